"""bench/bench_seed_scale.py and bench/bench_busy_core.py end to end on the default model with tiny parameters:
the plain reference is timed once per round (interleaved), every (level, prefetch) pair gets a row, and each
row's ratios are the bench's stated formulas applied to its own numbers (docs/DESIGN.md §3e, the roofline)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"


def _run(args, timeout=600):
    p = subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    return p.stdout


def test_seed_scale_rows_and_ratios(default_model_path, tmp_path):
    out = tmp_path / "s.json"
    text = _run([BENCH / "bench_seed_scale.py", "--model", default_model_path, "--levels", "512MiB", "--n", "5",
                 "--repeats", "2", "--mmap-n", "0", "--prefill", "0", "--prefetch", "off,lookahead", "--json", out])
    r = json.loads(out.read_text())
    assert text.count("[plain] round") == 2  # one plain run after each of the 2 rounds
    plain = r["plain"]
    assert len(plain["ms_per_token_runs"]) == 2
    assert plain["ms_per_token"] == pytest.approx(sorted(plain["ms_per_token_runs"])[0] / 2 + sorted(plain["ms_per_token_runs"])[1] / 2)
    rows = r["rows"]
    assert [x["prefetch"] for x in rows] == ["off", "lookahead"]
    bw = r["probe_mb_s"] * 1e6
    paged = {p["variant"]: p for p in r["paged"]["rows"]}
    assert set(paged) == {"off", "lookahead"} and all(p["runs"] == 2 for p in paged.values())
    for x in rows:
        p = paged[x["prefetch"]]
        assert x["ms_per_token"] == pytest.approx(1000.0 / p["decode_tok_s"])
        io_ms = 1000.0 * p["ssd_mb_per_token"] * 1e6 / bw  # miss bytes per token / probe bandwidth
        assert x["io_ms"] == pytest.approx(io_ms)
        assert x["bound_ms"] == pytest.approx(max(plain["ms_per_token"], io_ms))
        assert x["roofline_ratio"] == pytest.approx(x["ms_per_token"] / x["bound_ms"])
        assert x["plain_ratio"] == pytest.approx(plain["ms_per_token"] / x["ms_per_token"])
        assert x["time_split"]["wall_ms"] > 0
    assert "| 512.00 MiB | lookahead |" in text


def test_busy_core_table(default_model_path, tmp_path):
    """The slowdowns and the paged / plain ratio are worked out here from the runs the bench wrote (medians of the
    busy and quiet ms/token), and the printed table shows them rounded."""
    import statistics

    out = tmp_path / "b.json"
    text = _run([BENCH / "bench_busy_core.py", "--model", default_model_path, "--budget", "512MiB", "--n", "4",
                 "--repeats", "1", "--threads", "1", "--json", out])
    rows = [line for line in text.splitlines() if line.startswith("| plain |") or line.startswith("| paged |")]
    assert len(rows) == 2, text
    r = json.loads(out.read_text())["rows"]
    assert set(r) == {"plain", "paged"}

    def slow(x):
        return statistics.median(x["busy_ms_runs"]) / statistics.median(x["quiet_ms_runs"])

    assert r["plain"]["slowdown"] == pytest.approx(slow(r["plain"]))
    assert r["paged"]["slowdown"] == pytest.approx(slow(r["paged"]))
    assert r["paged"]["vs_plain"] == pytest.approx(slow(r["paged"]) / slow(r["plain"]))
    assert float(rows[1].split("|")[5]) == pytest.approx(r["paged"]["vs_plain"], abs=0.0051)  # printed to 2 decimals
    assert float(rows[0].split("|")[4]) == pytest.approx(r["plain"]["slowdown"], abs=0.0051)


def test_seed_scale_addressing_variants():
    """--addressing crosses every prefetch setting with each addressing (names "PREFETCH ADDRESSING"), --io-uring
    with each read path ("PREFETCH uring|pread"), and the defaults (auto, off) leave the prefetch variants as they are."""
    import argparse
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_seed_scale", BENCH / "bench_seed_scale.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    a = argparse.Namespace(prefetch="off,lookahead", predictor=None, model="m.gguf", addressing="slots,region", io_uring="off")
    assert mod.prefetch_variants(a) == {
        "off slots": {"expert_addressing": "slots"}, "off region": {"expert_addressing": "region"},
        "lookahead slots": {"prefetch": "lookahead", "expert_addressing": "slots"},
        "lookahead region": {"prefetch": "lookahead", "expert_addressing": "region"}}
    a.addressing = "auto"
    assert mod.prefetch_variants(a) == {"off": {}, "lookahead": {"prefetch": "lookahead"}}
    a.io_uring = "on,off"  # --io-uring crosses them again: io_uring reads against pread (docs/DESIGN.md §3e)
    assert mod.prefetch_variants(a) == {
        "off uring": {"io_uring": True}, "off pread": {"io_uring": False},
        "lookahead uring": {"prefetch": "lookahead", "io_uring": True},
        "lookahead pread": {"prefetch": "lookahead", "io_uring": False}}
    a.io_uring = "on"
    assert mod.prefetch_variants(a) == {"off": {"io_uring": True}, "lookahead": {"prefetch": "lookahead", "io_uring": True}}
