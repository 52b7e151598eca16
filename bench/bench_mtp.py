"""Does MTP speculation pay when the experts stream? tok/s of teacher-forced decode with set acceptance, per memory
limit, draft length and acceptance, beside decode without speculation and plain llama.cpp in RAM (with and without).

    .venv/bin/epqlab model synth qwen35-a3b /work/big/q35.gguf        # 20.76 GiB, Qwen3.6-35B-A3B's shape + MTP block
    .venv/bin/python bench/bench_mtp.py --model /work/big/q35.gguf --levels 8GiB --drafts 1,2,3 \
        --accepts 1.0,0.8,0.6,0.4 --n 32 --repeats 3 --json bench/results/mtp_8gib.json

Each row is a child process (``epqlab.studies.speculative_child``) in a memory cgroup of the level (the Session's
``ram_budget`` is the level - 16 MiB headroom), the model file dropped from the page cache first. The child feeds
held-out text (``epqlab.studies.speculative.measure``): a random-weight model drafts nonsense, so acceptance is set:
each draft token is the text's next token, replaced by a wrong one with probability 1 - a. Every MTP draft pass,
verify pass over 1 + d tokens, MTP catch-up pass and rollback runs. Per level: ``no spec`` (the same decode without
an MTP context), then ``d=D a=A`` rows. ``plain``: plain llama.cpp (``pager=False``) with every weight in RAM (the
file warmed into the page cache, no limit), without speculation and with it at each d and ``--plain-accept`` (default
0.8, llama.cpp PR #22673's aggregate acceptance on Qwen3.6-35B-A3B). Repeats are interleaved (every row once, then
again); speeds are medians, with the time per verify pass, per draft pass and per catch-up pass, the union of
experts per layer a verify pass reads and the SSD MB per generated token beside them. Goal (issue 42): at 8 GiB with
a = 0.8, decode tok/s above plain's without speculation. Run it alone: a build or a test suite beside it measures the
contention.
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
MEDIANS = ("tok_s", "ms_per_token", "verify_ms", "draft_ms", "catchup_ms", "ssd_mb_per_token", "io_ms", "acceptance",
           "tokens_per_verify", "verify_union", "mtp_union", "decode_hit_rate")


def run_row(model, limit, accept, d, a, kw, workdir: Path, tag: str, plain: bool = False) -> dict:
    if plain:
        limit, kw = None, kw | {"pager": False}
    else:
        drop_page_cache(model)
    spec = {"model": model, "ram_budget": None if limit is None else limit - HEADROOM, "n_predict": a.n,
            "prompt_tokens": a.prompt_tokens, "accept": accept, "draft_max": d, "seed": a.seed, "session_kw": kw}
    sp, op = workdir / f"{tag}.spec.json", workdir / f"{tag}.out.json"
    sp.write_text(json.dumps(spec))
    lim = run_limited([sys.executable, "-m", "epqlab.studies.speculative_child", str(sp), str(op)], limit or 2**40,
                      mode=None if limit else "sampled", timeout_s=3600)
    out = json.loads(op.read_text()) if op.is_file() else {"status": "FAIL", "reason": lim.reason or lim.stderr[-300:]}
    out["cgroup_peak"], out["killed"] = lim.cgroup_peak, lim.killed
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a MoE GGUF with an MTP block (default: none; required)")
    ap.add_argument("--levels", default="8GiB", help="memory limits, e.g. 4GiB,8GiB,16GiB")
    ap.add_argument("--drafts", default="1,2,3", help="draft lengths d (draft_max)")
    ap.add_argument("--accepts", default="1.0,0.8,0.6,0.4", help="set acceptances a")
    ap.add_argument("--n", type=int, default=32, help="teacher-forced tokens per run (default 32)")
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--n-ctx", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0, help="seed of the wrong-draft choices")
    ap.add_argument("--no-plain", action="store_true", help="skip the plain-in-RAM rows")
    ap.add_argument("--plain-accept", type=float, default=0.8, help="acceptance of the plain speculative rows")
    ap.add_argument("--json", default=None, help="write the rows here")
    a = ap.parse_args()
    model = str(a.model or default_model(progress=False))
    lay = epqlab.inspect(model)
    levels = [parse_bytes(x) for x in a.levels.split(",") if x.strip()]
    drafts = [int(x) for x in a.drafts.split(",") if x.strip()]
    accepts = [float(x) for x in a.accepts.split(",") if x.strip()]
    kw = {"n_threads": a.threads, "n_ctx": a.n_ctx}
    print(f"model {lay.path.name} ({fmt_bytes(lay.file_size)}; {len(lay.layers)} MoE layers + MTP block(s) "
          f"{lay.mtp_moe_layers} x {lay.n_expert} experts, top-{lay.n_expert_used}); {a.n} teacher-forced tokens; "
          f"{a.repeats} interleaved repeats", flush=True)
    keys = [(lvl, None, None) for lvl in levels] + [(lvl, d, x) for lvl in levels for d in drafts for x in accepts]
    want_plain = not a.no_plain
    if want_plain:
        try:
            warm_file(model)
        except epqlab.EpqlabError as e:
            print(f"plain-in-RAM rows skipped: {e}")
            want_plain = False
    if want_plain:
        keys = [("plain", None, None)] + [("plain", d, a.plain_accept) for d in drafts] + keys
    runs: dict[tuple, list[dict]] = {k: [] for k in keys}
    with tempfile.TemporaryDirectory() as td:
        for rep in range(a.repeats):
            for i, (lvl, d, x) in enumerate(keys):
                plain = lvl == "plain"
                if plain and rep:
                    warm_file(model)  # the paged rows dropped it from the page cache
                r = run_row(model, None if plain else lvl, x, d or 0, a, kw, Path(td), f"k{i}r{rep}", plain=plain)
                name = f"{'plain' if plain else fmt_bytes(lvl)} {'no spec' if d is None else f'd={d} a={x:g}'}"
                if r.get("status") != "PASS":
                    print(f"  {name} rep {rep + 1}: FAIL {r.get('reason')}", flush=True)
                    continue
                runs[(lvl, d, x)].append(r)
                row = r["row"]
                print(f"  {name} rep {rep + 1}: {row['tok_s']:.2f} tok/s, verify {row['verify_ms']:.0f} ms, "
                      f"{row['ssd_mb_per_token']:.0f} MB/tok, arena {fmt_bytes(r['arena_bytes'])}, peak "
                      f"{fmt_bytes(r['cgroup_peak']) if r.get('cgroup_peak') else '-'}", flush=True)
    table = []
    for (lvl, d, x), rs in runs.items():
        if not rs:
            continue
        rows = [r["row"] for r in rs]
        t = {"level": "plain" if lvl == "plain" else fmt_bytes(lvl), "limit": None if lvl == "plain" else lvl,
             "draft_max": d or 0, "accept": x, "runs": len(rows), "arena_bytes": rs[0]["arena_bytes"],
             "cgroup_peak": max((r.get("cgroup_peak") or 0) for r in rs)}
        for k in MEDIANS:
            v = [r[k] for r in rows if r.get(k) is not None]
            t[k] = statistics.median(v) if v else None
        t["tok_s_min"], t["tok_s_max"] = min(r["tok_s"] for r in rows), max(r["tok_s"] for r in rows)
        table.append(t)
    plain0 = next((t["tok_s"] for t in table if t["level"] == "plain" and not t["draft_max"]), None)
    print(f"\nplain llama.cpp in RAM, no speculation: {plain0 and round(plain0, 2)} tok/s")
    print("| level | d | a | tok/s (min-max) | x no spec | x plain | ms/token | verify ms | draft ms | catch-up ms | "
          "tokens/verify | union/layer | MTP union | SSD MB/tok | io ms/tok | hit % | peak |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for t in table:
        base = next((u["tok_s"] for u in table if u["level"] == t["level"] and not u["draft_max"]), None)
        f = lambda k, spec=".1f": "-" if t.get(k) is None else format(t[k], spec)  # noqa: E731
        print(f"| {t['level']} | {t['draft_max'] or '-'} | {'-' if t['accept'] is None else format(t['accept'], 'g')} | "
              f"{t['tok_s']:.2f} ({t['tok_s_min']:.2f}-{t['tok_s_max']:.2f}) | "
              f"{t['tok_s'] / base if base else float('nan'):.2f} | {t['tok_s'] / plain0 if plain0 else float('nan'):.2f} | "
              f"{f('ms_per_token', '.0f')} | {f('verify_ms', '.0f')} | {f('draft_ms')} | {f('catchup_ms')} | "
              f"{f('tokens_per_verify', '.2f')} | {f('verify_union')} | {f('mtp_union')} | {f('ssd_mb_per_token', '.0f')} | "
              f"{f('io_ms', '.0f')} | {100 * (t['decode_hit_rate'] or 0):.1f} | "
              f"{fmt_bytes(t['cgroup_peak']) if t['cgroup_peak'] else '-'} |")
    if a.json:
        epqlab.results.write_json({"model": model, "parameters": vars(a), "plain_tok_s": plain0, "rows": table,
                                   "run": epqlab.results.run_info(model),
                                   "runs": {f"{k[0]} d{k[1]} a{k[2]}": [r["row"] for r in rs] for k, rs in runs.items()}},
                                  a.json)


if __name__ == "__main__":
    main()
