"""Process memory as the RAM budget counts it: the whole resident set, RssAnon + RssShmem +
RssFile (dense weights, arena, KV cache, compute buffers, heap, libraries) -- what a memory cgroup
charges (docs/DESIGN.md "Memory accounting"). Source: /proc/<pid>/status (Linux).

The expert arena is one memfd. Pages of it that back a resident expert are mapped in the
process and show in RssShmem; pages of a slot's copy of a boundary page that the region maps
from a neighbour are charged but not mapped. :func:`sample` therefore takes the arena's
allocated bytes (``arena_resident``, from the memfd's st_blocks) as a floor for the shmem part.
"""
from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass
class MemSample:
    """One reading, bytes. ``arena_resident``: allocated bytes of the arena memfd (0 without one)."""

    rss_anon: int
    rss_shmem: int
    rss_file: int
    arena_resident: int = 0

    @property
    def shmem(self) -> int:
        """Shared memory charged to the process: RssShmem, at least the arena's allocated bytes."""
        return max(self.rss_shmem, self.arena_resident)

    @property
    def total(self) -> int:
        """RssAnon + shmem + RssFile: what the RAM budget bounds, bytes."""
        return self.rss_anon + self.shmem + self.rss_file


def sample(pid: int | str = "self", arena_resident: int = 0, fill_mapped: int = 0) -> MemSample:
    """Read RssAnon, RssShmem and RssFile of a process from /proc/<pid>/status (bytes).

    ``fill_mapped``: bytes of the pager's fill mapping (``Pager.fill_bytes``), a second, fully populated
    mapping of the arena's pages, which RssShmem counts again; they are taken out of ``rss_shmem`` (the
    arena itself is ``arena_resident``; docs/DESIGN.md §5)."""
    vals = {"RssAnon": 0, "RssShmem": 0, "RssFile": 0}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key = line.split(":", 1)[0]
            if key in vals:
                vals[key] = int(line.split()[1]) * 1024
    shmem = max(0, vals["RssShmem"] - int(fill_mapped))
    return MemSample(vals["RssAnon"], shmem, vals["RssFile"], int(arena_resident))


def read_bytes(pid: int | str = "self") -> int | None:
    """Bytes this process caused to be fetched from storage (/proc/<pid>/io ``read_bytes``:
    page-cache misses, readahead and O_DIRECT reads; not cache hits). None if unavailable."""
    try:
        with open(f"/proc/{pid}/io") as f:
            for line in f:
                if line.startswith("read_bytes:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


class PeakTracker:
    """Keeps the peak of each field, and of the total, over calls to :meth:`update`.

    Args:
        arena_resident: callable returning the arena's allocated bytes (default: none).
        fill_mapped: callable returning the bytes of the pager's fill mapping (:func:`sample`).
    """

    def __init__(self, arena_resident=None, fill_mapped=None):
        self._arena = arena_resident
        self._fill = fill_mapped
        self.peak = MemSample(0, 0, 0, 0)
        self.peak_total = 0

    def update(self) -> MemSample:
        s = sample(arena_resident=self._arena() if self._arena else 0, fill_mapped=self._fill() if self._fill else 0)
        p = self.peak
        self.peak = MemSample(max(p.rss_anon, s.rss_anon), max(p.rss_shmem, s.rss_shmem),
                              max(p.rss_file, s.rss_file), max(p.arena_resident, s.arena_resident))
        self.peak_total = max(self.peak_total, s.total)
        return s


def cpu_threads() -> int:
    """CPUs this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def page_cache_bytes(path, start: int = 0, end: int | None = None) -> int:
    """Bytes of ``path``'s pages in [start, end) that are in the page cache now (mincore(2) on a
    fresh private mapping; mapping does not read the file). Offsets in bytes; ``end`` defaults to
    the file size."""
    import ctypes
    import mmap

    size = os.path.getsize(path)
    end = size if end is None else min(end, size)
    page = mmap.PAGESIZE
    a = start // page * page
    if end <= a:
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    length = end - a
    with open(path, "rb") as f:
        addr = libc.mmap(None, length, mmap.PROT_READ, mmap.MAP_SHARED, f.fileno(), a)
        if addr in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), f"mmap of {path} failed")
        try:
            n = (length + page - 1) // page
            vec = (ctypes.c_ubyte * n)()
            if libc.mincore(ctypes.c_void_p(addr), length, vec) != 0:
                raise OSError(ctypes.get_errno(), "mincore failed")
            return sum(v & 1 for v in vec) * page
        finally:
            libc.munmap(ctypes.c_void_p(addr), length)


def drop_page_cache(path) -> None:
    """Drop ``path``'s pages from the page cache: write back dirty pages (fdatasync), then
    posix_fadvise DONTNEED over the whole file. Pages some process has mapped stay."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
