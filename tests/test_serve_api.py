"""The OpenAI features beyond plain text, against one ``epqlab serve --api-key`` on the default model, driven
with the ``openai`` client: JSON-schema output that validates (``jsonschema``), streamed and not; a forced
tool call whose arguments validate, then the next turn with the tool's result; ``logprobs`` equal to the
log-softmax of the engine's own logits (``Session.greedy_trace`` computed here, NumPy); ``logit_bias`` and the
frequency / presence penalties doing what a hand computation on those logits predicts; 401 on every endpoint
without the key; oversized and malformed requests answered 4xx while the server keeps serving. The same dicts
in-process through ``Session.create_*`` (with ``n`` = 2: per-sequence samplers in one batch). The default
model is a random-ish MoE: the grammar is what makes its JSON valid."""
from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from collections import Counter

import numpy as np
import pytest

import epqlab
from epqlab.requests.tools import StreamSplitter, parse_reply, render_jinja
from test_serve import _free_port, served

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
jsonschema = pytest.importorskip("jsonschema")

KEY = "sk-test-4f1c"
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                           "age": {"type": "integer"},
                                           "admin": {"type": "boolean"}},
          "required": ["name", "age", "admin"], "additionalProperties": False}
WEATHER = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "unit": {"enum": ["C", "F"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
PROMPT = "one two one two one two one two one"
N = 5


def _ready(url, p, timeout=180):
    import time

    deadline = time.time() + timeout
    while time.time() < deadline:
        if p.poll() is not None:
            pytest.fail(f"epqlab serve exited with {p.returncode}: {p.stdout.read()[-3000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    pytest.fail("epqlab serve did not answer")


@pytest.fixture(scope="module")
def server(default_model_path):
    port = _free_port()
    cmd = [sys.executable, "-m", "epqlab", "serve", str(default_model_path), "--port", str(port), "--threads", "1",
           "--n-ctx", "512", "--max-batch", "2", "--log-level", "warning", "--api-key", KEY,
           "--max-body-bytes", "20000"]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    yield url, p
    p.terminate()
    try:
        out = p.communicate(timeout=20)[0]
    except subprocess.TimeoutExpired:
        p.kill()
        out = p.communicate()[0]
    assert KEY not in out  # the key is never logged


@contextlib.contextmanager
def keyed(model):
    """``epqlab serve`` with the key and limits this module's server has, ready; yields ``(url, process)`` (the
    fixture of the Anthropic and Responses tests)."""
    with served(model, "--n-ctx", 512, "--max-batch", 2, "--api-key", KEY, "--max-body-bytes", 20000) as (url, p):
        _ready(url, p)
        yield url, p


@pytest.fixture(scope="module")
def sess(default_model_path):
    with epqlab.Session(default_model_path, pager=False, n_threads=1, n_ctx=512, n_seq_max=2) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    url, p = server
    _ready(url, p)
    return openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def _log_softmax(x):
    x = np.asarray(x, np.float64)
    return x - (x.max() + np.log(np.exp(x - x.max()).sum()))


def test_json_schema_streamed_and_not(client):
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    msgs = [{"role": "user", "content": "Describe a user as JSON."}]
    r = client.chat.completions.create(model="x", messages=msgs, max_tokens=60, temperature=0, response_format=rf)
    jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)
    assert r.choices[0].finish_reason == "stop"  # the grammar completed and allowed the end of generation
    parts = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="x", messages=msgs, max_tokens=60, temperature=0.9, seed=3, response_format=rf, stream=True)]
    assert len([p for p in parts if p]) > 1
    jsonschema.validate(json.loads("".join(parts)), PERSON)
    r = client.chat.completions.create(model="x", messages=msgs, max_tokens=40, temperature=0,
                                       response_format={"type": "json_object"})
    assert r.choices[0].finish_reason != "stop" or json.loads(r.choices[0].message.content) is not None


def test_forced_tool_call_then_tool_result(client):
    params = WEATHER[0]["function"]["parameters"]
    r = client.chat.completions.create(model="x", messages=ASK, tools=WEATHER, max_tokens=60, temperature=0,
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}})
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and len(ch.message.tool_calls) == 1
    call = ch.message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather" and call.id
    jsonschema.validate(json.loads(call.function.arguments), params)
    turn2 = ASK + [ch.message.model_dump(exclude_none=True),
                   {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21, "sky": "sunny"}'}]
    r2 = client.chat.completions.create(model="x", messages=turn2, tools=WEATHER, max_tokens=8, temperature=0)
    assert r2.choices[0].finish_reason in ("stop", "length", "tool_calls") and r2.usage.completion_tokens > 0
    assert r2.usage.prompt_tokens > r.usage.prompt_tokens  # the call and its result are in the prompt
    # streamed: id and name first, then the arguments, as OpenAI streams them
    calls: dict = {}
    fin = None
    for c in client.chat.completions.create(model="x", messages=ASK, tools=WEATHER, tool_choice="required",
                                            max_tokens=60, temperature=0, stream=True):
        d = c.choices[0].delta
        fin = c.choices[0].finish_reason or fin
        for tc in d.tool_calls or []:
            e = calls.setdefault(tc.index, {"name": "", "args": ""})
            e["name"] += (tc.function.name or "") if tc.function else ""
            e["args"] += (tc.function.arguments or "") if tc.function else ""
    assert fin == "tool_calls" and calls[0]["name"] == "get_weather"
    jsonschema.validate(json.loads(calls[0]["args"]), params)


def test_logprobs_are_log_softmax_of_engine_logits(client, sess):
    toks = sess.tokenize(PROMPT)
    _, steps, gen = sess.greedy_trace(toks, N)  # the engine's logits of each generated token
    want = [_log_softmax(row) for row in steps]
    r = client.completions.create(model="x", prompt=toks, max_tokens=N, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert lp.tokens == [sess.detokenize([t]) for t in gen]
    assert lp.token_logprobs == pytest.approx([w[t] for w, t in zip(want, gen)], abs=1e-4)
    for w, top in zip(want, lp.top_logprobs):
        best = np.argsort(-w)[:3]
        assert list(top.values())[:3] == pytest.approx(w[best].tolist(), abs=1e-4)
    msgs = [{"role": "user", "content": "Count: one two"}]
    c = client.chat.completions.create(model="x", messages=msgs, max_tokens=4, temperature=0, logprobs=True,
                                       top_logprobs=2)
    ctoks = sess.tokenize(sess.chat_prompt(msgs), add_special=False)
    _, csteps, cgen = sess.greedy_trace(ctoks, 4)
    content = c.choices[0].logprobs.content
    assert [e.logprob for e in content] == pytest.approx([_log_softmax(r)[t] for r, t in zip(csteps, cgen)], abs=1e-4)
    assert b"".join(bytes(e.bytes) for e in content).decode() == c.choices[0].message.content
    assert all(e.top_logprobs[0].logprob == pytest.approx(e.logprob) for e in content)  # greedy: the best one


def test_logit_bias_and_penalties_as_computed(client, sess):
    toks = sess.tokenize(PROMPT)
    _, steps, gen = sess.greedy_trace(toks, 1)
    row = steps[0].astype(np.float64)
    t0 = gen[0]
    other = int(np.argsort(-row)[7])  # some token the model does not pick
    one = lambda **kw: client.completions.create(model="x", prompt=toks, max_tokens=1, temperature=0, **kw).choices[0].text
    assert one() == sess.detokenize([t0])
    assert one(logit_bias={str(other): 100}) == sess.detokenize([other])  # +100 makes it the argmax
    banned = client.completions.create(model="x", prompt=toks, max_tokens=12, temperature=0, logprobs=0,
                                       logit_bias={str(t0): -100}).choices[0].logprobs.tokens
    assert sess.detokenize([t0]) not in banned and banned[0] == sess.detokenize([int(np.argsort(-row)[1])])
    # llama.cpp's penalties over the last 64 accepted tokens (the prompt here): l - count * f - (count > 0) * p
    counts = Counter(toks[-64:])

    def pick(f, p):
        adj = row.copy()
        for t, n in counts.items():
            adj[t] -= n * f + p
        return int(np.argmax(adj))

    # a pair where each penalty matters: the pick differs from no penalty, frequency alone, presence alone
    grid = [(f, p) for f in (0.25, 0.5, 1.0, 1.5) for p in (0.5, 1.0, 1.5, 2.0)]
    f, p = next((f, p) for f, p in grid if pick(f, p) not in (pick(f, 0), pick(0, p), t0))
    assert one(frequency_penalty=f, presence_penalty=p) == sess.detokenize([pick(f, p)])


def test_api_key_on_every_endpoint(server, client):
    url, proc = server
    calls = [("GET", "/v1/models", None), ("GET", "/v1/epqlab/stats", None),
             ("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 1}),
             ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}),
             ("POST", "/tokenize", {"input": "hi"}), ("POST", "/extras/tokenize", {"input": "hi"}),
             ("POST", "/extras/tokenize/count", {"input": "hi"}), ("POST", "/detokenize", {"tokens": [1, 2]}),
             ("POST", "/extras/detokenize", {"tokens": [1, 2]}), ("POST", "/v1/embeddings", {"input": "hi"})]
    for method, path, body in calls:
        for hdr in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            h = httpx.request(method, url + path, json=body, headers=hdr, timeout=60)
            assert h.status_code == 401, (path, hdr)
            assert h.json()["error"]["type"] == "authentication_error"
        h = httpx.request(method, url + path, json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
        assert h.status_code == (400 if path == "/v1/embeddings" else 200), (path, h.text)
    assert httpx.get(url + "/health").status_code == 200  # the one endpoint without a key
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="nope", max_retries=0).models.list()
    auth = {"Authorization": f"Bearer {KEY}"}
    tk = httpx.post(url + "/tokenize", json={"input": "Hello world"}, headers=auth).json()["tokens"]
    assert httpx.post(url + "/detokenize", json={"tokens": tk}, headers=auth).json()["text"].endswith("Hello world")


def test_bad_and_oversized_requests_then_serves(server, client):
    url, proc = server
    auth = {"Authorization": f"Bearer {KEY}"}
    h = httpx.post(url + "/v1/completions", json={"prompt": "x" * 30000}, headers=auth)
    assert h.status_code == 413 and "limit" in h.json()["error"]["message"]
    body = json.dumps({"prompt": "x" * 30000}).encode()
    h = httpx.post(url + "/v1/completions", content=iter([body[:10000], body[10000:]]),  # chunked: no length
                   headers={**auth, "content-type": "application/json"})
    assert h.status_code == 413 and "limit" in h.json()["error"]["message"]
    bad = [("max_tokens", dict(prompt="hi", max_tokens=100000)), ("response_format", dict(
        prompt="hi", extra_body={"response_format": {"type": "yaml"}})),
        ("grammar", dict(prompt="hi", extra_body={"grammar": "root ::= ("})),
        ("logit_bias", dict(prompt="hi", logit_bias={"abc": 1})), ("suffix", dict(prompt="hi", suffix="end")),
        ("echo", dict(prompt="hi", echo=True, logprobs=1)), ("tfs_z", dict(prompt="hi", extra_body={"tfs_z": 0.9})), ("frequency_penalty", dict(prompt="hi", frequency_penalty=9))]
    for what, kw in bad:
        with pytest.raises(openai.BadRequestError, match=what):
            client.completions.create(model="x", **kw)
    with pytest.raises(openai.BadRequestError, match="tool_choice"):
        client.chat.completions.create(model="x", messages=ASK, tools=WEATHER,
                                       tool_choice={"type": "function", "function": {"name": "nope"}})
    with pytest.raises(openai.BadRequestError, match="tools\\[0\\]"):
        client.chat.completions.create(model="x", messages=ASK, tools=[{"type": "function", "function": {}}])
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        client.chat.completions.create(model="x", messages=ASK, logprobs=True, top_logprobs=99)
    with pytest.raises(openai.BadRequestError, match="schema"):
        client.chat.completions.create(model="x", messages=ASK, stream=True,
                                       response_format={"type": "json_schema", "json_schema": {"name": "x"}})
    r = client.completions.create(model="x", prompt="Hi", max_tokens=2, temperature=0, echo=True)
    assert r.choices[0].text.startswith("Hi") and proc.poll() is None


def test_in_process_same_dicts(sess):
    """The same request dicts through Session.create_*: two choices per request (one batch, a Sampler each)."""
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    r = sess.create_chat_completion([{"role": "user", "content": "A user as JSON"}], max_tokens=60, temperature=0.9,
                                    seed=5, n=2, response_format=rf)
    for ch in r["choices"]:
        jsonschema.validate(json.loads(ch["message"]["content"]), PERSON)
    r = sess.create_chat_completion(ASK, tools=WEATHER, tool_choice="required", max_tokens=60, temperature=0)
    call = r["choices"][0]["message"]["tool_calls"][0]
    jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER[0]["function"]["parameters"])
    toks = sess.tokenize(PROMPT)
    _, steps, gen = sess.greedy_trace(toks, 3)
    lp = sess.create_completion(toks, max_tokens=3, temperature=0, logprobs=1)["choices"][0]["logprobs"]
    assert lp["token_logprobs"] == pytest.approx([_log_softmax(r)[t] for r, t in zip(steps, gen)], abs=1e-4)
    streamed = [x for c in sess.create_completion(toks, max_tokens=3, temperature=0, logprobs=1, stream=True)
                if c["choices"][0]["logprobs"] for x in c["choices"][0]["logprobs"]["token_logprobs"]]
    assert streamed == lp["token_logprobs"]  # each chunk carries its own tokens' log-probabilities
    both = sess.create_completion(toks, max_tokens=3, temperature=0, logprobs=1, n=2)["choices"]
    per: dict = {0: [], 1: []}
    for c in sess.create_completion(toks, max_tokens=3, temperature=0, logprobs=1, n=2, stream=True):
        ch = c["choices"][0]
        per[ch["index"]] += ch["logprobs"]["token_logprobs"] if ch["logprobs"] else []
    assert [per[0], per[1]] == [b["logprobs"]["token_logprobs"] for b in both]  # batched: per sequence, per piece
    two = sess.create_completion(toks, max_tokens=3, temperature=0, n=2, logit_bias={gen[0]: -100})
    assert all(sess.detokenize([gen[0]]) != c["text"][:len(sess.detokenize([gen[0]]))] for c in two["choices"])


def test_tool_prompt_and_reply_parsing():
    """The jinja2 path with a template that renders tools, the reply parser, the stream splitter."""
    tmpl = ("{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}\n{% endif %}"
            "{% for m in messages %}<{{ m.role }}>{{ m.content or '' }}"
            "{% for c in m.tool_calls or [] %}CALL {{ c.function.name }} {{ c.function.arguments.city }}{% endfor %}"
            "\n{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")
    msgs = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "cold"}]
    fns = [WEATHER[0]["function"]]
    assert render_jinja(tmpl, msgs, fns, "<s>", "</s>") == (
        # trim_blocks (as transformers renders): the newline after a block tag goes
        "TOOLS:get_weather;<user>What is the weather in Paris?<assistant>CALL get_weather Oslo<tool>cold<assistant>")
    text = 'Sure. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "unit": "C"}}\n</tool_call>'
    content, calls = parse_reply(text, fns)
    assert content == "Sure." and json.loads(calls[0]["function"]["arguments"]) == {"city": "Rome", "unit": "C"}
    assert parse_reply('<tool_call>{"name": "other"}</tool_call>', fns)[1] == []  # not a given tool: text
    sp = StreamSplitter()
    assert [sp.feed(x) for x in ("Sure. <to", "ol_c", "all>{")] == ["Sure. ", "", ""] and sp.calling


def test_template_with_tools_renders_through_jinja(sess, monkeypatch):
    """A GGUF whose chat template renders ``tools`` gets its own rendering (jinja2), not the fallback prompt."""
    import epqlab.requests.tools as tools_mod

    tmpl = ("{% for t in tools or [] %}[TOOL {{ t.function.name }}]{% endfor %}"
            "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
            "<|im_start|>assistant\n")
    monkeypatch.setattr(tools_mod, "chat_template", lambda s: tmpl)
    text = tools_mod.chat_prompt(sess, ASK, [WEATHER[0]["function"]], "auto")
    # (jinja2 drops the template's final newline, as transformers' environment does)
    assert text == "[TOOL get_weather]<|im_start|>user\nWhat is the weather in Paris?<|im_end|>\n<|im_start|>assistant"
    r = sess.create_chat_completion(ASK, tools=WEATHER, max_tokens=1, temperature=0)
    assert r["usage"]["prompt_tokens"] == len(sess.tokenize(text, add_special=False))
    assert tools_mod.TOOL_PROMPT[:20] not in text  # not the fallback


TWO_CALLS = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
             '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>')


@pytest.mark.parametrize("stream", [False, True])
def test_parallel_tool_calls_false_gives_at_most_one_call(sess, stream):
    """OpenAI's ``parallel_tool_calls=false`` (LangChain's ``bind_tools(..., parallel_tool_calls=False)``): a reply that
    makes two calls (a grammar makes it here) answers with the first alone; true or unset, with both."""
    gbnf = 'root ::= "' + TWO_CALLS.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'

    def calls(**kw):
        r = sess.create_chat_completion(ASK, tools=WEATHER, max_tokens=80, temperature=0, grammar=gbnf,
                                        stream=stream, **kw)
        if not stream:
            m = r["choices"][0]
            return [json.loads(c["function"]["arguments"])["city"] for c in m["message"].get("tool_calls") or []], \
                m["message"]["content"], m["finish_reason"]
        args, text, fin = {}, "", None
        for ch in r:
            d = ch["choices"][0]["delta"]
            fin = ch["choices"][0]["finish_reason"] or fin
            text += d.get("content") or ""
            for tc in d.get("tool_calls") or []:
                args[tc["index"]] = args.get(tc["index"], "") + tc["function"]["arguments"]
        return [json.loads(args[i])["city"] for i in sorted(args)], text or None, fin

    assert calls() == calls(parallel_tool_calls=True) == (["Oslo", "Rome"], None, "tool_calls")
    assert calls(parallel_tool_calls=False) == (["Oslo"], None, "tool_calls")
    with pytest.raises(ValueError, match="parallel_tool_calls must be true or false"):
        sess.create_chat_completion(ASK, tools=WEATHER, max_tokens=2, parallel_tool_calls="no")


def test_parse_reply_keeps_at_most_max_calls():
    fns = [WEATHER[0]["function"]]
    content, calls = parse_reply("Both: " + TWO_CALLS + " done", fns, max_calls=1)
    assert [json.loads(c["function"]["arguments"])["city"] for c in calls] == ["Oslo"] and content == "Both: \n done"
    assert len(parse_reply(TWO_CALLS, fns)[1]) == 2


def test_langchain_chat_openai_tools_and_structured_output(server):
    """LangChain's ``ChatOpenAI`` as a user points it at the server: ``bind_tools(..., parallel_tool_calls=False)`` and
    ``with_structured_output(method="function_calling")`` (which sends ``parallel_tool_calls``: once a 400 "unknown
    field") answer with one call and a parsed object; a plain ``invoke`` answers text."""
    lc = pytest.importorskip("langchain_openai")
    url, p = server
    _ready(url, p)
    llm = lc.ChatOpenAI(base_url=url + "/v1", api_key=KEY, model="x", temperature=0, max_tokens=60, max_retries=0,
                        timeout=300)
    m = llm.bind_tools(WEATHER, tool_choice="get_weather", parallel_tool_calls=False).invoke(ASK[0]["content"])
    assert [c["name"] for c in m.tool_calls] == ["get_weather"]
    jsonschema.validate(m.tool_calls[0]["args"], WEATHER[0]["function"]["parameters"])
    city = {"title": "City", "description": "A city and its country", "type": "object",
            "properties": {"name": {"type": "string", "maxLength": 12}, "country": {"type": "string", "maxLength": 12}},
            "required": ["name", "country"]}
    out = llm.with_structured_output(city, method="function_calling").invoke("Name a city in France.")
    assert isinstance(out, dict) and isinstance(out["name"], str) and isinstance(out["country"], str), out
    assert isinstance(llm.bind(max_tokens=4).invoke("Hi").content, str)
