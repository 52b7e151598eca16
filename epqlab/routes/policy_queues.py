"""The eviction policies built from queues and ghost lists: ``arc``, ``2q``, ``sieve``, ``s3fifo``,
``wtinylfu`` (one pool each; :mod:`epqlab.routes.online` drives them, ``native/pager/policy_queues.cpp`` is the
same rule in C++).

Shared conventions, the pager's constraints on each paper's algorithm:

- Every miss is admitted (demand paging: the expert must be in a slot to be computed), so a policy frees
  exactly one slot per miss (:meth:`victim`), and only when no slot is free.
- A victim must be *evictable* (``ok``: resident, not pinned by the layer loading, not in flight); a queue
  scan passes over the others without touching them (no bit cleared, no move), and when the queue the paper
  would take from has none, the other queue gives the victim.
- Queues are ordered oldest (LRU end) first; "first ok" is the oldest evictable entry.
- ``c`` is the pool's slot count.
"""
from __future__ import annotations

from collections import OrderedDict


def _first(q, ok):
    for v in q:
        if ok(v):
            return v
    return None


class QueuePolicy:
    def __init__(self, capacity: int, n_layers: int, n_expert: int, k: int, params: dict, st) -> None:
        self.c, self.L, self.E, self.k, self.p, self.st = capacity, n_layers, n_expert, k, params, st

    def begin_pass(self) -> None: ...
    def router(self, li: int, picked: list[int]) -> None: ...
    def admit(self, u: int) -> None: ...

    def refuse(self, u: int, ok) -> bool:
        """Admission staging (``admit="stage"`` of ``wtinylfu``, ``2q``, ``s3fifo``): asked only when no slot is
        free for the miss ``u`` (a prefetch asks too, so it changes nothing); True = ``u`` is used from the
        staging buffer for its layer step, takes no slot, evicts nothing and is not inserted."""
        return False

    def refused(self, u: int) -> None:
        """A demand miss was refused (the driver calls it after :meth:`refuse` said True)."""


def _ghost(q: OrderedDict, u: int, n: int) -> None:
    """Append ``u`` to the ghost FIFO ``q`` and drop its oldest ids beyond ``n``."""
    q[u] = None
    while len(q) > n:
        q.popitem(last=False)


class Arc(QueuePolicy):
    """ARC (Megiddo & Modha, "ARC: A Self-Tuning, Low Overhead Replacement Cache", FAST 2003): T1 (seen once
    recently) and T2 (seen at least twice) with ghost lists B1, B2 of their recent victims; a miss that hits a
    ghost in B1 grows the target size p of T1 by max(1, |B2| // |B1|), one in B2 shrinks it by
    max(1, |B1| // |B2|) (integer division), and the ghost returns to T2; REPLACE evicts T1's LRU into B1 when
    |T1| > p (or |T1| == p and the miss is in B2), else T2's LRU into B2. After each insertion the ghosts are
    trimmed to |T1| + |B1| <= c and |T1| + |T2| + |B1| + |B2| <= 2c (oldest ghost first), as ARC's case IV."""

    def __init__(self, *a) -> None:
        super().__init__(*a)
        self.T1, self.T2, self.B1, self.B2 = OrderedDict(), OrderedDict(), OrderedDict(), OrderedDict()
        self.target = 0

    def request(self, u, resident):
        if resident:
            if u in self.T1:
                del self.T1[u]
            else:
                del self.T2[u]
            self.T2[u] = None

    def admit(self, u):
        b1, b2 = len(self.B1), len(self.B2)
        if u in self.B1:
            self.target = min(self.c, self.target + max(1, b2 // b1))
        elif u in self.B2:
            self.target = max(0, self.target - max(1, b1 // b2))

    def victim(self, u, ok, li):
        a, b = _first(self.T1, ok), _first(self.T2, ok)
        n1 = len(self.T1)
        from_t1 = n1 >= 1 and ((u in self.B2 and n1 == self.target) or n1 > self.target)
        return a if (from_t1 and a is not None) or b is None else b

    def evicted(self, v):
        if v in self.T1:
            del self.T1[v]
            self.B1[v] = None
        else:
            del self.T2[v]
            self.B2[v] = None

    def dropped(self, v):
        self.T1.pop(v, None)
        self.T2.pop(v, None)

    def insert(self, u):
        if u in self.B1:
            del self.B1[u]
            self.T2[u] = None
        elif u in self.B2:
            del self.B2[u]
            self.T2[u] = None
        else:
            self.T1[u] = None
        while len(self.T1) + len(self.B1) > self.c and self.B1:
            self.B1.popitem(last=False)
        while len(self.T1) + len(self.T2) + len(self.B1) + len(self.B2) > 2 * self.c and (self.B2 or self.B1):
            (self.B2 if self.B2 else self.B1).popitem(last=False)


class TwoQ(QueuePolicy):
    """2Q, full version (Johnson & Shasha, "2Q: A Low Overhead High Performance Buffer Management Replacement
    Algorithm", VLDB 1994): a first touch enters the FIFO A1in; a victim taken from A1in leaves its id in the
    ghost FIFO A1out (at most Kout ids); a miss found in A1out enters the LRU Am; a hit in Am refreshes it, a hit
    in A1in does nothing. The victim is A1in's oldest while |A1in| > Kin, else Am's LRU.
    Kin = max(1, floor(kin * c)), Kout = max(1, floor(kout * c)); the paper's kin = 25 %, kout = 50 %."""

    def __init__(self, *a) -> None:
        super().__init__(*a)
        self.kin = max(1, int(self.p["kin"] * self.c))
        self.kout = max(1, int(self.p["kout"] * self.c))
        self.A1in, self.A1out, self.Am = OrderedDict(), OrderedDict(), OrderedDict()
        self.stage = self.p.get("admit", "slot") == "stage"

    def refuse(self, u, ok):
        return self.stage and u not in self.A1out

    def refused(self, u):
        _ghost(self.A1out, u, self.kout)

    def request(self, u, resident):
        if resident and u in self.Am:
            self.Am.move_to_end(u)

    def victim(self, u, ok, li):
        if len(self.A1in) > self.kin:
            v = _first(self.A1in, ok)
            return v if v is not None else _first(self.Am, ok)
        v = _first(self.Am, ok)
        return v if v is not None else _first(self.A1in, ok)

    def evicted(self, v):
        if v in self.A1in:
            del self.A1in[v]
            _ghost(self.A1out, v, self.kout)
        else:
            del self.Am[v]

    def dropped(self, v):
        self.A1in.pop(v, None)
        self.Am.pop(v, None)

    def insert(self, u):
        if u in self.A1out:
            del self.A1out[u]
            self.Am[u] = None
        else:
            self.A1in[u] = None


class Sieve(QueuePolicy):
    """SIEVE (Zhang, Yang, Yue, Vigfusson & Rashmi, "SIEVE is Simpler than LRU: an Efficient Turn-Key Eviction
    Algorithm for Web Caches", NSDI 2024): one FIFO queue and a visited bit per entry, set by a hit; new
    entries go to the head; the hand starts at the tail (oldest) and moves toward the head, clearing visited
    bits, and evicts the first unvisited entry; it stays where it stopped (at the victim's newer neighbour)
    and wraps from the head back to the tail."""

    def __init__(self, *a) -> None:
        super().__init__(*a)
        self.nxt: dict = {}      # toward the head (newer); None at the head
        self.prv: dict = {}
        self.tail = self.head = None
        self.visited: dict = {}
        self.hand = None         # None: start at the tail

    def request(self, u, resident):
        if resident:
            self.visited[u] = True

    def insert(self, u):
        self.prv[u], self.nxt[u] = self.head, None
        if self.head is None:
            self.tail = u
        else:
            self.nxt[self.head] = u
        self.head = u
        self.visited[u] = False

    def _unlink(self, v):
        p, n = self.prv.pop(v), self.nxt.pop(v)
        if p is None:
            self.tail = n
        else:
            self.nxt[p] = n
        if n is None:
            self.head = p
        else:
            self.prv[n] = p
        del self.visited[v]

    def victim(self, u, ok, li):
        n = len(self.visited)
        x = self.hand if self.hand is not None else self.tail
        for _ in range(2 * n + 1):
            if x is None:
                x = self.tail
            if ok(x):
                if self.visited[x]:
                    self.visited[x] = False
                else:
                    self.hand = self.nxt[x]
                    return x
            x = self.nxt[x]
        return None

    def evicted(self, v):
        if self.hand == v:
            self.hand = self.nxt[v]
        self._unlink(v)

    dropped = evicted


class S3Fifo(QueuePolicy):
    """S3-FIFO (Yang, Zhang, Qiu, Yue & Rashmi, "FIFO queues are all you need for cache eviction", SOSP 2023):
    a small FIFO S (``small_ratio`` of the slots, 10 %), a main FIFO M and a ghost FIFO G of ids
    (``ghost_ratio`` x slots, 90 %); a 2-bit frequency per entry (hits, capped at 3). A miss found in G enters M,
    any other miss S, with frequency 0. While |S| >= max(1, floor(small_ratio * c)) the victim comes from S:
    S's oldest moves to M if its frequency >= ``move_threshold`` (the paper's "freq > 1": 2), else it is evicted
    and its id enters G. Otherwise from M: M's oldest with frequency > 0 is reinserted at M's head with its
    frequency decremented, the first with 0 is evicted. One victim per miss: a promotion into a full M does not
    evict from M by itself (the |S| test keeps M's share).
    ``admit="stage"`` (issue 50's admission knob at S's door; default ``"slot"``): a miss that finds no free slot
    and is not in G is staged (used for its layer step from the staging buffer, no slot taken) and its id goes
    to G, so its next miss enters M: a one-hit wonder never takes a slot once the arena is full."""

    def __init__(self, *a) -> None:
        super().__init__(*a)
        self.s_n = max(1, int(self.p["small_ratio"] * self.c))
        self.g_n = max(1, int(self.p["ghost_ratio"] * self.c))
        self.thr = int(self.p["move_threshold"])
        self.stage = self.p.get("admit", "slot") == "stage"
        self.S, self.M, self.G = OrderedDict(), OrderedDict(), OrderedDict()
        self.freq: dict = {}

    def refuse(self, u, ok):
        return self.stage and u not in self.G

    def refused(self, u):
        _ghost(self.G, u, self.g_n)

    def request(self, u, resident):
        if resident:
            self.freq[u] = min(self.freq[u] + 1, 3)

    def insert(self, u):
        if u in self.G:
            del self.G[u]
            self.M[u] = None
        else:
            self.S[u] = None
        self.freq[u] = 0

    def victim(self, u, ok, li):
        if len(self.S) >= self.s_n:
            while True:
                t = _first(self.S, ok)
                if t is None:
                    break
                if self.freq[t] >= self.thr:
                    del self.S[t]
                    self.M[t] = None
                    continue
                return t
        while True:
            t = _first(self.M, ok)
            if t is None:
                break
            if self.freq[t] > 0:
                self.freq[t] -= 1
                self.M.move_to_end(t)
                continue
            return t
        return _first(self.S, ok)

    def evicted(self, v):
        if v in self.S:
            del self.S[v]
            _ghost(self.G, v, self.g_n)
        else:
            del self.M[v]
        del self.freq[v]

    def dropped(self, v):
        self.S.pop(v, None)
        self.M.pop(v, None)
        self.freq.pop(v, None)


QUEUE_POLICIES = {"arc": Arc, "2q": TwoQ, "sieve": Sieve, "s3fifo": S3Fifo}
