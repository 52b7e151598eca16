"""``epqlab tune``: the selection rule on hand-built frontiers, the paired cost interval by hand, and the command on
the default model (exact at --quality 0, LOSSY rows labelled, bad --quality refused with exit 2)."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pandas as pd
import pytest

from epqlab.studies.plan import PlanInputError
from epqlab.studies.paired import ratio_interval, worded
from epqlab.studies.tune import paired_cost, parse_quality, pick


def test_paired_cost_by_hand():
    # d = [0, 1, 2]: mean 1, sd 1, se 1/sqrt(3)
    c, lo, hi = paired_cost([1.0, 2.0, 3.0], [1.0, 1.0, 1.0])
    se = 1 / math.sqrt(3)
    assert c == pytest.approx(math.e - 1)
    assert lo == pytest.approx(math.exp(1 - 1.96 * se) - 1) and hi == pytest.approx(math.exp(1 + 1.96 * se) - 1)
    with pytest.raises(ValueError, match="same scored tokens"):
        paired_cost([1.0], [1.0, 2.0])
    # as ratios: 1 + each cost; the words say when the interval holds x1
    r, lo, hi = ratio_interval([1.0, 2.0, 3.0], [1.0, 1.0, 1.0])
    assert (r, lo, hi) == pytest.approx((math.e, math.exp(1 - 1.96 * se), math.exp(1 + 1.96 * se)))
    # d = [-0.02, 0.01, 0.0, -0.01]: mean -0.005, sd sqrt(0.0005 / 3), se = sd / 2 = 0.006455
    r, lo, hi = ratio_interval([0.98, 1.01, 1.0, 0.99], [1.0] * 4)
    assert (r, lo, hi) == pytest.approx((math.exp(-0.005), math.exp(-0.005 - 1.96 * 0.0064550), math.exp(
        -0.005 + 1.96 * 0.0064550)), rel=1e-6)
    assert worded(r, lo, hi, 4) == "x0.995 (95% x0.983..x1.008 over 4 tokens: not distinguishable from exact)"
    assert worded(1.02, 1.01, 1.03, 400) == "x1.020 (95% x1.010..x1.030 over 400 tokens)"


def _frame(b_speed, b_spread=0.5):
    return pd.DataFrame({"label": ["A exact", "B lossy"], "lossy": [False, True],
                         "decode_tok_s": [10.0, b_speed], "tok_s_min": [9.5, b_speed - b_spread],
                         "tok_s_max": [10.5, b_speed + b_spread]})


EXACT = [2.0, 2.1, 1.9, 2.0, 2.2, 1.8, 2.0, 2.0]
SMALL = [x + d for x, d in zip(EXACT, [0.001, 0.002, 0.0, 0.001, 0.002, 0.0, 0.001, 0.001])]  # ~+0.1%
LARGE = [x + 0.05 for x in EXACT]                                                               # +5.1%


def test_lossy_wins_only_when_faster_beyond_noise_and_within_budget():
    f, top, why = pick(_frame(15.0), {"A exact": EXACT, "B lossy": SMALL}, 0.005)
    assert top.label == "B lossy" and "LOSSY" in why
    assert list(f.label) == ["B lossy", "A exact"] and f.qualifies.all()
    # the same at quality 0: nothing lossy is allowed
    _, top, _ = pick(_frame(15.0), {"A exact": EXACT, "B lossy": SMALL}, 0.0)
    assert top.label == "A exact"
    # over the budget: its cost interval reaches +5%
    f, top, _ = pick(_frame(15.0), {"A exact": EXACT, "B lossy": LARGE}, 0.005)
    assert top.label == "A exact" and not f.set_index("label").loc["B lossy", "qualifies"]
    # faster, but not by more than the speed noise (10.4 vs 10 with a 10% spread)
    _, top, why = pick(_frame(10.4, 0.5), {"A exact": EXACT, "B lossy": SMALL}, 0.005)
    assert top.label == "A exact" and "noise" in why
    # a lower perplexity by noise does not make a LOSSY setting free at quality 0
    _, top, _ = pick(_frame(15.0), {"A exact": EXACT, "B lossy": [x - 0.01 for x in EXACT]}, 0.0)
    assert top.label == "A exact"


def test_quality_parsing():
    assert parse_quality("0.5%") == pytest.approx(0.005) and parse_quality(0.01) == 0.01 and parse_quality("0") == 0
    for bad in ("80%", "-1%", "lots", "nan"):
        with pytest.raises(PlanInputError):
            parse_quality(bad)


@pytest.fixture(scope="module")
def tuned(default_path, tmp_path_factory):
    out = tmp_path_factory.mktemp("tune") / "tune.json"
    env = {**os.environ, "EPQLAB_CACHE": str(tmp_path_factory.mktemp("tunecache"))}
    r = subprocess.run([sys.executable, "-m", "epqlab", "tune", str(default_path), "--quality", "0", "-n", "16",
                        "--repeats", "1", "--threads", "1", "--json", str(out)], capture_output=True, text=True,
                       timeout=1200, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout, json.loads(out.read_text())


def test_quality_zero_picks_an_exact_setting(tuned):
    text, doc = tuned
    assert doc["best"]["lossy"] is False and doc["quality"] == 0
    rows = doc["frontier"]
    assert any(r["lossy"] for r in rows) and any(not r["lossy"] for r in rows)
    # every LOSSY candidate is labelled in the printed frontier; exact ones cost nothing
    for r in rows:
        line = next(l for l in text.splitlines() if l.strip().startswith(r["label"]))
        assert ("LOSSY" in line) == r["lossy"]
        if not r["lossy"]:
            assert r["cost"] == 0.0
    assert "winner:" in text and "(LOSSY)" not in text.split("winner:", 1)[1].splitlines()[0]


@pytest.mark.parametrize("q", ["80%", "much"])
def test_bad_quality_exit_2(default_path, q):
    r = subprocess.run([sys.executable, "-m", "epqlab", "tune", str(default_path), "--quality", q],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.startswith("epqlab tune: error:") and "--quality" in r.stderr
    assert r.stderr.count("\n") == 1
