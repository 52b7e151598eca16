"""Segment-parallel expert reads: choose the segment size from a device probe.

A miss reads each of an expert's matrices (one slice per tensor, e.g. 1.67 MB for a Q8_0
Qwen3-30B-A3B expert matrix) as one ``pread``. When a layer misses few experts, fewer reads than
I/O threads are in flight and the device idles (seed study 002: +48 % decode from splitting each
expert's reads into parallel segments). ``Session(read_segment_bytes=...)`` splits every slice read
into page-aligned segments spread over the I/O pool (native/pager/pager.h ``set_read_segment_bytes``).

:func:`segment_from_probe` picks the size from :func:`epqlab.paging.probe.probe_io`'s table: enough
segments that ``io_threads`` reads are in flight for a layer's ``reads_per_layer`` slice reads, but
no segment smaller than the smallest probed request size that still reaches ``fraction`` of the
largest size's aggregate MB/s at that concurrency (smaller requests cost more per byte). Whether
it wins is a measurement (bench/bench_overlap.py), so the Session's default stays one read per slice.
"""
from __future__ import annotations

import math

ALIGN = 4096


def segment_from_probe(df, slice_bytes: int, reads_per_layer: int, io_threads: int, fraction: float = 0.9) -> int:
    """Segment size in bytes (a multiple of 4096), or 0 for "do not split".

    Args:
        df: :func:`epqlab.paging.probe.probe_io` table (``request_bytes``, ``concurrency``, ``mb_s``).
        slice_bytes: bytes of one expert matrix slice (``ExpertTensor.expert_bytes``).
        reads_per_layer: slice reads a layer issues per token (misses x matrices per expert).
        io_threads: the pager's reader threads.
        fraction: the efficiency floor for small requests (default 0.9 of the best size's MB/s).

    Raises:
        ValueError: non-positive sizes or thread counts, or an empty probe table.
    """
    if slice_bytes <= 0 or reads_per_layer <= 0 or io_threads <= 0:
        raise ValueError("slice_bytes, reads_per_layer and io_threads must be > 0")
    if len(df) == 0:
        raise ValueError("the probe table is empty: run epqlab.paging.probe.probe_io first")
    if reads_per_layer >= io_threads:
        return 0  # every thread already has a whole slice to read
    c = int(df.concurrency[df.concurrency <= io_threads].max()) if (df.concurrency <= io_threads).any() \
        else int(df.concurrency.min())
    at = df[df.concurrency == c].groupby("request_bytes").mb_s.median()
    floor = fraction * float(at.max())
    efficient = [int(s) for s, v in at.items() if v >= floor]
    min_seg = min(efficient)
    want = math.ceil(slice_bytes * reads_per_layer / io_threads)
    seg = max(want, min_seg)
    seg = -(-seg // ALIGN) * ALIGN
    return 0 if seg >= slice_bytes else seg
