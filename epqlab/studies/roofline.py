"""The roofline every paged speed is held against: plain llama.cpp with all weights in RAM, and the disk.

A paged decode step cannot be faster than the same step of plain llama.cpp with every weight already in
RAM (``T_plain``: same model, shape, threads and kernels: a ``Session(pager=False)`` on a file warm in
the page cache), nor faster than reading its missed experts (``miss bytes per token / bandwidth``, the
bandwidth from :func:`epqlab.probe_io` at the pager's request size and I/O threads). Its bound is the
larger of the two (compute and reads overlap at best: docs/DESIGN.md §5, pipelined reads), and a
paged row reports::

    roofline_ratio = time per token / max(T_plain, miss_bytes_per_token / bandwidth)   (>= 1; 1 = at the bound)
    plain_ratio    = paged tok/s / plain tok/s                                          (<= 1)

- :func:`warm_file`: read a model file into the page cache (refused when it cannot fit).
- :func:`plain_reference`: ``T_plain`` by teacher-forced decode of real text, median of repeats.
- :func:`bound_ratios`: the two ratios of one paged row.
"""
from __future__ import annotations

import os
import statistics
import time

import psutil

from ..engine.session import Session
from ..errors import EpqlabError
from ..units import fmt_bytes

CHUNK = 16 << 20
WARM_MARGIN = 1 << 30  # RAM left to everything else while the file sits in the page cache


def warm_file(path, *, margin: int = WARM_MARGIN) -> dict:
    """Read ``path`` once so that all of it is in the page cache (buffered reads of 16 MiB).

    Returns:
        ``{"bytes": file size, "seconds": read time, "mb_s": MB/s}``.

    Raises:
        EpqlabError: the file is larger than MemAvailable - ``margin`` (plus what of it is cached
            already): it cannot be held in RAM, so there is no plain-in-RAM reference on this machine.
    """
    size = os.path.getsize(path)
    avail = psutil.virtual_memory().available
    if size > avail - margin:
        raise EpqlabError(f"{path} is {fmt_bytes(size)} but only {fmt_bytes(avail)} of RAM is available "
                          f"(keeping {fmt_bytes(margin)} free): plain llama.cpp cannot hold it in RAM here, so there is "
                          "no all-in-RAM reference; use a model with fewer layers (--n-layer) for the roofline")
    t0 = time.perf_counter()
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        while os.read(fd, CHUNK):
            pass
    finally:
        os.close(fd)
    dt = time.perf_counter() - t0
    return {"bytes": size, "seconds": dt, "mb_s": size / 1e6 / max(dt, 1e-9)}


def plain_reference(model, prompt, forced, n_predict: int, *, repeats: int = 3, warm: bool = True,
                    **session_kw) -> dict:
    """``T_plain``: plain llama.cpp (``Session(pager=False)``, dense weights and experts on llama.cpp's own
    mmap, no hook) decoding ``forced`` teacher-forced after ``prompt``, the file warm in the page cache.

    One warm-up generation, then ``repeats`` timed ones in one Session (the same tokens each time).

    Args:
        model: GGUF path; prompt: text or ids; forced: the text (or ids) fed one per decode step;
        n_predict: decode tokens per run; repeats: timed runs (>= 1); warm: read the file first
            (:func:`warm_file`); **session_kw: e.g. ``n_threads``, ``n_ctx`` (use the paged runs' values).

    Returns:
        ``{"ms_per_token", "decode_tok_s" (medians), "ms_per_token_runs" (list), "prefill_tok_s", "warm"}``.

    Raises:
        EpqlabError: the file does not fit in RAM (from :func:`warm_file`); ValueError: repeats < 1.
    """
    if int(repeats) < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    w = warm_file(model) if warm else None
    ms, pre = [], []
    with Session(model, pager=False, **session_kw) as s:
        s.generate(prompt, n_predict, forced=forced)  # warm-up: page tables, thread pool, allocator
        for _ in range(int(repeats)):
            st = s.generate(prompt, n_predict, forced=forced).stats
            ms.append(1000.0 / st["decode_tok_s"] if st.get("decode_tok_s") else float("nan"))
            pre.append(st.get("prefill_tok_s"))
    med = statistics.median(ms)
    return {"ms_per_token": med, "decode_tok_s": 1000.0 / med, "ms_per_token_runs": ms,
            "prefill_tok_s": statistics.median(p for p in pre if p) if any(pre) else None, "warm": w}


def bound_ratios(ms_per_token: float, plain_ms_per_token: float, miss_bytes_per_token: float,
                 bandwidth_bytes_s: float | None) -> dict:
    """The two ratios of one paged row (module docstring): ``bound_ms`` = max(T_plain, miss bytes /
    bandwidth), ``io_ms`` = miss bytes / bandwidth (None without a bandwidth), ``roofline_ratio``,
    ``plain_ratio`` (paged tok/s / plain tok/s = T_plain / paged time per token)."""
    io_ms = 1000.0 * miss_bytes_per_token / bandwidth_bytes_s if bandwidth_bytes_s else None
    bound = max(plain_ms_per_token, io_ms or 0.0)
    return {"bound_ms": bound, "io_ms": io_ms, "roofline_ratio": ms_per_token / bound if bound else None,
            "plain_ratio": plain_ms_per_token / ms_per_token if ms_per_token else None}


__all__ = ["bound_ratios", "plain_reference", "warm_file"]
