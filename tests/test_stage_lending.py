"""Stage lending (native/pager/pager.h ``lend``; docs/DESIGN.md §3 item 8): a ubatch whose expert union
overflows a layer's slots is staged matrix by matrix, and under a ram_budget the staged pages come out of the
arena (its slots' memfd pages punched out, free slots first, then residents evicted) instead of a reserve the
size of a whole expert matrix kept idle beside it. The logits stay plain llama.cpp's, the arena's pages drop by
exactly the bytes lent, and everything lent comes back before the next load."""
from __future__ import annotations

import numpy as np
import pytest

import epqlab
from epqlab.engine.arena_sizing import plan_arena
from exact import THREADS, greedy_ref

ARENA = 2_000_000  # tests/test_slot_addressing.py: a fraction of the tiny model's experts; a prompt's union overflows


@pytest.fixture(scope="module")
def tiny_ref(tiny_gguf):
    return greedy_ref(tiny_gguf)


@pytest.mark.parametrize("addressing", ["slots", "region"])
@pytest.mark.parametrize("pipeline", [False, True])
def test_lending_is_bit_identical_and_gives_everything_back(tiny_gguf, tiny_ref, addressing, pipeline):
    toks, (rp, rs, rg) = tiny_ref
    with epqlab.Session(tiny_gguf, arena_bytes=ARENA, expert_addressing=addressing, n_threads=THREADS,
                        io_threads=2, pipeline_reads=pipeline, io_uring=True) as s:
        native = s.pager.native
        native.stage_lending = True
        p, st, gen = s.greedy_trace(toks, 8)
        stats = s.stats
        assert native.lent_bytes == 0  # given back at the end of the decode
        assert s.pager.arena_resident_bytes == s.pager.arena_bytes  # and allocated again (reads never allocate)
    assert np.array_equal(p, rp) and np.array_equal(st, rs[:8]) and gen == rg[:8]
    assert stats["staged_layers"] > 0
    assert stats["stage_lends"] > 0 and stats["stage_lent_bytes"] > 0
    if addressing == "slots":  # reads land in the registered arena: lending unpins and re-pins its chunks
        assert stats["io_uring"] == "registered buffers" and stats["fixed_reads"] > 0, stats["io_uring"]


def _tiny_pager(tiny_gguf):
    lay = epqlab.inspect(tiny_gguf)
    return lay, epqlab.Pager(lay, ARENA, io_threads=2)


def _slot_bytes(n, pred) -> int:
    """Bytes of the slots whose state [class, MoE layer index, expert, pinned, hot] satisfies pred."""
    return sum(n.class_slot_bytes[st[0]] for st in n.slot_states() if pred(st))


def test_lend_takes_free_slots_then_residents_and_punches_their_pages(tiny_gguf):
    lay, pg = _tiny_pager(tiny_gguf)
    n = pg.native
    q4 = [l.layer for l in lay.layers][:2]  # two Q4_K layers
    li0, li1 = pg._li(q4[0]), pg._li(q4[1])
    pg.load_layer(q4[0], [0, 1, 2])
    pg.release_layer(q4[0])
    pg.load_layer(q4[1], [4, 5])
    pg.release_layer(q4[1])
    full = pg.arena_resident_bytes
    assert full == pg.arena_bytes
    kept = _slot_bytes(n, lambda st: st[1] == li1)
    # free slots alone cover a small loan: nobody is evicted
    got = n.lend(li1, np.array([4, 5], np.int32), 1)
    assert got > 0 and n.lent_bytes == got
    assert pg.arena_resident_bytes == full - got  # exactly the lent slots' pages are gone
    assert pg.stats["stage_lent_evictions"] == 0 and pg.stats["evictions"] == 0
    # everything but layer q4[1]'s two kept experts: every free slot, then the three other residents
    got = n.lend(li1, np.array([4, 5], np.int32), pg.arena_bytes - kept)
    assert got == pg.arena_bytes - kept
    assert pg.stats["evictions"] == pg.stats["stage_lent_evictions"] == 3
    assert pg.is_resident(q4[1], 4) and pg.is_resident(q4[1], 5)  # kept: the others sufficed
    assert not any(pg.is_resident(q4[0], e) for e in (0, 1, 2))
    assert pg.arena_resident_bytes == full - got
    n.unlend()
    assert n.lent_bytes == 0 and pg.arena_resident_bytes == full
    hits = pg.load_layer(q4[1], [4, 5, 6])  # the slots are usable again
    assert hits.tolist() == [True, True, False]
    pg.release_layer(q4[1])
    # the kept experts go too when nothing else is left
    got = n.lend(li1, np.array([4, 5], np.int32), pg.arena_bytes)
    assert got == pg.arena_bytes and pg.arena_resident_bytes == 0
    assert not pg.is_resident(q4[1], 4)
    n.unlend()


def test_lend_refuses_what_pinned_experts_hold_and_lends_nothing(tiny_gguf):
    lay, pg = _tiny_pager(tiny_gguf)
    li = lay.layers[0].layer
    pg.load_layer(li, [0, 1])  # pinned until released
    with pytest.raises(epqlab.ArenaTooSmall, match="staging needs"):
        pg.native.lend(pg._li(li), np.zeros(0, np.int32), pg.arena_bytes)
    assert pg.native.lent_bytes == 0 and pg.arena_resident_bytes == pg.arena_bytes
    assert pg.is_resident(li, 0) and pg.is_resident(li, 1)
    pg.release_layer(li)


def test_stage_need_counts_the_pages_a_staged_matrix_touches(tiny_gguf):
    lay, pg = _tiny_pager(tiny_gguf)
    page = 4096
    for i, l in enumerate(lay.layers):
        ids = [0, 3, 5]
        want = 0
        for t in l.tensors:  # hand count: each expert's whole pages, a page shared by two counted once
            eb = t.n_bytes // lay.n_expert
            pages = set()
            for e in ids:
                a, b = t.offset + e * eb, t.offset + (e + 1) * eb
                pages |= set(range(a // page, -(-b // page)))
            want = max(want, len(pages) * page)
        assert pg.native.stage_need(i, np.array(ids, np.int32)) == want


def test_budget_plan_holds_no_staging_reserve(tiny_gguf):
    lay = epqlab.inspect(tiny_gguf)
    stage, low = epqlab.Pager.max_stage_bytes(lay), epqlab.Pager.min_arena_bytes(lay)
    used = 50 * 2**20
    plan = plan_arena(lay, 2, budget=used + 3 * stage, used_before_arena=used, reserve=0)
    assert plan.stage_reserve == 0 and plan.stage_lend and plan.arena == 3 * stage
    # the smallest arena is the larger of one layer's top-k and one staged matrix, not their sum
    need = max(stage, low)
    assert plan_arena(lay, 2, budget=used + need, used_before_arena=used, reserve=0).arena == need
    with pytest.raises(epqlab.ArenaTooSmall, match="staged expert matrix"):
        plan_arena(lay, 2, budget=used + need - 4096, used_before_arena=used, reserve=0)
