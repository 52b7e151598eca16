"""The learned expert predictor (prefetch="trained", docs/DESIGN.md §3c): router inputs recorded from the graph
reproduce the routes the model took (NumPy top-k of the GGUF router), the engine's scored hits equal
a NumPy count from the same inputs and the fitted weights, the fit beats router lookahead on held-out
text, logits stay bit-identical to plain llama.cpp, and bad predictors are refused by name."""
from __future__ import annotations

import os

import numpy as np
import pytest

import epqlab
from epqlab.engine import predictor as P
from epqlab.studies import predictor_fit as F
from epqlab.data import heldout_texts
from epqlab.errors import EpqlabError
from exact import check_identical


@pytest.fixture(scope="module")
def fitted(default_path):
    """(predictor fitted on 400 calibration tokens at depth 2, routers, biases)."""
    with epqlab.Session(default_path, pager=False, n_ctx=256) as s:
        ids = F.calibration_tokens(s, 400)
    H, routes = F.record_router_inputs(default_path, ids)
    Ws, bs = P.router_weights(default_path)
    return F.fit_predictor(H, routes, Ws, bs, depth=2), Ws, bs


@pytest.fixture(scope="module")
def heldout(default_path):
    with epqlab.Session(default_path, pager=False, n_ctx=256) as s:
        ids = s.tokenize(heldout_texts()["code"])[:300]
    return F.record_router_inputs(default_path, ids)


def test_recorded_router_inputs_reproduce_the_routes(default_path, heldout, fitted):
    H, routes = heldout
    _, Ws, bs = fitted
    T, L, k = routes.shape
    assert H.shape[:2] == (T, L) and not np.isnan(H).any()
    for l in range(L):  # the router applied in NumPy (float64) to the captured input picks the same experts
        logits = H[:, l].astype(np.float64) @ Ws[l].T.astype(np.float64) + bs[l]
        assert F._hits(F._topk(logits, k), routes[:, l]) >= 0.99 * T * k, l


def test_route_log_probs_are_the_routers_softmax(default_path, fitted, tmp_path):
    """The route log's ``probs`` (gate_rank's weights) equal the router applied in NumPy to the captured input:
    softmax over all experts of H @ W^T + b (float64), at each selected expert, within float32 rounding."""
    _, Ws, bs = fitted
    with epqlab.Session(default_path, pager=False, route_log=tmp_path / "r.npz", n_ctx=256) as s:
        ids = s.tokenize(heldout_texts()["code"])[:40]
        s.decoder.capture_router_inputs(True)
        for _ in s.iter_logits(ids):
            pass
        flat, dim = s.decoder.take_router_inputs()
        log = s.route_log()
    T, L, k = log.experts.shape
    H = np.asarray(flat, np.float32).reshape(T, L, int(dim)).astype(np.float64)
    assert log.probs is not None and log.probs.shape == (T, L, k)
    for l in range(L):
        z = H[:, l] @ Ws[l].T.astype(np.float64) + bs[l]
        p = np.exp(z - z.max(1, keepdims=True))
        p /= p.sum(1, keepdims=True)
        want = np.take_along_axis(p, log.experts[:, l], 1)
        assert np.allclose(log.probs[:, l], want, rtol=1e-3, atol=1e-6), l
        assert (np.diff(log.probs[:, l], axis=1) <= 1e-7).all()  # router order: descending probability


def test_trained_predictor_beats_lookahead_on_heldout_text(heldout, fitted):
    H, routes = heldout
    p, Ws, bs = fitted
    for d in (1, 2):
        la, tr = F.predictor_recall(H, routes, Ws, bs, None, d), F.predictor_recall(H, routes, Ws, bs, p, d)
        assert tr > la + 0.01, (d, la, tr)


def test_bf16_round_hand_values():
    # bfloat16 keeps 7 mantissa bits: near 1.0 its step is 2^-7. Halfway cases round to the even mantissa.
    x = np.array([1.0, 1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-8 + 2**-20, -2.5, 2.0**100 * (1 + 2**-7 + 2**-9)], np.float32)
    want = np.array([1.0, 1.0, 1 + 2**-6, 1 + 2**-7, -2.5, 2.0**100 * (1 + 2**-7)], np.float32)
    assert np.array_equal(P.bf16_round(x), want)


def test_engine_predictor_logits_equal_numpy(default_path, heldout, fitted):
    """The hook's trained predictor (W in Q8_0 with ggml-cpu's vec_dot over a Q8_0 input, or W in bfloat16 over the
    float32 input) against NumPy's float64 product of the same rounded operands (gguf-py's Q8_0), per layer and depth;
    the two types' logits differ by far more than the tolerance, so a hook applying the wrong type fails."""
    import dataclasses

    H, _ = heldout
    p = fitted[0]
    got = {}
    with epqlab.Session(default_path, arena_bytes="6MiB") as s:
        eng = s.decoder.engine
        for wt in P.WEIGHT_TYPES:
            q = dataclasses.replace(p, weight_type=wt)
            eng.set_predictor(q.W, q.b, wt)
            for d in (1, 2):
                for l in (0, H.shape[1] // 2, H.shape[1] - 1 - d):
                    rows = H[::37, l]
                    want = (P.applied_input(rows, wt).astype(np.float64) @ P.applied_weights(q.W[d - 1, l], wt).T.astype(np.float64)
                            + q.b[d - 1, l])
                    eng_l = np.stack([eng.predictor_logits(l, d, r) for r in rows])
                    scale = np.abs(want).max()
                    assert np.abs(eng_l - want).max() <= 2e-6 * scale, (wt, d, l, np.abs(eng_l - want).max() / scale)
                    got[wt, d, l] = eng_l
        with pytest.raises(ValueError, match="outside the predictor"):
            eng.predictor_logits(0, 3, H[0, 0])
        with pytest.raises(ValueError, match="width"):
            eng.predictor_logits(0, 1, H[0, 0, :-1])
        with pytest.raises(ValueError, match="'q8_0' or 'bf16'"):
            eng.set_predictor(p.W, p.b, "q4_0")
    gap = max(np.abs(got["q8_0", k[1], k[2]] - got["bf16", k[1], k[2]]).max() / np.abs(got["bf16", k[1], k[2]]).max()
              for k in got if k[0] == "bf16")
    assert gap > 1e-3, gap


@pytest.mark.parametrize("weight_type", P.WEIGHT_TYPES)
def test_engine_hits_equal_numpy_count(default_path, fitted, tmp_path, weight_type):
    """The engine's scored prediction (depth 1) against a NumPy top-k of W h + b on the router inputs it
    saw, decode steps only, with W (and for Q8_0 h) rounded as the engine holds them in each weight type."""
    import dataclasses

    p = dataclasses.replace(fitted[0], weight_type=weight_type)
    with epqlab.Session(default_path, arena_bytes="6MiB", prefetch="trained", prefetch_predictor=p, prefetch_depth=2,
                        route_log=tmp_path / "r.npz") as s:
        s.decoder.capture_router_inputs(True)
        g = s.generate(heldout_texts()["prose"][:200], 12)
        flat, dim = s.decoder.take_router_inputs()
        routes, _, ubs, _ = s.decoder.routes(s.n_expert_used)
    st = g.stats
    T, L, k = routes.shape
    H = np.asarray(flat).reshape(T, L, dim)
    u, c = np.unique(ubs, return_counts=True)
    single = np.isin(ubs, u[c == 1])  # single-token ubatches: the decode steps that prefetch
    assert single.sum() == 11
    hits = sum(F._hits(F._topk(P.applied_input(H[single, l], weight_type).astype(np.float64)
                               @ P.applied_weights(p.W[0, l], weight_type).T.astype(np.float64) + p.b[0, l], k),
                       routes[single, l + 1]) for l in range(L - 1))
    assert st["pred_experts"] == single.sum() * (L - 1) * k
    assert abs(st["pred_correct"] - hits) <= 2, (st["pred_correct"], hits)


@pytest.mark.parametrize("pipeline", [False, True])
def test_trained_prefetch_keeps_logits_bit_identical(default_path, ref, fitted, pipeline, tmp_path):
    p, _, _ = fitted
    path = p.save(tmp_path / "pred.npz")  # the saved file: round trip included
    q = P.ExpertPredictor.load(path)
    assert np.array_equal(q.W, p.W) and np.array_equal(q.b, p.b) and q.alpha == p.alpha
    st = check_identical(default_path, ref, "lru", "trained", 0, pipeline, depth=2, predictor=str(path))
    assert st["pred_correct"] / st["pred_experts"] > 0.5


def test_predictor_errors(default_path, fitted, tmp_path):
    p, _, _ = fitted
    with pytest.raises(ValueError, match="needs prefetch_predictor"):
        epqlab.Session(default_path, prefetch="trained")
    with pytest.raises(ValueError, match="prefetch='trained' and 'oracle' only"):
        epqlab.Session(default_path, prefetch="lookahead", prefetch_predictor=p)
    with pytest.raises(ValueError, match="exceeds the predictor's depth"):
        epqlab.Session(default_path, prefetch="trained", prefetch_predictor=p, prefetch_depth=3)
    other = P.ExpertPredictor(p.W[:, :-1], p.b[:, :-1], p.alpha, p.n_tokens)
    with pytest.raises(ValueError, match="fit one on this model"):
        epqlab.Session(default_path, prefetch="trained", prefetch_predictor=other)
    import dataclasses

    with pytest.raises(ValueError, match="fitted on another model"):
        epqlab.Session(default_path, prefetch="trained", prefetch_predictor=dataclasses.replace(p, model_fingerprint="0" * 40))
    fewer = P.ExpertPredictor(p.W[:, :, :-1], p.b[:, :, :-1], p.alpha, p.n_tokens)  # one expert short
    with pytest.raises(ValueError, match="fit one on this model"):
        epqlab.Session(default_path, prefetch="trained", prefetch_predictor=fewer)
    with pytest.raises(ValueError, match="weight_type must be one of q8_0, bf16"):
        dataclasses.replace(p, weight_type="q4_0")
    narrow = P.ExpertPredictor(p.W[..., :48], p.b, p.alpha, p.n_tokens)  # width 48: not whole Q8_0 blocks
    with pytest.raises(ValueError, match="not a multiple of q8_0's block of 32"):
        narrow.check_model(*narrow.shape)
    dataclasses.replace(narrow, weight_type="bf16").check_model(*narrow.shape)
    bf = P.ExpertPredictor.load(dataclasses.replace(p, weight_type="bf16").save(tmp_path / "bf.npz"))
    assert bf.weight_type == "bf16" and np.array_equal(bf.W, p.W)
    for content in (b"no", b""):
        bad = tmp_path / "not.npz"
        bad.write_bytes(content)
        with pytest.raises(EpqlabError, match="not an epqlab expert predictor"):
            epqlab.Session(default_path, prefetch="trained", prefetch_predictor=bad)
    W = p.W.copy()
    W[0, 0, 0, 0] = np.nan
    P.ExpertPredictor(W, p.b, p.alpha, p.n_tokens).save(tmp_path / "nan.npz")
    with pytest.raises(EpqlabError, match="not finite"):
        epqlab.Session(default_path, prefetch="trained", prefetch_predictor=tmp_path / "nan.npz")
    with epqlab.Session(default_path, arena_bytes="6MiB") as s:  # the native check, below the Python one
        with pytest.raises(ValueError, match="experts per layer"):
            s.decoder.engine.set_predictor(fewer.W, fewer.b)
        with pytest.raises(ValueError, match="not finite"):
            s.decoder.engine.set_predictor(W, p.b)
    with epqlab.Session(default_path, arena_bytes="6MiB") as s:
        with pytest.raises(ValueError, match="needs route recording"):
            s.decoder.capture_router_inputs(True)
    H = np.ones((32, 2, 8), np.float32)
    H[0, 1] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        F.fit_predictor(H, np.zeros((32, 2, 1), np.int32), [np.zeros((3, 8), np.float32)] * 2, [np.zeros(3, np.float32)] * 2)
    with pytest.raises(ValueError, match="too few"):
        F.fit_predictor(np.zeros((4, 2, 8), np.float32), np.zeros((4, 2, 1), np.int32),
                        [np.zeros((3, 8), np.float32)] * 2, [np.zeros(3, np.float32)] * 2)


def test_cli_fit_and_eval(default_path, tmp_path, capsys):
    from epqlab.cli import main

    out = tmp_path / "p.npz"
    assert main(["predictor", "fit", str(default_path), str(out), "--depth", "5"]) == 1  # refused before recording
    assert "depth must be 1..4" in capsys.readouterr().err
    assert main(["predictor", "fit", str(default_path), str(out), "--tokens", "200", "--depth", "1", "--weight-type", "bf16"]) == 0
    assert os.path.exists(out)
    q = P.ExpertPredictor.load(out)
    assert q.model_fingerprint == P.router_fingerprint(default_path) and q.weight_type == "bf16"
    assert main(["predictor", "eval", str(default_path), str(out), "--text", "legal", "--tokens", "64"]) == 0
    text = capsys.readouterr().out
    assert "1 layer(s) ahead: lookahead" in text and "trained q8_0" in text and "trained bf16" in text
    assert main(["run", str(default_path), "-n", "4", "--prefetch", "trained",
                 "--predictor", str(out)]) == 0
    assert "trained: precision" in capsys.readouterr().out
    # a depth the predictor was not fitted for: one clean error line
    assert main(["run", str(default_path), "-n", "4", "--prefetch", "trained", "--predictor", str(out),
                 "--prefetch-depth", "2"]) == 1
    assert "exceeds the predictor's depth 1" in capsys.readouterr().err
