"""Hiding I/O behind compute (docs/DESIGN.md §3c): prefetch and segment-parallel reads change timing only
(logits bit-identical to plain llama.cpp for every policy at small arenas); a wrong prediction
never evicts a pinned expert nor the prediction's own resident experts; the time split's parts
come from their own timestamps and an injected read delay lands in the I/O part."""
from __future__ import annotations

import os

import numpy as np
import pytest

import epqlab
import epqlab.models
from epqlab.constants import ONLINE_POLICIES
from exact import N_STEPS, THREADS, check_identical, small_arena
from ggufs import two_class_model

@pytest.mark.parametrize("policy", ONLINE_POLICIES)
@pytest.mark.parametrize("pipeline", [False, True])
def test_prefetch_keeps_logits_bit_identical_every_policy(mini_gguf, mini_ref, policy, pipeline):
    """Every online policy with the union predictor and segmented reads, on the 4-layer mini model,
    with and without pipelined (matrix-by-matrix) reads."""
    check_identical(mini_gguf, mini_ref, policy, "union", 4096, pipeline)


@pytest.mark.parametrize("prefetch,segment,pipeline", [("lookahead", 0, False), ("previous", 8192, False),
                                                       (None, 0, True), ("lookahead", 65536, True)])
def test_prefetch_keeps_logits_bit_identical_default_model(default_path, ref, prefetch, segment, pipeline):
    st = check_identical(default_path, ref, "lru", prefetch, segment, pipeline)
    if prefetch == "lookahead":  # the router lookahead is a real predictor on a trained model
        assert st["pred_correct"] / st["pred_experts"] > 0.5


def test_prefetch_knob_errors(mini_gguf):
    with pytest.raises(ValueError, match="exclusive"):
        epqlab.Session(mini_gguf, prefetch="union", skip_cold=0.1)
    with pytest.raises(ValueError, match="unknown prefetch"):
        epqlab.Session(mini_gguf, prefetch="belady")
    with pytest.raises(ValueError, match="needs the pager"):
        epqlab.Session(mini_gguf, prefetch="previous", pager=False)
    with pytest.raises(ValueError, match="prefetch_budget needs"):
        epqlab.Session(mini_gguf, prefetch_budget=1 << 20)
    with pytest.raises(ValueError, match="pipeline_reads and skip_cold are exclusive"):
        epqlab.Session(mini_gguf, pipeline_reads=True, skip_cold=0.1)
    with pytest.raises(ValueError, match="pipeline_reads needs the pager"):
        epqlab.Session(mini_gguf, pipeline_reads=True, pager=False)
    # the default follows skip_cold: on without it, off with it
    with epqlab.Session(mini_gguf, n_threads=THREADS) as s:
        assert s.pipeline_reads
    with epqlab.Session(mini_gguf, skip_cold=0.1, n_threads=THREADS) as s:
        assert not s.pipeline_reads


@pytest.mark.parametrize("segment", [0, 4096])
def test_wrong_prefetch_never_evicts_pinned_or_predicted(tmp_path, segment):
    """A route log built for it: tokens use experts 0..3 only; every prediction for layer l+1 is
    experts 4..7 (always wrong) plus one of l+1's resident experts (which the prefetch must keep).
    The arena holds k + 3 slots, so the prefetch must evict to make room, and may take only
    unpinned, unpredicted experts."""
    w = two_class_model(tmp_path / "m.gguf")
    lay = epqlab.inspect(w.path)
    k = lay.n_expert_used
    blocks = lay.moe_layers
    slot = max(epqlab.Pager.unit_slot_bytes(lay))
    p = epqlab.Pager(lay, k * slot + 3 * slot, io_threads=2, policy="lru")
    p.read_segment_bytes = segment
    rng = np.random.default_rng(0)
    route = np.stack([[rng.choice(4, k, replace=False) for _ in blocks] for _ in range(12)]).astype(np.int32)
    issued = 0
    for t in range(len(route)):
        p.begin_pass()
        for i, b in enumerate(blocks):
            if i:
                p.release_layer(blocks[i - 1])
            p.load_layer(b, route[t, i])
            assert all(p.is_resident(b, e) for e in route[t, i])
            if i + 1 < len(blocks):
                nb = blocks[i + 1]
                keep = [e for e in range(4) if p.is_resident(nb, e)][:1]
                issued += p.prefetch(nb, [4, 5, 6, 7] + keep)
                p.prefetch_finish()
                # pinned (this layer's) experts and the prediction's resident one survived
                assert all(p.is_resident(b, e) for e in route[t, i]), (t, b)
                assert all(p.is_resident(nb, e) for e in keep), (t, nb)
        p.release_layer(blocks[-1])
    st = p.stats
    assert issued > 0 and st["prefetch_units"] == issued
    assert st["prefetch_used"] == 0 and st["prefetch_used_bytes"] == 0  # experts 4..7 are never requested
    assert st["prefetch_bytes"] > 0
    # what a prefetch made resident holds the file's bytes (mapping and segments are right)
    for b in blocks:
        for e in range(lay.n_expert):
            if p.is_resident(b, e):
                for ti, t in enumerate(lay.layers[blocks.index(b)].tensors):
                    assert p.read_expert(b, ti, e) == w.expert_slice(t.name, e)


def test_right_prefetch_turns_misses_into_hits(tmp_path):
    w = two_class_model(tmp_path / "m.gguf")
    lay = epqlab.inspect(w.path)
    b = lay.moe_layers[1]
    p = epqlab.Pager(lay, epqlab.Pager.all_experts_bytes(lay), io_threads=2)
    assert p.prefetch(b, [3, 5]) == 2
    assert p.load_layer(b, [5, 3]).all()  # both hits: the load waited for the prefetch, read nothing more
    st = p.stats
    page = os.sysconf("SC_PAGESIZE")
    want = sum(-(-(t.offset + (e + 1) * t.expert_bytes) // page) * page - (t.offset + e * t.expert_bytes) // page * page
               for e in (3, 5) for t in lay.layers[1].tensors)  # whole pages each slice spans
    assert st["bytes_read"] == st["prefetch_bytes"] == st["prefetch_used_bytes"] == want
    assert st["prefetch_used"] == 2 and st["misses"] == 0
    for ti, t in enumerate(lay.layers[1].tensors):
        assert p.read_expert(b, ti, 5) == w.expert_slice(t.name, 5)


def test_time_split_parts_and_injected_read_delay(mini_gguf, mini_ref):
    path = mini_gguf
    toks = mini_ref[0][:8]
    n = 6
    out = {}
    for delay in (0, 2000):
        with epqlab.Session(path, arena_bytes=small_arena(path, 1.0), io_threads=1,
                            n_threads=THREADS) as s:
            s.pager.read_delay_us = delay
            s.generate(toks, n)
            c0 = s.pager.stats
            s.reset_stats()
            g = s.generate(toks, n)
            pst = s.pager.stats
            df = s.time_split("token")
            lay_df = s.time_split("layer")
        d = df[df.n_tokens == 1]
        assert len(d) == n - 1 and len(df) == len(lay_df) / len(epqlab.inspect(path).layers)
        parts = ["attn_us", "expert_us", "io_us", "map_us", "predict_us"]
        # "other" is the remainder, nothing else: recompute it
        assert (df.other_us == df.wall_us - df[parts].sum(axis=1)).all()
        # compute parts come from ggml's pieces: present in every decode step and every layer
        assert (d.attn_us > 0).all() and (d.expert_us > 0).all() and (d.io_us > 0).all() and (d.map_us > 0).all()
        assert (lay_df[lay_df.n_tokens == 1].expert_us > 0).all()
        # the I/O part is the pager's own wait clock, layer by layer summed: equal to its counter
        assert df.io_us.sum() == pst["io_wait_us"] and df.map_us.sum() == pst["map_us"]
        assert (df[parts] >= 0).all().all() and (df.other_us >= 0).all()
        out[delay] = (d, pst, g.stats)
    d0, d1 = out[0][0], out[2000][0]
    # one read per (missed expert, tensor), each sleeping 2 ms, on one I/O thread (run inline)
    n_tensors = len(epqlab.inspect(path).layers[0].tensors)
    reads = out[2000][1]["misses"] * n_tensors
    decode_reads_delay_us = reads * 2000 * len(d1) / (len(d1) + 1)  # prefill pass's share removed (approx.)
    assert d1.io_us.sum() - d0.io_us.sum() >= 0.8 * decode_reads_delay_us
    # the device-busy clock (>= 1 read in progress) sees the same sleeps, and never exceeds the wall time
    assert d1.io_busy_us.sum() >= 0.8 * decode_reads_delay_us
    assert (d1.io_busy_us <= d1.wall_us).all() and (d0.io_busy_us <= d0.wall_us).all()
    # and it did not leak into the compute parts
    comp0 = (d0.attn_us + d0.expert_us).sum()
    comp1 = (d1.attn_us + d1.expert_us).sum()
    assert comp1 - comp0 < 0.25 * (d1.io_us.sum() - d0.io_us.sum())
    assert out[2000][2]["time_split"]["io_ms"] > out[0][2]["time_split"]["io_ms"]


def test_mispredicted_reads_not_started_are_cancelled(tmp_path):
    """At the request, reads of predicted experts the router did not pick that no I/O thread has
    started are cancelled (slow reads keep them queued): the wait is only for what is needed."""
    w = two_class_model(tmp_path / "m.gguf")
    lay = epqlab.inspect(w.path)
    b = lay.moe_layers[0]
    p = epqlab.Pager(lay, epqlab.Pager.all_experts_bytes(lay), io_threads=1)
    p.read_delay_us = 20_000
    assert p.prefetch(b, [0, 1, 2, 3, 4, 5]) == 6
    p.load_layer(b, [0, 6])  # 0 was predicted (first, so already being read), 6 was not
    st = p.stats
    assert st["prefetch_cancelled"] >= 4 and st["prefetch_used"] == 1 and st["misses"] == 1
    assert p.is_resident(b, 0) and p.is_resident(b, 6)
    assert not any(p.is_resident(b, e) for e in (2, 3, 4, 5))
    for ti, t in enumerate(lay.layers[0].tensors):
        assert p.read_expert(b, ti, 0) == w.expert_slice(t.name, 0)


def test_segment_from_probe_hand_computed():
    import pandas as pd

    from epqlab.paging.read_segments import segment_from_probe

    # concurrency 4: 64 KiB reaches 400 of 1.9 MB's 420 MB/s (>= 90%), 4 KiB only 40
    df = pd.DataFrame({"request_bytes": [4096, 65536, 1_900_000] * 2, "concurrency": [1, 1, 1, 4, 4, 4],
                       "mb_s": [7, 100, 250, 40, 400, 420]})
    # 2 slices of 1.67 MB over 4 threads: ceil(2 * 1_670_000 / 4) = 835_000 -> 204 pages = 835_584
    assert segment_from_probe(df, 1_670_000, 2, 4) == 835_584
    # 1 small slice: want 25_000 B, but nothing below 64 KiB is efficient -> 64 KiB >= slice -> no split
    assert segment_from_probe(df, 50_000, 2, 4) == 0
    # as many reads as threads: no split
    assert segment_from_probe(df, 1_670_000, 4, 4) == 0
    # 6 threads (nearest probed concurrency below: 4): ceil(1_670_000 / 6) = 278_334 -> 68 pages
    assert segment_from_probe(df, 1_670_000, 1, 6) == 68 * 4096
    with pytest.raises(ValueError):
        segment_from_probe(df, 0, 1, 4)


@pytest.mark.parametrize("prefetch", [None, "lookahead"])
def test_pipelined_read_error_raises_and_session_recovers(default_path, ref, prefetch):
    """A read that fails inside a pipelined layer (matrix-by-matrix waits) surfaces as PagerIOError
    from the call, leaves nothing half-read resident, and the same session then decodes exactly
    as plain llama.cpp. With a one-token prompt every pass is single-token, so every layer load
    takes the pipelined path; a fault that lands on a prefetch read instead is absorbed (the
    demand read redoes it) and counted as a failed prefetch."""
    import errno

    toks, (rp, rs, rg) = ref
    with epqlab.Session(default_path, arena_bytes=small_arena(default_path), pipeline_reads=True,
                        prefetch=prefetch, io_threads=2, n_threads=THREADS) as s:
        s.generate(toks[:1], 3)
        s.pager.inject_fault(40, errno.EIO)
        raised = False
        try:
            s.generate(toks[:1], 6)
        except epqlab.PagerIOError as e:
            raised = True
            assert "Input/output error" in str(e)
        failed = s.pager.stats["prefetch_failed"]
        assert raised or (prefetch and failed > 0)
        if not prefetch:
            assert raised
        assert s.stats["pipelined_loads"] > 0
        p, st, gen = s.greedy_trace(toks, N_STEPS)
    assert np.array_equal(p, rp) and np.array_equal(st, rs) and gen == rg


@pytest.mark.parametrize("pipeline,prefetch", [(True, None), (False, None), (True, "lookahead")])
def test_failed_expert_mmap_raises_and_session_recovers(default_path, ref, pipeline, prefetch):
    """An mmap of an expert slice that fails (ENOMEM, as when vm.max_map_count runs out) at any point
    of a layer -- first, middle or last matrix of a pipelined load, a synchronous load, a prefetched
    expert mapped by an I/O thread -- raises a clear error or is absorbed, never leaves an expert
    counted resident with unmapped pages (that would crash on the next token) and never loses a
    neighbour's boundary page: the same session then decodes exactly as plain llama.cpp."""
    toks, (rp, rs, rg) = ref
    lay = epqlab.inspect(default_path)
    n_tensors = len(lay.layers[0].tensors)
    for nth in (1, n_tensors, n_tensors + 1, 3 * n_tensors, 7 * n_tensors - 1):
        with epqlab.Session(default_path, arena_bytes=small_arena(default_path, 1.3), pipeline_reads=pipeline,
                            prefetch=prefetch, io_threads=2, n_threads=THREADS) as s:
            s.generate(toks[:1], 2)
            s.pager.inject_map_fault(nth)
            try:
                s.generate(toks[:1], 4)
            except RuntimeError as e:
                assert "mmap of an expert slot failed" in str(e) and "max_map_count" in str(e)
            s.pager.inject_map_fault(0)
            p, st, gen = s.greedy_trace(toks, N_STEPS)
        assert np.array_equal(p, rp) and np.array_equal(st, rs) and gen == rg, nth
