"""What a forward pass of n tokens costs against one token: plain llama.cpp (``pager=False``, every weight in RAM),
random token ids appended to a 32-token prompt, widths interleaved, medians printed with ms per token.

    .venv/bin/python bench/bench_pass_width.py --model /work/big/q35.gguf --widths 1,2,3,4,8 --repeats 5

A verify pass of speculative decoding (docs/DESIGN.md §3g) is such a pass of 1 + d tokens: where the pass of 2 costs
about twice the pass of 1, drafting cannot pay. Run it alone: a build or a test suite beside it measures the
contention.
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

import epqlab
from epqlab.studies.roofline import warm_file


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--widths", default="1,2,3,4,8")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    widths = [int(x) for x in a.widths.split(",") if x.strip()]
    warm_file(a.model)
    with epqlab.Session(a.model, pager=False, n_threads=a.threads, n_ctx=2048) as s:
        e = s.decoder.engine
        e.clear()
        prompt = np.array(s.tokenize("The quick brown fox jumps over the lazy dog. " * 4)[:32], np.int32)
        e.decode(prompt, 0, False)
        pos, rng = len(prompt), np.random.default_rng(0)
        res = {n: [] for n in widths}
        for _ in range(a.repeats):
            for n in widths:
                if pos + n > s.n_ctx:
                    e.clear()
                    e.decode(prompt, 0, False)
                    pos = len(prompt)
                t = rng.integers(100, min(20000, s.n_vocab), n).astype(np.int32)
                t0 = time.perf_counter()
                e.decode(t, pos, True)
                res[n].append(time.perf_counter() - t0)
                pos += n
    one = statistics.median(res[widths[0]]) / widths[0]
    print("| tokens in the pass | ms (min-max) | ms per token | x one token's |")
    print("|---|---|---|---|")
    for n, v in res.items():
        m = statistics.median(v)
        print(f"| {n} | {1000 * m:.1f} ({1000 * min(v):.1f}-{1000 * max(v):.1f}) | {1000 * m / n:.1f} | {m / one:.2f} |")


if __name__ == "__main__":
    main()
