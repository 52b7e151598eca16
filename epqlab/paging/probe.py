"""Device I/O probe: how fast can the storage under a model serve expert-sized random reads?

Every pager decision (how many I/O threads, whether to split a large read, how long a miss
costs) rests on three numbers of the device: per-request latency, single-stream bandwidth and
how aggregate bandwidth grows with the number of reads in flight. :func:`probe_io` measures them
the way the pager reads: random 4096-aligned ``pread`` calls from native threads (no GIL), with
``O_DIRECT`` by default so the page cache does not answer for the disk.

One *cell* = one (request size, concurrency) pair: ``concurrency`` threads start together and each
issues ``n_requests`` reads back to back, so ``concurrency`` reads are in flight for the whole cell.

Units: latency in microseconds (µs); bandwidth in MB/s with MB = 10**6 bytes; IOPS = requests/s.
The seed study on its disk measured 4 KiB reads at 0.57 ms, one 1.9 MB stream at ~275 MB/s and
aggregate bandwidth rising linearly to ~2.8 GB/s at 16 threads (see docs/DESIGN.md §8).
"""
from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from ..constants import GGUF_MAGIC
from ..errors import NotGGUFError, NotMoEError, ProbeFileTooSmallError
from ..layout import inspect
from ..units import fmt_bytes, parse_bytes

logger = logging.getLogger(__name__)

DEFAULT_REQUEST_BYTES: tuple[int, ...] = (4096, 65536, 1_900_000)
"""4 KiB (latency floor), 64 KiB (a small matrix slice) and 1.9 MB (the seed study's expert read)."""
DEFAULT_CONCURRENCY: tuple[int, ...] = (1, 2, 4, 6, 8, 12, 16)
DEFAULT_SCRATCH_BYTES = 2 * 1024**3
"""Scratch file size: large enough that the device's (or a VM host's) cache does not serve it all."""
REFERENCE_EXPERT_BYTES = 176_256
"""One Q8_0 expert of 3 matrices 576x96 (gate+up+down): the small test MoE's unit, used when no model is given."""
ALIGN = 4096

COLUMNS = [
    "label", "source", "request_bytes", "read_bytes", "concurrency", "n_requests", "total_bytes", "wall_s",
    "lat_median_us", "lat_mean_us", "lat_p90_us", "lat_p99_us", "lat_min_us", "lat_max_us", "mb_s", "iops", "mode",
]
"""Columns of :func:`probe_io`'s table, in order."""


# --------------------------------------------------------------------------------------------- sizes

def size_label(n: int) -> str:
    if n % 1024 == 0 and n < 1024**2:
        return f"{n // 1024} KiB"
    if n % 1024**2 == 0:
        return f"{n // 1024**2} MiB"
    if n >= 100_000 and n % 100_000 == 0:
        return f"{n / 1e6:g} MB"
    return f"{n} B"


def model_request_sizes(path: str | os.PathLike) -> list[tuple[int, str, str]]:
    """The byte sizes a pager reads from a MoE GGUF: each distinct per-matrix expert slice
    (``ExpertTensor.expert_bytes``) and each distinct per-expert unit (``ExpertLayer.expert_bytes``).

    Returns ``[(bytes, label, source)]`` with source ``"model:matrix"`` or ``"model:expert"``.
    Raises what :func:`epqlab.inspect` raises (NotGGUFError, NotMoEError, ...).
    """
    layout = inspect(path)
    out: dict[int, tuple[str, str]] = {}
    for layer in layout.layers:
        for t in layer.tensors:
            out.setdefault(t.expert_bytes, (f"matrix {t.kind} {t.ggml_type} ({fmt_bytes(t.expert_bytes)})", "model:matrix"))
    for layer in layout.layers:  # an expert label wins over a matrix label of the same size
        n = layer.expert_bytes
        if n not in out or out[n][1] != "model:expert":
            out[n] = (f"expert {'/'.join(layer.types)} ({fmt_bytes(n)})", "model:expert")
    return [(n, lab, src) for n, (lab, src) in sorted(out.items())]


def _is_gguf(path: Path) -> bool:
    try:
        with open(path, "rb") as fh:
            return fh.read(4) == GGUF_MAGIC
    except OSError:
        return False


def _plan_sizes(path: Path | None, request_bytes: Iterable[int] | None) -> list[tuple[int, str, str]]:
    if request_bytes is not None:
        sizes = sorted({int(n) for n in request_bytes})
        if not sizes or sizes[0] <= 0:
            raise ValueError(f"request_bytes must be positive byte counts, got {list(request_bytes)!r}")
        return [(n, size_label(n), "user") for n in sizes]
    plan = {n: (size_label(n), "default") for n in DEFAULT_REQUEST_BYTES}
    if path is not None and _is_gguf(path):
        try:
            for n, lab, src in model_request_sizes(path):
                plan[n] = (lab, src)
        except NotMoEError:
            logger.info("%s is a dense GGUF: probing the default sizes only", path)
        except NotGGUFError as e:  # any file can be probed; only a MoE GGUF llama.cpp would load adds sizes
            logger.info("%s: no expert sizes (%s); probing the default sizes only", path, e)
    return [(n, lab, src) for n, (lab, src) in sorted(plan.items())]


# --------------------------------------------------------------------------------------------- scratch

def _write_scratch(directory: Path, n_bytes: int, seed: int) -> Path:
    """Creates a file of ``n_bytes`` random bytes (really written, not sparse) in ``directory``."""
    fd, name = tempfile.mkstemp(prefix="epqlab-probe-", suffix=".bin", dir=directory)
    path = Path(name)
    try:
        rng = np.random.default_rng(seed)
        chunk = 16 * 1024**2
        with os.fdopen(fd, "wb") as fh:
            left = n_bytes
            while left > 0:
                k = min(chunk, left)
                fh.write(rng.bytes(k))
                left -= k
            fh.flush()
            os.fsync(fh.fileno())  # dirty pages are not dropped by FADV_DONTNEED; write them out first
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    return path


# --------------------------------------------------------------------------------------------- probe

def probe_io(
    path: str | os.PathLike | None,
    request_bytes: Iterable[int] | None = None,
    concurrency: Sequence[int] = DEFAULT_CONCURRENCY,
    n_requests: int = 64,
    direct: bool = True,
    drop_cache: bool = True,
    seed: int = 0,
    *,
    scratch_bytes: int | str | None = None,
    scratch_dir: str | os.PathLike | None = None,
    progress: bool | str = True,
):
    """Measure random-read latency and bandwidth of the device holding ``path``.

    Args:
        path: the file to read (e.g. a model), or a **directory** in which to create a scratch file,
            or ``None`` for a scratch file in ``scratch_dir`` (default: the system temp dir). A scratch
            file holds ``scratch_bytes`` of random data really written to disk (not sparse) and is
            removed afterwards, also on error or Ctrl-C.
        request_bytes: read sizes in bytes. ``None`` = 4096, 65536 and 1_900_000, plus, when ``path``
            is a MoE GGUF, that model's distinct per-matrix (``ExpertTensor.expert_bytes``) and
            per-expert (``ExpertLayer.expert_bytes``) sizes.
        concurrency: numbers of reader threads; each thread keeps one read in flight.
        n_requests: reads **per thread** in each cell (a cell at concurrency c issues c * n_requests).
        direct: open with ``O_DIRECT`` (bypass the page cache). Falls back to buffered reads where the
            filesystem refuses it; the ``mode`` column says what ran.
        drop_cache: ``posix_fadvise(POSIX_FADV_DONTNEED)`` over the file before every cell, so buffered
            runs start cold too.
        seed: offsets are uniform over 4096-aligned positions, reproducible for a given seed.
        scratch_bytes: scratch file size (int or e.g. ``"2GiB"``); default 2 GiB. Only for scratch mode.
        scratch_dir: where to create the scratch file when ``path`` is None.
        progress: show a ``tqdm.auto`` progress bar over cells; ``"text"``: a plain-text bar on stderr (for a
            notebook run by papermill: a widget bar's saved output keeps its first state, "0/N").

    Returns:
        ``pandas.DataFrame``, one row per (request size, concurrency), sizes ascending, with columns
        :data:`COLUMNS`: ``label``/``source`` (where the size came from), ``request_bytes``,
        ``read_bytes`` (issued size: rounded up to 4096 with O_DIRECT), ``concurrency``, ``n_requests``
        (in the cell), ``total_bytes`` (transferred), ``wall_s`` (s), ``lat_{median,mean,p90,p99,min,max}_us``
        (µs per request), ``mb_s`` = total_bytes / wall_s / 1e6 (aggregate MB/s), ``iops`` =
        n_requests / wall_s, and ``mode`` ("direct" or "buffered"). ``df.attrs`` records the file,
        its size, whether it was a scratch file, and the arguments.

    Raises:
        ProbeFileTooSmallError: the file is smaller than the largest request size.
        FileNotFoundError: ``path`` does not exist.
        ValueError: empty or non-positive sizes, concurrency or n_requests.
        OSError: a read failed; ``filename``, ``errno`` and an extra ``offset`` attribute say where.
    """
    import pandas as pd
    from tqdm import tqdm as text_bar
    from tqdm.auto import tqdm as auto_bar

    from .native import pager_core as core
    tqdm = text_bar if progress == "text" else auto_bar
    conc = [int(c) for c in concurrency]
    if not conc or min(conc) <= 0:
        raise ValueError(f"concurrency must be positive thread counts, got {list(concurrency)!r}")
    if int(n_requests) <= 0:
        raise ValueError(f"n_requests must be > 0, got {n_requests!r}")

    target = Path(path) if path is not None else None
    scratch = target is None or target.is_dir()
    if not scratch and not target.exists():
        raise FileNotFoundError(2, "no such file to probe", str(target))
    sizes = _plan_sizes(None if scratch else target, request_bytes)
    largest = sizes[-1][0]

    scratch_path: Path | None = None
    if scratch:
        n_scratch = parse_bytes(scratch_bytes) if scratch_bytes is not None else DEFAULT_SCRATCH_BYTES
        if n_scratch < largest:
            raise ProbeFileTooSmallError(
                f"scratch file of {n_scratch} bytes is smaller than the largest request ({largest} bytes); "
                "raise scratch_bytes or drop the large sizes"
            )
        directory = target if target is not None else Path(scratch_dir or tempfile.gettempdir())
        scratch_path = _write_scratch(directory, n_scratch, seed)
        file = scratch_path
    else:
        file = target
    try:
        file_size = file.stat().st_size
        if file_size < largest:
            raise ProbeFileTooSmallError(
                f"{file} is {file_size} bytes, smaller than the largest request ({largest} bytes, "
                f"{size_label(largest)}); probe a larger file or pass smaller request_bytes"
            )
        probe = core.IoProbe(str(file), bool(direct))
        rows = []
        cells = [(s, c) for s in sizes for c in conc]
        for (n, label, source), c in tqdm(cells, desc="io probe", unit="cell", disable=not progress):
            r = probe.run(n, c, int(n_requests), int(seed), bool(drop_cache))
            lat = np.asarray(r["latency_us"], dtype=np.float64)
            wall = float(r["wall_s"])
            rows.append({
                "label": label, "source": source,
                "request_bytes": int(r["request_bytes"]), "read_bytes": int(r["read_bytes"]),
                "concurrency": int(r["concurrency"]), "n_requests": int(r["n_requests"]),
                "total_bytes": int(r["total_bytes"]), "wall_s": wall,
                "lat_median_us": float(np.median(lat)), "lat_mean_us": float(lat.mean()),
                "lat_p90_us": float(np.percentile(lat, 90)), "lat_p99_us": float(np.percentile(lat, 99)),
                "lat_min_us": float(lat.min()), "lat_max_us": float(lat.max()),
                "mb_s": r["total_bytes"] / wall / 1e6, "iops": r["n_requests"] / wall,
                "mode": str(r["mode"]),
            })
        df = pd.DataFrame(rows, columns=COLUMNS)
        df.attrs.update({
            "path": str(file), "file_size": int(file_size), "scratch": scratch, "mode": probe.mode,
            "direct_requested": bool(direct), "drop_cache": bool(drop_cache), "seed": int(seed),
            "n_requests_per_thread": int(n_requests),
        })
        return df
    finally:
        if scratch_path is not None:
            scratch_path.unlink(missing_ok=True)


# --------------------------------------------------------------------------------------------- reading

def rows_of_size(df, size: int):
    """The rows of a :func:`probe_io` table for one request size, by concurrency."""
    return df[df.request_bytes == size].sort_values("concurrency")


def flatten_concurrency(df, size: int, fraction: float = 0.9) -> int:
    """Smallest concurrency whose aggregate MB/s for ``size`` reaches ``fraction`` of that size's best."""
    r = rows_of_size(df, size)
    best = r.mb_s.max()
    return int(r[r.mb_s >= fraction * best].concurrency.iloc[0])


def summarize(df) -> dict:
    """Headline numbers of a :func:`probe_io` table.

    Keys: ``mode``; ``lat_small_us`` and ``small_bytes`` (median latency of the smallest size at the
    lowest concurrency; 4 KiB by default); ``single_stream_mb_s`` and ``large_bytes`` (largest size at
    the lowest concurrency); ``best_mb_s``, ``best_bytes``, ``best_concurrency`` (highest aggregate
    MB/s in the table); ``flatten_concurrency`` (where the best size reaches 90% of its best).
    """
    c0 = int(df.concurrency.min())
    small, large = int(df.request_bytes.min()), int(df.request_bytes.max())
    best = df.loc[df.mb_s.idxmax()]
    return {
        "mode": "/".join(sorted(set(df["mode"]))),
        "small_bytes": small,
        "lat_small_us": float(rows_of_size(df, small).query("concurrency == @c0").lat_median_us.iloc[0]),
        "large_bytes": large,
        "single_stream_mb_s": float(rows_of_size(df, large).query("concurrency == @c0").mb_s.iloc[0]),
        "min_concurrency": c0,
        "best_mb_s": float(best.mb_s),
        "best_bytes": int(best.request_bytes),
        "best_concurrency": int(best.concurrency),
        "flatten_concurrency": flatten_concurrency(df, int(best.request_bytes)),
    }


__all__ = [
    "probe_io", "model_request_sizes", "summarize", "flatten_concurrency", "rows_of_size", "size_label", "DEFAULT_REQUEST_BYTES", "DEFAULT_CONCURRENCY",
    "DEFAULT_SCRATCH_BYTES", "REFERENCE_EXPERT_BYTES", "COLUMNS",
]
