"""``coact``: co-activation-aware eviction, an MoE-only policy (this project's rule; issue 50 names a peer's
"co-activation policy" without its rule). ``native/pager/policy_coact.cpp`` is the same rule in C++."""
from __future__ import annotations

from .policy_queues import QueuePolicy


class CoAct(QueuePolicy):
    """An expert whose frequent partners are resident is worth more: its value is
    V(u) = requests(u) + sum over resident experts v of u's layer of C(u, v), where C(u, v) counts the layer
    steps whose experts (one token's k, or a ubatch's union) held both u and v, counted when the layer's router
    has run (before its requests). Requests are counted across evictions, as ``lfu`` does. Evict the smallest
    V, ties by least recent request, then unit id. The partner sums are kept incrementally (a unit entering or
    leaving the arena adds or removes its column), so a victim costs one scan of the residents."""

    def __init__(self, *a) -> None:
        super().__init__(*a)
        n = self.L * self.E
        self.C = [[0] * self.E for _ in range(n)]
        self.P = [0] * n
        self.cnt = [0] * n
        self.last = [0] * n
        self.tick = 0
        self.res: set[int] = set()

    def router(self, li, picked):
        b = li * self.E
        for e in picked:
            for f in picked:
                if e != f:
                    self.C[b + e][f] += 1
                    if b + f in self.res:
                        self.P[b + e] += 1

    def request(self, u, resident):
        self.tick += 1
        self.last[u] = self.tick
        self.cnt[u] += 1

    def _column(self, u, sign):
        b, e = u - u % self.E, u % self.E
        for f in range(self.E):
            if f != e:
                self.P[b + f] += sign * self.C[b + f][e]

    def insert(self, u):
        self.res.add(u)
        self._column(u, 1)

    def evicted(self, u):
        self.res.discard(u)
        self._column(u, -1)

    dropped = evicted

    def victim(self, u, ok, li):
        best, bk = None, None
        for v in self.res:
            if ok(v):
                kv = (self.cnt[v] + self.P[v], self.last[v], v)
                if bk is None or kv < bk:
                    best, bk = v, kv
        return best


COACT_POLICIES = {"coact": CoAct}
