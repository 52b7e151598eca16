"""The batched lossy trade-off's table and reading (:func:`epqlab.studies.ablation.batch_lossy.batch_lossy`;
notebook 07's batch section, papers/07), and the same for ``bench/bench_batching.py --lossy`` JSON (speed and
bytes under a memory limit, no perplexity)."""
from __future__ import annotations

import pandas as pd

from ...results import run_info, save_study
from ..paired import worded

COLUMNS = {"point": "point", "knob": "knob", "setting": "setting", "batch": "batch", "ppl_ratio": "PPL / exact",
           "ppl_ratio_low": "95% low", "ppl_ratio_high": "95% high",
           "decode_tok_s": "tok/s (all seqs)", "speedup": "x exact b1", "ssd_mb_per_token": "SSD MB/token",
           "mb_ratio": "MB x exact b1", "union_before": "union/layer (router)", "union_after": "union/layer (used)",
           "routing_agreement": "agreement"}

BENCH_COLUMNS = {"setting": "setting", "batch": "batch", "decode_tok_s": "tok/s (all seqs)", "speedup": "x exact b1",
                 "plain_tok_s": "plain tok/s", "x_plain": "x plain", "ssd_mb_per_token": "SSD MB/token",
                 "mb_ratio": "MB x exact b1", "union_before": "union/layer (router)",
                 "union_per_layer": "union/layer (used)", "routing_agreement": "agreement", "hit_rate": "hit"}


def _high(df: pd.DataFrame) -> pd.Series:
    """The upper end of each row's paired 95% perplexity interval; the point ratio where a table has none (an older
    JSON)."""
    return df["ppl_ratio_high"].fillna(df["ppl_ratio"]) if "ppl_ratio_high" in df else df["ppl_ratio"]


def best_tradeoff(df: pd.DataFrame, batch: int = 4, max_ppl_ratio: float = 1.01) -> dict | None:
    """The row at ``batch`` with the highest ``speedup`` (over exact batch 1) among the lossy settings that are
    distinguishable from exact batching there: faster than exact at the same point and batch size, with the upper
    end of the perplexity ratio's paired 95% interval (:mod:`epqlab.studies.paired`) within ``max_ppl_ratio`` (the
    issue's 1%), and some route changed (agreement below 1: a setting that changed nothing differs from exact by
    timing noise only); or None."""
    ex = df[(df.knob == "exact") & (df.batch == batch)].set_index("point")["speedup"]
    at = df[(df.batch == batch) & (df.knob != "exact") & (df.routing_agreement < 1.0)]
    faster = at.point.map(ex).lt(at.speedup) if not at.empty else at.point.astype(bool)
    ok = at[(_high(at) <= max_ppl_ratio) & faster]
    return None if ok.empty else ok.sort_values("speedup", ascending=False).iloc[0].to_dict()


def reading(df: pd.DataFrame, batch: int = 4, max_ppl_ratio: float = 1.01) -> str:
    """Per memory point: exact batching's own gain at ``batch``, and the fastest knob setting there that is
    distinguishable from exact (:func:`best_tradeoff`: faster than exact at that batch size, its perplexity's paired
    95% interval within ``max_ppl_ratio``; the issue's goal: 2x exact batch 1 at 1%), or that none is."""
    out = []
    for point, g in df.groupby("point", sort=False):
        b = batch if (g.batch == batch).any() else int(g.batch.max())
        ex = g[(g.knob == "exact") & (g.batch == b)]
        if ex.empty:
            continue
        e = ex.iloc[0]
        s = (f"{point}: exact batching at b = {b} runs {e.speedup:.2f}x exact batch 1's aggregate tok/s and reads "
             f"{e.mb_ratio:.2f}x its MB per token (union {e.union_after:.1f} experts per layer and step).")
        r = best_tradeoff(g, b, max_ppl_ratio)
        if r is None:
            s += (f" No lossy setting is distinguishable from exact there: none runs faster than exact at b = {b} with "
                  f"its perplexity's 95% interval within x{max_ppl_ratio:.2f}.")
        else:
            s += (f" The fastest setting faster than exact at b = {b} with its 95% interval within "
                  f"x{max_ppl_ratio:.2f} is {r['knob']} {r['setting']}: {r['speedup']:.2f}x batch 1 (exact b = {b}: "
                  f"{e.speedup:.2f}x), {r['mb_ratio']:.2f}x its MB per token, union {r['union_before']:.1f} -> "
                  f"{r['union_after']:.1f}, perplexity {_ratio(r)}, routing agreement {r['routing_agreement']:.1%}.")
        worst = g[(g.batch == b) & (g.knob != "exact")].sort_values("ppl_ratio", ascending=False)
        if not worst.empty:
            w = worst.iloc[0]
            s += f" The largest loss there: {w.knob} {w.setting}, perplexity {_ratio(w.to_dict())}."
        out.append(s)
    out.append("Perplexity is over the same held-out windows at every batch size, teacher-forced, the prompts' own "
               "tokens excluded; on a random-weight model it means nothing (read bytes and speed only). Speeds are one "
               "run each on the machine that ran it.")
    return " ".join(out)


def _ratio(r: dict) -> str:
    if r.get("ppl_ratio_high") is None or r["ppl_ratio_high"] != r["ppl_ratio_high"]:
        return f"x{r['ppl_ratio']:.4f}"
    return worded(r["ppl_ratio"], r["ppl_ratio_low"], r["ppl_ratio_high"], int(r["scored_tokens"]))


def plot(df: pd.DataFrame):
    """One panel per memory point: aggregate speed over exact batch 1 (x) against the perplexity ratio to exact at
    the same batch size (y), one line per knob setting through its batch sizes (labelled b=...). Returns the
    matplotlib Figure."""
    import matplotlib.pyplot as plt

    points = list(dict.fromkeys(df["point"]))
    fig, axes = plt.subplots(1, len(points), figsize=(6 * len(points), 4.5), squeeze=False)
    for ax, pt in zip(axes[0], points):
        d = df[df["point"] == pt]
        for (knob, setting), g in d.groupby(["knob", "setting"], sort=False):
            g = g.sort_values("batch")
            ax.plot(g["speedup"], g["ppl_ratio"], "*-" if knob == "exact" else "o-", label=f"{knob} {setting}")
            for r in g.itertuples():
                ax.annotate(f"b={r.batch}", (r.speedup, r.ppl_ratio), fontsize=7, xytext=(3, 3),
                            textcoords="offset points")
        ax.axhline(1.0, color="grey", lw=0.5)
        ax.set_xlabel("aggregate tok/s / exact batch 1")
        ax.set_ylabel("perplexity / exact at the same batch")
        ax.set_title(f"{pt}: speed bought vs quality lost")
        ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def save(df: pd.DataFrame, results_dir, name: str, figure: bool = True, extra: dict | None = None) -> dict:
    """Write ``<results_dir>/<name>.json`` (``kind`` ``batch_lossy``, the rows, the study's attrs, :func:`reading`,
    the run; updated with ``extra``), ``<name>.csv`` and ``<name>.png`` (:func:`plot`). Returns ``{kind: path}``."""
    doc = {"kind": "batch_lossy", "rows": df.to_dict("records"), "attrs": dict(df.attrs), "reading": reading(df),
           "run": run_info(df.attrs.get("model"))}
    return save_study(results_dir, name, doc, df, plot=(lambda: plot(df)) if figure else None, extra=extra)


def bench_frame(doc: dict) -> pd.DataFrame:
    """bench/bench_batching.py ``--lossy`` JSON rows with the ratios over the first setting's (exact) first batch
    size and plain's."""
    df = pd.DataFrame(doc["rows"])
    base = df.iloc[0]
    df["speedup"] = df.decode_tok_s / base.decode_tok_s
    df["mb_ratio"] = df.ssd_mb_per_token / base.ssd_mb_per_token if base.ssd_mb_per_token else float("nan")
    df["x_plain"] = [r.decode_tok_s / r.plain_tok_s if r.plain_tok_s else float("nan") for r in df.itertuples()]
    return df


def is_bench(doc: dict) -> bool:
    rows = doc.get("rows") or [{}]
    return "lossy" in doc and isinstance(rows[0], dict) and {"setting", "batch", "union_per_layer"} <= set(rows[0])


__all__ = ["COLUMNS", "BENCH_COLUMNS", "best_tradeoff", "reading", "plot", "save", "bench_frame", "is_bench"]
