"""``epqlab tune``: the fastest setting whose perplexity cost stays within a quality budget.

:func:`tune` takes the budget and the exact candidates from :func:`epqlab.studies.plan.plan` (every simulated
eviction policy worth running x prefetch off / the predictor, at the recommended budget or the one given) and
adds the knobs that trade quality (:func:`epqlab.studies.ablation.lossy.knob_settings`: top-k below the model's,
cache-aware routing with δ, entropy-adaptive top-k; with ``batch > 1`` also the union budget ``expert_budget``).
Every candidate runs the same measurement, through :func:`epqlab.sweep` (so ``executor=`` can hand the grid to a
Dask cluster), ``repeats`` times interleaved: ``batch`` sequences, each teacher-forced on its own window of the
held-out text's second half (the calibration decoded the first), one token per decode step, in one
:class:`epqlab.Session` at the budget; aggregate decode tok/s, and the negative log-likelihood of every forced
token under the logits it was fed from (:class:`epqlab.engine.batch.Request` ``score``), so speed and quality come
from the same decode steps.

The rule (stated in :attr:`Tuning.rule`): quality cost = ppl / ppl(exact) - 1 on those tokens (exact settings cost
0: paging does not change a logit), with a 95% interval from the paired per-token NLL differences; a LOSSY setting
qualifies when the interval's upper end is at most ``quality`` and ``quality`` > 0 (at 0 nothing lossy is
allowed, even one whose perplexity came out lower: on a few hundred tokens that is noise); the winner is the fastest qualifying setting by median tok/s, but a LOSSY winner must beat the fastest
exact setting by more than the speed noise (the larger relative spread, max-min over median, of the two);
otherwise the exact setting wins.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from ..data import heldout_texts
from ..engine import run_stats
from ..engine.batch import Batcher, Request
from ..engine.session import Session
from ..errors import EpqlabError
from ..layout import inspect
from ..units import fmt_bytes, parse_bytes
from .ablation.lossy import DEFAULT_ADAPTIVE, knob_settings
from .paired import paired_cost
from .sweeps import sweep
from .plan import PlanInputError, plan as make_plan, split_text

RULE = __doc__.split("The rule (stated in :attr:`Tuning.rule`): ", 1)[1].strip()
MAX_QUALITY = 0.5  # a quality budget above 50% perplexity is not a budget


def parse_quality(q) -> float:
    """``"0.5%"`` -> 0.005, ``0.01`` -> 0.01. Raises PlanInputError outside [0, 0.5] or unreadable."""
    try:
        v = float(str(q).strip().rstrip("%")) / (100.0 if str(q).strip().endswith("%") else 1.0)
    except ValueError:
        raise PlanInputError(f"--quality {q!r} is not a number; write e.g. 0.5% or 0.005") from None
    if not (0.0 <= v <= MAX_QUALITY) or math.isnan(v):
        raise PlanInputError(f"--quality {q!r} is outside 0..{MAX_QUALITY:.0%} (a perplexity increase, e.g. 0.5%)")
    return v


def tune_point(model, ram_budget, label, lossy, kw, prompt, windows, n, batch, n_ctx=None, n_threads=None):
    """One candidate, in a worker process: ``batch`` sequences teacher-forced on ``windows`` (texts), ``n`` tokens
    each. Returns decode tok/s (aggregate over the batch's decode steps), ppl of the forced tokens, SSD MB per
    token and the decode hit rate."""

    extra = {k: v for k, v in (("n_ctx", n_ctx), ("n_threads", n_threads)) if v}
    with Session(model, ram_budget=ram_budget, n_seq_max=int(batch), **extra, **kw) as s:
        base = s.batch_requests([prompt] * int(batch), n, 0.0)
        reqs = [Request(r.tokens, n, r.sampler, index=i, forced=s.tokenize(windows[i], add_special=False)[:n], score=True)
                for i, r in enumerate(base)]
        b = Batcher(s, int(batch))
        with s.decoder.lock:
            c0, t0 = run_stats.counters(s), time.perf_counter()
            b.run(reqs)
            st = run_stats.batch_stats(s, b, reqs, c0, run_stats.counters(s), time.perf_counter() - t0)
    nll = [x for r in reqs for x in (r.nll or [])]
    if not nll:
        raise EpqlabError(f"{label}: no token was scored")
    return {"decode_tok_s": float(st.get("decode_tok_s") or 0.0), "ppl": math.exp(sum(nll) / len(nll)), "nll": nll,
            "scored_tokens": len(nll), "ssd_mb_per_token": float(st.get("ssd_bytes_per_token") or 0.0) / 1e6,
            "hit_rate": float(st.get("decode_hit_rate") or st.get("hit_rate") or 0.0)}


@dataclass
class Tuning:
    """What :func:`tune` tried and what it picked. ``frame``: one row per candidate (median tok/s, min, max, ppl,
    ``cost`` = ppl / ppl(exact) - 1, ``lossy``, ``qualifies``, ``pareto``); ``best``: the winning row (a dict with
    ``session_kwargs``); ``why``: the reason in words; ``plan``: the :class:`~epqlab.studies.plan.Plan` it started from."""
    model: str
    quality: float
    budget: int
    batch: int
    frame: object
    best: dict
    why: str
    plan: object
    rule: str = RULE
    points: list = field(default_factory=list)


def candidates(plan_obj, budget: int, own_k: int, batch: int) -> list[tuple[str, bool, dict]]:
    """``[(label, lossy, Session kwargs)]`` at ``budget``: the plan's exact rows there, then the lossy knobs with the
    best simulated policy and prefetch off (cache routing and adaptive-k are exclusive with prefetch; top-k also
    runs with the predictor when the plan's prefetch row exists)."""
    rows = [r for r in plan_obj.rows if r.budget == budget]
    out, seen = [], set()
    for r in rows:
        kw = {k: v for k, v in r.session_kwargs().items() if k != "ram_budget"}
        label = f"{r.policy}, prefetch {r.prefetch}"
        if label not in seen:
            seen.add(label)
            out.append((label, False, kw))
    best_pol = max(rows, key=lambda r: r.decode_tok_s).policy if rows else "lru"
    ks = tuple(k for k in (own_k - 1, own_k - 2) if k >= 1)
    for knob, setting, kw in knob_settings(own_k, ks=ks, taus=(), deltas=(0.02, 0.05, 0.1), adaptive=DEFAULT_ADAPTIVE):
        if knob == "exact":
            continue
        out.append((f"{knob} {setting}, {best_pol}", True, {"policy": best_pol, **kw}))
        pf = next((r for r in rows if r.prefetch != "off" and r.policy == best_pol), None)
        if knob == "top-k" and pf is not None:
            pkw = {k: v for k, v in pf.session_kwargs().items() if k != "ram_budget"}
            out.append((f"{knob} {setting}, {best_pol}, prefetch {pf.prefetch}", True, {**pkw, **kw}))
    if batch > 1:
        for n in sorted({max(own_k, int(own_k * batch * f)) for f in (0.5, 0.75)}):
            out.append((f"expert_budget {n}, {best_pol}", True, {"policy": best_pol, "expert_budget": n}))
    return out


def tune(model, quality="0.5%", *, budget=None, batch: int = 1, text: str | None = None, n: int = 48,
         repeats: int = 3, executor=None, n_threads: int | None = None, n_ctx: int | None = None,
         plan_obj=None, progress: bool = False) -> Tuning:
    """Pick the fastest setting within a perplexity budget (module docstring: the candidates and the rule).

    Args:
        model: a MoE GGUF path.
        quality: the perplexity increase allowed, ``"0.5%"`` or 0.005 (0..50%).
        budget: the RAM budget (bytes or "8GiB"); default the plan's recommended one.
        batch: sequences decoded together (>= 1); above 1 the union budget ``expert_budget`` joins the knobs.
        text: its first half calibrates the plan, its second half is decoded and scored (default the held-out prose).
        n: tokens per sequence per run (>= 16).
        repeats: runs per candidate, interleaved (>= 1).
        executor: a :class:`concurrent.futures.Executor` for :func:`epqlab.sweep` (e.g. a Dask client's); default
            one local worker process (timings on one box must not run side by side).
        plan_obj: a :class:`~epqlab.studies.plan.Plan` of this model to start from (else one is made).

    Returns:
        :class:`Tuning`.

    Raises:
        PlanInputError: quality outside 0..50%, batch < 1, repeats < 1, a text too short; what
            :func:`~epqlab.studies.plan.plan` raises.
    """
    import pandas as pd

    q = parse_quality(quality)
    if int(batch) < 1 or int(repeats) < 1:
        raise PlanInputError(f"batch and repeats must be >= 1, got batch={batch}, repeats={repeats}")
    lay = inspect(model)
    if text is None:
        text = heldout_texts()["prose"]
    p = plan_obj or make_plan(model, budget if budget is not None else "auto", text=text, n=n, n_threads=n_threads,
                              n_ctx=n_ctx)
    B = parse_bytes(budget) if budget is not None else p.best.budget
    if B not in {r.budget for r in p.rows}:
        raise PlanInputError(f"the plan has no rows at {B} bytes; plan with that budget first")
    _, second = split_text(text)
    words = second.split()
    per = max(1, len(words) // int(batch))
    windows = [" ".join(words[i * per:(i + 1) * per]) for i in range(int(batch))]
    cands = candidates(p, B, lay.n_expert_used, int(batch))
    points = [dict(model=str(lay.path), ram_budget=B, label=lab, lossy=lossy, kw=kw, prompt=p.prompt, windows=windows,
                   n=int(n), batch=int(batch), n_ctx=n_ctx, n_threads=n_threads)
              for _ in range(int(repeats)) for lab, lossy, kw in cands]
    df = sweep(tune_point, points, executor=executor, progress=progress, desc="tune")
    g = df.groupby("label", sort=False)
    frame = pd.DataFrame({
        "lossy": g["lossy"].first(), "decode_tok_s": g["decode_tok_s"].median(), "tok_s_min": g["decode_tok_s"].min(),
        "tok_s_max": g["decode_tok_s"].max(), "ppl": g["ppl"].median(), "ssd_mb_per_token": g["ssd_mb_per_token"].median(),
        "hit_rate": g["hit_rate"].median(), "scored_tokens": g["scored_tokens"].first()}).reset_index()
    frame["kwargs"] = [next(kw for lab, _, kw in cands if lab == x) for x in frame.label]
    nll = {lab: next(r["nll"] for r in df.to_dict(orient="records") if r["label"] == lab) for lab in frame.label}
    frame, top, why = pick(frame, nll, q)
    best = {"label": top.label, "lossy": bool(top.lossy), "decode_tok_s": float(top.decode_tok_s), "cost": float(top.cost),
            "cost_interval": [float(top.cost_low), float(top.cost_high)], "session_kwargs": {"ram_budget": B, **top.kwargs}}
    return Tuning(model=str(lay.path), quality=q, budget=B, batch=int(batch), frame=frame, best=best, why=why, plan=p,
                  points=df.to_dict(orient="records"))


def pick(frame, nll: dict, q: float):
    """The rule of the module docstring on a frame of candidates (columns ``label``, ``lossy``, ``decode_tok_s``,
    ``tok_s_min``, ``tok_s_max``) and each candidate's per-token NLL (``nll[label]``, nats, the same forced tokens):
    adds ``cost``, ``cost_low``, ``cost_high`` (:func:`paired_cost` against the first exact candidate), ``noise``,
    ``qualifies`` (exact, or LOSSY with ``cost_high <= q`` and ``q > 0``) and ``pareto``; returns
    ``(frame sorted by tok/s, winning row, why)``."""
    frame = frame.copy()
    ref = nll[frame[~frame.lossy].label.iloc[0]]
    costs = [paired_cost(nll[lab], ref) if lossy else (0.0, 0.0, 0.0) for lab, lossy in zip(frame.label, frame.lossy)]
    frame["cost"], frame["cost_low"], frame["cost_high"] = zip(*costs) if costs else ((), (), ())
    frame["noise"] = (frame.tok_s_max - frame.tok_s_min) / frame.decode_tok_s
    frame["qualifies"] = (~frame.lossy) | ((frame.cost_high <= q) & (q > 0))
    frame = frame.sort_values("decode_tok_s", ascending=False).reset_index(drop=True)
    frame["pareto"] = [bool(not ((frame.decode_tok_s > r.decode_tok_s) & (frame.cost_high <= r.cost_high)).any())
                       for r in frame.itertuples()]
    best_exact = frame[~frame.lossy].iloc[0]
    top = frame[frame.qualifies].iloc[0]
    noise = max(float(top.noise), float(best_exact.noise))
    if bool(top.lossy) and top.decode_tok_s <= best_exact.decode_tok_s * (1 + noise):
        why = (f"the fastest LOSSY setting within {q:.2%} ({top.label}: {top.decode_tok_s:.2f} tok/s, cost {top.cost:+.2%}) "
               f"is not faster than the exact {best_exact.label} ({best_exact.decode_tok_s:.2f}) by more than the speed "
               f"noise ({noise:.1%}): exact wins")
        top = best_exact
    elif bool(top.lossy):
        why = (f"LOSSY {top.label} is {top.decode_tok_s / best_exact.decode_tok_s:.2f}x the fastest exact setting "
               f"({best_exact.label}) at a perplexity cost of {top.cost:+.2%} (95% interval {top.cost_low:+.2%} .. "
               f"{top.cost_high:+.2%}, within the budget {q:.2%}), beyond the speed noise ({noise:.1%})")
    else:
        why = (f"the exact {top.label} is the fastest setting that qualifies (no LOSSY setting is faster with its "
               f"95% cost interval within {q:.2%})")
    return frame, top, why


def format_tuning(t: Tuning) -> str:
    """The frontier as text: every candidate by speed, LOSSY ones labelled, then the winner and why."""
    lines = [f"epqlab tune  {t.model}  at {fmt_bytes(t.budget)}, batch {t.batch}, quality budget {t.quality:.2%}",
             f"  {'setting':<44} {'tok/s':>7} {'(min-max)':>13} {'ppl':>8} {'cost':>7} {'(95% interval)':>17} {'MB/tok':>7} {'':>6} {'':>7}"]
    for r in t.frame.itertuples():
        lines.append(f"  {r.label:<44} {r.decode_tok_s:>7.2f} {f'({r.tok_s_min:.2f}-{r.tok_s_max:.2f})':>13} {r.ppl:>8.3f} "
                     f"{r.cost:>+7.2%} {f'({r.cost_low:+.1%}..{r.cost_high:+.1%})':>17} {r.ssd_mb_per_token:>7.2f} {'LOSSY' if r.lossy else 'exact':>6} "
                     f"{'pareto' if r.pareto else '':>7}{'' if r.qualifies else '  over budget'}")
    kw = t.best["session_kwargs"]
    lines += ["", f"winner: {t.best['label']}{' (LOSSY)' if t.best['lossy'] else ''}: {t.why}",
              f"  Session({t.model!r}, " + ", ".join(f"{k}={v!r}" for k, v in kw.items()) + ")",
              "rule: " + " ".join(t.rule.split())]
    return "\n".join(lines)


__all__ = ["tune", "Tuning", "tune_point", "candidates", "parse_quality", "format_tuning"]
