"""The server's interop and start-up checks (epqlab/server/, epqlab/commands/serve.py) on the mini model: the
``Bearer`` scheme in any case (RFC 7235), text-only content parts joined, unknown request fields refused with 400
naming them, bad ports and hosts and a tiny ``--n-ctx`` refused before the model loads, and Ctrl-C ending each open
stream with an error event and ``[DONE]`` (chat/completions), or its API's own error event (messages, responses)."""
from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

import epqlab

pytest.importorskip("fastapi")
pytest.importorskip("sse_starlette")
httpx = pytest.importorskip("httpx")
KEY = "sk-x-9"


@pytest.fixture(scope="module")
def client(mini_gguf):
    from fastapi.testclient import TestClient

    from epqlab.server import create_app

    with epqlab.Session(mini_gguf, n_threads=1, n_ctx=256) as s, TestClient(create_app(s, api_key=KEY)) as c:
        yield s, c


def test_bearer_scheme_in_any_case(client):
    _, c = client
    for scheme in ("Bearer", "bearer", "BEARER", "bEaReR"):
        assert c.get("/v1/models", headers={"Authorization": f"{scheme} {KEY}"}).status_code == 200, scheme
    for bad in (f"Basic {KEY}", f"Bearer{KEY}", "Bearer wrong", KEY):
        assert c.get("/v1/models", headers={"Authorization": bad}).status_code == 401, bad


def test_text_content_parts_are_joined(client):
    s, c = client
    h = {"Authorization": f"Bearer {KEY}"}
    parts = [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]
    body = {"max_tokens": 3, "temperature": 0}
    r = c.post("/v1/chat/completions", headers=h, json={**body, "messages": [{"role": "user", "content": parts}]})
    want = c.post("/v1/chat/completions", headers=h,
                  json={**body, "messages": [{"role": "user", "content": "Hi\nthere"}]})  # llama.cpp's join
    assert r.status_code == 200 and r.json()["usage"] == want.json()["usage"]
    assert r.json()["choices"][0]["message"] == want.json()["choices"][0]["message"]
    img = [{"type": "image_url", "image_url": {"url": "data:,"}}]
    r = c.post("/v1/chat/completions", headers=h, json={**body, "messages": [{"role": "user", "content": img}]})
    assert r.status_code == 400 and "content[0]: only text parts" in r.json()["error"]["message"]


def test_unknown_fields_are_refused_naming_them(client):
    _, c = client
    h = {"Authorization": f"Bearer {KEY}"}
    r = c.post("/v1/completions", headers=h, json={"prompt": "Hi", "max_token": 3, "temprature": 0})
    assert r.status_code == 400
    msg = r.json()["error"]["message"]
    assert msg.startswith("unknown fields 'max_token', 'temprature':") and "max_tokens" in msg
    r = c.post("/tokenize", headers=h, json={"input": "Hi", "inptu": 1})
    assert r.status_code == 400 and "unknown field 'inptu'" in r.json()["error"]["message"]
    # OpenAI fields that ask for nothing this server could do differently are accepted (README)
    r = c.post("/v1/completions", headers=h, json={"prompt": "Hi", "max_tokens": 2, "user": "u1", "store": False})
    assert r.status_code == 200


def test_max_tokens_and_temperature_follow_openai(client):
    """OpenAI's ranges: ``max_tokens`` / ``max_completion_tokens`` >= 1 (0 once ran until the context was full)
    or null (until the context is full), ``temperature`` in 0..2 (-1 was accepted); 400 naming the field."""
    _, c = client
    h = {"Authorization": f"Bearer {KEY}"}
    chat = {"messages": [{"role": "user", "content": "Hi"}]}
    for path, body in [("/v1/completions", {"prompt": "Hi", "max_tokens": 0}),
                       ("/v1/completions", {"prompt": "Hi", "max_tokens": -5}),
                       ("/v1/chat/completions", {**chat, "max_tokens": 0}),
                       ("/v1/chat/completions", {**chat, "max_completion_tokens": 0}),
                       ("/v1/completions", {"prompt": "Hi", "max_tokens": 2, "temperature": -1}),
                       ("/v1/chat/completions", {**chat, "max_tokens": 2, "temperature": 2.5}),
                       ("/v1/chat/completions", {**chat, "max_tokens": 2, "temperature": -0.5, "stream": True})]:
        t0 = time.monotonic()
        r = c.post(path, headers=h, json=body)
        assert r.status_code == 400 and time.monotonic() - t0 < 30, (path, body, r.text)
        field = next(k for k in ("max_completion_tokens", "max_tokens", "temperature") if k in body and (
            k != "max_tokens" or body[k] < 1))
        assert field in r.json()["error"]["message"], r.json()
    for body in [{"prompt": "Hi", "max_tokens": 2, "temperature": 0}, {"prompt": "Hi", "max_tokens": 2, "temperature": 2}]:
        assert c.post("/v1/completions", headers=h, json=body).status_code == 200, body


def test_openai_fields_clients_send_are_accepted(client):
    """Fields of OpenAI's current chat schema that clients send by default (LangChain's ChatOpenAI sends
    ``parallel_tool_calls``; reasoning models' clients ``reasoning_effort``): accepted, each by its documented rule
    (epqlab.server.fields); a name OpenAI does not have is still refused, and so is an output this server lacks."""
    _, c = client
    h = {"Authorization": f"Bearer {KEY}"}
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 0}
    extra = {"parallel_tool_calls": False, "reasoning_effort": "low", "verbosity": "low", "safety_identifier": "u",
             "prompt_cache_key": "k", "prompt_cache_retention": "24h", "web_search_options": None}
    r = c.post("/v1/chat/completions", headers=h, json={**chat, **extra})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"] == c.post("/v1/chat/completions", headers=h, json=chat).json()[
        "choices"][0]["message"]
    r = c.post("/v1/chat/completions", headers=h, json={**chat, "reasoning_efort": "low"})
    assert r.status_code == 400 and "unknown field 'reasoning_efort'" in r.json()["error"]["message"]
    r = c.post("/v1/chat/completions", headers=h, json={**chat, "web_search_options": {}})
    assert r.status_code == 400 and "web search is not offered" in r.json()["error"]["message"]
    r = c.post("/v1/chat/completions", headers=h, json={**chat, "parallel_tool_calls": "no"})
    assert r.status_code == 400 and "parallel_tool_calls" in r.json()["error"]["message"]


def test_context_errors_speak_server_flags(client):
    """An HTTP client cannot open a Session: a prompt or max_tokens that does not fit names --n-ctx."""
    s, c = client
    h = {"Authorization": f"Bearer {KEY}"}
    long = {"prompt": list(range(1, s.n_ctx + 10)), "max_tokens": 2}
    big = {"prompt": "Hi", "max_tokens": s.n_ctx * 2}
    for body in (long, big, {**big, "stream": True}):
        r = c.post("/v1/completions", headers=h, json=body)
        msg = r.json()["error"]["message"]
        assert r.status_code == 400 and "--n-ctx" in msg and "Session" not in msg, msg
    with pytest.raises(ValueError, match="open the Session with a larger n_ctx"):  # in-process: the Session's words
        s.create_completion(list(range(1, s.n_ctx + 10)))


def _serve(model, *args, timeout=60):
    return subprocess.run([sys.executable, "-m", "epqlab", "serve", str(model), "--threads", "1", *args],
                          capture_output=True, text=True, timeout=timeout)


def test_bad_port_host_and_context_refused_before_loading(mini_gguf, tmp_path):
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    try:
        for args, msg in [(["--port", "-1"], "--port must be a TCP port in 1..65535, got -1"),
                          (["--port", "70000"], "--port must be a TCP port in 1..65535, got 70000"),
                          (["--port", str(busy.getsockname()[1])], "the port is in use by another process"),
                          (["--host", "no.such.host.invalid"], "--host 'no.such.host.invalid' is not an address"),
                          (["--host", "203.0.113.7"], "the address is not one of this machine's"),
                          (["--n-ctx", "10"], "--n-ctx 10 is below llama.cpp's smallest context of 256")]:
            t0 = time.perf_counter()
            r = _serve(mini_gguf, *args)
            assert r.returncode == (2 if args[0] == "--n-ctx" else 1) and msg in r.stderr, (args, r.stderr[-2000:])
            assert "Traceback" not in r.stderr and "serving" not in r.stderr  # refused before the model loaded
    finally:
        busy.close()


def test_ctrl_c_ends_open_streams_with_an_error_and_done(mini_gguf):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # one sequence: the long completion holds it, so a Messages and a Responses stream opened after it are in flight
    # (their first events sent, their requests queued) when SIGINT comes; the mini model would end their own answers
    # with an end-of-text token within a second (neither API has logit_bias)
    p = subprocess.Popen([sys.executable, "-m", "epqlab", "serve", str(mini_gguf), "--threads", "1", "--port",
                          str(port), "--n-ctx", "4096", "--max-batch", "1", "--log-level", "warning"],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 120
        while True:
            assert p.poll() is None, p.stdout.read()[-3000:]
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.time() < deadline, "server did not start"
            time.sleep(0.3)
        # a long answer: ignore_eos is not an OpenAI field, so every control token (end-of-text, end-of-turn, ...)
        # is biased away instead
        from gguf import GGUFReader

        tt = GGUFReader(mini_gguf).fields["tokenizer.ggml.token_type"]
        eos = [i for i, j in enumerate(tt.data) if int(tt.parts[j][0]) == 3]  # llama_token_type CONTROL
        assert eos
        body = {"prompt": "Once", "max_tokens": 3000, "temperature": 0, "stream": True,
                "logit_bias": {str(t): -100 for t in eos}}
        events = []
        others = {"/v1/messages": {"model": "x", "max_tokens": 100, "temperature": 0, "stream": True,
                                   "messages": [{"role": "user", "content": "Once"}]},
                  "/v1/responses": {"model": "x", "max_output_tokens": 100, "temperature": 0, "stream": True,
                                    "input": "Once"}}
        lines = {path: [] for path in others}
        opened = {path: threading.Event() for path in others}

        def read(path):
            with httpx.stream("POST", url + path, json=others[path], timeout=60) as h:
                assert h.status_code == 200
                for ln in h.iter_lines():
                    lines[path].append(ln)
                    if sum(x.startswith("event: ") for x in lines[path]) == 2:  # message_start, ping / created, in_progress
                        opened[path].set()

        threads = [threading.Thread(target=read, args=(path,), daemon=True) for path in others]
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line[6:])
                if len(events) == 3:
                    for t in threads:
                        t.start()
                    assert all(e.wait(30) for e in opened.values()), lines
                    p.send_signal(signal.SIGINT)
        for t in threads:
            t.join(30)
        # each new API's stream ends with its own error event, never with its normal last event
        names = {path: [x[7:] for x in ls if x.startswith("event: ")] for path, ls in lines.items()}
        assert names["/v1/messages"] == ["message_start", "ping", "error"], lines
        assert names["/v1/responses"] == ["response.created", "response.in_progress", "error"], lines
        err = json.loads([x for x in lines["/v1/messages"] if x.startswith("data: ")][-1][6:])
        assert err["type"] == "error" and err["error"]["type"] == "api_error" and "shutting down" in err["error"]["message"]
        err = json.loads([x for x in lines["/v1/responses"] if x.startswith("data: ")][-1][6:])
        assert err["type"] == "error" and err["code"] == "server_error" and "shutting down" in err["message"]
        assert events[-1] == "[DONE]"
        last = json.loads(events[-2])
        assert "shutting down" in last["error"]["message"] and last["error"]["type"] == "server_error"
        assert all("choices" in json.loads(e) and json.loads(e)["choices"][0]["finish_reason"] is None
                   for e in events[:-2])  # the cut answer is never presented as complete
        p.wait(30)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
