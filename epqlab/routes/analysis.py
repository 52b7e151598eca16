"""Routing-locality analyses of a :class:`~epqlab.routes.RouteLog`, each returning numbers or a DataFrame.

They answer how fast paging can ever be (docs/DESIGN.md §8, the seed's route_overlap study): how soon an expert is
reused, how much a batch of k tokens shares, how concentrated popularity is, and what a static pin list buys.
The cache simulators live in :mod:`epqlab.routes.simulators`.
"""
from __future__ import annotations

from typing import Iterable

import numpy as np
import pandas as pd

from .log import RouteLog
from .simulators import prev_next


def _prev_token(log: RouteLog) -> np.ndarray:
    """Token of the previous request of the same (layer, expert), int64 [T, L, k]; -1 for a first touch."""
    prev, _ = prev_next(log)
    per_tok = log.n_layers * log.k
    return np.where(prev >= 0, prev // per_tok, -1).reshape(log.experts.shape)


def reuse_distances(log: RouteLog) -> np.ndarray:
    """Distance in tokens from each request to the previous request of the same (layer, expert), int64
    [T, L, k]; 0 marks a first touch (a real reuse distance is >= 1)."""
    p = _prev_token(log)
    t = np.arange(log.n_tokens)[:, None, None]
    return np.where(p >= 0, t - p, 0)


def reuse_histogram(log: RouteLog) -> pd.DataFrame:
    """Requests per reuse distance: columns ``distance`` (0 = first touch), ``requests``, ``share`` (of all
    requests) and ``cum_share`` (share of all requests whose distance is <= this one, first touches excluded)."""
    d = reuse_distances(log).ravel()
    counts = np.bincount(d, minlength=1) if d.size else np.zeros(1, np.int64)
    dist = np.nonzero(counts)[0]
    total = max(d.size, 1)
    df = pd.DataFrame({"distance": dist, "requests": counts[dist]})
    df["share"] = df["requests"] / total
    reuse = np.where(df["distance"] > 0, df["requests"], 0)
    df["cum_share"] = np.cumsum(reuse) / total
    return df


def one_off_share(log: RouteLog, window: int = 48) -> float:
    """Share of requests whose (layer, expert) is requested only once within its window, the log being cut into
    consecutive windows of ``window`` tokens (the last one may be shorter). An admission policy that refuses
    one-off experts can at best save this share of loads."""
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    T, L, k = log.experts.shape
    if T == 0:
        return float("nan")
    E = log.n_expert
    w = (np.arange(T) // window)[:, None, None]
    key = ((w * L + np.arange(L)[None, :, None]) * E + log.experts).ravel()
    _, inv, cnt = np.unique(key, return_inverse=True, return_counts=True)
    return float((cnt[inv] == 1).mean())


def union_sizes(log: RouteLog, ks: Iterable[int] = range(1, 17), per_layer: bool = False) -> pd.DataFrame:
    """U(k): the mean number of distinct experts a layer needs over k consecutive tokens (every window of k
    tokens, sliding by one, averaged over windows and layers), and the I/O a k-token batch saves by loading
    each expert once: ``saving = 1 - U(k) / (k * U(1))``. Columns ``k``, ``union``, ``saving`` (plus ``layer``
    with ``per_layer=True``). Values of k larger than the log are skipped."""
    T, L, _ = log.experts.shape
    p = _prev_token(log)
    t = np.broadcast_to(np.arange(T)[:, None, None], p.shape)
    lay = np.broadcast_to(np.arange(L)[None, :, None], p.shape).ravel()
    rows = []
    u1 = None
    for k in sorted(set(int(x) for x in ks)):
        if k < 1 or k > T:
            continue
        # a request starts a new expert in the windows [s, s+k) that contain t but not its previous use p
        lo = np.maximum(p + 1, t - k + 1)
        hi = np.minimum(t, T - k)
        n = np.maximum(hi - lo + 1, 0).ravel()
        per_l = np.bincount(lay, weights=n, minlength=L) / (T - k + 1)    # [L] mean union size
        if k == 1:
            u1 = per_l
        base = u1 if u1 is not None else np.full(L, float(log.k))
        if per_layer:
            for l in range(L):
                rows.append(dict(k=k, layer=l, union=per_l[l], saving=1 - per_l[l] / (k * base[l])))
        else:
            rows.append(dict(k=k, union=per_l.mean(), saving=1 - per_l.mean() / (k * base.mean())))
    return pd.DataFrame(rows)


def expert_counts(log: RouteLog, tokens: slice = slice(None)) -> np.ndarray:
    """Requests per (layer, expert) over ``tokens``, int64 [L, n_expert]."""
    e = log.experts[tokens]
    L, E = log.n_layers, log.n_expert
    key = (np.arange(L)[None, :, None] * E + e).ravel()
    return np.bincount(key, minlength=L * E).reshape(L, E)


def hot_set(log: RouteLog, n: int, tokens: slice = slice(None)) -> np.ndarray:
    """The n most requested experts of each layer over ``tokens`` (ties: lower id first), int [L, n]."""
    c = expert_counts(log, tokens)
    return np.argsort(-c, axis=1, kind="stable")[:, :n]


def hot_set_hit_rate(log: RouteLog, pins: np.ndarray, tokens: slice = slice(None)) -> float:
    """Share of the requests over ``tokens`` that a static pin list ``pins[l]`` (expert ids per layer, as from
    :func:`hot_set`) would serve from RAM."""
    c = expert_counts(log, tokens)
    total = c.sum()
    if total == 0:
        return float("nan")
    L = log.n_layers
    pinned = np.zeros_like(c, dtype=bool)
    for l in range(L):
        pinned[l, np.asarray(pins[l], dtype=np.int64)] = True
    return float(c[pinned].sum() / total)


def popularity(log: RouteLog, ns: Iterable[int] | None = None) -> pd.DataFrame:
    """How concentrated routing is. Per N: ``top_share`` = share of requests that go to each layer's N most
    requested experts (in-sample: the best any static pin list of N per layer can do on this log), and
    ``hot_set_hit_rate`` = the hit rate of the top-N pin list chosen on the first half of the tokens and
    measured on the second half (NaN for logs under 2 tokens)."""
    E, T = log.n_expert, log.n_tokens
    if ns is None:
        ns = sorted({1, 2, 4, 8, 16, 32, 64, 128, E} & set(range(1, E + 1)) | {log.k})
    c = expert_counts(log)
    srt = -np.sort(-c, axis=1)
    cum = np.cumsum(srt, axis=1)
    total = c.sum()
    half = T // 2
    rows = []
    for n in sorted(set(int(x) for x in ns)):
        if not 1 <= n <= E:
            continue
        top = float(cum[:, n - 1].sum() / total) if total else float("nan")
        hold = (hot_set_hit_rate(log, hot_set(log, n, slice(0, half)), slice(half, None))
                if half >= 1 else float("nan"))
        rows.append(dict(n=n, top_share=top, hot_set_hit_rate=hold))
    return pd.DataFrame(rows)
