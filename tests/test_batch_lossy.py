"""The lossy routing knobs in batched decode steps (native/engine/hook_lossy.h, lossy_step; docs/DESIGN.md §3a'):
cache-aware and batch-aware routing, adaptive-k and the union budget act on every token of a step whose tokens
belong to different sequences. Checked against a hand-worked step, exact batched decode and plain llama.cpp
(margin 0 / a budget no step reaches), and a NumPy MoE layer computed from the recorded router inputs and the
GGUF's own expert weights."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

import epqlab
from epqlab import _core
from epqlab.engine.batch import Batcher
from epqlab.engine.predictor import router_weights
from epqlab.studies.ablation.grid import memory_points
from test_lossy_route import _experts, _moe, _probs, _rel

BATCH, MODE = _core.ROUTE_MODES["batch"], _core.ROUTE_MODES

# ---- the rule, on a hand-built step ---------------------------------------------------------------------------

# 3 tokens, k = 2, 8 experts, expert 7 resident. Probabilities are dyadic (exact in float32).
Q3 = np.zeros((3, 8), np.float32)
Q3[0, [0, 1, 2, 3, 7]] = [0.375, 0.25, 0.1875, 0.0625, 0.125]  # A: 1 is its own; 2 (B, C use it) is 0.0625 below
Q3[1, [0, 2, 7]] = [0.5, 0.25, 0.125]                          # B: both its experts shared with A
Q3[2, [3, 2, 0, 7]] = [0.25, 0.5, 0.125, 0.125]                  # C: 3 its own, the best other (0) 0.125 below
IDS3 = np.array([[0, 1], [0, 2], [2, 3]], np.int32)
RES3 = np.zeros(8, np.uint8)
RES3[7] = 1


def test_hand_step_one_substitution_one_budget_drop():
    """Margin 0.1: A's expert 1 (read for A alone) becomes 2 (B and C read it; 0.0625 below), C's expert 3 stays
    (its best available, 0, is 0.125 below). Budget 2: the union {0, 2, 3} keeps 0 (aggregate 0.375 + 0.5 + 0)
    and 2 (0.1875 + 0.25 + 0.5) over 3 (0.25): C's slot of 3 is dropped and repeats C's best kept expert, 2."""
    ids, keep, c = _core.lossy_step(Q3, IDS3, RES3, BATCH, 0.1, [], [], 2)
    assert ids.tolist() == [[0, 2], [0, 2], [2, 2]] and keep.tolist() == [[1, 1], [1, 1], [1, 0]]
    assert c == dict(substituted=1, unchanged=4, adaptive_dropped=0, budget_dropped=1, budget_overflow=0,
                     union_before=4, union_after=2, not_read=2)  # 1 and 3 are not read
    # cache-aware routing sees only the arena: A's 1 -> 7 (0.125 below: outside 0.1), so nothing changes
    ids, keep, c = _core.lossy_step(Q3, IDS3, RES3, MODE["cache"], 0.1, [], [], 0)
    assert ids.tolist() == IDS3.tolist() and c["substituted"] == 0 and c["union_after"] == 4
    # margin 0 and a budget the step does not reach: the step unchanged
    ids, keep, c = _core.lossy_step(Q3, IDS3, RES3, BATCH, 0.0, [], [], 4)
    assert ids.tolist() == IDS3.tolist() and keep.all() and c["union_before"] == c["union_after"] == 4
    assert c["substituted"] == c["budget_dropped"] == c["not_read"] == 0


def test_budget_keeps_resident_experts_first_and_a_token_never_empty():
    """Budget 1 over {0, 2, 3, 7} with 7 resident: 7 is kept although its aggregate weight (0.125) is the lowest. A
    keeps 7 and drops 0; B and C have nothing inside the budget, so each keeps its best (B 0 at 0.5, C 2 at 0.5:
    budget_overflow 2) and drops the other."""
    ids = np.array([[0, 7], [0, 2], [2, 3]], np.int32)
    out, keep, c = _core.lossy_step(Q3, ids, RES3, MODE["off"], 0.0, [], [], 1)
    assert keep.tolist() == [[0, 1], [1, 0], [1, 0]] and out.tolist() == [[7, 7], [0, 0], [2, 2]]
    assert c["budget_overflow"] == 2 and c["budget_dropped"] == 3 and c["union_after"] == 3
    assert c["not_read"] == 1  # 3: the only non-resident expert of the router's union left out


def test_batch_mode_with_one_token_is_cache_mode():
    rng = np.random.default_rng(3)
    for _ in range(50):
        q = rng.dirichlet(np.ones(8)).astype(np.float32)[None]
        ids = np.argsort(-q[0])[:3].astype(np.int32)[None]
        res = (rng.random(8) < 0.4).astype(np.uint8)
        a = _core.lossy_step(q, ids, res, BATCH, 0.2, [], [], 0)
        b = _core.lossy_step(q, ids, res, MODE["cache"], 0.2, [], [], 0)
        assert a[0].tolist() == b[0].tolist() and a[2] == b[2]


def test_rule_invariants_on_random_steps():
    """Never an expert twice among a token's kept slots; the union after = a hand count of the kept ids; at most
    budget (+ overflowing tokens); a substitute is resident or used by another token of the step."""
    rng = np.random.default_rng(0)
    for trial in range(300):
        n, E, k = int(rng.integers(1, 6)), 16, int(rng.integers(1, 5))
        q = rng.dirichlet(np.ones(E) * 0.5, size=n).astype(np.float32)
        ids = np.stack([rng.choice(E, k, replace=False) for _ in range(n)]).astype(np.int32)
        res = (rng.random(E) < 0.3).astype(np.uint8)
        budget = int(rng.integers(0, 8))
        out, keep, c = _core.lossy_step(q, ids, res, BATCH, float(rng.random() * 0.3), [], [], budget)
        kept = [set(out[j][keep[j] == 1].tolist()) for j in range(n)]
        assert all(len(kept[j]) == int(keep[j].sum()) >= 1 for j in range(n))
        union = set().union(*kept)
        assert c["union_after"] == len(union) and c["union_before"] == len(set(ids.ravel().tolist()))
        if budget:
            assert len(union) <= budget + c["budget_overflow"]
        for j in range(n):
            others = set().union(*(set(ids[i].tolist()) | kept[i] for i in range(n) if i != j))
            for e in kept[j] - set(ids[j].tolist()):
                assert res[e] or e in others


# ---- in the engine: batched decode steps -----------------------------------------------------------------------

TEXTS = ["A CPU cache is a small, fast memory that sits between the processor and main memory.",
         "The river rose through the night, and by morning the low fields were under water.",
         "In 1905 Einstein published four papers that changed how physicists thought about light.",
         "Bread dough rises because yeast turns sugar into carbon dioxide and a little alcohol."]
N_FORCED = 11
PROMPT = 5  # tokens of each text before the forced ones (not 4: a prompt pass must not look like a 4-token step)


def _forced_batch(s, n=N_FORCED):
    """Teacher-forced batched decode of TEXTS (prompt: the first PROMPT tokens, then the next n fed one per step, the
    four sequences in one step): every step's logits per text, float32 [n, n_vocab], and the run's counters."""
    reqs = []
    for t in TEXTS:
        toks = s.tokenize(t)
        r = s.batch_requests([toks[:PROMPT]], n, 0.0)[0]
        r.forced, r.n_predict, r.logits = [int(x) for x in toks[PROMPT:PROMPT + n]], n, []
        reqs.append(r)
    s.reset_stats()
    Batcher(s, len(TEXTS)).run(reqs)
    return [np.stack(r.logits) for r in reqs], s.stats


@pytest.fixture(scope="module")
def exact_batch(default_path):
    half = memory_points(epqlab.inspect(default_path), arenas=[0.5])[0].session_kwargs()
    with epqlab.Session(default_path, **half, n_seq_max=4, n_threads=2) as s:
        paged, st = _forced_batch(s)
    with epqlab.Session(default_path, pager=False, n_seq_max=4, n_threads=2) as s:
        plain, _ = _forced_batch(s)
    return half, paged, plain, st


@pytest.mark.parametrize("kw", [dict(route_bias="batch", route_delta=0.0), dict(route_bias="cache", route_delta=0.0),
                                dict(expert_budget=64), dict(adaptive_k=((100.0,), (3, 3)))],
                         ids=["batch-delta0", "cache-delta0", "budget-n_expert", "adaptive-keep-all"])
def test_no_change_is_bit_identical_to_exact_batched_decode(default_path, exact_batch, kw):
    half, paged, plain, _ = exact_batch
    for a, b in zip(paged, plain):
        assert np.array_equal(a, b)  # the reference itself: paged exact = plain llama.cpp
    with epqlab.Session(default_path, **half, n_seq_max=4, n_threads=2, **kw) as s:
        got, st = _forced_batch(s)
        L, k = len(s.layout.layers), s.n_expert_used
    for a, b in zip(got, paged):
        assert np.array_equal(a, b)
    # the knob examined every slot of every decode step (4 sequences x (N_FORCED - 1) steps after the prompts')
    assert st["lossy_slots"] == len(TEXTS) * (N_FORCED - 1) * L * k
    assert st["route_changed"] == st["budget_dropped"] == st["adaptive_dropped"] == 0
    assert st["lossy_union_before"] == st["lossy_union_after"] > 0


@pytest.mark.parametrize("kw", [dict(route_bias="batch", route_delta=0.5), dict(expert_budget=4),
                                dict(route_bias="cache", route_delta=0.5), dict(adaptive_k=((1.5, 1.9), (1, 2, 3)))],
                         ids=["batch", "budget", "cache", "adaptive_k"])  # the published adaptive-k rule drops nothing
                                                                          # on this model's flat router (H > 1.2)
def test_knobs_act_in_batched_steps(default_path, exact_batch, kw):
    """In batched decode the knob changes routes and logits, and the union per step and the bytes read shrink.
    Cache-aware routing needs resident experts beside a step's load: at half the slots (4 of 8 experts per layer)
    four tokens' union (up to 8) is staged and nothing stays resident, so it runs at 7 of 8 slots, against plain."""
    half, paged, plain, st0 = exact_batch
    if kw.get("route_bias") == "cache":
        half = memory_points(epqlab.inspect(default_path), arenas=[7 / 8])[0].session_kwargs()
    with epqlab.Session(default_path, **half, n_seq_max=4, n_threads=2, **kw) as s:
        got, st = _forced_batch(s)
    assert any(not np.array_equal(a, b) for a, b in zip(got, plain))
    assert st["route_changed"] > 0 and st["lossy_union_after"] < st["lossy_union_before"]
    assert st["lossy_bytes_saved"] > 0
    if "expert_budget" in kw:
        L = len(epqlab.inspect(default_path).layers)
        assert st["lossy_union_after"] <= 4 * L * (N_FORCED - 1) + st["budget_overflow"]
        assert st["budget_dropped"] > 0
    if kw.get("route_bias") == "batch":
        assert st["route_substituted"] > 0
    if "adaptive_k" in kw:
        assert st["adaptive_dropped"] > 0


def _record_batch(path, tmp_path, **kw):
    """Teacher-forced batched decode of TEXTS with knobs ``kw`` at half the experts' slots, recording routes,
    router inputs and MoE outputs; returns (stats, H [T, L, D], out [T, L, D], routes [T, L, k], step id [T]) of
    the rows of batched decode steps (forward passes of len(TEXTS) tokens; the prompts are PROMPT tokens)."""
    half = memory_points(epqlab.inspect(path), arenas=[0.5])[0].session_kwargs()
    with epqlab.Session(path, **half, n_seq_max=4, n_threads=2, route_log=tmp_path / "r.npz", n_ctx=256, **kw) as s:
        s.decoder.capture_router_inputs(True)
        _, stats = _forced_batch(s)
        outs = np.asarray(s.decoder.engine.moe_outputs(), np.float32)
        flat, dim = s.decoder.take_router_inputs()
        log = s.route_log()
    T, L, _ = log.experts.shape
    H = np.asarray(flat, np.float32).reshape(T, L, int(dim))[-len(log.ubatch):]
    O = outs.reshape(-1, L, int(dim))[-len(log.ubatch):]
    ub = np.asarray(log.ubatch)
    step = np.array([np.sum(ub == u) == len(TEXTS) for u in ub])
    return stats, H[step].astype(np.float64), O[step].astype(np.float64), log.experts[step], ub[step]


def test_batch_substituted_step_equals_numpy_moe_layer(tiny_gguf, tmp_path):
    """Each token of a batched step with substitutions: its MoE output is the mixture of the experts it actually
    used (the route log), weighted by its router probabilities renormalized over them (qwen3moe's norm)."""
    stats, H, O, R, ub = _record_batch(tiny_gguf, tmp_path, route_bias="batch", route_delta=0.9)
    Ws, bs = router_weights(tiny_gguf)
    ex = _experts(tiny_gguf)
    T, L, k = R.shape
    assert T >= 4 * 8 and stats["route_substituted"] > 0
    n_sub, errs, errs_orig = 0, [], []
    for l in range(L):
        p = _probs(H, Ws, bs, l)
        for t in range(T):
            used = R[t, l]
            w = p[t, used] / p[t, used].sum()
            errs.append(_rel(O[t, l], _moe(H[t, l], used, w, ex[l])))
            srt = np.sort(p[t])[::-1]
            if srt[k - 1] - srt[k] > 1e-3:
                orig = np.argsort(-p[t], kind="stable")[:k]
                if set(orig) - set(used):
                    n_sub += 1
                    errs_orig.append(_rel(O[t, l], _moe(H[t, l], orig, p[t, orig] / p[t, orig].sum(), ex[l])))
    assert max(errs) < 0.04, max(errs)  # ggml quantizes activations for Q4_K dot products
    assert n_sub > 0 and min(errs_orig) > 10 * max(errs)


def test_budget_step_equals_numpy_moe_layer_within_the_budget(tiny_gguf, tmp_path):
    """A batched step under expert_budget=3: each token's output is the renormalized mixture of a non-empty subset
    of its router's experts (the route log records the router's own choice for dropped slots), found here by
    trying every subset against NumPy; the union of the subsets over a step's tokens stays within the budget
    (a token with none inside keeps its best: at most one more expert per overflowing token)."""
    stats, H, O, R, ub = _record_batch(tiny_gguf, tmp_path, expert_budget=3)
    Ws, bs = router_weights(tiny_gguf)
    ex = _experts(tiny_gguf)
    T, L, k = R.shape
    assert stats["budget_dropped"] > 0
    n_dropped = 0
    for l in range(L):
        p = _probs(H, Ws, bs, l)
        chosen = {}
        for t in range(T):
            ids = R[t, l]
            best = None
            for r in range(1, k + 1):
                for sub in itertools.combinations(ids, r):
                    sub = np.array(sub)
                    e = _rel(O[t, l], _moe(H[t, l], sub, p[t, sub] / p[t, sub].sum(), ex[l]))
                    if best is None or e < best[0]:
                        best = (e, sub)
            assert best[0] < 0.04, best[0]
            chosen.setdefault(ub[t], []).append(set(best[1].tolist()))
            n_dropped += k - len(best[1])
        for sets in chosen.values():
            assert len(set().union(*sets)) <= 3 + sum(len(s) == 1 for s in sets)
    assert n_dropped > 0
