"""Table, plot, reading and files of :func:`epqlab.studies.ablation.lossy.lossy_knobs` (notebook 07, papers/07): every
sentence of :func:`reading` is computed from the rows."""
from __future__ import annotations

import math

from ...results import run_info, save_study
from ..paired import worded

KNOB_ORDER = ("exact", "top-k", "skip-cold", "cache-route", "adaptive-k")


def _num(x):
    try:
        v = float(x)
    except (TypeError, ValueError):
        return x
    return None if math.isnan(v) else v


def columns(df) -> dict:
    """Column -> heading of the table (per-text ratios first, then the I/O and speed columns)."""
    texts = df.attrs.get("texts") or [c[len("ppl_ratio_"):] for c in df.columns
                                      if c.startswith("ppl_ratio_") and c != "ppl_ratio_mean"]
    cols = {"point": "arena", "knob": "knob", "setting": "setting"}
    cols.update({f"ppl_ratio_{t}": f"PPL ratio {t}" for t in texts if f"ppl_ratio_{t}" in df})
    cols.update({"ppl_ratio_tokens": "PPL ratio (all tokens)", "ppl_ratio_low": "95% low", "ppl_ratio_high": "95% high"}
                if texts else {})
    cols.update({"routing_agreement": "agreement", "mean_k": "mean k", "ssd_mb_per_token": "SSD MB/token",
                 "decode_tok_s": "decode tok/s", "hit_rate": "hit rate"})
    return {c: h for c, h in cols.items() if c in df}


def format_table(df) -> str:
    cols = columns(df)
    out = df[list(cols)].rename(columns=cols)
    return out.to_string(index=False, float_format=lambda v: f"{v:.4f}")


def plot(df):
    """One panel per arena: SSD MB/token (x) against the geometric-mean PPL ratio to exact (y), a marker per
    knob, each point labelled with its setting. Returns the matplotlib Figure."""
    import matplotlib.pyplot as plt

    points = list(dict.fromkeys(df["point"]))
    fig, axes = plt.subplots(1, len(points), figsize=(6 * len(points), 4.5), squeeze=False)
    marks = dict(zip(KNOB_ORDER, ("*", "o", "s", "^", "D")))
    for ax, pt in zip(axes[0], points):
        d = df[df["point"] == pt]
        for knob in KNOB_ORDER:
            g = d[d["knob"] == knob]
            if g.empty:
                continue
            ax.plot(g["ssd_mb_per_token"], g["ppl_ratio_mean"], marks[knob], label=knob, markersize=9 if knob == "exact" else 7)
            for _, r in g.iterrows():
                if knob != "exact":
                    ax.annotate(r["setting"], (r["ssd_mb_per_token"], r["ppl_ratio_mean"]), fontsize=7,
                                xytext=(4, 3), textcoords="offset points")
        ax.axhline(1.0, color="grey", lw=0.5)
        ax.set_xlabel("SSD MB per decoded token")
        ax.set_ylabel("perplexity / exact (geometric mean over texts)")
        ax.set_title(f"{pt}: quality lost vs bytes read")
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def reading(df) -> str:
    """Per arena: the exact baseline, then per knob and setting the PPL ratio (mean and per text, and over all
    scored tokens with its paired 95% interval), SSD MB/token and decode speed against exact, agreement and hit
    rate; and which knob reads the fewest bytes with its interval within 1% and 5% perplexity, or that none is
    distinguishable from exact (:func:`_picks`). Speeds are one wall-clock run each on the machine that ran it (a
    shared box inflates their noise), so no pick rests on them."""
    out = []
    texts = df.attrs.get("texts") or []
    for pt in dict.fromkeys(df["point"]):
        d = df[df["point"] == pt]
        base = d[d["knob"] == "exact"].iloc[0]
        lines = [f"**{pt}**: exact reads {base['ssd_mb_per_token']:.3f} MB/token at {base['decode_tok_s']:.1f} tok/s, "
                 f"hit rate {base['hit_rate']:.1%}."]
        for _, r in d[d["knob"] != "exact"].iterrows():
            per = ", ".join(f"{t} x{r[f'ppl_ratio_{t}']:.3f}" for t in texts if f"ppl_ratio_{t}" in r)
            mb = r["ssd_mb_per_token"] / base["ssd_mb_per_token"] - 1 if base["ssd_mb_per_token"] else 0.0
            sp = r["decode_tok_s"] / base["decode_tok_s"] if base["decode_tok_s"] else 0.0
            q = f"PPL x{r['ppl_ratio_mean']:.3f} ({per}; all tokens {_interval(r)}); " if texts else ""
            lines.append(f"{r['knob']} {r['setting']}: {q}SSD {mb:+.0%}; "
                         f"speed x{sp:.2f}; agreement {r['routing_agreement']:.1%}; hit rate {r['hit_rate']:.1%}; "
                         f"mean k {r['mean_k']:.2f}.")
        if not texts:
            lines.append("No perplexity: no texts were scored (a random-weight model's perplexity means nothing).")
        lines += _picks(d, base) if texts else []
        out.append(" ".join(lines))
    ak = df[df["knob"] == "adaptive-k"]
    pub = ak[ak["setting"].str.startswith("H<0.6:1,H<1.2:2")]
    if not pub.empty and (pub["mean_k"] >= df.attrs.get("own_k", 0)).all():
        out.append(f"The published adaptive-k thresholds never lower k on this model: its router entropies are above "
                   f"1.2 nats (n_expert = {df.attrs.get('n_expert')}, ln n_expert = {math.log(df.attrs.get('n_expert') or 1):.2f}), "
                   f"so the rule only bites with thresholds set for this model.")
    return "\n\n".join(out)


def _interval(r) -> str:
    if "ppl_ratio_high" not in r or r["ppl_ratio_high"] != r["ppl_ratio_high"]:  # an older table: no interval
        return "no interval"
    return worded(r["ppl_ratio_tokens"], r["ppl_ratio_low"], r["ppl_ratio_high"], int(r["scored_tokens"]))


def _picks(d, base, limits=(1.01, 1.05)) -> list[str]:
    """Which lossy setting reads the fewest bytes within each perplexity limit, counted only when it is shown to
    stay within: its paired 95% interval's upper end (:mod:`epqlab.studies.paired`), not its point estimate, is
    at most the limit, and it reads fewer bytes than exact. A point estimate below x1 is noise on a few hundred
    tokens, never a gain; when no setting's interval excludes x1, the reading says no setting is distinguishable
    from exact."""
    lossy = d[d["knob"] != "exact"]
    if lossy.empty or "ppl_ratio_high" not in lossy:
        return []
    n = int(lossy["scored_tokens"].iloc[0])
    out = []
    for lim in limits:
        ok = lossy[(lossy["ppl_ratio_high"] <= lim) & (lossy["ssd_mb_per_token"] < base["ssd_mb_per_token"])]
        if ok.empty:
            out.append(f"No lossy setting reads fewer bytes than exact with its 95% interval within PPL x{lim:.2f} "
                       f"on these {n} scored tokens.")
        else:
            b = ok.loc[ok["ssd_mb_per_token"].idxmin()]
            out.append(f"Fewest bytes with the 95% interval within PPL x{lim:.2f}: {b['knob']} {b['setting']} "
                       f"({b['ssd_mb_per_token']:.3f} MB/token against exact's {base['ssd_mb_per_token']:.3f}; "
                       f"{_interval(b)}).")
    if ((lossy["ppl_ratio_low"] <= 1.0) & (lossy["ppl_ratio_high"] >= 1.0)).all():
        out.append(f"No lossy setting is distinguishable from exact here: every 95% interval holds x1 over these {n} "
                   "scored tokens (a ratio below x1 is noise, not a gain; score more text to tell them apart).")
    return out


def to_json(df) -> dict:
    return {"parameters": dict(df.attrs), "rows": [{k: _num(v) for k, v in r.items()} for r in df.to_dict("records")],
            "reading": reading(df), "run": run_info(df.attrs.get("model"))}


def save(df, results_dir, name: str = "lossy", figure: bool = True, extra: dict | None = None) -> dict:
    """Write ``<results_dir>/<name>.json`` (:func:`to_json` updated with ``extra``), ``<name>.csv`` and
    ``<name>.png`` (:func:`plot`). Returns ``{kind: path}`` (str)."""
    return save_study(results_dir, name, to_json(df), df, plot=(lambda: plot(df)) if figure else None, extra=extra)


__all__ = ["columns", "format_table", "plot", "reading", "to_json", "save", "KNOB_ORDER"]
