"""Live arena resize (Session.resize, Pager.resize; docs/DESIGN.md §5 "Resizing the arena"): shrinking and
growing between decode steps leaves the logits plain llama.cpp's, gives the pages back to the OS at once (the
memfd's blocks, and a memory cgroup's charge, fall by the slots taken out), and refuses below the smallest
budget with the quote Session gives; the memory follower shrinks when headroom goes and grows back slowly."""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import psutil
import pytest

import epqlab
from epqlab.engine import arena_resize
from epqlab.engine.arena_resize import MemoryFollower, plan_for_budget
from epqlab.memory.limits import cgroup_unavailable_reason, run_limited
from exact import N_STEPS, PROMPT, THREADS, greedy_ref

HERE = Path(__file__).parent


def _open(path, **kw):
    """A paged Session whose opening budget gives an arena of every expert (so resize has room both ways)."""
    big = psutil.Process().memory_info().rss + 768 * 2**20
    return epqlab.Session(path, ram_budget=big, n_threads=THREADS, io_threads=2, **kw)


def _budget_for(s, arena_bytes: int) -> int:
    """The ram_budget that buys ``arena_bytes`` of arena in Session ``s``, computed here from the usage the
    Session measured at open (plan_arena's rule: arena = budget - usage - reserve - read buffers)."""
    return s.used_before_arena + s.reserve_bytes + s.read_buffer_bytes + arena_bytes


def _smallest_arena(lay, s=None) -> int:
    """The smallest arena a resize of ``s`` accepts (the budget's rule; slot addressing's, when on)."""
    least = s.pager.min_resize_bytes if s is not None else 0
    return max(epqlab.Pager.min_arena_bytes(lay), epqlab.Pager.max_stage_bytes(lay), least)


@pytest.mark.parametrize("model", ["tiny", "default", "tiny-io_uring"])
def test_resize_sequence_bit_identical(model, tiny_gguf, default_path):
    """Shrink, grow, shrink again between the tokens of one greedy stream: the tokens, and the logits of the
    whole sequence decoded afterwards at the last size, equal plain llama.cpp's bit for bit; after each resize
    the memfd holds exactly the slots in use (no page of a slot taken out stays allocated). With io_uring the
    registered chunks of slots taken out are unregistered before their pages go, and registered again."""
    path = default_path if model == "default" else tiny_gguf
    lay = epqlab.inspect(path)
    toks, (rp, rs, rg) = greedy_ref(path)
    with epqlab.Session(path, pager=False, n_threads=THREADS) as plain:
        ref_logits = plain.logits(toks + rg)
        ref_text = plain.detokenize(rg)
    with _open(path, io_uring=model.endswith("io_uring")) as s:
        if model.endswith("io_uring"):
            assert s.io_uring == "registered buffers", s.io_uring
        small = _smallest_arena(lay, s)
        sizes = [int(small * 1.2), epqlab.Pager.all_experts_bytes(lay), small, int(small * 1.6)]
        addressing = s.expert_addressing
        got, seen = [], []
        for i, t in enumerate(s.stream(toks, n_predict=N_STEPS, temperature=0.0)):
            got.append(t)
            if i < len(sizes):
                e = s.resize(_budget_for(s, sizes[i]))
                p = s.pager
                seen.append((e.arena_before, e.arena_after))
                assert p.arena_bytes <= sizes[i] and p.arena_resident_bytes == p.arena_bytes
        lg = s.logits(toks + rg)
        st = s.stats
    assert addressing == ("region" if model == "default" else "slots")  # both addressing modes are covered
    assert "".join(got) == ref_text
    assert np.array_equal(lg, ref_logits)
    assert st["resizes"] == len(sizes) and st["evictions"] > 0
    if model.endswith("io_uring"):
        assert st["fixed_reads"] > 0  # reads really went through the registered chunks
    assert seen[0][1] < seen[0][0] and seen[1][1] > seen[1][0] and seen[2][1] < seen[2][0]


def test_stream_tokens_equal_plain_across_resizes(default_path):
    """The generated ids themselves (greedy_trace between resizes) equal plain llama.cpp's."""
    lay = epqlab.inspect(default_path)
    toks, (rp, rs, rg) = greedy_ref(default_path)
    small = _smallest_arena(lay)
    with _open(default_path) as s:
        s.resize(_budget_for(s, small))
        p1, s1, g1 = s.greedy_trace(toks, N_STEPS)
        s.resize(_budget_for(s, 3 * small))
        p2, s2, g2 = s.greedy_trace(toks, N_STEPS)
    assert np.array_equal(p1, rp) and np.array_equal(s1, rs) and g1 == rg
    assert np.array_equal(p2, rp) and np.array_equal(s2, rs) and g2 == rg


def test_shrink_below_quote_refused(default_path):
    """Below the smallest arena: ArenaTooSmall with the quote Session gives; the arena is unchanged."""
    lay = epqlab.inspect(default_path)
    with _open(default_path) as s:
        before = s.pager.arena_bytes
        with pytest.raises(epqlab.ArenaTooSmall, match="The smallest budget that works is"):
            s.resize(_budget_for(s, _smallest_arena(lay) // 2))
        assert s.pager.arena_bytes == before and s.stats["resizes"] == 0
        assert s.generate(PROMPT, n_predict=2).stats["n_gen"] == 2  # still serving


def test_capacity_gives_room_to_grow(default_path):
    """A Pager made with room above its arena (Session's max_ram_budget) holds no pages there until resize
    grows into it; a resize above the room is refused; the Session's knobs are checked before the model loads."""
    lay = epqlab.inspect(default_path)
    allx = epqlab.Pager.all_experts_bytes(lay)
    p = epqlab.Pager(lay, 2 * epqlab.Pager.min_arena_bytes(lay), capacity_bytes=allx, io_threads=1)
    assert p.arena_resident_bytes == p.arena_bytes < p.capacity_bytes == allx
    block = lay.moe_layers[0]
    p.load_layer(block, [0, 1, 2])
    p.native.release_all()
    assert p.resize(allx) == allx == p.arena_resident_bytes
    with pytest.raises(ValueError, match="capacity"):
        p.resize(allx + 4096)
    big = psutil.Process().memory_info().rss + 768 * 2**20
    with pytest.raises(ValueError, match="below ram_budget"):
        epqlab.Session(default_path, ram_budget=big, max_ram_budget=big - 1)
    with pytest.raises(ValueError, match="needs a paged Session"):
        epqlab.Session(default_path, pager=False, follow_memory=True)
    with pytest.raises(ValueError, match="follow_memory must be"):
        epqlab.Session(default_path, ram_budget=big, follow_memory="yes")


def test_resize_needs_a_budget(default_path):
    with epqlab.Session(default_path, arena_bytes="1MiB", n_threads=THREADS) as s:
        with pytest.raises(ValueError, match="opened with ram_budget"):
            s.resize("2GiB")


def test_pager_resize_policy_victims_and_pages(default_path):
    """Pager level: a shrink with no free slot evicts the policy's victims (LRU: the least recently used
    residents go, the most recent stay) and the memfd's allocated bytes drop by exactly the slots taken out."""
    full = epqlab.inspect(default_path)
    sizes = epqlab.Pager.unit_slot_bytes(full)
    ub = min(sizes)  # the layers of one slot class only: the counts below are exact
    lay = dataclasses.replace(full, layers=[l for l, b in zip(full.layers, sizes) if b == ub])
    assert len(lay.layers) >= 2 and set(epqlab.Pager.unit_slot_bytes(lay)) == {ub}
    p = epqlab.Pager(lay, 12 * ub, policy="lru", io_threads=1)
    b0, b1 = lay.moe_layers[:2]
    order = [(b0, e) for e in range(8)] + [(b1, e) for e in range(4)]
    for blk, e in order:  # fill every slot, oldest first
        p.load_layer(blk, [e])
        p.native.release_all()

    def resident():
        st = p.slot_states()
        return sorted((int(l), int(e)) for l, e in zip(st["layer"], st["expert"]) if e >= 0)

    assert p.n_slots == 12 and p.arena_resident_bytes == 12 * ub and resident() == sorted(order)
    got = p.resize(8 * ub)
    assert got == 8 * ub == p.arena_resident_bytes and p.n_slots == 8
    assert resident() == sorted(order[4:])  # LRU's victims: the four least recently used
    assert p.stats["evictions"] == 4
    p.resize(12 * ub)
    assert p.n_slots == 12 and p.arena_resident_bytes == 12 * ub and resident() == sorted(order[4:])
    p.load_layer(b1, [4, 5, 6, 7])  # the slots given back take new experts without evicting
    assert p.stats["evictions"] == 4


@pytest.mark.skipif(cgroup_unavailable_reason() is not None, reason="no writable memory cgroup here")
def test_cgroup_charge_falls_after_shrink(default_path):
    """In its own memory cgroup, a child's charge falls by about the slots a shrink takes out and rises
    again when they come back (the pages are punched out of the memfd, not just unmapped)."""
    r = run_limited([sys.executable, str(HERE / "resize_child.py"), str(default_path)], 6 * 2**30, mode="cgroup",
                    timeout_s=300)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    (u0, u1, u2), (a0, a1, a2) = out["usage"], out["arena"]
    assert a1 < a0 and a2 == a0
    assert out["resident"] == out["arena"]
    assert u0 - u1 >= 0.9 * (a0 - a1)  # the cgroup uncharged the slots taken out
    assert u2 - u1 >= 0.9 * (a2 - a1)  # and charges them again when they come back


def test_follower_rule(default_path):
    """MemoryFollower's rule on scripted readings: headroom falling below the budget shrinks at once to it
    (never below the floor, then flags the floor under pressure), pressure rising shrinks by 1/8 of the
    arena, and growth waits for calm, the hold time, and moves by at most 1/8 of the capacity, up to the
    opening budget."""
    with _open(default_path) as s:
        s.resize(_budget_for(s, 12 * 2**20))  # below every expert (~18 MiB), so a smaller budget is a smaller arena
        top = s.budget_bytes
        readings = {"auto": top, "psi": 0.0}
        f = MemoryFollower(s, budget_fn=lambda: readings["auto"], psi_fn=lambda: readings["psi"], period_s=0)
        floor = f.floor()
        assert plan_for_budget(s, floor) and floor < top
        with pytest.raises(epqlab.ArenaTooSmall):
            plan_for_budget(s, floor - 2**20)
        assert f.look(now=0.0) is None  # nothing changed
        readings["auto"] = top - 4 * 2**20
        e = f.look(now=1.0)
        assert e.reason == "headroom" and s.budget_bytes == top - 4 * 2**20 and e.arena_after < e.arena_before
        readings["psi"] = 20.0
        a = s.pager.arena_bytes
        e = f.look(now=2.0)
        assert e.reason == "pressure" and s.pager.arena_bytes <= a - int(arena_resize.PRESSURE_STEP * a) + 2**16
        assert f.look(now=3.0) is None  # pressure not rising: no further shrink
        readings["auto"] = floor // 2  # far below the floor: shrink to the floor, then flag it
        e = f.look(now=4.0)
        assert s.budget_bytes == floor
        assert f.look(now=5.0) is None and f.floor_under_pressure
        readings["auto"], readings["psi"] = top, 5.0
        assert f.look(now=6.0) is None  # not calm yet
        readings["psi"] = 0.0
        assert f.look(now=4.0 + arena_resize.GROW_HOLD_S - 1) is None  # hold time after the last shrink
        e = f.look(now=4.0 + arena_resize.GROW_HOLD_S + 1)
        assert e.reason == "grow" and e.budget_after - e.budget_before <= arena_resize.GROW_STEP * s.pager.capacity_bytes
        for i in range(20):
            f.look(now=100.0 + i)
        assert s.budget_bytes == top and not f.floor_under_pressure


@pytest.mark.skipif(cgroup_unavailable_reason() is not None, reason="no writable memory cgroup here")
def test_follow_memory_under_a_hog(default_path):
    """A hog in the same memory cgroup takes memory while a follow_memory Session decodes: no OOM kill, the
    arena shrinks (headroom fell under the margin), the hog ends and the arena grows back, and the greedy
    tokens equal plain llama.cpp's."""
    limit, hog_mib, n = 1536 * 2**20, 1000, 400  # the hog leaves the budget too small for more than the floor
    r = run_limited([sys.executable, str(HERE / "pressure_child.py"), str(default_path), str(hog_mib), str(n)],
                    limit, mode="cgroup", timeout_s=240)
    assert r.returncode == 0 and not r.killed and not r.oom_kills, (r.reason, r.stderr[-2000:])
    out = json.loads(r.stdout.strip().splitlines()[-1])
    reasons = [e["reason"] for e in out["events"]]
    assert out["hog_end"] is not None, (out["events"], out["arena"][:20])  # the arena shrank under the hog
    assert "headroom" in reasons and reasons[-1] == "grow" and out["arena"][-1] == out["full"]
    assert min(out["arena"]) < out["full"]
    shrink = next(e for e in out["events"] if e["reason"] == "headroom")
    assert shrink["arena_after"] < shrink["arena_before"] and shrink["seconds"] < 1.0
    with epqlab.Session(default_path, pager=False, n_threads=THREADS) as plain:
        ref = plain.generate(PROMPT, n_predict=len(out["tokens"]), temperature=0.0).tokens
    assert out["tokens"] == ref[:len(out["tokens"])] and len(out["tokens"]) > out["hog_end"]


def test_requested_resize_lands_between_layers(default_path):
    """A resize asked for from another thread (follow_memory's monitor: request_resize, an atomic store) is applied
    by the hook before the next layer's load, inside a forward pass: after one decode call nobody else applied,
    the arena is the asked size and the logits are still plain llama.cpp's."""
    lay = epqlab.inspect(default_path)
    toks, (rp, rs, rg) = greedy_ref(default_path)
    with _open(default_path) as s:
        p = s.pager
        small = _smallest_arena(lay, s)
        p.native.request_resize(small)
        assert p.native.requested_resize == small and p.native.resizes == 0
        p1, s1, g1 = s.greedy_trace(toks, N_STEPS)  # its prefill's first layer applies the request
        assert p.native.requested_resize == -1 and p.native.resizes == 1
        assert p.arena_bytes <= small < epqlab.Pager.all_experts_bytes(lay) and p.arena_resident_bytes == p.arena_bytes
    assert np.array_equal(p1, rp) and np.array_equal(s1, rs) and g1 == rg
