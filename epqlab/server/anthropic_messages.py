"""Anthropic's Messages API (https://docs.anthropic.com/en/api/messages): ``POST /v1/messages`` and
``POST /v1/messages/count_tokens`` (https://docs.anthropic.com/en/api/messages-count-tokens), translated to one
OpenAI chat request (:mod:`.translate`) and answered in Anthropic's shapes, errors included
(:mod:`.error_shapes`).

The request: ``model`` (any name: the one model answers), ``max_tokens`` (required, >= 1), ``messages`` (``user`` /
``assistant`` turns; content a string or blocks: ``text``, ``tool_use`` in an assistant turn, ``tool_result`` in a
user turn; an earlier turn's ``thinking`` blocks are dropped, as Anthropic's API drops them from the context),
``system`` (a string or text blocks), ``tools`` (client tools: ``name``, ``description``, ``input_schema``),
``tool_choice`` (``auto`` | ``any`` | ``tool`` with ``name`` | ``none``; ``disable_parallel_tool_use``: at most one
call), ``stop_sequences``, ``temperature`` (0..1), ``top_p``, ``top_k``, ``stream``; ``cache_control`` on any block is
ignored (the prompt cache here is automatic, ``--prompt-cache``). Images and documents are refused (a text model), so
are server tools and a last assistant turn (a prefill: the chat template closes every turn it renders).

The answer: ``content`` blocks (``text``, then one ``tool_use`` per call with its ``input`` object), ``stop_reason``
``tool_use`` | ``max_tokens`` | ``stop_sequence`` (with ``stop_sequence``) | ``end_turn``, ``usage`` ``input_tokens`` /
``output_tokens`` / ``cache_read_input_tokens`` (the prompt tokens the prompt cache held: Anthropic's
``input_tokens`` leaves them out, so the two add up to the prompt) / ``cache_creation_input_tokens`` (0). Streamed, the documented events (https://docs.anthropic.com/en/docs/build-with-claude/streaming):
``message_start``, ``ping``, per block ``content_block_start`` / ``content_block_delta`` (``text_delta`` or
``input_json_delta``) / ``content_block_stop``, then ``message_delta`` (``stop_reason``, ``usage``) and
``message_stop``; an error after the first byte is an ``error`` event.
"""
# no `from __future__ import annotations`: FastAPI reads the endpoint annotations at runtime

import asyncio
import json
import uuid

from fastapi import Request

from ..requests.completion import chat_prompt_tokens
from .context import Served
from .fields import check_names
from .http_errors import anthropic
from .streaming import ANTHROPIC, run
from .translate import (assistant, chat_kwargs, function_tools, json_body, number, reply_events, reply_of, start,
                        text_parts, tool_call, tool_result)
from .wording import said

RULE = " (Anthropic's Messages API: https://docs.anthropic.com/en/api/messages)"
OWN = ("model", "messages", "system", "tools", "tool_choice")  # count_tokens takes these; messages takes OWN_CREATE
OWN_CREATE = OWN + ("max_tokens", "stop_sequences", "stream", "temperature", "top_p", "top_k")
IGNORED = {"metadata": "a user id for Anthropic's abuse monitoring: nothing here uses it",
           "service_tier": "Anthropic's capacity tiers: there is one here",
           "thinking": "extended thinking's budget: not applied; the GGUF's chat template decides whether a model "
                       "reasons, and what it writes comes back as text"}
REFUSED = {"mcp_servers": ((None, []), "MCP servers are not reached from here (nothing here reaches the network)"),
           "container": ((None,), "code-execution containers are not offered")}
DROPPED = ("thinking", "redacted_thinking")  # an assistant turn's thinking blocks: dropped, as Anthropic drops them


def _blocks(m: dict, i: int) -> list[dict]:
    """One Anthropic message as OpenAI chat messages (module docstring). ValueError naming a bad block."""
    role, content, where = m.get("role"), m.get("content"), f"messages[{i}]"
    if role not in ("user", "assistant"):
        raise ValueError(f"{where}: role must be \"user\" or \"assistant\" (the system prompt goes in the top-level "
                         f"\"system\" field){RULE}, got {role!r}")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise ValueError(f"{where}.content must be a string or a list of content blocks")
    texts, calls, results = [], [], []
    for j, b in enumerate(content):
        typ, at = b.get("type") if isinstance(b, dict) else None, f"{where}.content[{j}]"
        if typ == "text":
            texts.append(text_parts([b], at))
        elif typ == "tool_use" and role == "assistant":
            if not isinstance(b.get("input", {}), dict):
                raise ValueError(f"{at}: a tool_use block's input must be an object")
            calls.append(tool_call(b.get("id"), b.get("name"), b.get("input", {}), at))
        elif typ == "tool_result" and role == "user":
            text = text_parts(b.get("content") or "", f"{at}.content")
            results.append(tool_result(b.get("tool_use_id"), text, at))
        elif typ in DROPPED and role == "assistant":
            continue
        elif typ in ("image", "document", "search_result"):
            raise ValueError(f"{at}: {typ} blocks are not supported (a text model): send text")
        else:
            raise ValueError(f"{at}: a block of type {typ!r} is not accepted in a {role} turn (text, "
                             f"{'tool_use' if role == 'assistant' else 'tool_result'}){RULE}")
    if role == "assistant":
        return [assistant("\n".join(texts), calls)]
    return results + ([{"role": "user", "content": "\n".join(texts)}] if texts or not results else [])


def chat_messages(body: dict) -> list[dict]:
    """``system`` and ``messages`` as OpenAI chat messages. ValueError naming what is malformed."""
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise ValueError(f"messages must be a non-empty list of {{\"role\", \"content\"}} objects{RULE}")
    out = []
    system = text_parts(body.get("system") or "", "system")
    if system:
        out.append({"role": "system", "content": system})
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise ValueError(f"messages[{i}] must be an object with \"role\" and \"content\"")
        out += _blocks(m, i)
    if msgs[-1].get("role") == "assistant":
        raise ValueError("the last message is an assistant turn (a prefill), which this server cannot continue (the "
                         "chat template closes every turn it renders): end with a user turn")
    return out


def chat_tools(body: dict) -> tuple[list, object, bool | None]:
    """``(tools, tool_choice, parallel_tool_calls)`` in OpenAI chat's terms. ValueError naming a bad tool or
    choice."""
    out = function_tools(body.get("tools"), (None, "custom"), "input_schema", "is a server tool, which is not "
                         'offered here: send client tools ({"name", "description", "input_schema"})')
    tc = body.get("tool_choice")
    if tc is None:
        return out, None, None
    typ = tc.get("type") if isinstance(tc, dict) else None
    choice = {"auto": "auto", "any": "required", "none": "none",
              "tool": {"type": "function", "function": {"name": tc.get("name")}} if typ == "tool" else None}.get(typ)
    if choice is None:
        raise ValueError(f'tool_choice must be {{"type": "auto" | "any" | "tool" | "none"}} ("tool" with "name")'
                         f"{RULE}, got {tc!r}")
    off = tc.get("disable_parallel_tool_use")
    if off is not None and not isinstance(off, bool):
        raise ValueError("tool_choice.disable_parallel_tool_use must be true or false")
    return out, choice, (False if off else None)


def _message(reply, name: str, mid: str) -> dict:
    content = ([{"type": "text", "text": reply.text}] if reply.text else []) + [_tool_use(c) for c in reply.calls]
    return {"id": mid, "type": "message", "role": "assistant", "model": name, "content": content,
            "stop_reason": _stop_reason(reply), "stop_sequence": reply.stop_sequence,
            "usage": _usage(reply)}


def _usage(reply) -> dict:
    """Anthropic's usage: ``input_tokens`` are the prompt tokens decoded, ``cache_read_input_tokens`` those whose KV
    cells the prompt cache held (their sum is the prompt); nothing is charged for writing the cache here
    (``cache_creation_input_tokens`` 0: every finished sequence stays cached by itself, ``--prompt-cache``)."""
    return {"input_tokens": reply.input_tokens - reply.cached_tokens, "output_tokens": reply.output_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": reply.cached_tokens}


def _tool_use(call, with_input: bool = True) -> dict:
    cid, name, args = call
    return {"type": "tool_use", "id": "toolu_" + cid.removeprefix("call_"), "name": name,
            "input": json.loads(args) if with_input else {}}


def _stop_reason(reply) -> str:
    if reply.calls:
        return "tool_use"
    if reply.finish == "length":
        return "max_tokens"
    return "stop_sequence" if reply.stop_sequence is not None else "end_turn"


def message_events(events, head: dict):
    """The documented stream events (module docstring) of :func:`~.translate.reply_events` ``events``; ``head``: the
    message as ``message_start`` carries it (no content yet, the prompt's ``input_tokens``)."""
    yield {"type": "message_start", "message": head}
    yield {"type": "ping"}
    index, text_open = -1, False
    try:
        for ev in events:
            if ev[0] == "text":
                if not text_open:
                    index, text_open = index + 1, True
                    yield {"type": "content_block_start", "index": index, "content_block": {"type": "text", "text": ""}}
                yield {"type": "content_block_delta", "index": index, "delta": {"type": "text_delta", "text": ev[1]}}
                continue
            if text_open:
                text_open = False
                yield {"type": "content_block_stop", "index": index}
            if ev[0] == "call":
                index += 1
                yield {"type": "content_block_start", "index": index, "content_block": _tool_use(ev[1:], False)}
                yield {"type": "content_block_delta", "index": index,
                       "delta": {"type": "input_json_delta", "partial_json": ev[3]}}
                yield {"type": "content_block_stop", "index": index}
                continue
            reply = ev[1]
            yield {"type": "message_delta", "delta": {"stop_reason": _stop_reason(reply),
                                                      "stop_sequence": reply.stop_sequence},
                   "usage": _usage(reply)}
            yield {"type": "message_stop"}
    finally:
        events.close()


def _request(body: dict, own) -> tuple[list, list, object, bool | None]:
    check_names(body, own, IGNORED, REFUSED)
    if not isinstance(body.get("model"), str):
        raise ValueError(f"model: a model name (a string) is required{RULE}")
    return (chat_messages(body), *chat_tools(body))


def add_routes(app, served: Served) -> None:
    session = served.session

    @app.post("/v1/messages")
    async def messages(request: Request):
        try:
            body = await json_body(request)
            msgs, tools, choice, parallel = _request(body, OWN_CREATE)
            if body.get("max_tokens") is None:
                raise ValueError(f"max_tokens: field required (an integer >= 1){RULE}")
            stream = body.get("stream", False)
            if not isinstance(stream, bool):
                raise ValueError("stream must be true or false")
            stops = body.get("stop_sequences")
            if stops is not None and (not isinstance(stops, list) or not all(isinstance(s, str) for s in stops)):
                raise ValueError("stop_sequences must be a list of strings")
            kw = chat_kwargs(served, max_tokens=number(body, "max_tokens", 1, integer=True, rule=RULE),
                             temperature=number(body, "temperature", 0, 1, default=1.0, rule=RULE),
                             top_p=number(body, "top_p", 0, 1, default=1.0, rule=RULE),
                             top_k=number(body, "top_k", 0, integer=True, default=0, rule=RULE), stop=stops,
                             tools=tools, tool_choice=choice, parallel_tool_calls=parallel, stream=stream)
        except ValueError as e:
            return anthropic(400, str(e))
        mid = f"msg_{uuid.uuid4().hex}"

        def make(cancel):
            it = start(served, msgs, kw, stream, cancel)
            if not stream:
                return _message(reply_of(it), served.name, mid)
            n = len(chat_prompt_tokens(session, msgs, tools, choice))
            head = {"id": mid, "type": "message", "role": "assistant", "model": served.name, "content": [],
                    "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": n, "output_tokens": 0}}
            return message_events(reply_events(it), head)

        return await run(served, make, stream, request, ANTHROPIC)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request):
        try:
            msgs, tools, choice, _ = _request(await json_body(request), OWN)
            n = await asyncio.get_running_loop().run_in_executor(
                served.stats_pool, lambda: len(chat_prompt_tokens(session, msgs, tools, choice)))
        except (ValueError, TypeError) as e:
            return anthropic(400, said(e))
        return {"input_tokens": n}
