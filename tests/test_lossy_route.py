"""The lossy routing knobs (native/engine/hook_lossy.h): cache-aware routing (route_bias='cache', route_delta) and
entropy-adaptive top-k (adaptive_k). Checked against hand-worked routes, plain llama.cpp's logits (delta 0 /
a rule that keeps every k), and a NumPy reference of the MoE layer computed from the recorded router inputs
and the GGUF's own expert weights."""
from __future__ import annotations

import math

import numpy as np
import pytest

import epqlab
from epqlab import _core
from epqlab.engine.predictor import router_weights
from epqlab.studies.ablation.grid import memory_points
from exact import N_STEPS, THREADS, small_arena

# ---- the rule, on hand-built routes ---------------------------------------------------------------------------

Q = np.array([0.375, 0.25, 0.1875, 0.125, 0.0625], np.float32)  # exact in float32: margins compare exactly


def _route(ids, resident, delta, thr=(), ks=()):
    res = np.zeros(len(Q), np.uint8)
    res[list(resident)] = 1
    out, keep, n = _core.lossy_route(Q, np.array(ids, np.int32), res, delta, list(thr), list(ks))
    return out.tolist(), keep.tolist(), n


def test_cache_route_by_hand():
    # router picks 0 (0.375) and 1 (0.25), neither resident; resident: 2 (0.1875) and 3 (0.125).
    # delta 0.1: slot 0 -> 2 would lose 0.1875 >= 0.1 (outside: kept); slot 1 -> 2 loses 0.0625 < 0.1 (substituted)
    assert _route([0, 1], {2, 3}, 0.1) == ([0, 2], [1, 1], 1)
    # delta 0.25: slot 0 takes the best resident (2), slot 1 the next one not used yet (3), never 2 twice
    assert _route([0, 1], {2, 3}, 0.25) == ([2, 3], [1, 1], 2)
    # delta 0, and a margin exactly equal to the loss, change nothing (strict)
    assert _route([0, 1], {2, 3}, 0.0) == ([0, 1], [1, 1], 0)
    assert _route([0, 1], {2}, 0.0625) == ([0, 1], [1, 1], 0)
    # a resident expert already chosen is not a candidate; a resident choice is never replaced
    assert _route([0, 2], {2}, 0.5) == ([0, 2], [1, 1], 0)
    assert _route([0, 1], {1, 3}, 0.3) == ([3, 1], [1, 1], 1)


def test_adaptive_k_by_hand():
    flat = np.full(8, 1 / 8, np.float32)  # H = ln 8 = 2.08 nats -> k 4, capped at the graph's 3
    peaked = np.array([0.9, 0.05, 0.05, 0, 0, 0, 0, 0], np.float32)  # H = 0.394 -> k 1
    mid = np.array([0.6, 0.3, 0.1, 0, 0, 0, 0, 0], np.float32)  # H = 0.898 -> k 2
    h = lambda q: float(-(q[q > 0] * np.log(q[q > 0])).sum())  # noqa: E731
    assert math.isclose(_core.router_entropy(flat), math.log(8), rel_tol=1e-6)
    assert math.isclose(_core.router_entropy(peaked), h(peaked), rel_tol=1e-6) and h(peaked) < 0.6 < h(mid) < 1.2
    res = np.zeros(8, np.uint8)
    for q, ids, want_ids, want_keep in ((flat, [3, 1, 2], [3, 1, 2], [1, 1, 1]),
                                        (peaked, [0, 1, 2], [0, 0, 0], [1, 0, 0]),
                                        (mid, [1, 0, 2], [1, 0, 0], [1, 1, 0])):  # keeps the 2 most probable slots
        out, keep, n = _core.lossy_route(q, np.array(ids, np.int32), res, 0.0, [0.6, 1.2], [1, 2, 4])
        assert out.tolist() == want_ids and keep.tolist() == want_keep and n == 0


def test_bad_knobs_are_refused_with_the_reason(mini_gguf):
    with pytest.raises(ValueError, match="route_bias and skip_cold are exclusive"):
        epqlab.Session(mini_gguf, route_bias="cache", route_delta=0.1, skip_cold=0.1)
    with pytest.raises(ValueError, match="route_bias and prefetch are exclusive"):
        epqlab.Session(mini_gguf, route_bias="cache", route_delta=0.1, prefetch="lookahead")
    with pytest.raises(ValueError, match="adaptive_k and skip_cold are exclusive"):
        epqlab.Session(mini_gguf, adaptive_k=True, skip_cold=0.1)
    with pytest.raises(ValueError, match="needs route_delta"):
        epqlab.Session(mini_gguf, route_bias="cache")
    with pytest.raises(ValueError, match="route_delta is the margin"):
        epqlab.Session(mini_gguf, route_delta=0.1)
    with pytest.raises(ValueError, match="unknown route_bias"):
        epqlab.Session(mini_gguf, route_bias="resident", route_delta=0.1)
    with pytest.raises(ValueError, match="probability margin in 0..1"):
        epqlab.Session(mini_gguf, route_bias="cache", route_delta=-0.1)
    with pytest.raises(ValueError, match="one more k than thresholds"):
        epqlab.Session(mini_gguf, adaptive_k=((0.6, 1.2), (1, 2)))
    with pytest.raises(ValueError, match="increasing"):
        epqlab.Session(mini_gguf, adaptive_k=((1.2, 0.6), (1, 2, 4)))
    with pytest.raises(ValueError, match="pager"):
        epqlab.Session(mini_gguf, adaptive_k=True, pager=False)
    # what composes: adaptive-k under an expert_used cap, with cache-aware routing, with pipelined reads
    with epqlab.Session(mini_gguf, adaptive_k=True, expert_used=1, route_bias="cache", route_delta=0.1) as s:
        assert s.pipeline_reads and s.n_expert_used == 1 and s.adaptive_k == ((0.6, 1.2), (1, 2, 4))


# ---- exactness: delta 0, and a rule that keeps every k ----------------------------------------------------------

@pytest.mark.parametrize("kw", [dict(route_bias="cache", route_delta=0.0), dict(adaptive_k=((100.0,), (3, 3)))],
                         ids=["delta0", "adaptive-keep-all"])
def test_no_change_is_bit_identical_to_llama_cpp(default_path, ref, kw):
    toks, (rp, rs, rg) = ref
    # half of the experts' slots: a layer has resident experts to substitute (at the smallest arenas it has none)
    half = memory_points(epqlab.inspect(default_path), arenas=[0.5])[0].session_kwargs()
    with epqlab.Session(default_path, **half, n_threads=THREADS, io_threads=2, **kw) as s:
        p, st, gen = s.greedy_trace(toks, N_STEPS)
        stats = s.stats
        mean_k = s.adaptive_k_per_layer()
    assert np.array_equal(p, rp) and np.array_equal(st, rs) and gen == rg
    L, k = len(epqlab.inspect(default_path).layers), 3
    assert stats["misses"] > 0 and stats["lossy_slots"] == (N_STEPS - 1) * L * k  # the knob examined every decode slot
    assert stats["route_changed"] == stats["route_substituted"] == stats["adaptive_dropped"] == 0
    assert stats["routing_agreement"] == 1.0
    if "adaptive_k" in kw:
        assert np.all(mean_k == 3.0)
    else:
        assert np.isnan(mean_k).all()


# ---- the MoE layer against NumPy, from recorded router inputs ----------------------------------------------------

def _experts(path):
    from gguf import GGUFReader
    from gguf.quants import dequantize

    r = GGUFReader(path)
    t = {x.name: x for x in r.tensors}
    lay = epqlab.inspect(path)
    out = []
    for b in lay.moe_layers:
        g, u, d = (dequantize(t[f"blk.{b}.ffn_{n}_exps.weight"].data, t[f"blk.{b}.ffn_{n}_exps.weight"].tensor_type)
                   .astype(np.float64) for n in ("gate", "up", "down"))
        out.append((g, u, d))  # (E, n_ff, n_embd), (E, n_ff, n_embd), (E, n_embd, n_ff)
    return out


def _moe(x, ids, w, ex):
    """llama.cpp's MoE mixture of one token: sum_s w_s * down_e(silu(gate_e x) * up_e x)."""
    g, u, d = ex
    y = np.zeros(len(x))
    for e, ws in zip(ids, w):
        h = g[e] @ x
        y += ws * (d[e] @ (h / (1 + np.exp(-h)) * (u[e] @ x)))
    return y


def _record(path, tmp_path, **kw):
    """Greedy-decode the exact.py prompt with knobs ``kw`` at half the experts' slots, recording routes, router
    inputs and MoE outputs; returns (stats, mean k per layer, decode-token rows: H [T, L, D], out [T, L, D],
    routes [T, L, k])."""
    half = memory_points(epqlab.inspect(path), arenas=[0.5])[0].session_kwargs()
    with epqlab.Session(path, **half, n_threads=THREADS, route_log=tmp_path / "r.npz", n_ctx=256, **kw) as s:
        s.decoder.capture_router_inputs(True)
        toks = s.tokenize("A CPU cache is a small, fast memory that sits between the processor and main memory.")
        s.greedy_trace(toks, 12)
        outs = np.asarray(s.decoder.engine.moe_outputs(), np.float32)
        kept = np.asarray(s.decoder.engine.take_adaptive_k_log(), np.int32)
        flat, dim = s.decoder.take_router_inputs()
        log = s.route_log()
        stats, mean_k = s.stats, s.adaptive_k_per_layer()
    T, L, _ = log.experts.shape
    H = np.asarray(flat, np.float32).reshape(T, L, int(dim))
    O = outs.reshape(T, L, int(dim))
    ub = np.asarray(log.ubatch)
    single = np.array([np.sum(ub == u) == 1 for u in ub])  # decode steps: one-token forward passes
    kept = kept.reshape(T, L)[single] if kept.size else None
    return stats, mean_k, H[single].astype(np.float64), O[single].astype(np.float64), log.experts[single], kept


def _probs(H, Ws, bs, l):
    z = H[:, l] @ Ws[l].T.astype(np.float64) + bs[l]
    p = np.exp(z - z.max(1, keepdims=True))
    return p / p.sum(1, keepdims=True)


def _rel(a, b):
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def test_substituted_step_equals_numpy_moe_layer(tiny_gguf, tmp_path):
    """qwen3moe normalizes the top-k weights: the substituted step's MoE output is the mixture of the experts
    actually used, weighted by their router probabilities renormalized over them."""
    stats, _, H, O, R, _ = _record(tiny_gguf, tmp_path, route_bias="cache", route_delta=0.9)
    Ws, bs = router_weights(tiny_gguf)
    ex = _experts(tiny_gguf)
    T, L, k = R.shape
    assert T >= 10 and stats["route_substituted"] > 0
    n_sub, errs_used, errs_orig = 0, [], []
    for l in range(L):
        p = _probs(H, Ws, bs, l)
        for t in range(T):
            used = R[t, l]
            srt = np.sort(p[t])[::-1]
            orig = np.argsort(-p[t], kind="stable")[:k]
            w = p[t, used] / p[t, used].sum()
            ref = _moe(H[t, l], used, w, ex[l])
            errs_used.append(_rel(O[t, l], ref))
            if srt[k - 1] - srt[k] > 1e-3:  # a clear top-k in float64: the router's own choice is known
                changed = len(set(orig) - set(used))
                n_sub += changed
                if changed:
                    wo = p[t, orig] / p[t, orig].sum()
                    errs_orig.append(_rel(O[t, l], _moe(H[t, l], orig, wo, ex[l])))
    assert max(errs_used) < 0.04, max(errs_used)  # ggml quantizes activations for Q4_K dot products (measured <= 2.4%)
    assert errs_orig and min(errs_orig) > 10 * max(errs_used)  # the router's own experts would give another output
    # substitutions the hook counted = slots whose expert differs from NumPy's top-k (clear top-k tokens)
    assert 0 < n_sub <= stats["route_substituted"]
    assert stats["route_changed"] == stats["route_substituted"] and stats["lossy_slots"] == T * L * k


def test_adaptive_k_follows_the_entropy_rule(tiny_gguf, tmp_path):
    """k per (token, layer) equals the rule applied to the entropy of softmax(router logits) computed here from
    the recorded router inputs and the GGUF's router weights; the output is the kept (most probable) experts'
    renormalized mixture; the route log keeps the router's own k ids."""
    Ws, bs = router_weights(tiny_gguf)
    # a threshold at the median of this model's router entropies (an exact run), so that both k = 1 and k = 2 occur
    _, _, H0, _, _, _ = _record(tiny_gguf, tmp_path)
    ent0 = np.concatenate([-(p * np.log(p)).sum(1) for p in (_probs(H0, Ws, bs, l) for l in range(H0.shape[1]))])
    thr, ks = (float(np.median(ent0)),), (1, 2)
    stats, mean_k, H, O, R, K = _record(tiny_gguf, tmp_path, adaptive_k=(thr, ks))
    ex = _experts(tiny_gguf)
    T, L, k = R.shape
    seen, ks_rule = set(), np.zeros((T, L))
    for l in range(L):
        p = _probs(H, Ws, bs, l)
        ent = -(p * np.log(np.maximum(p, 1e-300))).sum(1)
        for t in range(T):
            want = ks[int(np.searchsorted(thr, ent[t], side="right"))]
            ks_rule[t, l] = min(want, k)
            got = int(K[t, l])
            if min(abs(ent[t] - x) for x in thr) > 1e-4:
                assert got == ks_rule[t, l], (t, l, ent[t])
            seen.add(got)
            order = np.argsort(-p[t], kind="stable")
            keep = order[:got]  # the kept slots are the most probable ones
            assert sorted(R[t, l].tolist()) == sorted(order[:k].tolist())  # the log keeps the router's k ids
            w = p[t, keep] / p[t, keep].sum()
            assert _rel(O[t, l], _moe(H[t, l], keep, w, ex[l])) < 0.04  # as above: quantized activations
    assert seen == {1, 2}, seen
    assert np.allclose(mean_k, ks_rule.mean(0))
    assert stats["adaptive_dropped"] == int((k - ks_rule).sum())
