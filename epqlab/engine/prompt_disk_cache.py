"""The server's prompt cache on disk (``epqlab serve --prompt-cache-dir DIR [--prompt-cache-size 4GiB]``): a finished
sequence's state is saved, and after a restart a request that extends a saved sequence's tokens starts from it.

- **What is saved:** when a request ends and the in-memory prompt cache keeps its sequence (:class:`Batcher`), the
  sequence's state (``llama_state_seq_get_data``) is copied under the decoder's lock and written by one background
  thread as one file (:mod:`epqlab.engine.state_file`: atomic, checksummed), named by the SHA-256 of the identity and
  the tokens, under ``DIR/<identity[:16]>/`` (one subdirectory per model and settings: another model's files are
  never touched).
- **Reuse:** the same rule as the in-memory cache (:func:`epqlab.engine.batch.reusable_prefix` with the server's
  ``--prompt-cache`` mode): under ``exact`` only whole ubatches of the saved prompt, so the answer equals a fresh
  run's bit for bit; hybrid/recurrent memory only an exact whole sequence (:meth:`Decoder.trim_seq`). A disk entry
  is used only when it reuses more than every cached sequence in memory.
- **Eviction:** least recently used (file mtime, touched on a hit) by total size, down to ``max_bytes``.
- **Failures never fail a request:** a truncated, corrupt or foreign file is refused, removed and logged; a write
  that fails (a full disk) is logged and dropped; a state llama.cpp refuses is removed and the prompt is evaluated
  from its start.
"""
from __future__ import annotations

import hashlib
import logging
import os
import queue
import tempfile
import threading
from pathlib import Path

from . import state_file
from .state_file import Entry, StateFileError

log = logging.getLogger("epqlab.prompt_cache")
SUFFIX = ".epqs"
QUEUE = 4  # states waiting to be written; more are dropped (logged): the cache never holds up the batcher


def check_dir(directory) -> None:
    """Raises ValueError naming ``directory`` when it cannot be created or written (before a model loads)."""
    d = Path(directory)
    try:
        d.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".write-test-", dir=d)
        os.close(fd)
        os.unlink(tmp)
    except OSError as e:
        raise ValueError(f"--prompt-cache-dir {directory}: cannot write there ({e.strerror}); give a writable "
                         "directory") from None


class PromptDiskCache:
    """Saved sequence states under ``directory`` (module docstring). ``max_bytes``: the most the files may take;
    ``ident``: :func:`epqlab.engine.state_file.identity` of the serving Session.

    Raises:
        ValueError: ``max_bytes`` < 1, or ``directory`` cannot be created or written (the message names it).
    """

    def __init__(self, directory, max_bytes: int, ident: str):
        if max_bytes < 1:
            raise ValueError(f"--prompt-cache-size must be >= 1 byte, got {max_bytes}")
        self.dir = Path(directory) / ident[:16]
        check_dir(self.dir)
        self.max_bytes, self.ident = int(max_bytes), ident
        self.entries: dict[Path, Entry] = {}
        self.hits = self.saved = self.refused = self.write_errors = 0
        self.hit_tokens = 0
        self._lock = threading.Lock()
        self._q: queue.Queue = queue.Queue(QUEUE)
        for p in sorted(self.dir.glob("*" + SUFFIX)):
            self._admit(p)
        for p in self.dir.glob(".tmp-*"):  # a write cut short by a crash
            p.unlink(missing_ok=True)
        self._writer = threading.Thread(target=self._write_loop, name="epqlab-prompt-cache", daemon=True)
        self._writer.start()

    # -- reading -----------------------------------------------------------------------------------
    def _admit(self, p: Path) -> None:
        try:
            e = state_file.read_header(p, self.ident)
        except (StateFileError, OSError) as ex:
            self._drop(p, ex)
            return
        self.entries[p] = e

    def _drop(self, p: Path, why) -> None:
        log.warning("prompt cache: refused and removed %s: %s", p.name, why)
        self.refused += 1
        self.entries.pop(p, None)
        try:
            p.unlink()
        except OSError:
            pass

    def best(self, tokens, rule) -> tuple[Entry | None, int]:
        """The entry whose tokens give the most reuse for a prompt of ``tokens`` under ``rule(held, ends, tokens)``
        (the batcher's :func:`reusable_prefix`), and that reuse; ``(None, 0)`` when none gives any."""
        best, keep = None, 0
        with self._lock:
            entries = list(self.entries.values())
        for e in entries:
            n = rule(list(e.tokens), list(e.ubatch_ends), tokens)
            if n > keep:
                best, keep = e, n
        return best, keep

    def load(self, e: Entry) -> bytes | None:
        """``e``'s state bytes, or None when the file is gone or fails its checks (it is then removed and logged)."""
        try:
            b = state_file.read_state(e)
        except (StateFileError, OSError) as ex:
            with self._lock:
                self._drop(e.path, ex)
            return None
        try:
            os.utime(e.path)  # recently used: evicted last
        except OSError:
            pass
        return b

    def refuse(self, e: Entry, why: str) -> None:
        """llama.cpp refused ``e``'s state: remove it."""
        with self._lock:
            self._drop(e.path, why)

    # -- writing -----------------------------------------------------------------------------------
    def key(self, tokens) -> Path:
        h = hashlib.sha256(self.ident.encode() + b"|" + ",".join(map(str, tokens)).encode()).hexdigest()
        return self.dir / (h[:40] + SUFFIX)

    def has(self, tokens) -> bool:
        return self.key(tokens) in self.entries

    def save(self, tokens, ubatch_ends, state: bytes) -> None:
        """Queue one state for the writer thread (dropped, and logged, when it is behind)."""
        try:
            self._q.put_nowait((list(tokens), list(ubatch_ends), state))
        except queue.Full:
            log.info("prompt cache: writer behind, a state of %d tokens not saved", len(tokens))

    def flush(self, timeout: float = 30.0) -> None:
        """Wait until every queued state is written (tests, and the server's shutdown)."""
        done = threading.Event()
        self._q.put(done, timeout=timeout)
        done.wait(timeout)

    def _write_loop(self) -> None:
        while True:
            item = self._q.get()
            if isinstance(item, threading.Event):
                item.set()
                continue
            tokens, ends, state = item
            p = self.key(tokens)
            try:
                state_file.write(p, self.ident, tokens, ends, state)
                e = state_file.read_header(p, self.ident)
            except (OSError, StateFileError) as ex:  # a full disk: the request already has its answer
                self.write_errors += 1
                log.warning("prompt cache: could not save a state of %d tokens: %s", len(tokens), ex)
                continue
            with self._lock:
                self.entries[p] = e
                self.saved += 1
                self._evict()

    def _evict(self) -> None:
        """Least recently used first (mtime), until the files fit ``max_bytes``."""
        def mtime(p):
            try:
                return p.stat().st_mtime_ns
            except OSError:
                return 0
        total = self.disk_bytes()
        for p in sorted(self.entries, key=mtime):
            if total <= self.max_bytes:
                break
            total -= self.entries[p].offset + self.entries[p].state_bytes
            self.entries.pop(p)
            p.unlink(missing_ok=True)

    def disk_bytes(self) -> int:
        """Bytes the cache's files take."""
        return sum(e.offset + e.state_bytes for e in list(self.entries.values()))
