"""Tables, figures, the reading and the results files of a :func:`epqlab.probe_io` table, for
notebooks/01_io_probe.ipynb and ``epqlab probe`` (measuring lives in :mod:`epqlab.paging.probe`)."""
from __future__ import annotations

import os
import sys
from pathlib import Path

from ..errors import NotGGUFError, NotMoEError
from ..layout import inspect
from ..paging.probe import (DEFAULT_REQUEST_BYTES, REFERENCE_EXPERT_BYTES, flatten_concurrency, rows_of_size, size_label,
                            summarize)
from ..results import run_info, save_csv, save_figures, write_json
from ..units import fmt_bytes


def _threads(n: int) -> str:
    return f"{n} thread" if n == 1 else f"{n} threads"


def summary_line(df) -> str:
    """One line: single-stream MB/s, best aggregate MB/s and where it flattens, small-read latency."""
    s = summarize(df)
    return (
        f"{s['mode']}: single stream {s['single_stream_mb_s']:.0f} MB/s ({size_label(s['large_bytes'])} reads); "
        f"best aggregate {s['best_mb_s']:.0f} MB/s ({size_label(s['best_bytes'])} x {_threads(s['best_concurrency'])}), "
        f"flattening at {_threads(s['flatten_concurrency'])} (>= 90% of best); "
        f"{size_label(s['small_bytes'])} latency {s['lat_small_us']:.0f} us median at {_threads(s['min_concurrency'])}"
    )


def format_table(df) -> str:
    """The table as fixed-width text (the CLI's output)."""
    cols = ["label", "concurrency", "lat_median_us", "lat_p90_us", "lat_p99_us", "mb_s", "iops", "mode"]
    return df[cols].to_string(index=False, float_format=lambda v: f"{v:.1f}")


def reading(df, expert_bytes: int | None = None, top_k: int | None = None) -> str:
    """A short markdown reading of what a :func:`probe_io` table implies for expert paging.

    Every number in it is computed from ``df``. ``expert_bytes`` picks the row size that stands for
    one expert (default: the largest ``model:expert`` size, else the size nearest 1.9 MB);
    ``top_k`` (experts per token per layer) adds the cost of a layer's worth of misses.
    """
    s = summarize(df)
    sizes = sorted(set(int(x) for x in df.request_bytes))
    if expert_bytes is None:
        ex = df[df.source == "model:expert"]
        expert_bytes = int(ex.request_bytes.max()) if len(ex) else min(sizes, key=lambda n: abs(n - 1_900_000))
    e = min(sizes, key=lambda n: abs(n - expert_bytes))
    r = rows_of_size(df, e)
    c0 = r.iloc[0]
    bestr = r.loc[r.mb_s.idxmax()]
    fc = flatten_concurrency(df, e)
    out = [f"**Reading ({s['mode']} I/O, {len(df)} cells).**", ""]
    out.append(
        f"- One expert read of {fmt_bytes(e)} ({e} B) takes {c0.lat_median_us / 1000:.2f} ms median "
        f"(p99 {c0.lat_p99_us / 1000:.2f} ms) alone: a miss costs at least that on the critical path; "
        f"one stream moves {c0.mb_s:.0f} MB/s."
    )
    out.append(
        f"- With {int(bestr.concurrency)} reads in flight the device delivers {bestr.mb_s:.0f} MB/s "
        f"({bestr.mb_s / c0.mb_s:.1f}x one stream), i.e. at most {bestr.mb_s * 1e6 / e:.0f} experts/s; "
        f"each read then takes {bestr.lat_median_us / 1000:.2f} ms median "
        f"({bestr.lat_median_us / c0.lat_median_us:.1f}x its alone latency)."
    )
    c_max = int(r.concurrency.max())
    if fc < c_max:
        out.append(
            f"- Aggregate bandwidth for this size reaches 90% of its best at {_threads(fc)} (of up to {c_max} "
            f"measured): an I/O pool larger than {fc} buys little here, and threads help only when that many "
            f"independent misses are outstanding."
        )
    else:
        out.append(
            f"- Aggregate bandwidth for this size is still rising at {_threads(c_max)}, the most measured: "
            f"probe higher concurrency before capping the I/O pool."
        )
    if top_k:
        at_least = r[r.concurrency >= top_k]
        rk = at_least.iloc[0] if len(at_least) else r.iloc[-1]
        ck = int(rk.concurrency)
        serial = top_k * c0.lat_median_us
        parallel = -(-top_k // ck) * rk.lat_median_us  # ceil(k / c) rounds of c reads in flight
        out.append(
            f"- A layer missing all its top-{top_k} experts: ~{serial / 1000:.2f} ms read one after another vs "
            f"~{parallel / 1000:.2f} ms issued {min(ck, top_k)} at a time (latency measured at {_threads(ck)})."
        )
    big = rows_of_size(df, sizes[-1])
    b0, bb = big.iloc[0], big.loc[big.mb_s.idxmax()]
    gain = bb.mb_s / b0.mb_s
    if int(bb.concurrency) == int(b0.concurrency):
        out.append(
            f"- {size_label(sizes[-1])} reads: {_threads(int(b0.concurrency))} moves {b0.mb_s:.0f} MB/s and no "
            f"higher concurrency measured beats it: splitting one large read into parallel segments gains nothing here."
        )
    else:
        verdict = ("splitting one large read into segments read in parallel should shorten a miss"
                   if gain >= 1.5 else "splitting one large read into parallel segments gains little")
        out.append(
            f"- {size_label(sizes[-1])} reads: {_threads(int(b0.concurrency))} {b0.mb_s:.0f} MB/s, at best "
            f"{_threads(int(bb.concurrency))} {bb.mb_s:.0f} MB/s ({gain:.1f}x): {verdict}."
        )
    if sizes[0] <= 8192:
        small = rows_of_size(df, sizes[0]).iloc[0]
        out.append(
            f"- {size_label(sizes[0])} reads take {small.lat_median_us:.0f} us median alone: the per-request floor; "
            f"a request of {fmt_bytes(e)} costs {c0.lat_median_us / small.lat_median_us:.1f}x that."
        )
    tail = df.lat_p99_us / df.lat_median_us
    if (tail > 10).any():
        w = df.loc[tail.idxmax()]
        out.append(
            f"- Tails: in {int((tail > 10).sum())} of {len(df)} cells p99 latency exceeds 10x the median (worst "
            f"{tail.max():.0f}x, {w.label} at {_threads(int(w.concurrency))}): the device is shared, throttled or "
            f"noisy; repeat the probe before trusting the shape of these curves."
        )
    return "\n".join(out)


def to_json(df) -> dict:
    """The table and its attrs as JSON-ready Python (rows as records; numpy scalars converted)."""
    rows = [{k: (v.item() if hasattr(v, "item") else v) for k, v in rec.items()} for rec in df.to_dict("records")]
    return {"attrs": dict(df.attrs), "columns": list(df.columns), "rows": rows, "summary": summarize(df)}


def probe_defaults(model, sizes=None, top_k=None) -> tuple[int, int, list[int] | None]:
    """``(expert_bytes, top_k, sizes)`` for a probe of ``model``: a MoE GGUF gives its largest expert (bytes) and
    its top-k (else 4), and ``sizes=None`` lets :func:`~epqlab.probe_io` add its expert sizes; any other file
    (or ``None``: a scratch file) uses :data:`~epqlab.paging.probe.REFERENCE_EXPERT_BYTES` and top-k 4, and
    ``sizes=None`` becomes the default sizes plus that reference expert."""
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
    ``<run_name>.json`` in ``out_dir``; return the JSON's content: :func:`~epqlab.paging.probe.to_json` plus
    ``notebook``, ``run_name``, ``python``, ``elapsed_s`` (s), ``parameters``, ``expert_bytes`` (bytes),
    ``summary_line``, ``reading`` (Markdown) and the file names ``csv`` and ``figures``."""
    out_dir = Path(out_dir)
    csv = f"{run_name}.csv"
    save_csv(df, out_dir / csv)
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


__all__ = ["summary_line", "format_table", "reading", "to_json", "probe_defaults", "probe_figure", "save_probe_results", "explore"]
