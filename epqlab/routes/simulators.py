"""Fast offline cache simulators over many capacities at once (pure NumPy).

Same model and policies as :mod:`epqlab.routes.reference` (read its docstring: pinning of a layer's k experts,
demand paging, ``lru`` / ``ls`` / ``ls_pos`` / ``belady``); the tests check every number here against it.

How they are fast:

- **Per-layer pools** (``per_layer=True``, C slots per layer): layers never interact, and while layer L loads,
  every unpinned resident of L's pool is *stale* (the only experts of L requested in this token are the pinned
  ones) and on the *right* side (its layer is L). So Least-Stale's key reduces to (layer L, last use) and the
  position-aware key to (stale-right, -L, last use): **``ls`` and ``ls_pos`` evict exactly like ``lru``**, and
  every victim of every policy falls in group ``stale_right``.
- **LRU is a stack algorithm** even with pinned batches (for C >= k the residents are always the C most recently
  used experts: a step moves its k experts to the top and the misses evict the least recent non-pinned ones).
  So one pass computes each request's *stack distance* d = 1 + the number of distinct experts (of its pool)
  used since its previous request, measured when its layer step starts, and a request hits at capacity C iff
  d <= C: hits for every capacity from one histogram (Mattson et al., 1970).
- **Belady (MIN)** next-use times are a property of the trace, the same for every capacity, so one pass over the
  tokens updates the resident sets of all (capacity, layer) pools at once: the victims of a pool are its
  unpinned residents in decreasing next-use order, taken with one sort per token and a cumulative sum.
- **Shared pool** (``per_layer=False``, C slots in all): LRU again from (global) stack distances. For ``ls`` and
  ``ls_pos``, within one layer the victims are always taken least-recent first (a layer's current experts are
  more recent than its stale ones), so each layer's residents are its n_l most recent experts and the state
  of a pool is the vector of counts n_l; one pass over the layer steps updates the counts of every
  (policy, capacity) at once. Belady with a shared pool uses a heap per capacity (slower: about
  1-2 us per request and capacity).
"""
from __future__ import annotations

import heapq
from dataclasses import replace
from typing import Iterable, Sequence

import numpy as np
import pandas as pd

from ..constants import PAGER_POLICIES
from .log import RouteLog
from .online import simulate_online
from .reference import GROUPS, POLICIES

INF = np.int64(1) << np.int64(62)   # "never requested again" / "first touch"


# ------------------------------------------------------------------------------------- per-log cache
def _cache(log: RouteLog) -> dict:
    c = log.__dict__.get("_routes_cache")
    if c is None:
        c = {}
        object.__setattr__(log, "_routes_cache", c)
    return c


def prev_next(log: RouteLog) -> tuple[np.ndarray, np.ndarray]:
    """For every request (flat index i = (t*L + l)*k + j, the request counter) the index of the previous and the
    next request of the same (layer, expert): ``prev`` is -1 for a first touch, ``next`` is :data:`INF` if never
    again. Both int64, shape (T*L*k,)."""
    c = _cache(log)
    if "prev_next" not in c:
        T, L, k = log.experts.shape
        key = (np.arange(L, dtype=np.int64)[None, :, None] * log.n_expert + log.experts).ravel()
        order = np.argsort(key, kind="stable")               # by (layer, expert), then time
        same = key[order[1:]] == key[order[:-1]]
        prev = np.full(key.size, -1, np.int64)
        nxt = np.full(key.size, INF, np.int64)
        prev[order[1:][same]] = order[:-1][same]
        nxt[order[:-1][same]] = order[1:][same]
        c["prev_next"] = (prev, nxt)
    return c["prev_next"]


def stack_distances(log: RouteLog, per_layer: bool = True) -> np.ndarray:
    """LRU stack distance of every request, int64 ``[T, L, k]`` (:data:`INF` for a first touch).

    ``per_layer``: 1 + the number of distinct experts of the same layer whose last use is more recent than this
    expert's, when its layer step starts. Otherwise the same over all (layer, expert) pairs of the shared pool.
    A request hits an LRU cache of C >= k slots iff its distance <= C."""
    c = _cache(log)
    name = f"stack_{per_layer}"
    if name not in c:
        T, L, k = log.experts.shape
        E = log.n_expert
        last = np.full((L, E), -1, np.int64)
        rows = np.arange(L)[:, None]
        base = np.arange(L * k, dtype=np.int64).reshape(L, k)
        d = np.empty((T, L, k), np.int64)
        if not per_layer:
            lay = np.repeat(np.arange(L), k)
            earlier = lay[None, :] < lay[:, None]            # [Lk, Lk]: column's layer < row's layer
        for t in range(T):
            S = log.experts[t]
            q = last[rows, S]                                # [L, k] previous use times
            if per_layer:
                dist = (last[:, None, :] > q[:, :, None]).sum(axis=2) + 1
            else:
                srt = np.sort(last, axis=None)
                qf = q.ravel()
                newer = srt.size - np.searchsorted(srt, qf, side="right")
                # experts of earlier layers requested in this token became newer than q too
                became = ((qf[None, :] <= qf[:, None]) & earlier).sum(axis=1)
                dist = (newer + became + 1).reshape(L, k)
            dist[q < 0] = INF
            d[t] = dist
            last[rows, S] = t * L * k + base
        c[name] = d
    return c[name]


# --------------------------------------------------------------------------------------------- LRU
def _lru_misses(log: RouteLog, caps: np.ndarray, per_layer: bool) -> np.ndarray:
    """Misses per (capacity, layer), int64 [n_caps, L], from stack distances."""
    d = stack_distances(log, per_layer)
    L = log.n_layers
    top = int(caps.max()) + 1
    dl = np.minimum(d, top).transpose(1, 0, 2).reshape(L, -1)         # [L, T*k]
    hist = np.stack([np.bincount(row, minlength=top + 1) for row in dl])  # [L, top+1]
    hits_le = np.cumsum(hist, axis=1)                                   # hits with distance <= c
    per_req = np.full(L, log.n_tokens * log.k, np.int64)
    return per_req[None, :] - hits_le[:, caps].T


# ------------------------------------------------------------------------------ Belady, per layer
def _belady_per_layer(log: RouteLog, caps: np.ndarray) -> np.ndarray:
    """Misses per (capacity, layer) of MIN with an independent pool of C slots per layer, all capacities at once."""
    T, L, k = log.experts.shape
    E = log.n_expert
    _, nxt_req = prev_next(log)
    nxt_req = nxt_req.reshape(T, L, k)
    nC = caps.size
    R = np.zeros((nC, L, E), bool)                      # residents
    Rf = R.reshape(nC * L, E)                           # view: one row per (capacity, layer) pool
    cnt = np.zeros((nC, L), np.int64)
    misses = np.zeros((nC, L), np.int64)
    NX = np.full((L, E), INF, np.int64)                 # next request after each expert's last request
    rows = np.arange(L)[:, None]
    capcol = caps[:, None]
    for t in range(T):
        S = log.experts[t]
        hit = R[:, rows, S]                             # [nC, L, k]
        m = k - hit.sum(axis=2)
        r = np.maximum(m - (capcol - cnt), 0)           # victims needed per pool
        if r.any():
            ci, li = np.nonzero(r)
            R[:, rows, S] = False                       # pinned: never victims (set resident again below)
            # farthest next use first; ties (never again) by lowest expert id: stable sort of -NX
            o = np.argsort(-NX, axis=1, kind="stable")[li]                  # [n, E] eviction order
            fl = ci * L + li
            cand = Rf[fl[:, None], o]                                       # candidates in eviction order
            take = cand & (np.cumsum(cand, axis=1, dtype=np.int32) <= r[ci, li][:, None])
            rr, pos = np.nonzero(take)
            Rf[fl[rr], o[rr, pos]] = False
        R[:, rows, S] = True
        cnt += m - r
        misses += m
        NX[rows, S] = nxt_req[t]
    return misses


# ------------------------------------------------------------------------------ Belady, shared pool
def _belady_shared(log: RouteLog, cap: int) -> np.ndarray:
    """Misses per layer of MIN with one pool of ``cap`` slots (lazy max-heap of next-use times)."""
    T, L, k = log.experts.shape
    E = log.n_expert
    _, nxt_req = prev_next(log)
    nx = nxt_req.tolist()
    keys = (np.arange(L)[None, :, None] * E + log.experts).reshape(-1).tolist()
    res: dict = {}                  # key -> its current next-use
    heap: list = []                 # (-next use, key): farthest first, then lowest (layer, expert)
    misses = [0] * L
    i = 0
    for t in range(T):
        for l in range(L):
            step = keys[i:i + k]
            pinned = set(step)
            hold = []
            for key in step:
                if key not in res:
                    misses[l] += 1
                    if len(res) >= cap:
                        while True:
                            negn, v = heapq.heappop(heap)
                            if res.get(v) != -negn:
                                continue            # stale heap entry
                            if v in pinned:
                                hold.append((negn, v))
                                continue
                            del res[v]
                            break
                res[key] = nx[i]
                heapq.heappush(heap, (-nx[i], key))
                i += 1
            for h in hold:
                if res.get(h[1]) == -h[0]:
                    heapq.heappush(heap, h)
    return np.array(misses, np.int64)


# ------------------------------------------------------------------------ Least-Stale, shared pool
def _ls_shared(log: RouteLog, caps: np.ndarray, policies: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """Misses [n_pol, n_caps, L] and victims by group [n_pol, n_caps, 4] for ``ls``/``ls_pos`` with a shared pool.

    Per layer the residents are its n_l most recent experts (victims within a layer go least-recent first), so a
    request hits iff its per-layer stack distance <= n_l, and each step only moves counts between layers."""
    T, L, k = log.experts.shape
    d = stack_distances(log, per_layer=True)
    nP, nC = len(policies), caps.size
    nR = nP * nC
    capv = np.tile(caps, nP)
    n = np.zeros((nR, L), np.int64)
    used = np.zeros(nR, np.int64)
    misses = np.zeros((nR, L), np.int64)
    groups = np.zeros((nR, 4), np.int64)
    lidx = np.arange(L)
    # bucket b < L: stale of layer b; b >= L: current of layer b - L. Order of buckets per (policy, L).
    orders = np.empty((nP, L, 2 * L), np.int64)
    for p, pol in enumerate(policies):
        for Lc in range(L):
            if pol == "ls":
                o = list(range(L)) + [L + l for l in range(Lc)] + [L + l for l in range(Lc, L)]
            else:  # ls_pos: stale-left, current-left (larger layer first), stale-right, (current-right)
                o = ([l for l in range(Lc - 1, -1, -1)] + [L + l for l in range(Lc - 1, -1, -1)]
                     + [l for l in range(L - 1, Lc - 1, -1)] + [L + l for l in range(L - 1, Lc - 1, -1)])
            orders[p, Lc] = o
    # group of each bucket given L: stale/current x left/right -> index into GROUPS
    bucket_group = np.empty((L, 2 * L), np.int64)
    for Lc in range(L):
        side = (lidx >= Lc).astype(np.int64) * 2
        bucket_group[Lc] = np.concatenate([side, side + 1])
    prow = np.repeat(np.arange(nP), nC)
    for t in range(T):
        for Lc in range(L):
            h = (d[t, Lc][None, :] <= n[:, Lc][:, None]).sum(axis=1)
            m = k - h
            r = np.maximum(m - (capv - used), 0)
            if r.any():
                cur = np.where(lidx[None, :] < Lc, np.minimum(n, k), 0)
                stale = n - cur
                stale[:, Lc] = n[:, Lc] - h
                A = np.concatenate([stale, cur], axis=1)                 # [nR, 2L]
                O = orders[prow, Lc]                                    # [nR, 2L]
                Ao = np.take_along_axis(A, O, axis=1)
                before = np.cumsum(Ao, axis=1) - Ao
                tk = np.clip(r[:, None] - before, 0, Ao)
                took = np.zeros_like(A)
                np.put_along_axis(took, O, tk, axis=1)
                n -= took[:, :L] + took[:, L:]
                for g in range(4):
                    groups[:, g] += took[:, bucket_group[Lc] == g].sum(axis=1)
            n[:, Lc] += m
            used += m - r
            misses[:, Lc] += m
    return misses.reshape(nP, nC, L), groups.reshape(nP, nC, 4)


# ------------------------------------------------------------------------------------------- API
def simulate(log: RouteLog, capacities: Iterable[int], policies: Sequence[str] = POLICIES, *,
             per_layer: bool = True, params: dict | None = None) -> pd.DataFrame:
    """Hit rate, misses, evictions and bytes read of each policy at each capacity.

    ``capacities`` are slots per layer (``per_layer=True``) or total slots of one shared pool; each must be
    >= k. Slots are all the same size; bytes read = sum over layers of misses x ``expert_bytes[layer]``
    (a byte budget B maps to ``B // max(expert_bytes)`` total slots: :func:`slots_for_bytes`).
    One row per (policy, capacity); ``gap_to_belady`` = Belady's hit rate minus the policy's (if Belady ran).
    ``ev_<group>`` columns count victims per group (NaN where a method does not track them: shared-pool LRU
    and Belady).

    ``policies``: any pager policy (:data:`epqlab.constants.PAGER_POLICIES`); those outside :data:`POLICIES`
    (``lru``, ``ls``, ``ls_pos``, ``belady``: the fast methods above) run request by
    request through :func:`epqlab.routes.online.simulate_online` (one token per forward pass, as here;
    ``params``: ``{policy: {parameter: value}}``)."""
    caps = np.array(sorted({int(c) for c in capacities}), np.int64)
    for p in policies:
        if p not in PAGER_POLICIES:
            raise ValueError(f"unknown policy {p!r}; choose one of {', '.join(PAGER_POLICIES)}")
    if caps.size == 0:
        raise ValueError("no capacities given")
    k = log.k
    if caps[0] < k:
        raise ValueError(f"capacity {int(caps[0])} < k = {k}: one layer's {k} experts must fit at once")
    T, L, _ = log.experts.shape
    requests = log.n_requests
    key = (np.arange(L)[None, :, None] * log.n_expert + log.experts)
    distinct_l = np.array([np.unique(key[:, l]).size for l in range(L)], np.int64)

    miss_by: dict = {}       # policy -> [nC, L]
    grp_by: dict = {}        # policy -> [nC, 4] or None
    want_lru = [p for p in policies if p in ("lru",) or (per_layer and p in ("ls", "ls_pos"))]
    if want_lru:
        ml = _lru_misses(log, caps, per_layer)
        for p in want_lru:
            miss_by[p] = ml
            grp_by[p] = None
    if not per_layer:
        lsp = [p for p in policies if p in ("ls", "ls_pos")]
        if lsp:
            mm, gg = _ls_shared(log, caps, lsp)
            for i, p in enumerate(lsp):
                miss_by[p], grp_by[p] = mm[i], gg[i]
    slow = [p for p in policies if p not in POLICIES]
    if slow:
        one = replace(log, ubatch=None)      # one token per forward pass, the model of the methods above
        for p in slow:
            res = [simulate_online(one, int(c), p, per_layer=per_layer, params=(params or {}).get(p)) for c in caps]
            miss_by[p] = np.array([r["misses_by_layer"] for r in res], np.int64)
            grp_by[p] = None if per_layer else np.array([[r["evictions_by_group"][g] for g in GROUPS] for r in res])
    if "belady" in policies:
        miss_by["belady"] = (_belady_per_layer(log, caps) if per_layer
                             else np.stack([_belady_shared(log, int(c)) for c in caps]))
        grp_by["belady"] = None

    rows = []
    for p in policies:
        mis_l = miss_by[p]
        for ci, c in enumerate(caps):
            misses = int(mis_l[ci].sum())
            if per_layer:
                evictions = misses - int(np.minimum(c, distinct_l).sum())
            else:
                evictions = misses - int(min(c, distinct_l.sum()))
            row = dict(mode="per_layer" if per_layer else "total", policy=p, capacity=int(c),
                       requests=requests, hits=requests - misses, misses=misses,
                       hit_rate=(requests - misses) / requests if requests else float("nan"),
                       evictions=evictions, bytes_read=int((mis_l[ci] * log.expert_bytes).sum()))
            if per_layer:   # every victim of a per-layer pool is stale-right (see module docstring)
                g = {"stale_right": evictions}
            elif grp_by[p] is not None:
                g = dict(zip(GROUPS, (int(x) for x in grp_by[p][ci])))
            else:
                g = dict.fromkeys(GROUPS, float("nan"))
            for name in GROUPS:
                row[f"ev_{name}"] = g.get(name, 0)
            rows.append(row)
    df = pd.DataFrame(rows)
    if "belady" in policies:
        best = df[df.policy == "belady"].set_index("capacity")["hit_rate"]
        df["gap_to_belady"] = df["capacity"].map(best) - df["hit_rate"]
    else:
        df["gap_to_belady"] = float("nan")
    return df


def slots_for_bytes(log: RouteLog, budget_bytes: int, per_layer: bool = False) -> int:
    """Slots a byte budget holds when every slot is sized for the largest expert (one slot class).
    ``per_layer`` divides the budget evenly over the layers first."""
    size = int(log.expert_bytes.max())
    if size <= 0:
        raise ValueError("expert_bytes are all zero: cannot size slots")
    return int(budget_bytes // log.n_layers // size) if per_layer else int(budget_bytes // size)
