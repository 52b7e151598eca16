"""The Session's decode lock is FIFO: a thread that releases it and takes it straight back (the batcher,
one step at a time) cannot keep a waiter out for more than the step running when it arrived."""
from __future__ import annotations

import threading
import time

import pytest

from epqlab.engine.fair_lock import FairRLock


def _hog_and_wait(lock, steps=40, step_s=0.005):
    """A hog takes the lock ``steps`` times back to back (sleeping inside, with the GIL released, as a
    llama_decode does); a waiter asks for it after the hog's 5th step. Returns how many hog steps began
    between the waiter's ask and its grant."""
    started = []
    asked = threading.Event()
    got = []

    def hog():
        for i in range(steps):
            with lock:
                started.append(i)
                if i == 5:
                    asked.set()
                time.sleep(step_s)

    def waiter():
        asked.wait()
        time.sleep(step_s / 2)  # ask while the hog is inside step 5
        n0 = len(started)
        with lock:
            got.append(len(started) - n0)

    threads = [threading.Thread(target=hog), threading.Thread(target=waiter)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return got[0]


def test_waiter_gets_the_next_turn():
    # FIFO by hand: the waiter arrives inside step 5, so step 5's release hands it the lock: 0 new steps
    assert _hog_and_wait(FairRLock()) == 0


def test_reentrant_and_release_checks():
    lock = FairRLock()
    with lock:
        with lock:
            assert lock.locked()
        assert lock.locked()
    assert not lock.locked()
    with pytest.raises(RuntimeError):
        lock.release()
    # a timed-out waiter leaves the queue: the next acquirer is not stuck behind it
    out = []
    with lock:
        t = threading.Thread(target=lambda: out.append(lock.acquire(timeout=0.05)))
        t.start()
        t.join(5)
    assert out == [False]
    assert lock.acquire(blocking=False)
    lock.release()
