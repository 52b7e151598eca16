"""bench/bench_overlap.py's bounds (docs/DESIGN.md §3c), from hand-computed runs: the ratio of the means and the
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


def test_step_classes_hand_computed(bench):
    # compute 200 ms per step; disk busy 900 (I/O bound), 250 (balanced: < 1.5 x 200), 100 (compute bound)
    cls = bench.step_classes([950, 300, 220, 260], [900, 250, 100, 290], [200, 200, 200, 200])
    assert cls["io"] == [950, 900, 1]
    assert cls["balanced"] == [300 + 260, 250 + 290, 2]
    assert cls["compute"] == [220, 200, 1]
    raw = {"off": [{"step_classes": cls}, {"step_classes": cls}]}
    assert "| off | 2, 1.06 | 4, 1.04 | 2, 1.10 |" in bench.class_table(raw)


def test_decode_series_matches_the_split(tmp_path):
    """The per-step series in run stats average to the time split's per-token means."""
    import epqlab
    import epqlab.models

    with epqlab.Session(epqlab.models.default_model(progress=False), arena_bytes="6MiB", n_threads=1) as s:
        st = s.generate("A CPU cache is", 6).stats
    ts, tk = st["time_split"], st["time_split_tokens"]
    assert len(tk["wall_ms"]) == len(tk["io_busy_ms"]) == len(tk["t_compute_ms"]) == ts["calls"] == 5
    assert sum(tk["wall_ms"]) / 5 == pytest.approx(ts["wall_ms"], rel=1e-3)
    assert sum(tk["t_compute_ms"]) / 5 == pytest.approx(ts["t_compute_ms"], rel=1e-3)


def test_read_rate_limit_paces_reads():
    """With a 20 MB/s device model, generating takes at least the bytes read / 20 MB/s; without it, far less."""
    import time

    import epqlab
    import epqlab.models

    path = epqlab.models.default_model(progress=False)
    out = {}
    for rate in (None, 20_000_000):
        with epqlab.Session(path, arena_bytes="6MiB", n_threads=1, read_rate_limit=rate) as s:
            s.generate("A CPU cache is", 2)  # warm the arena's slots and llama's graph
            t0 = time.perf_counter()
            g = s.generate("Memory is paged in", 8)
            out[rate] = (time.perf_counter() - t0, g.stats["bytes_read"])
    t, b = out[20_000_000]
    assert b > 5_000_000 and t >= 0.95 * b / 20e6, out
    t0, b0 = out[None]
    assert t0 < 0.5 * b0 / 20e6, out  # the pacing is what made it slow, not the disk
    with pytest.raises(ValueError, match="drop pager=False"):
        epqlab.Session(path, pager=False, read_rate_limit="10MB")


def test_oracle_row_replays_a_recorded_run(bench, tmp_path):
    """The oracle row: its log is recorded by the bench itself, every prediction is right, and the tokens are
    the off row's."""
    import json

    out = tmp_path / "o.json"
    assert bench.main(["--rows", "off,oracle@2+pipeline", "--n-predict", "5", "--repeats", "1",
                       "--arena", "6MiB", "--limit", "1GiB", "--out", str(out)]) == 0
    rows = {r["row"]: r for r in json.loads(out.read_text())["rows"]}
    off, oracle = rows["off"], rows["oracle@2+pipeline"]
    assert off["status"] == oracle["status"] == "PASS"
    assert oracle["precision"] == 1.0 and oracle["recall"] == 1.0 and off["text"] == oracle["text"]
