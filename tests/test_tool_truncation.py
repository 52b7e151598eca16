"""A forced tool call cut short by ``max_tokens`` (epqlab.requests.completion, epqlab.requests.tools): no call and no text,
``finish_reason: "length"`` and empty ``tool_calls``, streamed or not, never the raw ``<tool_call>`` prefix."""
from __future__ import annotations

import pytest

import epqlab

WEATHER = [{"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                          "required": ["city"], "additionalProperties": False}}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def sess(default_model_path):
    with epqlab.Session(default_model_path, pager=False, n_threads=1, n_ctx=512) as s:
        yield s


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}],
                         ids=["required", "named"])
def test_truncated_forced_call_is_length_with_no_calls(sess, choice):
    kw = dict(tools=WEATHER, tool_choice=choice, temperature=0)
    r = sess.create_chat_completion(ASK, max_tokens=4, **kw)
    c = r["choices"][0]
    assert r["usage"]["completion_tokens"] == 4
    assert c["finish_reason"] == "length" and c["message"]["tool_calls"] == [] and c["message"]["content"] is None
    chunks = list(sess.create_chat_completion(ASK, max_tokens=4, stream=True, **kw))
    deltas = [ch["choices"][0]["delta"] for ch in chunks]
    assert not any(d.get("content") for d in deltas) and not any(d.get("tool_calls") for d in deltas)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    # given room, the same request is a whole call (the grammar's block closes)
    full = sess.create_chat_completion(ASK, max_tokens=64, **kw)["choices"][0]
    assert full["finish_reason"] == "tool_calls" and full["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
