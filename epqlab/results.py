"""Where studies put their results, and the one strict JSON writer the notebooks and CLIs share.

Layout: ``<results_dir>/<study>/<run_name>.json`` plus figures and tables beside it (``<run_name>*.png``,
``<run_name>.csv``). JSON is strict (RFC 8259): NaN and infinities are written as ``null``, NumPy scalars as
plain numbers, tuples as lists.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np


def clean_json(x):
    """``x`` with every NaN/inf float replaced by None, NumPy scalars and arrays made plain, tuples made lists
    and dict keys made strings: what :func:`json.dump` with ``allow_nan=False`` accepts."""
    if isinstance(x, float) and not np.isfinite(x):
        return None
    if isinstance(x, dict):
        return {str(k): clean_json(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [clean_json(v) for v in x]
    if isinstance(x, np.ndarray):
        return clean_json(x.tolist())
    if isinstance(x, np.generic):
        return clean_json(x.item())
    if isinstance(x, os.PathLike):
        return os.fspath(x)
    return x


def write_json(obj: dict, path: str | os.PathLike) -> str:
    """Write ``obj`` as strict JSON (see :func:`clean_json`), creating the folder; returns the path as a str.

    Raises:
        TypeError: ``obj`` holds something JSON cannot represent (the message names its type).
    """
    path = os.fspath(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(clean_json(obj), f, indent=1, allow_nan=False)
    return path


def study_dir(results_dir: str | os.PathLike, study: str) -> Path:
    """``<results_dir>/<study>``, created if missing (e.g. ``results/01_io_probe``)."""
    out = Path(results_dir) / study
    out.mkdir(parents=True, exist_ok=True)
    return out


def save_figures(figures: dict, out_dir: str | os.PathLike, prefix: str, dpi: int = 110) -> dict:
    """Save matplotlib Figures ``{name: fig}`` as ``<out_dir>/<prefix>-<name>.png`` and return ``{name: file
    name}`` (relative to ``out_dir``, so a results JSON beside them stays valid when the folder moves)."""
    out = {}
    for name, fig in figures.items():
        fname = f"{prefix}-{name}.png"
        fig.savefig(Path(out_dir) / fname, dpi=dpi, bbox_inches="tight")
        out[name] = fname
    return out


def file_sha256(path: str | os.PathLike, chunk: int = 1 << 22) -> str:
    """Hex SHA-256 of the file at ``path`` (read in ``chunk``-byte pieces, so any size works)."""
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def machine_info() -> dict:
    """This machine in a few fields: ``platform`` (kernel and architecture), ``cpu`` (processor name from
    /proc/cpuinfo where readable), ``logical_cpus``, ``physical_cpus``, ``ram_bytes`` (bytes, psutil)."""
    import platform

    import psutil

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {"platform": platform.platform(), "cpu": cpu, "logical_cpus": psutil.cpu_count(),
            "physical_cpus": psutil.cpu_count(logical=False), "ram_bytes": int(psutil.virtual_memory().total)}


def run_info(model: str | os.PathLike | None = None) -> dict:
    """Provenance for a results JSON (key ``"run"``): ``date`` (UTC, ISO 8601), ``machine``
    (:func:`machine_info`), ``python`` and ``epqlab`` versions, ``argv`` (the command line of the process), and
    for an existing ``model`` file its ``model_path``, ``model_bytes`` and ``model_sha256``
    (:func:`file_sha256`). :func:`epqlab.papers.write_papers` renders it."""
    import datetime
    import platform
    import sys
    from importlib.metadata import PackageNotFoundError, version

    try:
        ver = version("epqlab")
    except PackageNotFoundError:  # pragma: no cover - running from a source tree without install
        ver = None
    out = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "machine": machine_info(), "python_version": platform.python_version(), "epqlab": ver,
           "argv": list(sys.argv)}
    if model is not None and os.path.isfile(model):
        out.update(model_path=os.path.abspath(model), model_bytes=os.path.getsize(model),
                   model_sha256=file_sha256(model))
    return out


__all__ = ["clean_json", "write_json", "study_dir", "save_figures", "file_sha256", "machine_info", "run_info"]
