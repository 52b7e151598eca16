"""Whether the model's files still hold the bytes a Session reads (docs/DESIGN.md §4, "model file changes").

A Session reads its model through descriptors opened at load: llama.cpp's mapping (the dense weights, with
``dense_weights="mmap"``) and the pager's O_DIRECT descriptors (the experts). They name *inodes*, so what can
make a Session mix old and new bytes is a write into those inodes; a new file renamed over the path leaves
them as they were. :class:`FileWatch` holds its own descriptor of each file, opened before the load, and
:meth:`FileWatch.check` (run before every decode) decides:

- **the inode the Session reads**: its size and mtime must be those seen at open (``fstat`` of the held
  descriptor). An in-place write sets the mtime (POSIX ``write``), so a rewrite is refused; ``chmod``,
  ``chown``, a hard link or a rename change only the ctime, which is not looked at. A write that puts the
  old size and mtime back (``touch -r``) is not detected: the same rule as rsync's default "quick check"
  (size + mtime) and make's. Telling a ``touch`` from an in-place rewrite would need a digest of the whole
  file taken at load, and the load reads only the header and the dense weights (§3b), so a changed mtime
  on the Session's own inode is refused.
- **the path**: it must still name a file. If it names another inode (a copy renamed over it: ``cp`` +
  ``mv``, rsync, a download tool), that file is compared byte for byte with the held one, once per (inode,
  size, mtime): equal bytes are accepted (the Session still reads its own inode, whose bytes the new
  file has), anything else is refused. A different model differs in its first block (the GGUF header), so
  a refusal is quick; proving equality reads both files once (4 MiB blocks, dropped from the page cache
  after each), which is the price of accepting a replaced file at all.

Once a change is found the watch stays *changed*: every later check raises the same
:class:`~epqlab.errors.ModelChangedError` (reopen the Session), so a server can answer each request with it.
"""
from __future__ import annotations

import os
import threading
from collections.abc import Sequence

from ..errors import ModelChangedError

FIX = "Restart with the new file (close this Session and open a new one)."  # a server words its own (e.change)

BLOCK = 4 << 20
"""Bytes compared per read when a replaced file is checked against the held one."""


def _same_bytes(a: int, b: int, size: int) -> bool:
    """Whether descriptors ``a`` and ``b`` hold equal bytes over ``[0, size)``; stops at the first unequal block
    and drops what it read from the page cache (``POSIX_FADV_DONTNEED``)."""
    off = 0
    while off < size:
        n = min(BLOCK, size - off)
        x, y = os.pread(a, n, off), os.pread(b, n, off)
        for fd in (a, b):
            os.posix_fadvise(fd, off, n, os.POSIX_FADV_DONTNEED)
        if x != y or len(x) != n:
            return False
        off += n
    return True


class FileWatch:
    """Held descriptors of a model's files (every shard) and the check of their identity (module docstring).

    Args:
        paths: the model's files. Each is opened read-only now (before the load, so the held inode is the one
            llama.cpp and the pager open next).

    Raises:
        OSError: a file cannot be opened.
    """

    def __init__(self, paths: Sequence):
        self.paths = [os.fspath(p) for p in paths]
        self._files = [open(p, "rb", buffering=0) for p in self.paths]  # closed by close() or the GC
        self._opened = [self._meta(os.fstat(f.fileno())) for f in self._files]
        self._accepted: set[tuple] = set()  # (dev, ino, size, mtime_ns) of replacement files proven equal
        self._lock = threading.Lock()
        self.changed: str | None = None
        self.content_checks = 0  # replaced files compared byte for byte (each costs a read of both files)

    @staticmethod
    def _meta(st) -> tuple:
        return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns

    def close(self) -> None:
        for f in self._files:
            f.close()

    def check(self) -> None:
        """Raise ModelChangedError if a file no longer holds the bytes the Session reads (module docstring);
        thread-safe. Costs two ``stat`` calls per file, plus one byte-for-byte comparison per replaced file."""
        with self._lock:
            if self.changed is None and not self._files[0].closed:  # closed: the Session refuses on its own
                self.changed = self._find_change()
            if self.changed is not None:
                e = ModelChangedError(f"{self.changed} {FIX}")
                e.change = self.changed
                raise e

    def _find_change(self) -> str | None:
        for p, f, was in zip(self.paths, self._files, self._opened):
            held = self._meta(os.fstat(f.fileno()))
            if held != was:
                return (f"the model file {p} changed on disk since it was opened (written in place: size {was[2]} -> "
                        f"{held[2]} bytes, mtime {was[3]} -> {held[3]} ns): its dense weights and experts would mix old "
                        f"and new bytes.")
            try:
                now = self._meta(os.stat(p))
            except OSError as e:
                return f"the model file {p} changed on disk: it is gone ({e.strerror})."
            if now[:2] == was[:2] or now in self._accepted:
                continue
            self.content_checks += 1
            try:
                with open(p, "rb", buffering=0) as g:
                    same = now[2] == was[2] and self._meta(os.fstat(g.fileno())) == now \
                        and _same_bytes(f.fileno(), g.fileno(), was[2])
            except OSError as e:
                return f"the model file {p} changed on disk: replaced by a file that cannot be read ({e.strerror})."
            if not same:
                return f"the model file {p} changed on disk: replaced by a file with other bytes."
            self._accepted.add(now)
        return None


__all__ = ["FileWatch", "BLOCK"]
