"""Hiding expert I/O behind compute: prefetch predictors and segment-parallel reads, side by side.

Usage:
    .venv/bin/python bench/bench_overlap.py [--model PATH] [--limit 1.5GiB | --arena 1GiB]
        [--n-predict 16] [--repeats 3] [--threads 1] [--rows off,lookahead,previous,union,segments,union+segments]
        [--segment 512KiB] [--budget BYTES] [--read-mbps 350 | --device-mbps 350] [--predictor P.npz] [--policy lfu] [--out results/overlap.json]

Each run is its own child process (``epqlab.studies.strict.run``: a cgroup v1 child of this process's
memory cgroup with the limit set before the model loads, page cache of the model dropped first),
decoding **teacher-forced** on the held-out prose (one token per step: a random-weight model's own
greedy output repeats itself and routes alike), ``--threads`` compute threads. Rows: ``off`` (synchronous reads: a token costs T_io +
T_compute), ``lookahead`` / ``previous`` / ``union`` / ``trained`` (next-layer prefetch predictors,
epqlab.engine.prefetch; ``trained`` needs ``--predictor``, fitted by ``epqlab predictor fit`` on the shipped
calibration texts, never on this benchmark's prompt), ``oracle`` (the ceiling of every predictor:
the routes of a run of the same prompt recorded first, so what it still waits for is the mechanism's
own cost, not a wrong guess), ``segments`` (expert reads split into ``--segment`` pieces over the I/O threads),
``union+segments``, ``pipeline`` / ``<predictor>+pipeline`` (``Session(pipeline_reads=True)``: each
expert matmul waits only for its own matrix's reads); ``<predictor>@<d>`` prefetches d layers ahead
(``prefetch_depth``), ``<predictor>:<p>`` sets the gate (``prefetch_min_precision``; 0 = off). ``--read-mbps`` caps the device's read rate with a blkio cgroup so every row
sees the same device; but blk-throttle grants a group that was idle a slice's worth of bytes at once, which
favours bursty reads. ``--device-mbps`` instead paces the reads in the I/O pool on one device clock with no
burst credit (``Session(read_rate_limit=...)``, on top of the real reads).

This disk alternates between ~1.2 GB/s and a throttled ~0.45 GB/s, so the repeats are interleaved
(repeat 1 of every row, then repeat 2, ...), each run is preceded by a 128 MiB O_DIRECT read of the
model file (``disk MB/s``, a hint of the device's state then), and each run is held against a
bound made of its own I/O and the off rows' compute: time/token / max(T_dev, T_compute), where
T_dev is the run's disk-busy time per token (wall time with at least one expert read in progress,
``io_busy_ms`` of the time split: this run's bytes at the speed the disk had during this run,
wasted prefetch bytes included) and T_compute the median compute time of the ``off`` runs (their
time split minus io wait and map: compute not slowed by concurrent reads). A run whose reads were
completely hidden behind unslowed compute scores 1.0. Columns: decode tok/s (median, min-max),
time/token (median), the ratio (median over repeats, min-max), the per-token ratio sum_i wall_i /
sum_i max(T_dev_i, T_compute_i) (decode step i's own disk-busy time against the off runs' median compute
time of step i: the first steps after the prefill read most of their experts and are I/O bound while the
rest are compute bound, so the max of the means understates the bound; a second table splits the same
ratio by kind of step: I/O bound, balanced (T_dev_i within 1.5x T_compute_i), compute bound), T_dev (median), disk MB/s (median), read ms/MB
(the summed duration of the run's reads per MB: ~3 on the fast disk, ~6-7 throttled, at 6 I/O
threads), the row's own remaining I/O wait and compute time, prefetch precision / recall, MB read in vain per
token, decode hit rate and MB read per token.
"""
from __future__ import annotations

import argparse
import atexit
import mmap
import os
import shutil
import statistics
import sys
import tempfile
import time

from epqlab.data import heldout_texts
from epqlab.studies import strict, strict_report
from epqlab.results import write_json
from epqlab.units import fmt_bytes, parse_bytes

FORCED = heldout_texts()["prose"]
PROMPT = ("A CPU cache is a small, fast memory that sits between the processor and main memory. "
          "It keeps copies of recently used data so that")


PREDICTORS = ("lookahead", "previous", "union", "trained", "oracle")


def row_spec(name: str) -> tuple[str, str, str]:
    """(predictor or other first part, depth, gate) of a row name ``<predictor>[@depth][:min_precision][+...]``."""
    spec, _, gate = name.split("+")[0].partition(":")
    pf, _, depth = spec.partition("@")
    return pf, depth, gate


def row_kwargs(name: str, segment: int, budget: int | None, predictor: str | None = None,
               oracle_log: str | None = None) -> dict:
    """Session keyword arguments of a row name: ``<predictor>[@depth][:min_precision][+segments][+pipeline]``;
    ``oracle_log``: the route log oracle rows replay (:func:`record_oracle_log`)."""
    kw: dict = {}
    pf, depth, gate = row_spec(name)
    if pf in PREDICTORS:
        kw["prefetch"] = pf
        if depth:
            kw["prefetch_depth"] = int(depth)
        if gate:
            kw["prefetch_min_precision"] = float(gate)
        if pf == "union" and budget:
            kw["prefetch_budget"] = budget
        if pf == "trained":
            if not predictor:
                raise SystemExit("trained rows need --predictor PATH (epqlab predictor fit MODEL PATH)")
            kw["prefetch_predictor"] = predictor
        if pf == "oracle":
            kw["prefetch_predictor"] = oracle_log
            # recording decodes the prompt with every position's logits: the same prompt pass as the
            # recorded run's, so the same tokens and routes follow (this run's log is thrown away)
            kw["route_log"] = oracle_log + ".replay.npz"
    if "segments" in name:
        kw["read_segment_bytes"] = segment
    kw["pipeline_reads"] = "pipeline" in name  # explicit: the Session's default is on
    return kw


def record_oracle_log(model: str, limit: str, n_predict: int, kw: dict) -> str:
    """Record the route log the oracle rows replay: one run of PROMPT with the rows' settings, no prefetch,
    routes saved to a temporary folder (removed at exit). Returns its path; SystemExit if the run fails."""
    folder = tempfile.mkdtemp(prefix="epqlab-oracle-")
    atexit.register(shutil.rmtree, folder, True)
    path = os.path.join(folder, "routes.npz")
    df = strict.run(model, levels=limit, prompt=PROMPT, n_predict=n_predict, forced=FORCED, repeats=1, progress=False,
                    route_log=path, **kw)
    run = df.attrs["runs"][0]
    if run.get("status") != "PASS" or not os.path.exists(path):
        raise SystemExit(f"recording the oracle's route log failed: {run.get('reason')}")
    return path


def disk_mb_s(path: str, n_bytes: int = 128 << 20, block: int = 4 << 20) -> float | None:
    """O_DIRECT sequential read speed of ``path`` now (MB/s), from an offset that moves each call so
    the device, not a cache, answers. None where O_DIRECT is refused."""
    size = os.path.getsize(path)
    disk_mb_s.calls = getattr(disk_mb_s, "calls", 0) + 1
    start = (disk_mb_s.calls * 977 * block) % max(block, size - n_bytes) // block * block
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError:
        return None
    buf = mmap.mmap(-1, block)
    try:
        t0, done = time.perf_counter(), 0
        while done < n_bytes:
            r = os.preadv(fd, [buf], start + done)
            if r <= 0:
                break
            done += r
        return done / (time.perf_counter() - t0) / 1e6
    except OSError:
        return None
    finally:
        os.close(fd)
        buf.close()


def throttle_reads(path: str, mb_s: float) -> str:
    """Move this process (and so every child it starts) into a new cgroup v1 blkio child whose
    ``blkio.throttle.read_bps_device`` caps reads from the device holding ``path`` at ``mb_s`` MB/s:
    a device of fixed speed for side-by-side rows, below the slowest state of a device that
    changes speed on its own. Returns the cgroup's path. Raises RuntimeError naming the obstacle
    (no blkio hierarchy, a partition or a device the kernel refuses to throttle, no permission)."""
    root = "/sys/fs/cgroup/blkio"
    if not os.path.isdir(root):
        raise RuntimeError(f"--read-mbps needs the cgroup v1 blkio hierarchy at {root}; run without it")
    own = next((line.split(":", 2)[2].strip() for line in open("/proc/self/cgroup") if ":blkio:" in line), "/")
    dev = os.stat(path).st_dev
    cg = os.path.join(root, own.lstrip("/"), f"epqlab-bench-{os.getpid()}")
    try:
        os.makedirs(cg, exist_ok=True)
        with open(os.path.join(cg, "blkio.throttle.read_bps_device"), "w") as f:
            f.write(f"{os.major(dev)}:{os.minor(dev)} {int(mb_s * 1e6)}\n")
        with open(os.path.join(cg, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))
    except OSError as e:
        raise RuntimeError(f"cannot cap reads of {os.major(dev)}:{os.minor(dev)} at {mb_s} MB/s in {cg}: {e} "
                           "(a partition cannot be throttled, only its whole disk; needs write access to the "
                           "blkio cgroup); run without --read-mbps") from e
    atexit.register(_leave_cgroup, cg)
    return cg


def _leave_cgroup(cg: str) -> None:
    """At exit: back into the parent blkio cgroup, and remove the child made by throttle_reads."""
    try:
        with open(os.path.join(os.path.dirname(cg), "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))
        os.rmdir(cg)
    except OSError:
        pass  # a child still inside, or no permission: the empty cgroup is harmless


def summarize(name: str, runs: list[dict]) -> dict:
    st = [r["stats"] for r in runs if r.get("status") == "PASS"]
    if not st:
        return {"row": name, "status": "FAIL", "reason": runs[0].get("reason") if runs else "no runs"}
    med = statistics.median
    tok = [s["decode_tok_s"] for s in st]
    ts = [s.get("time_split") or {} for s in st]
    passes = [max(1, s["decode_passes"]) for s in st]
    return {
        "row": name, "status": "PASS", "runs": len(st),
        "decode_tok_s": med(tok), "decode_tok_s_min": min(tok), "decode_tok_s_max": max(tok),
        "time_per_token_ms": med(t.get("wall_ms", 0) for t in ts),
        "t_io_ms": med(t.get("t_io_ms", 0) for t in ts),
        "io_busy_ms": med(t.get("io_busy_ms", 0) for t in ts),
        "t_compute_ms": med(t.get("t_compute_ms", 0) for t in ts),
        "split_ms": {k: med(t.get(k, 0) for t in ts) for k in
                     ("attn_ms", "expert_ms", "io_ms", "map_ms", "predict_ms", "other_ms")},
        "precision": med(s["prefetch_precision"] for s in st),
        "recall": med(s["prefetch_recall"] for s in st),
        "wasted_mb_per_token": med(s["prefetch_wasted_bytes"] / p / 1e6 for s, p in zip(st, passes)),
        "decode_hit_rate": med(s["decode_hit_rate"] for s in st),
        "mb_per_token": med(s["decode_ssd_bytes_per_token"] / 1e6 for s in st),
        "ratio": med(r["ratio"] for r in runs if r.get("ratio") is not None) if any(r.get("ratio") for r in runs) else None,
        "ratio_min": min((r["ratio"] for r in runs if r.get("ratio") is not None), default=None),
        "ratio_max": max((r["ratio"] for r in runs if r.get("ratio") is not None), default=None),
        "ratio_tok": med(r["ratio_tok"] for r in runs if r.get("ratio_tok") is not None) if any(r.get("ratio_tok") for r in runs) else None,
        "ratio_tok_min": min((r["ratio_tok"] for r in runs if r.get("ratio_tok") is not None), default=None),
        "ratio_tok_max": max((r["ratio_tok"] for r in runs if r.get("ratio_tok") is not None), default=None),
        "read_us_per_mb": med(s["read_us"] / max(1, s["bytes_read"]) * 1e6 for s in st),
        "disk_mb_s": med(r["disk_mb_s"] for r in runs if r.get("disk_mb_s")) if any(r.get("disk_mb_s") for r in runs) else None,
        "arena_bytes": st[0]["arena_bytes"], "io_threads": st[0]["io_threads"],
        "same_text": len({r["text"] for r in runs if r.get("status") == "PASS"}) == 1,
        "text": next(r["text"] for r in runs if r.get("status") == "PASS"),
    }


def table(rows: list[dict]) -> str:
    head = ("| row | decode tok/s (min-max) | time/token ms | / max(T_dev, T_comp of off) (min-max) | "
            "/ per-token bound (min-max) | T_dev ms | "
            "disk MB/s | read ms/MB | io wait ms | T_comp ms | precision | recall | wasted MB/tok | hit rate | MB/tok |")
    out = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        if r["status"] != "PASS":
            out.append(f"| {r['row']} | FAIL: {r.get('reason')} |")
            continue
        pf = row_spec(r["row"])[0] in PREDICTORS
        ratio = (f"{r['ratio']:.2f} ({r['ratio_min']:.2f}-{r['ratio_max']:.2f})" if r.get("ratio") is not None else "-")
        disk = f"{r['disk_mb_s']:.0f}" if r.get("disk_mb_s") else "-"
        rt = (f"{r['ratio_tok']:.2f} ({r['ratio_tok_min']:.2f}-{r['ratio_tok_max']:.2f})" if r.get("ratio_tok") is not None else "-")
        out.append(
            f"| {r['row']} | {r['decode_tok_s']:.2f} ({r['decode_tok_s_min']:.2f}-{r['decode_tok_s_max']:.2f}) | "
            f"{r['time_per_token_ms']:.0f} | {ratio} | {rt} | {r['io_busy_ms']:.0f} | {disk} | {r['read_us_per_mb'] / 1e3:.1f} | {r['split_ms']['io_ms']:.0f} | {r['t_compute_ms']:.0f} | "
            + (f"{r['precision']:.2f} | {r['recall']:.2f} | {r['wasted_mb_per_token']:.1f}" if pf else "- | - | -")
            + f" | {r['decode_hit_rate']:.2f} | {r['mb_per_token']:.0f} |")
    off = next((r for r in rows if r["row"] == "off" and r["status"] == "PASS"), None)
    if off:
        out.append(f"\noff row (median): T_io = {off['t_io_ms']:.0f} ms (io wait + map), T_dev = {off['io_busy_ms']:.0f} ms, "
                   f"T_compute = {off['t_compute_ms']:.0f} ms (the bound's compute term); T_io + T_compute = "
                   f"{(off['t_io_ms'] + off['t_compute_ms']) / max(off['t_io_ms'], off['t_compute_ms']):.2f} x max")
    return "\n".join(out)


def bound_ratios(raw: dict) -> None:
    """Each run's time/token over max(its own disk-busy time per token, the off runs' median
    compute time per token), in place (``ratio``)."""
    comp = [((r.get("stats") or {}).get("time_split") or {}).get("t_compute_ms") for r in raw.get("off", [])
            if r.get("status") == "PASS"]
    comp = [c for c in comp if c]
    t_comp = statistics.median(comp) if comp else None
    # per token: the off runs' median compute time of decode step i (every row generates the same tokens)
    series = [((r.get("stats") or {}).get("time_split_tokens") or {}).get("t_compute_ms") for r in raw.get("off", [])
              if r.get("status") == "PASS"]
    series = [x for x in series if x]
    if len({len(x) for x in series}) > 1:
        print(f"[overlap] off runs decoded {sorted({len(x) for x in series})} steps: no per-token bound", file=sys.stderr)
        series = []
    comp_i = [statistics.median(v) for v in zip(*series)] if series else []
    for runs in raw.values():
        for r in runs:
            ts = (r.get("stats") or {}).get("time_split") or {}
            bound = max(ts.get("io_busy_ms") or 0, t_comp or 0)
            r["ratio"] = ts["wall_ms"] / bound if bound and ts.get("wall_ms") and r.get("status") == "PASS" else None
            tk = (r.get("stats") or {}).get("time_split_tokens") or {}
            wall, busy = tk.get("wall_ms") or [], tk.get("io_busy_ms") or []
            r["ratio_tok"] = None
            if r.get("status") == "PASS" and wall and len(busy) == len(wall) == len(comp_i):
                r["ratio_tok"] = sum(wall) / sum(max(b, c) for b, c in zip(busy, comp_i))
                r["step_classes"] = step_classes(wall, busy, comp_i)


# A decode step is balanced when its disk-busy time is within this factor of its compute time.
BALANCED = 1.5


def step_classes(wall, busy, comp) -> dict:
    """Decode steps by kind: ``io`` (T_dev_i > BALANCED x T_compute_i), ``balanced``, ``compute``
    (T_dev_i < T_compute_i / BALANCED), each as [sum of wall_i, sum of max(T_dev_i, T_compute_i), steps]
    (ms, ms, count), so a row's ratio can be read where I/O and compute are comparable."""
    out = {"io": [0.0, 0.0, 0], "balanced": [0.0, 0.0, 0], "compute": [0.0, 0.0, 0]}
    for w, b, c in zip(wall, busy, comp):
        kind = "io" if b > BALANCED * c else "compute" if b * BALANCED < c else "balanced"
        o = out[kind]
        o[0] += w
        o[1] += max(b, c)
        o[2] += 1
    return out


def class_table(raw: dict) -> str:
    """Per row, pooled over its runs: sum wall_i / sum max(T_dev_i, T_compute_i) over each kind of step."""
    out = [f"| row | I/O-bound steps: n, time / bound | balanced steps (T_dev within {BALANCED}x T_comp) | compute-bound steps |",
           "|---|---|---|---|"]
    for name, runs in raw.items():
        tot = {k: [0.0, 0.0, 0] for k in ("io", "balanced", "compute")}
        for r in runs:
            for k, v in (r.get("step_classes") or {}).items():
                tot[k] = [a + b for a, b in zip(tot[k], v)]
        cells = [f"{v[2]}, {v[0] / v[1]:.2f}" if v[2] else "0, -" for v in tot.values()]
        out.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="GGUF (default: the default model)")
    ap.add_argument("--limit", default="2GiB", help="cgroup memory limit of each child (default 2GiB)")
    ap.add_argument("--arena", default=None, help="size the arena directly (else: ram budget = limit - headroom)")
    ap.add_argument("--n-predict", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="compute threads (default 1)")
    ap.add_argument("--io-threads", type=int, default=None)
    ap.add_argument("--rows", default="off,lookahead,previous,union,segments,union+segments")
    ap.add_argument("--segment", default="512KiB", help="segment size of the segments rows")
    ap.add_argument("--budget", default=None, help="union: bytes prefetched per layer at most")
    ap.add_argument("--n-ctx", type=int, default=512)
    ap.add_argument("--policy", default="lru", help="eviction policy of every row (default lru)")
    ap.add_argument("--device-mbps", type=float, default=None,
                    help="serve expert reads as by a device of this speed with no burst credit "
                         "(Session(read_rate_limit=...): one shared device clock in the I/O pool)")
    ap.add_argument("--read-mbps", type=float, default=None,
                    help="cap reads from the model's device at this many MB/s (a blkio cgroup): a device of fixed speed")
    ap.add_argument("--out", default=None, help="write the rows and every run as JSON here")
    ap.add_argument("--predictor", default=None,
                    help="trained rows: a predictor .npz fitted on the model (epqlab predictor fit; not on PROMPT)")
    a = ap.parse_args(argv)
    kw = {"n_threads": a.threads, "n_ctx": a.n_ctx, "policy": a.policy}
    if a.io_threads:
        kw["io_threads"] = a.io_threads
    if a.device_mbps:
        kw["read_rate_limit"] = int(a.device_mbps * 1e6)
    if a.arena:
        kw["arena_bytes"] = parse_bytes(a.arena)
    seg, budget = parse_bytes(a.segment), parse_bytes(a.budget) if a.budget else None
    names = a.rows.split(",")
    if any(row_spec(n)[0] == "trained" for n in names) and not a.predictor:
        ap.error("trained rows need --predictor PATH (epqlab predictor fit MODEL PATH)")
    if "off" not in names:
        names.insert(0, "off")  # the bound of every ratio
    model = a.model or str(__import__("epqlab.models", fromlist=["default_model"]).default_model(progress=False))
    if a.read_mbps:
        print(f"[overlap] reads capped at {a.read_mbps:.0f} MB/s: {throttle_reads(model, a.read_mbps)}", file=sys.stderr)
    oracle_log = record_oracle_log(model, a.limit, a.n_predict, kw) if any(
        row_spec(n)[0] == "oracle" for n in names) else None
    raw: dict = {name: [] for name in names}
    for rep in range(a.repeats):  # interleaved: the disk's state drifts between fast and throttled
        for name in names:
            mb_s = disk_mb_s(model)
            df = strict.run(model, levels=a.limit, prompt=PROMPT, n_predict=a.n_predict, forced=FORCED, repeats=1,
                            progress=False, **kw, **row_kwargs(name, seg, budget, a.predictor, oracle_log))
            run = df.attrs["runs"][0]
            run["disk_mb_s"] = mb_s
            raw[name].append(run)
            tok = run.get("stats", {}).get("decode_tok_s") if run.get("status") == "PASS" else None
            print(f"[overlap] repeat {rep + 1}/{a.repeats} {name}: disk {mb_s or 0:.0f} MB/s, "
                  + (f"{tok:.2f} tok/s" if tok else str(run.get("reason"))), file=sys.stderr, flush=True)
    bound_ratios(raw)
    rows = [summarize(name, raw[name]) for name in names]
    texts = {r["text"] for r in rows if r["status"] == "PASS"}
    print(table(rows))
    print("\nby kind of decode step (the per-token bound's terms):\n" + class_table(raw))
    paced = f"device {a.device_mbps:.0f} MB/s (paced), " if a.device_mbps else ""
    print(f"\nall rows generated the same tokens: {len(texts) == 1}; {paced}policy {a.policy}, limit {a.limit}, arena "
          f"{fmt_bytes(rows[0].get('arena_bytes', 0))}, {a.threads} compute thread(s), "
          f"{rows[0].get('io_threads')} I/O threads, {a.n_predict} tokens, {a.repeats} runs per row")
    if a.out:
        write_json({"rows": rows, "runs": raw, "args": vars(a)}, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
