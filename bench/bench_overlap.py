"""Hiding expert I/O behind compute: prefetch predictors and segment-parallel reads, side by side.

Usage:
    .venv/bin/python bench/bench_overlap.py [--model PATH] [--limit 1.5GiB | --arena 1GiB]
        [--n-predict 16] [--repeats 3] [--threads 1] [--rows off,lookahead,previous,union,segments,union+segments]
        [--segment 512KiB] [--budget BYTES] [--out results/overlap.json]

Each run is its own child process (``epqlab.strict.run``: a cgroup v1 child of this process's
memory cgroup with the limit set before the model loads, page cache of the model dropped first),
greedy, ``--threads`` compute threads. Rows: ``off`` (synchronous reads: a token costs T_io +
T_compute), ``lookahead`` / ``previous`` / ``union`` (next-layer prefetch predictors,
epqlab.prefetch), ``segments`` (expert reads split into ``--segment`` pieces over the I/O threads),
``union+segments``. Columns: decode tok/s (median of the repeats, min-max), time/token from the
hook's time split (median), its ratio to the bound max(T_io, T_compute) taken from the ``off``
row's split (T_io = io wait + map, T_compute = the rest), the row's own remaining I/O wait,
prefetch precision / recall, MB read in vain per token, decode hit rate and MB read per token.
"""
from __future__ import annotations

import argparse
import statistics
import sys

from epqlab import strict
from epqlab.results import write_json
from epqlab.units import fmt_bytes, parse_bytes

PROMPT = ("A CPU cache is a small, fast memory that sits between the processor and main memory. "
          "It keeps copies of recently used data so that")


def row_kwargs(name: str, segment: int, budget: int | None) -> dict:
    kw: dict = {}
    pf = name.split("+")[0]
    if pf in ("lookahead", "previous", "union"):
        kw["prefetch"] = pf
        if pf == "union" and budget:
            kw["prefetch_budget"] = budget
    if "segments" in name:
        kw["read_segment_bytes"] = segment
    if "pipeline" in name:
        kw["pipeline_reads"] = True
    return kw


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
        "t_compute_ms": med(t.get("t_compute_ms", 0) for t in ts),
        "split_ms": {k: med(t.get(k, 0) for t in ts) for k in
                     ("attn_ms", "expert_ms", "io_ms", "map_ms", "predict_ms", "other_ms")},
        "precision": med(s["prefetch_precision"] for s in st),
        "recall": med(s["prefetch_recall"] for s in st),
        "wasted_mb_per_token": med(s["prefetch_wasted_bytes"] / p / 1e6 for s, p in zip(st, passes)),
        "decode_hit_rate": med(s["decode_hit_rate"] for s in st),
        "mb_per_token": med(s["decode_ssd_bytes_per_token"] / 1e6 for s in st),
        "arena_bytes": st[0]["arena_bytes"], "io_threads": st[0]["io_threads"],
        "same_text": len({r["text"] for r in runs if r.get("status") == "PASS"}) == 1,
        "text": next(r["text"] for r in runs if r.get("status") == "PASS"),
    }


def table(rows: list[dict]) -> str:
    off = next((r for r in rows if r["row"] == "off" and r["status"] == "PASS"), None)
    bound = max(off["t_io_ms"], off["t_compute_ms"]) if off else None
    head = ("| row | decode tok/s (min-max) | time/token ms | / max(T_io,T_comp) | io wait ms | T_comp ms | "
            "precision | recall | wasted MB/tok | hit rate | MB/tok |")
    out = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        if r["status"] != "PASS":
            out.append(f"| {r['row']} | FAIL: {r.get('reason')} |")
            continue
        pf = r["row"].split("+")[0] in ("lookahead", "previous", "union")
        out.append(
            f"| {r['row']} | {r['decode_tok_s']:.2f} ({r['decode_tok_s_min']:.2f}-{r['decode_tok_s_max']:.2f}) | "
            f"{r['time_per_token_ms']:.0f} | {r['time_per_token_ms'] / bound:.2f} | {r['split_ms']['io_ms']:.0f} | "
            f"{r['t_compute_ms']:.0f} | {r['precision']:.2f} | {r['recall']:.2f} | "
            + (f"{r['wasted_mb_per_token']:.1f}" if pf else "-") + f" | {r['decode_hit_rate']:.2f} | {r['mb_per_token']:.0f} |"
            if bound else f"| {r['row']} | {r['decode_tok_s']:.2f} | no off row |")
    if off:
        out.append(f"\nbound from the off row: T_io = {off['t_io_ms']:.0f} ms (io wait + map), "
                   f"T_compute = {off['t_compute_ms']:.0f} ms; max = {bound:.0f} ms/token; "
                   f"T_io + T_compute = {(off['t_io_ms'] + off['t_compute_ms']) / bound:.2f} x max")
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
    ap.add_argument("--out", default=None, help="write the rows and every run as JSON here")
    a = ap.parse_args(argv)
    kw = {"n_threads": a.threads, "n_ctx": a.n_ctx}
    if a.io_threads:
        kw["io_threads"] = a.io_threads
    if a.arena:
        kw["arena_bytes"] = parse_bytes(a.arena)
    seg, budget = parse_bytes(a.segment), parse_bytes(a.budget) if a.budget else None
    rows, raw = [], {}
    for name in a.rows.split(","):
        df = strict.run(a.model, levels=a.limit, prompt=PROMPT, n_predict=a.n_predict, repeats=a.repeats,
                        progress=True, **kw, **row_kwargs(name, seg, budget))
        raw[name] = df.attrs["runs"]
        rows.append(summarize(name, df.attrs["runs"]))
        print(f"[overlap] {name}: " + (f"{rows[-1]['decode_tok_s']:.2f} tok/s" if rows[-1]["status"] == "PASS"
                                       else rows[-1]["reason"]), file=sys.stderr, flush=True)
    texts = {r["text"] for r in rows if r["status"] == "PASS"}
    print(table(rows))
    print(f"\nall rows generated the same tokens: {len(texts) == 1}; limit {a.limit}, arena "
          f"{fmt_bytes(rows[0].get('arena_bytes', 0))}, {a.threads} compute thread(s), "
          f"{rows[0].get('io_threads')} I/O threads, {a.n_predict} tokens, {a.repeats} runs per row")
    if a.out:
        write_json({"rows": rows, "runs": raw, "args": vars(a)}, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
