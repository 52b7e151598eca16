"""The MTP speculation bench's JSON (bench/bench_mtp.py) as a table and a reading, for papers/06 and the bench's own
print-out (docs/DESIGN.md §3g)."""
from __future__ import annotations

import pandas as pd

COLUMNS = {"level": "level", "draft_max": "d", "accept": "a", "tok_s": "tok/s", "x_no_spec": "x no spec",
           "x_plain": "x plain", "verify_ms": "verify ms", "draft_ms": "draft ms", "catchup_ms": "catch-up ms",
           "tokens_per_verify": "tokens/verify", "verify_union": "union/layer", "ssd_mb_per_token": "SSD MB/tok",
           "io_ms": "io ms/tok", "decode_hit_rate": "hit"}
PUBLISHED_ACCEPTANCE = 0.80
"""Aggregate draft acceptance llama.cpp PR #22673 reports for Qwen3.6-35B-A3B's MTP head."""


def is_mtp_bench(doc: dict) -> bool:
    """True for a bench/bench_mtp.py JSON."""
    rows = doc.get("rows") or [{}]
    return isinstance(rows[0], dict) and {"draft_max", "accept", "verify_ms", "tok_s"} <= set(rows[0])


def frame(doc: dict) -> pd.DataFrame:
    """One row per (level, d, a), with ``x_no_spec`` (tok/s over the same level's row without speculation) and
    ``x_plain`` (over plain llama.cpp in RAM without speculation), computed from the rows."""
    df = pd.DataFrame(doc["rows"])
    plain = doc.get("plain_tok_s")
    base = {r.level: r.tok_s for r in df.itertuples() if not r.draft_max}
    df["x_no_spec"] = [r.tok_s / base[r.level] if r.level in base else float("nan") for r in df.itertuples()]
    df["x_plain"] = df["tok_s"] / plain if plain else float("nan")
    df["draft_max"] = df["draft_max"].map(lambda d: d or "-")
    df["accept"] = df["accept"].map(lambda a: "-" if a is None or a != a else f"{a:g}")
    return df


def reading(doc: dict) -> list[str]:
    """Sentences on the table: the best speculative row per level against no speculation and plain, and the row at
    the published acceptance."""
    df = pd.DataFrame(doc["rows"])
    plain = doc.get("plain_tok_s")
    out = []
    for level, g in df.groupby("level", sort=False):
        base = g[g["draft_max"] == 0]
        spec = g[g["draft_max"] > 0]
        if base.empty or spec.empty:
            continue
        b = float(base["tok_s"].iloc[0])
        best = spec.loc[spec["tok_s"].idxmax()]
        at = spec[(spec["accept"] - PUBLISHED_ACCEPTANCE).abs() < 1e-9]
        s = (f"{level}: without speculation {b:.2f} tok/s; the best speculative row (d = {int(best.draft_max)}, "
             f"a = {best.accept:g}) {best.tok_s:.2f} tok/s, {best.tok_s / b:.2f}x")
        if not at.empty:
            a = at.loc[at["tok_s"].idxmax()]
            s += (f"; at the published acceptance a = {PUBLISHED_ACCEPTANCE:g} (llama.cpp PR #22673) the best is d = "
                  f"{int(a.draft_max)}, {a.tok_s:.2f} tok/s, {a.tok_s / b:.2f}x")
            if plain:
                s += f", {a.tok_s / plain:.2f}x plain llama.cpp in RAM without speculation ({plain:.2f} tok/s)"
        out.append(s + ".")
    return out


__all__ = ["COLUMNS", "PUBLISHED_ACCEPTANCE", "is_mtp_bench", "frame", "reading"]
