"""LIRS (Jiang & Zhang, "LIRS: an efficient low inter-reference recency set replacement policy to improve
buffer cache performance", ACM SIGMETRICS 2002). ``native/pager/policy_lirs.cpp`` is the same rule in C++."""
from __future__ import annotations

from collections import OrderedDict

from .policy_queues import QueuePolicy, _first


class Lirs(QueuePolicy):
    """LIRS ranks an expert by its inter-reference recency (IRR: how many other experts were requested between
    its last two requests) instead of its recency. The arena's c slots hold ``c - h`` LIR experts (small IRR)
    and h resident HIR ones, h = max(1, floor(``hir_ratio`` x c)) (the paper's 1 %). The stack S orders experts
    by recency (bottom = least recent) and holds every LIR expert plus the HIR experts (resident or not) more
    recent than the bottom LIR one; the queue Q holds the resident HIR experts, oldest first. After every
    change the stack is *pruned*: HIR entries at its bottom leave it (a non-resident one is then forgotten).

    A request of expert X moves X to S's top. If X is LIR, nothing else changes (pruning if X was the bottom).
    Otherwise X becomes LIR when it was still in S (its IRR is below the oldest LIR expert's recency) or the
    LIR set has fewer than ``c - h`` experts (warm-up), leaving Q; then S's bottom LIR expert is demoted to HIR
    (to Q's tail, if resident) while the LIR set is over ``c - h``, and S is pruned. A resident HIR X that
    stays HIR moves to Q's tail; a missed HIR X enters Q's tail when it gets its slot. The victim is Q's oldest
    (a HIR expert); a victim leaves Q but stays in S as a non-resident HIR entry while S holds it.

    The pager's constraints: the request is processed at request time, before the step's misses take slots
    (so a miss's promotion and the demotion it causes come before its victim is chosen, as every request of a
    layer step counts first); a victim must be evictable (resident, unpinned, slot large enough), so when Q
    has none the least recent evictable LIR expert (from S's bottom) goes, and becomes a non-resident HIR
    entry in S. A prefetched expert enters Q's tail as a resident HIR expert without a stack move (no request);
    an entry it had in S stays, so its first demand request promotes it as a resident HIR hit in S. A failed
    read (``dropped``) forgets the expert. S is not bounded beyond its definition: it holds at most every
    (layer, expert) unit, L x E entries."""

    def __init__(self, *a) -> None:
        super().__init__(*a)
        self.h = max(1, int(self.p["hir_ratio"] * self.c))
        self.lir_n = max(0, self.c - self.h)
        self.S: OrderedDict = OrderedDict()   # oldest (bottom) first
        self.Q: OrderedDict = OrderedDict()   # resident HIR, oldest first
        self.lir: set[int] = set()
        self.res: set[int] = set()

    def _prune(self):
        while self.S:
            b = next(iter(self.S))
            if b in self.lir:
                return
            del self.S[b]

    def _demote(self):
        for b in self.S:
            if b in self.lir:
                self.lir.discard(b)
                if b in self.res:
                    self.Q[b] = None
                return

    def request(self, u, resident):
        if u in self.lir:
            bottom = next(iter(self.S)) == u
            self.S.move_to_end(u)
            if bottom:
                self._prune()
            return
        in_s = u in self.S
        self.S.pop(u, None)
        self.S[u] = None
        if in_s or len(self.lir) < self.lir_n:
            self.lir.add(u)
            self.Q.pop(u, None)
            while len(self.lir) > self.lir_n:
                self._demote()
            self._prune()
        elif resident:
            self.Q.move_to_end(u)

    def insert(self, u):
        self.res.add(u)
        if u not in self.lir:
            self.Q[u] = None

    def victim(self, u, ok, li):
        v = _first(self.Q, ok)
        if v is not None:
            return v
        for x in self.S:
            if x in self.lir and ok(x):
                return x
        return None

    def evicted(self, v):
        self.res.discard(v)
        self.Q.pop(v, None)
        if v in self.lir:
            self.lir.discard(v)
            self._prune()

    def dropped(self, v):
        self.res.discard(v)
        self.Q.pop(v, None)
        self.S.pop(v, None)
        self.lir.discard(v)
        self._prune()


LIRS_POLICIES = {"lirs": Lirs}
