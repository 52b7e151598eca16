"""Prefetch batches of several layers in flight at once, prefetch depth, and victims' deferred
unmaps (docs/DESIGN.md §3 item 4): the region keeps its invariant (a page no resident expert touches is
PROT_NONE once its slot was rewritten, read from /proc/self/maps), batches of later layers keep
reading while a layer loads, a demand load that finds no victim waits for them instead of
failing, and logits stay bit-identical to plain llama.cpp with depth 2."""
from __future__ import annotations

import bisect
import os

import numpy as np
import pytest

import epqlab
import epqlab.models
from ggufs import aligned_model, tiny_slices_model, two_class_model
from exact import check_identical

PAGE = os.sysconf("SC_PAGESIZE")


def _maps():
    """(starts, rows): this process's mappings from /proc/self/maps, sorted by start address."""
    rows = []
    with open("/proc/self/maps") as f:
        for line in f:
            a, perms = line.split()[:2]
            lo, hi = (int(x, 16) for x in a.split("-"))
            rows.append((lo, hi, perms))
    rows.sort()
    return [r[0] for r in rows], rows


def _perms(maps, addr):
    starts, rows = maps
    i = bisect.bisect_right(starts, addr) - 1
    lo, hi, perms = rows[i]
    assert lo <= addr < hi, hex(addr)
    return perms


def check_region_invariant(p: epqlab.Pager, lay):
    """Every page of every expert tensor's region: mapped shared from the arena ("rw-s") when a
    resident expert's slice touches it, PROT_NONE ("---p") otherwise. Returns the pages checked."""
    maps = _maps()
    n = 0
    for l in lay.layers:
        li = p._li(l.layer)
        for ti, t in enumerate(l.tensors):
            first = t.offset // PAGE
            region = p._p.tensor_data(li, ti) - (t.offset - first * PAGE)
            last = -(-(t.offset + lay.n_expert * t.expert_bytes) // PAGE)
            touched = set()
            for e in range(lay.n_expert):
                if p.is_resident(l.layer, e):
                    a = t.offset + e * t.expert_bytes
                    touched.update(range(a // PAGE, -(-(a + t.expert_bytes) // PAGE)))
            for pg in range(first, last):
                want = "rw-s" if pg in touched else "---p"
                assert _perms(maps, region + (pg - first) * PAGE) == want, (l.layer, t.name, pg, want)
                n += 1
    return n


@pytest.mark.parametrize("build", [two_class_model, aligned_model, tiny_slices_model], ids=lambda b: b.__name__)
def test_evicted_pages_are_prot_none_after_their_slot_is_rewritten(tmp_path, build):
    """Victims' unmaps are deferred to the reads that rewrite their slots (or to the next mapping
    of them or a neighbour); after each load and each finished prefetch every one of them ran."""
    w = build(tmp_path / "m.gguf")
    lay = epqlab.inspect(w.path)
    k = lay.n_expert_used
    p = epqlab.Pager(lay, int(epqlab.Pager.min_arena_bytes(lay) * 2), io_threads=2)
    rng = np.random.default_rng(3)
    blocks = lay.moe_layers
    for step in range(40):
        b = blocks[step % len(blocks)]
        p.load_layer(b, rng.choice(lay.n_expert, size=k, replace=False))
        assert check_region_invariant(p, lay) > 0
        nb = blocks[(step + 1) % len(blocks)]
        p.prefetch(nb, rng.choice(lay.n_expert, size=k, replace=False))
        p.prefetch_finish()
        check_region_invariant(p, lay)
        p.release_layer(b)
    assert p.stats["evictions"] > 20  # the arena really turned over
    assert p.stats["evict_unmap_io_us"] > 0  # and the victims' unmaps ran on the I/O threads


def _expected_bytes(w, lay, p):
    for l in lay.layers:
        for e in range(lay.n_expert):
            if p.is_resident(l.layer, e):
                for ti, t in enumerate(l.tensors):
                    assert p.read_expert(l.layer, ti, e) == w.expert_slice(t.name, e), (l.layer, t.name, e)


def test_later_layers_batches_read_on_while_a_layer_loads(tmp_path):
    """Batches for layers 1 and 2 are started before layer 0 loads: layer 0's load finishes
    neither; layer 1's request finishes only layer 1's, and its prefetched experts are hits."""
    w = two_class_model(tmp_path / "m.gguf")
    lay = epqlab.inspect(w.path)
    b0, b1, b2 = lay.moe_layers[:3]
    p = epqlab.Pager(lay, epqlab.Pager.all_experts_bytes(lay), io_threads=2)
    assert p.prefetch(b1, [1, 2]) == 2 and p.prefetch(b2, [3, 4]) == 2
    assert p.load_layer(b0, [0, 5]).tolist() == [False, False]
    assert p.prefetch_active  # layers 1 and 2 still in flight (or done but not finished)
    p.release_layer(b0)
    assert p.load_layer(b1, [2, 1]).all()
    assert p.prefetch_active  # layer 2's batch
    p.release_layer(b1)
    assert p.load_layer(b2, [4, 3]).all()
    assert not p.prefetch_active
    st = p.stats
    assert st["prefetch_used"] == 4 and st["misses"] == 2 and st["hits"] == 4
    assert st["prefetch_bytes"] == st["prefetch_used_bytes"] > 0
    _expected_bytes(w, lay, p)


def test_demand_load_waits_for_batches_instead_of_failing(tmp_path):
    """An arena of k + 2 slots: two batches take every free slot, so layer 0's misses find no
    victim (in-flight experts are none, a batch's resident predictions neither); the load must
    finish the batches and evict, not raise ArenaTooSmall."""
    w = aligned_model(tmp_path / "m.gguf")
    lay = epqlab.inspect(w.path)
    k = lay.n_expert_used
    b0, b1, b2 = lay.moe_layers[:3]
    slot = max(epqlab.Pager.unit_slot_bytes(lay))
    p = epqlab.Pager(lay, (k + 2) * slot, io_threads=2)
    p.read_delay_us = 20000  # the batches are surely still reading when layer 0 asks
    issued = p.prefetch(b1, [0, 1]) + p.prefetch(b2, [0, 1, 2, 3])
    assert issued == k + 2  # every slot taken; the rest of b2's prediction stopped quietly
    p.read_delay_us = 0
    p.load_layer(b0, [4, 5])
    assert all(p.is_resident(b0, e) for e in (4, 5))
    assert not p.prefetch_active
    _expected_bytes(w, lay, p)
    check_region_invariant(p, lay)


@pytest.mark.parametrize("policy", ["lru", "ls_pos", "fnu"])
def test_depth_two_keeps_logits_bit_identical(mini_gguf, mini_ref, policy):  # noqa: F811
    st = check_identical(mini_gguf, mini_ref, policy, "union", 0, True, depth=2)
    assert st["pipelined_early"] > 0  # some layer's misses were queued while its batch still read


def test_depth_two_default_model(default_path, ref):  # noqa: F811
    st = check_identical(default_path, ref, "lru", "lookahead", 0, True, depth=2)
    assert st["pred_correct"] / st["pred_experts"] > 0.5


def test_depth_knob_errors(mini_gguf):
    with pytest.raises(ValueError, match="prefetch_depth must be an int in 1..8"):
        epqlab.Session(mini_gguf, prefetch="lookahead", prefetch_depth=0)
    with pytest.raises(ValueError, match="prefetch_depth must be an int in 1..8"):
        epqlab.Session(mini_gguf, prefetch="lookahead", prefetch_depth=2.0)
    with pytest.raises(ValueError, match="prefetch_depth must be an int in 1..8"):
        epqlab.Session(mini_gguf, prefetch="lookahead", prefetch_depth=9)
    with pytest.raises(ValueError, match="prefetch_depth needs a predictor"):
        epqlab.Session(mini_gguf, prefetch_depth=2)


def test_gate_reads_fewer_and_predicts_the_same(default_path, ref):  # noqa: F811
    """The gate changes which predictions are read, never the predictions nor the logits: with
    min_precision 1 a rank closes at its first wrong non-resident prediction (an EMA that starts at
    1 never returns to it), so fewer experts are read than with the gate off, the predictor's
    scores are identical, and the closed ranks' predictions are counted as gated."""
    runs = {}
    for gate in (0.0, 1.0):
        st = check_identical(default_path, ref, "lru", "lookahead", 0, True, min_precision=gate)
        runs[gate] = st
    off, strict = runs[0.0], runs[1.0]
    assert off["pred_gated"] == 0 and strict["pred_gated"] > 0
    assert strict["prefetch_units"] < off["prefetch_units"]
    for k in ("pred_layers", "pred_experts", "pred_actual", "pred_correct"):
        assert strict[k] == off[k], k


def test_gate_knob_errors(mini_gguf):
    with pytest.raises(ValueError, match=r"prefetch_min_precision must be a number in \[0, 1\]"):
        epqlab.Session(mini_gguf, prefetch="lookahead", prefetch_min_precision=1.5)
    with pytest.raises(ValueError, match="prefetch_min_precision needs a predictor"):
        epqlab.Session(mini_gguf, prefetch_min_precision=0.5)
