"""Live arena resize: ``Session.resize`` and ``Session(follow_memory=True)`` (docs/DESIGN.md §5,
"Resizing the arena").

A resize re-plans the arena for a new ``ram_budget`` with the rule the Session opened with
(:func:`~epqlab.engine.arena_sizing.plan_arena`: the same usage measured at open, the same reserve,
the same refusal quote) and hands the result to the pager (``Pager.resize``) under the decoder's
lock, so it lands between forward passes: a batched step or a prefetch in flight finishes first.

The follower (``follow_memory=True``) re-reads, at most every :data:`FOLLOW_PERIOD_S` between decode
steps, what ``ram_budget="auto"`` reads (:func:`epqlab.memory.auto_budget.auto_budget`: cgroup
headroom, MemAvailable, this process's RSS, the margin) and Linux PSI (``some avg10`` of
``/proc/pressure/memory``, or the cgroup v2 ``memory.pressure``; kernel docs
accounting/psi.rst). Its rule, with hysteresis:

- **shrink at once** to the auto budget when that falls below the current budget (headroom went
  under the margin), and by :data:`PRESSURE_STEP` of the arena when PSI ``some avg10`` is at least
  :data:`PSI_SHRINK` % and rose since the last look; never below the smallest budget that opens;
- **grow slowly** only when the auto budget exceeds the current one by :data:`GROW_HYSTERESIS` of the
  arena's capacity (or reaches the budget the Session opened with: the last step home),
  PSI ``some avg10`` is below :data:`PSI_CALM` %, and no shrink happened for :data:`GROW_HOLD_S`:
  by at most :data:`GROW_STEP` of the capacity per look, never above the budget the Session opened
  with (or ``max_ram_budget``).

Every resize is logged (``logging`` at INFO) and kept in ``Session.resize_events``.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from ..errors import ArenaTooSmall
from ..memory import auto_budget as budget_rule
from ..units import fmt_bytes, parse_bytes
from .arena_sizing import plan_arena

log = logging.getLogger("epqlab.resize")

FOLLOW_PERIOD_S = 0.25  # seconds between two looks at memory (a look costs ~50 µs: a few small /proc reads)
MONITOR_PERIOD_S = 0.05  # the monitor thread's period: how soon a shrink is asked for after headroom goes
PSI_SHRINK = 10.0       # % of time some task stalled on memory (avg10) that shrinks the arena
PSI_CALM = 1.0          # % below which growing is allowed
PRESSURE_STEP = 0.125   # fraction of the arena a pressure shrink gives back
GROW_HYSTERESIS = 0.10  # the auto budget must exceed the current one by this fraction of the arena capacity
GROW_HOLD_S = 10.0      # seconds after the last shrink before growing
GROW_STEP = 0.125       # fraction of the capacity one grow adds at most


@dataclass(frozen=True)
class ResizeEvent:
    """One resize: ``t`` (``time.time()``), ``reason`` (``"user"``, ``"headroom"``, ``"pressure"``,
    ``"grow"``), budgets and arenas before/after (bytes), ``seconds`` the pager took, ``evictions``
    it made, and ``psi_some_avg10`` (%, None where PSI is not readable)."""

    t: float
    reason: str
    budget_before: int
    budget_after: int
    arena_before: int
    arena_after: int
    seconds: float
    evictions: int
    psi_some_avg10: float | None = None

    def as_dict(self) -> dict:
        return asdict(self)


def plan_for_budget(session, budget: int) -> int:
    """Arena bytes ``budget`` buys for ``session`` (clamped to every routed expert's slots), by the rule it
    opened with. Raises ArenaTooSmall (the same quote ``Session`` gives)."""
    lay = session.layout
    p = session.pager
    plan = plan_arena(lay, session.n_expert_used, budget=budget, used_before_arena=session.used_before_arena,
                      reserve=session.reserve_bytes, dense_bytes=int(session.load_report.get("dense_bytes", 0)),
                      io_threads=p.io_threads, n_ctx=session.options.n_ctx, n_seq=session.options.n_seq_max)
    return min(plan.arena, p.all_experts_bytes(lay))


def budget_for_arena(session, arena_bytes: int) -> int:
    """The ``ram_budget`` (bytes) that buys ``session`` an arena of ``arena_bytes``: plan_arena's rule
    (arena = budget - usage at open - reserve - read buffers) run backwards."""
    return session.used_before_arena + session.reserve_bytes + session.read_buffer_bytes + int(arena_bytes)


def resize_session(session, ram_budget, reason: str = "user", psi: float | None = None) -> ResizeEvent | None:
    """Resize ``session``'s arena to what ``ram_budget`` (bytes or "6GiB") buys; see :meth:`Session.resize`.
    For the follower (``reason`` other than ``"user"``) a budget that leaves the arena as it is only moves
    ``session.budget_bytes`` and returns None."""
    p = session.pager
    if p is None:
        raise ValueError("resize needs a paged Session (pager=True)")
    if session.budget_bytes is None:
        raise ValueError("resize needs a Session opened with ram_budget (bytes or 'auto'), not arena_bytes or "
                         "no budget: the arena is sized from the budget")
    budget = parse_bytes(ram_budget)
    arena = plan_for_budget(session, budget)
    least = p.min_resize_bytes
    if arena < least:  # slot addressing keeps top-k slots in every class (docs/DESIGN.md §3f)
        smallest = budget - arena + least
        raise ArenaTooSmall(
            f"ram_budget {fmt_bytes(budget)} gives an arena of {fmt_bytes(arena)}, below the {fmt_bytes(least)} this "
            f"Session's arena needs ({session.expert_addressing} addressing: top-{session.n_expert_used} slots in "
            f"{'every slot class' if session.expert_addressing == 'slots' else 'the largest slot class'}). "
            f"The smallest budget that works is {smallest} bytes ({fmt_bytes(smallest)}).")
    if arena > p.capacity_bytes:
        raise ValueError(f"ram_budget {fmt_bytes(budget)} needs an arena of {fmt_bytes(arena)}, above the "
                         f"{fmt_bytes(p.capacity_bytes)} this Session made room for at open; open it with "
                         f"max_ram_budget={fmt_bytes(budget)!r} (or more)")
    before, b0 = p.arena_bytes, session.budget_bytes
    if reason != "user" and min(arena, p.capacity_bytes) == before:  # the follower's budget moved, the arena would not
        session.budget_bytes = budget
        return None
    with session.decoder.lock:  # between forward passes: a batched step or a prefetch finishes first
        ev0 = int(p.native.stats()["evictions"])
        t0 = time.perf_counter()
        p.resize(arena)
        dt = time.perf_counter() - t0
        ev = int(p.native.stats()["evictions"]) - ev0
    session.budget_bytes = budget
    e = ResizeEvent(time.time(), reason, b0, budget, before, p.arena_bytes, dt, ev, psi)
    session.resize_events.append(e)
    log.info("arena %s -> %s (ram_budget %s -> %s, %s; %.1f ms, %d evictions)", fmt_bytes(before),
             fmt_bytes(e.arena_after), fmt_bytes(b0), fmt_bytes(budget), reason, dt * 1e3, ev)
    return e


def read_psi(path: Path | None = None) -> float | None:
    """``some avg10`` (% of the last 10 s some task stalled on memory) from ``path`` (default: this
    process's cgroup v2 ``memory.pressure`` if readable, else ``/proc/pressure/memory``); None where
    PSI is not available (kernel without CONFIG_PSI, or ``psi=0``)."""
    paths = [path] if path is not None else [*_cgroup_pressure(), Path("/proc/pressure/memory")]
    for f in paths:
        try:
            for line in f.read_text().splitlines():
                if line.startswith("some "):
                    return float(dict(kv.split("=") for kv in line.split()[1:])["avg10"])
        except (OSError, KeyError, ValueError):
            continue
    return None


def _cgroup_pressure() -> list[Path]:
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            if line.startswith("0::"):
                return [Path("/sys/fs/cgroup") / line[3:].lstrip("/") / "memory.pressure"]
    except OSError:
        pass
    return []


class MemoryFollower:
    """``Session(follow_memory=True)``'s controller (the module docstring states the rule). :meth:`look`
    runs between decode steps (``Session._on_step``, the decoder's lock held). ``floor_under_pressure``:
    the arena is at its smallest and memory is still short, the server's cue to answer new requests 503.

    ``budget_fn`` (tests): returns the auto budget in bytes instead of :func:`auto_budget`; ``psi_fn``
    likewise for PSI."""

    def __init__(self, session, budget_fn=None, psi_fn=None, period_s: float | None = None):
        self.session = session
        self.ceiling = session.budget_bytes  # never grows above what it opened with (or max_ram_budget)
        self.budget_fn = budget_fn or (lambda: budget_rule.auto_budget().budget)
        self.psi_fn = psi_fn or read_psi
        self.period_s = FOLLOW_PERIOD_S if period_s is None else float(period_s)
        self._next = 0.0
        self._last_shrink = float("-inf")
        self._last_psi: float | None = None
        self.floor_under_pressure = False
        self.looks = 0
        self._pending = None  # a shrink the monitor asked for: (budget, budget before, arena before, time, psi)
        self._thread = None

    # -- the monitor thread: shrinks land within one layer (docs/DESIGN.md §5 "Following memory") ----------
    def start(self) -> "MemoryFollower":
        """Start the monitor thread: every :data:`MONITOR_PERIOD_S` it reads the auto budget and, when it fell
        below the current one, asks the pager for the smaller arena (``request_resize``, an atomic store), which
        the hook applies before the next layer's load; when no forward pass runs it applies it itself (the
        decoder's lock taken for at most 10 ms). A hog that takes memory in a second is then answered within a
        layer, not a decode step. Growth stays with :meth:`look` (slow on purpose)."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._monitor, name="epqlab-follow-memory", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if getattr(self, "_thread", None) is not None:
            self._stop.set()
            self._thread.join(2.0)
            self._thread = None

    def _monitor(self) -> None:
        while not self._stop.wait(MONITOR_PERIOD_S):
            try:
                self._watch()
            except Exception:  # noqa: BLE001 - the monitor must outlive a failed reading; logged
                log.exception("follow_memory: the monitor's reading failed")

    def _watch(self) -> None:
        s = self.session
        p = s.pager
        if p is None or s.decoder.closed or self._pending is not None:
            return
        auto, cur = self.budget_fn(), s.budget_bytes
        if auto >= cur:
            return
        floor = self._floor_cached()
        target = max(auto, floor)
        if target >= cur:
            self.floor_under_pressure = cur <= floor  # at the floor and still short: the server's 503
            return
        try:
            arena = min(plan_for_budget(s, target), p.capacity_bytes)
        except ArenaTooSmall:
            return
        if arena >= p.arena_bytes:
            return  # the budget moves, the arena would not: look() records it between steps
        self._pending = (target, cur, p.arena_bytes, time.time(), self.psi_fn())
        p.native.request_resize(arena)
        if s.decoder.lock.acquire(timeout=0.01):  # nobody is decoding: apply it here
            try:
                self._settle()
            finally:
                s.decoder.lock.release()

    def _settle(self) -> ResizeEvent | None:
        """Record a resize the monitor asked for (call with the decoder's lock held): applied by the hook inside
        a forward pass, or here. None while it is still pending."""
        if self._pending is None:
            return None
        s, p = self.session, self.session.pager
        if p.native.requested_resize >= 0:
            p.native.apply_requested_resize()
            if p.native.requested_resize >= 0:
                return None
        target, b0, before, t_wall, psi = self._pending
        self._pending = None
        s.budget_bytes = target
        self._last_shrink = time.monotonic()
        e = ResizeEvent(t_wall, "headroom", b0, target, before, p.arena_bytes, p.native.last_resize_us / 1e6,
                        int(p.native.last_resize_evictions), psi)
        s.resize_events.append(e)
        log.info("arena %s -> %s (ram_budget %s -> %s, headroom, monitor; %.1f ms, %d evictions)", fmt_bytes(before),
                 fmt_bytes(e.arena_after), fmt_bytes(b0), fmt_bytes(target), e.seconds * 1e3, e.evictions)
        return e

    def floor(self) -> int:
        """The smallest budget that opens an arena (the quote's exact part), bytes."""
        lo, hi = 0, self.ceiling
        least = self.session.pager.min_resize_bytes
        while hi - lo > 2**20:  # bisect the refusal (plan_arena's and the slot classes'): monotone in the budget
            mid = (lo + hi) // 2
            try:
                ok = plan_for_budget(self.session, mid) >= least
            except ArenaTooSmall:
                ok = False
            lo, hi = (lo, mid) if ok else (mid, hi)
        return hi

    def short_of_memory(self) -> bool:
        """Whether the arena is at its floor with memory still short (:attr:`floor_under_pressure`), read again
        when that was set: no decode step runs while a server refuses new requests, so the server asks here
        (at most every :data:`FOLLOW_PERIOD_S`, no resize; the next decode step grows the arena back)."""
        if not self.floor_under_pressure:
            return False
        now = time.monotonic()
        if now >= self._next:
            self._next = now + self.period_s
            psi = self.psi_fn()
            rising = self._stalls_rising(psi)
            self.floor_under_pressure = self.budget_fn() < self.session.budget_bytes or rising
        return self.floor_under_pressure

    def _stalls_rising(self, psi: float | None) -> bool:
        """PSI ``some avg10`` at least :data:`PSI_SHRINK` % and above the last reading (which it then replaces)."""
        rising = psi is not None and psi >= PSI_SHRINK and (self._last_psi is None or psi > self._last_psi)
        self._last_psi = psi
        return rising

    def _resize(self, target: int, reason: str, psi) -> ResizeEvent | None:
        try:
            return resize_session(self.session, target, reason, psi)
        except ArenaTooSmall as e:  # never raise inside a decode step: stay at this size
            log.warning("follow_memory: no resize to %s (%s)", fmt_bytes(target), e)
            return None

    def look(self, now: float | None = None) -> ResizeEvent | None:
        now = time.monotonic() if now is None else now
        if now < self._next:
            return None
        self._next = now + self.period_s
        self.looks += 1
        settled = self._settle()
        if settled is not None:
            return settled
        s = self.session
        cur = s.budget_bytes
        auto = self.budget_fn()
        psi = self.psi_fn()
        rising = self._stalls_rising(psi)
        floor = self._floor_cached()
        target, reason = cur, None
        if auto < cur:
            target, reason = auto, "headroom"
        elif rising:
            target, reason = cur - int(PRESSURE_STEP * s.pager.arena_bytes), "pressure"
        if reason is not None:
            target = max(target, floor)
            self.floor_under_pressure = target >= cur and cur <= floor
            if target < cur:
                self._last_shrink = now
                return self._resize(target, reason, psi)
            return None
        self.floor_under_pressure = False
        calm = psi is None or psi < PSI_CALM
        room = auto - cur > GROW_HYSTERESIS * s.pager.capacity_bytes or auto >= self.ceiling  # (the last step home)
        if room and calm and now - self._last_shrink >= GROW_HOLD_S and cur < self.ceiling:
            step = int(GROW_STEP * s.pager.capacity_bytes)
            target = min(auto, self.ceiling, cur + step)
            if target > cur:
                return self._resize(target, "grow", psi)
        return None

    def _floor_cached(self) -> int:
        if not hasattr(self, "_floor"):
            self._floor = self.floor()
        return self._floor
