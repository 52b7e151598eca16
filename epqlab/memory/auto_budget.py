"""``ram_budget="auto"``: a RAM budget that fits the machine without tuning.

Rule (stated here, reported by the CLI and in ``Session.budget_source``):

    available = min(memory-cgroup headroom, MemAvailable) + what this process already holds (RSS)
    budget    = available - margin,   margin = max(AUTO_MARGIN_MIN, AUTO_MARGIN_FRACTION x available)

- memory-cgroup headroom: this process's memory cgroup's effective limit (cgroup v2 ``memory.max``,
  the smallest along the path to the root; cgroup v1 ``hierarchical_memory_limit`` from
  ``memory.stat``) minus what the cgroup already uses (``memory.current`` / ``memory.usage_in_bytes``);
  no limit (``max``, or v1's "unlimited" 2^63 rounded down to a page) means no cgroup term.
  A cgroup charges page cache too (kernel docs: admin-guide/cgroup-v2.rst "Memory Interface
  Files", cgroup-v1/memory.rst §2.2), which is why the budget bounds the whole resident set.
- MemAvailable (``/proc/meminfo``): the kernel's estimate of memory available for new work
  without swapping (Documentation/filesystems/proc.rst).
- The margin leaves room for the rest of the machine and for the kernel's estimate being
  optimistic: 10 % of what is available, at least 256 MiB.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..errors import BudgetTooLargeError
from .limits import _mounts
from .usage import sample
from ..units import fmt_bytes

AUTO_MARGIN_MIN = 256 * 2**20  # bytes
AUTO_MARGIN_FRACTION = 0.10
_UNLIMITED = 2**62  # cgroup v1 reports "no limit" as 2^63 - 1 rounded down to a page


@dataclass(frozen=True)
class AutoBudget:
    """``budget`` (bytes) and how it was chosen: ``source`` (``"cgroup-v1"`` | ``"cgroup-v2"`` |
    ``"MemAvailable"``), ``available`` (bytes, before the margin), ``margin`` (bytes)."""

    budget: int
    source: str
    available: int
    margin: int

    def describe(self) -> str:
        return (f"ram_budget auto = {fmt_bytes(self.budget)}: {fmt_bytes(self.available)} available "
                f"({self.source}, this process included) - margin {fmt_bytes(self.margin)}")


def _int(path: Path) -> int | None:
    try:
        t = path.read_text().strip()
    except OSError:
        return None
    return int(t) if t.isdigit() else None


def _stat(path: Path, key: str) -> int:
    """The value of ``key`` in a cgroup ``memory.stat`` file (bytes), 0 when absent or unreadable."""
    try:
        for kv in path.read_text().splitlines():
            if kv.startswith(key + " "):
                return int(kv.split()[1])
    except (OSError, ValueError):
        pass
    return 0


def cgroup_headroom() -> tuple[int, str] | None:
    """(bytes the own memory cgroup may still charge, "cgroup-v1" | "cgroup-v2"), or None when no
    limit applies or none can be read.

    Headroom = limit - (usage - inactive file cache): the cgroup's clean page cache on the inactive list
    (``total_inactive_file`` in v1's memory.stat, ``inactive_file`` in v2's) is reclaimed before the
    cgroup is out of memory, so it is room, not use -- the "working set" of cAdvisor and the kubelet's
    eviction rule. Without it, a file read just before a Session opens (a predictor .npz) would count
    against the budget check as if it were held."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    mounts = _mounts()
    for line in lines:
        hid, ctrls, path = line.split(":", 2)
        if "memory" in ctrls.split(","):  # v1
            for mnt, typ, opts in mounts:
                if typ == "cgroup" and "memory" in opts.split(","):
                    d = Path(mnt + path.rstrip("/"))
                    limit = None
                    try:
                        for kv in (d / "memory.stat").read_text().splitlines():
                            if kv.startswith("hierarchical_memory_limit "):
                                limit = int(kv.split()[1])
                    except OSError:
                        limit = _int(d / "memory.limit_in_bytes")
                    used = _int(d / "memory.usage_in_bytes")
                    if limit is not None and limit < _UNLIMITED and used is not None:
                        used = max(0, used - _stat(d / "memory.stat", "total_inactive_file"))
                        return max(0, limit - used), "cgroup-v1"
        elif hid == "0" and ctrls == "":  # v2
            for mnt, typ, _ in mounts:
                if typ == "cgroup2":
                    root = Path(mnt)
                    d = Path(mnt + path.rstrip("/"))
                    best = None
                    p = d
                    while True:  # the effective limit is the smallest on the way up
                        lim = _int(p / "memory.max")
                        cur = _int(p / "memory.current")
                        if lim is not None and cur is not None:
                            room = max(0, lim - max(0, cur - _stat(p / "memory.stat", "inactive_file")))
                            best = room if best is None else min(best, room)
                        if p == root or p.parent == p:
                            break
                        p = p.parent
                    if best is not None:
                        return best, "cgroup-v2"
    return None


def mem_available() -> int:
    """MemAvailable from /proc/meminfo, bytes. Raises OSError when it cannot be read."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise OSError("/proc/meminfo has no MemAvailable line (Linux >= 3.14 has one)")


def check_budget(budget: int) -> None:
    """Refuse a ``ram_budget`` above what this machine can give the process: min(memory-cgroup headroom,
    MemAvailable) + what the process already holds, the ``available`` of :func:`auto_budget` (the same
    numbers, without the margin).

    Raises:
        BudgetTooLargeError: naming the budget, what is available and from where, and the ``"auto"`` value.
    """
    ab = auto_budget()
    if budget > ab.available:
        raise BudgetTooLargeError(
            f"ram_budget {fmt_bytes(budget)} is more than this machine can give this process: "
            f"{fmt_bytes(ab.available)} available ({ab.source}, this process included); the kernel would kill it "
            f"once the arena fills. Pass a smaller budget, or ram_budget='auto' ({fmt_bytes(ab.budget)} here).")


def auto_budget() -> AutoBudget:
    """The budget of the module docstring's rule, for a Session about to open in this process."""
    avail, source = mem_available(), "MemAvailable"
    cg = cgroup_headroom()
    if cg is not None and cg[0] < avail:
        avail, source = cg
    avail += sample().total
    margin = max(AUTO_MARGIN_MIN, int(AUTO_MARGIN_FRACTION * avail))
    return AutoBudget(max(0, avail - margin), source, avail, margin)


__all__ = ["AutoBudget", "auto_budget", "check_budget", "cgroup_headroom", "mem_available", "AUTO_MARGIN_MIN", "AUTO_MARGIN_FRACTION"]
