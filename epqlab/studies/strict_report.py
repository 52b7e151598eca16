"""The strict study's report (:func:`epqlab.studies.strict.run` makes the table): the table as text, a
reading computed from it, the figure, and the results files.

Units: bytes unless a column says MB (10**6 bytes) or tok/s.
"""
from __future__ import annotations

import json
import os
import sys

from ..results import run_info, save_study
from ..units import fmt_bytes


def format_table(df) -> str:
    """The table as text: one line per (level, mode), sizes in MiB/GiB, speeds in tok/s, SSD in MB/token."""
    def b(v):
        return "-" if v is None or v != v else fmt_bytes(v)

    def f(v, fmt):
        return "-" if v is None or v != v else format(v, fmt)

    def t(v):
        return v if isinstance(v, str) and v else "-"

    cols = ["level", "mode", "limit", "budget", "arena", "slots", "cover", "peak anon", "peak shmem", "peak file",
            "cg peak", "failcnt", "decode tok/s (min-max)", "prefill", "SSD MB/tok", "IO MB/tok", "hit",
            "evict", "load s", "load read", "status"]
    if "speedup_vs_mmap" in df:
        cols.insert(-1, "x mmap")
    sim = "sim_lru_hit_rate" in df and df["sim_lru_hit_rate"].notna().any()
    if sim:
        cols[cols.index("hit") + 1:cols.index("hit") + 1] = ["LRU sim", "Belady"]
    lines = []
    for _, r in df.iterrows():
        mode = r["mode"] + (f" {r['variant']}" if isinstance(r.get("variant"), str) and r["variant"] else "")
        cells = [b(r["level"]), mode, r["limit_mode"] + ("" if r["cache_dropped"] else " (cache kept)"),
                 b(r["budget"]), b(r["arena_bytes"]), t(r["slots"]), f(r["coverage"], ".1%"),
                 b(r["peak_rss_anon"]), b(r["peak_rss_shmem"]), b(r["peak_rss_file"]), b(r["cgroup_peak"]),
                 f(r["failcnt"], ".0f"),
                 (f"{r['decode_tok_s']:.2f} ({r['decode_tok_s_min']:.2f}-{r['decode_tok_s_max']:.2f})"
                  if r["decode_tok_s"] is not None and r["decode_tok_s"] == r["decode_tok_s"] else "-"),
                 f(r["prefill_tok_s"], ".1f"), f(r["ssd_mb_per_token"], ".2f"), f(r["io_mb_per_token"], ".2f"),
                 f(r["hit_rate"], ".1%"), f(r["evictions"], ".0f"), f(r["load_s"], ".2f"), b(r["load_bytes_read"]),
                 r["status"] + (f" ({r['passed']}/{r['runs']})" if r["passed"] != r["runs"] else "")]
        if "speedup_vs_mmap" in df:
            cells.insert(-1, f(r["speedup_vs_mmap"], ".2f"))
        if sim:
            i = cols.index("LRU sim")
            cells[i:i] = [f(r["sim_lru_hit_rate"], ".1%"), f(r["sim_belady_hit_rate"], ".1%")]
        lines.append([str(c) for c in cells])
    w = [max(len(c), *(len(l[i]) for l in lines)) for i, c in enumerate(cols)]
    out = ["  ".join(c.ljust(w[i]) for i, c in enumerate(cols))]
    out += ["  ".join(c.ljust(w[i]) for i, c in enumerate(l)) for l in lines]
    for _, r in df.iterrows():
        if isinstance(r["reason"], str) and r["reason"]:
            first = r["reason"].strip().splitlines()[0] if r["reason"].strip() else r["reason"]
            out.append(f"{fmt_bytes(r['level'])} {r['mode']}: {first[:400]}")
    return "\n".join(out)


def reading(df) -> str:
    """A few sentences computed from the table: which levels pass, the smallest passing level,
    speedup over mmap, and how the hit rate and SSD traffic move with the level."""
    paged = df[df["mode"] == "paged"]
    s = []
    passed = [fmt_bytes(x) for x in paged[paged["status"] == "PASS"]["level"]]
    failed = paged[paged["status"] != "PASS"]
    mode = ", ".join(sorted(set(df["limit_mode"])))
    if len(paged):
        s.append(f"Under a {mode} limit, the paged run passes at {', '.join(passed) if passed else 'no level'}"
                 + (f" and fails at {', '.join(fmt_bytes(x) for x in failed['level'])} "
                    f"({'; '.join(sorted({str(r).split(':')[0] for r in failed['reason']}))})" if len(failed) else "")
                 + ".")
    mm = df[df["mode"] == "mmap"]
    if len(mm):
        mp = [fmt_bytes(x) for x in mm[mm["status"] == "PASS"]["level"]]
        s.append(f"Plain llama.cpp (mmap) under the same limit passes at {', '.join(mp) if mp else 'no level'}.")
    if "speedup_vs_mmap" in df:
        sp = paged.dropna(subset=["speedup_vs_mmap"])
        if len(sp):
            parts = [f"{fmt_bytes(r['level'])}: {r['decode_tok_s']:.2f} vs {r['mmap_decode_tok_s']:.2f} tok/s "
                     f"({r['speedup_vs_mmap']:.2f}x)" for _, r in sp.iterrows()]
            same = sp["same_text_as_mmap"].dropna()
            s.append("Decode, paged vs mmap: " + "; ".join(parts) + "."
                     + (f" Greedy text identical to mmap at {int(same.sum())}/{len(same)} levels."
                        if len(same) else ""))
    ok = paged[paged["status"] == "PASS"]
    if len(ok) >= 2:
        lo, hi = ok.iloc[0], ok.iloc[-1]
        s.append(f"From {fmt_bytes(lo['level'])} to {fmt_bytes(hi['level'])} the arena covers "
                 f"{lo['coverage']:.0%} -> {hi['coverage']:.0%} of routed experts, the hit rate goes "
                 f"{lo['hit_rate']:.1%} -> {hi['hit_rate']:.1%}, pager reads {lo['ssd_mb_per_token']:.2f} -> "
                 f"{hi['ssd_mb_per_token']:.2f} MB/token and decode {lo['decode_tok_s']:.2f} -> "
                 f"{hi['decode_tok_s']:.2f} tok/s.")
    if not df["cache_dropped"].all():
        s.append("The model file could not be dropped from the page cache before every run (its file system "
                 "keeps it, as tmpfs does, or another process holds it mapped): "
                 "runs did not start cold.")
    return " ".join(s)


def plot(df):
    """Figure with decode tok/s (median, min-max bars) and SSD MB/token against the level, paged
    beside the mmap baseline; FAIL levels are marked with an x on the axis. Returns the Figure."""
    import matplotlib

    if not os.environ.get("MPLBACKEND") and "matplotlib.pyplot" not in sys.modules:
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gib = df["level"].max() >= 2**30
    unit, scale = ("GiB", 2**30) if gib else ("MiB", 2**20)
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    for mode, color in (("paged", "C0"), ("mmap", "C1")):
        d = df[df["mode"] == mode]
        if not len(d):
            continue
        ok = d[d["status"] == "PASS"]
        x = ok["level"] / scale
        y = ok["decode_tok_s"].astype(float)
        err = [y - ok["decode_tok_s_min"].astype(float), ok["decode_tok_s_max"].astype(float) - y]
        a1.errorbar(x, y, yerr=err, marker="o", color=color, capsize=3, label=f"{mode} decode")
        bad = d[d["status"] != "PASS"]
        for a in (a1, a2):
            a.plot(bad["level"] / scale, [0] * len(bad), "x", color=color, ms=9,
                   label=f"{mode} FAIL" if len(bad) and a is a1 else None)
        col = "ssd_mb_per_token" if mode == "paged" else "io_mb_per_token"
        a2.plot(x, ok[col].astype(float), marker="o", color=color,
                label="paged: pager reads" if mode == "paged" else "mmap: process reads (/proc/self/io)")
        if mode == "paged" and ok["io_mb_per_token"].notna().any():
            a2.plot(x, ok["io_mb_per_token"].astype(float), marker=".", ls="--", color=color,
                    label="paged: process reads (/proc/self/io)")
    modes = ", ".join(sorted(set(df["limit_mode"])))
    a1.set(xlabel=f"memory limit ({unit})", ylabel="decode tok/s", title=f"decode speed ({modes} limit)")
    a2.set(xlabel=f"memory limit ({unit})", ylabel="MB read per decoded token", title="storage reads per token")
    for a in (a1, a2):
        a.grid(alpha=0.3)
        a.legend(fontsize=8)
        a.set_ylim(bottom=0)
    fig.tight_layout()
    return fig


def to_json(df) -> dict:
    """``{"parameters": ..., "rows": [...], "runs": [...], "reading": str, "run": ...}`` (JSON-serializable;
    ``run`` is :func:`epqlab.results.run_info`: date, machine, model hash, command line)."""
    attrs = dict(df.attrs)
    runs = attrs.pop("runs", [])
    rows = json.loads(df.to_json(orient="records"))
    return {"parameters": attrs, "rows": rows, "runs": runs, "reading": reading(df), "run": run_info(attrs.get("model"))}


def save(df, results_dir, name: str = "strict", figure: bool = True, extra: dict | None = None) -> dict:
    """Write ``<results_dir>/<name>.json`` (:func:`to_json`, updated with ``extra``), ``.csv`` (the
    table) and ``.png`` (:func:`plot`, unless ``figure=False``). Returns ``{"json": path, "csv":
    path, "png": path}`` (str)."""
    return save_study(results_dir, name, to_json(df), df.drop(columns=["tokens"], errors="ignore"),
                      plot=(lambda: plot(df)) if figure else None, extra=extra)
