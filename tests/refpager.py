"""Test helper shared by test_pager and test_session: :class:`RefPager`, a plain-Python model of the
native pager's residency rules written from the spec (docs/DESIGN.md), not from the C++."""
from __future__ import annotations

import numpy as np


class RefPager:
    """Plain-Python model of the pager's residency rules (written from the spec, not the C++).

    Slots are numbered class by class, largest class first; each class's free slots are taken
    lowest id first; a unit takes a free slot of its own class, else of the smallest larger
    class, else evicts the first unpinned resident in policy order whose slot is large enough.
    lru: least recent first. ls: stale before current, smaller layer first, least recent first.
    ls_pos: stale-left, current-left, stale-right, current-right; larger layer first; least
    recent first (left = layer index < the layer being loaded).
    """

    def __init__(self, unit_bytes, class_slots, policy):
        self.unit_bytes = unit_bytes  # per layer index
        self.policy = policy
        self.slot_bytes = []
        for c in class_slots:
            self.slot_bytes += [c["slot_bytes"]] * c["slots"]
        self.free = {b: [i for i, sb in enumerate(self.slot_bytes) if sb == b] for b in set(self.slot_bytes)}
        self.res = {}  # (li, e) -> dict(slot, last_use, last_pass)
        self.pinned = set()
        self.tick = 0
        self.passno = 1
        self.hits = self.misses = self.evictions = 0
        self.groups = [0, 0, 0, 0]

    def begin_pass(self):
        self.passno += 1

    def order_key(self, u, L):
        li = u[0]
        r = self.res[u]
        stale = r["last_pass"] < self.passno
        if self.policy == "lru":
            return (r["last_use"],)
        if self.policy == "ls":
            return (0 if stale else 1, li, r["last_use"])
        left = li < L
        group = (0 if stale else 1) + (0 if left else 2)
        return (group, -li, r["last_use"])

    def take(self, L, need):
        for b in sorted(b for b in self.free if b >= need):
            if self.free[b]:
                return self.free[b].pop(0)
        cands = [u for u in self.res if u not in self.pinned and self.slot_bytes[self.res[u]["slot"]] >= need]
        assert cands, "reference ran out of slots"
        v = min(cands, key=lambda u: self.order_key(u, L))
        r = self.res.pop(v)
        stale = r["last_pass"] < self.passno
        self.groups[(0 if stale else 1) + (0 if v[0] < L else 2)] += 1
        self.evictions += 1
        return r["slot"]

    def load(self, li, ids):
        misses = []
        for e in dict.fromkeys(int(x) for x in ids):
            u = (li, e)
            self.tick += 1
            if u in self.res:
                self.hits += 1
                self.res[u]["last_use"] = self.tick
                self.res[u]["last_pass"] = self.passno
            else:
                self.misses += 1
                misses.append((u, self.tick))
            self.pinned.add(u)
        for u, t in misses:
            s = self.take(li, self.unit_bytes[li])
            self.res[u] = {"slot": s, "last_use": t, "last_pass": self.passno}

    def release(self, li):
        self.pinned = {u for u in self.pinned if u[0] != li}

    def replay(self, experts, ubatch=None):
        """Run a route log ``experts`` int ``[T, L, k]`` as the hook does: per forward pass (consecutive equal
        ``ubatch`` ids; default one token per pass), per layer in order, the previous layer released, then one
        token's experts in router order, or several tokens' sorted union; the last layer released at the end."""
        experts = np.asarray(experts)
        T, L, _ = experts.shape
        ub = np.arange(T) if ubatch is None else np.asarray(ubatch)
        starts = [0] + [t for t in range(1, T) if ub[t] != ub[t - 1]] + [T]
        for a, b in zip(starts[:-1], starts[1:]):
            self.begin_pass()
            for li in range(L):
                if li:
                    self.release(li - 1)
                ids = experts[a:b, li].ravel()
                self.load(li, ids if b - a == 1 else np.unique(ids))
            self.release(L - 1)
