"""What the Anthropic Messages API (:mod:`.anthropic_messages`) and OpenAI's Responses API (:mod:`.openai_responses`)
share: each becomes one OpenAI chat request on the request surface
(:func:`epqlab.requests.completion.create_chat_completion` on the served batcher, so the three chat APIs share the
batcher, the prompt cache, the limits and the refusals: docs/DESIGN.md §1), and its answer comes back as a
:class:`Reply` (not streamed) or as :func:`reply_events` (streamed), which each API words in its own shapes.

Sampling fields a client leaves out take both APIs' documented defaults, not chat/completions' (llama-cpp-python's):
``temperature`` 1 and no nucleus or top-k filter (https://docs.anthropic.com/en/api/messages,
https://platform.openai.com/docs/api-reference/responses/create); neither API has min-p or a repeat penalty, so
both are off.
"""
from __future__ import annotations

import json
import numbers
from collections.abc import Iterator
from dataclasses import dataclass, field

from ..requests.completion import create_chat_completion
from .context import Served


async def json_body(request) -> dict:
    """The request's body as a JSON object. ValueError naming what is wrong (not JSON, not UTF-8, not an object)."""
    raw = await request.body()
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"the request body is not JSON ({e})") from None
    if not isinstance(body, dict):
        raise ValueError(f"the request body must be a JSON object, got {type(body).__name__}")
    return body


def number(body: dict, name: str, lo, hi=None, *, integer: bool = False, default=None, rule: str = ""):
    """``body[name]`` checked to be a number (an integer with ``integer``) in ``lo``..``hi`` (``hi`` None: no upper
    bound), or ``default`` when absent or null. ValueError naming the field, its range and ``rule`` (the API
    reference that sets it)."""
    v = body.get(name)
    if v is None:
        return default
    kind = numbers.Integral if integer else numbers.Real
    if isinstance(v, bool) or not isinstance(v, kind) or v < lo or (hi is not None and v > hi):
        span = f">= {lo}" if hi is None else f"in {lo}..{hi}"
        raise ValueError(f"{name} must be {'an integer' if integer else 'a number'} {span}{rule}, got {v!r}")
    return v


def text_parts(parts, where: str, kinds: tuple = ("text",)) -> str:
    """A string, or content parts ``[{"type": <one of kinds>, "text": str}, ...]`` joined with newlines (the rule
    of chat/completions' text parts, :func:`epqlab.requests.completion.check_messages`). ValueError naming a part
    of another type (images, files, audio: a text model) or a malformed one."""
    if isinstance(parts, str):
        return parts
    if not isinstance(parts, list):
        raise ValueError(f"{where} must be a string or a list of text parts, got {type(parts).__name__}")
    out = []
    for j, p in enumerate(parts):
        typ = p.get("type") if isinstance(p, dict) else None
        if typ not in kinds or not isinstance(p.get("text"), str):
            raise ValueError(f'{where}[{j}]: only text parts {{"type": "{kinds[0]}", "text": str}} are supported '
                             f"(a text model), got {typ or type(p).__name__!r}")
        out.append(p["text"])
    return "\n".join(out)


def function_tool(name, description, parameters, where: str) -> dict:
    """An OpenAI chat tool (``{"type": "function", "function": {...}}``) of one function. ValueError naming a
    missing name or a schema that is not an object."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"{where}: a tool needs a name (a non-empty string)")
    if parameters is not None and not isinstance(parameters, dict):
        raise ValueError(f"{where}: the tool's input schema must be a JSON schema object")
    f = {"name": name, "parameters": parameters or {"type": "object", "properties": {}}}
    if isinstance(description, str):
        f["description"] = description
    return {"type": "function", "function": f}


def function_tools(tools, accepted: tuple, schema_key: str, refusal: str) -> list[dict]:
    """``tools`` (null or a list) as OpenAI chat tools: each an object whose ``type`` is one of ``accepted`` (None:
    absent), with ``name``, ``description`` and the JSON schema of its arguments under ``schema_key``. ValueError
    for a tools value that is not a list, a tool of another type (its type, then ``refusal``), a tool
    :func:`function_tool` refuses."""
    if not isinstance(tools or [], list):
        raise ValueError(f"tools must be a list of tool objects, got {type(tools).__name__}")
    out = []
    for i, t in enumerate(tools or []):
        typ = t.get("type") if isinstance(t, dict) else type(t).__name__
        if not isinstance(t, dict) or typ not in accepted:
            raise ValueError(f"tools[{i}]: {typ!r} {refusal}")
        out.append(function_tool(t.get("name"), t.get("description"), t.get(schema_key), f"tools[{i}]"))
    return out


def tool_call(call_id, name, arguments, where: str) -> dict:
    """An OpenAI chat assistant's tool call; ``arguments``: a JSON string or an object. ValueError naming a
    missing id or name."""
    if not isinstance(call_id, str) or not call_id or not isinstance(name, str) or not name:
        raise ValueError(f"{where}: a tool call needs an id and a name (strings)")
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments if arguments is not None else {})
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def tool_result(call_id, text: str, where: str) -> dict:
    """An OpenAI chat ``tool`` message: ``text``, the result of the call ``call_id``."""
    if not isinstance(call_id, str) or not call_id:
        raise ValueError(f"{where}: a tool result needs the id of its call (a string)")
    return {"role": "tool", "tool_call_id": call_id, "content": text}


def assistant(text: str | None, calls: list[dict]) -> dict:
    """An OpenAI chat assistant message: its text (None when empty and there are calls) and its tool calls."""
    m = {"role": "assistant", "content": text if text or not calls else None}
    if calls:
        m["tool_calls"] = calls
    return m


def chat_kwargs(served: Served, *, max_tokens: int | None, temperature: float, top_p: float, top_k: int = 0,
                stop: list[str] | None = None, tools: list | None = None, tool_choice=None,
                parallel_tool_calls: bool | None = None, response_format=None, stream: bool = False) -> dict:
    """The keyword arguments of :func:`~epqlab.requests.completion.create_chat_completion` for a translated
    request on the served batcher: the server's rules (``strict_context``: a ``max_tokens`` that does not fit is a
    400, never clamped), one choice, min-p and the repeat penalty off (module docstring), a stream's usage in its
    last chunk, the stop string that ended each reply (``stop_detail``) and the prompt tokens the prompt cache held
    (``usage_details``: :class:`Reply`'s ``cached_tokens``)."""
    return dict(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, min_p=0.0,
                repeat_penalty=1.0, stop=stop or None, model=served.name, n=1, batcher=served.batcher,
                strict_context=True, tools=tools or None, tool_choice=tool_choice,
                parallel_tool_calls=parallel_tool_calls, response_format=response_format,
                stream_options={"include_usage": True} if stream else None, stop_detail=True, usage_details=True)


def start(served: Served, messages: list[dict], kw: dict, stream: bool, cancel):
    """The chat request itself (validated before it returns: a bad one raises ValueError / TypeError)."""
    return create_chat_completion(served.session, messages, stream=stream, cancel=cancel, **kw)


@dataclass
class Reply:
    """One finished reply. ``calls``: ``(id, name, arguments JSON)``; ``finish``: chat's ``finish_reason``
    (``"stop"`` | ``"length"`` | ``"tool_calls"``); ``stop_sequence``: the stop string that ended it, or None;
    ``cached_tokens``: of the ``input_tokens``, those whose KV cells the prompt cache held (``--prompt-cache``)."""
    text: str = ""
    calls: list = field(default_factory=list)
    finish: str = "stop"
    stop_sequence: str | None = None
    input_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0


def reply_of(result: dict) -> Reply:
    """The :class:`Reply` of a chat.completion dict (one choice, made with ``stop_detail``)."""
    ch = result["choices"][0]
    msg, usage = ch["message"], result["usage"]
    calls = [(c["id"], c["function"]["name"], c["function"]["arguments"]) for c in msg.get("tool_calls") or []]
    return Reply(msg.get("content") or "", calls, ch["finish_reason"], ch.get("stop_sequence"),
                 usage["prompt_tokens"], usage["completion_tokens"], _cached(usage))


def _cached(usage: dict) -> int:
    return int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


def reply_events(chunks) -> Iterator[tuple]:
    """A chat stream (one choice, with usage and ``stop_detail``) as neutral events: ``("text", str)`` as text comes,
    ``("call", id, name, arguments)`` per tool call once the reply ended, then ``("end", Reply)``. Closing it closes
    ``chunks`` (which cancels the request)."""
    r, calls = Reply(), {}
    try:
        for ch in chunks:
            if ch.get("usage"):
                u = ch["usage"]
                r.input_tokens, r.output_tokens, r.cached_tokens = u["prompt_tokens"], u["completion_tokens"], _cached(u)
            for c in ch["choices"]:
                d = c["delta"]
                if d.get("content"):
                    r.text += d["content"]
                    yield "text", d["content"]
                for tc in d.get("tool_calls") or []:
                    e = calls.setdefault(tc["index"], ["", "", ""])
                    f = tc.get("function") or {}
                    e[0], e[1], e[2] = tc.get("id") or e[0], e[1] + (f.get("name") or ""), e[2] + (f.get("arguments") or "")
                if c.get("finish_reason"):
                    r.finish, r.stop_sequence = c["finish_reason"], c.get("stop_sequence")
    finally:
        chunks.close()
    r.calls = [tuple(calls[i]) for i in sorted(calls)]
    for call in r.calls:
        yield ("call", *call)
    yield "end", r
