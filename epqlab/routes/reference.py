"""Reference cache simulator: slow, literal, obviously correct. The fast simulators in
:mod:`epqlab.routes.simulators` and the native pager's eviction are tested against it.

The model of paging (shared with the native pager, ``native/pager/pager.cpp``):

- Tokens are processed in order; for each token, MoE layers in order; for each layer the token's k experts are
  requested together, one request at a time in router order, with a global request counter that is incremented
  per request. All k are **pinned** while their layer loads (a layer's own requested experts are never
  victims while that layer loads); the previous layer's experts are unpinned before the next layer loads.
- A request for a resident expert is a hit and refreshes its recency (last use = the request counter).
  Otherwise it is a miss: the expert is loaded into a free slot, or, when none is free, into the slot of one
  victim chosen by the policy among the unpinned residents (demand paging: every requested expert is loaded;
  nothing bypasses the cache).
- Capacity is either ``per_layer=True``: every MoE layer owns an independent pool of C slots, or
  ``per_layer=False``: one pool of C equal slots shared by all layers.

Victim groups (counted for every policy in ``evictions_by_group``), relative to the layer L being loaded:
an expert is *current* if it was requested in the current forward pass (= the current token), else *stale*;
its *side* is ``left`` if its layer < L, else ``right``.

Policies (victim = the unpinned resident with the smallest key):

- ``lru``: key = last use.
- ``ls`` (Least-Stale, SpecMD, arXiv 2602.03921): key = (group, layer, last use), group 0 = stale, 1 = current;
  layers ascending.
- ``ls_pos`` (position-aware Least-Stale, the seed's variant): key = (group, -layer, last use) with group
  stale-left 0, current-left 1, stale-right 2, current-right 3; larger layer first within a group.
- ``belady`` (Belady's MIN, 1966, under demand paging): the resident whose next request is farthest in the future
  (never requested again = infinitely far), ties broken by the lowest (layer, expert).
"""
from __future__ import annotations

from ..constants import EVICTION_GROUPS as GROUPS
from ..constants import SIMULATOR_POLICIES as POLICIES
from .log import RouteLog
NEVER = float("inf")


def simulate_reference(log: RouteLog, capacity: int, policy: str, per_layer: bool = True) -> dict:
    """Simulate one policy at one capacity, request by request.

    Returns ``dict(hits, misses, evictions, evictions_by_group, misses_by_layer, bytes_read)`` where
    ``evictions_by_group`` maps each of :data:`GROUPS` to the number of victims in that group and
    ``misses_by_layer`` lists misses per MoE layer index. ``capacity`` is slots per layer (``per_layer``) or
    total slots; it must be >= k."""
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; the reference simulates {', '.join(POLICIES)} "
                         "(every other online policy: epqlab.routes.online.simulate_online)")
    T, L, k = log.experts.shape
    if capacity < k:
        raise ValueError(f"capacity {capacity} < k = {k}: one layer's experts must fit at once")
    ex = log.experts.tolist()

    # next request time of every request (request counter = position in processing order)
    nxt_of: list = [NEVER] * (T * L * k)
    seen: dict = {}
    for i in range(T * L * k - 1, -1, -1):
        t, rem = divmod(i, L * k)
        l, j = divmod(rem, k)
        key = (l, ex[t][l][j])
        nxt_of[i] = seen.get(key, NEVER)
        seen[key] = i

    pools: dict = {}          # pool id -> {(layer, expert): None}  (residents)
    last: dict = {}           # (layer, expert) -> last request time
    last_tok: dict = {}       # (layer, expert) -> last token that requested it
    nxt: dict = {}            # (layer, expert) -> next request time after its last request
    hits = misses = evictions = 0
    by_group = dict.fromkeys(GROUPS, 0)
    misses_by_layer = [0] * L
    clock = 0
    for t in range(T):
        for l in range(L):
            pool = pools.setdefault(l if per_layer else 0, {})
            pinned = {(l, e) for e in ex[t][l]}
            for e in ex[t][l]:
                key = (l, e)
                if key in pool:
                    hits += 1
                else:
                    misses += 1
                    misses_by_layer[l] += 1
                    if len(pool) >= capacity:
                        cands = [r for r in pool if r not in pinned]

                        def group(r):
                            current = last_tok[r] == t
                            right = r[0] >= l
                            return 2 * right + current          # index into GROUPS

                        if policy == "lru":
                            victim = min(cands, key=lambda r: last[r])
                        elif policy == "ls":
                            victim = min(cands, key=lambda r: (last_tok[r] == t, r[0], last[r]))
                        elif policy == "ls_pos":
                            victim = min(cands, key=lambda r: (group(r), -r[0], last[r]))
                        else:
                            victim = min(cands, key=lambda r: (-nxt[r], r))
                        by_group[GROUPS[group(victim)]] += 1
                        evictions += 1
                        del pool[victim]
                    pool[key] = None
                last[key] = clock
                last_tok[key] = t
                nxt[key] = nxt_of[clock]
                clock += 1
    bytes_read = sum(m * int(b) for m, b in zip(misses_by_layer, log.expert_bytes))
    return dict(hits=hits, misses=misses, evictions=evictions, evictions_by_group=by_group,
                misses_by_layer=misses_by_layer, bytes_read=bytes_read)
