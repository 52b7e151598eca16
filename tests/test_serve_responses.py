"""OpenAI's Responses API of ``epqlab serve --api-key`` on the default model, driven with the ``openai`` client:
``responses.create`` and ``responses.stream`` answer what ``/v1/chat/completions`` answers for the same conversation
at temperature 0, with the documented events in order; a forced function call, then its ``function_call_output``
(sent whole, and through ``previous_response_id``), equal to chat's tool turn; ``text.format`` json_schema output
that validates; the bounded store (``store: false``, unknown and evicted ids: 400); the same tokens through all three
chat APIs (chat/completions, Anthropic's messages, responses); malformed bodies answered 4xx in OpenAI's error shape
while the server keeps serving."""
from __future__ import annotations

import json
import time

import pytest

from epqlab.server.response_store import ResponseStore
from test_serve_api import KEY

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
jsonschema = pytest.importorskip("jsonschema")

UNIT = {"type": "object", "properties": {"unit": {"enum": ["C", "F"]}}, "required": ["unit"],
        "additionalProperties": False}
TOOL = {"type": "function", "name": "get_weather", "description": "Current weather", "parameters": UNIT}
CHAT_TOOL = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather",
                                               "parameters": UNIT}}]
SYSTEM, ASK = "Be brief.", "What is the weather in Paris?"
N = 8


@pytest.fixture(scope="module")
def client(keyed_server):
    return openai.OpenAI(base_url=keyed_server[0] + "/v1", api_key=KEY, max_retries=0, timeout=120)


def _chat(client, messages, **kw):
    return client.chat.completions.create(model="x", messages=messages, temperature=0, **kw)


def test_create_and_stream_answer_as_chat(client):
    ref = _chat(client, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": ASK}], max_tokens=N)
    r = client.responses.create(model="x", instructions=SYSTEM, input=ASK, max_output_tokens=N, temperature=0)
    assert r.output_text == ref.choices[0].message.content and [o.type for o in r.output] == ["message"]
    assert (r.usage.input_tokens, r.usage.output_tokens) == (ref.usage.prompt_tokens, ref.usage.completion_tokens)
    assert ref.choices[0].finish_reason == "length" and r.status == "incomplete"
    assert r.incomplete_details.reason == "max_output_tokens"
    items = client.responses.create(model="x", max_output_tokens=N, temperature=0, input=[
        {"role": "system", "content": SYSTEM}, {"type": "message", "role": "user",
                                                "content": [{"type": "input_text", "text": ASK}]}])
    assert items.output_text == r.output_text and items.usage.input_tokens == r.usage.input_tokens
    with client.responses.stream(model="x", instructions=SYSTEM, input=ASK, max_output_tokens=N, temperature=0) as s:
        events = list(s)
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]  # cut by max_output_tokens: OpenAI's last event then
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == r.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].response.usage.output_tokens == r.usage.output_tokens


def test_function_call_round_trip_and_previous_response_id(client):
    r = client.responses.create(model="x", input=ASK, tools=[TOOL], max_output_tokens=40, temperature=0,
                                tool_choice={"type": "function", "name": "get_weather"})
    assert r.status == "completed" and [o.type for o in r.output] == ["function_call"]
    fc = r.output[0]
    jsonschema.validate(json.loads(fc.arguments), UNIT)
    ref = _chat(client, [{"role": "user", "content": ASK}], max_tokens=40, tools=CHAT_TOOL,
                tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = ref.choices[0].message.tool_calls[0]
    assert (fc.name, json.loads(fc.arguments)) == (call.function.name, json.loads(call.function.arguments))
    with client.responses.stream(model="x", input=ASK, tools=[TOOL], max_output_tokens=40, temperature=0,
                                 tool_choice="required") as s:
        deltas = [e.delta for e in s if e.type == "response.function_call_arguments.delta"]
        final = s.get_final_response()
    assert final.status == "completed" and "".join(deltas) == final.output[0].arguments == fc.arguments
    # the tool's result, sent whole, and after previous_response_id: the same turn as chat's
    out = {"type": "function_call_output", "call_id": fc.call_id, "output": "21 C, sunny"}
    whole = client.responses.create(model="x", tools=[TOOL], max_output_tokens=N, temperature=0,
                                    input=[{"role": "user", "content": ASK}, fc.model_dump(exclude_none=True), out])
    chained = client.responses.create(model="x", tools=[TOOL], max_output_tokens=N, temperature=0,
                                      previous_response_id=r.id, input=[out])
    ref2 = _chat(client, [{"role": "user", "content": ASK}, ref.choices[0].message.model_dump(exclude_none=True),
                          {"role": "tool", "tool_call_id": call.id, "content": "21 C, sunny"}],
                 max_tokens=N, tools=CHAT_TOOL)
    for x in (whole, chained):
        assert x.usage.input_tokens == ref2.usage.prompt_tokens > r.usage.input_tokens
        assert x.output_text == (ref2.choices[0].message.content or "")


def test_previous_response_id_and_store(client):
    r1 = client.responses.create(model="x", input="Hi", max_output_tokens=4, temperature=0,
                                 instructions="Answer in French.")  # not carried over (OpenAI's rule)
    r2 = client.responses.create(model="x", input="And?", previous_response_id=r1.id, max_output_tokens=4,
                                 temperature=0, instructions=SYSTEM)
    ref = _chat(client, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi"},
                         {"role": "assistant", "content": r1.output_text}, {"role": "user", "content": "And?"}],
                max_tokens=4)
    assert (r2.output_text, r2.usage.input_tokens) == (ref.choices[0].message.content, ref.usage.prompt_tokens)
    assert r2.previous_response_id == r1.id
    gone = client.responses.create(model="x", input="Hi", max_output_tokens=1, store=False)
    for rid in (gone.id, "resp_unknown"):
        with pytest.raises(openai.BadRequestError, match="previous_response_id") as e:
            client.responses.create(model="x", input="x", previous_response_id=rid, max_output_tokens=1)
        assert e.value.body["param"] == "previous_response_id"
    # GET returns the stored response object as it was answered (streamed ones too); DELETE answers OpenAI's
    # deletion object and forgets it; an id not held (store: false, unknown, deleted) is a 404 in OpenAI's shape
    assert client.responses.retrieve(r1.id).model_dump() == r1.model_dump()
    with client.responses.stream(model="x", input="Hi", max_output_tokens=2, temperature=0) as s:
        streamed = list(s)[-1].response  # response.incomplete (cut at 2 tokens): get_final_response wants completed
    assert client.responses.retrieve(streamed.id).model_dump() == streamed.model_dump()
    assert client.responses.delete(r1.id) is None  # the openai client returns nothing; the body:
    raw = client.responses.with_raw_response.delete(streamed.id).http_response.json()
    assert raw == {"id": streamed.id, "object": "response.deleted", "deleted": True}
    for rid in (r1.id, streamed.id, gone.id, "resp_unknown"):
        with pytest.raises(openai.NotFoundError, match=f"Response with id '{rid}' not found") as e:
            client.responses.retrieve(rid)
        assert e.value.body["type"] == "invalid_request_error" and e.value.body["param"] == "response_id"
        with pytest.raises(openai.NotFoundError):
            client.responses.delete(rid)
    with pytest.raises(openai.BadRequestError, match="previous_response_id"):  # a deleted response cannot be continued
        client.responses.create(model="x", input="x", previous_response_id=r1.id, max_output_tokens=1)
    assert client.responses.retrieve(r2.id).previous_response_id == r1.id  # the others stay


def test_store_is_bounded():
    st = ResponseStore(keep=3, keep_chars=10_000)
    for i in range(4):
        st.put(f"r{i}", [{"role": "user", "content": str(i)}])  # 36 characters of JSON each
    with pytest.raises(ValueError, match="last 3 responses"):
        st.conversation("r0")  # the oldest went first
    assert st.conversation("r3") == [{"role": "user", "content": "3"}]
    st.put("big", [{"role": "user", "content": "x" * 9_960}])  # 9,993 characters: every older one must go
    for rid in ("r1", "r2", "r3"):
        with pytest.raises(ValueError):
            st.conversation(rid)
    assert st.conversation("big")[0]["content"] == "x" * 9_960
    # a deletion gives its characters back: two small ones fit beside nothing (without it, 9,993 + 36 + 36 > 10,000)
    assert st.delete("big") and not st.delete("big") and st.response("big") is None
    st.put("r5", [{"role": "user", "content": "5"}], {"id": "r5"})
    st.put("r6", [{"role": "user", "content": "6"}])
    assert st.response("r5") == {"id": "r5"} and st.conversation("r5") and st.conversation("r6")


def test_json_schema_output(client):
    fmt = {"format": {"type": "json_schema", "name": "unit", "schema": UNIT, "strict": True}}
    r = client.responses.create(model="x", input="Pick a unit.", text=fmt, max_output_tokens=20, temperature=0)
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), UNIT)
    ref = _chat(client, [{"role": "user", "content": "Pick a unit."}], max_tokens=20, response_format={
        "type": "json_schema", "json_schema": {"name": "unit", "schema": UNIT}})
    assert r.output_text == ref.choices[0].message.content


def test_same_tokens_through_three_apis(keyed_server, client):
    """One conversation at temperature 0: chat/completions (its tokens' bytes, logprobs), Anthropic's messages and
    responses answer the same text from the same number of prompt and generated tokens."""
    anthropic = pytest.importorskip("anthropic")
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Name three colors."}]
    ref = _chat(client, msgs, max_tokens=N, logprobs=True)
    toks = [bytes(t.bytes) for t in ref.choices[0].logprobs.content]
    text = b"".join(toks).decode()
    assert len(toks) == ref.usage.completion_tokens == N and text == ref.choices[0].message.content
    m = anthropic.Anthropic(base_url=keyed_server[0], api_key=KEY, max_retries=0).messages.create(
        model="x", max_tokens=N, system=SYSTEM, messages=msgs[1:], extra_body={"temperature": 0})
    r = client.responses.create(model="x", instructions=SYSTEM, input=msgs[1]["content"], max_output_tokens=N,
                                temperature=0)
    assert m.content[0].text == r.output_text == text
    assert m.usage.output_tokens == r.usage.output_tokens == len(toks)
    assert m.usage.input_tokens == r.usage.input_tokens == ref.usage.prompt_tokens


def test_disconnect_frees_the_sequence(keyed_server):
    """A client that leaves a stream of either new API frees its sequence at the next step (the shared
    streaming.run): the batcher has no active sequence soon after, long before 400 tokens (about 5 s here)."""
    url, auth = keyed_server[0], {"Authorization": f"Bearer {KEY}"}
    long = "Tell me a long story about a river."
    for path, body in (("/v1/messages", {"model": "x", "max_tokens": 400, "temperature": 0, "stream": True,
                                         "messages": [{"role": "user", "content": long}]}),
                       ("/v1/responses", {"model": "x", "max_output_tokens": 400, "temperature": 0, "stream": True,
                                          "input": long})):
        with httpx.stream("POST", url + path, json=body, headers=auth, timeout=60) as h:
            assert h.status_code == 200
            next(ln for ln in h.iter_lines() if "text_delta" in ln or "output_text.delta" in ln)
            left = time.time()
        active = 1
        while active and time.time() < left + 1.5:
            time.sleep(0.05)
            active = httpx.get(url + "/v1/epqlab/stats", headers=auth).json()["batch"]["active"]
        assert active == 0, path


def test_malformed_bodies_then_serves(keyed_server, client):
    url, p = keyed_server
    hdr = {"Authorization": f"Bearer {KEY}"}
    ok = {"model": "x", "input": "Hi", "max_output_tokens": 1}
    bad = [({**ok, "max_output_tokens": 0}, "max_output_tokens"), ({**ok, "temperature": 3}, "temperature"),
           ({**ok, "temperature": -1}, "temperature must be a number in 0..2"),
           ({**ok, "max_output_tokens": 100000}, "--n-ctx"), ({**ok, "inputs": "x"}, "inputs"),
           ({**ok, "input": []}, "input"), ({**ok, "tools": [{"type": "web_search"}]}, "web_search"),
           ({**ok, "input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input_image"), ({**ok, "input": [{"type": "item_reference", "id": "x"}]}, "item_reference"),
           ({**ok, "text": {"format": {"type": "json_schema", "name": "x"}}}, "json_schema"),
           ({**ok, "truncation": "auto"}, "truncation"), ({**ok, "background": True}, "background"),
           ({**ok, "tool_choice": {"type": "function", "name": "nope"}, "tools": [TOOL]}, "nope")]
    for body, what in bad:
        h = httpx.post(url + "/v1/responses", json=body, headers=hdr, timeout=60)
        assert h.status_code == 400, (body, h.text)
        err = h.json()["error"]
        assert err["type"] == "invalid_request_error" and what in err["message"], (what, h.text)
    h = httpx.post(url + "/v1/responses", content=b"[1, 2", headers=hdr)
    assert h.status_code == 400 and "not JSON" in h.json()["error"]["message"]
    h = httpx.post(url + "/v1/responses", json=[ok], headers=hdr)
    assert h.status_code == 400 and "must be a JSON object" in h.json()["error"]["message"]
    h = httpx.post(url + "/v1/responses", json={**ok, "input": "x" * 30000}, headers=hdr)
    assert h.status_code == 413 and h.json()["error"]["type"] == "invalid_request_error"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).responses.create(model="x", input="Hi")
    with pytest.raises(openai.BadRequestError, match="max_output_tokens"):
        client.responses.create(model="x", input="Hi", max_output_tokens=0)
    r = client.responses.create(model="x", input="Hi", max_output_tokens=2, temperature=0, metadata={"k": "v"},
                                reasoning={"effort": "low"}, user="u1")  # accepted, ignored (metadata echoed)
    assert r.usage.output_tokens == 2 and r.metadata == {"k": "v"} and p.poll() is None
