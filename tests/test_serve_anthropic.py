"""The Anthropic Messages API of ``epqlab serve --api-key`` on the default model, driven with Anthropic's own client
(``anthropic``): ``messages.create`` and ``messages.stream`` answer what ``/v1/chat/completions`` answers for the
same conversation at temperature 0 (the reference, through the ``openai`` client), with Anthropic's stop reasons and
usage; a forced tool_use, then the tool_result turn, equal to chat's tool call and tool turn; ``count_tokens`` equal
to the ChatML prompt tokenized by hand through ``/tokenize``; the key as ``x-api-key`` or a bearer token, a wrong one
an ``AuthenticationError``; malformed bodies answered 4xx in Anthropic's error shape while the server keeps
serving."""
from __future__ import annotations

import json

import pytest

from test_serve_api import KEY

anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
jsonschema = pytest.importorskip("jsonschema")

UNIT = {"type": "object", "properties": {"unit": {"enum": ["C", "F"]}}, "required": ["unit"],
        "additionalProperties": False}  # a small schema: the forced call is a few tokens
TOOL = {"name": "get_weather", "description": "Current weather", "input_schema": UNIT}
CHAT_TOOL = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather",
                                               "parameters": UNIT}}]
SYSTEM, ASK = "Be brief.", "What is the weather in Paris?"
N = 8
T0 = {"extra_body": {"temperature": 0}}  # greedy; this client sends sampling fields only through extra_body


@pytest.fixture(scope="module")
def claude(keyed_server):
    return anthropic.Anthropic(base_url=keyed_server[0], api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def chat(keyed_server):
    """The reference: the same conversation through /v1/chat/completions."""
    oa = openai.OpenAI(base_url=keyed_server[0] + "/v1", api_key=KEY, max_retries=0, timeout=120)
    return lambda messages, **kw: oa.chat.completions.create(model="x", messages=messages, temperature=0, **kw)


def _tokens(url, text: str) -> int:
    r = httpx.post(url + "/tokenize", json={"input": text}, headers={"Authorization": f"Bearer {KEY}"})
    return len(r.json()["tokens"])


def test_create_and_stream_answer_as_chat(keyed_server, claude, chat):
    ref = chat([{"role": "system", "content": SYSTEM}, {"role": "user", "content": ASK}], max_tokens=N)
    r = claude.messages.create(model="x", max_tokens=N, **T0, system=SYSTEM,
                               messages=[{"role": "user", "content": ASK}])
    assert [b.type for b in r.content] == ["text"] and r.content[0].text == ref.choices[0].message.content
    assert r.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[ref.choices[0].finish_reason]
    assert (r.usage.input_tokens, r.usage.output_tokens) == (ref.usage.prompt_tokens, ref.usage.completion_tokens)
    # system as blocks, content as blocks: the same prompt
    blocks = claude.messages.create(model="x", max_tokens=N, **T0, system=[{"type": "text", "text": SYSTEM}],
                                    messages=[{"role": "user", "content": [{"type": "text", "text": ASK}]}])
    assert blocks.content[0].text == r.content[0].text and blocks.usage.input_tokens == r.usage.input_tokens
    with claude.messages.stream(model="x", max_tokens=N, **T0, system=SYSTEM,
                                messages=[{"role": "user", "content": ASK}]) as s:
        kinds = [e.type for e in s]  # the client's events: raw ones plus its text/input_json helpers
        final = s.get_final_message()
    raw = [k for k in kinds if k not in ("text", "input_json")]
    assert raw[0] == "message_start" and raw[-2:] == ["message_delta", "message_stop"]
    assert raw[1] == "content_block_start" and raw[-3] == "content_block_stop"
    assert set(raw[2:-3]) == {"content_block_delta"} and len(raw[2:-3]) > 1
    assert final.content[0].text == r.content[0].text and final.stop_reason == r.stop_reason
    assert (final.usage.input_tokens, final.usage.output_tokens) == (r.usage.input_tokens, r.usage.output_tokens)
    # the ping event is in the wire stream (the client drops it)
    with httpx.stream("POST", keyed_server[0] + "/v1/messages", headers={"x-api-key": KEY}, timeout=60,
                      json={"model": "x", "max_tokens": 2, "stream": True, "messages": [{"role": "user", "content": ASK}]}) as h:
        names = [ln[7:] for ln in h.iter_lines() if ln.startswith("event: ")]
    assert names[:2] == ["message_start", "ping"] and names[-1] == "message_stop"


def test_stop_sequence(claude, chat):
    text = chat([{"role": "user", "content": ASK}], max_tokens=N).choices[0].message.content
    stop = text.split()[1]  # a word the greedy reply writes
    r = claude.messages.create(model="x", max_tokens=N, **T0, stop_sequences=["zzqx", stop],
                               messages=[{"role": "user", "content": ASK}])
    assert (r.stop_reason, r.stop_sequence) == ("stop_sequence", stop)
    assert r.content[0].text == text[:text.index(stop)]


def test_tool_use_then_tool_result_as_chat(claude, chat):
    r = claude.messages.create(model="x", max_tokens=40, **T0, tools=[TOOL],
                               tool_choice={"type": "tool", "name": "get_weather"},
                               messages=[{"role": "user", "content": ASK}])
    assert r.stop_reason == "tool_use" and [b.type for b in r.content] == ["tool_use"]
    use = r.content[0]
    jsonschema.validate(use.input, UNIT)
    ref = chat([{"role": "user", "content": ASK}], max_tokens=40, tools=CHAT_TOOL,
               tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = ref.choices[0].message.tool_calls[0]
    assert use.name == call.function.name and use.input == json.loads(call.function.arguments)
    assert r.usage.input_tokens == ref.usage.prompt_tokens
    with claude.messages.stream(model="x", max_tokens=40, **T0, tools=[TOOL], tool_choice={"type": "any"},
                                messages=[{"role": "user", "content": ASK}]) as s:
        deltas = [e.delta.partial_json for e in s if e.type == "content_block_delta"]
        final = s.get_final_message()
    assert final.stop_reason == "tool_use" and json.loads("".join(deltas)) == final.content[0].input == use.input
    # the next turn: the tool's result, as chat's tool message
    turn = claude.messages.create(model="x", max_tokens=N, **T0, tools=[TOOL], messages=[
        {"role": "user", "content": ASK}, {"role": "assistant", "content": r.content},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "21 C, sunny"}]}])
    ref2 = chat([{"role": "user", "content": ASK}, ref.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "21 C, sunny"}], max_tokens=N, tools=CHAT_TOOL)
    assert turn.usage.input_tokens == ref2.usage.prompt_tokens > r.usage.input_tokens
    assert "".join(b.text for b in turn.content if b.type == "text") == (ref2.choices[0].message.content or "")
    n = claude.messages.count_tokens(model="x", tools=[TOOL], messages=[{"role": "user", "content": ASK}])
    assert n.input_tokens == r.usage.input_tokens


def test_count_tokens_by_hand(keyed_server, claude):
    n = claude.messages.count_tokens(model="x", system=SYSTEM, messages=[{"role": "user", "content": ASK}])
    chatml = f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{ASK}<|im_end|>\n<|im_start|>assistant\n"
    assert n.input_tokens == _tokens(keyed_server[0], chatml)


def test_keys(keyed_server):
    url = keyed_server[0]
    n = anthropic.Anthropic(base_url=url, auth_token=KEY, max_retries=0).messages.count_tokens(
        model="x", messages=[{"role": "user", "content": "Hi"}])  # Authorization: Bearer
    assert n.input_tokens > 0
    with pytest.raises(anthropic.AuthenticationError) as e:
        anthropic.Anthropic(base_url=url, api_key="wrong", max_retries=0).messages.create(
            model="x", max_tokens=1, messages=[{"role": "user", "content": "Hi"}])
    assert e.value.body == {"type": "error", "error": {"type": "authentication_error", "message": e.value.body["error"]["message"]}}
    body = {"model": "x", "messages": [{"role": "user", "content": "Hi"}]}
    # x-api-key, as older clients and Claude Code send it (this client version sends a bearer token)
    h = httpx.post(url + "/v1/messages/count_tokens", json=body, headers={"x-api-key": KEY})
    assert h.status_code == 200 and h.json()["input_tokens"] == n.input_tokens
    for hdr in ({}, {"x-api-key": "wrong"}, {"Authorization": "Bearer wrong"}):
        h = httpx.post(url + "/v1/messages", json={**body, "max_tokens": 1}, headers=hdr)
        assert h.status_code == 401 and h.json()["type"] == "error", hdr
        assert h.json()["error"]["type"] == "authentication_error", hdr


def test_malformed_bodies_then_serves(keyed_server, claude):
    url, p = keyed_server
    hdr = {"x-api-key": KEY}
    ok = {"model": "x", "max_tokens": 1, "messages": [{"role": "user", "content": "Hi"}]}
    bad = [({"model": "x", "messages": ok["messages"]}, "max_tokens"), ({**ok, "max_tokens": 0}, "max_tokens"),
           ({**ok, "temperature": 1.5}, "temperature"), ({**ok, "temperature": -1}, "temperature must be a number in 0..1"),
           ({**ok, "top_k": -1}, "top_k"),
           ({**ok, "max_tokens": 100000}, "--n-ctx"), ({**ok, "messags": []}, "messags"),
           ({**ok, "messages": [{"role": "system", "content": "x"}]}, "role"),
           ({**ok, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "image"),
           ({**ok, "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "server tool"),
           ({**ok, "tools": [TOOL], "tool_choice": {"type": "tool", "name": "nope"}}, "nope"),
           ({**ok, "messages": [*ok["messages"], {"role": "assistant", "content": "The"}]}, "prefill")]
    for body, what in bad:
        h = httpx.post(url + "/v1/messages", json=body, headers=hdr, timeout=60)
        assert h.status_code == 400, (body, h.text)
        assert h.json()["type"] == "error" and h.json()["error"]["type"] == "invalid_request_error"
        assert what in h.json()["error"]["message"], (what, h.text)
    h = httpx.post(url + "/v1/messages", content=b'{"model": ', headers=hdr)
    assert h.status_code == 400 and "not JSON" in h.json()["error"]["message"]
    h = httpx.post(url + "/v1/messages", json={**ok, "system": "x" * 30000}, headers=hdr)
    assert h.status_code == 413 and h.json()["error"]["type"] == "request_too_large"
    with pytest.raises(anthropic.BadRequestError, match="max_tokens"):
        claude.messages.create(model="x", max_tokens=0, messages=ok["messages"])
    with pytest.raises(anthropic.BadRequestError, match="role"):
        claude.messages.count_tokens(model="x", messages=[{"role": "robot", "content": "x"}])
    r = claude.messages.create(model="x", max_tokens=2, **T0, messages=ok["messages"],
                               metadata={"user_id": "u1"})  # metadata: accepted, ignored
    assert r.usage.output_tokens == 2 and p.poll() is None
