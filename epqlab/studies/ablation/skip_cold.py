"""The lossy skip-cold knob measured: perplexity and SSD MB/token against its threshold tau.

``Session(skip_cold=tau)`` (native/engine/hook.h) skips, in single-token decode steps, a selected expert that
is not resident and whose router weight is below tau; it computes on zeros instead. Perplexity is
therefore evaluated here one token per ``llama_decode`` (``n_batch = n_ubatch = 1``: teacher forcing
through decode steps), so the knob applies to every scored token; the SSD bytes and skip counts come
from the same runs. The baseline row (``tau = None``: knob off) uses the same single-token decoding,
because batched and single-token decodes need not give bit-identical logits in llama.cpp. Speed and
SSD MB/token of generation (prompts, greedy) come from :func:`epqlab.studies.ablation.grid.measure_prompts`, as in
the top-k sweep, so both sweeps sit on one trade-off curve.
"""
from __future__ import annotations

import sys
import time

from ...layout import inspect
from ...engine.perplexity import perplexity
from .grid import measure_prompts, memory_points, summarize
from .topk import resolve_prompts, resolve_texts
from ...engine.session import Session
from ...models import default_model
from ..sweeps import map_points


def skip_cold(model=None, taus=(0.0, 0.1, 0.3, 0.6, 1.0), *, arena=0.25, budget=None, k: int | None = None,
              texts=None, text_chars: int | None = None, ppl_n_ctx: int = 512, prompts=None, n_predict: int = 32,
              repeats: int = 1, n_ctx: int = 1024, progress: bool = False, executor=None, **session_kw):
    """Perplexity and SSD reads per token at each skip-cold threshold, at one memory point.

    Args:
        model: GGUF path (MoE); None = the default model.
        taus: thresholds (router weights, >= 0); the knob-off baseline (``tau`` None) is always the
            first row.
        arena: arena (fraction of all expert slots, or bytes), or ``budget``: a RAM budget instead
            (:func:`epqlab.studies.ablation.grid.memory_points`).
        k: top-k (None = the model's own).
        texts, text_chars: evaluation texts (:func:`epqlab.studies.ablation.topk.resolve_texts`).
        ppl_n_ctx: perplexity window (tokens).
        prompts, n_predict, repeats: generation runs per tau (:func:`epqlab.studies.ablation.topk.resolve_prompts`;
            ``repeats`` = 0 skips them), in sessions of ``n_ctx`` tokens.
        progress: one line per (tau, text) on stderr.
        executor: a :class:`concurrent.futures.Executor` to run the taus on (one per process at a time,
            :func:`epqlab.studies.sweeps.map_points`); default None runs them serially here: the tok/s columns
            are timings, which parallel runs on one box spoil (see :mod:`epqlab.studies.sweeps`).
        **session_kw: further :class:`epqlab.Session` arguments.

    Returns:
        pandas.DataFrame, one row per tau (None first): ``tau``, ``point``, ``k``, ``ppl_<text>`` per
        text, ``ppl_mean`` (geometric mean over texts), and from those teacher-forced decode steps
        ``ppl_ssd_mb_per_token`` (pager bytes read per token, 1e6 bytes), ``ppl_skipped_per_token``
        (experts skipped per token), ``ppl_requests_per_token``, ``ppl_hit_rate``, ``ppl_tokens``;
        then the :func:`~epqlab.studies.ablation.grid.summarize` fields of the generation runs (decode tok/s,
        ``ssd_mb_per_token``, ...) with ``skipped_per_token`` (skipped experts per decoded token), and
        ``seconds``.

    Raises:
        ValueError: a negative or non-finite tau, bad texts.
    """
    import math

    import pandas as pd

    if model is None:
        model = default_model(progress=False)
    lay = inspect(model)
    ts = [float(t) for t in taus]
    for t in ts:
        if not math.isfinite(t) or t < 0:
            raise ValueError(f"skip-cold thresholds must be finite router weights >= 0, got {t}")
    txt = resolve_texts(texts, text_chars)
    if not txt:
        raise ValueError("skip_cold measures perplexity: give at least one text (e.g. texts=['prose'])")
    pt = memory_points(lay, arenas=None if budget is not None else [arena],
                       budgets=[budget] if budget is not None else None, k=k)[0]
    pr = resolve_prompts(prompts) if repeats else []

    common = dict(model=model, k=k, lay_k=lay.n_expert_used, point=pt.label, point_kw=pt.session_kwargs(), txt=txt,
                  ppl_n_ctx=ppl_n_ctx, pr=pr, n_predict=n_predict, repeats=repeats, n_ctx=n_ctx, progress=progress,
                  session_kw=session_kw)
    rows = map_points(_tau_row, [dict(tau=tau, **common) for tau in [None] + ts], executor)
    df = pd.DataFrame(rows)
    df.attrs.update(model=str(lay.path), point=pt.label, k=k or lay.n_expert_used, texts=list(txt), ppl_n_ctx=ppl_n_ctx,
                    text_chars=text_chars, prompts=[p.id for p in pr], n_predict=int(n_predict),
                    repeats=int(repeats), session_kw=dict(session_kw))
    return df


def _tau_row(model, tau, k, lay_k, point, point_kw, txt, ppl_n_ctx, pr, n_predict, repeats, n_ctx, progress,
             session_kw) -> dict:
    """One row of :func:`skip_cold` (module level: executors pickle it)."""
    import math

    kw = {**session_kw, **point_kw}
    t0 = time.perf_counter()
    with Session(model, expert_used=k, skip_cold=tau, n_batch=1, n_ubatch=1, n_ctx=max(256, ppl_n_ctx), **kw) as s:
        ppl = {}
        for name, text in txt.items():
            ppl[name] = perplexity(s, text, n_ctx=ppl_n_ctx).ppl
            if progress:
                print(f"[skip_cold] tau={tau} {name}: PPL {ppl[name]:.4f}", file=sys.stderr, flush=True)
        st = s.stats
    n = max(1, st["tokens_routed"])
    row = {"tau": tau, "point": point, "k": k or lay_k, **{f"ppl_{x}": v for x, v in ppl.items()},
           "ppl_mean": math.exp(sum(math.log(v) for v in ppl.values()) / len(ppl)),
           "ppl_ssd_mb_per_token": st["bytes_read"] / n / 1e6, "ppl_skipped_per_token": st["cold_skipped"] / n,
           "ppl_requests_per_token": st["requests"] / n, "ppl_hit_rate": st["hit_rate"],
           "ppl_tokens": int(st["tokens_routed"])}
    if pr:
        rs, skipped, passes = [], 0, 0
        for _ in range(int(repeats)):  # each repeat a fresh session (cold arena), as in the other sweeps
            with Session(model, expert_used=k, skip_cold=tau, n_ctx=n_ctx, **kw) as s:
                m = measure_prompts(s, pr, n_predict)
                rs.append(m)
                skipped += s.stats["cold_skipped"]  # only single-token passes skip
                passes += m["decode_passes"]
        row.update(summarize(rs))
        row["skipped_per_token"] = skipped / max(1, passes)
    row["seconds"] = time.perf_counter() - t0
    return row


__all__ = ["skip_cold"]
