"""Tables, figures and a computed reading for the eviction ablation's table (:func:`epqlab.studies.ablation.eviction`)."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from ...results import save_figure

GROUPS = ("stale_left", "current_left", "stale_right", "current_right")
# Columns of the two tables a notebook shows (one wide table hid its speed columns behind a scrollbar).
HIT_COLUMNS = ("point", "policy", "slots", "hit_rate", "decode_hit_rate", "steady_hit_rate", "belady_hit_rate",
               "belady_steady_hit_rate", "steady_belady_share", "steady_belady_gap")
SPEED_COLUMNS = ("point", "policy", "misses_per_token", "ssd_mb_per_token", "decode_tok_s", "decode_tok_s_min",
                 "decode_tok_s_max", "io_wait_share", "io_wait_s", "replay_equal")
# A speed "contradicts" the bytes when the policy reading at least this much fewer MB/token decodes slower.
CONTRADICTION_MB_SHARE = 0.05


def _steady_share_gap(df):
    """``steady_belady_share`` and ``steady_belady_gap`` computed from the hit rates (results written before
    they were columns carried the share under the name ``steady_belady_gap``)."""
    b = df["belady_steady_hit_rate"].astype(float)
    s = df["steady_hit_rate"].astype(float)
    return s / b.where(b > 0), b - s


def hit_table(df, digits: int = 3):
    """Hit rates per (point, policy): lifetime, decode, steady state, Belady's on the same log, and the
    steady state's share of Belady's (ratio) and gap to it (hit-rate points, ``belady - live``), rounded."""
    t = df.copy()
    t["steady_belady_share"], t["steady_belady_gap"] = _steady_share_gap(t)
    return t[[c for c in HIT_COLUMNS if c in t]].round(digits)


def speed_table(df, digits: int = 3):
    """Reads and speed per (point, policy): misses and SSD MB (1e6 bytes) per decoded token, decode tok/s
    (median of the repeats, with min and max), the I/O-wait share of decode time and the I/O wait in s, and
    whether the replay reproduced the live counts; rounded."""
    return df[[c for c in SPEED_COLUMNS if c in df]].round(digits)


def replay_table(df, digits: int = 3):
    """Live vs replayed hits and I/O wait (s) per (point, policy), rounded."""
    return df[["point", "policy", "hits", "replay_hits", "replay_equal", "io_wait_s", "replay_io_wait_s"]].round(digits)


def figures(df, out_dir, prefix: str = "") -> list[str]:
    """Write the study's four figures as PNG into ``out_dir`` and return their paths: hit rate vs arena per
    policy with Belady's curve; decode tok/s (median, min-max bars) beside SSD MB/token vs arena; evictions by
    group (stale/current x left/right of the loading layer) as stacked bars; steady-state vs lifetime hit rate,
    each point labelled with its arena (policies on the same spot are named together). File names start with
    ``prefix``. The x axis is the arena as a fraction of all expert slots (bytes actually used)."""
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

    fig, (sp, mb) = plt.subplots(1, 2, figsize=(10, 4.2))
    for pol, g in df.groupby("policy", sort=False):
        g = g.sort_values(x)
        lo = (g["decode_tok_s"] - g.get("decode_tok_s_min", g["decode_tok_s"])).clip(lower=0)
        hi = (g.get("decode_tok_s_max", g["decode_tok_s"]) - g["decode_tok_s"]).clip(lower=0)
        sp.errorbar(g[x], g["decode_tok_s"], yerr=[lo, hi], marker="o", capsize=3, label=pol)
        mb.plot(g[x], g["ssd_mb_per_token"], marker="o", label=pol)
    runs = int(df["repeats"].max()) if "repeats" in df else 1
    sp.set(xlabel="arena / all expert slots", ylabel="decode tok/s",
           title=f"Decode speed (median of {runs} run{'s' if runs != 1 else ''}; min-max)")
    sp.set_ylim(bottom=0)
    mb.set(xlabel="arena / all expert slots", ylabel="SSD MB per decoded token", title="Expert reads vs arena")
    mb.set_ylim(bottom=0)
    mb.legend(fontsize=8)
    paths.append(_save(fig, out / f"{prefix}decode_speed_and_reads.png"))

    fig, ax = plt.subplots(figsize=(8, 4.6))
    labels = [f"{r.point}\n{r.policy}" for r in df.itertuples()]
    bottom = np.zeros(len(df))
    for g in GROUPS:
        vals = df[f"evictions_{g}"].to_numpy(float)
        ax.bar(range(len(df)), vals, bottom=bottom, label=g.replace("_", "-"))
        bottom = bottom + vals
    ax.set_xticks(range(len(df)), labels, fontsize=6, rotation=90)
    ax.set_ylim(0, max(1.0, float(bottom.max())) * 1.08)  # the tallest stack and its top segment stay inside
    ax.set(ylabel="evictions", title="Evictions by group (relative to the layer being loaded)")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))  # beside the bars, never over them
    paths.append(_save(fig, out / f"{prefix}eviction_groups.png"))

    fig, ax = plt.subplots(figsize=(6.4, 5.4))
    markers = "osD^vP*Xh"
    for i, (pol, g) in enumerate(df.groupby("policy", sort=False)):
        # hollow markers of decreasing size: policies on the same spot show as nested rings
        ax.scatter(g["hit_rate"], g["steady_hit_rate"], s=150 - 14 * i, marker=markers[i % len(markers)],
                   facecolors="none", edgecolors=f"C{i}", linewidths=1.4, label=pol)
    spots: dict = {}
    for r in df.itertuples():
        key = (round(float(r.hit_rate), 3), round(float(r.steady_hit_rate), 3))
        spots.setdefault(key, {}).setdefault(_arena_label(r), []).append(r.policy)
    placed: list = []
    for (hx, hy), by_arena in spots.items():
        text = "; ".join(f"{a}: {', '.join(p)}" if len(p) > 1 else f"{a} {p[0]}" for a, p in by_arena.items())
        near = sum(abs(hx - px) < 0.08 and abs(hy - py) < 0.04 for px, py in placed)  # stack labels of close points
        placed.append((hx, hy))
        ax.annotate(text, (hx, hy), xytext=(8, 4 - 9 * near), textcoords="offset points", fontsize=6.5, color="0.25")
    ax.plot([0, 1], [0, 1], color="0.7", lw=1)
    ax.set(xlabel="lifetime hit rate (prefill included)", ylabel="steady-state decode hit rate",
           title="Steady state vs lifetime (labels: arena, policy)", xlim=(-0.04, 1), ylim=(-0.04, 1))
    ax.legend(fontsize=8, loc="lower right")
    paths.append(_save(fig, out / f"{prefix}steady_vs_lifetime.png"))
    return paths


def _arena_label(r) -> str:
    frac = getattr(r, "arena_fraction", None)
    if frac is not None and frac == frac:
        return f"{float(frac):.0%}"
    return str(r.point).replace("arena ", "").replace("budget ", "")


def _save(fig, path: Path) -> str:
    fig.tight_layout()
    save_figure(fig, path)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return str(path)


def _speed_caveat(name: str, b, lru) -> str:
    """A sentence when the speeds contradict the bytes (the policy reading clearly fewer MB/token decodes
    slower, or the one reading clearly more decodes faster); empty otherwise."""
    mb_b, mb_l = float(b["ssd_mb_per_token"]), float(lru["ssd_mb_per_token"])
    tok_b, tok_l = float(b["decode_tok_s"]), float(lru["decode_tok_s"])
    if not all(np.isfinite([mb_b, mb_l, tok_b, tok_l])) or max(mb_b, mb_l) <= 0:
        return ""
    fewer = (mb_l - mb_b) / max(mb_b, mb_l)
    if (fewer >= CONTRADICTION_MB_SHARE and tok_b < tok_l) or (-fewer >= CONTRADICTION_MB_SHARE and tok_b > tok_l):
        who, other = (name, "LRU") if fewer > 0 else ("LRU", name)
        return (f" The speeds contradict the bytes: {who} reads fewer MB/token than {other} yet decodes slower, "
                f"so these timings are noise (median of {int(b['repeats'])} run{'s' if int(b['repeats']) != 1 else ''}; "
                "the box may have been busy, or the disk throttled): trust the counts, and rerun the speeds with "
                "more repeats (preset full) on an idle machine.")
    return ""


def reading(df) -> str:
    """A reading computed from the table, as a Markdown list with one item per memory point: the best online
    policy by steady-state hit rate and its share of Belady's, LRU's and Least-Stale's standing (the claims of
    seed 000 and SpecMD), decode speed with its I/O-wait share, and a caveat where the speeds contradict the
    bytes read; then whether every replay reproduced its live run."""
    lines = []
    if df["steady_hit_rate"].isna().all():
        lines.append("No steady-state decode passes were measured (n_predict <= warmup): raise n_predict above the "
                     "warm-up for steady-state hit rates; the lifetime rates are in the table.")
        return "\n\n".join(lines)
    df = df.copy()
    df["steady_belady_share"], _ = _steady_share_gap(df)
    for point, g in df.groupby("point", sort=False):
        g = g.set_index("policy")
        share_any = g["steady_belady_share"].notna().any()
        best = g["steady_hit_rate" if share_any else "hit_rate"].idxmax()
        b = g.loc[best]
        share = b["steady_belady_share"]
        line = (f"- **{point}** ({int(b['slots'])} slots): best online policy {best} — steady-state hit rate "
                f"{b['steady_hit_rate']:.1%} vs Belady {b['belady_steady_hit_rate']:.1%} "
                f"({share:.0%} of the bound; lifetime {b['hit_rate']:.1%} vs {b['belady_hit_rate']:.1%})."
                if share == share else
                f"- **{point}** ({int(b['slots'])} slots): best online policy {best} by lifetime hit rate "
                f"{b['hit_rate']:.1%} vs Belady {b['belady_hit_rate']:.1%}; no steady-state hits, not even Belady's "
                "(too few decode passes after the warm-up: raise n_predict).")
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
            if best != "lru":
                line += _speed_caveat(best, b, lru)
        lines.append(line)
    ok = bool(df["replay_equal"].all())
    lines.append("")
    lines.append("Replay of each run's own route log through a fresh pager reproduced its hits, misses and evictions "
                 + ("exactly in every row." if ok else "NOT in every row: see replay_equal."))
    return "\n".join(lines)
