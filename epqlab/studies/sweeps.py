"""Parameter sweeps on any :class:`concurrent.futures.Executor`: :func:`sweep` runs ``fn(**point)`` for
every point of a grid and returns one pandas row per point, with host and run metadata.

Executors: local processes by default (``ProcessPoolExecutor`` with the ``spawn`` start method, one
worker unless ``max_workers`` says otherwise); a Dask ``distributed`` cluster through
``Client.get_executor()``; Ray or anything else with ``submit``. The isolation this gives, exactly: the points run
outside the caller's process, but a worker is not a fresh process per point: with the default one worker, every
point of a sweep runs in turn in the same spawned process (the ``pid`` column shows it), so they share its
imports, llama.cpp's loaded library, the allocator's heap and, as any process on the machine, the page cache.
Each process runs one point at a time (a per-process lock guards the call, so a multi-threaded Dask worker too
never has two Sessions decoding in one process) and a point that opens a :class:`epqlab.Session` closes it before
the next starts; nothing else is reset between points.

Timing: runs that report speeds (tok/s, I/O wait) should stay serial on one box, which is why the
default is one worker and why the ablation functions run serially unless given an ``executor``: on a
2-core machine with one SSD, parallel runs compete for the cores, the disk queue and the page
cache, and spoil each other's medians. Parallel (or distributed, one run per machine) sweeps suit
counts that do not depend on timing — hits, misses, evictions, bytes read, perplexity, tokens.
"""
from __future__ import annotations

import itertools
import os
import socket
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Executor, ProcessPoolExecutor, as_completed
from datetime import datetime, timezone
from ..engine.session import Session
from ..layout import inspect
from ..models import default_model
from ..paging.pager import Pager

META = ("run", "host", "pid", "started_utc", "wall_s", "epqlab_version")  # metadata columns of every row
_ONE_AT_A_TIME = threading.Lock()  # per process: never two points (two Sessions decoding) at once


def grid_points(grid) -> list[dict]:
    """The points of ``grid``: a mapping of name -> list of values (their Cartesian product, in
    ``itertools.product`` order, like scikit-learn's ParameterGrid), a list of such mappings (each
    expanded, concatenated), or a list of points (dicts) taken as is. Raises ValueError otherwise."""
    if isinstance(grid, Mapping):
        names = list(grid)
        values = []
        for n in names:
            v = grid[n]
            if isinstance(v, (str, bytes)) or not isinstance(v, Iterable):
                raise ValueError(f"grid[{n!r}] must be a list of values, got {v!r} (wrap one value as [{v!r}])")
            values.append(list(v))
        return [dict(zip(names, combo)) for combo in itertools.product(*values)]
    if isinstance(grid, (list, tuple)):
        out = []
        for g in grid:
            if not isinstance(g, Mapping):
                raise ValueError(f"a grid list holds dicts, got {g!r}")
            if g and all(isinstance(v, (list, tuple)) for v in g.values()):
                out.extend(grid_points(g))
            else:
                out.append(dict(g))
        return out
    raise ValueError(f"grid must be a dict of lists or a list of dicts, got {type(grid).__name__}")


def run_point(fn: Callable, run: int, point: dict) -> list[dict]:
    """Run ``fn(**point)`` in this process (one point at a time) and return its rows: ``point`` +
    the result (a dict, a list of dicts, or any value as ``result``) + :data:`META`."""
    from importlib.metadata import version

    with _ONE_AT_A_TIME:
        started = datetime.now(timezone.utc).isoformat(timespec="seconds")
        t0 = time.perf_counter()
        out = fn(**point)
        wall = time.perf_counter() - t0
    if isinstance(out, Mapping):
        results = [dict(out)]
    elif isinstance(out, list) and all(isinstance(r, Mapping) for r in out):
        results = [dict(r) for r in out]
    else:
        results = [{"result": out}]
    meta = {"run": run, "host": socket.gethostname(), "pid": os.getpid(), "started_utc": started, "wall_s": wall,
            "epqlab_version": version("epqlab")}
    return [{**point, **r, **meta} for r in results]


def sweep(fn: Callable, grid, executor: Executor | None = None, *, max_workers: int = 1, progress: bool = True,
          desc: str | None = None):
    """Run ``fn(**point)`` for every point of ``grid`` on ``executor`` and collect the rows.

    Args:
        fn: a picklable (module-level) function of the grid's names; returns a dict (one row), a
            list of dicts (several rows) or a value (column ``result``). Open any Session inside it.
        grid: see :func:`grid_points`.
        executor: a :class:`concurrent.futures.Executor` — e.g. ``dask.distributed.Client(...).get_executor()``
            (give workers ``threads_per_worker=1``) or Ray's; None = local processes (``spawn``,
            ``max_workers`` of them, default 1, each running points in turn: see the module docstring on isolation
            and timing).
        progress: a tqdm.auto bar over finished points.

    Returns:
        pandas.DataFrame, one row per result in grid order (``run`` = the point's index), columns:
        the point's parameters, the result's fields, then :data:`META` (``host``, ``pid``,
        ``started_utc``, ``wall_s`` in s, ``epqlab_version``).

    Raises:
        ValueError: a malformed grid; whatever ``fn`` raises for a point (the others are cancelled).
    """
    import multiprocessing

    import pandas as pd
    from tqdm.auto import tqdm

    points = grid_points(grid)
    own = executor is None
    if own:
        if int(max_workers) < 1:
            raise ValueError(f"max_workers must be >= 1, got {max_workers}")
        executor = ProcessPoolExecutor(int(max_workers), mp_context=multiprocessing.get_context("spawn"))
    rows: dict[int, list[dict]] = {}
    try:
        futs = {executor.submit(run_point, fn, i, p): i for i, p in enumerate(points)}
        with tqdm(total=len(futs), desc=desc or getattr(fn, "__name__", "sweep"), disable=not progress) as bar:
            try:
                for f in as_completed(futs):
                    rows[futs[f]] = f.result()
                    bar.update(1)
            except BaseException:
                for f in futs:
                    f.cancel()
                raise
    finally:
        if own:
            executor.shutdown(wait=True, cancel_futures=True)
    return pd.DataFrame([r for i in sorted(rows) for r in rows[i]])


def _locked_call(fn: Callable, point: dict):
    with _ONE_AT_A_TIME:
        return fn(**point)


def map_points(fn: Callable, points: list[dict], executor: Executor | None = None) -> list:
    """``[fn(**p) for p in points]``, in this process (``executor`` None: serially, in order) or on
    ``executor`` (one point per process at a time; results in the order of ``points``). The
    ablation functions' ``executor=`` goes through here."""
    if executor is None:
        return [fn(**p) for p in points]
    futs = [executor.submit(_locked_call, fn, p) for p in points]
    try:
        return [f.result() for f in futs]
    except BaseException:
        for f in futs:
            f.cancel()
        raise


def executor_from(spec: str | None) -> Executor | None:
    """An executor from a plain value (for papermill parameters and the CLI): None -> None (serial,
    in this process); ``"local"`` or ``"local:N"`` -> N spawned local processes (default 1);
    ``"tcp://HOST:PORT"`` (or any Dask scheduler address) -> that cluster's
    ``Client(address).get_executor()``. Raises ValueError for anything else."""
    if spec is None or spec == "":
        return None
    if not isinstance(spec, str):
        raise ValueError(f"executor must be None, 'local[:N]' or a Dask scheduler address, got {spec!r}")
    if spec == "local" or spec.startswith("local:"):
        import multiprocessing

        n = int(spec.split(":", 1)[1]) if ":" in spec else 1
        if n < 1:
            raise ValueError(f"executor {spec!r}: the number of processes must be >= 1")
        return ProcessPoolExecutor(n, mp_context=multiprocessing.get_context("spawn"))
    if "://" in spec:
        try:
            from distributed import Client
        except ImportError:
            raise ValueError(f"executor {spec!r} needs Dask: pip install 'epqlab[dask]'") from None
        return Client(spec).get_executor()
    raise ValueError(f"executor must be None, 'local[:N]' or a Dask scheduler address (tcp://host:port), got {spec!r}")


def generation_point(model=None, prompt: str = "A CPU cache is a small, fast memory that", n_predict: int = 8,
                     arena: float = 0.5, policy: str = "lru", n_threads: int = 1) -> dict:
    """One greedy generation with an arena of ``arena`` x all expert slots (a fraction) under
    ``policy``: a ready-made sweep function. Returns the text, token ids (as a space-separated str)
    and the pager's counts (``hits``, ``misses``, ``evictions``, ``ssd_bytes``, ``hit_rate``) —
    values that do not depend on timing, so parallel runs give the same rows as serial ones — plus
    ``decode_tok_s`` (timing: compare only across serial runs)."""
    model = model or default_model(progress=False)

    lay = inspect(model)
    nbytes = max(Pager.min_arena_bytes(lay), int(arena * Pager.all_experts_bytes(lay)))
    with Session(model, arena_bytes=nbytes, policy=policy, n_threads=n_threads, n_ctx=256) as s:
        g = s.generate(prompt, n_predict)
    st = g.stats
    return {"text": g.text, "tokens": " ".join(map(str, g.tokens)), "hits": st["hits"], "misses": st["misses"],
            "evictions": st["evictions"], "ssd_bytes": st["ssd_bytes"], "hit_rate": st["hit_rate"],
            "decode_tok_s": st["decode_tok_s"]}


__all__ = ["sweep", "grid_points", "run_point", "map_points", "executor_from", "generation_point", "META"]
