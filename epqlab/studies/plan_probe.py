"""The device probe ``epqlab plan`` uses, cached per device and file size under the epqlab cache.

The probe reads the model's own file (:func:`epqlab.probe_io`) at its expert matrix sizes (what the pager
reads per request) and at 1, 2, 4 ... up to the pager's I/O threads in flight. The table is written to
``$EPQLAB_CACHE/probe/dev<st_dev>-<file size>.json`` whole or not at all (a temporary beside it, renamed) and
reused while the model sits on the same device with the same size: a file moved to another disk is probed
again, ``reprobe=True`` always probes.
"""
from __future__ import annotations

import json
import os
import resource
import time
from pathlib import Path

import pandas as pd

from ..errors import EpqlabError
from ..layout import ModelLayout
from ..paging.probe import probe_io
from ..results import atomic_path

FORMAT = "epqlab-plan-probe/1"
N_REQUESTS = 24  # reads per thread and cell: ~0.1-1 s a cell on an SSD


class ProbeCacheError(EpqlabError, ValueError):
    """A probe cache file that is not one epqlab wrote for this device and file size."""


class ProbeUnusableError(EpqlabError, OSError):
    """The device under the model cannot be probed as the pager reads it (no O_DIRECT, not a regular file)."""


def matrix_sizes(lay: ModelLayout) -> list[int]:
    """Distinct per-matrix expert read sizes of the model (``ExpertTensor.expert_bytes``), ascending."""
    return sorted({int(t.expert_bytes) for layer in lay.layers for t in layer.tensors})


def concurrencies(io_threads: int) -> list[int]:
    """1, 2, 4, ... below ``io_threads``, and ``io_threads``."""
    out, c = [], 1
    while c < io_threads:
        out.append(c)
        c *= 2
    return out + [int(io_threads)]


RAM_FILESYSTEMS = ("tmpfs", "ramfs", "hugetlbfs")


def fs_type(path) -> str:
    """The file system type of the mount holding ``path`` (the longest mount point of /proc/self/mounts above
    it), or "" when it cannot be told."""
    real = os.path.realpath(path)
    best, kind = "", ""
    try:
        with open("/proc/self/mounts") as fh:
            for line in fh:
                parts = line.split()
                if len(parts) < 3:
                    continue
                mnt = parts[1].replace("\\040", " ")
                if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                    best, kind = mnt, parts[2]
    except OSError:
        return ""
    return kind


def cache_path(model_path, cache_root) -> Path:
    st = os.stat(model_path)
    return Path(cache_root) / "probe" / f"dev{st.st_dev}-{st.st_size}.json"


def _check(d, path: Path, st_dev: int, size: int, sizes, concs) -> pd.DataFrame:
    if not isinstance(d, dict) or d.get("format") != FORMAT:
        raise ProbeCacheError(f"{path} is not an epqlab plan probe cache (format {FORMAT}); delete it or rerun with --reprobe")
    if d.get("st_dev") != st_dev or d.get("file_size") != size:
        raise ProbeCacheError(f"{path} was probed for device {d.get('st_dev')} and a file of {d.get('file_size')} bytes, not "
                              f"device {st_dev} and {size} bytes; delete it or rerun with --reprobe")
    try:
        df = pd.DataFrame(d["rows"])
        need = {"request_bytes", "concurrency", "mb_s", "lat_median_us", "mode"}
        if not need <= set(df.columns) or df.empty or not (df.mb_s > 0).all():
            raise ValueError("rows lack " + ", ".join(sorted(need - set(df.columns))) if not need <= set(df.columns)
                             else "rows empty or with non-positive MB/s")
    except (KeyError, ValueError, TypeError) as e:
        raise ProbeCacheError(f"{path} is corrupt ({e}); delete it or rerun with --reprobe") from None
    if set(df.request_bytes) < set(sizes) or set(df.concurrency) < set(concs):
        return None  # probed for other read sizes or thread counts: probe again
    return df


def probe_for_plan(lay: ModelLayout, io_threads: int, cache_root, *, reprobe: bool = False,
                   progress: bool = False) -> tuple[pd.DataFrame, dict]:
    """The probe table for ``lay``'s file and where it came from: ``(df, {"cache": path, "cached": bool,
    "seconds": probe time, "cpu_us_per_mb": CPU time the probe's reads cost, µs per MB read})``. ``df`` has :data:`epqlab.paging.probe.COLUMNS`.

    Raises:
        ProbeCacheError: the cache file is corrupt or was written for another device or size (the message
            names it and the fix: delete it or ``reprobe``).
        ProbeUnusableError: the model is not a regular file, lies on a RAM file system (tmpfs), or its file
            system refuses O_DIRECT: no device figure applies.
    """
    path = Path(lay.path)
    if not path.is_file():
        raise ProbeUnusableError(f"{path} is not a regular file: the pager reads a model file with O_DIRECT at offsets")
    kind = fs_type(path)
    if kind in RAM_FILESYSTEMS:
        raise ProbeUnusableError(f"{path} is on a {kind} (RAM): its bytes already sit in memory, so there is no device to "
                                 "page from and the probe would time memory copies, not O_DIRECT reads; put the model on "
                                 "a disk")
    st = os.stat(path)
    sizes, concs = matrix_sizes(lay), concurrencies(io_threads)
    cp = cache_path(path, cache_root)
    if cp.exists() and not reprobe:
        try:
            d = json.loads(cp.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ProbeCacheError(f"{cp} is corrupt ({e}); delete it or rerun with --reprobe") from None
        df = _check(d, cp, st.st_dev, st.st_size, sizes, concs)
        if df is not None and isinstance(d.get("cpu_us_per_mb"), (int, float)):
            return df, {"cache": str(cp), "cached": True, "seconds": 0.0, "cpu_us_per_mb": float(d["cpu_us_per_mb"])}
    t0 = time.perf_counter()
    ru0 = resource.getrusage(resource.RUSAGE_SELF)
    try:
        df = probe_io(path, request_bytes=sizes, concurrency=concs, n_requests=N_REQUESTS, direct=True,
                      drop_cache=True, progress="text" if progress else False)
    except OSError as e:
        raise ProbeUnusableError(f"the device probe could not read {path}: {e}") from None
    if (df["mode"] != "direct").any():
        raise ProbeUnusableError(f"the file system under {path} refuses O_DIRECT (a tmpfs?): the pager would read through "
                                 "the page cache, so no device forecast holds; move the model to a disk")
    secs = time.perf_counter() - t0
    ru1 = resource.getrusage(resource.RUSAGE_SELF)
    cpu_s = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)
    # CPU the reads themselves cost (O_DIRECT: pinning pages, submitting, completing), µs per MB read
    cpu_us_per_mb = 1e6 * cpu_s / max(1e-9, float(df.total_bytes.sum()) / 1e6)
    doc = {"format": FORMAT, "st_dev": st.st_dev, "file_size": st.st_size, "path": str(path), "seconds": secs,
           "cpu_us_per_mb": cpu_us_per_mb, "rows": df.to_dict(orient="records")}
    with atomic_path(cp) as tmp:
        Path(tmp).write_text(json.dumps(doc))
    return df, {"cache": str(cp), "cached": False, "seconds": secs, "cpu_us_per_mb": cpu_us_per_mb}


__all__ = ["probe_for_plan", "cache_path", "matrix_sizes", "concurrencies", "ProbeCacheError", "ProbeUnusableError"]
