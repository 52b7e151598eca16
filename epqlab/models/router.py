"""Fitting the router of a MoEfied layer: a linear classifier of the FFN input that predicts the oracle's
top-k experts (:func:`fit_router`) and the logit scale that minimises the layer's output error under llama.cpp's
``deepseek`` gating (:func:`choose_temperature`); see :mod:`epqlab.models.moefy`."""
from __future__ import annotations

import numpy as np


def fit_router(xn: np.ndarray, scores: np.ndarray, k: int, *, ridge: float = 1e-3, steps: int = 0,
               lr: float = 1.0) -> np.ndarray:
    """Router (E, n_embd), float32, trained to predict each token's oracle top-k experts (largest
    ``scores``) from its FFN input.

    First a ridge least-squares fit of the centred top-k indicator ``1[e in top-k] - k/E`` (a linear
    probability model), rescaled so its logits have unit std across experts; then, if ``steps`` > 0,
    that many full-batch gradient steps (Nesterov momentum) of multinomial logistic regression
    against targets 1/k on the oracle's experts, in whitened coordinates (features decorrelated by
    ``(X^T X / N + ridge I)^(-1/2)``) so one step size suits every layer. Either way the router separates
    the predicted top-k from the rest, so the k-th and (k+1)-th logits are apart (MoEfication, Zhang et al.
    2022, arXiv 2110.01786, trains its router on the same kind of oracle labels). ``ridge`` is relative to
    the mean feature variance.

    xn: (N, n_embd) FFN inputs; scores: (N, E) from :func:`oracle_scores`."""
    N, D = xn.shape
    E = scores.shape[1]
    top = np.argsort(-scores, axis=1, kind="stable")[:, :k]
    ind = np.zeros((N, E))
    np.put_along_axis(ind, top, 1.0, axis=1)
    X = xn.astype(np.float64)
    G = X.T @ X / N
    lam = ridge * np.trace(G) / D
    W = np.linalg.solve(G + lam * np.eye(D), X.T @ (ind - k / E) / N)  # (D, E)
    W /= max(float((X @ W).std(axis=1).mean()), 1e-12)
    if steps > 0:
        q = ind / k
        w_, V = np.linalg.eigh(G + lam * np.eye(D))
        P = (V / np.sqrt(w_)) @ V.T  # (D, D) whitening
        Pinv = (V * np.sqrt(w_)) @ V.T
        Z = X @ P
        Wt = Pinv @ W * 3.0  # start: the least-squares router with logits std 3
        mom = np.zeros_like(Wt)
        for _ in range(steps):
            look = Wt + 0.9 * mom
            lg = Z @ look
            lg -= lg.max(1, keepdims=True)
            p = np.exp(lg)
            p /= p.sum(1, keepdims=True)
            g = Z.T @ (p - q) / N + lam * (P @ (P @ look))  # penalty lam * ||W||^2 / 2 in original coordinates
            mom = 0.9 * mom - lr * g
            Wt = Wt + mom
        W = P @ Wt
    return W.T.astype(np.float32)


def choose_temperature(xn: np.ndarray, router: np.ndarray, C: np.ndarray, k: int, w_scale: float,
                       grid=(0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 4.0)) -> tuple[float, float, float]:
    """The factor ``t`` (from ``grid``) that router logits are multiplied by, and the gain ``g`` the routed
    experts' down projections are multiplied by, minimising the routed output's squared error against the
    dense routed output ``y_r = sum_e C_e`` on the calibration tokens under llama.cpp's ``deepseek`` gating
    (softmax over all E, top-k, no renormalisation, times ``w_scale``). ``t`` leaves the top-k unchanged
    and sets how unequal the selected experts' weights are; ``g`` is the least-squares gain for each ``t``
    (``<o, y_r> / ||o||^2``, o the gated output), clipped to [0.5, 4]. Returns (t, g, relative error).

    The grid starts at 0.5 on purpose: smaller factors flatten the softmax, so the k-th (boundary) expert
    enters with nearly the top expert's weight and a flip of the k-th choice under different kernel
    rounding costs more. Measured on the default config: t = 0.1 (the error minimum) put llama-cpp-python's
    default kernels 0.55 % away from epqlab's engine on the legal held-out text."""
    y = C.sum(0)
    yy = float((y * y).sum())
    lg = xn @ router.T
    top = np.argsort(-lg, axis=1, kind="stable")[:, :k]
    Csel = C[top.T, np.arange(len(xn))[None, :]]  # (k, N, D)
    best = (1.0, 1.0, np.inf)
    for t in grid:
        z = lg * t
        z = z - z.max(1, keepdims=True)
        p = np.exp(z)
        p /= p.sum(1, keepdims=True)
        w = np.take_along_axis(p, top, 1).T * w_scale  # (k, N)
        o = np.einsum("kn,knd->nd", w, Csel)
        g = float(np.clip((o * y).sum() / max(float((o * o).sum()), 1e-30), 0.5, 4.0))
        err = float(((g * o - y) ** 2).sum()) / yy
        if err < best[2]:
            best = (float(t), g, err)
    return best


__all__ = ["fit_router", "choose_temperature"]
