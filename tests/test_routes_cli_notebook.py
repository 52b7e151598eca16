"""`epqlab routes LOG` and notebooks/02_route_overlap.ipynb on hand-built and synthetic logs."""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from notebooks import run_notebook  # noqa: E402

from epqlab.cli import main  # noqa: E402
from epqlab.routes import RouteLog  # noqa: E402


def test_cli_routes(tmp_path, capsys):
    # one layer, k=1, trace 0 1 2 0 1: at 2 slots LRU hits 0 of 5, Belady 1 of 5
    p = tmp_path / "r.npz"
    RouteLog.from_arrays([[[e]] for e in [0, 1, 2, 0, 1]], n_expert=3).save(p)
    assert main(["routes", str(p), "--capacities", "2,3"]) == 0
    out = capsys.readouterr().out
    row2 = next(line.split() for line in out.splitlines() if line.startswith("2 "))
    assert row2 == ["2", "0.0000", "0.0000", "0.0000", "0.2000"]
    row3 = next(line.split() for line in out.splitlines() if line.startswith("3 "))
    assert row3[1:] == ["0.4000"] * 4          # everything fits: 2 reuses of 5


def test_cli_routes_errors(tmp_path, capsys):
    assert main(["routes", str(tmp_path / "missing.npz")]) == 1
    assert "does not exist" in capsys.readouterr().err
    p = tmp_path / "r.npz"
    RouteLog.from_arrays([[[0, 1]]], n_expert=2).save(p)
    assert main(["routes", str(p), "--capacities", "1"]) == 1
    assert "< k = 2" in capsys.readouterr().err


def test_notebook_02_synthetic(tmp_path):
    r = run_notebook("02_route_overlap", {"synthetic": True, "n_tokens": 24, "capacities": [4, 8, 64]}, tmp_path)
    assert r["source"].startswith("synthetic log") and r["parameters"]["synthetic"] is True
    assert r["log"]["n_tokens"] == 24 and r["log"]["k"] == 4 and r["log"]["requests"] == 24 * 8 * 4
    sim = {(s["policy"], s["capacity"]): s for s in r["simulation"]}
    assert set(sim) == {(p, c) for p in ("lru", "ls", "ls_pos", "belady") for c in (4, 8, 64)}
    # 64 slots per layer = every expert: only first touches miss, for every policy; Belady is never behind
    assert len({sim[(p, 64)]["misses"] for p in ("lru", "ls", "ls_pos", "belady")}) == 1
    for c in (4, 8, 64):
        assert sim[("belady", c)]["hit_rate"] >= sim[("lru", c)]["hit_rate"]
        assert sim[("lru", c)]["hits"] + sim[("lru", c)]["misses"] == 24 * 8 * 4
    assert [u["k"] for u in r["union"]] == list(range(1, 17))
    assert r["union"][0]["union"] == pytest.approx(4.0)       # U(1) = k
    for name in ("hit_rate", "reuse", "union", "popularity"):
        assert os.path.getsize(tmp_path / "results" / "02_route_overlap" / r["figures"][name]) > 1000


def test_notebook_02_records_a_real_log(tmp_path, default_model_path):
    """With no log given, the notebook records one from the default model with a Session."""
    import epqlab

    lay = epqlab.inspect(default_model_path)
    r = run_notebook("02_route_overlap", {"n_tokens": 12, "capacities": [lay.n_expert_used, lay.n_expert]}, tmp_path)
    assert "recorded with a Session" in r["source"] and r["log"]["meta"]["k"] == lay.n_expert_used
    assert r["log"]["k"] == lay.n_expert_used
    n = r["log"]["n_tokens"]
    assert r["log"]["requests"] == n * len(lay.layers) * lay.n_expert_used
    # capacity = n_expert slots per layer: every policy misses only on first touches
    sim = {(s["policy"], s["capacity"]): s for s in r["simulation"]}
    assert len({sim[(p, lay.n_expert)]["misses"] for p in ("lru", "ls", "ls_pos", "belady")}) == 1
