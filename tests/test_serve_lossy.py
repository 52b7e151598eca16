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
