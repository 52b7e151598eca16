"""``epqlab serve`` on a hybrid-recurrent model (qwen35moe: Gated-DeltaNet blocks with one recurrent state per
sequence, plus full attention), driven with the ``openai`` client.

llama.cpp's recurrent memory cannot drop a sequence's tail, so the prompt cache may reuse a cached sequence only
when its tokens are an exact prefix of the new prompt, else clears it whole (as llama-server does). A chat's
edited or regenerated turn (a prompt that shares most of a cached sequence, then diverges) once made the
server's scheduler raise outside its error handling: the request never answered and its sequence was lost,
and after ``n_seq_max`` such turns every request waited forever. Here every diverging turn answers exactly what
a fresh Session answers, 2 x n_seq_max of them, and a fresh request still answers afterwards.
"""
from __future__ import annotations


import pytest

import epqlab
from epqlab.models.archs import write_tiny
from test_serve import _wait_ready, served

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

N_SEQ = 2
N = 6
BASE = "The router of every layer picks the experts of each token, and the pager reads the missing ones"
TURNS = [BASE + t for t in (" from disk.", " with O_DIRECT.", " into slots.", " in order.", " at once.", " again.")]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_tiny(tmp_path_factory.mktemp("hybrid") / "qwen35moe.gguf", "qwen35moe")


@pytest.fixture(scope="module")
def server(model):
    # --prompt-cache fast: llama-server's reuse, the mode that trims cached sequences
    with served(model, "--n-ctx", 256, "--max-batch", N_SEQ, "--prompt-cache", "fast") as up:
        yield up


@pytest.fixture(scope="module")
def references(model):
    """Each prompt's greedy completion from a fresh plain-llama.cpp Session (one Session per prompt: nothing is
    reused between them)."""
    out = {}
    for t in TURNS + ["Hello"]:
        with epqlab.Session(model, pager=False, n_threads=1, n_ctx=256) as s:
            out[t] = s.create_completion(t, max_tokens=N, temperature=0)["choices"][0]["text"]
    return out


def test_diverging_turns_on_a_hybrid_model_answer_and_keep_serving(server, references, model):
    url, proc = server
    assert epqlab.inspect(model).architecture == "qwen35moe"
    _wait_ready(url, proc)
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
    reused = []
    # 2 x n_seq_max turns, each sharing most of the cached sequences' tokens and then diverging
    for t in TURNS[:2 * N_SEQ + 1]:
        r = client.completions.create(model="x", prompt=t, max_tokens=N, temperature=0)
        assert r.choices[0].text == references[t], t
        raw = httpx.post(url + "/v1/completions", json={"prompt": t, "max_tokens": N, "temperature": 0},
                         timeout=60).json()
        assert raw["choices"][0]["text"] == references[t]
        reused.append(raw["epqlab"]["n_prompt_reused"])
    # the same prompt again ends where the cached sequence diverges from a fresh evaluation: nothing of a
    # recurrent state can be kept short of its end, so nothing was reused
    assert reused == [0] * len(reused)
    # and a fresh request still answers
    r = client.completions.create(model="x", prompt="Hello", max_tokens=N, temperature=0)
    assert r.choices[0].text == references["Hello"]
    assert proc.poll() is None
