"""Process memory and its limits: what the RAM budget counts (:mod:`.usage`: RssAnon + RssShmem +
RssFile of /proc), the ``"auto"`` budget (:mod:`.auto_budget`), and hard limits for child processes
(:mod:`.limits`: a memory cgroup, or an RSS sampler where none can be made). docs/DESIGN.md "Memory accounting".

Imports only the vocabulary (:mod:`epqlab.errors`, :mod:`epqlab.units`) and the standard library.
"""
from __future__ import annotations

from .usage import MemSample, PeakTracker, cpu_threads, drop_page_cache, page_cache_bytes, read_bytes, sample

__all__ = ["MemSample", "PeakTracker", "cpu_threads", "drop_page_cache", "page_cache_bytes", "read_bytes", "sample"]
