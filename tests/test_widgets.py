"""epqlab.widgets.ArenaView driven headlessly: its slot picture follows the pager's (checked through the
pager's own is_resident and resident count), and its hit rate and SSD bytes per token equal the run's stats."""
from __future__ import annotations

import pytest

import epqlab

pytest.importorskip("ipywidgets")


def test_arena_view_follows_the_pager(default_model_path):
    from epqlab.widgets import ArenaView

    lay = epqlab.inspect(default_model_path)
    arena = int(0.3 * epqlab.Pager.all_experts_bytes(lay))
    with epqlab.Session(default_model_path, arena_bytes=arena, n_threads=1, n_ctx=256) as s:
        view = ArenaView(s)
        pg = s.pager
        assert view.state["resident"] == 0 and view.state["free"] == view.state["slots"] == pg.n_slots
        empty_html = view.grid.value
        stream = s.stream("A CPU cache is a small, fast memory that", 8)
        snaps = []
        for _ in view.watch(stream):
            st = view.state
            snaps.append((st["requests"], st["resident"], view.grid.value))
            # the picture is the pager's: every expert drawn in the arena is resident there, and no other
            drawn = {(b, e) for b, row in st["layers"].items() for e, x in enumerate(row) if x != "absent"}
            truth = {(b, e) for b in lay.moe_layers for e in range(lay.n_expert) if pg.is_resident(b, e)}
            assert drawn == truth
            assert st["resident"] == len(truth) == pg.stats["resident"]
            assert st["resident"] + st["free"] == pg.n_slots and st["pinned"] <= st["resident"]
        g = stream.result
        assert len(snaps) >= 2 and snaps[0][0] < snaps[-1][0]  # it updated while the stream ran
        assert snaps[-1][2] != empty_html and snaps[-1][1] > 0
        st = view.state
        assert st["tokens"] == len(g.tokens) == 8
        assert st["requests"] == g.stats["requests"] and st["hit_rate"] == pytest.approx(g.stats["hit_rate"])
        assert st["ssd_bytes"] == g.stats["ssd_bytes"] > 0
        assert st["ssd_mb_per_token"] == pytest.approx(g.stats["ssd_bytes"] / 1e6 / 8)
        assert view.grid.value.count("expert ") == lay.n_expert * len(lay.moe_layers)
        assert "text/plain" in view._repr_mimebundle_() or view._repr_mimebundle_()
    with epqlab.Session(default_model_path, pager=False, n_threads=1, n_ctx=256) as s0:
        with pytest.raises(ValueError, match="pager=True"):
            ArenaView(s0)
