"""A re-entrant lock that hands itself to waiters in arrival order.

The Session's decode lock is taken once per batched decode step by the batcher thread, which releases
it and takes it again straight away. CPython's ``threading.RLock`` makes no promise of order: the thread
that just released it usually wins it back before a waiter is scheduled, so a reader that needs the
lock *between* two steps (the server's stats endpoint, a second caller's generation) can wait for the
whole run. :class:`FairRLock` queues acquirers: a release with a queue hands the lock to the oldest
waiter, and an acquirer that finds a queue joins its end, so a waiter gets the lock after at most the
step that was running when it arrived (docs/DESIGN.md §3d, the lock between steps).
"""
from __future__ import annotations

import threading
import time
from collections import deque


class FairRLock:
    """FIFO, re-entrant lock with the ``threading.RLock`` interface used here (``acquire``,
    ``release``, the context manager). The owner may re-acquire without queueing; ``release`` by a
    thread that does not own it raises RuntimeError, as RLock does."""

    def __init__(self):
        self._cv = threading.Condition(threading.Lock())
        self._owner: int | None = None
        self._count = 0
        self._queue: deque[int] = deque()  # waiting thread idents, oldest first

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        me = threading.get_ident()
        with self._cv:
            if self._owner == me:
                self._count += 1
                return True
            if self._owner is None and not self._queue:
                self._owner, self._count = me, 1
                return True
            if not blocking:
                return False
            deadline = None if timeout is None or timeout < 0 else time.monotonic() + timeout
            self._queue.append(me)
            try:
                while self._owner is not None or self._queue[0] != me:
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        return False
                    self._cv.wait(left)
                self._queue.popleft()
                self._owner, self._count = me, 1
                return True
            finally:
                if self._owner != me:  # timed out (or interrupted): leave the queue, wake the next
                    self._queue.remove(me)
                    self._cv.notify_all()

    def release(self) -> None:
        with self._cv:
            if self._owner != threading.get_ident():
                raise RuntimeError("cannot release un-acquired lock")
            self._count -= 1
            if self._count == 0:
                self._owner = None
                self._cv.notify_all()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()

    def locked(self) -> bool:
        return self._owner is not None
