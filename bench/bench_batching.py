"""Batched decode under a hard memory limit: aggregate tok/s and SSD MB per generated token against batch size.

    .venv/bin/python bench/bench_batching.py                                  # the default model, a small arena
    .venv/bin/epqlab model synth qwen3-30b-a3b /work/big/q35.gguf --routing skewed --n-layer 40 --n-expert 256 \
        --n-ff-exp 512                                                        # 17.9 GiB, seed 002's shape
    .venv/bin/python bench/bench_batching.py --model /work/big/q35.gguf --limit 4GiB --n 32 --repeats 3

Each row is a child process in a memory cgroup of ``--limit`` (``epqlab.memory.limits.run_limited``; the
Session's ``ram_budget`` is the limit - 16 MiB headroom, its KV cache for every sequence inside it), the
model file dropped from the page cache first. In the child a Session with ``n_seq_max = b`` decodes b
sequences **teacher-forced** on windows of the held-out texts (``epqlab.studies.batching.measure``: one
token per step from real text, the timing and routing the model's; a random-weight model's own output
repeats itself). Repeats are interleaved (every batch size once, then again), speeds are medians, the
bytes moved and the time split printed beside them. Goals (issue: batched decode, 35B-A3B shape, 4 GiB):
aggregate decode tok/s at batch 4 >= 2.5x batch 1, and SSD MB per generated token at batch 4 <= 0.5x.
Beside each batch size, ``plain``: plain llama.cpp (``pager=False``) with every weight in RAM (the file read
into the page cache first, no limit: ``epqlab.studies.roofline``), the same sequences and threads: the
roofline, with the paged row's aggregate tok/s / plain's (``x plain``). ``--no-plain`` skips it (a file that
cannot fit in RAM skips it anyway, saying why).
Run it alone: a build or a test suite beside it measures the contention.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import epqlab
from epqlab.memory.limits import run_limited
from epqlab.memory.usage import drop_page_cache
from epqlab.models import default_model
from epqlab.studies.roofline import warm_file
from epqlab.units import fmt_bytes, parse_bytes

HEADROOM = 16 * 2**20
SPEEDS = ("decode_tok_s", "per_seq_tok_s", "step_ms")


def run_row(model, limit, b, n, session_kw, workdir: Path, tag: str, plain: bool = False) -> dict:
    if plain:  # all weights in RAM: warm, no limit
        limit, session_kw = None, {k: v for k, v in session_kw.items() if k != "arena_bytes"} | {"pager": False}
    else:
        drop_page_cache(model)
    spec = {"model": model, "ram_budget": None if limit is None else limit - HEADROOM, "batch": b, "n_predict": n,
            "teacher_forced": True, "prompt_tokens": 32, "session_kw": session_kw}
    sp, op = workdir / f"{tag}.spec.json", workdir / f"{tag}.out.json"
    sp.write_text(json.dumps(spec))
    cmd = [sys.executable, "-m", "epqlab.studies.batching_child", str(sp), str(op)]
    lim = run_limited(cmd, limit or 2**40, mode=None if limit else "sampled", timeout_s=3600)
    out = json.loads(op.read_text()) if op.is_file() else {"status": "FAIL", "reason": lim.reason or lim.stderr[-300:]}
    out["limit_mode"], out["cgroup_peak"], out["killed"] = lim.limit_mode, lim.cgroup_peak, lim.killed
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a MoE GGUF (default: the embedded default model)")
    ap.add_argument("--limit", default=None, help="memory limit (default: model file / 2 for the default model)")
    ap.add_argument("--arena", default=None, help="size the arena directly instead of from the budget, e.g. 6MiB")
    ap.add_argument("--batches", default="1,2,4,8")
    ap.add_argument("--n", type=int, default=32, help="tokens per sequence (default 32)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--n-ctx", type=int, default=256, help="context of each sequence")
    ap.add_argument("--json", default=None, help="write the rows here")
    ap.add_argument("--no-plain", action="store_true", help="skip the plain-in-RAM rows")
    a = ap.parse_args()
    model = str(a.model or default_model(progress=False))
    lay = epqlab.inspect(model)
    limit = parse_bytes(a.limit) if a.limit else None
    sizes = [int(x) for x in a.batches.split(",") if x.strip()]
    kw = {"n_threads": a.threads, "n_ctx": a.n_ctx}
    if a.arena:
        kw["arena_bytes"] = a.arena
    print(f"model {lay.path.name} ({fmt_bytes(lay.file_size)}; {len(lay.layers)} MoE layers x {lay.n_expert} experts, "
          f"top-{lay.n_expert_used}); limit {fmt_bytes(limit) if limit else 'none'}; {a.n} teacher-forced tokens per "
          f"sequence; {a.repeats} interleaved repeats", flush=True)
    runs: dict[int, list[dict]] = {b: [] for b in sizes}
    plain_runs: dict[int, list[dict]] = {b: [] for b in sizes}
    want_plain = not a.no_plain
    if want_plain:
        try:
            warm_file(model)
        except epqlab.EpqlabError as e:
            print(f"plain-in-RAM rows skipped: {e}")
            want_plain = False
    with tempfile.TemporaryDirectory() as td:
        for rep in range(a.repeats):
            for b in sizes if want_plain else ():
                r = run_row(model, limit, b, a.n, kw, Path(td), f"p{b}r{rep}", plain=True)
                if r.get("status") == "PASS":
                    plain_runs[b].append(r)
                    print(f"  plain b={b} rep {rep + 1}: {r['row']['decode_tok_s']:.2f} tok/s", flush=True)
                else:
                    print(f"  plain b={b} rep {rep + 1}: FAIL {r.get('reason')}", flush=True)
            for b in sizes:
                r = run_row(model, limit, b, a.n, kw, Path(td), f"b{b}r{rep}")
                if r.get("status") != "PASS":
                    print(f"  b={b} rep {rep + 1}: FAIL {r.get('reason')}", flush=True)
                    continue
                runs[b].append(r)
                row = r["row"]
                print(f"  b={b} rep {rep + 1}: {row['decode_tok_s']:.2f} tok/s, {row['ssd_mb_per_token']:.2f} MB/token, "
                      f"U={row['union_per_layer']:.1f}, arena {fmt_bytes(r['arena_bytes'])}, "
                      f"peak {fmt_bytes(r['cgroup_peak']) if r.get('cgroup_peak') else '-'}", flush=True)
    table = []
    for b in sizes:
        if not runs[b]:
            continue
        rows = [r["row"] for r in runs[b]]
        t = {"batch": b, "runs": len(rows)}
        for k in SPEEDS:
            v = [x[k] for x in rows]
            t[k], t[k + "_min"], t[k + "_max"] = statistics.median(v), min(v), max(v)
        for k in ("ssd_mb_per_token", "union_per_layer", "hit_rate", "attn_ms", "expert_ms", "io_ms", "other_ms"):
            t[k] = statistics.median(x.get(k, 0.0) for x in rows)
        t["arena_bytes"] = runs[b][0]["arena_bytes"]
        pv = [r["row"]["decode_tok_s"] for r in plain_runs[b]]
        t["plain_tok_s"] = statistics.median(pv) if pv else None
        t["cgroup_peak"] = max((r.get("cgroup_peak") or 0) for r in runs[b])
        table.append(t)
    base = table[0] if table else None
    print("\n| batch | tok/s all (min-max) | x b1 | plain tok/s | x plain | tok/s per seq | SSD MB/tok | x b1 | U/layer | hit % | "
          "ms/step: attn, experts, io, other | peak |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for t in table:
        print(f"| {t['batch']} | {t['decode_tok_s']:.2f} ({t['decode_tok_s_min']:.2f}-{t['decode_tok_s_max']:.2f}) | "
              f"{t['decode_tok_s'] / base['decode_tok_s']:.2f} | "
              f"{'-' if t['plain_tok_s'] is None else format(t['plain_tok_s'], '.2f')} | "
              f"{'-' if t['plain_tok_s'] is None else format(t['decode_tok_s'] / t['plain_tok_s'], '.2f')} | {t['per_seq_tok_s']:.2f} | {t['ssd_mb_per_token']:.2f} | "
              f"{t['ssd_mb_per_token'] / base['ssd_mb_per_token'] if base['ssd_mb_per_token'] else float('nan'):.2f} | "
              f"{t['union_per_layer']:.1f} | {100 * t['hit_rate']:.1f} | {t['step_ms']:.0f}: {t['attn_ms']:.0f}, "
              f"{t['expert_ms']:.0f}, {t['io_ms']:.0f}, {t['other_ms']:.0f} | "
              f"{fmt_bytes(t['cgroup_peak']) if t['cgroup_peak'] else '-'} |")
    b4 = next((t for t in table if t["batch"] == 4), None)
    if b4 and base:
        print(f"\nbatch 4 vs batch {base['batch']}: {b4['decode_tok_s'] / base['decode_tok_s']:.2f}x aggregate tok/s "
              f"(goal >= 2.5x), {b4['ssd_mb_per_token'] / base['ssd_mb_per_token']:.2f}x SSD MB per token (goal <= 0.5x)")
    if a.json:
        epqlab.results.write_json({"model": model, "limit": limit, "n": a.n, "repeats": a.repeats, "rows": table,
                                   "runs": {b: [r["row"] for r in rs] for b, rs in runs.items()}}, a.json)


if __name__ == "__main__":
    main()
