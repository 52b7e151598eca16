"""The lossy knobs on batched decode: perplexity against aggregate speed and bytes per generated token, per batch
size (``epqlab ablate lossy --batches``; notebooks/07_lossy_knobs.ipynb).

Batched decode reads, per layer and step, the union of the experts its sequences' tokens chose; exact batching
cannot read less than that union (docs/DESIGN.md §3d). The knobs that act on a step's union
(docs/DESIGN.md §3a'): batch-aware routing (``route_bias="batch"``; after Opportunistic Expert Activation, arXiv
2511.02237), the union budget (``expert_budget``; colibri EXPERT_BUDGET, colibri issue #220; MoE-Spec arXiv
2602.16052), and cache-aware routing (``route_bias="cache"``) for comparison. Every row feeds the same windows of
the held-out texts (:func:`epqlab.studies.batching.forced_sequences`, never calibrated on) teacher-forced, b
sequences per step, so its perplexity is that of the same tokens at every batch size and knob.
"""
from __future__ import annotations

import math
import statistics
import sys
from collections.abc import Sequence

import pandas as pd

from ...engine.session import Session
from ...layout import inspect
from ...models import default_model
from ..batching import BATCH_SIZES, measure
from .batch_lossy_report import best_tradeoff
from ..paired import ratio_interval
from .grid import memory_points


def batch_settings(own_k: int, deltas: Sequence[float] = (0.05, 0.2), budgets: Sequence[int] | None = None) -> list:
    """``[(knob, setting label, Session kwargs)]``: ``exact`` first, then batch-aware routing per margin, then the
    union budget per N (default ``own_k + 1`` and ``2 * own_k``: between one token's experts and two tokens').

    Raises:
        ValueError: a margin outside 0..1 or a budget < 1."""
    budgets = (own_k + 1, 2 * own_k) if budgets is None else budgets
    out = [("exact", "off", {})]
    for d in deltas:
        if not (math.isfinite(float(d)) and 0 <= float(d) <= 1):
            raise ValueError(f"margins must be router probabilities in 0..1, got {d}")
        out.append(("batch-route", f"delta={float(d):g}", {"route_bias": "batch", "route_delta": float(d)}))
    for n in budgets:
        if int(n) < 1:
            raise ValueError(f"budgets must be >= 1 distinct experts, got {n}")
        out.append(("expert-budget", f"N={int(n)}", {"expert_budget": int(n)}))
    return out


def batch_lossy(model=None, batch_sizes: Sequence[int] = BATCH_SIZES, settings: list | None = None, *,
                arenas: Sequence | None = (0.5,), windows: int = 8, n_predict: int = 24, prompt_tokens: int = 16,
                n_ctx: int = 256, score: bool = True, progress: bool = False, **session_kw) -> pd.DataFrame:
    """One row per (memory point, knob setting, batch size b): ``windows`` held-out windows decoded teacher-forced
    in ceil(windows / b) batches of b sequences.

    Args:
        model: a MoE GGUF (default: the embedded default model).
        batch_sizes: sequences per step; each must divide ``windows`` (so every b scores the same tokens).
        settings: :func:`batch_settings` rows (default: its defaults for the model's top-k).
        arenas: memory points (:func:`~epqlab.studies.ablation.grid.memory_points`).
        windows, n_predict, prompt_tokens: windows of prompt + forced tokens (:func:`epqlab.studies.batching.measure`).
        score: compute the perplexity (False on a random-weight model: only bytes and speed mean something).
        **session_kw: more :class:`epqlab.Session` arguments (``n_threads``, ``policy``).

    Returns:
        DataFrame: ``point``, ``knob``, ``setting``, ``batch``, ``ppl`` (exp of the mean NLL of the forced tokens
        fed from decode steps) and ``ppl_ratio`` (over exact's at the same point and b) with ``ppl_ratio_low`` /
        ``ppl_ratio_high`` (its paired 95% interval over the ``scored_tokens``: :mod:`epqlab.studies.paired`), ``decode_tok_s`` (aggregate:
        forced tokens / decode seconds, all batches), ``speedup`` (over exact at b = 1, same point),
        ``ssd_mb_per_token`` (decode reads per generated token, 1e6 bytes) and ``mb_ratio`` (over exact at b = 1),
        ``union_before`` / ``union_after`` (distinct experts per layer and step: the router's, and what the step used),
        ``routing_agreement``, ``hit_rate``. Timings are wall clock on a possibly shared box.

    Raises:
        ValueError: a batch size < 1 or not dividing ``windows``; the settings' and memory points' errors.
    """
    model = str(model or default_model(progress=False))
    sizes = sorted({int(b) for b in batch_sizes})
    if not sizes or sizes[0] < 1 or any(windows % b for b in sizes):
        raise ValueError(f"batch sizes must be >= 1 and divide windows={windows}, got {list(batch_sizes)}")
    lay = inspect(model)
    settings = settings if settings is not None else batch_settings(lay.n_expert_used)
    rows, nlls = [], {}  # (point, knob, setting, b) -> every scored token's NLL, in the same order at every row
    for pt in memory_points(lay, arenas, None):
        for knob, label, kw in settings:
            for b in sizes:
                with Session(model, n_seq_max=b, n_ctx=n_ctx, **pt.session_kwargs(), **kw, **session_kw) as s:
                    per = nlls.setdefault((pt.label, knob, label, b), [])
                    parts = [measure(s, b, n_predict, prompt_tokens=prompt_tokens, score=score, offset=o, token_nll=per)
                             for o in range(0, windows, b)]
                n_tok = sum(p["n_gen"] for p in parts)
                dec_s = sum(p["n_gen"] / p["decode_tok_s"] for p in parts if p["decode_tok_s"])
                nll_n = sum(p.get("nll_tokens", 0) for p in parts)
                row = {"point": pt.label, "knob": knob, "setting": label, "batch": b,
                       "ppl": math.exp(sum(p["nll"] * p["nll_tokens"] for p in parts) / nll_n) if score and nll_n
                       else float("nan"),
                       "decode_tok_s": n_tok / dec_s if dec_s else 0.0,
                       "ssd_mb_per_token": statistics.fmean(p["ssd_mb_per_token"] for p in parts),
                       "union_before": statistics.fmean(p.get("union_before", p["union_per_layer"]) for p in parts),
                       "union_after": statistics.fmean(p["union_per_layer"] for p in parts),
                       "routing_agreement": statistics.fmean(p.get("routing_agreement", 1.0) for p in parts),
                       "hit_rate": statistics.fmean(p["hit_rate"] for p in parts), "tokens": n_tok}
                rows.append(row)
                if progress:
                    q = f"ppl {row['ppl']:.3f}" if score else "ppl not scored"
                    print(f"[batch-lossy] {pt.label} {knob} {label} b={b}: {q}, "
                          f"{row['decode_tok_s']:.1f} tok/s, {row['ssd_mb_per_token']:.2f} MB/token, union "
                          f"{row['union_before']:.2f} -> {row['union_after']:.2f}", file=sys.stderr, flush=True)
    df = pd.DataFrame(rows)
    ex = df[df.knob == "exact"].set_index(["point", "batch"])
    ex1 = df[(df.knob == "exact") & (df.batch == sizes[0])].set_index("point")
    df["ppl_ratio"] = [r.ppl / ex.loc[(r.point, r.batch), "ppl"] for r in df.itertuples()]
    # its paired 95% interval against exact at the same point and b, token by token (epqlab.studies.paired)
    ex_label = df[df.knob == "exact"].setting.iloc[0] if (df.knob == "exact").any() else None
    iv = [ratio_interval(nlls[(r.point, r.knob, r.setting, r.batch)], nlls[(r.point, "exact", ex_label, r.batch)])
          if score and ex_label is not None and r.knob != "exact" and nlls[(r.point, r.knob, r.setting, r.batch)]
          else ((1.0,) * 3 if score else (float("nan"),) * 3) for r in df.itertuples()]
    df["ppl_ratio_low"], df["ppl_ratio_high"] = [x[1] for x in iv], [x[2] for x in iv]
    df["scored_tokens"] = [len(nlls[(r.point, r.knob, r.setting, r.batch)]) for r in df.itertuples()]
    df["speedup"] = [r.decode_tok_s / ex1.loc[r.point, "decode_tok_s"] for r in df.itertuples()]
    df["mb_ratio"] = [r.ssd_mb_per_token / ex1.loc[r.point, "ssd_mb_per_token"]
                      if ex1.loc[r.point, "ssd_mb_per_token"] else float("nan") for r in df.itertuples()]
    df.attrs.update(model=model, batch_sizes=sizes, windows=windows, n_predict=n_predict,
                    n_expert_used=lay.n_expert_used, n_expert=lay.n_expert, session_kw=dict(session_kw))
    return df


__all__ = ["batch_lossy", "batch_settings", "best_tradeoff"]
