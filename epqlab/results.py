"""Where studies put their results, and the one strict JSON writer the notebooks and CLIs share.

Layout: ``<results_dir>/<study>/<run_name>.json`` plus figures and tables beside it (``<run_name>*.png``,
``<run_name>.csv``). JSON is strict (RFC 8259): NaN and infinities are written as ``null``, NumPy scalars as
plain numbers, tuples as lists. Every file is written whole or not at all: to a temporary name in the same
folder, then renamed over the target (:func:`atomic_path`), so a full disk or an interrupt leaves the old
file (or none), never half of a new one.
"""
from __future__ import annotations

import contextlib
import json
import os
import tempfile
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


def _umask() -> int:
    old = os.umask(0)
    os.umask(old)
    return old


_FILE_MODE = 0o666 & ~_umask()


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike):
    """Yield a temporary path beside ``path`` (same folder, created if missing) to write to; on success it is
    renamed over ``path`` (atomic on POSIX), on any error it is removed and the error propagates."""
    path = os.fspath(path)
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=d, prefix="." + os.path.basename(path) + ".", suffix=".part")
    os.close(fd)
    os.chmod(tmp, _FILE_MODE)  # as open() would create it (mkstemp makes 0600)
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def check_writable(path, *, atomic: bool = False) -> None:
    """Raise OSError naming ``path`` when an output file could not be written there: checked before a run (a
    study, a model load), not after it. The folder (or the nearest existing one above it, where it will be
    created) must be a writable folder and ``path`` not a folder; ``atomic``: the file is written whole or not
    at all (:func:`atomic_path`: a temporary beside it, renamed over it), so the folder itself must be writable
    even when the file is; otherwise (appended in place) the existing file must be. Tried for real: a temporary
    file is made and removed in the folder (or the existing file opened for appending), so a folder whose
    permission bits allow writing but whose file system refuses it (``/sys``, a read-only mount, for root too) is
    refused here too."""
    path = Path(path)
    d = path.parent
    while not d.exists() and d != d.parent:
        d = d.parent
    if not d.is_dir():
        raise OSError(f"cannot write {path}: {d} is not a folder; choose another path")
    if path.is_dir():
        raise OSError(f"cannot write {path}: it is a folder; give a file name")
    target = path if path.exists() and not atomic else d
    if not os.access(target, os.W_OK):
        raise OSError(f"cannot write {path}: {target} is not writable; choose another path")
    # access() answers for the permission bits only (root passes them everywhere): try it for real, leaving nothing
    try:
        if target == d:
            fd, probe = tempfile.mkstemp(dir=d, prefix=".epqlab-probe-")
            os.close(fd)
            os.unlink(probe)
        else:
            open(target, "ab").close()  # appending nothing changes nothing
    except OSError as e:
        raise OSError(f"cannot write {path}: {target} refuses "
                      f"{'new files' if target == d else 'writes'} ({e.strerror}); choose another path") from None


def write_json(obj: dict, path: str | os.PathLike) -> str:
    """Write ``obj`` as strict JSON (see :func:`clean_json`), creating the folder, whole or not at all
    (:func:`atomic_path`); returns the path as a str.

    Raises:
        TypeError: ``obj`` holds something JSON cannot represent (the message names its type).
        OSError: the folder is not writable or the disk is full (the target is left as it was).
    """
    path = os.fspath(path)
    text = json.dumps(clean_json(obj), indent=1, allow_nan=False)  # fails before anything is written
    with atomic_path(path) as tmp, open(tmp, "w") as f:
        f.write(text)
    return path


def save_figure(fig, path: str | os.PathLike, dpi: int = 110) -> str:
    """``fig.savefig(path)`` whole or not at all (:func:`atomic_path`); returns the path as a str."""
    path = os.fspath(path)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=dpi, bbox_inches="tight", format=Path(path).suffix.lstrip(".") or "png")
    return path


def save_csv(df, path: str | os.PathLike, **kw) -> str:
    """``df.to_csv(path, index=False)`` whole or not at all; returns the path as a str."""
    path = os.fspath(path)
    with atomic_path(path) as tmp:
        df.to_csv(tmp, index=False, **kw)
    return path


def save_study(results_dir: str | os.PathLike, name: str, doc: dict, table, *, plot=None, extra: dict | None = None,
               tables: dict | None = None) -> dict:
    """A study's files in ``results_dir`` (created), each whole or not at all: ``<name>.json`` (``doc``
    updated with ``extra``), ``<name>.csv`` (``table``, a DataFrame), ``<name>_<key>.csv`` for each
    ``{key: DataFrame}`` in ``tables``, and ``<name>.png`` from ``plot()`` (a callable returning a
    matplotlib Figure, closed afterwards) when given. Returns ``{"json", "csv", "<key>_csv", "png": path}``
    (str) for the files written."""
    d = Path(results_dir)
    d.mkdir(parents=True, exist_ok=True)
    paths = {"json": d / f"{name}.json", "csv": d / f"{name}.csv"}
    write_json({**doc, **(extra or {})}, paths["json"])
    save_csv(table, paths["csv"])
    for key, df in (tables or {}).items():
        paths[f"{key}_csv"] = d / f"{name}_{key}.csv"
        save_csv(df, paths[f"{key}_csv"])
    if plot is not None:
        import matplotlib.pyplot as plt

        fig = plot()
        paths["png"] = d / f"{name}.png"
        try:
            save_figure(fig, paths["png"])
        finally:
            plt.close(fig)
    return {k: str(v) for k, v in paths.items()}


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
        save_figure(fig, Path(out_dir) / fname, dpi=dpi)
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


__all__ = ["clean_json", "check_writable", "write_json", "atomic_path", "save_figure", "save_csv", "save_study", "study_dir", "save_figures", "file_sha256", "machine_info", "run_info"]
