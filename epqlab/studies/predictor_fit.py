"""Fitting the trained prefetch predictor (:class:`epqlab.engine.predictor.ExpertPredictor`, whose
docstring states the model): record a model's router inputs and routes on calibration text with plain
llama.cpp, fit the ridge regression per layer and depth, and score recall on held-out text.

    W_{l,d} = G_{l+d} + A,   A = argmin ||X A^T + 1 b^T - (Y - X G_{l+d}^T)||^2 + lam ||A||^2

(arXiv 2511.10676 reports 93-95% for a pre-attention predictor of this kind on real MoEs.) Fit on one
text, evaluate on another: a predictor scored on its calibration text overstates itself.
"""
from __future__ import annotations

import os
import tempfile

import numpy as np

from ..data import calibration_texts
from ..engine.predictor import ExpertPredictor, check_depth, router_fingerprint, router_weights
from ..engine.session import Session
from ..errors import EpqlabError

ALPHAS = (1e-3, 1e-2, 1e-1, 1.0)  # ridge strengths tried, relative to the mean eigenvalue of X^T X
MIN_TOKENS = 16  # calibration tokens a fit needs at the very least (a few hundred in practice)


def record_router_inputs(model, tokens, n_ctx: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Decode ``tokens`` (ids) from an empty context with plain llama.cpp and record every MoE layer's
    router input and routes.

    Returns:
        (H float32 [n_tokens, n_layers, n_embd], routes int32 [n_tokens, n_layers, k]); memory is
        n_tokens x n_layers x n_embd x 4 bytes (393 KiB per token on a 48-layer, 2048-wide model).
    """
    tokens = [int(t) for t in tokens]
    with tempfile.TemporaryDirectory() as td:
        with Session(model, pager=False, route_log=os.path.join(td, "r.npz"),
                     n_ctx=n_ctx or max(512, len(tokens))) as s:
            s.decoder.capture_router_inputs(True)
            for _ in s.iter_logits(tokens):
                pass
            flat, dim = s.decoder.take_router_inputs()
            routes = s.route_log().experts
    T, L = routes.shape[:2]
    if int(dim) <= 0 or flat.size != T * L * int(dim):
        raise EpqlabError(f"recorded {flat.size} router-input values for {T} routed tokens x {L} layers x width {dim}")
    H = np.asarray(flat, np.float32).reshape(T, L, int(dim))
    return H, routes.astype(np.int32)


def _topk(logits: np.ndarray, k: int) -> np.ndarray:
    return np.argpartition(-logits, k - 1, axis=1)[:, :k]


def _hits(pred: np.ndarray, actual: np.ndarray) -> int:
    """|pred ∩ actual| summed over rows (both [T, k] expert ids)."""
    return int((pred[:, :, None] == actual[:, None, :]).any(2).sum())


def _router_logits(H: np.ndarray, Ws, bs, l: int) -> np.ndarray:
    return H[:, l] @ Ws[l].T + bs[l]


def fit_predictor(H: np.ndarray, routes: np.ndarray, Ws, bs, depth: int = 1, val_fraction: float = 0.2,
                  alphas=ALPHAS) -> ExpertPredictor:
    """Fit the predictor (module docstring) on recorded router inputs ``H`` float32 [T, L, n_embd] and
    routes int32 [T, L, k] (from :func:`record_router_inputs`); ``Ws, bs`` from :func:`router_weights`.
    ``alphas``: ridge strengths tried (relative to the mean eigenvalue of X^T X); the one with the best
    top-k recall on the validation tokens (blocks of 32 tokens, ``val_fraction`` of them, spread over the
    text) is refitted on all T tokens. Memory: a few n_embd x n_embd float64 matrices per layer.

    Raises:
        ValueError: depth outside 1..4, fewer than 16 calibration tokens, non-finite inputs, a
            val_fraction outside (0, 1), or shapes that disagree.
    """
    check_depth(depth)
    T, L, D = H.shape
    E, k = Ws[0].shape[0], routes.shape[2]
    if len(Ws) != L or Ws[0].shape[1] != D or routes.shape[:2] != (T, L):
        raise ValueError(f"router inputs {H.shape}, routes {routes.shape} and {len(Ws)} routers disagree")
    if T < MIN_TOKENS:
        raise ValueError(f"{T} calibration tokens are too few to fit a predictor; record at least a few hundred")
    if not np.isfinite(H).all():
        raise ValueError("router inputs contain NaN/inf rows (a layer that did not compute some tokens: record with "
                         "record_router_inputs, which outputs every token's logits)")
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    # validation: one block of 32 tokens in every 1/val_fraction blocks, so it spans the whole text (the
    # calibration texts are concatenated genre after genre; a tail split would hold out one genre)
    cycle = max(2, round(1 / val_fraction))
    is_va = (np.arange(T) // 32) % cycle == cycle - 1
    if not is_va.any() or is_va.all():
        is_va = np.arange(T) >= T - max(1, int(T * val_fraction))
    tr, va = np.flatnonzero(~is_va), np.flatnonzero(is_va)
    W = np.zeros((depth, L, E, D), np.float32)
    b = np.zeros((depth, L, E), np.float32)
    chosen = []
    for d in range(1, depth + 1):
        hits = {a: 0 for a in alphas}
        for l in range(L - d):
            X = H[:, l].astype(np.float64)
            R = _router_logits(H, Ws, bs, l + d) - X @ Ws[l + d].T.astype(np.float64)  # what lookahead misses
            xm, rm = X[tr].mean(0), R[tr].mean(0)
            Xc = X[tr] - xm
            XtX = Xc.T @ Xc
            XtR = Xc.T @ (R[tr] - rm)
            scale = np.trace(XtX) / D
            for a in alphas:
                A = np.linalg.solve(XtX + a * scale * np.eye(D), XtR)  # [D, E]
                c = rm - xm @ A
                pl = X[va] @ (Ws[l + d].T.astype(np.float64) + A) + c
                hits[a] += _hits(_topk(pl, k), routes[va, l + d])
        best = max(alphas, key=lambda a: (hits[a], a))
        chosen.append(best)
        # refit on every token with the chosen strength
        for l in range(L - d):
            X = H[:, l].astype(np.float64)
            R = _router_logits(H, Ws, bs, l + d) - X @ Ws[l + d].T.astype(np.float64)
            xm, rm = X.mean(0), R.mean(0)
            Xc = X - xm
            XtX = Xc.T @ Xc
            A = np.linalg.solve(XtX + best * (np.trace(XtX) / D) * np.eye(D), Xc.T @ (R - rm))
            W[d - 1, l] = (Ws[l + d].T + A).T
            b[d - 1, l] = (rm - xm @ A) + 0.0
    return ExpertPredictor(W, b, tuple(chosen), int(T))


def predictor_recall(H: np.ndarray, routes: np.ndarray, Ws, bs, predictor: ExpertPredictor | None = None,
                     depth: int = 1) -> float:
    """Recall of a top-k prediction made ``depth`` layers ahead, over every (token, layer) pair with
    layer >= depth: |predicted ∩ selected| / |selected|. ``predictor=None`` scores router lookahead
    (``G_{l+d}`` applied to ``h_l``), the baseline."""
    T, L, _ = H.shape
    k = routes.shape[2]
    hit = tot = 0
    for l in range(L - depth):
        if predictor is None:
            pl = H[:, l] @ Ws[l + depth].T + bs[l + depth]
        else:
            pl = predictor.logits(H[:, l], l, depth)
        hit += _hits(_topk(pl, k), routes[:, l + depth])
        tot += T * k
    return hit / tot


def calibration_tokens(session, n_tokens: int, text: str | None = None) -> list[int]:
    """``n_tokens`` token ids to fit on: from ``text``, or an equal share of each of the package's
    calibration texts (:func:`epqlab.data.calibration_texts`, several genres; never the held-out texts).

    Raises:
        ValueError: the text has fewer than ``n_tokens`` tokens.
    """
    if text is not None:
        ids = session.tokenize(text)
    else:
        toks = [session.tokenize(x) for x in calibration_texts().values()]
        share = -(-n_tokens // len(toks))
        ids = [t for x in toks for t in x[:share]]
        ids += [t for x in toks for t in x[share:]][:max(0, n_tokens - len(ids))]  # a short text's shortfall
    if len(ids) < n_tokens:
        raise ValueError(f"the calibration text has {len(ids)} tokens, fewer than the {n_tokens} asked for")
    return ids[:n_tokens]


def fit_for_model(model, n_tokens: int = 1024, depth: int = 2, text: str | None = None) -> ExpertPredictor:
    """Record ``n_tokens`` calibration tokens' router inputs on ``model`` (plain llama.cpp, no memory
    limit: the whole model is mapped) and fit a predictor ``depth`` layers ahead. Takes ~2 min for
    1200 tokens of a 24-layer, 2048-wide model on 2 cores (recording ~70 s, fitting ~35 s per depth).

    Raises:
        ValueError: depth outside 1..4 or fewer than 16 tokens (checked before recording), or a
            calibration text shorter than ``n_tokens``.
    """
    check_depth(depth)
    if n_tokens < MIN_TOKENS:
        raise ValueError(f"{n_tokens} calibration tokens are too few to fit a predictor; use a few hundred or more")

    with Session(model, pager=False, n_ctx=256) as s:
        ids = calibration_tokens(s, n_tokens, text)
    H, routes = record_router_inputs(model, ids)
    Ws, bs = router_weights(model)
    p = fit_predictor(H, routes, Ws, bs, depth=depth)
    p.model_fingerprint = router_fingerprint(model)
    return p


__all__ = ["record_router_inputs", "fit_predictor", "predictor_recall", "calibration_tokens", "fit_for_model",
           "ALPHAS", "MIN_TOKENS"]
