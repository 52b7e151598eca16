"""Request-by-request replay of a route log through any online eviction policy, the native pager's rules
exactly: :func:`simulate_online` predicts :meth:`epqlab.Pager.replay` (and a live Session) hit for hit when the
arena is one slot class of ``capacity`` slots (``per_layer=False``, the pager's model).

The model (that of :mod:`epqlab.routes.reference`, plus the pager's forward passes):

- Forward passes follow ``log.ubatch`` (consecutive equal ids; one token per pass when the log has none). In a
  pass, MoE layers in order; the previous layer is released (unpinned) before the next one loads.
- A layer step requests one token's k experts in router order, or several tokens' sorted distinct experts;
  a union larger than the pool is *staged* (no request, no state change; the pager reads it into a staging
  buffer). The step's experts are all pinned while it loads: never victims.
- Every request counts in the request order (the pager's tick: ``last_use``; ``count``; hits refresh the
  policy's structures at once); then each miss, in order, gets a free slot or the policy's victim among the
  evictable (resident, unpinned) experts, and is inserted. Every miss is admitted (demand paging), except
  under admission staging (``admit="stage"`` of ``wtinylfu``, ``2q``, ``s3fifo``): a miss the policy refuses when no slot is free
  takes none, evicts nothing and is not inserted (the pager reads it into the staging buffer for that step).
- ``per_layer=True`` gives each MoE layer its own pool of ``capacity`` slots and its own policy state.

Policies (sources in each class's docstring): key-ordered ``lru``, ``ls``, ``ls_pos``, ``lfu``, ``static``,
``fnu``, ``lfuda``, ``heat``, ``gate_rank`` (:mod:`.policy_keys`; ``gate_rank`` weighs each request by the
log's ``probs``, summed per expert over the step's tokens in log order, as the pager's ``set_gate_mass``);
queue-based ``arc``, ``2q``, ``sieve``, ``s3fifo`` (:mod:`.policy_queues`); ``wtinylfu``
(:mod:`.policy_tinylfu`); ``coact`` (:mod:`.policy_coact`); ``lirs`` (:mod:`.policy_lirs`).
Not here: ``predictor-rank`` needs the trained predictor's scores per token.
Prefetch is not modelled (the pager's prefetched experts enter a policy as a miss does, with no request).
"""
from __future__ import annotations

from ..constants import EVICTION_GROUPS as GROUPS
from ..constants import ONLINE_POLICIES
from .log import RouteLog
from .policy_coact import COACT_POLICIES
from .policy_keys import KEY_POLICIES
from .policy_lirs import LIRS_POLICIES
from .policy_params import policy_params
from .policy_queues import QUEUE_POLICIES
from .policy_tinylfu import TINYLFU_POLICIES

RULES = {**KEY_POLICIES, **QUEUE_POLICIES, **TINYLFU_POLICIES, **COACT_POLICIES, **LIRS_POLICIES}


class _State:
    """Per-unit request state the driver keeps for every policy (the pager's ``unit`` fields)."""

    def __init__(self, n: int) -> None:
        self.last_use = [0] * n
        self.last_pass = [0] * n
        self.count = [0] * n
        self.passno = 1
        self.mass: dict[int, float] = {}  # gate_rank: this step's router probability mass per unit


def _passes(log: RouteLog):
    T = log.n_tokens
    ub = log.ubatch
    start = 0
    for t in range(1, T + 1):
        if t == T or ub is None or ub[t] != ub[start]:
            yield start, t
            start = t


def simulate_online(log: RouteLog, capacity: int | None, policy: str, *, per_layer: bool = False,
                    params: dict | None = None, hot=None, slot_classes=None, unit_bytes=None,
                    slot_mode: bool = False) -> dict:
    """Replay ``log`` through ``policy`` with ``capacity`` slots (one pool, or per layer with ``per_layer``).

    Args:
        log: the route log (its ``ubatch`` gives the forward passes).
        capacity: slots of the pool (or of each layer's pool); at least ``log.k``.
        policy: one of :data:`epqlab.constants.ONLINE_POLICIES`.
        params: the policy's parameters (:func:`epqlab.routes.policy_params.policy_params`: defaults, ranges).
        hot: ``static`` only: (layer index, expert) pairs evicted last.
        slot_classes: the pager's arena instead of ``capacity`` equal slots: ``[(slot bytes, slots), ...]``
            largest first (``Pager.stats()["slot_classes"]``), with ``unit_bytes`` the slot bytes a unit of each
            log layer needs (``Pager.unit_slot_bytes``). A unit takes a free slot of its own class, else (unless
            ``slot_mode``, the pager's slot addressing) of the smallest larger class; a victim's slot must be
            large enough (exactly its size with ``slot_mode``). Only with one shared pool.

    Returns:
        dict(requests, hits, misses, evictions, staged, admission_staged, evictions_by_group, misses_by_layer,
        requests_by_layer, resident) (counts; ``staged``: layer steps whose union exceeded the pool;
        ``admission_staged``: misses the policy refused a slot (``wtinylfu``'s ``admit="stage"``), used from the
        staging buffer; ``resident``: the (layer index, expert) pairs left in the arena, sorted).

    Raises:
        ValueError: unknown policy (lists the valid ones), a parameter unknown or out of range (names the range),
            ``capacity`` < k, ``hot`` with another policy, ``gate_rank`` on a log without ``probs``.
    """
    if policy not in ONLINE_POLICIES:
        raise ValueError(f"unknown online policy {policy!r}; choose one of {', '.join(ONLINE_POLICIES)}"
                         + (" (belady: epqlab.routes.simulate)" if policy == "belady" else ""))
    prm = policy_params(policy, params)
    T, L, k = log.experts.shape
    E = int(log.n_expert)
    if slot_classes is not None:
        if per_layer or unit_bytes is None or len(unit_bytes) != L:
            raise ValueError("slot_classes needs one shared pool (per_layer=False) and unit_bytes per log layer")
        cls_b = [int(b) for b, _ in slot_classes]
        free = [int(n) for _, n in slot_classes]
        need_c = [cls_b.index(int(b)) for b in unit_bytes]
        capacity = sum(free)
    else:
        cls_b, need_c = [1], [0] * L
        free = [int(capacity) * (L if per_layer else 1)] if capacity is not None else [0]
    if capacity is None or int(capacity) < k:
        raise ValueError(f"capacity {capacity} < k = {k}: one layer's experts must fit at once")
    if hot is not None and policy != "static":
        raise ValueError("hot goes with policy 'static'")
    weigh = getattr(RULES[policy], "needs_probs", False)
    if weigh and log.probs is None:
        raise ValueError(f"policy {policy} needs the router probability of each selected expert: a route log "
                         "recorded by Session(route_log=...) of this version has them (`probs`)")
    pr = log.probs.tolist() if weigh else None
    cap = int(capacity)
    fits = (lambda have, need: have == need) if slot_mode else (lambda have, need: have >= need)
    cap_l = [cap if slot_classes is None else sum(n for b, n in slot_classes if fits(int(b), cls_b[need_c[li]]))
             for li in range(L)]
    slot_of: dict[int, int] = {}     # unit -> class of its slot
    st = _State(L * E)
    n_pools = L if per_layer else 1
    pols = [RULES[policy](cap, L, E, k, prm, st) for _ in range(n_pools)]
    if hot is not None:
        hs = frozenset(int(li) * E + int(e) for li, e in hot)
        for p in pols:
            p.hot = hs
    resident = [set() for _ in range(n_pools)]
    ex = log.experts.tolist()
    tick = 0
    hits = misses = evictions = staged = refused = 0
    groups = [0, 0, 0, 0]
    mis_l, req_l = [0] * L, [0] * L
    for a, b in _passes(log):
        st.passno += 1
        for p in pols:
            p.begin_pass()
        for li in range(L):
            pi = li if per_layer else 0
            pol, res = pols[pi], resident[pi]
            if b - a == 1:
                ids = ex[a][li]
                uni = sorted(set(ids))
            else:
                uni = sorted({e for t in range(a, b) for e in ex[t][li]})
                ids = uni
            pol.router(li, uni)
            if weigh:  # the pager's set_gate_mass: tokens in order, slots in router order
                st.mass = {}
                for t in range(a, b):
                    for e, q in zip(ex[t][li], pr[t][li]):
                        st.mass[li * E + e] = st.mass.get(li * E + e, 0.0) + q
            if len(uni) > cap_l[li]:
                staged += 1
                continue
            pinned = {li * E + e for e in ids}
            miss_u = []
            for e in dict.fromkeys(ids):
                u = li * E + e
                tick += 1
                req_l[li] += 1
                r = u in res
                if r:
                    hits += 1
                else:
                    misses += 1
                    mis_l[li] += 1
                    miss_u.append(u)
                st.last_use[u] = tick
                st.last_pass[u] = st.passno
                st.count[u] += 1
                pol.request(u, r)
            nc = need_c[li]
            nb = cls_b[nc]
            for u in miss_u:
                pol.admit(u)
                got = None
                if per_layer:
                    got = 0 if len(res) < cap else None
                else:
                    for c2 in range(nc, nc - 1 if slot_mode else -1, -1):
                        if free[c2]:
                            free[c2] -= 1
                            got = c2
                            break
                ok = lambda x: x not in pinned and fits(cls_b[slot_of[x]], nb)  # noqa: E731
                if got is None and pol.refuse(u, ok):
                    pol.refused(u)
                    refused += 1   # admission staging: read for this step only; no slot, no victim, no insertion
                    continue
                if got is None:
                    v = pol.victim(u, ok, li)
                    if v is None:
                        raise RuntimeError(f"{policy}: no evictable expert for layer {li} (simulator bug)")
                    stale = st.last_pass[v] < st.passno
                    groups[(0 if stale else 1) + (0 if v // E < li else 2)] += 1
                    evictions += 1
                    pol.evicted(v)
                    res.discard(v)
                    got = slot_of.pop(v)
                slot_of[u] = got
                res.add(u)
                pol.insert(u)
    left = sorted((u // E, u % E) for r in resident for u in r)
    return dict(requests=hits + misses, hits=hits, misses=misses, evictions=evictions, staged=staged,
                admission_staged=refused,
                evictions_by_group=dict(zip(GROUPS, groups)), misses_by_layer=mis_l, requests_by_layer=req_l,
                resident=left)
