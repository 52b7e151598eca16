"""A learned expert predictor for prefetch (``prefetch="trained"``): layer l+d's router logits
predicted from layer l's router input by a linear map fitted on recorded router inputs.

Router lookahead (``prefetch="lookahead"``) applies layer l+d's router ``G_{l+d}`` (``ffn_gate_inp``,
[n_expert, n_embd]) to layer l's router input ``h_l`` (the RMS-normed FFN input the router reads,
[n_embd]): it assumes ``h_{l+d} ≈ h_l``. What the layers in between add is partly linear in ``h_l``, so
a per-layer linear map learned from the model's own activations predicts better (a pre-attention
predictor of this kind reaches 93-95% on real MoEs: arXiv 2511.10676). The map is fitted as a ridge
regression shrunk toward lookahead, so that with little data it falls back to lookahead:

    W_{l,d} = G_{l+d} + A,   A = argmin ||X A^T + 1 b^T - (Y - X G_{l+d}^T)||^2 + lam ||A||^2

with ``X`` = recorded ``h_l`` rows [T, n_embd], ``A`` [n_expert, n_embd], ``Y = H_{l+d} G_{l+d}^T`` (+ the
router's bias, if any) the router logits the model computed [T, n_expert], ``b`` an unpenalised intercept
and ``lam`` = ``alpha * trace(X_c^T X_c) / n_embd`` with ``alpha`` chosen by top-k recall on held-back
blocks of the calibration tokens. The prediction is top-k of ``W_{l,d} h_l + b``. Fit on one text,
evaluate on another (:func:`predictor_recall`): a predictor scored on its calibration text overstates
itself.
"""
from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import EpqlabError

ALPHAS = (1e-3, 1e-2, 1e-1, 1.0)  # ridge strengths tried, relative to the mean eigenvalue of X^T X
MAX_DEPTH = 4  # layers ahead a predictor is fitted for (W [depth, L, E, D] float32: depth x a one-layer fit's bytes)
MIN_TOKENS = 16  # calibration tokens a fit needs at the very least (a few hundred in practice)


def _check_depth(depth: int) -> None:
    if not 1 <= depth <= MAX_DEPTH:
        raise ValueError(f"depth must be 1..{MAX_DEPTH} layers ahead, got {depth}")


@dataclass
class ExpertPredictor:
    """Per-depth, per-layer linear predictors of router logits.

    Attributes:
        W: float32 [depth, n_layers, n_expert, n_embd]: ``W[d-1, l]`` maps MoE layer l's router input
            to MoE layer l+d's router logits (rows for l+d >= n_layers are zero and unused).
        b: float32 [depth, n_layers, n_expert]: intercepts.
        alpha: the ridge strength chosen per depth (relative; see the module docstring).
        n_tokens: calibration tokens the fit used.
        model_fingerprint: :func:`router_fingerprint` of the model it was fitted on ("" = unknown); a
            Session refuses a predictor whose fingerprint is not the model's.
    """

    W: np.ndarray
    b: np.ndarray
    alpha: tuple
    n_tokens: int
    model_fingerprint: str = ""

    @property
    def depth(self) -> int:
        return int(self.W.shape[0])

    @property
    def shape(self) -> tuple[int, int, int]:
        """(n_layers, n_expert, n_embd)."""
        return tuple(int(x) for x in self.W.shape[1:])

    def logits(self, h: np.ndarray, layer: int, d: int = 1) -> np.ndarray:
        """Predicted router logits of MoE layer ``layer + d`` from layer ``layer``'s router inputs
        ``h`` [T, n_embd]: float32 [T, n_expert]."""
        return h @ self.W[d - 1, layer].T + self.b[d - 1, layer]

    def save(self, path) -> Path:
        """Write the predictor as NPZ (``.npz`` appended when missing, as NumPy does); returns the path written."""
        path = Path(path)
        np.savez(path, W=self.W, b=self.b, alpha=np.asarray(self.alpha, np.float64), n_tokens=self.n_tokens,
                 model_fingerprint=np.asarray(self.model_fingerprint))
        return path if path.suffix == ".npz" else path.with_suffix(path.suffix + ".npz")

    @classmethod
    def load(cls, path) -> "ExpertPredictor":
        """Raises EpqlabError when the file is not a predictor saved by :meth:`save`."""
        import zipfile

        try:
            with np.load(path) as z:
                W, b = z["W"].astype(np.float32, copy=False), z["b"].astype(np.float32, copy=False)
                fp = str(z["model_fingerprint"]) if "model_fingerprint" in z.files else ""
                p = cls(W, b, tuple(float(a) for a in z["alpha"]), int(z["n_tokens"]), fp)
        except (OSError, KeyError, ValueError, EOFError, zipfile.BadZipFile, AttributeError, TypeError) as e:
            raise EpqlabError(f"{path} is not an epqlab expert predictor ({e}); fit one with "
                              "epqlab.predictor.fit_predictor and save it with .save(path)") from None
        if W.ndim != 4 or b.shape != W.shape[:3] or not 1 <= W.shape[0] <= MAX_DEPTH:
            raise EpqlabError(f"{path}: predictor arrays W {W.shape} and b {b.shape} are not [depth<={MAX_DEPTH}, layers, "
                              "experts, width] and [depth, layers, experts]; refit it")
        if not (np.isfinite(W).all() and np.isfinite(b).all()):
            raise EpqlabError(f"{path}: the predictor's weights are not finite (NaN or inf); refit it")
        return p

    def check_model(self, n_layers: int, n_expert: int, n_embd: int | None = None) -> None:
        """Raises ValueError when the predictor was fitted for another shape of model (n_embd None: not checked)."""
        L, E, D = self.shape
        if (L, E) != (n_layers, n_expert) or (n_embd is not None and D != n_embd):
            raise ValueError(f"the predictor was fitted for {L} MoE layers x {E} experts x width {D}, the model has "
                             f"{n_layers} x {n_expert} x {n_embd}: fit one on this model (epqlab.predictor.fit_predictor)")


def router_fingerprint(model) -> str:
    """SHA-1 (hex) of the first MoE layer's router tensor bytes as stored in the GGUF, with the model's
    MoE layer count: cheap (one tensor of n_expert x n_embd) and different between models of one shape."""
    import hashlib

    from .layout import _open_reader, inspect

    lay = inspect(model)
    il = lay.moe_layers[0]
    t = next((t for t in _open_reader(Path(lay.path)).tensors if t.name == f"blk.{il}.ffn_gate_inp.weight"), None)
    if t is None:
        raise ValueError(f"{lay.path}: block {il} has no router (blk.{il}.ffn_gate_inp.weight)")
    h = hashlib.sha1(np.ascontiguousarray(t.data).tobytes())
    h.update(f"|{len(lay.moe_layers)}".encode())
    return h.hexdigest()


def router_weights(model) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Each MoE layer's router, read with gguf-py: (weights [n_expert, n_embd] float32 per layer,
    biases [n_expert] float32 per layer, zeros where the model has none)."""
    from gguf.quants import dequantize

    from .layout import _open_reader, inspect

    lay = inspect(model)
    r = _open_reader(Path(lay.path))
    ts = {t.name: t for t in r.tensors}
    Ws, bs = [], []
    for il in lay.moe_layers:
        t = ts.get(f"blk.{il}.ffn_gate_inp.weight")
        if t is None:
            raise ValueError(f"{lay.path}: block {il} has no router (blk.{il}.ffn_gate_inp.weight)")
        W = dequantize(t.data, t.tensor_type).astype(np.float32).reshape(lay.n_expert, -1)
        tb = ts.get(f"blk.{il}.ffn_gate_inp.bias")
        b = (dequantize(tb.data, tb.tensor_type).astype(np.float32).reshape(-1) if tb is not None
             else np.zeros(lay.n_expert, np.float32))
        Ws.append(W)
        bs.append(b)
    return Ws, bs


def record_router_inputs(model, tokens, n_ctx: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Decode ``tokens`` (ids) from an empty context with plain llama.cpp and record every MoE layer's
    router input and routes.

    Returns:
        (H float32 [n_tokens, n_layers, n_embd], routes int32 [n_tokens, n_layers, k]); memory is
        n_tokens x n_layers x n_embd x 4 bytes (393 KiB per token on a 48-layer, 2048-wide model).
    """
    from .session import Session

    tokens = [int(t) for t in tokens]
    with tempfile.TemporaryDirectory() as td:
        with Session(model, pager=False, route_log=os.path.join(td, "r.npz"),
                     n_ctx=n_ctx or max(512, len(tokens))) as s:
            s._engine.set_capture_inputs(True)
            for _ in s.iter_logits(tokens):
                pass
            flat, dim = s._engine.take_router_inputs()
            routes = np.concatenate([p[0] for p in s._route_parts])
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
    _check_depth(depth)
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
    from .data import calibration_texts

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
    from .session import Session

    _check_depth(depth)
    if n_tokens < MIN_TOKENS:
        raise ValueError(f"{n_tokens} calibration tokens are too few to fit a predictor; use a few hundred or more")

    with Session(model, pager=False, n_ctx=256) as s:
        ids = calibration_tokens(s, n_tokens, text)
    H, routes = record_router_inputs(model, ids)
    Ws, bs = router_weights(model)
    p = fit_predictor(H, routes, Ws, bs, depth=depth)
    p.model_fingerprint = router_fingerprint(model)
    return p
