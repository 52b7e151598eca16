"""A request flows one way (docs/DESIGN.md §1): the request surface (epqlab/requests/) calls the runtime
(epqlab/engine/), and the runtime never calls back up into it -- no method of the runtime's Session forwards
to the surface, no runtime loop resumes a surface generator. Traced with ``sys.setprofile`` / ``threading.setprofile``
(the batcher's thread too) on real requests: in-process, streamed, several choices, and on a background
batcher as the server runs them; tests/test_layers.py checks the same direction in the imports."""
from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest

import epqlab
from epqlab.engine.batch import Batcher
from epqlab.requests.completion import create_chat_completion, create_completion

PKG = Path(epqlab.__file__).resolve().parent
MSGS = [{"role": "user", "content": "Say hi."}]


def _room(filename: str) -> str | None:
    try:
        rel = Path(filename).resolve().relative_to(PKG)
    except ValueError:
        return None
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


class Upcalls:
    """Every call whose caller is in engine/ and whose callee is in requests/ (a generator resumed counts)."""

    def __init__(self):
        self.found: list[str] = []

    def __call__(self, frame, event, arg):
        if event != "call" or frame.f_back is None or _room(frame.f_code.co_filename) != "requests":
            return
        if _room(frame.f_back.f_code.co_filename) == "engine":
            self.found.append(f"{frame.f_back.f_code.co_name} -> {frame.f_code.co_name}")

    def __enter__(self):
        threading.setprofile(self)
        sys.setprofile(self)
        return self

    def __exit__(self, *exc):
        sys.setprofile(None)
        threading.setprofile(None)


@pytest.fixture(scope="module")
def sess(default_model_path):
    with epqlab.Session(default_model_path, pager=False, n_seq_max=2, n_ctx=256, n_threads=1) as s:
        yield s


def test_the_checker_sees_an_upcall():
    """The profiler itself: a runtime frame calling a surface function is caught."""
    import epqlab.engine.tokens as tokens_mod
    from epqlab.requests import completion_run

    code = compile("def call_up(f, *a):\n    return f(*a)\n", tokens_mod.__file__, "exec")
    ns: dict = {}
    exec(code, ns)  # a function whose code object lives in engine/tokens.py
    with Upcalls() as up:
        ns["call_up"](completion_run._stop_list, "x")
    assert up.found == ["call_up -> _stop_list"]


@pytest.mark.parametrize("how", ["method", "stream", "n2", "chat"])
def test_in_process_requests_never_call_up(sess, how):
    with Upcalls() as up:
        if how == "method":
            out = sess.create_completion("Once upon a time", max_tokens=4, temperature=0)
        elif how == "stream":
            out = list(sess.create_completion("Once upon a time", max_tokens=4, temperature=0, stream=True))
        elif how == "n2":
            out = sess.create_completion("Once upon a time", max_tokens=4, temperature=0, n=2)
        else:
            out = sess.create_chat_completion(MSGS, max_tokens=4, temperature=0)
    assert out and up.found == []


@pytest.mark.parametrize("stream", [False, True])
def test_server_requests_never_call_up(sess, stream):
    """As epqlab serve runs a request: on a background Batcher (its thread started under the profiler)."""
    with Upcalls() as up:
        b = Batcher(sess, 2).start()
        try:
            out = create_chat_completion(sess, MSGS, max_tokens=4, temperature=0, batcher=b, strict_context=True,
                                         stream=stream)
            out = list(out) if stream else out
            out2 = create_completion(sess, ["a", "b"], max_tokens=3, temperature=0, batcher=b, strict_context=True)
        finally:
            b.close()
    assert out and out2["choices"] and up.found == []
