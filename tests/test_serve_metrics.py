"""``GET /metrics`` (epqlab/server/metrics.py) parsed by prometheus_client's own text parser: the request counters
equal the requests this test sent (by route and status, 401 and 400 included), the token counters equal the usage
the answers reported, the arena figures the Session's; the API key guards it. And the memory follower's floor: while
the arena is at its smallest with memory still short, a new generation gets 503 with Retry-After, tokenizing still
works, and once memory returns requests are served again (docs/DESIGN.md §5 "Following memory")."""
from __future__ import annotations

import psutil
import pytest

import epqlab

pytest.importorskip("fastapi")
pytest.importorskip("sse_starlette")
parser = pytest.importorskip("prometheus_client.parser")
KEY = "sk-m-1"
H = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def client(default_model_path):
    from fastapi.testclient import TestClient

    from epqlab.server import create_app

    big = psutil.Process().memory_info().rss + 768 * 2**20
    with epqlab.Session(default_model_path, ram_budget=big, follow_memory=True, n_threads=1, n_ctx=256,
                        n_seq_max=2) as s, TestClient(create_app(s, api_key=KEY)) as c:
        yield s, c


def _scrape(c) -> dict:
    r = c.get("/metrics", headers=H)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    out = {}
    for fam in parser.text_string_to_metric_families(r.text):
        for smp in fam.samples:
            out[(smp.name, tuple(sorted(smp.labels.items())))] = smp.value
    return out


def test_metrics_count_what_was_sent(client):
    s, c = client
    before = _scrape(c)
    usage = []
    for p in ("The river rose", "A CPU cache is"):
        r = c.post("/v1/completions", headers=H, json={"prompt": p, "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200
        usage.append(r.json()["usage"])
    assert c.post("/v1/completions", headers=H, json={"prompt": "x", "temperature": 9}).status_code == 400
    assert c.post("/v1/completions", json={"prompt": "x"}).status_code == 401
    assert c.get("/metrics").status_code == 401  # the key guards it too
    m = _scrape(c)

    def delta(name, **labels):
        k = (name, tuple(sorted(labels.items())))
        return m.get(k, 0) - before.get(k, 0)

    assert delta("epqlab_requests_total", route="/v1/completions", status="200") == 2
    assert delta("epqlab_requests_total", route="/v1/completions", status="400") == 1
    assert delta("epqlab_requests_total", route="/v1/completions", status="401") == 1
    assert delta("epqlab_requests_total", route="/metrics", status="401") == 1
    assert delta("epqlab_prompt_tokens_total") == sum(u["prompt_tokens"] for u in usage)
    assert delta("epqlab_generated_tokens_total") == sum(u["completion_tokens"] for u in usage) == 8
    assert delta("epqlab_requests_finished_total", reason="length") == 2
    # each request's first token comes from its prefill; the other three from decode steps
    assert delta("epqlab_decode_tokens_total") == 6 and delta("epqlab_decode_seconds_total") > 0
    assert m[("epqlab_arena_bytes", ())] == s.pager.arena_bytes
    assert m[("epqlab_arena_slots", ())] == s.pager.n_slots
    assert m[("epqlab_ram_budget_bytes", ())] == s.budget_bytes
    assert m[("epqlab_active_sequences", ())] == 0 and m[("epqlab_queue_depth", ())] == 0
    st = s.stats
    assert m[("epqlab_expert_requests_total", ())] == st["requests"] and m[("epqlab_expert_hits_total", ())] == st["hits"]


def test_memory_floor_answers_503_and_recovers(client):
    s, c = client
    f = s.memory_follower
    real_budget, real_period = f.budget_fn, f.period_s
    try:
        f.period_s, f._next = 0.0, 0.0  # look at every step from now on
        f.budget_fn = lambda: 1  # no headroom at all: shrink to the floor, then stay short
        r = c.post("/v1/completions", headers=H, json={"prompt": "Hi", "max_tokens": 3, "temperature": 0})
        assert r.status_code == 200  # admitted before the follower looked: it finishes
        assert s.budget_bytes == f.floor() and f.floor_under_pressure
        r = c.post("/v1/completions", headers=H, json={"prompt": "Hi", "max_tokens": 3})
        assert r.status_code == 503 and r.headers["retry-after"] == "5"
        assert "short of memory" in r.json()["error"]["message"]
        assert c.post("/tokenize", headers=H, json={"input": "Hi"}).status_code == 200  # generates nothing
        assert _scrape(c)[("epqlab_memory_floor_under_pressure", ())] == 1
        f.budget_fn = real_budget  # memory is back
        r = c.post("/v1/completions", headers=H, json={"prompt": "Hi", "max_tokens": 3, "temperature": 0})
        assert r.status_code == 200 and not f.floor_under_pressure
    finally:
        f.budget_fn, f.period_s = real_budget, real_period
