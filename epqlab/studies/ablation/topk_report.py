"""Tables, figures, JSON/CSV files and the closing reading of the top-k ablation (notebook 04).

Inputs are the DataFrames of :func:`epqlab.studies.ablation.topk.topk` and
:func:`epqlab.studies.ablation.skip_cold.skip_cold`; every sentence of :func:`reading` is computed from them.
"""
from __future__ import annotations

import math
from ...results import run_info, save_study

# Columns of the speed/I/O summary this report reads (names of epqlab.studies.ablation.grid.summarize).
DECODE = "decode_tok_s"
PREFILL = "prefill_tok_s"
SSD = "ssd_mb_per_token"


def _ppl_cols(df) -> list[str]:
    return [c for c in df.columns if c.startswith("ppl_") and c != "ppl_mean"]


def _num(x):
    if x is None:
        return None
    try:
        v = float(x)
    except (TypeError, ValueError):
        return x
    return None if math.isnan(v) else v


def format_table(df) -> str:
    """Plain-text table: k, point, perplexity per text, decode/prefill tok/s, SSD MB/token, hit rate,
    greedy common prefix with the model's own k."""
    cols = ["k", "point", *_ppl_cols(df), DECODE, PREFILL, SSD, "hit_rate", "greedy_common_prefix_mean"]
    cols = [c for c in cols if c in df.columns]
    head = [c.replace("greedy_common_prefix_mean", "greedy_prefix") for c in cols]
    rows = []
    for _, r in df.iterrows():
        out = []
        for c in cols:
            v = r[c]
            out.append(f"{v:.4g}" if isinstance(v, float) else str(v))
        rows.append(out)
    w = [max(len(h), *(len(x[i]) for x in rows)) for i, h in enumerate(head)]
    lines = ["  ".join(h.rjust(w[i]) for i, h in enumerate(head))]
    lines += ["  ".join(x[i].rjust(w[i]) for i in range(len(head))) for x in rows]
    return "\n".join(lines)


def plot(df, skip=None):
    """One figure, four panels: perplexity vs k per text; decode tok/s vs k per point; SSD MB/token vs
    k per point; perplexity (geometric mean over texts) relative to its baseline vs SSD MB/token at
    each point -- the trade-off curve -- with the skip-cold points (``skip``) on it. The baselines are
    the model's own k (top-k rows) and the knob off (skip-cold rows, evaluated one token per decode,
    possibly on shorter texts), so both curves share one axis. Returns the matplotlib Figure."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(2, 2, figsize=(11, 8))
    ppl = _ppl_cols(df)
    first = df.drop_duplicates("k")
    own = df.attrs.get("own_k")
    a = ax[0, 0]
    for c in ppl:
        a.plot(first["k"], first[c], "o-", label=c[4:])
    if own is not None:
        a.axvline(own, color="grey", ls=":", label=f"model's k={own}")
    a.set(xlabel="top-k (experts per token)", ylabel="perplexity", yscale="log", title="Perplexity vs k")
    a.legend(fontsize=8)
    for a, col, title in ((ax[0, 1], DECODE, "Decode speed vs k"), (ax[1, 0], SSD, "SSD reads vs k")):
        for pt, g in df.groupby("point", sort=False):
            if col in g:
                a.plot(g["k"], g[col], "o-", label=pt)
        a.set(xlabel="top-k", title=title, ylabel="decode tok/s (median)" if col == DECODE else "SSD MB/token (decode)")
        a.legend(fontsize=8)
    a = ax[1, 1]
    if ppl:  # no texts (a synthesized model): no quality axis for the top-k rows
        gm = df[ppl].apply(lambda r: math.exp(sum(math.log(x) for x in r) / len(r)), axis=1)
        ref = gm[df["k"] == own]
        base = float(ref.iloc[0]) if len(ref) else float(gm.min())
        for pt, g in df.assign(_gm=gm / base).groupby("point", sort=False):
            a.plot(g[SSD], g["_gm"], "o-", label=f"top-k at {pt}")
            for _, r in g.iterrows():
                a.annotate(f"k={r['k']}", (r[SSD], r["_gm"]), fontsize=7, xytext=(3, 3), textcoords="offset points")
    if skip is not None and len(skip):
        x = SSD if SSD in skip else "ppl_ssd_mb_per_token"
        off = float(skip.loc[skip["tau"].isna(), "ppl_mean"].iloc[0])
        a.plot(skip[x], skip["ppl_mean"] / off, "s--", color="black",
               label=f"skip-cold at {skip.attrs.get('point', '')} (k={skip.attrs.get('k')}; vs knob off)")
        for _, r in skip.iterrows():
            a.annotate("off" if _num(r["tau"]) is None else f"τ={r['tau']:g}", (r[x], r["ppl_mean"] / off),
                       fontsize=7, xytext=(3, -9), textcoords="offset points")
    a.set(xlabel="SSD MB/token (decode)", ylabel="perplexity / baseline (geometric mean of texts)",
          title=f"Trade-off: quality vs I/O (baseline: top-{own}, knob off)")
    a.legend(fontsize=8)
    fig.tight_layout()
    return fig


def reading(df, skip=None) -> str:
    """The closing reading, every number computed from ``df`` (and ``skip``): perplexity change of each k
    against the model's own, the I/O and speed it buys at each point, greedy divergence, skip-cold."""
    own = df.attrs.get("own_k")
    ppl = _ppl_cols(df)
    first = df.drop_duplicates("k").set_index("k")
    out = []
    if own in first.index and ppl:
        ref = first.loc[own]
        parts = []
        for k, r in first.iterrows():
            if k == own:
                continue
            ratios = [r[c] / ref[c] for c in ppl]
            parts.append(f"k={k}: x{min(ratios):.3f}–x{max(ratios):.3f}")
        out.append(f"**Perplexity** against the model's own top-{own} ("
                   + ", ".join(f"{c[4:]} {ref[c]:.3f}" for c in ppl) + "): " + "; ".join(parts) + ".")
        worse = [k for k, r in first.iterrows() if k < own and any(r[c] > ref[c] for c in ppl)]
        better = [k for k, r in first.iterrows() if k > own and all(r[c] < ref[c] for c in ppl)]
        if worse:
            out.append(f"Every k below {own} raises perplexity on at least one text (k = {', '.join(map(str, worse))}).")
        if better:
            out.append(f"k above {own} lowers it on every text at k = {', '.join(map(str, better))}, at the cost of "
                       "more experts read per token.")
    for pt, g in df.groupby("point", sort=False):
        g = g.set_index("k")
        if own not in g.index or SSD not in g:
            continue
        lo = g.index.min()
        r0, r1 = g.loc[own], g.loc[lo]
        s = f"**At {pt}**: top-{lo} reads {r1[SSD]:.3f} MB/token vs {r0[SSD]:.3f} at top-{own}"
        if r0[SSD] > 0:
            s += f" ({(1 - r1[SSD] / r0[SSD]):.0%} less)"
        if DECODE in g and r0[DECODE]:
            s += f", decodes at {r1[DECODE]:.1f} vs {r0[DECODE]:.1f} tok/s (x{r1[DECODE] / r0[DECODE]:.2f})"
        out.append(s + ".")
    div = df.attrs.get("divergence") or []
    if div:
        import pandas as pd

        d = pd.DataFrame(div)
        n = int(d["n_predict"].iloc[0])
        parts = [f"k={k}: {g['common_prefix'].mean():.1f}" for k, g in d.groupby("k") if k != own]
        if parts:
            out.append(f"**Greedy divergence** from top-{own} (mean common prefix of {n} tokens over "
                       f"{d['prompt'].nunique()} prompts): " + ", ".join(parts) + ".")
    if skip is not None and len(skip):
        base = skip[skip["tau"].isna()].iloc[0]
        parts = []
        gen = SSD in skip
        for _, r in skip[skip["tau"].notna()].iterrows():
            s = (f"τ={r['tau']:g}: PPL x{r['ppl_mean'] / base['ppl_mean']:.3f}, "
                 f"{r['ppl_skipped_per_token']:.2f} experts skipped/token")
            if gen:
                s += f", generation {r[SSD]:.3f} MB/token"
                if DECODE in skip and base[DECODE]:
                    s += f" at x{r[DECODE] / base[DECODE]:.2f} the decode speed"
            parts.append(s)
        out.append(f"**Skip-cold** (lossy, off by default) at {skip.attrs.get('point')}, top-{skip.attrs.get('k')}; "
                   f"perplexity one token per decode: off = PPL {base['ppl_mean']:.3f} (geometric mean of texts)"
                   + (f", generation {base[SSD]:.3f} MB/token" if gen else "") + "; " + "; ".join(parts) + ".")
    return "\n\n".join(out)


def to_json(df, skip=None) -> dict:
    """JSON-ready dict: ``parameters`` (df.attrs without raw runs), ``rows`` (the table),
    ``divergence``, ``runs``, ``skip_cold`` (rows and parameters, or None), ``reading`` and ``run``
    (:func:`epqlab.results.run_info`: date, machine, model hash, command line)."""
    params = {k: v for k, v in df.attrs.items() if k not in ("divergence", "runs")}
    clean = lambda recs: [{k: _num(v) for k, v in r.items()} for r in recs]  # noqa: E731
    return {"parameters": params, "rows": clean(df.to_dict("records")), "divergence": df.attrs.get("divergence", []),
            "runs": clean(df.attrs.get("runs", [])),
            "skip_cold": None if skip is None else {"parameters": dict(skip.attrs), "rows": clean(skip.to_dict("records"))},
            "reading": reading(df, skip), "run": run_info(df.attrs.get("model"))}


def save(df, results_dir, name: str = "topk", skip=None, figure: bool = True, extra: dict | None = None) -> dict:
    """Write ``<results_dir>/<name>.json`` (:func:`to_json` updated with ``extra``), ``<name>.csv`` (the
    table), ``<name>_divergence.csv``, ``<name>_skip_cold.csv`` (with ``skip``) and ``<name>.png``
    (:func:`plot`). Returns ``{kind: path}`` (str)."""
    import pandas as pd

    tables = {"divergence": pd.DataFrame(df.attrs.get("divergence", []))}
    if skip is not None:
        tables["skip_cold"] = skip
    return save_study(results_dir, name, to_json(df, skip), df, plot=(lambda: plot(df, skip)) if figure else None,
                      extra=extra, tables=tables)


__all__ = ["format_table", "plot", "reading", "to_json", "save"]
