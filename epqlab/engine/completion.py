"""llama-cpp-python's completion API on an :class:`epqlab.Session`: ``create_completion`` and
``create_chat_completion`` take the arguments ``llama_cpp.Llama``'s methods of the same names take
and return the same OpenAI-schema dicts (``id``, ``object``, ``created``, ``model``, ``choices``
with ``finish_reason``, ``usage``), or, with ``stream=True``, an iterator of the same chunks
(``text_completion`` / ``chat.completion.chunk``). epqlab adds one key, ``"epqlab"``: the run stats
of :meth:`epqlab.Session.generate` (pager hit rates, SSD bytes, timings), on the response and on the
last chunk of a stream.

``prompt`` takes the OpenAI completions API's forms: a string, a list of strings, a list of token ids (one
prompt) or a list of token-id lists; ``n`` choices per prompt (choice ``i * n + j`` is prompt i's j-th).
Several choices decode as a batch (:mod:`epqlab.engine.batch`, up to the Session's ``n_seq_max`` at a
time, one after another with ``n_seq_max=1``); with ``seed`` s, choice c samples with seed ``s + c``.

Sampling is llama.cpp's chain with llama-cpp-python's defaults (:class:`epqlab.engine.sampling.Sampler`),
and, as in llama-cpp-python, the KV cache of the previous call is kept when its tokens are a prefix
of the new prompt (a chat's next turn): only the new tokens are decoded.
"""
from __future__ import annotations

import numbers
import queue
import threading
import time
import uuid
from collections.abc import Iterator, Sequence

from ..results import clean_json
from .batch import Batcher, Request
from .sampling import Sampler

# What these calls accept beyond llama-cpp-python's defaults is refused, not ignored.
_CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")
MAX_CHOICES = 128  # n x prompts per call
CANCEL_POLL_S = 0.1  # how often a wait on a background batcher looks at its cancel event


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


def prompt_list(session, prompt) -> list[list[int]]:
    """The prompts of a completions request as token-id lists: a str, a list of str, a list of ints (one
    prompt), or a list of int lists (OpenAI's ``prompt`` forms). Raises TypeError / ValueError naming the
    form that is wrong."""
    if isinstance(prompt, str):
        return [session.prompt_tokens(prompt, True)]
    if isinstance(prompt, (bytes, bytearray)) or prompt is None or not isinstance(prompt, Sequence):
        raise TypeError("prompt must be a str, a list of str, a list of token ids or a list of token-id lists, "
                        f"got {type(prompt).__name__}")
    if not prompt:
        raise ValueError("empty prompt: pass some text or at least one token id")
    if all(isinstance(x, numbers.Integral) and not isinstance(x, bool) for x in prompt):
        return [session.prompt_tokens(list(prompt), True)]
    if all(isinstance(x, str) for x in prompt):
        return [session.prompt_tokens(x, True) for x in prompt]
    if all(isinstance(x, Sequence) and not isinstance(x, (str, bytes)) for x in prompt):
        return [session.prompt_tokens(list(x), True) for x in prompt]
    if all(isinstance(x, numbers.Number) and not isinstance(x, bool) for x in prompt):
        raise TypeError(f"token ids must be integers, got {type(next(x for x in prompt if not isinstance(x, numbers.Integral))).__name__}")
    raise TypeError("prompt must be a str, a list of str, a list of token ids or a list of token-id lists; "
                    "this list mixes them")


def _check_n(n) -> int:
    if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 1:
        raise ValueError(f"n must be an integer >= 1 (choices per prompt), got {n!r}")
    return int(n)


def _requests(session, prompts: list[list[int]], n: int, max_tokens, stops, seed, sampling: dict,
              events: queue.SimpleQueue) -> list[Request]:
    if len(prompts) * n > MAX_CHOICES:
        raise ValueError(f"{len(prompts)} prompts x n={n} is more than {MAX_CHOICES} choices in one call")
    out = []
    for i, toks in enumerate(prompts):
        m = _max_tokens(session, max_tokens, len(toks))
        for j in range(n):
            c = i * n + j
            sd = None if seed is None else (int(seed) + c) % 2**32
            out.append(Request(toks, m, Sampler(session.n_vocab, seed=sd, **sampling), stops, index=c,
                               events=events))
    return out


def batch_events(session, reqs: list[Request], batcher: Batcher | None = None,
                 cancel: threading.Event | None = None) -> Iterator[tuple]:
    """``("piece", choice, text)`` and ``("done", choice, None)`` of ``reqs`` as they happen: on ``batcher``
    when given (a background one: the server's), else on a Batcher driven here, step by step. Closing the
    iterator, or setting ``cancel``, cancels what is still running."""
    q = reqs[0].events
    local = batcher is None
    b = Batcher(session) if local else batcher
    for r in reqs:
        b.submit(r)
    left = len(reqs)
    try:
        while left:
            if cancel is not None and cancel.is_set():
                for r in reqs:
                    r.cancel()
            try:
                ev = q.get_nowait() if local else q.get(timeout=CANCEL_POLL_S)
            except queue.Empty:
                if not local:
                    continue
                try:
                    if not b.drive():
                        break
                except BaseException as e:
                    b._fail_all(e)  # every request ends (with this error); their events follow
                continue
            left -= ev[0] == "done"
            yield ev
    finally:
        for r in reqs:
            r.cancel()
        if local:
            try:
                while b.drive():  # let the cancelled sequences leave
                    pass
            except BaseException as e:  # noqa: BLE001 - already ending; the requests carry the error
                b._fail_all(e)


def _choice_events(session, reqs: list[Request], batcher, cancel, n_prompt: int) -> Iterator[tuple]:
    """:func:`batch_events` as a stream's chunks need them: ``("piece", choice, text)`` and ``("end", choice,
    finish_reason, extra)``, ``extra`` None except on the last choice to end, where it carries ``usage`` and
    ``epqlab`` (once per call); raises the error that ended a choice."""
    left = len(reqs)
    for kind, c, value in batch_events(session, reqs, batcher, cancel):
        if kind == "piece":
            yield "piece", c, value
            continue
        left -= 1
        if reqs[c].error is not None:
            raise reqs[c].error
        if left:
            yield "end", c, reqs[c].result.finish_reason, None
        else:
            gens, usage, st = _batch_result(reqs, n_prompt)
            yield "end", c, gens[c].finish_reason, {"usage": usage, "epqlab": st}


def _batch_result(reqs: list[Request], n_prompt: int) -> tuple[list, dict, dict]:
    """(generations, usage, epqlab stats) of finished requests (``n_prompt``: prompt tokens, each prompt
    counted once however many choices it has); raises the first request's error."""
    for r in reqs:
        if r.error is not None:
            raise r.error
    gens = [r.result for r in reqs]
    usage = _usage(n_prompt, sum(len(g.tokens) for g in gens))
    # one choice: its figures at the top, as a single generation's run stats are; every choice's under "choices"
    top = dict(gens[0].stats) if len(gens) == 1 else {"n_prompt": n_prompt}
    top.update(n_gen=usage["completion_tokens"], choices=[g.stats for g in gens])
    return gens, usage, clean_json(top)


def create_completion(session, prompt, *, max_tokens: int | None = 16, temperature: float = 0.8,
                      top_p: float = 0.95, top_k: int = 40, min_p: float = 0.05, repeat_penalty: float = 1.0,
                      stop: str | Sequence[str] | None = None, seed: int | None = None, stream: bool = False,
                      model: str | None = None, n: int = 1, batcher: Batcher | None = None,
                      cancel: threading.Event | None = None) -> dict | Iterator[dict]:
    """:meth:`epqlab.Session.create_completion` (see there). ``batcher``: a background
    :class:`~epqlab.engine.batch.Batcher` to decode on (the server's continuous batching); ``cancel``: an
    event that, once set, cancels the request's sequences (a client that went away)."""
    prompts = prompt_list(session, prompt)
    n = _check_n(n)
    cid, created, name = f"cmpl-{uuid.uuid4()}", int(time.time()), model or session.model_name
    sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, repeat_penalty=repeat_penalty)

    def chunk(text: str, reason, index: int = 0, extra=None) -> dict:
        d = {"id": cid, "object": "text_completion", "created": created, "model": name,
             "choices": [{"text": text, "index": index, "logprobs": None, "finish_reason": reason}]}
        if extra:
            d.update(extra)
        return d

    if len(prompts) == 1 and n == 1 and batcher is None:
        return _single_completion(session, prompts[0], max_tokens, sampling, _stop_list(stop), seed, stream, chunk)
    reqs = _requests(session, prompts, n, max_tokens, _stop_list(stop), seed, sampling, queue.SimpleQueue())
    n_prompt = sum(len(t) for t in prompts)
    if stream:
        def chunks():
            for kind, c, *rest in _choice_events(session, reqs, batcher, cancel, n_prompt):
                yield chunk(rest[0], None, c) if kind == "piece" else chunk("", rest[0], c, rest[1])
        return chunks()
    for _ in batch_events(session, reqs, batcher, cancel):
        pass
    gens, usage, st = _batch_result(reqs, n_prompt)
    return {"id": cid, "object": "text_completion", "created": created, "model": name,
            "choices": [{"text": g.text, "index": c, "logprobs": None, "finish_reason": g.finish_reason}
                        for c, g in enumerate(gens)],
            "usage": usage, "epqlab": st}


def _single_completion(session, toks, max_tokens, sampling, stops, seed, stream, chunk):
    """One prompt, one choice, in-process: a :class:`~epqlab.engine.generation.Stream` that keeps the KV cache
    of the previous call when it prefixes this prompt."""
    m = _max_tokens(session, max_tokens, len(toks))
    st = session.stream(toks, m, sampling["temperature"], seed, stops, top_k=sampling["top_k"],
                        top_p=sampling["top_p"], min_p=sampling["min_p"], repeat_penalty=sampling["repeat_penalty"],
                        reuse_kv=True)
    if stream:
        def chunks():
            try:  # no lock held across yields: a consumer may resume it from another thread
                for piece in st:
                    yield chunk(piece, None)
            finally:
                st.close()
            g = st.result
            yield chunk("", g.finish_reason, 0, {"usage": _usage(len(toks), len(g.tokens)), "epqlab": clean_json(g.stats)})
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
        try:
            m["content"].encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(f"messages[{i}]: content is not valid Unicode at position {e.start} (a lone "
                             "surrogate): remove it or pair it") from None
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def create_chat_completion(session, messages: Sequence[dict], *, max_tokens: int | None = None,
                           temperature: float = 0.2, top_p: float = 0.95, top_k: int = 40, min_p: float = 0.05,
                           repeat_penalty: float = 1.0, stop: str | Sequence[str] | None = None,
                           seed: int | None = None, stream: bool = False, model: str | None = None, n: int = 1,
                           batcher: Batcher | None = None, cancel: threading.Event | None = None) -> dict | Iterator[dict]:
    """:meth:`epqlab.Session.create_chat_completion` (see there); ``batcher``, ``cancel`` as
    :func:`create_completion`."""
    msgs = check_messages(messages)
    prompt = session.chat_prompt(msgs)
    toks = session.tokenize(prompt, add_special=False)
    n = _check_n(n)
    cid, created, name = f"chatcmpl-{uuid.uuid4()}", int(time.time()), model or session.model_name
    sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, repeat_penalty=repeat_penalty)

    def chunk(delta: dict, reason, index: int = 0, extra=None) -> dict:
        d = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": name,
             "choices": [{"index": index, "delta": delta, "logprobs": None, "finish_reason": reason}]}
        if extra:
            d.update(extra)
        return d

    def message(c: int, g) -> dict:
        return {"index": c, "message": {"role": "assistant", "content": g.text}, "logprobs": None,
                "finish_reason": g.finish_reason}

    if n == 1 and batcher is None:
        m = _max_tokens(session, max_tokens, len(toks))
        st = session.stream(toks, m, temperature, seed, _stop_list(stop), top_k=top_k, top_p=top_p, min_p=min_p,
                            repeat_penalty=repeat_penalty, reuse_kv=True)
        if stream:
            def chunks():
                yield chunk({"role": "assistant"}, None)
                try:
                    for piece in st:
                        yield chunk({"content": piece}, None)
                finally:
                    st.close()
                g = st.result
                yield chunk({}, g.finish_reason, 0, {"usage": _usage(len(toks), len(g.tokens)), "epqlab": clean_json(g.stats)})
            return chunks()
        with session.decoder.lock:
            for _ in st:
                pass
        g = st.result
        return {"id": cid, "object": "chat.completion", "created": created, "model": name,
                "choices": [message(0, g)], "usage": _usage(len(toks), len(g.tokens)), "epqlab": clean_json(g.stats)}
    reqs = _requests(session, [toks], n, max_tokens, _stop_list(stop), seed, sampling, queue.SimpleQueue())
    n_prompt = len(toks)
    if stream:
        def chunks():
            started = set()
            for kind, c, *rest in _choice_events(session, reqs, batcher, cancel, n_prompt):
                if c not in started:
                    started.add(c)
                    yield chunk({"role": "assistant"}, None, c)
                yield chunk({"content": rest[0]}, None, c) if kind == "piece" else chunk({}, rest[0], c, rest[1])
        return chunks()
    for _ in batch_events(session, reqs, batcher, cancel):
        pass
    gens, usage, st = _batch_result(reqs, n_prompt)
    return {"id": cid, "object": "chat.completion", "created": created, "model": name,
            "choices": [message(c, g) for c, g in enumerate(gens)], "usage": usage, "epqlab": st}


__all__ = ["create_completion", "create_chat_completion", "check_messages", "prompt_list", "batch_events"]
