"""``epqlab serve`` on the default model in a subprocess, driven with the ``openai`` client: a chat
completion at temperature 0 equals :meth:`Session.create_chat_completion` computed here, streaming yields
the same text, bad requests get 4xx and the server keeps serving (also after a client drops a stream),
and a chat's next turn gets the uncached answer. Plus the completion API's shapes."""
from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time

import pytest

import epqlab

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("sse_starlette")

MSGS = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is a CPU cache?"}]
N = 12


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def served(model, *args):
    """``epqlab serve MODEL`` on a free loopback port with one thread and ``args``, in a subprocess; yields
    ``(url, process)`` and stops it afterwards (the server modules' fixtures share this)."""
    port = _free_port()
    cmd = [sys.executable, "-m", "epqlab", "serve", str(model), "--port", str(port), "--threads", "1",
           "--log-level", "warning", *map(str, args)]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        yield f"http://127.0.0.1:{port}", p
    finally:
        p.terminate()
        try:
            p.wait(20)
        except subprocess.TimeoutExpired:
            p.kill()


@pytest.fixture(scope="module")
def server(default_model_path):
    with served(default_model_path, "--n-ctx", 512) as up:
        yield up


def _wait_ready(url: str, p: subprocess.Popen, timeout: float = 180) -> None:
    deadline = time.time() + timeout
    while True:
        if p.poll() is not None:
            pytest.fail(f"epqlab serve exited with {p.returncode}: {p.stdout.read()[-3000:]}")
        try:
            if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.time() > deadline:
            pytest.fail(f"epqlab serve did not answer within {timeout} s")
        time.sleep(0.3)


@pytest.fixture(scope="module")
def reference(default_model_path):
    """The same messages through Session.create_chat_completion in this process (plain llama.cpp: paging
    does not change logits, tests/test_session.py)."""
    with epqlab.Session(default_model_path, pager=False, n_threads=1, n_ctx=512) as s:
        r = s.create_chat_completion(MSGS, max_tokens=N, temperature=0)
        yield s, r


def test_server_matches_session_and_survives_bad_requests(server, reference):
    url, proc = server  # started before the reference session loads; both load at once
    s, ref = reference
    _wait_ready(url, proc)
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
    assert [m.id for m in client.models.list().data] == [os.path.basename(s.layout.path)]
    want = ref["choices"][0]["message"]["content"]
    assert ref["usage"]["completion_tokens"] == N and want
    r = client.chat.completions.create(model="x", messages=MSGS, max_tokens=N, temperature=0)
    assert r.choices[0].message.content == want
    assert r.choices[0].finish_reason == ref["choices"][0]["finish_reason"] == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (ref["usage"]["prompt_tokens"], N)
    assert r.model_extra["epqlab"]["n_gen"] == N  # epqlab's run stats ride along under their own key

    pieces = [c.choices[0].delta.content or "" for c in
              client.chat.completions.create(model="x", messages=MSGS, max_tokens=N, temperature=0, stream=True)]
    assert "".join(pieces) == want and len([p for p in pieces if p]) > 1

    # bad requests: 4xx with an OpenAI error body, and the server keeps serving
    with pytest.raises(openai.BadRequestError, match="unknown role"):
        client.chat.completions.create(model="x", messages=[{"role": "wizard", "content": "hi"}])
    with pytest.raises(openai.BadRequestError, match="top_p"):
        client.completions.create(model="x", prompt="hi", top_p=3.0, stream=True)
    with pytest.raises(openai.BadRequestError, match="context"):
        client.completions.create(model="x", prompt="word " * 600, max_tokens=4)
    with pytest.raises(openai.UnprocessableEntityError):
        client.chat.completions.create(model="x", messages="not a list")
    h = httpx.post(url + "/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert 400 <= h.status_code < 500

    # a client that drops a long stream after two events: the server stops that generation and serves on
    with httpx.stream("POST", url + "/v1/completions", timeout=60,
                      json={"prompt": "Once upon a time", "max_tokens": 400, "stream": True, "temperature": 0}) as resp:
        assert resp.status_code == 200
        events = []
        for ln in resp.iter_lines():
            if ln.startswith("data:"):
                events.append(ln)
                if len(events) == 2:
                    break  # leaving the with-block closes the connection mid-stream
        assert len(events) == 2
    r = client.chat.completions.create(model="x", messages=MSGS, max_tokens=N, temperature=0)
    assert r.choices[0].message.content == want
    assert proc.poll() is None

    # the next chat turn: --prompt-cache exact (the default) reuses whole 512-token ubatches of the previous
    # prompt's evaluation only, so this short chat is decoded again and its answer is the uncached one
    # (tests/test_serve_cache.py: reuse with --n-ubatch 16)
    turn2 = MSGS + [{"role": "assistant", "content": want}, {"role": "user", "content": "And a TLB?"}]
    j = httpx.post(url + "/v1/chat/completions", timeout=120,
                   json={"messages": turn2, "max_tokens": 4, "temperature": 0}).json()
    assert j["epqlab"]["n_prompt_reused"] == 0
    assert j["choices"][0]["message"]["content"] == s.create_chat_completion(turn2, max_tokens=4, temperature=0)[
        "choices"][0]["message"]["content"]
    full = httpx.get(url + "/v1/epqlab/stats").json()
    st, ts = full["stats"], full["time_split"]
    assert st["requests"] > 0 and 0 <= st["hit_rate"] <= 1
    # the parts of the time split add up to each call's wall time ("other" is the remainder)
    parts = ("attn_ms", "expert_ms", "io_ms", "map_ms", "predict_ms", "other_ms")
    assert ts["calls"] > 0 and sum(ts[p] for p in parts) == pytest.approx(ts["wall_ms"])


def test_completion_shapes(reference):
    s, _ = reference
    r = s.create_completion("The capital of France is", max_tokens=5, temperature=0)
    assert r["object"] == "text_completion" and r["id"].startswith("cmpl-")
    g = s.generate("The capital of France is", 5)
    assert r["choices"][0]["text"] == g.text and r["choices"][0]["finish_reason"] == "length"
    assert r["usage"] == {"prompt_tokens": len(g.prompt_tokens), "completion_tokens": 5,
                          "total_tokens": len(g.prompt_tokens) + 5}
    chunks = list(s("The capital of France is", max_tokens=5, temperature=0, stream=True))
    assert "".join(c["choices"][0]["text"] for c in chunks) == g.text
    assert [c["choices"][0]["finish_reason"] for c in chunks[-1:]] == ["length"] and "epqlab" in chunks[-1]
    # llama-cpp-python's tokenize forms
    assert s.tokenize(b"Hello world") == s.tokenize("Hello world")
    assert s.tokenize(b"<|im_start|>", special=True) != s.tokenize(b"<|im_start|>")
    assert s.tokenize(b"Hi", add_bos=False) == s.tokenize("Hi", False)
    with pytest.raises(TypeError):
        epqlab.Session(s.layout.path, 2**30)  # keyword-only after model, as llama_cpp.Llama
    with pytest.raises(ValueError, match="messages\\[0\\].content\\[0\\]: only text parts"):
        s.create_chat_completion([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])
    with pytest.raises(ValueError, match="repeat_penalty"):
        s.create_completion("x", repeat_penalty=0)
