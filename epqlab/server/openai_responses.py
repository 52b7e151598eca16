"""OpenAI's Responses API (https://platform.openai.com/docs/api-reference/responses/create): ``POST /v1/responses``,
translated to one OpenAI chat request (:mod:`.translate`) and answered in the Responses API's shapes; ``GET
/v1/responses/{id}`` (the stored response object) and ``DELETE /v1/responses/{id}`` (``{"id", "object":
"response.deleted", "deleted": true}``), a 404 for an id the store does not hold (unknown, evicted, deleted, or made
with ``store: false``); errors in OpenAI's error shape.

The request: ``input`` (a string, or items: messages with text parts, ``function_call``, ``function_call_output``;
``reasoning`` items are dropped: none is produced here), ``instructions`` (a system message first; not carried over
by ``previous_response_id``, OpenAI's rule), ``tools`` (``function`` tools only), ``tool_choice`` (``auto`` | ``none``
| ``required`` | ``{"type": "function", "name"}``), ``parallel_tool_calls`` (false: at most one call),
``max_output_tokens`` (>= 1: OpenAI's service refuses values below 16, but that floor is its own, not the API
reference's, and a smaller answer costs nothing here), ``temperature`` (0..2), ``top_p``, ``text.format`` (``text`` | ``json_object`` |
``json_schema``: the structured-output grammar, :mod:`epqlab.requests.structured`), ``stream``,
``previous_response_id`` and ``store`` (default true: the bounded in-memory store, :mod:`.response_store`; an id it
does not hold is a 400), ``metadata`` (echoed). A field this server cannot honour is refused by name
(:data:`REFUSED`); a few that change nothing here are accepted (:data:`IGNORED`).

The answer: a ``response`` object whose ``output`` is a ``message`` item (``output_text``; left out when the reply
is only tool calls) and one ``function_call`` item per call; ``status`` ``completed``, or ``incomplete`` with
``incomplete_details.reason`` ``max_output_tokens``; ``usage``. Streamed, the documented events
(https://platform.openai.com/docs/api-reference/responses-streaming): ``response.created``,
``response.in_progress``, per item ``response.output_item.added`` / ``.done``, for a message
``response.content_part.added`` / ``.done`` and ``response.output_text.delta`` / ``.done``, for a call
``response.function_call_arguments.delta`` / ``.done``, then ``response.completed`` (or ``response.incomplete``).
"""
# no `from __future__ import annotations`: FastAPI reads the endpoint annotations at runtime

import time
import uuid

from fastapi import Request

from .context import Served
from .fields import check_names
from .http_errors import error
from .response_store import ResponseStore
from .streaming import NAMED, run
from .translate import (assistant, chat_kwargs, function_tools, json_body, number, reply_events, reply_of, start,
                        text_parts, tool_call, tool_result)

RULE = " (OpenAI's Responses API: https://platform.openai.com/docs/api-reference/responses/create)"
OWN = ("model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls", "max_output_tokens",
       "temperature", "top_p", "text", "stream", "previous_response_id", "store", "metadata")
IGNORED = {"user": "an end-user id for OpenAI's abuse monitoring: nothing here uses it",
           "safety_identifier": "an end-user id for OpenAI's abuse monitoring: nothing here uses it",
           "service_tier": "OpenAI's processing tiers: there is one here",
           "prompt_cache_key": "OpenAI's prompt-cache routing: this server's cache is --prompt-cache, per sequence",
           "prompt_cache_retention": "OpenAI's prompt-cache lifetime: this server's cache is --prompt-cache",
           "reasoning": "a reasoning model's effort and summaries on OpenAI: nothing here sets a reasoning budget",
           "include": "extra outputs of OpenAI's hosted tools and reasoning: none is produced here",
           "max_tool_calls": "a limit on OpenAI's built-in tools' calls: none is offered here",
           "stream_options": "OpenAI's stream obfuscation: not needed here"}
REFUSED = {"truncation": ((None, "disabled"), "dropping the conversation's start when it overflows is not done here: "
                                              "a prompt that does not fit is a 400 naming --n-ctx"),
           "background": ((None, False), "background responses are not offered: send the request and wait"),
           "conversation": ((None,), "OpenAI's conversations are not stored here: use previous_response_id or "
                                     "send the whole conversation"),
           "prompt": ((None,), "OpenAI's stored prompt templates are not offered: send input and instructions"),
           "top_logprobs": ((None, 0), "log-probabilities are offered on /v1/chat/completions (logprobs)")}
TEXT_KINDS = ("input_text", "output_text")


def chat_input(inp) -> list[dict]:
    """``input`` as OpenAI chat messages (module docstring); consecutive ``function_call`` items join the assistant
    message before them, as chat writes parallel calls. ValueError naming a bad item."""
    if isinstance(inp, str):
        return [{"role": "user", "content": inp}]
    if not isinstance(inp, list) or not inp:
        raise ValueError(f"input must be a string or a non-empty list of items{RULE}")
    out: list[dict] = []
    for i, it in enumerate(inp):
        typ, where = it.get("type", "message") if isinstance(it, dict) else None, f"input[{i}]"
        if typ == "message":
            role = it.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise ValueError(f"{where}: role must be user, assistant, system or developer, got {role!r}")
            text = text_parts(it.get("content"), f"{where}.content", TEXT_KINDS)
            out.append(assistant(text, []) if role == "assistant" else {"role": role, "content": text})
        elif typ == "function_call":
            call = tool_call(it.get("call_id"), it.get("name"), it.get("arguments", "{}"), where)
            if out and out[-1]["role"] == "assistant":
                out[-1] = assistant(out[-1]["content"], out[-1].get("tool_calls", []) + [call])
            else:
                out.append(assistant(None, [call]))
        elif typ == "function_call_output":
            out.append(tool_result(it.get("call_id"), text_parts(it.get("output"), f"{where}.output", TEXT_KINDS),
                                   where))
        elif typ != "reasoning":
            raise ValueError(f"{where}: items of type {typ!r} are not accepted (message, function_call, "
                             f"function_call_output){RULE}")
    return out


def chat_tools(body: dict) -> tuple[list, object]:
    """``(tools, tool_choice)`` in OpenAI chat's terms. ValueError naming a tool that is not a function, or a bad
    choice."""
    out = function_tools(body.get("tools"), ("function",), "parameters",
                         "tools are not offered here (OpenAI's hosted tools): only function tools")
    tc = body.get("tool_choice")
    if isinstance(tc, dict):
        if tc.get("type") != "function" or not isinstance(tc.get("name"), str):
            raise ValueError(f'tool_choice must be "auto", "none", "required" or {{"type": "function", "name": ...}}'
                             f"{RULE}, got {tc!r}")
        tc = {"type": "function", "function": {"name": tc["name"]}}
    return out, tc


def response_format(text) -> dict | None:
    """``text.format`` as chat's ``response_format``. ValueError naming a malformed one."""
    if text is None:
        return None
    fmt = text.get("format") if isinstance(text, dict) else None
    if not isinstance(text, dict) or set(text) - {"format", "verbosity"} or not isinstance(fmt, (dict, type(None))):
        raise ValueError(f'text must be {{"format": {{"type": "text" | "json_object" | "json_schema", ...}}}}{RULE}')
    if fmt is None or fmt.get("type") in ("text", "json_object"):
        return fmt
    if fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise ValueError(f'text.format must be {{"type": "json_schema", "name": ..., "schema": {{...}}}}, '
                         f'{{"type": "json_object"}} or {{"type": "text"}}{RULE}')
    return {"type": "json_schema", "json_schema": {"name": fmt.get("name"), "schema": fmt["schema"]}}


def _message_item(mid: str, text: str, status: str) -> dict:
    return {"type": "message", "id": mid, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}] if text is not None else []}


def _call_item(call, status: str = "completed", with_args: bool = True) -> dict:
    cid, name, args = call
    return {"type": "function_call", "id": "fc_" + cid.removeprefix("call_"), "call_id": cid, "name": name,
            "arguments": args if with_args else "", "status": status}


def _status(reply) -> str:
    return "incomplete" if reply.finish == "length" and not reply.calls else "completed"


def _output(reply, mid: str) -> list[dict]:
    msg = [_message_item(mid, reply.text, _status(reply))] if reply.text or not reply.calls else []
    return msg + [_call_item(c) for c in reply.calls]


def _finished(base: dict, reply, mid: str) -> dict:
    st = _status(reply)
    return {**base, "status": st, "output": _output(reply, mid),
            "incomplete_details": {"reason": "max_output_tokens"} if st == "incomplete" else None,
            "usage": {"input_tokens": reply.input_tokens, "input_tokens_details": {"cached_tokens": reply.cached_tokens},
                      "output_tokens": reply.output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                      "total_tokens": reply.input_tokens + reply.output_tokens}}


def response_events(events, base: dict, mid: str, done):
    """The documented stream events (module docstring) of :func:`~.translate.reply_events` ``events``. ``base``: the
    response without output; ``done(reply, response)``: called with the reply and the finished response object
    before the last event (stores them)."""
    seq, idx, text, state = 0, -1, "", None  # state: the message item's, None (not added), "open", "closed"

    def ev(typ, **kw):
        nonlocal seq
        seq += 1
        return {"type": typ, "sequence_number": seq - 1, **kw}

    def close_message(status):
        at = dict(item_id=mid, output_index=idx, content_index=0)
        yield ev("response.output_text.done", **at, text=text, logprobs=[])
        yield ev("response.content_part.done", **at, part=_message_item(mid, text, status)["content"][0])
        yield ev("response.output_item.done", output_index=idx, item=_message_item(mid, text, status))

    def open_message():
        yield ev("response.output_item.added", output_index=idx, item=_message_item(mid, None, "in_progress"))
        yield ev("response.content_part.added", item_id=mid, output_index=idx, content_index=0,
                 part={"type": "output_text", "text": "", "annotations": []})

    yield ev("response.created", response={**base, "status": "in_progress", "output": []})
    yield ev("response.in_progress", response={**base, "status": "in_progress", "output": []})
    try:
        for e in events:
            reply = e[1] if e[0] == "end" else None
            # the message item opens with the first text, or at the end of a reply with neither text nor calls
            if state is None and (e[0] == "text" or (reply is not None and not reply.calls)):
                idx, state = idx + 1, "open"
                yield from open_message()
            if e[0] == "text":
                text += e[1]
                yield ev("response.output_text.delta", item_id=mid, output_index=idx, content_index=0, delta=e[1],
                         logprobs=[])
                continue
            if state == "open":
                yield from close_message("completed" if reply is None else _status(reply))
                state = "closed"
            if e[0] == "call":
                idx += 1
                item = _call_item(e[1:])
                yield ev("response.output_item.added", output_index=idx, item=_call_item(e[1:], "in_progress", False))
                at = dict(item_id=item["id"], output_index=idx)
                yield ev("response.function_call_arguments.delta", **at, delta=item["arguments"])
                yield ev("response.function_call_arguments.done", **at, name=item["name"], arguments=item["arguments"])
                yield ev("response.output_item.done", output_index=idx, item=item)
                continue
            final = _finished(base, reply, mid)
            done(reply, final)
            yield ev(f"response.{final['status']}", response=final)
    finally:
        events.close()


def add_routes(app, served: Served, store: ResponseStore) -> None:
    @app.post("/v1/responses")
    async def responses(request: Request):
        try:
            body = await json_body(request)
            check_names(body, OWN, IGNORED, REFUSED)
            stream, keep, prev = body.get("stream", False), body.get("store", True), body.get("previous_response_id")
            if not isinstance(stream, bool) or not isinstance(keep, bool):
                raise ValueError("stream and store must be true or false")
            instructions, metadata = body.get("instructions"), body.get("metadata")
            if instructions is not None and not isinstance(instructions, str):
                raise ValueError("instructions must be a string")
            if metadata is not None and not isinstance(metadata, dict):
                raise ValueError("metadata must be an object of strings")
            history = store.conversation(prev) if prev is not None else []
            turn = history + chat_input(body.get("input"))
            msgs = ([{"role": "system", "content": instructions}] if instructions else []) + turn
            tools, choice = chat_tools(body)
            parallel = body.get("parallel_tool_calls")
            kw = chat_kwargs(served, max_tokens=number(body, "max_output_tokens", 1, integer=True, rule=RULE),
                             temperature=number(body, "temperature", 0, 2, default=1.0, rule=RULE),
                             top_p=number(body, "top_p", 0, 1, default=1.0, rule=RULE), tools=tools,
                             tool_choice=choice, parallel_tool_calls=parallel,
                             response_format=response_format(body.get("text")), stream=stream)
        except ValueError as e:
            param = "previous_response_id" if "previous_response_id" in str(e) else None
            return error(400, str(e), param=param)
        rid, mid = f"resp_{uuid.uuid4().hex}", f"msg_{uuid.uuid4().hex}"
        base = {"id": rid, "object": "response", "created_at": int(time.time()), "status": "in_progress",
                "error": None, "incomplete_details": None, "instructions": instructions,
                "max_output_tokens": body.get("max_output_tokens"), "model": served.name, "output": [],
                "parallel_tool_calls": parallel is not False, "previous_response_id": prev,
                "reasoning": {"effort": None, "summary": None}, "store": keep,
                "temperature": kw["temperature"], "text": body.get("text") or {"format": {"type": "text"}},
                "tool_choice": body.get("tool_choice", "auto"), "tools": body.get("tools") or [],
                "top_p": kw["top_p"], "truncation": "disabled", "usage": None, "metadata": metadata or {}}

        def done(reply, final):
            if keep:
                calls = [tool_call(*c, where="output") for c in reply.calls]
                store.put(rid, turn + [assistant(reply.text, calls)], final)

        def make(cancel):
            it = start(served, msgs, kw, stream, cancel)
            if stream:
                return response_events(reply_events(it), base, mid, done)
            reply = reply_of(it)
            final = _finished(base, reply, mid)
            done(reply, final)
            return final

        return await run(served, make, stream, request, NAMED)

    def unknown(rid: str):
        return error(404, f"Response with id '{rid}' not found: this server keeps the last {store.keep} responses "
                          "made with store=true in memory, since it started (fewer when their conversations are long), "
                          "until they are deleted", param="response_id")

    @app.get("/v1/responses/{rid}")
    async def retrieve(rid: str):
        got = store.response(rid)
        return got if got is not None else unknown(rid)

    @app.delete("/v1/responses/{rid}")
    async def delete(rid: str):
        if not store.delete(rid):
            return unknown(rid)
        return {"id": rid, "object": "response.deleted", "deleted": True}
