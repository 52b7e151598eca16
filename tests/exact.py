"""Helpers of the bit-identity tests: a plain-llama.cpp greedy reference and the paged run that must
reproduce it exactly at a small arena (docs/DESIGN.md §3: paging changes where weights come from, never
the result). The fixtures built on them (``default_path``, ``ref``, ``mini_ref``) are in conftest.py."""
from __future__ import annotations

import numpy as np

import epqlab

N_STEPS = 8
THREADS = 1
PROMPT = "A CPU cache is a small, fast memory that sits between the processor and main memory. It keeps"


def greedy_ref(path):
    """``(prompt ids, Session.greedy_trace(...))`` of :data:`PROMPT` with plain llama.cpp (``pager=False``)."""
    with epqlab.Session(path, pager=False, n_threads=THREADS) as s:
        toks = s.tokenize(PROMPT)
        return toks, s.greedy_trace(toks, N_STEPS)


def small_arena(path, factor=1.5):
    """An arena of ``factor`` x the smallest that works (bytes): the pager must evict."""
    lay = epqlab.inspect(path)
    return int(epqlab.Pager.min_arena_bytes(lay) * factor)


def check_identical(path, ref, policy, prefetch, segment, pipeline=False, depth=1, min_precision=None, predictor=None,
                    route_log=None, policy_params=None, arena_factor=1.5):
    """Run the greedy trace paged at :func:`small_arena` with these knobs; assert prompt logits, step logits
    and tokens equal ``ref`` bit for bit, that the pager really paged, and that the knobs really ran.
    Returns the Session's stats."""
    toks, (rp, rs, rg) = ref
    with epqlab.Session(path, arena_bytes=small_arena(path, arena_factor), policy=policy, policy_params=policy_params, prefetch=prefetch,
                        read_segment_bytes=segment or None, io_threads=2, n_threads=THREADS,
                        pipeline_reads=pipeline, prefetch_depth=depth, prefetch_predictor=predictor,
                        prefetch_min_precision=min_precision if prefetch else None, route_log=route_log) as s:
        p, st, gen = s.greedy_trace(toks, N_STEPS)
        stats = s.stats
    assert np.array_equal(p, rp) and np.array_equal(st, rs) and gen == rg
    assert stats["misses"] > 0 and stats["evictions"] > 0  # a small arena: the pager really paged
    # pipelined reads really queued decode layers' misses (and only when on)
    assert (stats["pipelined_loads"] > 0) == pipeline
    if prefetch:
        # the prefetch really ran and was scored: otherwise this test would not test it
        assert stats["prefetch_units"] > 0 and stats["pred_layers"] > 0
        assert 0 < stats["pred_correct"] <= min(stats["pred_experts"], stats["pred_actual"])
    return stats
