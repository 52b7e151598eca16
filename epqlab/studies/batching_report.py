"""The batching study's report (:mod:`epqlab.studies.batching` makes the tables): the tables as Markdown, a
reading computed from them, the figure, and the results files (``<run_name>.json``, ``.csv``, ``.png``)."""
from __future__ import annotations

import pandas as pd

from ..results import run_info, save_study

COLUMNS = {"point": "memory", "batch": "batch", "decode_tok_s": "tok/s (all)", "speedup": "x smallest batch",
           "per_seq_tok_s": "tok/s per seq", "ssd_mb_per_token": "SSD MB/token", "mb_ratio": "MB x smallest batch",
           "union_per_layer": "U(b)/layer", "hit_rate": "hit %", "step_ms": "ms/step", "attn_ms": "attn",
           "expert_ms": "experts", "io_ms": "io wait", "other_ms": "other"}


def table(df: pd.DataFrame) -> pd.DataFrame:
    """The batching table with readable column names, rounded (hit rate in %)."""
    cols = [c for c in COLUMNS if c in df]
    out = df[cols].copy()
    if "hit_rate" in out:
        out["hit_rate"] = 100 * out["hit_rate"]
    return out.rename(columns=COLUMNS).round(2)


def speculation_table(spec: pd.DataFrame) -> pd.DataFrame:
    """Mean accepted length and tokens per pass by n-gram size, over every sequence (weighted by steps),
    with each sequence's tokens per pass beside."""
    rows = []
    for n, g in spec.groupby("n"):
        w = g["steps"].clip(lower=1)
        row = {"n": int(n), "k": int(g["k"].iloc[0]),
               "mean_accepted": float((g["mean_accepted"] * w).sum() / w.sum()),
               "tokens_per_pass": float((g["tokens_per_pass"] * w).sum() / w.sum()),
               "drafted_share": float((g["drafted_share"] * w).sum() / w.sum())}
        for r in g.itertuples():
            row[f"{r.sequence} tok/pass"] = r.tokens_per_pass
        rows.append(row)
    return pd.DataFrame(rows).round(3)


def reading(df: pd.DataFrame, spec: pd.DataFrame | None = None, draft: dict | None = None,
            union_k: pd.DataFrame | None = None) -> list[str]:
    """Sentences computed from the tables, one per point (a list, rendered as bullets)."""
    out = []
    mode = "teacher-forced on held-out text" if df.attrs.get("teacher_forced") else "greedy on the shipped prompts"
    for point, g in df.groupby("point", sort=False):
        g = g.sort_values("batch")
        b0, bN = g.iloc[0], g.iloc[-1]
        if len(g) < 2:
            out.append(f"{point} ({mode}): one batch size ({int(b0.batch)}): {b0.decode_tok_s:.1f} tok/s over all "
                       f"sequences, {b0.ssd_mb_per_token:.3f} SSD MB/token, U(b) {b0.union_per_layer:.1f}; measure "
                       "several batch sizes to compare.")
            continue
        s = (f"{point} ({mode}): batch {int(bN.batch)} decodes {bN.decode_tok_s:.1f} tok/s over all sequences, "
             f"{bN.speedup:.2f}x batch {int(b0.batch)} ({b0.decode_tok_s:.1f}); each sequence gets {bN.per_seq_tok_s:.1f} "
             f"tok/s ({bN.per_seq_tok_s / b0.per_seq_tok_s:.2f}x its speed alone). SSD reads per generated token "
             f"{b0.ssd_mb_per_token:.3f} -> {bN.ssd_mb_per_token:.3f} MB ({bN.mb_ratio:.2f}x): the step's union of "
             f"experts per layer grows {b0.union_per_layer:.1f} -> {bN.union_per_layer:.1f} for "
             f"{int(bN.batch)}x the tokens.")
        if bN.speedup and bN.mb_ratio and bN.speedup > 1 / bN.mb_ratio * 1.5:
            s += " Speed grew more than reads fell: the step's compute is shared too (one pass over the dense weights)."
        out.append(s)
    if union_k is not None and len(union_k):
        u = {int(r.k): r.union for r in union_k.itertuples()}
        ub = df.groupby("batch")["union_per_layer"].mean().to_dict()
        common = sorted(set(u) & {int(b) for b in ub})
        if common:
            out.append("Union per layer, b sequences at one step U(b) vs k consecutive tokens of one sequence U(k) "
                       "(route log): " + "; ".join(f"{b}: {ub[b]:.1f} vs {u[b]:.1f}" for b in common)
                       + ". Different sequences share fewer experts than one sequence's neighbouring tokens.")
    if spec is not None and len(spec):
        t = speculation_table(spec)
        best = t.loc[t["tokens_per_pass"].idxmax()]
        out.append(f"Prompt-lookup speculation (k = {int(best.k)} drafted tokens): {best.tokens_per_pass:.2f} tokens per "
                   f"verification pass at best (n = {int(best.n)}; a draft found in {best.drafted_share:.0%} of passes, "
                   f"{best.mean_accepted:.2f} accepted).")
    if draft:
        verdict = ("reads less per generated token than plain decode" if draft["reads_per_token_ratio"] < 1
                   else "reads more per generated token than plain decode")
        out.append(f"Verifying a draft of {draft['k']} reads U({draft['k'] + 1}) = {draft['union_k1']:.1f} experts per layer "
                   f"({draft['overlap']:.0%} of its requests shared) for {draft['tokens_per_pass']:.2f} tokens: "
                   f"{draft['reads_per_token_ratio']:.2f}x the reads per token of one token per pass, so speculation "
                   f"{verdict} here.")
    return out


def plot(df: pd.DataFrame, union_k: pd.DataFrame | None = None):
    """Three panels against batch size: aggregate and per-sequence decode tok/s, SSD MB per generated token,
    and the union of experts per layer per step U(b) (with U(k) of one sequence when given)."""
    import matplotlib.pyplot as plt

    fig, (a1, a2, a3) = plt.subplots(1, 3, figsize=(13, 3.8))
    for i, (point, g) in enumerate(df.groupby("point", sort=False)):
        g = g.sort_values("batch")
        c = f"C{i}"
        a1.plot(g.batch, g.decode_tok_s, "o-", color=c, label=f"{point}: all sequences")
        a1.plot(g.batch, g.per_seq_tok_s, "o--", color=c, alpha=0.6, label=f"{point}: per sequence")
        a2.plot(g.batch, g.ssd_mb_per_token, "o-", color=c, label=point)
        a3.plot(g.batch, g.union_per_layer, "o-", color=c, label=f"U(b), {point}")
    if union_k is not None and len(union_k):
        a3.plot(union_k.k, union_k.union, "s:", color="gray", label="U(k), one sequence")
    for a, y, t in ((a1, "decode tok/s", "decode speed"), (a2, "SSD MB per generated token", "reads per token"),
                    (a3, "distinct experts per layer", "union per step")):
        a.set(xlabel="sequences per step", ylabel=y, title=t)
        a.set_xscale("log", base=2)
        a.grid(alpha=0.3)
        a.set_ylim(bottom=0)
        a.legend(fontsize=7)
    fig.tight_layout()
    return fig


def to_json(df, spec=None, draft=None, union_k=None) -> dict:
    """``parameters``, ``rows``, ``speculation`` (rows, table), ``draft_reads``, ``union_k``, ``reading`` and
    ``run`` (:func:`epqlab.results.run_info`)."""
    return {"parameters": dict(df.attrs), "rows": df.to_dict("records"),
            "speculation": None if spec is None else {"rows": spec.to_dict("records"),
                                                      "table": speculation_table(spec).to_dict("records")},
            "draft_reads": draft, "union_k": None if union_k is None else union_k.to_dict("records"),
            "reading": reading(df, spec, draft, union_k), "run": run_info(df.attrs.get("model"))}


def save(df, results_dir, name: str = "batching", spec=None, draft=None, union_k=None, figure: bool = True,
         extra: dict | None = None) -> dict:
    """Write ``<name>.json`` (:func:`to_json` updated with ``extra``), ``<name>.csv`` and ``<name>.png``
    (:func:`plot`) in ``results_dir``, each whole or not at all. Returns ``{kind: path}``."""
    return save_study(results_dir, name, to_json(df, spec, draft, union_k), df,
                      plot=(lambda: plot(df, union_k)) if figure else None, extra=extra)


__all__ = ["table", "speculation_table", "reading", "plot", "to_json", "save", "COLUMNS"]
