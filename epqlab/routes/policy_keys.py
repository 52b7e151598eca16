"""The eviction policies that are one sort key over the evictable experts (the native pager's ``key_of``):
``lru``, ``ls``, ``ls_pos``, ``lfu``, ``static``, ``fnu``, ``lfuda``, ``heat``, ``gate_rank``.

Each class keeps the state of one pool (:mod:`epqlab.routes.online` drives it). The victim is the evictable
resident with the smallest key ``(tier, primary, last use, unit)``, exactly as ``native/pager/pager.cpp``
orders its evictable sets; units are ``layer index * n_expert + expert``.
"""
from __future__ import annotations

import math


class KeyPolicy:
    """Base of the key-ordered policies; subclasses define :meth:`key`. ``st`` is the driver's per-unit state
    (``last_use``, ``last_pass``, ``count`` lists and ``passno``, the current forward pass)."""

    name = "lru"

    def __init__(self, capacity: int, n_layers: int, n_expert: int, k: int, params: dict, st) -> None:
        self.c, self.L, self.E, self.k, self.p, self.st = capacity, n_layers, n_expert, k, params, st
        self.res: set[int] = set()

    # hooks the driver calls (see epqlab.routes.online)
    def begin_pass(self) -> None: ...
    def router(self, li: int, picked: list[int]) -> None: ...
    def request(self, u: int, resident: bool) -> None: ...
    def admit(self, u: int) -> None: ...

    def refuse(self, u: int, ok) -> bool:  # admission staging: every miss takes a slot
        return False

    def refused(self, u: int) -> None: ...

    def insert(self, u: int) -> None:
        self.res.add(u)

    def evicted(self, u: int) -> None:
        self.res.discard(u)

    def dropped(self, u: int) -> None:
        """``u`` left without being a victim (a failed read): no ghost, no aging."""
        self.res.discard(u)

    def key(self, u: int, li: int) -> tuple:
        """(tier, primary): lower goes first."""
        return (0, 0)

    def victim(self, u_in: int, ok, li: int):
        best, bk = None, None
        st = self.st
        for v in self.res:
            if not ok(v):
                continue
            kv = self.key(v, li) + (st.last_use[v], v)
            if bk is None or kv < bk:
                best, bk = v, kv
        return best


class Lru(KeyPolicy):
    """Least recently used (the classic; e.g. Denning, "Virtual memory", ACM Computing Surveys 1970)."""


class Ls(KeyPolicy):
    """Least-Stale (SpecMD, arXiv 2602.03921): stale (not requested in this forward pass) before current, the
    smallest layer first, least recent first."""

    def key(self, u, li):
        return (int(self.st.last_pass[u] == self.st.passno), u // self.E)


class LsPos(KeyPolicy):
    """Seed 000's position-aware Least-Stale: stale-left, current-left, stale-right, current-right (left = a layer
    before the one loading), the larger layer first in each group."""

    def key(self, u, li):
        lay = u // self.E
        return (int(self.st.last_pass[u] == self.st.passno) + (2 if lay >= li else 0), -lay)


class Lfu(KeyPolicy):
    """Least frequently used, counts kept across evictions ("perfect" LFU; e.g. Aho, Denning & Ullman,
    "Principles of optimal page replacement", JACM 1971)."""

    def key(self, u, li):
        return (0, self.st.count[u])


class Static(KeyPolicy):
    """Seed 002's hot-pin: the hot units (``hot``, set by the driver) are evicted only when no other victim
    exists; otherwise LRU."""

    hot: frozenset = frozenset()

    def key(self, u, li):
        return (int(u in self.hot), 0)


class Fnu(KeyPolicy):
    """Farthest predicted next use (this project's; native ``fnu_update``): each expert's pick rate is an EMA
    (weight ``fnu_alpha`` on the newest pass) of "picked in this pass", updated when its layer's router runs;
    its next use is predicted at ``pass * L + layer + floor(L / max(rate, 1e-3))`` layer steps and Belady's rule
    evicts the farthest prediction."""

    def __init__(self, *a) -> None:
        super().__init__(*a)
        n = self.L * self.E
        self.rate = [self.k / self.E] * n
        self.next_use = [0] * n

    def router(self, li, picked):
        a, L, pas = self.p["fnu_alpha"], self.L, self.st.passno
        ps = set(picked)
        for e in range(self.E):
            u = li * self.E + e
            self.rate[u] = (1 - a) * self.rate[u] + a * (1.0 if e in ps else 0.0)
            self.next_use[u] = pas * L + li + int(L / max(self.rate[u], 1e-3))

    def key(self, u, li):
        return (0, -self.next_use[u])


class Lfuda(KeyPolicy):
    """LFU with Dynamic Aging (Arlitt, Cherkasova, Dilley, Friedman & Jin, "Evaluating content management
    techniques for Web proxy caches", ACM SIGMETRICS PER 27(4), 2000), unit cost and size: an expert's key is
    K = A + F, F its requests while resident (1 at insertion), A the pool's age, set to the victim's K at each
    eviction. Evict the smallest K."""

    def __init__(self, *a) -> None:
        super().__init__(*a)
        self.age = 0
        self.freq: dict[int, int] = {}
        self.K: dict[int, int] = {}

    def request(self, u, resident):
        if resident:
            self.freq[u] += 1
            self.K[u] = self.age + self.freq[u]

    def insert(self, u):
        super().insert(u)
        self.freq[u] = 1
        self.K[u] = self.age + 1

    def evicted(self, u):
        super().evicted(u)
        self.age = self.K.pop(u)
        del self.freq[u]

    def dropped(self, u):
        super().evicted(u)
        self.K.pop(u, None)
        self.freq.pop(u, None)

    def key(self, u, li):
        return (0, self.K[u])


class Heat(KeyPolicy):
    """Decayed request frequency ("heat", as ftllm keeps it per expert; issue 50 cites its half-life of 128):
    each request at forward pass t sets h = h * 2^(-(t - t_last) / half_life) + 1; evict the coldest heat
    *now*, i.e. the smallest log2(h) + t_last / half_life (the same order for every now). Heat is kept across
    evictions. ``half_life`` in forward passes (one per decode token)."""

    def __init__(self, *a) -> None:
        super().__init__(*a)
        n = self.L * self.E
        self.h = [0.0] * n
        self.t = [0] * n
        self.hk = [0.0] * n

    def added(self, u) -> float:
        """What one request adds to the heat of ``u``."""
        return 1.0

    def request(self, u, resident):
        H, t = self.p["half_life"], self.st.passno
        self.h[u] = self.h[u] * math.pow(2.0, -(t - self.t[u]) / H) + self.added(u)
        self.t[u] = t
        self.hk[u] = math.log2(max(self.h[u], 1e-300)) + t / H  # h >= 1 for heat: the floor is gate_rank's

    def key(self, u, li):
        return (0, self.hk[u])


class GateRank(Heat):
    """Gate-rank: decayed router-probability mass per expert (issue 50's gate-rank, as the peer bigrig ships
    one; no paper defines it, so its half-life is heat's). Heat's rule (:class:`Heat`) with the request's probability mass for its 1:
    each request at forward pass t sets h = h * 2^(-(t - t_last) / half_life) + m, where m sums the router's
    probability (``RouteLog.probs``, normalised over the layer's experts) of that expert over the pass's
    tokens; evict the smallest log2(max(h, 1e-300)) + t_last / half_life. An expert picked often but with a
    small weight ranks below one picked rarely with a large weight. ``half_life`` in forward passes."""

    needs_probs = True

    def added(self, u) -> float:
        return self.st.mass.get(u, 0.0)


KEY_POLICIES = {"lru": Lru, "ls": Ls, "ls_pos": LsPos, "lfu": Lfu, "static": Static, "fnu": Fnu,
                "lfuda": Lfuda, "heat": Heat, "gate_rank": GateRank}
