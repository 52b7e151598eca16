"""``epqlab serve`` with the lossy knobs of batched steps (``--expert-budget``, ``--route-bias batch``): the banner
says the answers are lossy, concurrent requests (one batched step) all answer, the answers differ from an exact
server's where the budget bites, and a bad value stops the server before it loads, naming the range."""
from __future__ import annotations

import concurrent.futures
import subprocess
import sys

import pytest

from test_serve import _wait_ready, httpx, served

PROMPTS = ["The river rose through the night and", "A CPU cache is a small, fast memory", "In 1905 Einstein published",
           "Bread dough rises because"]


def _answers(url):
    def one(p):
        r = httpx.post(url + "/v1/completions", json={"prompt": p, "max_tokens": 8, "temperature": 0}, timeout=300)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as ex:
        return list(ex.map(one, PROMPTS))


@pytest.mark.slow
def test_serve_expert_budget_answers_batched_requests(default_model_path):
    with served(default_model_path, "--n-ctx", 256, "--max-batch", 4, "--batch-window-ms", 200) as (url, p):
        _wait_ready(url, p)
        exact = _answers(url)
    with served(default_model_path, "--n-ctx", 256, "--max-batch", 4, "--batch-window-ms", 200, "--expert-budget", 3,
                "--route-bias", "batch", "--route-delta", "0.1") as (url, p):
        _wait_ready(url, p)
        lossy = _answers(url)
        p.terminate()
        out = p.communicate(timeout=30)[0]
    assert "LOSSY routing on" in out and "expert_budget=3" in out and "route_bias=batch" in out
    assert all(isinstance(t, str) and t for t in lossy)
    assert lossy != exact  # 4 sequences' union (up to 8 experts per layer) capped at 3 changes some answer


def test_serve_refuses_a_bad_budget_before_loading(default_model_path):
    from test_serve import _free_port

    r = subprocess.run([sys.executable, "-m", "epqlab", "serve", str(default_model_path), "--port", str(_free_port()),
                        "--expert-budget", "0"], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "expert_budget is the most distinct experts" in r.stderr


def test_a_budget_that_cannot_bind_is_not_called_lossy():
    """``--expert-budget 1000000`` (or any >= the experts of a layer) never binds: the banner names it a no-op
    instead of announcing LOSSY answers; a budget that can bind, or another knob beside it, is still LOSSY."""
    from epqlab.commands.run import lossy_kwargs
    from epqlab.commands.serve import lossy_banner

    class A:
        skip_cold = route_bias = route_delta = adaptive_k = None
        expert_budget = 1_000_000

    (line,) = lossy_banner(lossy_kwargs(A), 8)
    assert "no-op" in line and "LOSSY" not in line
    assert lossy_banner({"expert_budget": 8}, 8)[0].endswith("no step can read more")
    assert lossy_banner({"expert_budget": 7}, 8) == ["epqlab: LOSSY routing on (answers differ from exact decoding): "
                                                    "expert_budget=7"]
    both = lossy_banner({"expert_budget": 9, "route_bias": "batch", "route_delta": 0.1}, 8)
    assert "no-op" in both[0] and both[1].endswith("route_bias=batch, route_delta=0.1")
    assert lossy_banner({"expert_budget": None, "skip_cold": None}, 8) == []
