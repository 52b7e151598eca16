"""Process memory as the budget counts it: RssAnon + RssShmem (arena memfd, KV cache, compute
buffers, heap), with file-backed RSS (mmapped non-expert weights) reported apart.
Source: /proc/self/status (Linux); see shared/DESIGN.md §5."""
from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass
class MemSample:
    """One reading, bytes."""

    rss_anon: int
    rss_shmem: int
    rss_file: int

    @property
    def budgeted(self) -> int:
        """RssAnon + RssShmem: what a RAM budget bounds, bytes."""
        return self.rss_anon + self.rss_shmem


def sample(pid: int | str = "self") -> MemSample:
    """Read RssAnon, RssShmem and RssFile of a process from /proc/<pid>/status (bytes)."""
    vals = {"RssAnon": 0, "RssShmem": 0, "RssFile": 0}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key = line.split(":", 1)[0]
            if key in vals:
                vals[key] = int(line.split()[1]) * 1024
    return MemSample(vals["RssAnon"], vals["RssShmem"], vals["RssFile"])


class PeakTracker:
    """Keeps the peak of each field over calls to :meth:`update`."""

    def __init__(self):
        self.peak = MemSample(0, 0, 0)
        self.peak_budgeted = 0

    def update(self) -> MemSample:
        s = sample()
        self.peak = MemSample(max(self.peak.rss_anon, s.rss_anon), max(self.peak.rss_shmem, s.rss_shmem),
                              max(self.peak.rss_file, s.rss_file))
        self.peak_budgeted = max(self.peak_budgeted, s.budgeted)
        return s


def cpu_threads() -> int:
    """CPUs this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
