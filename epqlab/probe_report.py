"""Figures and the results files of a :func:`epqlab.probe_io` table, for notebooks/01_io_probe.ipynb
(measuring lives in :mod:`epqlab.probe`; its reading of the numbers is :func:`epqlab.probe.reading`)."""
from __future__ import annotations

import os
import sys
from pathlib import Path

from .probe import REFERENCE_EXPERT_BYTES, DEFAULT_REQUEST_BYTES, reading, summary_line, to_json
from .results import run_info, save_figures, write_json


def probe_defaults(model, sizes=None, top_k=None) -> tuple[int, int, list[int] | None]:
    """``(expert_bytes, top_k, sizes)`` for a probe of ``model``: a MoE GGUF gives its largest expert (bytes) and
    its top-k (else 4), and ``sizes=None`` lets :func:`~epqlab.probe_io` add its expert sizes; any other file
    (or ``None``: a scratch file) uses :data:`~epqlab.probe.REFERENCE_EXPERT_BYTES` and top-k 4, and
    ``sizes=None`` becomes the default sizes plus that reference expert."""
    from .errors import NotGGUFError, NotMoEError
    from .layout import inspect

    layout = None
    if model is not None and Path(model).is_file():
        try:
            layout = inspect(model)
        except (NotGGUFError, NotMoEError):
            layout = None  # any file can be probed; only a MoE GGUF adds its expert sizes
    if layout is not None:
        return layout.max_expert_bytes, int(top_k or layout.n_expert_used or 4), sizes
    if sizes is None:
        sizes = sorted(set(DEFAULT_REQUEST_BYTES) | {REFERENCE_EXPERT_BYTES})
    return REFERENCE_EXPERT_BYTES, int(top_k or 4), sizes


def probe_figure(df):
    """Median latency per read (µs, log scale) and aggregate MB/s against reads in flight, one line per
    request size: a matplotlib Figure of two panels."""
    import matplotlib.pyplot as plt

    fig, (ax_lat, ax_bw) = plt.subplots(1, 2, figsize=(11, 4))
    for (_, label), g in df.groupby(["request_bytes", "label"], sort=True):
        g = g.sort_values("concurrency")
        ax_lat.plot(g.concurrency, g.lat_median_us, marker="o", label=label)
        ax_bw.plot(g.concurrency, g.mb_s, marker="o", label=label)
    ax_lat.set(xlabel="reads in flight (threads)", ylabel="median latency per read (µs)", yscale="log",
               title=f"latency ({df.attrs.get('mode', '?')})")
    ax_bw.set(xlabel="reads in flight (threads)", ylabel="aggregate MB/s", title="bandwidth")
    for ax in (ax_lat, ax_bw):
        ax.set_xticks(sorted(set(df.concurrency)))
        ax.grid(alpha=0.3)
    ax_bw.legend(title="request size", fontsize=8)
    fig.tight_layout()
    return fig


def save_probe_results(df, out_dir: str | os.PathLike, run_name: str, *, parameters: dict, expert_bytes: int,
                       top_k: int, elapsed_s: float, figure=None) -> dict:
    """Write ``<run_name>.csv`` (the table), ``<run_name>-probe.png`` (``figure``, if given) and
    ``<run_name>.json`` in ``out_dir``; return the JSON's content: :func:`~epqlab.probe.to_json` plus
    ``notebook``, ``run_name``, ``python``, ``elapsed_s`` (s), ``parameters``, ``expert_bytes`` (bytes),
    ``summary_line``, ``reading`` (Markdown) and the file names ``csv`` and ``figures``."""
    out_dir = Path(out_dir)
    csv = f"{run_name}.csv"
    df.to_csv(out_dir / csv, index=False)
    result = to_json(df)
    result.update({
        "notebook": "01_io_probe", "run_name": run_name, "python": sys.executable, "elapsed_s": float(elapsed_s),
        "parameters": parameters, "expert_bytes": int(expert_bytes), "top_k": int(top_k),
        "summary_line": summary_line(df), "reading": reading(df, expert_bytes=expert_bytes, top_k=top_k),
        "run": run_info(parameters.get("model")), "csv": csv, "figures": save_figures({"probe": figure}, out_dir, run_name, dpi=120) if figure else {},
    })
    write_json(result, out_dir / f"{run_name}.json")
    return result


def explore(df) -> None:
    """ipywidgets controls to plot any latency/bandwidth column of the table against reads in flight."""
    import matplotlib.pyplot as plt
    from ipywidgets import interact

    metrics = ["lat_median_us", "lat_p90_us", "lat_p99_us", "lat_mean_us", "mb_s", "iops"]

    @interact(metric=metrics, log_y=True)
    def _plot(metric="lat_median_us", log_y=True):
        _, ax = plt.subplots(figsize=(6, 4))
        for label, g in df.sort_values(["request_bytes", "concurrency"]).groupby("label", sort=False):
            ax.plot(g.concurrency, g[metric], marker="o", label=label)
        ax.set(xlabel="reads in flight (threads)", ylabel=metric, yscale="log" if log_y else "linear")
        ax.legend(fontsize=8)
        plt.show()


__all__ = ["probe_defaults", "probe_figure", "save_probe_results", "explore"]
