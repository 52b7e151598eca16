"""``epqlab plan`` end to end on the default model: the printed forecast table and its JSON, ``--verify``'s
forecast-vs-measured rows, the Python API (``Session(model, **plan.best.session_kwargs())`` opens as is), the
calibration inside its budget under a hard limit, and bad input: one line on stderr, exit status 2, no file
half-written."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import epqlab
from epqlab.studies.plan import HEADROOM
from epqlab.studies.plan_probe import cache_path

N = "16"


def _plan(*args, cache, timeout=900):
    env = {**os.environ, "EPQLAB_CACHE": str(cache)}
    return subprocess.run([sys.executable, "-m", "epqlab", "plan", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("plancache")


@pytest.fixture(scope="module")
def verified(default_path, cache, tmp_path_factory):
    out = tmp_path_factory.mktemp("plan") / "plan.json"
    r = _plan(str(default_path), "--budgets", "auto", "-n", N, "--threads", "1", "--verify", "--repeats", "1", "--row-policies", "best",
              "--json", str(out), cache=cache)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout, json.loads(out.read_text())


ROW = re.compile(r"^\s+([\d.]+ [KMG]iB)\s+([\d.]+)\s+(\w+)\s+(off|lookahead|trained)\s+([\d.]+)\s+([\d.]+)(\s+[\d.]+){8}"
                 r"\s+([\d.]+)\s+([+-][\d.]+)$")


def test_verify_prints_forecast_against_measured(verified):
    text, doc = verified
    rows = [m for m in (ROW.match(l) for l in text.splitlines()) if m]
    assert len(rows) == len(doc["rows"]) >= 4, text
    for m, d in zip(rows, doc["rows"]):
        assert m.group(3) == d["policy"] and m.group(4) == d["prefetch"]
        measured, err = float(m.group(8)), float(m.group(9))
        assert measured == pytest.approx(d["measured_tok_s"], abs=0.01)
        # the printed error is (forecast - measured) / measured of the JSON's own numbers
        assert err == pytest.approx(100 * (d["decode_tok_s"] - d["measured_tok_s"]) / d["measured_tok_s"], abs=0.06)
    assert "recommended:" in text and "Session(" in text and "epqlab run " in text
    assert re.search(r"\|error\|: median [\d.]+%, max [\d.]+% over \d+ rows", text)


def test_budgets_auto_cover_the_arena_and_the_calibration_stays_inside_its_limit(verified):
    _, doc = verified
    b = doc["budgets"]
    assert b == sorted(b) and len(b) >= 3
    cov = {r["budget"]: r["coverage"] for r in doc["rows"] if r["prefetch"] == "off"}
    assert cov[b[0]] < 0.5 and cov[b[-1]] == 1.0
    for name, c in doc["calibration"].items():
        # each calibration run's child had ram_budget = the smallest budget and a hard limit 16 MiB above it
        assert c["limit_mode"] in ("cgroup-v1", "cgroup-v2", "sampled"), c
        assert 0 < c["peak_charged"] <= b[0] + HEADROOM, (name, c["peak_charged"], b[0])
        assert c["n_steps"] >= int(N) - 1


def test_terms_reproduce_each_row(verified):
    """Every row's ms/token is the sum of its printed parts, and its tok/s their inverse. The smallest auto budget
    holds 1/8 of the experts, fewer than top-3 of each layer, so C0 is plain llama.cpp's µs per step inside the same
    limit (its own run's tok/s, inverted here)."""
    _, doc = verified
    t = doc["terms"]["off"]
    assert t["notes"]["compute_fit"] == "plain", t["notes"]
    assert t["compute_us"] == pytest.approx(1e6 / doc["calibration"]["plain"]["decode_tok_s"])
    for r in doc["rows"]:
        assert r["decode_ms"] == pytest.approx(r["compute_ms"] + r["io_ms"] + r["map_ms"] + r["predict_ms"])
        assert r["decode_tok_s"] == pytest.approx(1000 / r["decode_ms"])
        t = doc["terms"]["off"]
        if r["prefetch"] == "off":  # C0 + kappa x the MB its misses read + c_wait x the layers that wait
            assert r["compute_ms"] == pytest.approx((t["compute_us"] + t["kappa_us_per_mb"] * r["miss_mb_per_token"]
                                                     + t["wait_us_per_layer"] * r["waits_per_token"]) / 1e3)


def test_python_api_session_kwargs_open_as_is(default_path, verified):
    """``Session(model, **best.session_kwargs())`` in a fresh process, as a user's script runs it (this pytest
    process holds more before its arena than the child the plan measured: the smallest budgets of the default
    model leave an arena of a few MiB)."""
    _, doc = verified
    kw = doc["best"]["session_kwargs"]
    code = ("import json, sys, epqlab\n"
            "kw = json.loads(sys.argv[2])\n"
            "with epqlab.Session(sys.argv[1], n_threads=1, **kw) as s:\n"
            "    print(json.dumps({'tokens': len(s.generate('Hello', 2).tokens), 'policy': s.pager.policy}))\n")
    r = subprocess.run([sys.executable, "-c", code, str(default_path), json.dumps(kw)], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["tokens"] == 2 and out["policy"] == kw["policy"]


def test_probe_cache_reused_and_refused_when_corrupt(default_path, cache, tmp_path):
    p = cache_path(default_path, cache)
    assert p.is_file()  # written by the verified plan above
    good = p.read_text()
    try:
        p.write_text("{not json")
        r = _plan(str(default_path), "--budgets", "1GiB", "-n", N, "--json", str(tmp_path / "x.json"), cache=cache)
        assert r.returncode == 2 and "corrupt" in r.stderr and "--reprobe" in r.stderr, r.stderr
        assert r.stderr.count("\n") == 1 and not (tmp_path / "x.json").exists()
        d = json.loads(good)
        d["st_dev"] += 1
        p.write_text(json.dumps(d))
        r = _plan(str(default_path), "--budgets", "1GiB", "-n", N, cache=cache)
        assert r.returncode == 2 and "probed for device" in r.stderr, r.stderr
    finally:
        p.write_text(good)
    assert not list(p.parent.glob("*.part"))


def test_compute_term_from_the_resident_run(default_path, cache, tmp_path):
    """At 1 GiB the default model's arena holds every expert, so plan adds the resident run (cache-aware routing, a
    margin of 1): C0 is the median compute of its steps that read nothing, recomputed here from the run's own
    per-step series (wall - compute <= 2% of wall), and the printed terms say so."""
    out = tmp_path / "x.json"
    r = _plan(str(default_path), "--budgets", "1GiB", "-n", N, "--threads", "1", "--json", str(out), cache=cache)
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(out.read_text())
    res = doc["calibration"]["resident"]
    wall, comp = np.array(res["step_wall_us"]), np.array(res["step_compute_us"])
    zero = comp[(wall - comp) <= 0.02 * wall]
    assert zero.size >= 4
    t = doc["terms"]["off"]
    assert t["notes"]["compute_fit"] == "resident" and t["notes"]["resident_steps"] == zero.size
    assert t["compute_us"] == pytest.approx(float(np.median(zero)))
    assert t["kappa_us_per_mb"] == 0 and t["wait_us_per_layer"] >= 0
    assert f"resident run's {zero.size} steps that read nothing" in r.stdout
    assert 0 < res["peak_charged"] <= 2**30 + HEADROOM


def test_budget_below_the_minimum_quotes_the_smallest(default_path, cache, tmp_path):
    r = _plan(str(default_path), "--budgets", "100MiB,1GiB", "-n", N, "--json", str(tmp_path / "x.json"), cache=cache)
    assert r.returncode == 2, r.stderr
    assert "too small" in r.stderr and "smallest budget that works is" in r.stderr
    assert r.stderr.count("\n") == 1 and not (tmp_path / "x.json").exists()


@pytest.mark.parametrize("case", ["short-text", "few-steps", "pipe", "tmpfs", "foreign-predictor", "bad-budgets"])
def test_bad_input_is_one_line_and_exit_2(default_path, cache, tmp_path, case):
    args = [str(default_path), "--budgets", "1GiB", "-n", N]
    want = {"short-text": "too short", "few-steps": "n must be >= 16", "pipe": "not a regular file",
            "tmpfs": "O_DIRECT", "foreign-predictor": "another model", "bad-budgets": "budgets"}[case]
    if case == "short-text":
        (tmp_path / "t.txt").write_text("only a few words here\n\nand a few more")
        args += ["--text", str(tmp_path / "t.txt")]
    elif case == "few-steps":
        args[-1] = "8"
    elif case == "pipe":
        os.mkfifo(tmp_path / "m.gguf")
        args[0] = str(tmp_path / "m.gguf")
    elif case == "tmpfs":
        shm = Path("/dev/shm")
        if not shm.is_dir() or os.statvfs(shm).f_bavail * os.statvfs(shm).f_frsize < 2 * os.path.getsize(default_path):
            pytest.skip("no tmpfs with room for the model")
        dst = shm / f"epq-plan-{os.getpid()}.gguf"
        shutil.copy(default_path, dst)
        args[0] = str(dst)
    elif case == "foreign-predictor":
        from epqlab.engine.predictor import ExpertPredictor
        lay = epqlab.inspect(default_path)
        n_embd = 576
        W = np.zeros((1, len(lay.layers), lay.n_expert, n_embd), np.float32)
        ExpertPredictor(W, np.zeros(W.shape[:3], np.float32), (0.1,), 100, "0" * 40).save(tmp_path / "p.npz")
        args += ["--predictor", str(tmp_path / "p.npz")]
    elif case == "bad-budgets":
        args[2] = "plenty"
    try:
        r = _plan(*args, "--json", str(tmp_path / "x.json"), cache=cache, timeout=300)
    finally:
        if case == "tmpfs":
            dst.unlink(missing_ok=True)
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert want in r.stderr and r.stderr.startswith("epqlab plan: error:") and r.stderr.count("\n") == 1, r.stderr
    assert not (tmp_path / "x.json").exists()


def test_notebook_08_defaults(tmp_path, default_path):
    """notebooks/08_plan.ipynb with its defaults (verify on, one run per row) on the default model, and the paper
    rendered from its JSON: the paper's table carries the JSON's forecast and measured numbers."""
    from notebooks import run_notebook
    from epqlab.papers import write_papers

    doc = run_notebook("08_plan", {"model": str(default_path)}, tmp_path, cell_timeout=900)
    assert doc["notebook"] == "08_plan" and doc["verified"] and doc["parameters"]["n"] == 32
    assert all(r["measured_tok_s"] for r in doc["rows"])
    papers = write_papers(tmp_path / "results", tmp_path / "papers")
    md = (tmp_path / "papers" / "08_plan.md").read_text()
    assert any(p.endswith("08_plan.md") for p in papers) and md.startswith("# 08 · Plan")
    for r in doc["rows"]:
        assert f"{r['decode_tok_s']:.3g}" in md and f"{r['measured_tok_s']:.3g}" in md
    assert "median |error|" in md
