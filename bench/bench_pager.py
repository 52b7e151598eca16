"""Pager replay throughput vs a plain sequential O_DIRECT read of the same file.

Usage:
    .venv/bin/python bench/bench_pager.py [--model PATH] [--gb 4] [--tokens 64] [--arena 512MiB]

Without --model it synthesizes a Qwen3-30B-A3B-shaped model (Q4_K experts, 2.5 MiB each) with
enough layers for --gb gigabytes under $EPQLAB_CACHE/bench/ and reuses it on later runs. The
route log has temporal locality (RouteLog.synthetic: each of the previous token's experts kept with
p=0.5). Every run drops the file from the page cache first; replay reads with O_DIRECT. Prints one table: I/O
threads, GB/s of replay (bytes read / wall time), hit rate, and the ratio to the sequential read.
"""
from __future__ import annotations

import argparse
import mmap
import os
import time
from pathlib import Path


import epqlab
from epqlab.constants import ggml_row_bytes
from epqlab.models import synthesize
from epqlab.models.smollm2 import cache_dir
from epqlab.routes import RouteLog


def sequential_direct_read(path: Path, chunk: int = 8 << 20) -> float:
    """GB/s of one thread reading the whole file with O_DIRECT in 8 MiB requests."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    buf = mmap.mmap(-1, chunk)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        t0 = time.perf_counter()
        off, total = 0, 0
        while True:
            n = os.preadv(fd, [buf], off)
            if n <= 0:
                break
            total += n
            off += n
            if n < chunk:
                break
        return total / (time.perf_counter() - t0) / 1e9
    finally:
        os.close(fd)
        buf.close()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model")
    ap.add_argument("--gb", type=float, default=4.0)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--arena", default="512MiB")
    ap.add_argument("--threads", default="1,4,8,16,24")
    args = ap.parse_args()
    if args.model:
        path = Path(args.model)
    else:
        per_layer = 128 * 3 * ggml_row_bytes("Q4_K", 2048) * 768  # 128 experts x gate/up/down of 2048 x 768 Q4_K
        n_layer = max(1, int(args.gb * 1e9 // per_layer))
        path = cache_dir() / "bench" / f"qwen3-30b-a3b-{n_layer}L.gguf"
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            r = synthesize(path, "qwen3-30b-a3b", n_layer=n_layer)
            print(f"synthesized {path} ({r['bytes'] / 1e9:.2f} GB at {r['mb_per_s']:.0f} MB/s)")
    lay = epqlab.inspect(path)
    log = RouteLog.synthetic(args.tokens, len(lay.layers), lay.n_expert, lay.n_expert_used, locality=0.5, skew=0.0,
                             seed=0)
    seq = sequential_direct_read(path)
    print(f"model {path.name}: {lay.file_size / 1e9:.2f} GB, {len(lay.layers)} MoE layers x {lay.n_expert} experts "
          f"of {epqlab.fmt_bytes(lay.max_expert_bytes)}, top-{lay.n_expert_used}; arena {args.arena}; {args.tokens} tokens")
    print(f"sequential O_DIRECT read (1 thread, 8 MiB requests): {seq:.2f} GB/s\n")
    print(f"{'io_threads':>10} {'replay GB/s':>12} {'vs seq':>8} {'hit rate':>9} {'misses':>8} {'wall s':>7}")
    for th in [int(x) for x in args.threads.split(",")]:
        fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
        p = epqlab.Pager(lay, args.arena, io_threads=th)
        t0 = time.perf_counter()
        st = p.replay(log)
        wall = time.perf_counter() - t0
        gbs = st["bytes_read"] / wall / 1e9
        print(f"{th:>10} {gbs:>12.2f} {gbs / seq:>8.2f} {st['hit_rate']:>9.1%} {st['misses']:>8} {wall:>7.2f}")
        del p


if __name__ == "__main__":
    main()
