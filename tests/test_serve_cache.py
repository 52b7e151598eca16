"""The server's prompt cache never changes an answer (``epqlab serve --prompt-cache exact``, the default;
epqlab.engine.batch.reusable_prefix): the same chat request three times, and a chat's second turn, through a
real ``epqlab serve`` each equal a fresh Session's answer (text and every log-probability, bit for bit), while ``/v1/epqlab/stats`` counts the KV cells the
cache reused (whole 16-token ubatches here: ``--n-ubatch 16``, so a short chat reuses some). Plus the rule
itself on hand-made token lists: ubatch ends, exact vs fast vs off."""
from __future__ import annotations


import pytest

import epqlab
from epqlab.engine.batch import Batcher, Request, fresh_ubatch_ends, reusable_prefix
from test_serve import _wait_ready, served

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

U = 16  # --n-ubatch
SYSTEM = ("You are a terse assistant. You answer questions about computer hardware, caches, memory and "
          "operating systems in one or two plain sentences.")
MSGS = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is a CPU cache?"}]
N = 12


def test_fresh_ubatch_ends_and_the_reuse_rule():
    assert fresh_ubatch_ends(40, 512, 16) == [16, 32]  # the short last ubatch [32, 40) is not shared
    assert fresh_ubatch_ends(48, 512, 16) == [16, 32, 48]
    assert fresh_ubatch_ends(1100, 512, 512) == [512, 1024]
    assert fresh_ubatch_ends(1100, 512, 200) == [512, 1024]  # 200 does not divide 512: chunk ends only
    cached = list(range(100, 140)) + [7, 7, 7]  # a 40-token prompt, then 3 generated tokens
    ends = fresh_ubatch_ends(40, 512, 16)
    turn2 = cached + [9, 9]
    assert reusable_prefix(cached, ends, turn2, "fast") == 43  # generated tokens too (llama.cpp's server)
    assert reusable_prefix(cached, ends, turn2, "exact") == 32  # whole ubatches of the prompt's evaluation
    assert reusable_prefix(cached, ends, turn2, "off") == 0
    assert reusable_prefix(cached, ends, cached[:40], "exact") == 32  # the same prompt again
    assert reusable_prefix(cached, ends, cached[:32], "exact") == 16  # one token is always left to decode
    assert reusable_prefix(cached, ends, cached[:20] + [1] * 30, "exact") == 16  # diverges inside a ubatch
    assert reusable_prefix(cached, ends, cached[:40], "fast") == 39
    with pytest.raises(ValueError, match="exact, fast, off"):
        reusable_prefix(cached, ends, turn2, "always")


def test_batcher_refuses_an_unknown_mode(default_model_path):
    with epqlab.Session(default_model_path, pager=False, n_ctx=256, n_threads=1) as s:
        with pytest.raises(ValueError, match="prompt_cache must be one of exact, fast, off"):
            Batcher(s, prompt_cache="sometimes")
        assert Batcher(s, prompt_cache=True).prompt_cache == "exact"


@pytest.fixture(scope="module")
def server(default_model_path):
    with served(default_model_path, "--n-ctx", 512, "--max-batch", 2, "--n-ubatch", U) as up:
        yield up


@pytest.fixture(scope="module")
def fresh(default_model_path):
    """A fresh Session's answer to any messages (the KV cache cleared before each: nothing reused)."""
    with epqlab.Session(default_model_path, pager=False, n_threads=1, n_ctx=512, n_seq_max=2, n_ubatch=U) as s:
        def answer(msgs):
            with s.decoder.lock:
                s.decoder.begin()  # an empty context: the next call decodes its whole prompt
            r = s.create_chat_completion(msgs, max_tokens=N, temperature=0, logprobs=True)
            assert r["epqlab"]["n_prompt_reused"] == 0
            c = r["choices"][0]
            return (c["message"]["content"], [e["logprob"] for e in c["logprobs"]["content"]]), r["usage"]["prompt_tokens"]
        yield answer


def _answer(r) -> tuple:
    """The text and every token's log-probability (exact floats: a logit that moved by one rounding shows)."""
    return r.choices[0].message.content, [e.logprob for e in r.choices[0].logprobs.content]


def _reused(url) -> int:
    b = httpx.get(url + "/v1/epqlab/stats", timeout=60).json()["batch"]
    assert b["prompt_cache"] == "exact"
    return b["reused_cells"]


def test_cached_answers_equal_fresh_ones(server, fresh):
    url, proc = server
    _wait_ready(url, proc)
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
    want, n_prompt = fresh(MSGS)
    assert n_prompt > 2 * U
    turn2 = MSGS + [{"role": "assistant", "content": want[0]}, {"role": "user", "content": "And a TLB?"}]
    want2, n_prompt2 = fresh(turn2)
    got, reuse = [], []
    for msgs in (MSGS, MSGS, MSGS, turn2):  # the second and third find the first one's cells; turn 2 the third's
        r = client.chat.completions.create(model="x", messages=msgs, max_tokens=N, temperature=0, logprobs=True)
        got.append(_answer(r))
        reuse.append(r.model_extra["epqlab"]["n_prompt_reused"])
    assert got == [want] * 3 + [want2]  # (--prompt-cache fast reuses turn 1's generated cells: its turn 2 differs)
    assert reuse[0] == 0 and reuse[1] == reuse[2] == (n_prompt - 1) // U * U > 0
    assert 0 < reuse[3] <= n_prompt < n_prompt2 and reuse[3] % U == 0  # never turn 1's generated tokens
    assert _reused(url) == sum(reuse)
    assert proc.poll() is None


def test_cached_tokens_in_each_api(server):
    """The same prompt twice through each API's own client reports the prompt cache's reuse in the API's usage field:
    0, then the prompt's whole ubatches but the last token's ((n - 1) // 16 x 16, the exact rule), equal to what the
    server's own counter (/v1/epqlab/stats reused_cells) added. A system prompt of its own per API, so no earlier
    request's cells serve the first one."""
    anthropic = pytest.importorskip("anthropic")
    url, proc = server
    _wait_ready(url, proc)
    oa = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
    claude = anthropic.Anthropic(base_url=url, api_key="none", max_retries=0, timeout=120)
    ask = "What does a memory controller do?"

    def chat(system):  # -> (prompt tokens, cached tokens)
        u = oa.chat.completions.create(model="x", max_tokens=2, temperature=0, messages=[
            {"role": "system", "content": system}, {"role": "user", "content": ask}]).usage
        return u.prompt_tokens, u.prompt_tokens_details.cached_tokens

    def responses(system):
        with oa.responses.stream(model="x", instructions=system, input=ask, max_output_tokens=2, temperature=0) as st:
            u = list(st)[-1].response.usage  # the streamed path's usage, in response.incomplete (cut at 2 tokens)
        return u.input_tokens, u.input_tokens_details.cached_tokens

    def messages(system):  # Anthropic's input_tokens leave the cache reads out
        u = claude.messages.create(model="x", max_tokens=2, system=system, extra_body={"temperature": 0},
                                   messages=[{"role": "user", "content": ask}]).usage
        assert u.cache_creation_input_tokens == 0
        return u.input_tokens + u.cache_read_input_tokens, u.cache_read_input_tokens

    for call, system in ((chat, "Chat answers: you explain computer memory systems in one plain sentence each."),
                         (responses, "Responses answer: you explain computer memory systems in one plain sentence."),
                         (messages, "Messages reply: you explain computer memory systems in one plain sentence.")):
        seen = []
        for _ in range(2):
            before = _reused(url)
            n, cached = call(system)
            seen.append(cached)
            assert cached == _reused(url) - before, call.__name__
        assert n > 2 * U and seen == [0, (n - 1) // U * U], (call.__name__, n, seen)


@pytest.mark.parametrize("max_batch", [1, 2])
def test_a_growing_chat_reuses_its_whole_ubatches(default_model_path, max_batch):
    """A chat's next turn shares less than half of its prompt with the cached turn (31 -> 73 -> 133 tokens in the
    new user's report): every whole shared ubatch is reused anyway, whether the cached sequence is the only one
    (max_batch 1) or an empty one is free beside it. (A 50 % similarity rule once reused nothing here.)"""
    from epqlab.engine.sampling import Sampler

    with epqlab.Session(default_model_path, pager=False, n_ctx=512, n_seq_max=2, n_ubatch=U, n_threads=1) as s:
        b = Batcher(s, max_batch, prompt_cache="exact")
        turn, reused, lengths, gen = list(range(200, 231)), [], [], []  # 31 tokens
        for total in (31, 73, 133):  # each turn: the last one, its answer, then a new question up to `total` tokens
            if gen:
                turn = turn + gen + list(range(300, 300 + total - len(turn) - len(gen)))
            assert len(turn) == total
            r = Request(turn, 4, Sampler(s.n_vocab, temperature=0.0))
            b.run([r])
            assert r.result.finish_reason in ("stop", "length")
            gen = list(r.result.tokens)
            reused.append(r.reused)
        assert reused == [0, 31 // U * U, 73 // U * U]  # 16 of 73 and 64 of 133: under half, reused
