"""The eviction policies of issue 50 (lfuda, heat, arc, 2q, sieve, s3fifo, wtinylfu, lirs) and the simulators of
every online policy (epqlab.routes.online).

Each policy's defining decision is checked on a hand-built trace where it differs from LRU, with the hits and
the residents worked out by hand in the comments (one MoE layer, k = 1, so a trace is a plain sequence of
experts, one per forward pass; a, b, c, ... are experts 0, 1, 2, ...). Every hand test runs the native pager's
replay and the simulator and asserts both equal the hand count. Then: the native pager equals the simulator on a
random trace with multi-token passes at three arena sizes, a live Session's counters equal the simulator's on
its own route log with logits bit-identical to pager=False, and bad input is refused.
"""
from __future__ import annotations

import numpy as np
import pytest

import epqlab
from epqlab.constants import ONLINE_POLICIES
from epqlab.routes import RouteLog, simulate_online
from epqlab.routes.policy_params import policy_params

from exact import check_identical, small_arena
from ggufs import LayerSpec, write_moe

NEW = ("lfuda", "heat", "arc", "2q", "sieve", "s3fifo", "wtinylfu", "coact", "lirs", "gate_rank")


@pytest.fixture(scope="module")
def one(tmp_path_factory):
    """One MoE layer of 12 experts, top-1 (one slot class of 24 KiB units)."""
    path = tmp_path_factory.mktemp("one") / "one.gguf"
    write_moe(path, [LayerSpec(0, "F32", 128, 16)], n_expert=12, n_expert_used=1, alignment=4096)
    return epqlab.inspect(path)


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    """4 MoE layers x 8 experts, top-2."""
    path = tmp_path_factory.mktemp("four") / "four.gguf"
    write_moe(path, [LayerSpec(i, "F32", 128, 16) for i in range(4)], n_expert=8, n_expert_used=2, alignment=4096)
    return epqlab.inspect(path)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """One MoE layer of 8 experts, top-2."""
    path = tmp_path_factory.mktemp("pair") / "pair.gguf"
    write_moe(path, [LayerSpec(0, "F32", 128, 16)], n_expert=8, n_expert_used=2, alignment=4096)
    return epqlab.inspect(path)


def trace_log(lay, s, probs=None) -> RouteLog:
    """``s``: one letter per token (k = 1), or a list of k-letter strings (one per token, router order);
    ``probs``: the router probability of each letter, in the same order (default none)."""
    steps = [s] if isinstance(s, str) else s
    ex = np.array([[ord(ch) - ord("a") for ch in w] for w in steps], np.int32)
    ex = ex.reshape(-1, 1, 1) if isinstance(s, str) else ex.reshape(len(s), 1, -1)
    pr = None if probs is None else np.asarray(probs, np.float32).reshape(ex.shape)
    return RouteLog.from_arrays(ex, lay.n_expert, layers=np.array(lay.moe_layers, np.int32), probs=pr)


def run(lay, policy, trace, slots, params=None, probs=None):
    """(hits, resident experts as letters) of ``trace`` with ``slots`` slots, asserting the native pager's replay
    and the simulator agree on hits, misses and evictions."""
    unit = epqlab.Pager.unit_slot_bytes(lay)[0]
    p = epqlab.Pager(lay, slots * unit, policy=policy, policy_params=params, prefault=False)
    assert p.n_slots == slots
    log = trace_log(lay, trace, probs)
    st = p.replay(log)
    sim = simulate_online(log, slots, policy, params=params)
    assert (st["hits"], st["misses"], st["evictions"]) == (sim["hits"], sim["misses"], sim["evictions"])
    res = "".join(chr(ord("a") + e) for e in range(lay.n_expert) if p.is_resident(lay.moe_layers[0], e))
    assert res == "".join(chr(ord("a") + e) for _, e in sim["resident"])
    return st["hits"], res


# ARC, 3 slots, "aabcdbe".  a a: a goes T1 -> T2 (seen twice). b, c fill T1 = [b, c]. d: |T1| = 2 > p = 0, so
# T1's LRU b goes (ghost in B1) -- LRU would evict a, its least recent. b: a ghost hit in B1: p = 1, the victim
# is T1's LRU c (|T1| = 2 > 1), b returns to T2 = [a, b], T1 = [d]. e: |T1| = 1 = p, so T2's LRU a goes.
# Hits: a (2nd) = 1; residents b, d, e. LRU: a, b (6th: still resident) = 2 hits, residents b, d, e.
def test_arc_ghost_hit(one):
    assert run(one, "arc", "aabcdbe", 3) == (1, "bde")
    assert run(one, "lru", "aabcdbe", 3) == (2, "bde")
    # had b re-entered T1 instead of T2, e would find |T1| = 2 > p and evict d: residents a, b, e
    assert run(one, "arc", "aabcdb", 3) == (1, "abd")


# SIEVE, 3 slots, "abcadced". a b c fill the queue; a hit sets a's visited bit. d: the hand at the tail a
# clears its bit and evicts b; the hand stays at c. c hit: bit set. e: the hand clears c's bit and evicts d,
# the newest (LRU evicts a, least recent). d: miss (LRU: hit). Hits: a, c = 2 (LRU: a, c, d = 3).
def test_sieve_visited_bit_and_hand(one):
    assert run(one, "sieve", "abcadce", 3) == (2, "ace")
    assert run(one, "lru", "abcadce", 3) == (2, "cde")
    assert run(one, "sieve", "abcadced", 3)[0] == 2
    assert run(one, "lru", "abcadced", 3)[0] == 3


# S3-FIFO, 3 slots: S's size max(1, floor(0.1 x 3)) = 1, G holds floor(0.9 x 3) = 2 ids, move threshold 2.
# "aaabcdea": a, then two hits (freq 2); b, c fill S = [a, b, c]. d: |S| >= 1, so S's oldest a (freq 2 >= 2)
# moves to M and b (freq 0) is evicted into G. e: S = [c, d]: c evicted into G. a: hit in M.
# Hits: 2 + 1 = 3; LRU evicts a at d: 2 hits.
def test_s3fifo_small_queue_eviction(one):
    assert run(one, "s3fifo", "aaabcdea", 3) == (3, "ade")
    assert run(one, "lru", "aaabcdea", 3) == (2, "ade")


# W-TinyLFU, 3 slots: window 1 slot, main 2. "aaabbbcda": a (window), 2 hits; b: a moves on to probation
# (main has room), b enters the window, 2 hits; c: b moves to probation, c to the window. d: the arena is full;
# the window's candidate c (1 request) meets main's victim a (3 requests): refused, c is evicted (LRU evicts
# a). a: hit. Hits 2 + 2 + 1 = 5; LRU 4.
# And admission granted, "abcccde": a, b move on to probation as c arrives; c gets 2 hits (3 requests). d: the
# candidate c (3) beats main's victim a (1): c enters probation, a goes. e: the candidate d (1) does not beat
# probation's b (1): d goes. Residents b, c, e; LRU evicts a, then b: c, d, e.
def test_wtinylfu_admission_refusal(one):
    assert run(one, "wtinylfu", "aaabbbcd", 3) == (4, "abd")
    assert run(one, "wtinylfu", "abcccde", 3) == (2, "bce")
    assert run(one, "lru", "abcccde", 3) == (2, "cde")
    assert run(one, "wtinylfu", "aaabbbcda", 3)[0] == 5
    assert run(one, "lru", "aaabbbcda", 3)[0] == 4


# The admission knob (issue 50 item 2), wtinylfu admit="stage", 3 slots: "aaabbbcd" fills the arena as in
# test_wtinylfu_admission_refusal (probation a (3 requests), b (3); window c (1)). d: no slot is free, and TinyLFU
# at the door rates d (1) no more frequent than main's victim a (3): d is refused a slot and used from the staging
# buffer; nothing is evicted, residents stay a, b, c (with admit="slot" d enters the window and the candidate c
# loses its duel: one eviction, residents a, b, d). "dddd": d is refused at 2 and 3 requests too; its 4th beats
# a's 3, so it is admitted (window), and the window's candidate c (1) loses to a: one eviction, residents a, b, d.
def run_admit(lay, trace, admit, policy="wtinylfu", slots=3):
    unit = epqlab.Pager.unit_slot_bytes(lay)[0]
    prm = {"admit": admit}
    p = epqlab.Pager(lay, slots * unit, policy=policy, policy_params=prm, prefault=False)
    log = trace_log(lay, trace)
    st, sim = p.replay(log), simulate_online(log, slots, policy, params=prm)
    keys = ("hits", "misses", "evictions", "admission_staged")
    assert [st[k] for k in keys] == [sim[k] for k in keys]
    res = "".join(chr(ord("a") + e) for e in range(lay.n_expert) if p.is_resident(lay.moe_layers[0], e))
    assert res == "".join(chr(ord("a") + e) for _, e in sim["resident"])
    return tuple(st[k] for k in keys) + (res,)


def test_wtinylfu_admit_stage_refuses_without_evicting(one):
    assert run_admit(one, "aaabbbcd", "stage") == (4, 4, 0, 1, "abc")
    assert run_admit(one, "aaabbbcd", "slot") == (4, 4, 1, 0, "abd")
    assert run_admit(one, "aaabbbcdddd", "stage") == (4, 7, 1, 3, "abd")
    assert policy_params("wtinylfu")["admit"] == "slot"
    with pytest.raises(ValueError, match="wtinylfu admit must be one of slot, stage, got 'never'"):
        epqlab.Pager(one, 3 * epqlab.Pager.unit_slot_bytes(one)[0], policy="wtinylfu", policy_params={"admit": "never"})


# 2Q (Kin 1, Kout 2) and S3-FIFO (|S| target 1, 3 ghosts), 4 slots, "abcdeabe". a-d fill the free slots. e: no
# slot is free and e is not a ghost, so with admit=stage it is staged and its id becomes a ghost; a, b hit. e again:
# a ghost now, so it is admitted (into Am / M) and A1in's / S's oldest, a, goes: hits 2, misses 6, 1 eviction,
# 1 staged, residents b c d e. With admit=slot, e evicts a, a evicts b, b evicts c (each returning ghost enters
# Am / M) and only e's second request hits: 1 hit, residents a b d e.
@pytest.mark.parametrize("policy", ["2q", "s3fifo"])
def test_ghost_admission_stages_a_first_miss(one, policy):
    assert run_admit(one, "abcdeabe", "stage", policy, 4) == (2, 6, 1, 1, "bcde")
    assert run_admit(one, "abcdeabe", "slot", policy, 4) == (1, 7, 3, 0, "abde")
    assert policy_params(policy)["admit"] == "slot"


# LFUDA, 2 slots, "aaabcdea": a: K = 0 + 3 after its hits. b (K 1) fills. c: evict b (K 1): age 1; c K = 2.
# d: evict c (K 2): age 2, d K = 3. e: a and d tie at K 3, the older a goes (age 3). a: miss.
# Hits 2; residents after e: d, e. LFU keeps a (3 requests against 1): hits 3, residents a, e.
def test_lfuda_aging(one):
    assert run(one, "lfuda", "aaabcde", 2) == (2, "de")
    assert run(one, "lfu", "aaabcde", 2) == (2, "ae")
    assert run(one, "lfuda", "aaabcdea", 2)[0] == 2
    assert run(one, "lfu", "aaabcdea", 2)[0] == 3


# Heat, half-life 2 passes, 2 slots, "aaaabcdea" (passes 2, 3, ...): the key log2(h) + t / 2 of a after its 4th
# request (t = 5): h = 1 -> 1.707 -> 2.207 -> 2.561, key 1.357 + 2.5 = 3.857. b (t 6): key 3.0. c (t 7):
# evicts b; key 3.5. d (t 8): evicts c (3.5 < 3.857); key 4.0. e (t 9): evicts a (3.857 < 4.0): a has
# cooled. With the default half-life (128) a stays, as in LFU.
def test_heat_decay(one):
    assert run(one, "heat", "aaaabcde", 2, {"half_life": 2}) == (3, "de")
    assert run(one, "heat", "aaaabcde", 2) == (3, "ae")
    assert run(one, "lfu", "aaaabcde", 2) == (3, "ae")
    assert policy_params("heat") == {"half_life": 128.0}


# 2Q, 4 slots: Kin = 1, Kout = 2. "abcdeafghia": a-d fill A1in. e: |A1in| = 4 > 1: a (oldest) goes, its id to
# A1out. a: found in A1out, so it enters Am (b goes). f, g, h, i: each evicts A1in's oldest (c, d, e, f) while
# a stays in Am. a: hit. LRU evicts a at i (least recent): 0 hits.
# gate_rank, 2 slots, "abbbca" with router probabilities .9 .1 .1 .1 .5 .9. At c the mass is a 0.9 against
# b 0.3 (decay 2^(-3/128) on a's barely matters), so b goes, and a's return hits: hits b, b, a = 3, residents
# a, c. LRU evicts a (least recent) at c and b at a: 2 hits; heat evicts a (1 request against 3) at c and
# c (1 against b's ~3) at a: 2 hits, residents a, b. With half_life 0.5 a's mass has decayed to 0.9/64 by c,
# under b's ~0.13, so gate_rank evicts a at c, and at a evicts b (0.13 two passes back against c's fresh 0.5):
# 2 hits, residents a, c.
def test_gate_rank_weighs_router_probability(one):
    pr = [.9, .1, .1, .1, .5, .9]
    assert run(one, "gate_rank", "abbbca", 2, probs=pr) == (3, "ac")
    assert run(one, "lru", "abbbca", 2, probs=pr) == (2, "ac")
    assert run(one, "heat", "abbbca", 2, probs=pr) == (2, "ab")
    assert run(one, "gate_rank", "abbbca", 2, {"half_life": 0.5}, probs=pr) == (2, "ac")
    assert policy_params("gate_rank") == {"half_life": 128.0}
    with pytest.raises(ValueError, match="needs the router probability"):
        simulate_online(trace_log(one, "abc"), 2, "gate_rank")
    unit = epqlab.Pager.unit_slot_bytes(one)[0]
    with pytest.raises(ValueError, match="gate_rank replays need"):
        epqlab.Pager(one, 2 * unit, policy="gate_rank", prefault=False).replay(trace_log(one, "abc"))


def test_2q_a1out_promotes(one):
    assert run(one, "2q", "abcdeafghi", 4) == (0, "aghi")
    assert run(one, "lru", "abcdeafghi", 4) == (0, "fghi")
    assert run(one, "2q", "abcdeafghia", 4)[0] == 1


# coact, 3 slots, top-2, steps ae, bc, be, ca, ba. ae fills two slots (C(a,e) = 1). bc: b takes the last slot;
# c must evict a or e: both have 1 request + partner mass 1 (each other): the older a goes. be: 2 hits (C(b,e)
# = 1). ca: c hits; a must evict e or b: V(e) = 2 requests + C(e,b) = 1 -> 3; V(b) = 2 + C(b,c) + C(b,e) = 4:
# e goes (LRU and LFU evict b, the least recent of two equally frequent). ba: b hits (LRU, LFU: miss), a hits.
# Hits 5 (LRU and LFU: 4); after ca the residents are a, b, c (LRU, LFU: a, c, e).
def test_coact_partners_keep_an_expert(pair):
    steps = ["ae", "bc", "be", "ca", "ba"]
    assert run(pair, "coact", steps, 3) == (5, "abc")
    assert run(pair, "coact", steps[:4], 3) == (3, "abc")
    for pol in ("lru", "lfu"):
        assert run(pair, pol, steps[:4], 3) == (3, "ace")
        assert run(pair, pol, steps, 3)[0] == 4


# LIRS, 3 slots: h = max(1, floor(0.01 x 3)) = 1 resident HIR slot, 2 LIR. "abcad": a, b become LIR (warm-up).
# c: not in the stack S, the LIR set is full: resident HIR, Q = [c], S = [a, b, c]. a: LIR hit; a was S's bottom,
# S = [b, c, a]. d: a miss; the victim is Q's oldest, c, the one-shot touched two requests ago; b (LIR, reuse
# distance small) stays. c stays in S as a non-resident HIR entry. LRU evicts b (its least recent): residents a,
# c, d. Then "ce": c's second request finds it in S (its IRR, 2, is below the recency of S's bottom LIR b), so c
# becomes LIR and b is demoted to Q (resident HIR) behind d; c's victim is Q's oldest, d. e: resident HIR; its
# victim is Q's oldest, now b. Residents a, c, e (had c not been promoted, c would be Q's oldest at e: a, b, e).
# LRU: a and c hit, residents c, d, e.
def test_lirs_keeps_small_reuse_distance(one):
    assert run(one, "lirs", "abcad", 3) == (1, "abd")
    assert run(one, "lru", "abcad", 3) == (1, "acd")
    assert run(one, "lirs", "abcadce", 3) == (1, "ace")
    assert run(one, "lru", "abcadce", 3) == (2, "cde")
    # the one-shots d, e stream through the one HIR slot while a, b keep hitting: 4 hits (LRU 2)
    assert run(one, "lirs", "abcadbeab", 3) == (4, "abe")
    assert run(one, "lru", "abcadbeab", 3)[0] == 2
    assert policy_params("lirs") == {"hir_ratio": 0.01}
    with pytest.raises(ValueError, match=r"lirs hir_ratio must lie in \(0, 1\), got 1\.5"):
        epqlab.Pager(one, 4 * epqlab.Pager.unit_slot_bytes(one)[0], policy="lirs", policy_params={"hir_ratio": 1.5})
    with pytest.raises(ValueError, match=r"hir_ratio must lie in \(0, 1\)"):
        simulate_online(trace_log(one, "abc"), 2, "lirs", params={"hir_ratio": 0})


def test_cyclic_hand_counts_in_simulator():
    """test_eviction.py's hand-worked cycle (4 layers x (0, 1), 6 slots, 5 tokens) through the simulator."""
    ex = np.tile(np.array([0, 1], np.int32), (5, 4, 1))
    log = RouteLog.from_arrays(ex, 4)
    for pol, hits in {"lru": 0, "ls": 0, "lfu": 0, "ls_pos": 22}.items():
        assert simulate_online(log, 6, pol)["hits"] == hits, pol
    # static, layer 0 hot: layer 0 always hits after token 1 (2 per token), the rest cycles through 4 slots
    assert simulate_online(log, 6, "static", hot=[[0, 0], [0, 1]])["hits"] == 8


@pytest.mark.parametrize("policy", ONLINE_POLICIES)
def test_native_replay_equals_simulator(four, policy):
    """Skewed random routes, 200 tokens, the first 100 in two-token passes (sorted unions; a union over the
    pool is staged): the native pager and the simulator agree on every counter at three arena sizes."""
    rng = np.random.default_rng(0)
    ex = np.stack([rng.choice(8, 2, replace=False, p=[.3, .2, .15, .1, .1, .05, .05, .05]) for _ in range(800)])
    ub = np.concatenate([np.repeat(np.arange(50), 2), np.arange(50, 150)]).astype(np.int32)
    pr = np.random.default_rng(1).random((200, 4, 2)).astype(np.float32)  # router probabilities (gate_rank)
    log = RouteLog.from_arrays(ex.reshape(200, 4, 2).astype(np.int32), 8, layers=np.array(four.moe_layers, np.int32),
                               ubatch=ub, probs=pr)
    unit = epqlab.Pager.unit_slot_bytes(four)[0]
    hot = [[0, 0], [1, 0]] if policy == "static" else None
    for slots in (3, 7, 16):
        p = epqlab.Pager(four, slots * unit, policy=policy, prefault=False)
        if hot:
            p.set_hot([[four.moe_layers[li], e] for li, e in hot])
        st = p.replay(log)
        sim = simulate_online(log, slots, policy, hot=hot)
        assert (st["hits"], st["misses"], st["evictions"]) == (sim["hits"], sim["misses"], sim["evictions"]), slots
        assert [st[f"evictions_{g}"] for g in sim["evictions_by_group"]] == list(sim["evictions_by_group"].values())
        assert st["requests"] > 0 and (slots == 16 or st["evictions"] > 0)


@pytest.mark.parametrize("policy", [p for p in ONLINE_POLICIES if p != "static"])
def test_live_equals_simulated_and_bit_identical(default_path, ref, tmp_path, policy):
    """A live greedy run at a small arena: logits bit-identical to pager=False (check_identical), and the live
    hits, misses and evictions equal the simulator's on the run's own route log."""
    st = check_identical(default_path, ref, policy, None, 0, route_log=tmp_path / "r.npz")
    log = RouteLog.load(tmp_path / "r.npz")
    lay = epqlab.inspect(default_path)
    classes = [(c["slot_bytes"], c["slots"]) for c in
               epqlab.Pager(lay, small_arena(default_path), policy=policy, prefault=False).stats["slot_classes"]]
    assert len(classes) == 2   # the default model's two unit sizes: a larger slot may hold a smaller unit
    sim = simulate_online(log, None, policy, slot_classes=classes, unit_bytes=epqlab.Pager.unit_slot_bytes(lay))
    assert (st["hits"], st["misses"], st["evictions"]) == (sim["hits"], sim["misses"], sim["evictions"])
    assert sim["staged"] == 0 or st["staged_reads"] + st["staged_copies"] > 0


def test_lirs_live_equals_simulated_at_a_larger_arena(default_path, ref, tmp_path):
    """LIRS live at 8 x the smallest arena (35 slots; at test_live_equals_simulated_and_bit_identical's small arena
    every request misses, so no rule shows): logits bit-identical to pager=False, the live counters equal the
    simulator's on the run's own route log, and LIRS hits where LRU, on the same routes, does not."""
    st = check_identical(default_path, ref, "lirs", None, 0, route_log=tmp_path / "r.npz", arena_factor=8)
    log = RouteLog.load(tmp_path / "r.npz")
    lay = epqlab.inspect(default_path)
    classes = [(c["slot_bytes"], c["slots"]) for c in st["slot_classes"]]
    kw = dict(slot_classes=classes, unit_bytes=epqlab.Pager.unit_slot_bytes(lay))
    sim = simulate_online(log, None, "lirs", **kw)
    assert (st["hits"], st["misses"], st["evictions"]) == (sim["hits"], sim["misses"], sim["evictions"])
    assert sim["hits"] > simulate_online(log, None, "lru", **kw)["hits"]


@pytest.mark.parametrize("policy,extra,factor", [("wtinylfu", {}, 1.5), ("2q", {"kout": 4.0}, 8),
                                                 ("s3fifo", {"ghost_ratio": 4.0}, 8)])
def test_admit_stage_live_equals_simulated_and_bit_identical(default_path, ref, tmp_path, policy, extra, factor):
    """admit="stage" live at a small arena: the refused experts are read by the layer's staging, so logits
    stay bit-identical to pager=False; the live hits, misses, evictions and refusals equal the simulator's on the
    run's own route log, and refusals really happened (and were staged). The ghost admissions of 2Q and S3-FIFO
    need a ghost list longer than a token's 90 requests (30 layers x top-3) to see a staged expert come back, so
    they run at 8x the smallest arena with 4 ghosts per slot (at 1.5x and the papers' ratios every miss is staged
    and nothing is ever evicted)."""
    prm = {"admit": "stage", **extra}
    st = check_identical(default_path, ref, policy, None, 0, route_log=tmp_path / "r.npz", policy_params=prm,
                         arena_factor=factor)
    log = RouteLog.load(tmp_path / "r.npz")
    lay = epqlab.inspect(default_path)
    classes = [(c["slot_bytes"], c["slots"]) for c in
               epqlab.Pager(lay, small_arena(default_path, factor), policy=policy, prefault=False).stats["slot_classes"]]
    sim = simulate_online(log, None, policy, params=prm, slot_classes=classes,
                          unit_bytes=epqlab.Pager.unit_slot_bytes(lay))
    keys = ("hits", "misses", "evictions", "admission_staged")
    assert [st[k] for k in keys] == [sim[k] for k in keys]
    assert st["admission_staged"] > 0 and st["staged_reads"] >= st["admission_staged"]


@pytest.mark.parametrize("policy,params", [("heat", {"half_life": 2.0})])
def test_session_policy_params_reach_the_pager(default_path, tmp_path, policy, params):
    """Session(policy_params=...) runs the pager with those numbers: its live hits, misses and evictions equal the
    simulator's with the same parameters on the run's own route log (and differ from the defaults' where the
    parameter matters); a value out of range is refused before the model loads."""
    lay = epqlab.inspect(default_path)
    with epqlab.Session(default_path, arena_bytes=small_arena(default_path), policy=policy, policy_params=params,
                        n_threads=1, io_threads=2, route_log=tmp_path / "r.npz") as s:
        s.generate("A CPU cache is a small, fast memory that sits between the processor and", n_predict=24)
        st = s.stats
        classes = [(c["slot_bytes"], c["slots"]) for c in st["slot_classes"]]
        assert s.pager.policy_params == params
    log = RouteLog.load(tmp_path / "r.npz")
    kw = dict(slot_classes=classes, unit_bytes=epqlab.Pager.unit_slot_bytes(lay))
    sim = simulate_online(log, None, policy, params=params, **kw)
    assert (st["hits"], st["misses"], st["evictions"]) == (sim["hits"], sim["misses"], sim["evictions"])
    default = simulate_online(log, None, policy, **kw)
    assert (default["hits"], default["evictions"]) != (sim["hits"], sim["evictions"])  # the parameter mattered
    with pytest.raises(ValueError, match="must lie in"):
        epqlab.Session(default_path, policy=policy, policy_params={k: -1.0 for k in params})


def test_bad_policy_input(one):
    unit = epqlab.Pager.unit_slot_bytes(one)[0]
    with pytest.raises(ValueError, match="choose one of lru, ls, .*wtinylfu"):
        epqlab.Pager(one, 4 * unit, policy="clock")
    with pytest.raises(ValueError, match=r"half_life must lie in \(0, inf\)"):
        epqlab.Pager(one, 4 * unit, policy="heat", policy_params={"half_life": 0})
    with pytest.raises(ValueError, match=r"small_ratio must lie in \(0, 1\)"):
        simulate_online(trace_log(one, "abc"), 2, "s3fifo", params={"small_ratio": 1.0})
    with pytest.raises(ValueError, match=r"move_threshold must lie in \[1, 3\]"):
        policy_params("s3fifo", {"move_threshold": 4})
    with pytest.raises(ValueError, match="no parameter 'p'.*window, protected, sample_factor"):
        policy_params("wtinylfu", {"p": 1})
    with pytest.raises(ValueError, match="choose one of"):
        simulate_online(trace_log(one, "abc"), 2, "clock")
    with pytest.raises(ValueError, match="capacity 0 < k = 1"):
        simulate_online(trace_log(one, "abc"), 0, "arc")


@pytest.mark.parametrize("per_layer", [False, True])
def test_simulate_table_runs_every_policy(per_layer):
    """epqlab.routes.simulate takes every online policy beside the fast ones: its rows equal simulate_online's
    (one token per forward pass, the table's model), and lru / ls / ls_pos through simulate_online equal the
    fast methods (which the reference checks), in both pool modes."""
    from dataclasses import replace

    from epqlab.routes import simulate

    rng = np.random.default_rng(2)
    ex = np.stack([rng.choice(8, 2, replace=False, p=[.3, .2, .15, .1, .1, .05, .05, .05]) for _ in range(240)])
    log = RouteLog.from_arrays(ex.reshape(60, 4, 2).astype(np.int32), 8, ubatch=np.repeat(np.arange(30), 2).astype(np.int32))
    caps = [3, 6] if per_layer else [5, 12]
    df = simulate(log, caps, ["lru", "ls", "ls_pos", "arc", "coact"], per_layer=per_layer).set_index(["policy", "capacity"])
    one = replace(log, ubatch=None)
    for pol in ("lru", "ls", "ls_pos", "arc", "coact"):
        for c in caps:
            r = simulate_online(one, c, pol, per_layer=per_layer)
            assert int(df.loc[(pol, c), "hits"]) == r["hits"], (pol, c)
            assert int(df.loc[(pol, c), "evictions"]) == r["evictions"], (pol, c)


@pytest.mark.parametrize("policy", NEW)
def test_prefetch_keeps_new_policies_bit_identical(default_path, ref, policy):
    """With prefetch (union of lookahead and previous, pipelined reads) prefetched experts enter each policy as
    misses do and cancelled ones leave it; logits stay bit-identical to pager=False and the prefetch ran."""
    st = check_identical(default_path, ref, policy, "union", 0, pipeline=True)
    assert st["prefetch_units"] > 0
