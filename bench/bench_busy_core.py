"""Paged decode with misses against plain llama.cpp, quiet and with one core kept busy by another process.

    .venv/bin/python bench/bench_busy_core.py --model /work/big/q35.gguf --budget 4GiB --predictor p.npz

bench_hook_cost.py measures the hook with every expert resident; this one keeps the reads in: the paged rows
decode under ``--budget`` (an arena far smaller than the experts, so every token reads: the arena keeps what an
earlier run loaded, and at 8 GiB on the 35B-A3B shape the experts of 48 tokens all fit, so later runs read
nothing; 4 GiB evicts throughout), with prefetch off and,
given ``--predictor``, with the trained next-layer predictor (DESIGN §3c). Rows, each decoding ``--n`` tokens
**teacher-forced** on the held-out prose (one token per decode step):

- ``plain``: plain llama.cpp (``pager=False``), the file warm in the page cache first (it must fit in RAM).
- ``paged``: ``ram_budget=--budget``, prefetch off.
- ``paged-trained``: the same with ``prefetch="trained"``.

One Session per row (a plain Session and an arena at once need more RAM than the box has); in it, ``--repeats``
pairs of runs back to back: quiet, then with a process spinning on CPU 0 (another job taking a core). A row's
slowdown is the median busy / median quiet ms per token; the goal (issue: paged slowdown <= 1.2 x plain's) is
each paged row's slowdown over plain's. Beside them: SSD MB per token and the time split of the last run of
each kind (attention, expert matmuls, I/O wait, map, predict, other), so a slowdown can be placed. Run it alone.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics

import epqlab
from epqlab.data import heldout_texts
from epqlab.engine.time_split import decode_summary
from epqlab.studies.roofline import warm_file
from epqlab.studies.strict import DEFAULT_PROMPT

PARTS = ("attn_ms", "expert_ms", "io_ms", "map_ms", "predict_ms", "other_ms")


def _spin(cpu: int) -> None:
    import os

    os.sched_setaffinity(0, {cpu})
    while True:
        pass


def _run(s: epqlab.Session, n: int, text: str) -> dict:
    s.reset_stats()
    st = s.generate(DEFAULT_PROMPT, n, forced=text).stats
    split = decode_summary(s.time_split()) if s.pager is not None else {}
    return {"ms": 1000.0 / st["decode_tok_s"], "mb": (st.get("decode_ssd_bytes_per_token") or 0) / 1e6,
            "split": {k: split.get(k, 0.0) for k in PARTS}}


def measure_row(model: str, kw: dict, n: int, repeats: int, text: str) -> dict:
    """``repeats`` (quiet, busy) pairs in one Session: {"quiet": [run...], "busy": [run...]}."""
    out = {"quiet": [], "busy": []}
    with epqlab.Session(model, **kw) as s:
        s.generate(DEFAULT_PROMPT, 4, forced=text)  # warm-up: thread pool, allocator, page tables
        for _ in range(repeats):
            out["quiet"].append(_run(s, n, text))
            p = mp.Process(target=_spin, args=(0,), daemon=True)
            p.start()
            try:
                out["busy"].append(_run(s, n, text))
            finally:
                p.kill()
                p.join()
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--budget", default="4GiB", help="ram_budget of the paged rows")
    ap.add_argument("--predictor", default=None, help="a predictor .npz (epqlab predictor fit): adds paged-trained")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--n", type=int, default=48, help="teacher-forced tokens per run")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None, help="write each row's runs, medians and ratios (unrounded) here")
    a = ap.parse_args()
    text = heldout_texts()["prose"]
    base = {"n_threads": a.threads, "n_ctx": 1024}
    rows = {"paged": {**base, "ram_budget": a.budget}}
    if a.predictor:
        rows["paged-trained"] = {**base, "ram_budget": a.budget, "prefetch": "trained", "prefetch_predictor": a.predictor}
    print(f"model {a.model}; {a.n} teacher-forced tokens, {a.repeats} quiet/busy pairs per row, {a.threads} threads, "
          f"paged at {a.budget}", flush=True)
    res = {name: measure_row(a.model, kw, a.n, a.repeats, text) for name, kw in rows.items()}
    w = warm_file(a.model)
    print(f"plain: {w['bytes'] / 2**30:.2f} GiB read into the page cache", flush=True)
    res = {"plain": measure_row(a.model, {**base, "pager": False}, a.n, a.repeats, text), **res}

    med = {r: {k: statistics.median(x["ms"] for x in v[k]) for k in ("quiet", "busy")} for r, v in res.items()}
    slow = {r: m["busy"] / m["quiet"] for r, m in med.items()}
    sp = slow["plain"]
    if a.json:
        doc = {r: {"quiet_ms_runs": [x["ms"] for x in v["quiet"]], "busy_ms_runs": [x["ms"] for x in v["busy"]],
                   "quiet_ms": med[r]["quiet"], "busy_ms": med[r]["busy"],
                   "slowdown": slow[r], "vs_plain": slow[r] / sp,
                   "ssd_mb_per_token": statistics.median(x["mb"] for x in v["quiet"])} for r, v in res.items()}
        with open(a.json, "w") as f:
            json.dump({"model": a.model, "budget": a.budget, "threads": a.threads, "n": a.n, "rows": doc}, f, indent=1)
    print("\n| row | quiet ms/token (runs) | busy ms/token (runs) | slowdown | / plain's (goal <= 1.2) | SSD MB/tok "
          "| split quiet: attn/experts/io/map/predict/other | split busy |")
    print("|---|---|---|---|---|---|---|---|")
    for r, v in res.items():
        s = slow[r]

        def runs(k):
            return ", ".join(f"{x['ms']:.0f}" for x in v[k])

        def split(k):
            return " / ".join(f"{v[k][-1]['split'][p]:.0f}" for p in PARTS) if r != "plain" else "-"

        print(f"| {r} | {med[r]['quiet']:.0f} ({runs('quiet')}) | {med[r]['busy']:.0f} ({runs('busy')}) | {s:.2f} | "
              f"{s / sp:.2f} | {statistics.median(x['mb'] for x in v['quiet']):.1f} | {split('quiet')} | {split('busy')} |")
        if r != "plain" and min(x["mb"] for k in ("quiet", "busy") for x in v[k]) == 0:
            print(f"  ({r}: some runs read nothing -- the arena held every expert they used; lower --budget)")


if __name__ == "__main__":
    main()
