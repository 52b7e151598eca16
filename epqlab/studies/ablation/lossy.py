"""Every lossy routing knob on one trade-off curve: quality lost against SSD bytes and time saved.

Knobs (all off by default in :class:`epqlab.Session`): top-k (``expert_used``), skip-cold (``skip_cold=tau``),
cache-aware routing (``route_bias="cache", route_delta``; colibri CACHE_ROUTE, colibri issue #258; arXiv
2412.00099) and entropy-adaptive top-k (``adaptive_k``; DOI 10.5281/zenodo.18282008, TensorRT-LLM PR #10672).
Each row is one Session at one arena decoding the held-out texts teacher-forced, one token per
``llama_decode`` (``n_batch = n_ubatch = 1``), so every lossy knob acts on every scored token (they act on
decode steps only); perplexity, SSD bytes, hit rate, routing agreement and decode tok/s all come from those
decode steps. The baseline (knob ``exact``) decodes the same way at the same arena.
"""
from __future__ import annotations

import math
import sys
import time

from ...engine.perplexity import perplexity
from ...engine.session import Session
from ...layout import inspect
from ...models import default_model
from ..paired import ratio_interval
from .grid import memory_points
from .topk import resolve_texts

DEFAULT_ADAPTIVE = (True, ((1.6, 1.9), (1, 2, 3)))
"""The published adaptive-k rule, and one whose thresholds sit inside the default model's router entropies (its
8-expert routers are flat: H is above the published 1.2 nats on nearly every token, so the published rule keeps k)."""


def knob_settings(own_k: int, ks=(1, 2), taus=(0.3,), deltas=(0.02, 0.05, 0.1), adaptive=DEFAULT_ADAPTIVE) -> list:
    """``[(knob, setting label, Session kwargs)]``: ``exact`` first, then each knob's settings (top-k values
    at or above ``own_k`` are left out: they are not a saving).

    Raises:
        ValueError: a tau or delta that is negative or not finite.
    """
    out = [("exact", "off", {})]
    out += [("top-k", f"k={int(k)}", {"expert_used": int(k)}) for k in ks if int(k) < own_k]
    for name, vals in (("tau", taus), ("delta", deltas)):
        for v in vals:
            if not math.isfinite(float(v)) or float(v) < 0:
                raise ValueError(f"{name} values must be finite and >= 0, got {v}")
    out += [("skip-cold", f"tau={float(t):g}", {"skip_cold": float(t)}) for t in taus]
    out += [("cache-route", f"delta={float(d):g}", {"route_bias": "cache", "route_delta": float(d)}) for d in deltas]
    for a in adaptive:
        if a is True:
            out.append(("adaptive-k", "H<0.6:1,H<1.2:2,else 4", {"adaptive_k": True}))
        else:
            thr, kk = a
            label = ",".join(f"H<{t:g}:{k}" for t, k in zip(thr, kk)) + f",else {kk[-1]}"
            out.append(("adaptive-k", label, {"adaptive_k": (tuple(thr), tuple(kk))}))
    return out


DEFAULT_POLICY = "fnu"
"""The study's eviction policy. With LRU at a 25% arena of the default model (30 layers x 8 experts, top-3: 60
slots) each token's 90 loads evict every expert of a layer before the layer comes round again, so nothing is
resident at its router (hit rate 0) and cache-aware routing has nothing to substitute: its rows would be exact
for want of candidates. ``fnu`` keeps the experts a layer is predicted to use next (docs/DESIGN.md §5b)."""


def lossy_knobs(model=None, *, arenas=(0.25, 0.5), ks=(1, 2), taus=(0.3,), deltas=(0.02, 0.05, 0.1),
                adaptive=DEFAULT_ADAPTIVE, texts=None, text_chars: int | None = 250, ppl_n_ctx: int = 128,
                progress: bool = False, policy: str = DEFAULT_POLICY, warmup: bool = True, **session_kw):
    """One row per (arena, knob, setting): perplexity per held-out text and its ratio to exact, routing
    agreement, SSD MB/token, decode tok/s and hit rate, from teacher-forced decode steps.

    Args:
        model: GGUF path (MoE); None = the default model.
        arenas: arenas (fractions of all expert slots, or bytes; :func:`~epqlab.studies.ablation.grid.memory_points`).
        ks, taus, deltas, adaptive: the knobs' settings (:func:`knob_settings`).
        texts, text_chars: evaluation texts (:func:`epqlab.studies.ablation.topk.resolve_texts`); [] = no
            perplexity (a synthesized model: only bytes and speed mean something), the held-out prose is
            then still fed teacher-forced for the bytes, hit rate and speed.
        ppl_n_ctx: perplexity window, tokens.
        progress: one line per row on stderr.
        policy: eviction policy of every row (:data:`DEFAULT_POLICY`).
        warmup: before the first row, decode a few tokens in an untimed Session, so the first row's speed is not
            charged with the process's one-time costs (loading llama.cpp, the model file's first reads).
        **session_kw: further :class:`epqlab.Session` arguments (e.g. ``n_threads``).

    Returns:
        pandas.DataFrame with ``point``, ``knob``, ``setting``, ``ppl_<text>`` and ``ppl_ratio_<text>`` per text,
        ``ppl_ratio_mean`` (geometric mean of the ratios), ``ppl_ratio_tokens`` with ``ppl_ratio_low`` /
        ``ppl_ratio_high`` (the ratio over all ``scored_tokens`` tokens of the texts, with its paired 95% interval
        against exact's NLL on the same tokens: :func:`epqlab.studies.paired.ratio_interval`), ``routing_agreement`` (share of (token, layer,
        slot) choices computed with the router's own expert; top-k: k / own k), ``ssd_mb_per_token``
        (pager bytes read per decoded token, 1e6 bytes), ``not_read_mb_per_token`` (router-chosen
        non-resident experts a knob did not read), ``decode_tok_s``, ``hit_rate``, ``mean_k`` (experts
        computed per token and layer), ``tokens``, ``seconds``. Timings are wall clock on a possibly shared box.

    Raises:
        ValueError: bad settings or texts; a knob's own refusals (:class:`epqlab.Session`).
    """
    import numpy as np
    import pandas as pd

    if model is None:
        model = default_model(progress=False)
    lay = inspect(model)
    own = lay.n_expert_used
    settings = knob_settings(own, ks, taus, deltas, adaptive)
    txt = resolve_texts(texts, text_chars)
    feed = resolve_texts(["prose"], text_chars)  # fed without a perplexity when no texts are asked for
    points = memory_points(lay, arenas=list(arenas), k=None)
    session_kw = {**session_kw, "policy": policy}
    if warmup and points:
        with Session(model, n_batch=1, n_ubatch=1, n_ctx=max(256, ppl_n_ctx), **points[0].session_kwargs(),
                     **session_kw) as s:
            perplexity(s, next(iter((txt or feed).values()))[:64], n_ctx=ppl_n_ctx)
    rows = []
    for pt in points:
        exact = None
        for knob, label, kw in settings:
            t0 = time.perf_counter()
            with Session(model, n_batch=1, n_ubatch=1, n_ctx=max(256, ppl_n_ctx), **pt.session_kwargs(), **kw,
                         **session_kw) as s:
                ppl, t_dec, per = {}, 0.0, []
                for name, text in (txt or feed).items():
                    t1 = time.perf_counter()
                    r = perplexity(s, text, n_ctx=ppl_n_ctx, per_token=bool(txt))
                    t_dec += time.perf_counter() - t1
                    if txt:
                        ppl[name] = r.ppl
                        per.append(r.token_nll)
                st = s.stats
                mk = s.adaptive_k_per_layer()
                k_graph = s.n_expert_used
            n = max(1, st["tokens_routed"])
            row = {"point": pt.label, "knob": knob, "setting": label, **{f"ppl_{x}": v for x, v in ppl.items()}}
            if exact is None:
                exact, exact_nll = row, np.concatenate(per) if per else None
            for x in ppl:
                row[f"ppl_ratio_{x}"] = ppl[x] / exact[f"ppl_{x}"]
            row["ppl_ratio_mean"] = (math.exp(sum(math.log(row[f"ppl_ratio_{x}"]) for x in ppl) / len(ppl))
                                     if ppl else float("nan"))
            # the paired 95% interval of the ratio over every scored token of every text (epqlab.studies.paired)
            if per:  # no texts: no perplexity column at all
                row["ppl_ratio_tokens"], row["ppl_ratio_low"], row["ppl_ratio_high"] = (
                    ratio_interval(np.concatenate(per), exact_nll) if knob != "exact" else (1.0, 1.0, 1.0))
                row["scored_tokens"] = int(sum(len(x) for x in per))
            if knob == "top-k":
                agree = k_graph / own
            else:
                agree = st["routing_agreement"]
            row.update(routing_agreement=agree, ssd_mb_per_token=st["bytes_read"] / n / 1e6,
                       not_read_mb_per_token=st["lossy_bytes_saved"] / n / 1e6,
                       decode_tok_s=st["tokens_routed"] / t_dec if t_dec > 0 else 0.0, hit_rate=st["hit_rate"],
                       mean_k=float(np.nanmean(mk)) if np.isfinite(mk).any() else float(k_graph),
                       tokens=int(st["tokens_routed"]), seconds=time.perf_counter() - t0)
            rows.append(row)
            if progress:
                q = f"PPL x{row['ppl_ratio_mean']:.4f}" if ppl else "PPL not scored (no texts)"
                print(f"[lossy] {pt.label} {knob} {label}: {q}, "
                      f"{row['ssd_mb_per_token']:.3f} MB/token, {row['decode_tok_s']:.1f} tok/s", file=sys.stderr, flush=True)
    df = pd.DataFrame(rows)
    df.attrs.update(model=str(lay.path), own_k=own, n_expert=lay.n_expert, arenas=[str(a) for a in arenas],
                    points=[p.label for p in points], texts=list(txt), text_chars=text_chars, ppl_n_ctx=ppl_n_ctx,
                    session_kw=dict(session_kw))
    return df


__all__ = ["lossy_knobs", "knob_settings", "DEFAULT_ADAPTIVE", "DEFAULT_POLICY"]
