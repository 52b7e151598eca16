"""Prefill inside the budget: speed and re-read factor at a tight arena, per n_ubatch.

Re-read factor = bytes the pager reads during one prefill / bytes of the distinct experts that
prefill routes to (the distinct (layer, expert) units of the prompt, from a route log recorded
at a full arena). 1.0 means every expert was read once; colibri's tracker calls 4.37x "77% of
I/O wasted". A ubatch whose experts exceed a layer's slots is staged matrix by matrix (bytes
counted in ``staged_bytes``); nothing goes through llama.cpp's page-cache mapping.

    .venv/bin/python bench/bench_prefill.py [--model M] [--arena 0.3] [--ubatch 32,128,512] [--repeats 3]

Prints one row per n_ubatch: prefill tok/s (median of repeats, min-max), MB read, re-read factor
against the slices' bytes and against the whole pages the pager reads for them, staged layers,
hit rate. Each repeat opens a fresh Session (cold arena). A prompt longer than n_batch is decoded
in n_batch chunks, each re-reading what the arena cannot keep: the floor is ~ceil(n / n_batch).
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import numpy as np

import epqlab
from epqlab.models import default_model
from epqlab.routes import RouteLog

TEXT = (Path(epqlab.__file__).parent / "data" / "eval_execmodel.txt").read_text()


def distinct_bytes(path, prompt_tokens, lay) -> tuple[int, int, int]:
    """(bytes, page-rounded bytes, units) of the distinct (layer, expert) units the prompt routes
    to: their slices' bytes, and the whole pages the pager must read for them (mirror layout)."""
    with tempfile.TemporaryDirectory() as d:
        log = Path(d) / "r.npz"
        with epqlab.Session(path, route_log=log, n_ctx=1024) as s:
            s.generate(prompt_tokens, 1)
        ex = RouteLog.load(log).experts  # [T, L, k]
    ub = epqlab.Pager.unit_slot_bytes(lay)
    total, paged, units = 0, 0, 0
    for li in range(ex.shape[1]):
        e = np.unique(ex[:, li][ex[:, li] >= 0])
        total += len(e) * lay.layers[li].expert_bytes
        paged += len(e) * ub[li]
        units += len(e)
    return total, paged, units


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--arena", type=float, default=0.3, help="arena as a fraction of all expert slots")
    ap.add_argument("--ubatch", default="32,128,512,1024", help="n_ubatch values (n_batch = max(512, n_ubatch))")
    ap.add_argument("--tokens", type=int, default=700)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    path = args.model or default_model()
    lay = epqlab.inspect(path)
    with epqlab.Session(path, pager=False, n_ctx=1024) as s0:
        toks = s0.tokenize(TEXT)[: args.tokens]
    dist, dist_pages, units = distinct_bytes(path, toks, lay)
    arena = max(epqlab.Pager.min_arena_bytes(lay), int(args.arena * epqlab.Pager.all_experts_bytes(lay)))
    print(f"model {Path(path).name}: {len(toks)}-token prompt routes to {units} distinct (layer, expert) units = "
          f"{dist / 1e6:.1f} MB ({dist_pages / 1e6:.1f} MB in whole pages); arena {epqlab.fmt_bytes(arena)} ({args.arena:.0%} of all expert slots)\n")
    print(f"{'n_ubatch':>8} {'prefill tok/s':>14} {'(min-max)':>15} {'MB read':>8} {'re-read':>8} {'(pages)':>8} "
          f"{'staged':>7} {'hit rate':>8}")
    for nub in [int(x) for x in args.ubatch.split(",")]:
        rows = []
        for _ in range(args.repeats):
            with epqlab.Session(path, arena_bytes=arena, n_ubatch=nub, n_batch=max(512, nub), n_ctx=1024) as s:
                g = s.generate(toks, 1)
                rows.append(g.stats)
        tps = [r["prefill_tok_s"] for r in rows]
        r = rows[0]
        print(f"{nub:>8} {statistics.median(tps):>14.1f} {f'({min(tps):.0f}-{max(tps):.0f})':>15} "
              f"{r['ssd_bytes'] / 1e6:>8.1f} {r['ssd_bytes'] / dist:>7.2f}x {r['ssd_bytes'] / dist_pages:>7.2f}x "
              f"{r['staged_layers']:>7} {r['hit_rate']:>8.1%}")


if __name__ == "__main__":
    main()
