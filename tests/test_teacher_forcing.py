"""Teacher-forced decode (``Session.generate(..., forced=)``): each fed token is an ordinary decode
pass, so its routes, hits and bytes equal those of the same tokens decoded one by one."""
from __future__ import annotations

import numpy as np
import pytest

import epqlab
from epqlab.data import heldout_texts
from exact import PROMPT, THREADS, small_arena


def _routes(path, tmp_path, name, run):
    with epqlab.Session(path, arena_bytes=small_arena(path), n_threads=THREADS, route_log=tmp_path / name) as s:
        out = run(s)
        return out, s.route_log(), s.stats


def test_forced_routes_equal_stepwise_decode(default_path, tmp_path):
    """Greedy-decode N tokens step by step (greedy_trace), then feed those tokens teacher-forced:
    every (token, layer) expert choice, the hit count and the bytes read are the same."""
    n = 10

    def trace(s):
        toks = s.tokenize(PROMPT)
        return toks, s.greedy_trace(toks, n)[2]

    (toks, gen), log_a, st_a = _routes(default_path, tmp_path, "a.npz", trace)
    g, log_b, st_b = _routes(default_path, tmp_path, "b.npz", lambda s: s.generate(toks, n, forced=gen))
    assert g.tokens == gen and g.stats["teacher_forced"] is True
    assert g.stats["decode_passes"] == n - 1
    assert log_a.experts.shape == log_b.experts.shape == (len(toks) + n - 1, len(log_a.layers), 3)
    assert np.array_equal(log_a.experts, log_b.experts)
    assert np.array_equal(log_a.phase, log_b.phase)
    for k in ("hits", "misses", "bytes_read"):
        assert st_a[k] == st_b[k], k


def test_forced_text_is_fed_not_sampled(default_path):
    """The forced text's tokens (no BOS) are the generated tokens; a sampled run gives others."""
    text = heldout_texts()["prose"][:400]
    with epqlab.Session(default_path, pager=False, n_threads=THREADS) as s:
        want = s.tokenize(text, add_special=False)[:12]
        g = s.generate(PROMPT, 12, forced=text)
        free = s.generate(PROMPT, 12)
        with pytest.raises(ValueError, match="forced is empty"):
            s.generate(PROMPT, 4, forced="")
        with pytest.raises(ValueError, match="forced is empty"):
            s.generate(PROMPT, 4, forced=[])
    assert g.tokens == want and g.finish_reason == "length"
    assert free.tokens != want and free.stats["teacher_forced"] is False
    short = want[:3]
    with epqlab.Session(default_path, pager=False, n_threads=THREADS) as s:
        assert s.generate(PROMPT, 12, forced=short).tokens == short  # min(n_predict, len(forced))


@pytest.mark.parametrize("time_split", [True, False])
def test_graph_pieces_per_decode_pass(default_path, time_split):
    """With every expert resident, a decode pass is split where the hook must look: after each MoE
    layer's router top-k, plus (time split on) after each layer's last expert matmul -- counted by hand:
    30 MoE layers -> 60 pieces, or 30 without the time split."""
    lay = epqlab.inspect(default_path)
    n_layers = len(lay.layers)
    with epqlab.Session(default_path, arena_bytes=epqlab.Pager.all_experts_bytes(lay), n_threads=THREADS,
                        time_split=time_split) as s:
        toks = s.tokenize(PROMPT)
        s.greedy_trace(toks, 4)  # every expert these tokens use is now resident
        g = s.generate(toks, 6, forced=s.greedy_trace(toks, 6)[2])
        assert g.stats["decode_hit_rate"] == 1.0
        assert g.stats["decode_graph_pieces_per_pass"] == n_layers * (2 if time_split else 1)
        assert bool(g.stats["time_split"]) == time_split
