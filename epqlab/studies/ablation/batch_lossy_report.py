"""The batched lossy trade-off's table and reading (:func:`epqlab.studies.ablation.batch_lossy.batch_lossy`;
notebook 07's batch section, papers/07), and the same for ``bench/bench_batching.py --lossy`` JSON (speed and
bytes under a memory limit, no perplexity)."""
from __future__ import annotations

import pandas as pd

COLUMNS = {"point": "point", "knob": "knob", "setting": "setting", "batch": "batch", "ppl_ratio": "PPL / exact",
           "decode_tok_s": "tok/s (all seqs)", "speedup": "x exact b1", "ssd_mb_per_token": "SSD MB/token",
           "mb_ratio": "MB x exact b1", "union_before": "union/layer (router)", "union_after": "union/layer (used)",
           "routing_agreement": "agreement"}

BENCH_COLUMNS = {"setting": "setting", "batch": "batch", "decode_tok_s": "tok/s (all seqs)", "speedup": "x exact b1",
                 "plain_tok_s": "plain tok/s", "x_plain": "x plain", "ssd_mb_per_token": "SSD MB/token",
                 "mb_ratio": "MB x exact b1", "union_before": "union/layer (router)",
                 "union_per_layer": "union/layer (used)", "routing_agreement": "agreement", "hit_rate": "hit"}


def best_tradeoff(df: pd.DataFrame, batch: int = 4, max_ppl_ratio: float = 1.01) -> dict | None:
    """The row at ``batch`` with the highest ``speedup`` (over exact batch 1) whose ``ppl_ratio`` is within
    ``max_ppl_ratio`` (the issue's 1%), among the settings that changed some route (agreement below 1: a setting that
    changed nothing differs from exact by timing noise only), or None."""
    ok = df[(df.batch == batch) & (df.ppl_ratio <= max_ppl_ratio) & (df.knob != "exact") & (df.routing_agreement < 1.0)]
    return None if ok.empty else ok.sort_values("speedup", ascending=False).iloc[0].to_dict()


def reading(df: pd.DataFrame, batch: int = 4, max_ppl_ratio: float = 1.01) -> str:
    """Per memory point: exact batching's own gain at ``batch``, and the fastest knob setting there whose perplexity
    is within ``max_ppl_ratio`` of exact at the same batch (the issue's goal: 2x exact batch 1 at 1%)."""
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
            s += f" No lossy setting stays within {100 * (max_ppl_ratio - 1):.0f}% perplexity there."
        else:
            s += (f" The fastest setting within {100 * (max_ppl_ratio - 1):.0f}% perplexity is {r['knob']} {r['setting']}: "
                  f"{r['speedup']:.2f}x batch 1, {r['mb_ratio']:.2f}x its MB per token, union {r['union_before']:.1f} -> "
                  f"{r['union_after']:.1f}, perplexity x{r['ppl_ratio']:.4f}, routing agreement "
                  f"{r['routing_agreement']:.1%}.")
        worst = g[(g.batch == b) & (g.knob != "exact")].sort_values("ppl_ratio", ascending=False)
        if not worst.empty:
            w = worst.iloc[0]
            s += f" The largest loss there: {w.knob} {w.setting}, perplexity x{w.ppl_ratio:.4f}."
        out.append(s)
    out.append("Perplexity is over the same held-out windows at every batch size, teacher-forced, the prompts' own "
               "tokens excluded; on a random-weight model it means nothing (read bytes and speed only).")
    return " ".join(out)


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


__all__ = ["COLUMNS", "BENCH_COLUMNS", "best_tradeoff", "reading", "bench_frame", "is_bench"]
