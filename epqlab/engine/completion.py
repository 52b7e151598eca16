"""llama-cpp-python's completion API on an :class:`epqlab.Session`: ``create_completion`` and
``create_chat_completion`` take the arguments ``llama_cpp.Llama``'s methods of the same names take
and return the same OpenAI-schema dicts (``id``, ``object``, ``created``, ``model``, ``choices``
with ``finish_reason``, ``usage``), or, with ``stream=True``, an iterator of the same chunks
(``text_completion`` / ``chat.completion.chunk``). epqlab adds one key, ``"epqlab"``: the run stats
of :meth:`epqlab.Session.generate` (pager hit rates, SSD bytes, timings), on the response and on the
last chunk of a stream.

Sampling is llama.cpp's chain with llama-cpp-python's defaults (:class:`epqlab.engine.sampling.Sampler`),
and, as in llama-cpp-python, the KV cache of the previous call is kept when its tokens are a prefix
of the new prompt (a chat's next turn): only the new tokens are decoded.
"""
from __future__ import annotations

import time
import uuid
from collections.abc import Iterator, Sequence

from ..results import clean_json

# What these calls accept beyond llama-cpp-python's defaults is refused, not ignored.
_CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")


def _stop_list(stop) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, (list, tuple)) and all(isinstance(x, str) for x in stop):
        return list(stop)
    raise ValueError(f"stop must be a string or a list of strings, got {stop!r}")


def _max_tokens(session, max_tokens, n_prompt: int) -> int:
    room = session.n_ctx - n_prompt
    if room < 1:
        raise ValueError(f"the prompt has {n_prompt} tokens, which leaves no room in the context of "
                         f"{session.n_ctx}; shorten it or open the Session with a larger n_ctx")
    if max_tokens is None or (isinstance(max_tokens, int) and not isinstance(max_tokens, bool) and max_tokens <= 0):
        return room  # llama-cpp-python: None or <= 0 means "until the context is full"
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int):
        raise ValueError(f"max_tokens must be an integer, got {max_tokens!r}")
    return min(max_tokens, room)


def _usage(n_prompt: int, n_gen: int) -> dict:
    return {"prompt_tokens": n_prompt, "completion_tokens": n_gen, "total_tokens": n_prompt + n_gen}


def create_completion(session, prompt: str | Sequence[int], *, max_tokens: int | None = 16, temperature: float = 0.8,
                      top_p: float = 0.95, top_k: int = 40, min_p: float = 0.05, repeat_penalty: float = 1.0,
                      stop: str | Sequence[str] | None = None, seed: int | None = None, stream: bool = False,
                      model: str | None = None) -> dict | Iterator[dict]:
    """:meth:`epqlab.Session.create_completion` (see there)."""
    toks = session.prompt_tokens(prompt, True)
    n = _max_tokens(session, max_tokens, len(toks))
    st = session.stream(toks, n, temperature, seed, _stop_list(stop), top_k=top_k, top_p=top_p, min_p=min_p,
                        repeat_penalty=repeat_penalty, reuse_kv=True)
    cid, created, name = f"cmpl-{uuid.uuid4()}", int(time.time()), model or session.model_name

    def chunk(text: str, reason, extra=None) -> dict:
        d = {"id": cid, "object": "text_completion", "created": created, "model": name,
             "choices": [{"text": text, "index": 0, "logprobs": None, "finish_reason": reason}]}
        if extra:
            d.update(extra)
        return d

    if stream:
        def chunks():
            try:  # no lock held across yields: a consumer may resume it from another thread
                for piece in st:
                    yield chunk(piece, None)
            finally:
                st.close()
            g = st.result
            yield chunk("", g.finish_reason, {"usage": _usage(len(toks), len(g.tokens)), "epqlab": clean_json(g.stats)})
        return chunks()
    with session.decoder.lock:
        for _ in st:
            pass
    g = st.result
    out = chunk(g.text, g.finish_reason)
    out.update(usage=_usage(len(toks), len(g.tokens)), epqlab=clean_json(g.stats))
    return out


def check_messages(messages) -> list[dict]:
    """``messages`` as ``[{"role": str, "content": str}]``; ValueError naming the first bad one."""
    if isinstance(messages, (str, bytes, dict)) or not isinstance(messages, Sequence):
        raise ValueError('messages must be a list of {"role": ..., "content": ...} dicts')
    if not messages:
        raise ValueError("messages is empty: pass at least one message")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m:
            raise ValueError(f'messages[{i}] must be a dict with "role" and "content", got {m!r}')
        if m["role"] not in _CHAT_ROLES:
            raise ValueError(f"messages[{i}]: unknown role {m['role']!r}; use one of {', '.join(_CHAT_ROLES)}")
        if not isinstance(m.get("content"), str):
            raise ValueError(f"messages[{i}]: content must be a string (content parts, images and tool calls "
                             f"are not supported), got {type(m.get('content')).__name__}")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def create_chat_completion(session, messages: Sequence[dict], *, max_tokens: int | None = None,
                           temperature: float = 0.2, top_p: float = 0.95, top_k: int = 40, min_p: float = 0.05,
                           repeat_penalty: float = 1.0, stop: str | Sequence[str] | None = None,
                           seed: int | None = None, stream: bool = False,
                           model: str | None = None) -> dict | Iterator[dict]:
    """:meth:`epqlab.Session.create_chat_completion` (see there)."""
    msgs = check_messages(messages)
    prompt = session.chat_prompt(msgs)
    toks = session.tokenize(prompt, add_special=False)
    n = _max_tokens(session, max_tokens, len(toks))
    st = session.stream(toks, n, temperature, seed, _stop_list(stop), top_k=top_k, top_p=top_p, min_p=min_p,
                        repeat_penalty=repeat_penalty, reuse_kv=True)
    cid, created, name = f"chatcmpl-{uuid.uuid4()}", int(time.time()), model or session.model_name

    def chunk(delta: dict, reason, extra=None) -> dict:
        d = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": name,
             "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}]}
        if extra:
            d.update(extra)
        return d

    if stream:
        def chunks():
            yield chunk({"role": "assistant"}, None)
            try:
                for piece in st:
                    yield chunk({"content": piece}, None)
            finally:
                st.close()
            g = st.result
            yield chunk({}, g.finish_reason, {"usage": _usage(len(toks), len(g.tokens)), "epqlab": clean_json(g.stats)})
        return chunks()
    with session.decoder.lock:
        for _ in st:
            pass
    g = st.result
    return {"id": cid, "object": "chat.completion", "created": created, "model": name,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": g.text}, "logprobs": None,
                         "finish_reason": g.finish_reason}],
            "usage": _usage(len(toks), len(g.tokens)), "epqlab": clean_json(g.stats)}


__all__ = ["create_completion", "create_chat_completion", "check_messages"]
