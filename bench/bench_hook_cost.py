"""The hook's own cost per token, and how paged decode holds up when another process takes a core.

    .venv/bin/python bench/bench_hook_cost.py                                  # the default model
    .venv/bin/epqlab model synth qwen35-a3b /work/big/q35-l10.gguf --n-layer 10  # 4.5 GiB: fits in RAM whole
    .venv/bin/python bench/bench_hook_cost.py --model /work/big/q35-l10.gguf --threads 1,2 --busy
    .venv/bin/python bench/bench_hook_cost.py --model /work/big/q35.gguf --threads 2 --one-at-a-time   # full depth

Rows, each decoding ``--n`` tokens **teacher-forced** on the held-out prose (one token per decode step):

- ``plain``: plain llama.cpp (``pager=False``), the file warm in the page cache: no hook.
- ``paged``: the pager with an arena of every expert (after a warm-up pass every expert the text uses is
  resident, so no read is left: what remains is the hook), time split on (the default).
- ``paged-nosplit``: the same with ``time_split=False`` (one graph piece per MoE layer instead of two).

Every row at each ``--threads`` count, repeats interleaved, medians. The hook's cost per token is paged -
plain, and per graph piece that over ``decode_graph_pieces_per_pass`` (each piece is a ggml_graph_compute:
a thread-pool kick-off and barrier; mlx-lm #1438 found a per-layer readback costing 63% of a token).
``--busy`` repeats everything with one spinning process pinned to CPU 0 (another job taking a core) and
prints each row's slowdown (busy / quiet ms per token) and paged's slowdown over plain's (goal <= 1.2).
Run it alone: anything else on the box is the contention this measures.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics

import epqlab
from epqlab.data import heldout_texts
from epqlab.models import default_model
from epqlab.studies.roofline import warm_file
from epqlab.studies.strict import DEFAULT_PROMPT

ROWS = ("plain", "paged", "paged-nosplit")


def _spin(cpu: int) -> None:
    os.sched_setaffinity(0, {cpu})
    while True:
        pass


def _session(model, row: str, threads: int, full: int) -> epqlab.Session:
    if row == "plain":
        return epqlab.Session(model, pager=False, n_threads=threads, n_ctx=512)
    return epqlab.Session(model, arena_bytes=full, n_threads=threads, n_ctx=512, time_split=row == "paged")


def measure(model, threads: list[int], n: int, repeats: int, one_at_a_time: bool = False) -> dict:
    """{(row, threads): [(ms/token, pieces/pass), ...]} over ``repeats`` interleaved rounds. ``one_at_a_time``: each
    run opens its own Session (warm-up pass, timed pass, close), so a model whose arena of every expert and plain's
    page cache do not fit in RAM together (the 35B shape at full depth) can be measured."""
    lay = epqlab.inspect(model)
    full = epqlab.Pager.all_experts_bytes(lay)
    text = heldout_texts()["prose"]
    out: dict = {}
    if one_at_a_time:
        for _ in range(repeats):
            for r in ROWS:
                for t in threads:
                    with _session(model, r, t, full) as s:
                        s.generate(DEFAULT_PROMPT, n, forced=text)  # warm-up: the text's experts resident / cached
                        st = s.generate(DEFAULT_PROMPT, n, forced=text).stats
                    out.setdefault((r, t), []).append((1000.0 / st["decode_tok_s"],
                                                       st.get("decode_graph_pieces_per_pass", 0), st.get("decode_hit_rate")))
                    print(f"  {r} threads {t}: {1000.0 / st['decode_tok_s']:.1f} ms/token", flush=True)
        return out
    sessions = {(r, t): _session(model, r, t, full) for r in ROWS for t in threads}
    try:
        for s in sessions.values():
            s.generate(DEFAULT_PROMPT, n, forced=text)  # warm-up: every expert the text uses becomes resident
        for _ in range(repeats):
            for key, s in sessions.items():
                st = s.generate(DEFAULT_PROMPT, n, forced=text).stats
                out.setdefault(key, []).append((1000.0 / st["decode_tok_s"], st.get("decode_graph_pieces_per_pass", 0),
                                                st.get("decode_hit_rate")))
    finally:
        for s in sessions.values():
            s.close()
    return out


def table(res: dict, threads: list[int], label: str) -> dict:
    med = {k: statistics.median(x[0] for x in v) for k, v in res.items()}
    print(f"\n{label}\n| threads | row | ms/token (min-max) | pieces/pass | decode hit | x plain | hook ms/token | µs/piece |")
    print("|---|---|---|---|---|---|---|---|")
    for t in threads:
        base = med[("plain", t)]
        for r in ROWS:
            v = res[(r, t)]
            ms = [x[0] for x in v]
            pieces = v[0][1]
            hook = med[(r, t)] - base
            per = f"{1000 * hook / pieces:.0f}" if r != "plain" and pieces else "-"
            print(f"| {t} | {r} | {med[(r, t)]:.1f} ({min(ms):.1f}-{max(ms):.1f}) | {pieces:.0f} | "
                  f"{v[0][2] if r != 'plain' else '-'} | {med[(r, t)] / base:.2f} | {hook if r != 'plain' else 0:.1f} | {per} |")
    return med


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--n", type=int, default=33, help="teacher-forced tokens per run (decode passes = n - 1)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--busy", action="store_true", help="also measure with one spinning process on CPU 0")
    ap.add_argument("--one-at-a-time", action="store_true",
                    help="one Session open at a time (a full-depth 35B shape: its arena and plain's page cache do not "
                         "fit in RAM together)")
    a = ap.parse_args()
    model = str(a.model or default_model(progress=False))
    threads = [int(x) for x in a.threads.split(",")]
    w = warm_file(model)
    print(f"model {model}: {w['bytes'] / 2**30:.2f} GiB read into the page cache; {a.n} teacher-forced tokens, "
          f"{a.repeats} interleaved repeats, threads {threads}", flush=True)
    quiet = table(measure(model, threads, a.n, a.repeats, a.one_at_a_time), threads, "quiet")
    if not a.busy:
        return
    p = mp.Process(target=_spin, args=(0,), daemon=True)
    p.start()
    try:
        busy = table(measure(model, threads, a.n, a.repeats, a.one_at_a_time), threads, "one core kept busy (a spinning process on CPU 0)")
    finally:
        p.kill()
    print("\n| threads | row | slowdown busy/quiet | / plain's slowdown (goal <= 1.2) |\n|---|---|---|---|")
    for t in threads:
        sp = busy[("plain", t)] / quiet[("plain", t)]
        for r in ROWS:
            s = busy[(r, t)] / quiet[(r, t)]
            print(f"| {t} | {r} | {s:.2f} | {s / sp:.2f} |")


if __name__ == "__main__":
    main()
