"""Tool (function) calling for chat completions, in OpenAI's shapes: ``tools=[{"type": "function",
"function": {"name", "description", "parameters"}}]``, ``tool_choice`` ``"auto"`` | ``"none"`` |
``"required"`` | ``{"type": "function", "function": {"name": ...}}``, assistant messages with ``tool_calls``
and ``role: "tool"`` results in the next turn (the legacy ``functions`` / ``function_call`` map onto these).

The prompt: when the GGUF's ``tokenizer.chat_template`` mentions ``tools`` it is rendered with jinja2
(a sandboxed environment, as Hugging Face transformers and llama-cpp-python's ``Jinja2ChatFormatter`` render
it) with ``messages``, ``tools``, ``add_generation_prompt=True``, ``bos_token`` and ``eos_token``. Otherwise
the generic fallback (the Hermes / Qwen format): :data:`TOOL_PROMPT` listing the tools as JSON goes into the
system message, an earlier assistant call is written as ``<tool_call>{"name", "arguments"}</tool_call>``,
a tool's result as a user message ``<tool_response>...</tool_response>``, and the GGUF's template (through
llama.cpp) formats the rest.

The reply: every ``<tool_call>{...}</tool_call>`` block (a last unclosed one too) whose JSON names a given
tool becomes an OpenAI tool call (``id``, ``type: "function"``, ``function.name``, ``function.arguments`` as a
JSON string); the text around them is the message's ``content`` (None when empty). When ``tool_choice`` forces
a call ("required" or a named function), a grammar (:func:`forced_grammar`) makes the reply exactly one such
block whose arguments follow the tool's ``parameters`` schema, so they always parse. A forced call cut short
before its JSON is complete (``max_tokens``, a stop string) is no call and no text: ``content`` None, empty
``tool_calls`` and the generation's own ``finish_reason`` (``"length"``), streamed or not, never the raw
``<tool_call>`` prefix.
"""
from __future__ import annotations

import json
import re
import uuid

from .structured import chat_template, schema_grammar, vocab_of

TOOL_PROMPT = ("You may call one or more functions to assist with the user query. The functions are described "
               "in JSON below:\n<tools>\n{tools}\n</tools>\nTo call a function, reply with one JSON object per "
               "call inside <tool_call></tool_call> tags:\n<tool_call>\n{{\"name\": <function-name>, "
               "\"arguments\": <arguments-json-object>}}\n</tool_call>")
OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)


def check_tools(tools, tool_choice, functions=None, function_call=None) -> tuple[list[dict], str | None]:
    """``(functions, choice)``: the tools' ``function`` dicts and ``"auto"`` | ``"none"`` | ``"required"`` |
    a function name (forced). No tools: ``([], None)``. Raises ValueError naming a malformed tool or choice."""
    if functions:
        if tools:
            raise ValueError("pass tools or the legacy functions, not both")
        tools = [{"type": "function", "function": f} for f in functions]
    if function_call is not None and tool_choice is None:
        tool_choice = function_call if isinstance(function_call, str) else {"type": "function", "function": function_call}
    if not tools:
        if tool_choice not in (None, "none", "auto"):
            raise ValueError("tool_choice needs tools")
        return [], None
    if not isinstance(tools, list):
        raise ValueError("tools must be a list of {\"type\": \"function\", \"function\": {...}} objects")
    fns = []
    for i, t in enumerate(tools):
        f = t.get("function") if isinstance(t, dict) and t.get("type", "function") == "function" else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not f["name"]:
            raise ValueError(f'tools[{i}] must be {{"type": "function", "function": {{"name": str, "parameters": '
                             f"{{...}}}}}}, got {t!r}")
        p = f.get("parameters", {"type": "object"})
        if not isinstance(p, dict):
            raise ValueError(f"tools[{i}].function.parameters must be a JSON schema object")
        fns.append({**f, "parameters": p})
    names = [f["name"] for f in fns]
    if tool_choice is None:
        tool_choice = "auto"
    if isinstance(tool_choice, dict):
        name = (tool_choice.get("function") or {}).get("name") if tool_choice.get("type", "function") == "function" else None
        if name not in names:
            raise ValueError(f"tool_choice names {name!r}, which is not among the tools ({', '.join(names)})")
        return fns, name
    if tool_choice not in ("auto", "none", "required"):
        raise ValueError(f'tool_choice must be "auto", "none", "required" or {{"type": "function", "function": '
                         f'{{"name": ...}}}}, got {tool_choice!r}')
    return fns, tool_choice


def _tools_json(fns: list[dict]) -> list[dict]:
    return [{"type": "function", "function": f} for f in fns]


def _call_text(call: dict) -> str:
    f = call.get("function") or {}
    args = f.get("arguments", "{}")
    try:
        args = json.loads(args) if isinstance(args, str) else args
    except json.JSONDecodeError:
        pass  # written back as the string it was
    return f"{OPEN}\n{json.dumps({'name': f.get('name'), 'arguments': args})}\n{CLOSE}"


def fallback_messages(messages: list[dict], fns: list[dict], choice: str | None) -> list[dict]:
    """``messages`` as plain ``{"role", "content": str}`` for a template without tools (module docstring)."""
    out = []
    for m in messages:
        role, content = m["role"], m.get("content") or ""
        if role == "assistant" and m.get("tool_calls"):
            content = "\n".join(([content] if content else []) + [_call_text(c) for c in m["tool_calls"]])
        elif role == "tool":
            role, content = "user", f"<tool_response>\n{content}\n</tool_response>"
        out.append({"role": role, "content": content})
    if fns and choice != "none":
        sys_text = TOOL_PROMPT.format(tools="\n".join(json.dumps(t) for t in _tools_json(fns)))
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + sys_text}
        else:
            out.insert(0, {"role": "system", "content": sys_text})
    return out


def template_supports_tools(template: str | None) -> bool:
    return bool(template) and "tools" in template


def render_jinja(template: str, messages: list[dict], fns: list[dict], bos: str, eos: str) -> str:
    """``template`` rendered as transformers' ``apply_chat_template`` does (sandboxed jinja2, trim and lstrip
    blocks), assistant ``tool_calls`` arguments given as objects. Raises ValueError for a template error."""
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(msg):
        raise ValueError(f"the chat template refused the messages: {msg}")

    msgs = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            calls = []
            for c in m["tool_calls"]:
                f = dict(c.get("function") or {})
                try:
                    f["arguments"] = json.loads(f.get("arguments") or "{}")
                except (TypeError, json.JSONDecodeError):
                    pass
                calls.append({**c, "function": f, **f})  # both shapes templates read: call.function.x and call.x
            m["tool_calls"] = calls
        msgs.append(m)
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(template).render(messages=msgs, tools=_tools_json(fns) if fns else None,
                                                add_generation_prompt=True, bos_token=bos, eos_token=eos)
    except jinja2.TemplateError as e:
        raise ValueError(f"the GGUF's chat template failed to render ({e})") from None


def chat_prompt(session, messages: list[dict], fns: list[dict], choice: str | None) -> str:
    """The prompt text for ``messages`` (module docstring: jinja2 when the template knows tools, else the
    fallback through llama.cpp's template). Plain messages (no tools, no calls) go to llama.cpp's template."""
    has_calls = any(m["role"] == "tool" or m.get("tool_calls") for m in messages)
    if not fns and not has_calls:
        return session.chat_prompt(messages)
    tmpl = chat_template(session)
    if template_supports_tools(tmpl):
        import llama_cpp as L

        v = vocab_of(session)
        text = lambda t: L.llama_vocab_get_text(v, t).decode("utf-8", "replace") if t >= 0 else ""
        return render_jinja(tmpl, messages, fns if choice != "none" else [], text(L.llama_vocab_bos(v)),
                            text(L.llama_vocab_eos(v)))
    return session.chat_prompt(fallback_messages(messages, fns, choice))


def forced_grammar(fns: list[dict], choice: str) -> str:
    """GBNF for exactly one ``<tool_call>\\n{"name": N, "arguments": A}\\n</tool_call>`` block: N the named
    function (or, for "required", any of them) and A following that function's ``parameters`` schema."""
    pick = [f for f in fns if choice == "required" or f["name"] == choice]
    alts = [{"type": "object", "properties": {"name": {"const": f["name"]}, "arguments": f["parameters"]},
             "required": ["name", "arguments"], "additionalProperties": False} for f in pick]
    g = schema_grammar(alts[0] if len(alts) == 1 else {"anyOf": alts})
    g = re.sub(r"^root ::=", "tool-call-json ::=", g, count=1, flags=re.M)
    return g + f'\nroot ::= "{OPEN}\\n" tool-call-json "\\n{CLOSE}"\n'


def parse_reply(text: str, fns: list[dict], max_calls: int | None = None) -> tuple[str | None, list[dict]]:
    """``(content, tool_calls)`` of a reply (module docstring); blocks that do not parse or name no given
    tool stay in the content. ``max_calls`` (OpenAI's ``parallel_tool_calls=false``: 1): the calls past that many
    are dropped, from the calls and from the content."""
    names = {f["name"] for f in fns}
    calls, keep, last = [], [], 0
    for m in _BLOCK.finditer(text):
        try:
            obj = json.loads(m.group(1))
        except json.JSONDecodeError:
            continue
        if not isinstance(obj, dict) or obj.get("name") not in names:
            continue
        args = obj.get("arguments", obj.get("parameters", {}))
        if max_calls is None or len(calls) < max_calls:
            calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                          "function": {"name": obj["name"],
                                       "arguments": args if isinstance(args, str) else json.dumps(args)}})
        keep.append(text[last:m.start()])
        last = m.end()
    if not calls:
        return text, []
    content = ("".join(keep) + text[last:]).strip()
    return content or None, calls


class StreamSplitter:
    """Streams a reply's text while holding back what may be the start of a ``<tool_call>`` block: feed it
    each piece, send what :meth:`feed` returns as content; once a block opened, the rest is held for
    :func:`parse_reply` at the end."""

    def __init__(self):
        self.text = ""
        self.sent = 0
        self.calling = False

    def feed(self, piece: str) -> str:
        self.text += piece
        if self.calling:
            return ""
        i = self.text.find(OPEN, self.sent)
        if i >= 0:
            self.calling = True
            out, self.sent = self.text[self.sent:i], i
            return out
        end = len(self.text)
        for k in range(min(len(OPEN) - 1, end - self.sent), 0, -1):  # a suffix that may grow into OPEN
            if OPEN.startswith(self.text[end - k:]):
                end -= k
                break
        out, self.sent = self.text[self.sent:end], end
        return out

    def rest(self) -> str:
        """The held-back text that was not a tool call after all."""
        return self.text[self.sent:]


__all__ = ["check_tools", "chat_prompt", "forced_grammar", "parse_reply", "fallback_messages", "render_jinja",
           "StreamSplitter", "TOOL_PROMPT"]
