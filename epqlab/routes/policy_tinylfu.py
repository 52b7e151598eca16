"""W-TinyLFU (Einziger, Friedman & Manes, "TinyLFU: A Highly Efficient Cache Admission Policy", ACM TOS 13(4),
2017): a window LRU in front of a segmented-LRU main cache, and TinyLFU admission between them, with request
frequencies estimated by a count-min sketch. ``native/pager/policy_queues.cpp`` is the same rule in C++ (same
sketch, same hash)."""
from __future__ import annotations

from collections import OrderedDict

from .policy_queues import QueuePolicy, _first

M64 = (1 << 64) - 1
SEEDS = (0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0xD6E8FEB86659FD93)


class CountMin:
    """Count-min sketch (Cormode & Muthukrishnan 2005) of 4 rows of 4-bit counters (capped at 15), ``width`` a
    power of two; row i of unit u is ``(((u + 1) * SEEDS[i]) mod 2^64 >> 32) & (width - 1)``. After
    ``sample`` increments every counter and the increment count are halved (TinyLFU's reset)."""

    def __init__(self, width: int, sample: int) -> None:
        self.w, self.sample, self.n = width, sample, 0
        self.rows = [[0] * width for _ in SEEDS]

    def _idx(self, u: int):
        return [((((u + 1) * s) & M64) >> 32) & (self.w - 1) for s in SEEDS]

    def add(self, u: int) -> None:
        for r, i in zip(self.rows, self._idx(u)):
            if r[i] < 15:
                r[i] += 1
        self.n += 1
        if self.n >= self.sample:
            for r in self.rows:
                for i in range(self.w):
                    r[i] >>= 1
            self.n //= 2

    def estimate(self, u: int) -> int:
        return min(r[i] for r, i in zip(self.rows, self._idx(u)))


class WTinyLfu(QueuePolicy):
    """W-TinyLFU. Every request adds to the sketch. A miss enters the window LRU W (``window`` of the slots,
    1 %, at least 1); while the main cache has room (c - |W|'s size slots), W's LRU moves on to probation. The main cache is an SLRU: a hit in probation P moves to protected R (``protected`` of
    the main slots, 80 %), whose LRU then falls back to P when R is over its size. When a slot must be freed
    and W is full, W's LRU (the candidate) meets main's victim (P's LRU, else R's): the candidate is admitted to
    P and main's victim evicted only if the sketch rates the candidate strictly more frequent; otherwise the
    candidate is evicted (admission refused). While W is below its size, main's victim goes. The sketch is
    ``width`` = the smallest power of two >= max(16, c), reset every ``sample_factor`` x c requests (10, as
    Caffeine's W = 10 x size). No doorkeeper.

    ``admit="stage"`` (issue 50's admission knob; default ``"slot"``): TinyLFU also guards the door. A miss that
    finds no free slot is admitted only if the sketch rates it strictly more frequent than main's victim (P's
    LRU evictable entry, else R's; with none, it is admitted); otherwise it is *staged*: the pager reads it into
    the staging buffer for its layer step (the layer's residents are copied beside it), it takes no slot,
    evicts nothing and enters no queue (its request still counts in the sketch, so a returning expert gets in).
    An admitted miss then goes on as above (window, candidate duel). A prefetch of an expert it would refuse
    is not issued. With ``"slot"`` every miss takes a slot (demand paging), as the other policies do."""

    def __init__(self, *a) -> None:
        super().__init__(*a)
        # window W, probation P and protected R sizes in slots; main = P + R
        self.w_n = max(1, int(self.p["window"] * self.c))
        self.m_n = max(0, self.c - self.w_n)
        self.r_n = max(1, int(self.p["protected"] * self.m_n))
        w = 16
        while w < self.c:
            w *= 2
        self.sketch = CountMin(w, int(self.p["sample_factor"]) * self.c)
        self.W, self.P, self.R = OrderedDict(), OrderedDict(), OrderedDict()

    def request(self, u, resident):
        self.sketch.add(u)
        if not resident:
            return
        if u in self.W:
            self.W.move_to_end(u)
        elif u in self.P:
            del self.P[u]
            self.R[u] = None
            if len(self.R) > self.r_n:
                d, _ = self.R.popitem(last=False)
                self.P[d] = None
        else:
            self.R.move_to_end(u)

    def insert(self, u):
        self.W[u] = None
        while len(self.W) > self.w_n and len(self.P) + len(self.R) < self.m_n:
            v, _ = self.W.popitem(last=False)      # main has room: the window's LRU moves on, no test
            self.P[v] = None

    def victim(self, u, ok, li):
        while True:
            cm = _first(self.P, ok)
            if cm is None:
                cm = _first(self.R, ok)
            cw = _first(self.W, ok) if len(self.W) >= self.w_n else None
            if cw is None:
                return cm if cm is not None else _first(self.W, ok)
            if len(self.P) + len(self.R) < self.m_n:   # room in main (a pinned window entry held it back)
                del self.W[cw]
                self.P[cw] = None
                continue
            if cm is None:
                return cw
            if self.sketch.estimate(cw) > self.sketch.estimate(cm):
                del self.W[cw]
                self.P[cw] = None
                return cm
            return cw

    def refuse(self, u, ok):
        if self.p.get("admit", "slot") != "stage":
            return False
        cm = _first(self.P, ok)
        if cm is None:
            cm = _first(self.R, ok)
        return cm is not None and self.sketch.estimate(u) <= self.sketch.estimate(cm)

    def evicted(self, v):
        for q in (self.W, self.P, self.R):
            if v in q:
                del q[v]
                return

    dropped = evicted


TINYLFU_POLICIES = {"wtinylfu": WTinyLfu}
