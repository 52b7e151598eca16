"""Streams equal non-streamed results for every stop string (epqlab/engine/stop_text.py): in
``Session.stream``, ``create_completion(stream=True)`` (one choice, and n = 2 on a batch), ``stream_batch`` and
the chat stream, for stops that fall inside one token, across two tokens, at the very start, never, and one
whose prefix appears but which never completes (the held-back text must come out at the end). The expected
text is worked out from one generation without stops: greedy decoding is deterministic, so with a stop the
text is that text cut before the stop's first occurrence. Plus ``StopText`` on hand-made byte pieces and the
usage chunk of ``stream_options``."""
from __future__ import annotations

import pytest

import epqlab
from epqlab.engine.stop_text import StopText

PROMPT = "Paris is"
N = 24


def test_stop_text_holds_back_a_possible_stop_start():
    t = StopText(["ace wh"])
    assert t.add(b" a pl") == " a pl"
    assert t.add(b"ace") == ""  # "ace" may begin "ace wh": held back
    assert t.add(b" where") == "" and t.stopped and t.text == " a pl"
    t = StopText(["ace wh"])
    assert [t.add(b" a"), t.add(b" pl"), t.add(b"ace"), t.add(b"!")] == [" ", "a pl", "", "ace!"]  # "a" may begin "ace wh" too
    assert t.flush() == "" and not t.stopped
    t = StopText(["xyz"])
    assert t.add(b"ab x") == "ab " and t.flush() == "x" and t.text == "ab x"  # ended: the held text comes out
    t = StopText(["\U0001F600!"])  # a stop that begins with a character cut between tokens
    assert t.add("\U0001F600".encode()[:2]) == "" and t.add("\U0001F600".encode()[2:]) == ""
    assert t.add(b"?") == "\U0001F600?"
    t = StopText(["ab"])
    assert t.add(b"ab") == "" and t.stopped and t.text == ""  # a stop at the very start
    with pytest.raises(RuntimeError, match="after a stop"):
        t.add(b"x")


@pytest.fixture(scope="module")
def sess(default_model_path):
    with epqlab.Session(default_model_path, pager=False, n_seq_max=2, n_ctx=256, n_threads=1) as s:
        yield s


@pytest.fixture(scope="module")
def plain(sess):
    """The greedy text without stops, and each token's text (to place stops inside and across tokens)."""
    g = sess.generate(PROMPT, N)
    pieces = [sess.decoder.piece(t).decode("utf-8", "ignore") for t in g.tokens]
    assert "".join(pieces) == g.text and len(g.tokens) == N  # ASCII text: tokens split it cleanly
    return g.text, pieces


def _stops(text: str, pieces: list[str]) -> dict[str, str]:
    """Stop strings by kind, from the stop-free text's own tokens."""
    k = next(i for i, p in enumerate(pieces) if len(p.strip()) >= 3 and i >= 2)  # a token with 3+ letters
    start = len("".join(pieces[:k]))
    inside = pieces[k].lstrip()[1:3]  # two characters inside that token
    j = next(i for i in range(k + 1, len(pieces) - 1) if len(pieces[i]) >= 2 and len(pieces[i + 1]) >= 2)
    b = len("".join(pieces[:j + 1]))
    across = text[b - 2:b + 2]  # the last two characters of token j and the first two of token j + 1
    assert start >= 0 and inside and len(across) == 4
    return {"inside": inside, "across": across, "start": text[:2], "never": "\u0000never",
            "prefix_only": text[-3:] + "\u0001"}  # its first 3 characters end the text; it never completes


def _expect(text: str, stops: list[str]) -> str:
    cut = [text.find(s) for s in stops if s in text]
    return text[:min(cut)] if cut else text


@pytest.mark.parametrize("kind", ["inside", "across", "start", "never", "prefix_only"])
def test_every_stream_path_equals_the_non_streamed_text(sess, plain, kind):
    text, pieces = plain
    stop = _stops(text, pieces)[kind]
    want = _expect(text, [stop])
    if kind in ("never", "prefix_only"):
        assert want == text
    else:
        assert stop in text and len(want) < len(text)
    assert sess.generate(PROMPT, N, stop=[stop]).text == want
    st = sess.stream(PROMPT, N, stop=[stop])
    assert "".join(st) == want and st.result.text == want
    assert "".join(p for _, p in sess.stream_batch([PROMPT], N, stop=[stop])) == want
    kw = dict(max_tokens=N, temperature=0, stop=[stop])
    assert sess.create_completion(PROMPT, **kw)["choices"][0]["text"] == want
    assert "".join(c["choices"][0]["text"] for c in sess.create_completion(PROMPT, stream=True, **kw)) == want
    # two sequences per step round differently from one (tests/test_batch.py): their own stop-free texts
    want2 = [_expect(g.text, [stop]) for g in sess.generate_batch([PROMPT, PROMPT], N)]
    assert [g.text for g in sess.generate_batch([PROMPT, PROMPT], N, stop=[stop])] == want2
    assert [c["text"] for c in sess.create_completion(PROMPT, n=2, **kw)["choices"]] == want2
    per = {0: "", 1: ""}
    for c in sess.create_completion(PROMPT, stream=True, n=2, **kw):  # a batch: epqlab.engine.batch's path
        per[c["choices"][0]["index"]] += c["choices"][0]["text"]
    assert [per[0], per[1]] == want2


def test_chat_stream_equals_chat_and_usage_chunk(sess):
    msgs = [{"role": "user", "content": "What is a CPU cache?"}]
    full = sess.create_chat_completion(msgs, max_tokens=N, temperature=0)
    text = full["choices"][0]["message"]["content"]
    stop = text[5:9]
    want = _expect(text, [stop])
    assert len(want) < len(text)
    kw = dict(max_tokens=N, temperature=0, stop=[stop])
    assert sess.create_chat_completion(msgs, **kw)["choices"][0]["message"]["content"] == want
    chunks = list(sess.create_chat_completion(msgs, stream=True, stream_options={"include_usage": True}, **kw))
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks[:-1]) == want
    last = chunks[-1]  # OpenAI's usage chunk: no choices, the whole request's usage; every other has usage None
    assert last["choices"] == [] and last["usage"] == sess.create_chat_completion(msgs, **kw)["usage"]
    assert all(c["usage"] is None for c in chunks[:-1])
    assert all("usage" not in c for c in sess.create_chat_completion(msgs, stream=True, **kw))  # not asked for
    with pytest.raises(ValueError, match="stream_options"):
        sess.create_chat_completion(msgs, stream_options={"include_usage": True}, **kw)
    with pytest.raises(ValueError, match="include_usage"):
        sess.create_completion(PROMPT, stream=True, stream_options={"include_usage": 1}, **kw)
