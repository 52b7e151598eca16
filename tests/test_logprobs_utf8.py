"""``logprobs`` on multi-byte text: one entry per generated token (``usage.completion_tokens`` of them),
``text_offset`` the characters of the text before each token (its bytes decoded as the text is), a token that
holds part of a UTF-8 character shown as llama-cpp-python shows it (decoded with ``errors="ignore"``), chat's
``bytes`` the token's exact bytes; streamed entries join to the non-streamed ones. A grammar makes the
model write emoji and CJK (byte-level BPE splits them between tokens); the token ids are worked out on
a batch of one here (:class:`~epqlab.engine.batch.Batcher`, the same decode bit for bit)."""
from __future__ import annotations

import pytest

import epqlab
from epqlab.engine.batch import Batcher, Request
from epqlab.requests.completion_run import make_sampler, sampling_args

TEXT = "\U0001F600\U0001F603\U0001F604 \u6f22\u5b57\u304b\u306a"  # 3 emoji, a space, 2 kanji, 2 kana
GRAMMAR = f'root ::= "{TEXT}"'
PROMPT = "Emoji list:"
N = 24


@pytest.fixture(scope="module")
def sess(default_model_path):
    with epqlab.Session(default_model_path, pager=False, n_ctx=256, n_threads=1) as s:
        yield s


def _ids(sess, toks: list[int]) -> list[int]:
    r = Request(toks, N, make_sampler(sess, None, sampling_args(
        sess, temperature=0, top_k=40, top_p=0.95, min_p=0.05, repeat_penalty=1.0, grammar=GRAMMAR)))
    Batcher(sess).run([r])
    return r.out


def _expected(sess, ids: list[int]) -> tuple[list[str], list[int], str]:
    pieces = [sess.decoder.piece(t) for t in ids]
    shown = [p.decode("utf-8", "ignore") for p in pieces]
    offsets = [len(b"".join(pieces[:i]).decode("utf-8", "ignore")) for i in range(len(pieces))]
    return shown, offsets, b"".join(pieces).decode("utf-8", "ignore")


def test_completion_logprobs_one_entry_per_token(sess):
    toks = sess.tokenize(PROMPT)
    ids = _ids(sess, toks)
    shown, offsets, text = _expected(sess, ids)
    assert any(s == "" for s in shown), shown  # the grammar's text really splits characters between tokens
    kw = dict(max_tokens=N, temperature=0, logprobs=2, grammar=GRAMMAR)
    r = sess.create_completion(toks, **kw)
    ch, lp = r["choices"][0], r["choices"][0]["logprobs"]
    assert ch["text"] == text == TEXT  # the grammar ends it (end of generation)
    assert len(lp["tokens"]) == r["usage"]["completion_tokens"] == len(ids)
    assert lp["tokens"] == shown and lp["text_offset"] == offsets
    assert all(ch["text"][:o] == b"".join(sess.decoder.piece(t) for t in ids[:i]).decode("utf-8", "ignore")
               for i, o in enumerate(lp["text_offset"]))
    assert all(len(d) >= 1 and lp["tokens"][i] in d for i, d in enumerate(lp["top_logprobs"]))
    for stop in (None, TEXT[4]):  # with a stop string, the entries of the tokens held back come at the end
        r = sess.create_completion(toks, stop=stop, **kw)
        lp, k = r["choices"][0]["logprobs"], r["usage"]["completion_tokens"]
        assert (lp["tokens"], lp["text_offset"]) == (shown[:k], offsets[:k])
        streamed = {key: [] for key in lp}
        for c in sess.create_completion(toks, stream=True, stop=stop, **kw):
            for key in lp:
                streamed[key] += (c["choices"][0]["logprobs"] or {}).get(key, [])
        assert streamed == lp
    assert r["choices"][0]["text"] == TEXT[:4] and k < len(ids)


def test_chat_logprobs_one_entry_per_token(sess):
    msgs = [{"role": "user", "content": "Some emoji and kanji please."}]
    toks = sess.tokenize(sess.chat_prompt(msgs), add_special=False)
    ids = _ids(sess, toks)
    shown, _, text = _expected(sess, ids)
    kw = dict(max_tokens=N, temperature=0, logprobs=True, top_logprobs=1, grammar=GRAMMAR)
    r = sess.create_chat_completion(msgs, **kw)
    content = r["choices"][0]["logprobs"]["content"]
    assert r["choices"][0]["message"]["content"] == text == TEXT
    assert len(content) == r["usage"]["completion_tokens"] == len(ids)
    assert [e["token"] for e in content] == shown
    assert [bytes(e["bytes"]) for e in content] == [sess.decoder.piece(t) for t in ids]
    streamed = [e for c in sess.create_chat_completion(msgs, stream=True, **kw)
                if c["choices"][0]["logprobs"] for e in c["choices"][0]["logprobs"]["content"]]
    assert streamed == content
