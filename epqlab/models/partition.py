"""Partitioning a dense FFN's neurons into experts and scoring the experts per token (MoEfication, Zhang et
al. 2022; the method is described in :mod:`epqlab.models.moefy`)."""
from __future__ import annotations

import numpy as np


def _balanced_assign(cost: np.ndarray, cap: int) -> np.ndarray:
    """Greedy balanced assignment: rows (items) to columns (groups), at most ``cap`` items per group,
    cheapest (item, group) pairs first. cost (n, G) with n <= G * cap."""
    n, G = cost.shape
    lab = np.full(n, -1, dtype=np.int64)
    cnt = np.zeros(G, dtype=np.int64)
    left = n
    for idx in np.argsort(cost, axis=None, kind="stable"):
        i, g = divmod(int(idx), G)
        if lab[i] < 0 and cnt[g] < cap:
            lab[i] = g
            cnt[g] += 1
            left -= 1
            if not left:
                break
    return lab


def neuron_contributions(a: np.ndarray, down: np.ndarray) -> np.ndarray:
    """(N, n_ff) contribution sizes ``|a_i| * ||down[:, i]||`` of each neuron on each token."""
    return np.abs(a) * np.linalg.norm(down, axis=0)[None, :]


def partition_neurons(contrib: np.ndarray, n_expert: int, cap: int, method: str, rng) -> np.ndarray:
    """Assign each neuron (column of ``contrib``, (N, n)) to one of ``n_expert`` groups of at most
    ``cap`` neurons. Returns labels (n,).

    ``coactivation``: balanced k-means (MoEfication) on the neurons' contribution profiles over the
    calibration tokens, each normalised to unit length, so neurons that are large on the same tokens
    share an expert. ``random``: a random split (a baseline).
    """
    n = contrib.shape[1]
    if method == "random":
        return rng.permutation(np.arange(n) % n_expert)
    if method != "coactivation":
        raise ValueError(f"unknown partition method {method!r}")
    feat = (contrib / (np.linalg.norm(contrib, axis=0, keepdims=True) + 1e-9)).T.astype(np.float32)  # (n, N)
    cent = feat[rng.choice(n, n_expert, replace=False)]
    lab = None
    for _ in range(10):
        d = (cent * cent).sum(1)[None, :] - 2 * feat @ cent.T  # squared distance minus ||feat||^2
        new = _balanced_assign(d, cap)
        if lab is not None and np.array_equal(new, lab):
            break
        lab = new
        cent = np.stack([feat[lab == g].mean(0) for g in range(n_expert)])
    return lab


def expert_outputs(a: np.ndarray, down: np.ndarray, labels: np.ndarray, n_expert: int) -> np.ndarray:
    """(E, N, n_embd) float32: each routed expert's part ``C_e`` of the dense FFN output.
    a (N, n) activations of the routed neurons, down (n_embd, n), labels (n,) expert of each neuron."""
    out = np.empty((n_expert, len(a), down.shape[0]), np.float32)
    for e in range(n_expert):
        m = labels == e
        out[e] = a[:, m] @ down[:, m].T
    return out


def oracle_scores(C: np.ndarray) -> np.ndarray:
    """(N, E) error reduction of adding expert e alone to an empty routed output, relative to the routed
    output's energy: ``(2 <C_e, y_r> - ||C_e||^2) / ||y_r||^2`` with ``y_r = sum_e C_e``. Its top-k per
    token is the *oracle* expert set the router learns to predict."""
    y = C.sum(0)
    yy = (y * y).sum(-1) + 1e-6
    return ((2 * np.einsum("end,nd->ne", C, y) - np.einsum("end,end->ne", C, C)) / yy[:, None]).astype(np.float64)


__all__ = ["neuron_contributions", "partition_neurons", "expert_outputs", "oracle_scores"]
