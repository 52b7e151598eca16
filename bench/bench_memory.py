"""Honest memory on a model larger than its memory limit: paged vs plain mmap under one hard limit.

    .venv/bin/epqlab model synth qwen3-30b-a3b /work/big/q8g.gguf --n-layer 24      # 8.3 GiB
    .venv/bin/python bench/bench_memory.py --model /work/big/q8g.gguf [--limit 1.5GiB] [--levels ...]

Every run decodes teacher-forced on the held-out prose (one token per step: a random-weight model's own
greedy output repeats itself and routes alike).

1. One limit (default: a fifth of the file, rounded down to 64 MiB), both modes, each run a child in
   a memory cgroup that charges page cache (``epqlab.studies.strict``), file dropped from the page cache
   before each run, ``--repeats`` runs each (medians): decode tok/s, cgroup peak and failcnt, load
   time and bytes read by the load, SSD MB/token.
2. The device's bandwidth for this model's expert reads (``epqlab.probe_io`` at the pager's I/O
   thread count), then the paged run against an I/O model: time/token vs (miss bytes/token /
   probe bandwidth + compute time/token), compute = decode time - I/O wait (per pass); and the
   load against dense bytes / probe bandwidth + 2 s.
2b. The roofline: plain llama.cpp with every weight in RAM (``epqlab.studies.roofline``; skipped when the
   file cannot fit), and the paged run's time/token / max(T_plain, miss bytes/token / probe bandwidth).
3. The strict table at ``--levels`` (default: the limit x 1, 1.5, 2, 3), paged only.

Every speed is printed beside the bytes moved; the disk here alternates between ~1.2 GB/s and a
throttled ~0.45 GB/s, so compare rows of one run, not runs of different days.
"""
from __future__ import annotations

import argparse
import statistics

import epqlab
from epqlab.data import heldout_texts
from epqlab.studies import roofline, strict, strict_report
from epqlab.paging.pager import default_io_threads
from epqlab.units import fmt_bytes, parse_bytes


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--limit", default=None, help="memory limit (default: file size / 5, rounded down to 64 MiB)")
    ap.add_argument("--levels", default=None, help="strict table levels (default: limit x 1, 1.5, 2, 3)")
    ap.add_argument("--n", type=int, default=8, help="tokens generated per run")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--results-dir", default="results")
    ap.add_argument("--no-table", action="store_true", help="skip part 3 (the strict table)")
    args = ap.parse_args()
    lay = epqlab.inspect(args.model)
    limit = parse_bytes(args.limit) if args.limit else lay.file_size // 5 // (64 * 2**20) * (64 * 2**20)
    print(f"model {lay.path} ({fmt_bytes(lay.file_size)}; routed experts {fmt_bytes(lay.routed_expert_bytes)}, "
          f"dense {fmt_bytes(lay.non_expert_bytes)}); limit {fmt_bytes(limit)} = 1/{lay.file_size / limit:.1f} of the file\n")
    kw = dict(n_threads=args.threads, n_ctx=512)

    # 1. paged vs mmap under one limit
    forced = heldout_texts()["prose"]
    df = strict.run(args.model, [limit], n_predict=args.n, forced=forced, repeats=args.repeats, mmap_baseline=True, **kw)
    print(strict_report.format_table(df))
    paged = df[df["mode"] == "paged"].iloc[0]
    mm = df[df["mode"] == "mmap"].iloc[0]

    # 2. the device and the I/O model
    io_threads = default_io_threads()
    mat = max(t.expert_bytes for l in lay.layers for t in l.tensors)
    probe = epqlab.probe_io(args.model, request_bytes=[mat], concurrency=[io_threads], n_requests=32, progress=False)
    bw = float(probe["mb_s"].iloc[0]) * 1e6
    print(f"\nprobe: {fmt_bytes(mat)} reads x {io_threads} threads: {bw / 1e6:.0f} MB/s")
    runs = [r for r in df.attrs.get("runs", []) if r.get("pager") and r.get("status") == "PASS"]
    model_rows = []
    for r in runs:
        st = r["stats"]
        passes = st.get("decode_passes") or 0
        if not passes or not st.get("decode_tok_s"):
            continue
        t_tok = 1 / st["decode_tok_s"]
        wait = st["decode_io_wait_s"] / passes
        miss = st["decode_ssd_bytes_per_token"]
        compute = t_tok - wait
        model_rows.append((t_tok, miss / bw + compute, miss, wait, compute))
    if model_rows:
        t_tok, bound, miss, wait, compute = (statistics.median(x) for x in zip(*model_rows))
        print(f"paged decode: {t_tok * 1e3:.0f} ms/token = I/O wait {wait * 1e3:.0f} ms + compute {compute * 1e3:.0f} ms; "
              f"{miss / 1e6:.1f} MB read/token -> at probe bandwidth {miss / bw * 1e3:.0f} ms; "
              f"time/token / (miss/bw + compute) = {t_tok / bound:.2f} (goal <= 1.10)")
    if paged["status"] == "PASS" and mm["status"] == "PASS":
        print(f"paged {paged['decode_tok_s']:.3f} tok/s vs mmap {mm['decode_tok_s']:.3f} tok/s under the same limit: "
              f"{paged['decode_tok_s'] / mm['decode_tok_s']:.1f}x; same text: {paged['tokens'] == mm['tokens']}")
    for name, r in (("paged", paged), ("mmap", mm)):
        print(f"{name:>5} load: {r['load_s']:.2f} s, {fmt_bytes(r['load_bytes_read'] or 0)} read; cgroup peak "
              f"{fmt_bytes(r['cgroup_peak'] or 0)}, failcnt {r['failcnt']}")
    if paged["status"] == "PASS":
        try:
            plain = roofline.plain_reference(args.model, strict.DEFAULT_PROMPT, forced, args.n, repeats=args.repeats, **kw)
            b = roofline.bound_ratios(1000 / paged["decode_tok_s"], plain["ms_per_token"], paged["ssd_mb_per_token"] * 1e6, bw)
            print(f"plain llama.cpp, all weights in RAM: {plain['ms_per_token']:.0f} ms/token; paged "
                  f"{1000 / paged['decode_tok_s']:.0f} ms/token = {b['roofline_ratio']:.2f} x max(T_plain, miss/BW "
                  f"{b['io_ms']:.0f} ms), {b['plain_ratio']:.2f} x plain tok/s")
        except epqlab.EpqlabError as e:
            print(f"roofline skipped: {e}")
    goal = lay.non_expert_bytes / bw + 2
    print(f"load goal: <= dense bytes / probe bandwidth + 2 s = {goal:.2f} s (paged load {paged['load_s']:.2f} s)")

    # 3. strict table
    if args.no_table:
        return
    levels = strict.parse_levels(args.levels) if args.levels else [int(limit * f) for f in (1, 1.5, 2, 3)]
    table = strict.run(args.model, levels, n_predict=args.n, forced=forced, repeats=args.repeats, **kw)
    print("\n" + strict_report.format_table(table))
    strict_report.save(table, args.results_dir, name="bench_memory")


if __name__ == "__main__":
    main()
