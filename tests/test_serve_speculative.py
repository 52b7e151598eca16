"""``epqlab serve --spec-type draft-mtp``: MTP speculative decoding through the OpenAI-compatible server, one request
at a time (epqlab/engine/speculative.py), driven with the ``openai`` client from several threads at once. Each answer
equals a fresh plain-llama.cpp Session's greedy completion (speculation never changes a greedy answer), a streamed
answer equals the whole one, and a request for several choices is refused with a 400 while the server keeps serving.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

import epqlab
from epqlab.models.archs import write_tiny
from test_serve import _wait_ready, served

openai = pytest.importorskip("openai")

N = 8
PROMPTS = ["The router of every layer picks", "Experts are read with O_DIRECT", "A slot of the arena holds",
           "The MTP block drafts the next"]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_tiny(tmp_path_factory.mktemp("mtp_serve") / "qwen35moe.gguf", "qwen35moe")


@pytest.fixture(scope="module")
def references(model):
    out = {}
    for t in PROMPTS:
        with epqlab.Session(model, pager=False, n_threads=1, n_ctx=256) as s:
            out[t] = s.create_completion(t, max_tokens=N, temperature=0)["choices"][0]["text"]
    return out


def test_speculative_server_answers_in_turn(model, references):
    with served(model, "--n-ctx", 256, "--spec-type", "draft-mtp", "--spec-draft-n-max", 3) as (url, proc):
        _wait_ready(url, proc)
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)

        def ask(t):
            return client.completions.create(model="x", prompt=t, max_tokens=N, temperature=0).choices[0].text

        with ThreadPoolExecutor(4) as ex:  # concurrent requests take turns on the one sequence
            got = list(ex.map(ask, PROMPTS * 2))
        assert got == [references[t] for t in PROMPTS * 2]
        parts = client.completions.create(model="x", prompt=PROMPTS[0], max_tokens=N, temperature=0, stream=True)
        assert "".join(c.choices[0].text for c in parts) == references[PROMPTS[0]]
        with pytest.raises(openai.BadRequestError, match="one sequence at a time"):
            client.completions.create(model="x", prompt=PROMPTS[0], max_tokens=N, temperature=0, n=2)
        assert ask(PROMPTS[1]) == references[PROMPTS[1]]
        assert proc.poll() is None
    out = proc.stdout.read()
    assert "speculative decoding with the MTP block" in out
