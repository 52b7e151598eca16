"""``epqlab serve --max-batch 4``: continuous batching, driven with the ``openai`` client from 4 threads.

Four concurrent requests at temperature 0 decode in shared steps (the stats endpoint shows steps of 4) and
each returns what the same four prompts return from one unpaged ``Session.create_completion`` batch computed
here (llama.cpp's batched kernels round differently from single-token decode, tests/test_batch.py, so the
reference is the batch, not each prompt alone); ``n`` > 1 and a list of prompts are choices of one request;
a client that drops its stream frees its sequence at the next step while another request finishes unharmed.
"""
from __future__ import annotations

import threading
import time

import pytest

import epqlab
from test_serve import _wait_ready, served

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

PROMPTS = ["A CPU cache is", "The capital of France is a city that", "def fib(n):", "Once upon a time, in a"]
N = 10


@pytest.fixture(scope="module")
def server(default_model_path):
    with served(default_model_path, "--n-ctx", 256, "--max-batch", 4, "--batch-window-ms", 3000) as up:
        yield up


@pytest.fixture(scope="module")
def reference(default_model_path):
    with epqlab.Session(default_model_path, pager=False, n_threads=1, n_ctx=256, n_seq_max=4) as s:
        r = s.create_completion(PROMPTS, max_tokens=N, temperature=0)
        alone = [s.create_completion(p, max_tokens=N, temperature=0)["choices"][0]["text"] for p in PROMPTS]
        yield [c["text"] for c in r["choices"]], alone


def test_concurrent_requests_share_steps(server, reference):
    url, proc = server
    _wait_ready(url, proc)
    batched, alone = reference
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
    out: dict[int, str] = {}

    def ask(i):
        out[i] = client.completions.create(model="x", prompt=PROMPTS[i], max_tokens=N, temperature=0).choices[0].text

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert [out.get(i) for i in range(4)] == batched
    st = httpx.get(url + "/v1/epqlab/stats").json()["batch"]
    assert st["batch_sizes"].get("4", 0) >= N - 2 and st["union_per_layer"] > 0  # they decoded together
    assert st["active"] == 0 and st["waiting"] == 0
    # what the batch changes against decoding alone is llama.cpp's rounding: say so when it shows
    if batched != alone:
        assert sum(a == b for a, b in zip(batched, alone)) < 4

    # one request, two (new) prompts x n=2: four choices in order, decoded as one batch
    r = client.completions.create(model="x", prompt=["Water boils at", "The sun is a"], max_tokens=N, temperature=0,
                                  n=2)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.choices[0].text == r.choices[1].text and r.choices[2].text == r.choices[3].text
    assert r.usage.completion_tokens == 4 * N


def test_dropped_client_frees_its_sequence(server, reference):
    url, proc = server
    _wait_ready(url, proc)
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
    got = {}

    def other():
        got["r"] = client.completions.create(model="x", prompt=PROMPTS[2], max_tokens=24, temperature=0)

    t = threading.Thread(target=other)
    t.start()
    with httpx.stream("POST", url + "/v1/completions", timeout=60,
                      json={"prompt": PROMPTS[3], "max_tokens": 200, "stream": True, "temperature": 0}) as resp:
        n = 0
        for ln in resp.iter_lines():
            n += ln.startswith("data:")
            if n == 3:
                break  # the connection closes mid-stream
    t.join(180)
    assert got["r"].choices[0].finish_reason == "length" and len(got["r"].choices[0].text) > 0
    deadline = time.time() + 30
    while time.time() < deadline:
        st = httpx.get(url + "/v1/epqlab/stats").json()["batch"]
        if st["active"] == 0:
            break
        time.sleep(0.2)
    assert st["active"] == 0 and st["waiting"] == 0  # the dropped stream's sequence left
    assert proc.poll() is None


def test_abandoned_non_streaming_request_stops(server, reference, default_model_path):
    """A non-streaming client that gives up (a 1 s timeout on a 240-token request that, alone, runs all 240
    tokens): the server notices the closed connection and frees the sequence at the next step, so far fewer
    than 240 steps run."""
    url, proc = server
    _wait_ready(url, proc)
    body = {"prompt": PROMPTS[3], "max_tokens": 240, "temperature": 0}
    with epqlab.Session(default_model_path, pager=False, n_threads=1, n_ctx=256) as s:
        assert s.create_completion(PROMPTS[3], max_tokens=240, temperature=0)["usage"]["completion_tokens"] == 240
    steps0 = httpx.get(url + "/v1/epqlab/stats").json()["batch"]["steps"]
    with pytest.raises(httpx.TimeoutException):
        httpx.post(url + "/v1/completions", timeout=1.0, json=body)
    deadline = time.time() + 60
    while time.time() < deadline:
        st = httpx.get(url + "/v1/epqlab/stats").json()["batch"]
        if st["active"] == 0 and st["waiting"] == 0:
            break
        time.sleep(0.1)
    assert st["active"] == 0 and st["steps"] - steps0 < 150
    r = httpx.post(url + "/v1/completions", timeout=120, json={"prompt": "Hi", "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200 and proc.poll() is None


def test_fields_bodies_usage_and_stats_under_load(server, reference):
    """Unsupported OpenAI fields are refused (not ignored); a body that is not UTF-8 gets the OpenAI error shape;
    a streamed n=2 reports usage once; the stats endpoint answers while streams wait for a sequence."""
    url, proc = server
    _wait_ready(url, proc)
    for field, value in (("suffix", "end"), ("best_of", 3), ("audio", {"voice": "x"}), ("modalities", ["audio"]),
                         ("prediction", {"type": "content", "content": "x"})):
        r = httpx.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2, field: value}, timeout=60)
        assert r.status_code == 400 and field in r.json()["error"]["message"], (field, r.text)
    r = httpx.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "suffix": None, "best_of": 1,
                                                  "modalities": ["text"]}, timeout=60)
    assert r.status_code == 200  # the "off" values pass
    r = httpx.post(url + "/v1/completions", content=b'{"prompt": "\xff", "max_tokens": 2}',
                   headers={"content-type": "application/json"}, timeout=60)
    assert 400 <= r.status_code < 500 and "message" in r.json()["error"]
    chunks = []
    with httpx.stream("POST", url + "/v1/completions", timeout=120,
                      json={"prompt": "Hi", "max_tokens": 4, "n": 2, "stream": True, "temperature": 0,
                            "stream_options": {"include_usage": True}}) as resp:
        for ln in resp.iter_lines():
            if ln.startswith("data:") and ln != "data: [DONE]":
                chunks.append(__import__("json").loads(ln[5:]))
    # OpenAI's usage chunk: once, last, with no choices; every other chunk says "usage": null
    assert [c["usage"] is not None for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 8
    # a long request on every sequence, 6 streams queued behind it: the stats endpoint answers while it decodes.
    # Polled until the big request returns, so no wall-clock guess decides whether a sample lands mid-run.
    big = threading.Thread(target=lambda: httpx.post(url + "/v1/completions", timeout=300, json={
        "prompt": PROMPTS[3], "max_tokens": 200, "n": 4, "temperature": 0}))
    big.start()

    def stream_one():
        with httpx.stream("POST", url + "/v1/completions", timeout=300,
                          json={"prompt": "Hi", "max_tokens": 2, "stream": True}) as resp:
            list(resp.iter_lines())

    streams = [threading.Thread(target=stream_one) for _ in range(6)]
    samples = []  # (active, waiting, big still running once the answer came back)
    while big.is_alive():
        st = httpx.get(url + "/v1/epqlab/stats", timeout=60).json()["batch"]
        samples.append((st["active"], st["waiting"], big.is_alive()))
        if st["active"] == 4 and not any(t.ident for t in streams):
            for t in streams:  # queue the streams once every sequence is busy
                t.start()
        time.sleep(0.05)
    big.join(300)
    for t in streams:
        if t.ident:
            t.join(300)
    mid = [s for s in samples if s[2] and s[0] == 4]
    assert mid, samples  # answered mid-run, with every sequence busy
    assert any(s[1] > 0 for s in mid), samples  # ... and with streams waiting for a sequence
