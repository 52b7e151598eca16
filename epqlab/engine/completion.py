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

Sampling is llama.cpp's chain with llama-cpp-python's defaults (:class:`epqlab.engine.sampling.Sampler`:
``frequency_penalty``, ``presence_penalty``, ``logit_bias``, ``typical_p``, ``mirostat_*`` and a GBNF
``grammar`` too), and, as in llama-cpp-python, the KV cache of the previous call is kept when its tokens are
a prefix of the new prompt (a chat's next turn): only the new tokens are decoded.

Beyond plain text: ``response_format`` / ``grammar`` constrain the output (:mod:`epqlab.engine.structured`);
``tools`` / ``tool_choice`` on chat (:mod:`epqlab.engine.tools`); ``logprobs`` (completions: an int, the
alternatives per token; chat: ``logprobs=True`` and ``top_logprobs``) in OpenAI's shapes, from the
log-softmax of the engine's raw logits at each step (what llama-cpp-python reports), streamed with the
chunk that carries the tokens' text; ``echo`` (completions) puts the prompt's text before the completion.
"""
from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator, Sequence

from .batch import Batcher
from .completion_run import _check_n, _stop_list, batch_events, choice_events, prompt_list, run_all, sampling_args
from .sampling import MAX_LOGPROBS
from .structured import request_grammar
from .tools import StreamSplitter, chat_prompt, check_tools, forced_grammar, parse_reply

_CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")


def _refuse(**fields) -> None:
    """ValueError for llama-cpp-python / OpenAI fields set to something epqlab does not do (never ignored)."""
    why = {"suffix": "fill-in-the-middle (suffix) is not offered: put the text in the prompt",
           "best_of": "best_of > 1 (server-side choice by likelihood) is not offered: ask for n choices instead"}
    for k, v in fields.items():
        if v not in (None, "", 1, False):
            raise ValueError(f"{k}={v!r}: {why[k]}")


def _n_logprobs(v, name: str) -> int | None:
    if v is None or v is False:
        return None
    if v is True:
        return 0
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_LOGPROBS:
        raise ValueError(f"{name} must be an integer in 0..{MAX_LOGPROBS}, got {v!r}")
    return v


def _piece(session, tok: int) -> bytes:
    return session.decoder.piece(tok)


def _completion_logprobs(session, recs: list, offset0: int, text_len: int | None) -> dict:
    """OpenAI's completions ``logprobs`` object of ``recs`` (tokens whose text starts before ``text_len``)."""
    out = {"tokens": [], "text_offset": [], "token_logprobs": [], "top_logprobs": []}
    off = offset0
    for tok, lp, top in recs:
        s = _piece(session, tok).decode("utf-8", "replace")
        if text_len is not None and off - offset0 >= text_len:
            break
        out["tokens"].append(s)
        out["text_offset"].append(off)
        out["token_logprobs"].append(lp)
        if top:  # as llama-cpp-python: the k most likely, most likely first, and the chosen token
            d = {_piece(session, t).decode("utf-8", "replace"): v for t, v in top}
            d.setdefault(s, lp)
            out["top_logprobs"].append(d)
        else:
            out["top_logprobs"].append(None)
        off += len(s)
    return out


def _chat_logprobs(session, recs: list, text_len: int | None) -> dict:
    """OpenAI's chat ``logprobs`` object (``content``: token, logprob, bytes, top_logprobs)."""
    def entry(t, v):
        b = _piece(session, t)
        return {"token": b.decode("utf-8", "replace"), "logprob": v, "bytes": list(b)}

    content, off = [], 0
    for tok, lp, top in recs:
        if text_len is not None and off >= text_len:
            break
        e = entry(tok, lp)
        e["top_logprobs"] = [entry(t, v) for t, v in top]
        content.append(e)
        off += len(e["token"])
    return {"content": content, "refusal": None}


def create_completion(session, prompt, *, max_tokens: int | None = 16, temperature: float = 0.8,
                      top_p: float = 0.95, top_k: int = 40, min_p: float = 0.05, repeat_penalty: float = 1.0,
                      stop: str | Sequence[str] | None = None, seed: int | None = None, stream: bool = False,
                      model: str | None = None, n: int = 1, frequency_penalty: float = 0.0,
                      presence_penalty: float = 0.0, typical_p: float = 1.0, logit_bias: dict | None = None,
                      mirostat_mode: int = 0, mirostat_tau: float = 5.0, mirostat_eta: float = 0.1,
                      grammar=None, response_format=None, logprobs: int | None = None, echo: bool = False,
                      suffix: str | None = None, best_of: int | None = None, batcher: Batcher | None = None,
                      cancel: threading.Event | None = None, strict_context: bool = False) -> dict | Iterator[dict]:
    """:meth:`epqlab.Session.create_completion` (see there). ``batcher``: a background
    :class:`~epqlab.engine.batch.Batcher` to decode on (the server's continuous batching); ``cancel``: an
    event that, once set, cancels the request's sequences (a client that went away); ``strict_context``:
    refuse a ``max_tokens`` that does not fit instead of clamping it (the server)."""
    _refuse(suffix=suffix, best_of=best_of)
    prompts = prompt_list(session, prompt)
    n = _check_n(n)
    nlp = _n_logprobs(logprobs, "logprobs")
    if echo is not False and echo is not True:
        raise ValueError(f"echo must be true or false, got {echo!r}")
    if echo and nlp is not None:
        raise ValueError("echo with logprobs needs the prompt tokens' log-probabilities, which epqlab does not "
                         "compute (the batched prefill keeps only the last logits row): drop one of them")
    sampling = sampling_args(session, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                             repeat_penalty=repeat_penalty, frequency_penalty=frequency_penalty,
                             presence_penalty=presence_penalty, typical_p=typical_p, logit_bias=logit_bias,
                             mirostat_mode=mirostat_mode, mirostat_tau=mirostat_tau, mirostat_eta=mirostat_eta,
                             grammar=request_grammar(response_format, grammar), n_logprobs=nlp)
    cid, created, name = f"cmpl-{uuid.uuid4()}", int(time.time()), model or session.model_name
    texts = [(prompt if isinstance(prompt, str) and len(prompts) == 1 else session.detokenize(t)) if echo else ""
             for t in prompts]
    head = lambda c: texts[c // n]

    def chunk(text: str, reason, index: int = 0, extra=None, lp=None) -> dict:
        d = {"id": cid, "object": "text_completion", "created": created, "model": name,
             "choices": [{"text": text, "index": index, "logprobs": lp, "finish_reason": reason}]}
        if extra:
            d.update(extra)
        return d

    events = choice_events(session, prompts, n, max_tokens, _stop_list(stop), seed, sampling, batcher, cancel,
                           strict_context)
    if stream:
        def chunks():
            started, off = set(), {}
            for kind, c, *rest in events:
                if c not in started:
                    started.add(c)
                    off[c] = len(head(c))
                    if head(c):
                        yield chunk(head(c), None, c)
                if kind == "piece":
                    text, recs = rest
                    lp = None if recs is None else _completion_logprobs(session, recs, off[c], None)
                    off[c] += len(text)
                    yield chunk(text, None, c, lp=lp)
                else:
                    yield chunk("", rest[0].finish_reason, c, rest[1])
        return chunks()
    gens, extra = run_all(session, events, batcher is None)
    return {"id": cid, "object": "text_completion", "created": created, "model": name,
            "choices": [{"text": head(c) + g.text, "index": c,
                         "logprobs": None if recs is None else _completion_logprobs(session, recs, 0, len(g.text)),
                         "finish_reason": g.finish_reason} for c, (g, recs) in enumerate(gens)], **extra}


def _text_parts(parts: list, i: int) -> str:
    """OpenAI content parts that are all ``{"type": "text", "text": str}``, joined with newlines as llama.cpp's
    server joins them for a template that takes string content (common/chat.cpp, ``to_json_oaicompat``).
    ValueError naming a part of another type (images, audio: a text model) or a malformed one."""
    texts = []
    for j, part in enumerate(parts):
        typ = part.get("type") if isinstance(part, dict) else None
        if typ != "text":
            what = f"type {typ!r}" if isinstance(part, dict) else type(part).__name__
            raise ValueError(f'messages[{i}].content[{j}]: only text parts {{"type": "text", "text": ...}} are supported '
                             f"(a text model), got {what}")
        if not isinstance(part.get("text"), str):
            raise ValueError(f'messages[{i}].content[{j}]: a text part needs "text": a string')
        texts.append(part["text"])
    return "\n".join(texts)


def check_messages(messages) -> list[dict]:
    """``messages`` as OpenAI chat messages: ``{"role", "content": str}`` (or text-only content parts, joined:
    :func:`_text_parts`), an assistant's ``content`` may be None with ``tool_calls``, a ``tool`` message's ``tool_call_id`` / ``name`` are kept. ValueError naming the
    first bad one."""
    if isinstance(messages, (str, bytes, dict)) or not isinstance(messages, Sequence):
        raise ValueError('messages must be a list of {"role": ..., "content": ...} dicts')
    if not messages:
        raise ValueError("messages is empty: pass at least one message")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m:
            raise ValueError(f'messages[{i}] must be a dict with "role" and "content", got {m!r}')
        if m["role"] not in _CHAT_ROLES:
            raise ValueError(f"messages[{i}]: unknown role {m['role']!r}; use one of {', '.join(_CHAT_ROLES)}")
        calls = m.get("tool_calls")
        if calls is not None:
            if m["role"] != "assistant" or not isinstance(calls, list) or not all(
                    isinstance(c, dict) and isinstance(c.get("function"), dict)
                    and isinstance(c["function"].get("name"), str) for c in calls):
                raise ValueError(f'messages[{i}]: tool_calls belong to an assistant message, as a list of '
                                 '{"id", "type": "function", "function": {"name", "arguments"}}')
        content = m.get("content")
        if isinstance(content, list):
            content = _text_parts(content, i)
        if content is None and calls:
            content = None
        elif not isinstance(content, str):
            raise ValueError(f'messages[{i}]: content must be a string or a list of {{"type": "text", "text": ...}} '
                             f"parts, got {type(content).__name__}")
        else:
            try:
                content.encode("utf-8")
            except UnicodeEncodeError as e:
                raise ValueError(f"messages[{i}]: content is not valid Unicode at position {e.start} (a lone "
                                 "surrogate): remove it or pair it") from None
        d = {"role": m["role"], "content": content}
        if calls:
            d["tool_calls"] = calls
        for k in ("tool_call_id", "name"):
            if isinstance(m.get(k), str):
                d[k] = m[k]
        out.append(d)
    return out


def create_chat_completion(session, messages: Sequence[dict], *, max_tokens: int | None = None,
                           temperature: float = 0.2, top_p: float = 0.95, top_k: int = 40, min_p: float = 0.05,
                           repeat_penalty: float = 1.0, stop: str | Sequence[str] | None = None,
                           seed: int | None = None, stream: bool = False, model: str | None = None, n: int = 1,
                           frequency_penalty: float = 0.0, presence_penalty: float = 0.0, typical_p: float = 1.0,
                           logit_bias: dict | None = None, mirostat_mode: int = 0, mirostat_tau: float = 5.0,
                           mirostat_eta: float = 0.1, grammar=None, response_format=None, logprobs: bool | None = None,
                           top_logprobs: int | None = None, tools: list | None = None, tool_choice=None,
                           functions: list | None = None, function_call=None, batcher: Batcher | None = None,
                           cancel: threading.Event | None = None, strict_context: bool = False) -> dict | Iterator[dict]:
    """:meth:`epqlab.Session.create_chat_completion` (see there); ``batcher``, ``cancel``, ``strict_context``
    as :func:`create_completion`."""
    msgs = check_messages(messages)
    fns, choice = check_tools(tools, tool_choice, functions, function_call)
    calling = bool(fns) and choice != "none"
    forced = calling and choice != "auto"
    g = request_grammar(response_format, grammar)
    if forced:
        if g is not None:
            raise ValueError("a forced tool call has its own grammar: drop response_format / grammar")
        g = forced_grammar(fns, choice)
    if logprobs not in (None, False, True):
        raise ValueError(f"logprobs must be true or false on chat completions, got {logprobs!r}")
    if top_logprobs not in (None, 0) and not logprobs:
        raise ValueError("top_logprobs needs logprobs=true")
    nlp = _n_logprobs(top_logprobs or 0, "top_logprobs") if logprobs else None
    toks = session.tokenize(chat_prompt(session, msgs, fns, choice), add_special=False)
    n = _check_n(n)
    sampling = sampling_args(session, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                             repeat_penalty=repeat_penalty, frequency_penalty=frequency_penalty,
                             presence_penalty=presence_penalty, typical_p=typical_p, logit_bias=logit_bias,
                             mirostat_mode=mirostat_mode, mirostat_tau=mirostat_tau, mirostat_eta=mirostat_eta,
                             grammar=g, n_logprobs=nlp)
    cid, created, name = f"chatcmpl-{uuid.uuid4()}", int(time.time()), model or session.model_name

    def chunk(delta: dict, reason, index: int = 0, extra=None, lp=None) -> dict:
        d = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": name,
             "choices": [{"index": index, "delta": delta, "logprobs": lp, "finish_reason": reason}]}
        if extra:
            d.update(extra)
        return d

    def message(c: int, gen, recs) -> dict:
        content, calls = parse_reply(gen.text, fns) if calling else (gen.text, [])
        msg = {"role": "assistant", "content": content}
        if calls:
            msg["tool_calls"] = calls
        elif forced:  # the grammar admits only the call: cut short (max_tokens, a stop), it is no call and no text
            msg.update(content=None, tool_calls=[])
        return {"index": c, "message": msg,
                "logprobs": None if recs is None else _chat_logprobs(session, recs, len(gen.text)),
                "finish_reason": "tool_calls" if calls else gen.finish_reason}

    events = choice_events(session, [toks], n, max_tokens, _stop_list(stop), seed, sampling, batcher, cancel,
                           strict_context)
    if stream:
        def chunks():
            split: dict[int, StreamSplitter] = {}
            for kind, c, *rest in events:
                if c not in split:
                    split[c] = StreamSplitter()
                    yield chunk({"role": "assistant"}, None, c)
                if kind == "piece":
                    text, recs = rest
                    out = split[c].feed(text) if calling else text
                    lp = None if recs is None else _chat_logprobs(session, recs, None)
                    if out or lp:
                        yield chunk({"content": out}, None, c, lp=lp)
                    continue
                gen, extra = rest[0], rest[1]
                content, calls = parse_reply(split[c].text, fns) if calling else (None, [])
                if not calls and calling and not forced and split[c].rest():
                    yield chunk({"content": split[c].rest()}, None, c)  # held back, and no call after all
                for i, call in enumerate(calls):  # as OpenAI streams them: id and name, then the arguments
                    f = call["function"]
                    yield chunk({"tool_calls": [{"index": i, "id": call["id"], "type": "function",
                                                 "function": {"name": f["name"], "arguments": ""}}]}, None, c)
                    yield chunk({"tool_calls": [{"index": i, "function": {"arguments": f["arguments"]}}]}, None, c)
                yield chunk({}, "tool_calls" if calls else gen.finish_reason, c, extra)
        return chunks()
    gens, extra = run_all(session, events, batcher is None)
    return {"id": cid, "object": "chat.completion", "created": created, "model": name,
            "choices": [message(c, gen, recs) for c, (gen, recs) in enumerate(gens)], **extra}


__all__ = ["create_completion", "create_chat_completion", "check_messages", "prompt_list", "batch_events"]
