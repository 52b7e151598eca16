"""bench/bench_overlap.py's bounds (issue 14), from hand-computed runs: the ratio of the means and the
per-token ratio sum_i wall_i / sum_i max(T_dev_i, T_compute_i)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def bench():
    path = Path(__file__).resolve().parent.parent / "bench" / "bench_overlap.py"
    spec = importlib.util.spec_from_file_location("bench_overlap", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _run(wall, busy, comp):
    n = len(wall)
    return {"status": "PASS", "stats": {
        "time_split": {"wall_ms": sum(wall) / n, "io_busy_ms": sum(busy) / n, "t_compute_ms": sum(comp) / n},
        "time_split_tokens": {"wall_ms": wall, "io_busy_ms": busy, "t_compute_ms": comp}}}


def test_per_token_bound_hand_computed(bench):
    # off: step 1 is I/O bound (900 ms of reads), steps 2-3 compute bound; compute 200 ms per step
    off = [_run([1100, 250, 250], [900, 50, 50], [200, 200, 200]), _run([1000, 260, 240], [800, 60, 40], [200, 210, 190])]
    pf = [_run([950, 210, 205], [900, 60, 40], [190, 190, 190])]
    raw = {"off": off, "trained": pf}
    bench.bound_ratios(raw)
    # off medians of compute per step: 200, 205, 195; the mean compute of the off runs: 200 (both)
    assert pf[0]["ratio_tok"] == pytest.approx((950 + 210 + 205) / (900 + 205 + 195))
    # the ratio of the means: 455 / max(333.3, 200)
    assert pf[0]["ratio"] == pytest.approx((1365 / 3) / (1000 / 3))
    assert off[0]["ratio_tok"] == pytest.approx(1600 / (900 + 205 + 195))
    row = bench.summarize("trained", [dict(r, text="x", disk_mb_s=None) | {"stats": dict(
        r["stats"], decode_tok_s=3.0, decode_passes=3, prefetch_precision=0.9, prefetch_recall=0.9, prefetch_wasted_bytes=0,
        decode_hit_rate=0.9, decode_ssd_bytes_per_token=1e6, read_us=1, bytes_read=1, arena_bytes=1, io_threads=1)}
        for r in pf])
    assert row["ratio_tok"] == pytest.approx(pf[0]["ratio_tok"])
    assert "per-token bound" in bench.table([row])
