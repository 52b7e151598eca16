"""No scheduler error may leave a request without an answer or lose a sequence (docs/DESIGN.md §3d).

A background :class:`Batcher` with the prompt cache on (as ``epqlab serve`` runs it) is given a failure at each
step of its work -- picking and trimming a cached sequence, freeing one, the sampler's prompt, the prefill, the
first sample, a decode step, a token's text, the end of a request -- once, while more requests than sequences
are in flight. Every request must end (a Generation or an error, never a hang), every sequence must come back
to the free list, and afterwards a fresh request must still get exactly the answer it gets from a fresh
Session (so no sequence decodes on cells it lost when a failed pass cleared llama.cpp's memory).
"""
from __future__ import annotations

import threading

import numpy as np
import pytest

import epqlab
from epqlab.engine.batch import Batcher, Request
from epqlab.engine.sampling import Sampler

N_SEQ = 2
N_GEN = 6
BASE = "A CPU cache is a small, fast memory that sits between the processor and main memory."
# each later prompt shares BASE with the others, so the prompt cache reuses (and trims) cached sequences
PROMPTS = [BASE + t for t in (" It keeps", " Its lines", " A miss", " The L1", " Caches are", " Eviction")]
FRESH = "def fibonacci(n):"


class Boom(RuntimeError):
    pass


@pytest.fixture(scope="module")
def session(default_model_path):
    with epqlab.Session(default_model_path, n_seq_max=N_SEQ, n_ctx=256, n_threads=1) as s:
        yield s


@pytest.fixture(scope="module")
def fresh_ref(default_model_path):
    with epqlab.Session(default_model_path, n_seq_max=N_SEQ, n_ctx=256, n_threads=1) as s:
        (lg, out), = s.batch_trace([FRESH], N_GEN)
    return lg, out


def _request(s, text, i):
    return Request(s.tokenize(text), N_GEN, Sampler(s.n_vocab, temperature=0.0), index=i, keep_logits=True)


class Once:
    """Replace ``obj.name`` (an instance's or a class's method) by a function that raises :class:`Boom` on its
    ``at``-th call (1-based) and otherwise calls the original; counts calls."""

    def __init__(self, obj, name, at=1):
        self.obj, self.name, self.at, self.calls, self.fired = obj, name, at, 0, False

    def __enter__(self):
        self.had = self.name in vars(self.obj)
        self.saved = vars(self.obj).get(self.name)
        orig = getattr(self.obj, self.name)  # bound for an instance, the plain function for a class

        def injected(*a, **k):
            self.calls += 1
            if self.calls == self.at:
                self.fired = True
                raise Boom(f"injected failure in {self.name}")
            return orig(*a, **k)

        setattr(self.obj, self.name, injected)  # a function on a class binds like the method it replaces
        return self

    def __exit__(self, *exc):
        if self.had:
            setattr(self.obj, self.name, self.saved)
        else:
            delattr(self.obj, self.name)


def _points(s, b):
    """(label, object, attribute, call number) of each injection point."""
    d = s.decoder
    return [
        ("pick", b, "_pick_sequence", 3),
        ("trim", d, "trim_seq", 1),
        ("free", d, "free_seq", 1),
        ("accept_prompt", Sampler, "accept", 2),
        ("prefill", d, "decode_seq", 3),
        ("first_sample", b, "_sample", 1),
        ("step", d, "decode_step", 2),
        ("piece", d, "piece", 4),
        ("stats", b, "_seq_stats", 1),
        ("sampler_free", Sampler, "free", 1),
    ]


@pytest.mark.parametrize("point", ["pick", "trim", "free", "accept_prompt", "prefill", "first_sample", "step",
                                   "piece", "stats", "sampler_free"])
def test_every_request_ends_and_every_sequence_returns(session, fresh_ref, point):
    s = session
    # without the prompt cache a finished sequence is freed at once (free_seq); with it, cached and trimmed
    b = Batcher(s, prompt_cache=point != "free").start()
    try:
        # a finished sequence in the cache first, so the injected requests pick and trim it
        warm = b.submit(_request(s, PROMPTS[0], 0))
        warm.wait(120)
        label, obj, name, at = next(p for p in _points(s, b) if p[0] == point)
        with Once(obj, name, at) as inj:
            reqs = [b.submit(_request(s, t, i)) for i, t in enumerate(PROMPTS[1:], 1)]  # 2.5 x N_SEQ
            for r in reqs:
                assert r.done.wait(120), f"{point}: request {r.index} never ended"
        assert inj.fired, f"{point}: the injection point was never reached"
        errors = [r for r in reqs if r.error is not None]
        # a failed free is absorbed (the sequence is cleared at its next pick); every other failure ends a request
        assert bool(errors) == (point != "free"), (point, [r.error for r in errors])
        for r in reqs:  # an answer either way: a result or the error that ended it
            assert r.result is not None or r.error is not None
        # every sequence is back (free, not active) once the batcher is idle
        for _ in range(200):
            with s.decoder.lock:
                if not b._active and not b._waiting and sorted(b._free) == list(range(N_SEQ)):
                    break
            threading.Event().wait(0.05)
        assert not b._active and sorted(b._free) == list(range(N_SEQ)), (point, b._active, b._free)
        # and the batcher still answers: a request alone exactly as a fresh Session does (a batch of one; it
        # shares no cached prefix), then more requests than sequences, every one to its end without error
        r = b.submit(_request(s, FRESH, 9))
        g = r.wait(120)
        assert g.tokens == fresh_ref[1], point
        assert np.array_equal(np.stack(r.logits), fresh_ref[0]), point
        for r in [b.submit(_request(s, t, i)) for i, t in enumerate(PROMPTS[:N_SEQ + 1])]:
            assert r.wait(120).tokens, point
    finally:
        b.close()


def test_lost_cells_end_running_requests_not_silently(session):
    """A failed prefill clears llama.cpp's memory under every sequence (engine.cpp): a request decoding beside it
    ends with an error naming the cause instead of decoding on cells it no longer has."""
    s = session
    b = Batcher(s)
    running = _request(s, PROMPTS[0], 0)
    running.n_predict = 40
    b.submit(running)
    with s.decoder.lock:
        b.step()  # running is prefilled and active
        assert running.seq is not None and not running.done.is_set()
        d = s.decoder
        orig = d.decode_seq

        def failing(seq, tokens, pos0, epoch, *a, **k):
            d.engine.clear()  # what engine::run does when llama_decode or the hook fails
            raise Boom("injected prefill failure")

        d.decode_seq = failing
        try:
            late = b.submit(_request(s, PROMPTS[1], 1))
            b.step()
        finally:
            del d.decode_seq
        assert late.done.is_set() and isinstance(late.error, Boom)
        assert running.done.is_set() and "lost its KV cells" in str(running.error)
        while b.step():
            pass
    assert sorted(b._free) == list(range(N_SEQ)) and not b._active
    assert d.decode_seq == orig
