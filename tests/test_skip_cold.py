"""Lossy skip-cold: the pager's zero overlay keeps every neighbour's bytes and is undone at release;
in a Session, tau = 0 is bit-identical to off, tau > 0 skips experts and reads fewer bytes."""
from __future__ import annotations

import ctypes
import os

import numpy as np
import pytest

import epqlab
from ggufs import tiny_slices_model, two_class_model

PAGE = os.sysconf("SC_PAGESIZE")


def page_perms(addr: int) -> str:
    """Permissions ('r--p', '---p', 'rw-s', ...) of the mapping holding ``addr``, from /proc/self/maps."""
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= addr < hi:
                return line.split()[1]
    raise AssertionError(f"address {addr:#x} is not mapped")


def slice_addr(pager, layout, layer, ti, e) -> int:
    t = layout.layer(layer).tensors[ti]
    return pager.native.tensor_data(pager._li(layer), ti) + e * t.expert_bytes


@pytest.mark.parametrize("build", [two_class_model, tiny_slices_model], ids=lambda b: b.__name__)
def test_zero_overlay_keeps_neighbours(tmp_path, build):
    """Skipped experts read as zeros; resident neighbours sharing their boundary pages still read the
    file's bytes, during the overlay and after release; interior pages go back to PROT_NONE."""
    w = build(tmp_path / "m.gguf")
    layout = epqlab.inspect(w.path)
    pager = epqlab.Pager(layout, epqlab.Pager.all_experts_bytes(layout))
    layer = layout.moe_layers[0]
    l = layout.layer(layer)
    resident = [0, 2, 3]            # 1 sits between two resident experts: both its boundary pages are shared
    skipped = [1, 4, 6]             # 4 touches resident 3 on one side; 6 has no resident neighbour
    pager.load_layer(layer, resident)
    pager.zero_overlay(layer, skipped)
    shared = 0
    for ti, t in enumerate(l.tensors):
        nb = t.expert_bytes
        for e in skipped:
            got = ctypes.string_at(slice_addr(pager, layout, layer, ti, e), nb)
            assert got == bytes(nb), (t.name, e)
            assert w.expert_slice(t.name, e) != bytes(nb)  # the file's bytes are not zeros
        for e in resident:
            assert pager.read_expert(layer, ti, e) == w.expert_slice(t.name, e), (t.name, e)
        # Count boundary pages that a skipped and a resident expert share (the case this test is about).
        for e in skipped:
            for nbr in (e - 1, e + 1):
                if nbr in resident:
                    a0, a1 = t.offset + e * nb, t.offset + (e + 1) * nb
                    b0, b1 = t.offset + nbr * nb, t.offset + (nbr + 1) * nb
                    shared += bool(set(range(a0 // PAGE, (a1 - 1) // PAGE + 1)) & set(range(b0 // PAGE, (b1 - 1) // PAGE + 1)))
    assert shared > 0, "the model must have boundary pages shared by a skipped and a resident expert"
    # An interior page of expert 6 (touched by no resident expert) is the read-only zero page now.
    t = l.tensors[0]
    mid = slice_addr(pager, layout, layer, 0, 6) + t.expert_bytes // 2
    interior = all(not (set(range((t.offset + n * t.expert_bytes) // PAGE, (t.offset + (n + 1) * t.expert_bytes - 1) // PAGE + 1))
                        & {(t.offset + 6 * t.expert_bytes + t.expert_bytes // 2) // PAGE}) for n in resident)
    if interior:
        assert page_perms(mid) == "r--p"
    pager.release_layer(layer)
    for ti, t in enumerate(l.tensors):
        for e in resident:
            assert pager.read_expert(layer, ti, e) == w.expert_slice(t.name, e), (t.name, e)
    if interior:
        assert page_perms(mid) == "---p"  # back to PROT_NONE: not resident
    # The skipped experts load normally afterwards, with the file's bytes.
    assert not pager.load_layer(layer, skipped).any()
    for ti, t in enumerate(l.tensors):
        for e in skipped:
            assert pager.read_expert(layer, ti, e) == w.expert_slice(t.name, e), (t.name, e)
    with pytest.raises(ValueError, match="resident"):
        pager.zero_overlay(layer, [1])
    assert pager.stats["bytes_read"] > 0


def test_skip_cold_tau0_identical_and_tau_skips(default_model_path):
    """tau = 0 decodes bit-identically to off with the same pager counters; tau > 0 skips experts,
    reads fewer bytes, and skips only in single-token steps (the prompt's logits stay identical)."""
    from epqlab import Session

    lay = epqlab.inspect(default_model_path)
    arena = epqlab.Pager.all_experts_bytes(lay) // 2
    out = {}
    for tau in (None, 0.0, 0.6):
        with Session(default_model_path, arena_bytes=arena, skip_cold=tau, n_ctx=256) as s:
            toks = s.tokenize("The history of the printing press begins in")
            prompt_logits, steps, gen = s.greedy_trace(toks, 16)
            out[tau] = (prompt_logits, steps, gen, s.stats)
    off, zero, on = out[None], out[0.0], out[0.6]
    assert np.array_equal(off[0], zero[0]) and np.array_equal(off[1], zero[1]) and off[2] == zero[2]
    for key in ("requests", "hits", "misses", "bytes_read", "evictions"):
        assert off[3][key] == zero[3][key], key
    assert off[3]["cold_skipped"] == zero[3]["cold_skipped"] == 0
    assert on[3]["cold_skipped"] > 0
    assert on[3]["bytes_read"] < off[3]["bytes_read"]
    # Every single-token step requests k experts per layer; a skipped one is not requested. The
    # prefill is the same, so requests + skips with the knob on equal the requests with it off.
    assert on[3]["requests"] + on[3]["cold_skipped"] == off[3]["requests"]
    assert np.array_equal(off[0], on[0])       # prefill (many tokens per ubatch) is untouched
    assert not np.array_equal(off[1], on[1])   # the decode steps are not


def test_skip_cold_huge_tau_reads_nothing_in_decode(default_model_path):
    """With tau above every router weight, no decode step reads: the pager reads exactly what the
    prefill alone reads (a fresh session decoding 1 token vs 12), and every decode miss is a skip."""
    from epqlab import Session

    lay = epqlab.inspect(default_model_path)
    arena = epqlab.Pager.all_experts_bytes(lay) // 4
    got = []
    for n in (1, 12):
        # the largest tau there is: a weight is a router probability times the model's expert_weights_scale, 3
        with Session(default_model_path, arena_bytes=arena, skip_cold=3.0, n_ctx=256) as s:
            s.greedy_trace(s.tokenize("Once upon a time"), n)
            got.append(s.stats)
    assert got[1]["bytes_read"] == got[0]["bytes_read"] and got[1]["misses"] == got[0]["misses"]
    assert got[0]["cold_skipped"] == 0 and got[1]["cold_skipped"] > 0
    # 11 decode steps x 30 layers x k: each selected expert is either a hit or a skip
    k, L = lay.n_expert_used, len(lay.layers)
    assert (got[1]["requests"] - got[0]["requests"]) + got[1]["cold_skipped"] == 11 * L * k


def test_skip_cold_bad_values(default_model_path):
    from epqlab import Session

    with pytest.raises(ValueError, match="skip_cold"):
        Session(default_model_path, skip_cold=-0.1)
    with pytest.raises(ValueError, match=r"tau in 0\.\.3 "):
        Session(default_model_path, skip_cold=1e9)
    with pytest.raises(ValueError, match="pager"):
        Session(default_model_path, skip_cold=0.1, pager=False)
