"""Decode speed and SSD traffic of paged generation, side by side in one run.

Usage:
    .venv/bin/python bench/bench_session.py [--model PATH] [--n 64] [--budget 4GiB] [--no-plain]

Default: the embedded default model, three rows measured in this process one after the other:
plain llama.cpp (pager off), pager on with every expert resident (the hook's overhead), and the
pager with an arena of 25% of the experts' slots. With --budget (e.g. a synthesized model larger
than RAM at 4GiB) the rows are: pager at that RAM budget, and plain llama.cpp (mmap) unless
--no-plain. Prints tok/s, the ratios to plain, hit rate, SSD MB/token, load time and peak memory.
"""
from __future__ import annotations

import argparse
import time

import epqlab
from epqlab.models import default_model

PROMPT = "A CPU cache is a small, fast memory that"


def run(path, label, n, **kw):
    t0 = time.perf_counter()
    with epqlab.Session(path, **kw) as s:
        prompt = s.chat_prompt([{"role": "user", "content": PROMPT}])
        s.generate(prompt, 4, add_special=False)  # first tokens: page faults, cold caches
        g = s.generate(prompt, n, add_special=False)
        st = g.stats
    st["label"] = label
    st["wall_s"] = time.perf_counter() - t0
    return st, g.text


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model")
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--budget")
    ap.add_argument("--no-plain", action="store_true")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    path = args.model or default_model()
    lay = epqlab.inspect(path)
    rows = []
    common = dict(n_threads=args.threads, n_ctx=1024)
    if args.budget:
        rows.append(run(path, f"pager, budget {args.budget}", args.n, ram_budget=args.budget, **common))
        if not args.no_plain:
            rows.append(run(path, "plain llama.cpp (mmap)", args.n, pager=False, **common))
    else:
        total = epqlab.Pager.all_experts_bytes(lay)
        rows.append(run(path, "plain llama.cpp (mmap)", args.n, pager=False, **common))
        rows.append(run(path, "pager, all experts resident", args.n, **common))
        rows.append(run(path, "pager, arena 25% of experts", args.n, arena_bytes=max(epqlab.Pager.min_arena_bytes(lay), total // 4), **common))
    base = next((r for r, _ in rows if not r["pager"]), None)
    print(f"model {path}: {len(lay.layers)} MoE layers x {lay.n_expert} experts, top-{lay.n_expert_used}, "
          f"routed experts {epqlab.fmt_bytes(lay.routed_expert_bytes)}; {args.n} tokens decoded per row\n")
    hdr = f"{'run':<32} {'decode tok/s':>12} {'vs plain':>8} {'prefill tok/s':>13} {'hit rate':>8} {'SSD MB/tok':>10} {'load s':>7} {'peak anon+shmem':>16} {'peak file':>10}"
    print(hdr)
    for r, _ in rows:
        ratio = r["decode_tok_s"] / base["decode_tok_s"] if base and base["decode_tok_s"] else float("nan")
        print(f"{r['label']:<32} {r['decode_tok_s']:>12.2f} {ratio:>8.2f} {r['prefill_tok_s']:>13.1f} "
              f"{r['hit_rate']:>8.1%} {r['decode_ssd_bytes_per_token'] / 1e6:>10.2f} {r['load_s']:>7.2f} "
              f"{epqlab.fmt_bytes(r['peak_total']):>16} {epqlab.fmt_bytes(r['peak_rss_file']):>10}")
    texts = {t for _, t in rows}
    print(f"\ngreedy text identical across rows: {len(texts) == 1}")
    print(f"text: {rows[0][1]!r}")


if __name__ == "__main__":
    main()
