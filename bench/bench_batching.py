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
``--lossy "exact;budget=16;batch=0.1"`` adds the lossy knobs of batched steps (docs/DESIGN.md §3a'): each
setting is a row per batch size (``budget=N``: ``expert_budget=N``; ``batch=D`` / ``cache=D``: ``route_bias`` with
``route_delta=D``), its union per layer before and after the rewrite beside its speed and bytes, the ratios over
exact batch 1. Quality is not measured here (a random-weight model has none): ``epqlab ablate lossy --batches``
gives the perplexity on the default model.
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


LOSSY_KEYS = {"budget": "expert_budget", "batch": "route_bias", "cache": "route_bias"}


def parse_lossy(text: str) -> list[tuple[str, dict]]:
    """``"exact;budget=16;batch=0.1"`` -> [(label, Session kwargs)]."""
    out = []
    for part in (x.strip() for x in text.split(";")):
        if not part:
            continue
        if part == "exact":
            out.append(("exact", {}))
            continue
        key, _, val = part.partition("=")
        if key == "budget":
            out.append((part, {"expert_budget": int(val)}))
        elif key in ("batch", "cache"):
            out.append((part, {"route_bias": key, "route_delta": float(val)}))
        else:
            raise SystemExit(f"--lossy setting {part!r}: use exact, budget=N, batch=DELTA or cache=DELTA")
    return out


def run_row(model, limit, b, n, session_kw, workdir: Path, tag: str, plain: bool = False) -> dict:
    if plain:  # all weights in RAM: warm, no limit
        paging_only = ("arena_bytes", "expert_budget", "route_bias", "route_delta")
        limit, session_kw = None, {k: v for k, v in session_kw.items() if k not in paging_only} | {"pager": False}
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
    ap.add_argument("--lossy", default="exact", help="settings separated by ';': exact, budget=N, batch=D, cache=D")
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
    settings = parse_lossy(a.lossy)
    keys = [(lab, b) for lab, _ in settings for b in sizes]
    runs: dict[tuple, list[dict]] = {key: [] for key in keys}
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
            for si, (lab, skw) in enumerate(settings):
                for b in sizes:
                    r = run_row(model, limit, b, a.n, kw | skw, Path(td), f"s{si}b{b}r{rep}")
                    if r.get("status") != "PASS":
                        print(f"  {lab} b={b} rep {rep + 1}: FAIL {r.get('reason')}", flush=True)
                        continue
                    runs[(lab, b)].append(r)
                    row = r["row"]
                    print(f"  {lab} b={b} rep {rep + 1}: {row['decode_tok_s']:.2f} tok/s, {row['ssd_mb_per_token']:.2f} "
                          f"MB/token, U={row.get('union_before', row['union_per_layer']):.1f}->{row['union_per_layer']:.1f}, "
                          f"arena {fmt_bytes(r['arena_bytes'])}, "
                          f"peak {fmt_bytes(r['cgroup_peak']) if r.get('cgroup_peak') else '-'}", flush=True)
    table = []
    for lab, b in keys:
        if not runs[(lab, b)]:
            continue
        rows = [r["row"] for r in runs[(lab, b)]]
        t = {"setting": lab, "batch": b, "runs": len(rows)}
        for k in SPEEDS:
            v = [x[k] for x in rows]
            t[k], t[k + "_min"], t[k + "_max"] = statistics.median(v), min(v), max(v)
        for k in ("ssd_mb_per_token", "union_per_layer", "hit_rate", "attn_ms", "expert_ms", "io_ms", "other_ms"):
            t[k] = statistics.median(x.get(k, 0.0) for x in rows)
        t["union_before"] = statistics.median(x.get("union_before", x["union_per_layer"]) for x in rows)
        t["routing_agreement"] = statistics.median(x.get("routing_agreement", 1.0) for x in rows)
        t["arena_bytes"] = runs[(lab, b)][0]["arena_bytes"]
        pv = [r["row"]["decode_tok_s"] for r in plain_runs[b]]
        t["plain_tok_s"] = statistics.median(pv) if pv else None
        t["cgroup_peak"] = max((r.get("cgroup_peak") or 0) for r in runs[(lab, b)])
        table.append(t)
    base = next((t for t in table if t["setting"] == settings[0][0] and t["batch"] == sizes[0]), None)
    print(f"\n| setting | batch | tok/s all (min-max) | x {settings[0][0]} b{sizes[0]} | plain tok/s | x plain | tok/s per seq | "
          "SSD MB/tok | x b1 | U/layer before -> after | agreement | hit % | ms/step: attn, experts, io, other | peak |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for t in table:
        print(f"| {t['setting']} | {t['batch']} | {t['decode_tok_s']:.2f} ({t['decode_tok_s_min']:.2f}-{t['decode_tok_s_max']:.2f}) | "
              f"{t['decode_tok_s'] / base['decode_tok_s']:.2f} | "
              f"{'-' if t['plain_tok_s'] is None else format(t['plain_tok_s'], '.2f')} | "
              f"{'-' if t['plain_tok_s'] is None else format(t['decode_tok_s'] / t['plain_tok_s'], '.2f')} | {t['per_seq_tok_s']:.2f} | {t['ssd_mb_per_token']:.2f} | "
              f"{t['ssd_mb_per_token'] / base['ssd_mb_per_token'] if base['ssd_mb_per_token'] else float('nan'):.2f} | "
              f"{t['union_before']:.1f} -> {t['union_per_layer']:.1f} | {100 * t['routing_agreement']:.1f}% | "
              f"{100 * t['hit_rate']:.1f} | {t['step_ms']:.0f}: {t['attn_ms']:.0f}, "
              f"{t['expert_ms']:.0f}, {t['io_ms']:.0f}, {t['other_ms']:.0f} | "
              f"{fmt_bytes(t['cgroup_peak']) if t['cgroup_peak'] else '-'} |")
    for t in table:
        if t["batch"] == 4 and base:
            print(f"{t['setting']} batch 4 vs {base['setting']} batch {base['batch']}: "
                  f"{t['decode_tok_s'] / base['decode_tok_s']:.2f}x aggregate tok/s, "
                  f"{t['ssd_mb_per_token'] / base['ssd_mb_per_token']:.2f}x SSD MB per token")
    if a.json:
        epqlab.results.write_json({"model": model, "limit": limit, "n": a.n, "repeats": a.repeats, "lossy": a.lossy,
                                   "parameters": vars(a),
                                   "rows": table, "run": epqlab.results.run_info(model),
                                   "runs": {f"{lab} b{b}": [r["row"] for r in rs] for (lab, b), rs in runs.items()}}, a.json)


if __name__ == "__main__":
    main()
