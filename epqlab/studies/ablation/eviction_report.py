"""Figures and a computed reading for the eviction ablation's table (:func:`epqlab.studies.ablation.eviction`)."""
from __future__ import annotations

from pathlib import Path
from ...results import save_figure

GROUPS = ("stale_left", "current_left", "stale_right", "current_right")


def figures(df, out_dir, prefix: str = "") -> list[str]:
    """Write the study's four figures as PNG into ``out_dir`` and return their paths:
    hit rate vs arena per policy with Belady's curve; SSD MB/token vs arena; evictions by group
    (stale/current x left/right of the loading layer) as stacked bars; steady-state vs lifetime
    hit rate. File names start with ``prefix``. The x axis is the arena as a fraction of all expert slots (bytes actually used)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    x = "arena_fraction_of_experts"

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for pol, g in df.groupby("policy", sort=False):
        g = g.sort_values(x)
        ax.plot(g[x], g["hit_rate"], marker="o", label=pol)
    b = df.groupby(x, as_index=False)["belady_hit_rate"].first().sort_values(x)
    ax.plot(b[x], b["belady_hit_rate"], "k--", marker="s", label="Belady (same log)")
    ax.set(xlabel="arena / all expert slots", ylabel="hit rate (lifetime)", title="Hit rate vs arena", ylim=(0, 1))
    ax.legend(fontsize=8)
    paths.append(_save(fig, out / f"{prefix}hit_rate_vs_arena.png"))

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for pol, g in df.groupby("policy", sort=False):
        g = g.sort_values(x)
        ax.plot(g[x], g["ssd_mb_per_token"], marker="o", label=pol)
    ax.set(xlabel="arena / all expert slots", ylabel="SSD MB per decoded token", title="Expert reads vs arena")
    ax.legend(fontsize=8)
    paths.append(_save(fig, out / f"{prefix}ssd_mb_per_token.png"))

    fig, ax = plt.subplots(figsize=(8, 4.2))
    labels = [f"{r.point}\n{r.policy}" for r in df.itertuples()]
    bottom = [0.0] * len(df)
    for g in GROUPS:
        vals = df[f"evictions_{g}"].tolist()
        ax.bar(range(len(df)), vals, bottom=bottom, label=g.replace("_", "-"))
        bottom = [a + v for a, v in zip(bottom, vals)]
    ax.set_xticks(range(len(df)), labels, fontsize=6, rotation=90)
    ax.set(ylabel="evictions", title="Evictions by group (relative to the layer being loaded)")
    ax.legend(fontsize=8)
    paths.append(_save(fig, out / f"{prefix}eviction_groups.png"))

    fig, ax = plt.subplots(figsize=(5.2, 5))
    for pol, g in df.groupby("policy", sort=False):
        ax.scatter(g["hit_rate"], g["steady_hit_rate"], label=pol)
    ax.plot([0, 1], [0, 1], color="0.7", lw=1)
    ax.set(xlabel="lifetime hit rate (prefill included)", ylabel="steady-state decode hit rate",
           title="Steady state vs lifetime", xlim=(0, 1), ylim=(0, 1))
    ax.legend(fontsize=8)
    paths.append(_save(fig, out / f"{prefix}steady_vs_lifetime.png"))
    return paths


def _save(fig, path: Path) -> str:
    fig.tight_layout()
    save_figure(fig, path)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return str(path)


def reading(df) -> str:
    """A short reading computed from the table: per memory point, the best online policy by
    steady-state hit rate and its share of Belady's, LRU's and Least-Stale's standing (the claims of
    seed 000 and SpecMD), and decode speed with its I/O-wait share."""
    lines = []
    if df["steady_hit_rate"].isna().all():
        lines.append("No steady-state decode passes were measured (n_predict <= warmup): raise n_predict above the "
                     "warm-up for steady-state hit rates; the lifetime rates are in the table.")
        return "\n\n".join(lines)
    for point, g in df.groupby("point", sort=False):
        g = g.set_index("policy")
        best = g["steady_hit_rate"].idxmax()
        b = g.loc[best]
        line = (f"{point} ({int(b['slots'])} slots): best online policy {best} — steady-state hit rate "
                f"{b['steady_hit_rate']:.1%} vs Belady {b['belady_steady_hit_rate']:.1%} "
                f"({b['steady_belady_gap']:.0%} of the bound; lifetime {b['hit_rate']:.1%} vs {b['belady_hit_rate']:.1%}).")
        if "lru" in g.index:
            lru = g.loc["lru"]
            line += f" LRU {lru['steady_hit_rate']:.1%}"
            if "ls" in g.index:
                ls = g.loc["ls"]["steady_hit_rate"]
                line += f", Least-Stale {ls:.1%} ({'above' if ls > lru['steady_hit_rate'] else 'not above'} LRU)"
            if "ls_pos" in g.index:
                lp = g.loc["ls_pos"]["steady_hit_rate"]
                line += f", LS+position {lp:.1%}"
            line += "."
            line += (f" Decode {b['decode_tok_s']:.1f} tok/s ({best}, median of {int(b['repeats'])}; "
                     f"{b['io_wait_share']:.0%} of decode time waiting for {b['ssd_mb_per_token']:.2f} MB/token) "
                     f"vs {lru['decode_tok_s']:.1f} tok/s (LRU; {lru['io_wait_share']:.0%}, {lru['ssd_mb_per_token']:.2f} MB/token).")
        lines.append(line)
    ok = bool(df["replay_equal"].all())
    lines.append("Replay of each run's own route log through a fresh pager reproduced its hits, misses and evictions "
                 + ("exactly in every row." if ok else "NOT in every row: see replay_equal."))
    return "\n".join(lines)
