"""The checks of a :class:`epqlab.Session`'s paging, prefetch and thread options, in one place.

:func:`check_options` turns the Session's keyword arguments into one :class:`Options` (resolved values,
native codes) or raises ValueError naming the argument and the fix. It knows nothing of llama.cpp: the
Session passes the layout it inspected, and the checks are the same with the pager on or off.
"""
from __future__ import annotations

import numbers
import os
from dataclasses import dataclass

import numpy as np

from ..constants import MIN_N_CTX, DenseMode
from ..layout import ModelLayout
from ..paging.pager import MAX_IO_THREADS, POLICIES
from ..units import parse_bytes
from .prefetch import check_prefetch, resolve_predictor
from .speculative import check_speculative

MAX_THREADS = 512  # ggml's GGML_MAX_N_THREADS: llama.cpp's compute threadpool holds at most this many
MAX_SEQ = 256  # llama.cpp's LLAMA_MAX_SEQ (src/llama-cparams.h): sequences one context can hold
DENSE_MODES = {m.name.lower(): m for m in DenseMode}
"""``dense_weights`` name -> native code (:class:`epqlab.constants.DenseMode`)."""


@dataclass(frozen=True)
class Options:
    """Resolved Session options (see :class:`epqlab.Session` for each meaning).

    Attributes:
        policy, n_expert_used (top-k in the graph and the pager), expert_override (top-k passed to
        llama.cpp as a GGUF override, 0 = the model's), paged, dense_weights (name) and dense_mode
        (native code), skip_cold (tau or None), route_bias ("cache" or None) and route_delta (margin,
        0 with route_bias None), adaptive_k (``(thresholds, ks)`` or None; :func:`check_lossy`), expert_budget
        (distinct experts per layer and decode step, 0 = off), prefetch (name or None) and prefetch_args (mode code,
        budget bytes per layer, depth, gate: for the native hook), predictor (an ExpertPredictor, the
        oracle's route table, or None), pipeline_reads, read_segment_bytes and read_rate_limit (bytes,
        bytes/s; 0 = off), n_ctx / n_batch / n_ubatch (tokens; n_ctx per sequence), n_seq_max (sequences
        decoded side by side), n_threads / io_threads (None = default), expert_addressing (``"auto"``,
        ``"slots"`` or ``"region"``: :data:`EXPERT_ADDRESSINGS`), speculative (``"mtp"`` or None), draft_max
        (tokens drafted per verify pass, 0 when off) and draft_p_min (:func:`epqlab.engine.speculative.check_speculative`).
    """

    policy: str
    n_expert_used: int
    expert_override: int
    paged: bool
    dense_weights: str
    dense_mode: int
    skip_cold: float | None
    route_bias: str | None
    route_delta: float
    adaptive_k: tuple | None
    expert_budget: int
    prefetch: str | None
    prefetch_args: tuple
    predictor: object
    pipeline_reads: bool
    read_segment_bytes: int
    read_rate_limit: int
    n_ctx: int
    n_batch: int
    n_ubatch: int
    n_seq_max: int
    n_threads: int | None
    io_threads: int | None
    expert_addressing: str = "auto"
    io_uring: bool = False
    speculative: str | None = None
    draft_max: int = 0
    draft_p_min: float = 0.0


def _check_int(name: str, v, hi: int | None = None) -> None:
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
        raise ValueError(f"{name} must be an integer, got {v!r}")
    if int(v) < 1:
        raise ValueError(f"{name} must be >= 1, got {v}")
    if hi is not None and int(v) > hi:
        raise ValueError(f"{name} must be <= {hi}, got {v}")


EXPERT_ADDRESSINGS = ("auto", "slots", "region")
"""How llama.cpp's expert matmuls find a resident expert (docs/DESIGN.md §3f): ``"slots"`` reads the arena's
slots in place and gives the matmul the slot of each selected expert (no mmap per load or eviction);
``"region"`` maps each resident expert at its own offset of the tensor (an mmap per load, a page-table zap
per eviction); ``"auto"`` is slots where the model and options allow it (page-multiple expert slices, at least
top-k slots in every slot class, the arena prefaulted, no skip_cold), else region."""

ROUTE_BIASES = ("cache", "batch")
"""``route_bias`` values (native/engine/hook_lossy.h): ``"cache"`` = cache-aware routing (a non-resident expert may
become a resident one; colibri CACHE_ROUTE, arXiv 2412.00099); ``"batch"`` = batch-aware routing (also an expert another
token of the same decode step already reads; after arXiv 2511.02237). Both within ``route_delta``."""
ADAPTIVE_K_DEFAULT = ((0.6, 1.2), (1, 2, 4))
"""Adaptive-k's published rule: k = 1 if H < 0.6, 2 if H < 1.2, else 4 (H in nats; DOI 10.5281/zenodo.18282008,
TensorRT-LLM PR #10672)."""


def check_lossy(route_bias=None, route_delta=None, adaptive_k=None, expert_budget=None, *, skip_cold=None, prefetch=None,
                pager=True, n_expert: int | None = None, n_seq_max: int = 1) -> tuple:
    """Check the lossy routing knobs; returns ``(route_bias, route_delta, adaptive_k, expert_budget)`` resolved:
    ``route_bias`` None, ``"cache"`` or ``"batch"``, ``route_delta`` a float (0 when off), ``expert_budget`` an int
    (0 when off: at most that many distinct experts per MoE layer and decode step; colibri EXPERT_BUDGET, colibri
    issue #220; MoE-Spec arXiv 2602.16052), ``adaptive_k`` None or
    ``(thresholds tuple, ks tuple)``.

    ``adaptive_k``: None/False (off), True (:data:`ADAPTIVE_K_DEFAULT`), or ``(thresholds, ks)`` with
    increasing entropy thresholds (nats) and one more k than thresholds, each k in 1..``n_expert``
    (the model's experts per layer, when given). The graph's k (``expert_used``, default the model's
    n_expert_used) caps each k: with ``expert_used`` the two compose (``expert_used=4, adaptive_k=True``
    lets the published rule reach 4 on a top-3 model). ``route_delta`` is a difference of two router
    probabilities, so 0..1.

    ``route_bias``, ``adaptive_k`` and ``expert_budget`` rewrite every token of a decode step, one sequence's or a
    batched step's, and any one-token forward pass (docs/DESIGN.md §3a'); prompt chunks of several tokens are
    evaluated exactly. ``skip_cold`` acts on single-token steps
    only, so it is refused with ``n_seq_max > 1``.

    Raises:
        ValueError: an unknown ``route_bias``; ``route_delta`` without ``route_bias``, outside 0..1 or
            not finite; bad thresholds/ks (a k outside 1..n_expert); ``expert_budget`` not an integer >= 1; a lossy
            knob without the pager; ``skip_cold`` with ``n_seq_max > 1``; ``route_bias`` or ``expert_budget`` with
            ``skip_cold`` (both decide what happens to a non-resident expert / skip-cold would take the zeroed weights
            of dropped slots as cold) or with ``prefetch`` (their choice depends on residency, which prefetch
            changes); ``adaptive_k`` with ``skip_cold`` (skip-cold would take the zeroed weights of dropped slots as
            cold experts).
    """
    if route_bias is not None and route_bias not in ROUTE_BIASES:
        raise ValueError(f"unknown route_bias {route_bias!r}; choose one of {', '.join(map(repr, ROUTE_BIASES))} or None")
    if route_delta is not None and route_bias is None:
        raise ValueError("route_delta is the margin of route_bias ('cache' or 'batch'): give route_bias too")
    delta = 0.0
    if route_bias is not None:
        if route_delta is None:
            raise ValueError(f"route_bias={route_bias!r} needs route_delta, the router-probability margin within which "
                             "an expert already available may replace one that is not (e.g. route_delta=0.05; 0 changes "
                             "nothing)")
        if isinstance(route_delta, bool) or not isinstance(route_delta, numbers.Real) or not np.isfinite(route_delta) \
                or not 0 <= route_delta <= 1:
            raise ValueError(f"route_delta must be a router-probability margin in 0..1 (e.g. 0.05), got {route_delta!r}")
        delta = float(route_delta)
    ak = None
    if adaptive_k is True:
        ak = ADAPTIVE_K_DEFAULT
    elif adaptive_k is not None and adaptive_k is not False:
        try:
            thr, ks = adaptive_k
            thr, ks = tuple(float(t) for t in thr), tuple(ks)
        except (TypeError, ValueError):
            raise ValueError(f"adaptive_k must be True or (thresholds, ks), e.g. ((0.6, 1.2), (1, 2, 4)); got {adaptive_k!r}") from None
        if len(ks) != len(thr) + 1:
            raise ValueError(f"adaptive_k needs one more k than thresholds, got thresholds {thr} and ks {ks}")
        if any(isinstance(x, bool) or not isinstance(x, numbers.Integral) or x < 1 for x in ks):
            raise ValueError(f"adaptive_k's ks must be integers >= 1, got {ks}")
        if n_expert is not None and max(ks) > n_expert:
            raise ValueError(f"adaptive_k's ks must be in 1..{n_expert} (the model's experts per layer), got {ks}")
        if not all(np.isfinite(thr)) or any(b <= a for a, b in zip(thr, thr[1:])):
            raise ValueError(f"adaptive_k's entropy thresholds must be finite and increasing (nats), got {thr}")
        ak = (thr, tuple(int(x) for x in ks))
    budget = 0
    if expert_budget is not None:
        if isinstance(expert_budget, bool) or not isinstance(expert_budget, numbers.Integral) or expert_budget < 1:
            raise ValueError(f"expert_budget is the most distinct experts a decode step may use per MoE layer, an "
                             f"integer >= 1 (e.g. expert_budget=16; None for off), got {expert_budget!r}")
        # N >= n_expert can never drop a slot: the same as n_expert (also keeps it inside the engine's int)
        budget = min(int(expert_budget), int(n_expert) if n_expert else 2**31 - 1)
    if (route_bias is not None or ak is not None or budget) and not pager:
        raise ValueError("route_bias, adaptive_k and expert_budget rewrite the route in the pager's hook; drop pager=False")
    if n_seq_max > 1 and skip_cold is not None:
        # docs/DESIGN.md §3a: skip-cold decides per single-token step, so a batched decode step of n_seq_max
        # sequences would read exactly the bytes of exact decode
        raise ValueError(f"skip_cold acts on single-token forward passes only, so with n_seq_max={n_seq_max} "
                         "(batched decode: generate_batch, stream_batch, the server's batching) it would "
                         "silently do nothing; use n_seq_max=1 with skip_cold, or drop it (route_bias, adaptive_k "
                         "and expert_budget act on batched steps)")
    if budget and skip_cold is not None:
        raise ValueError("expert_budget and skip_cold are exclusive: skip-cold would take the budget's zeroed weights as "
                         "cold experts; measure one at a time")
    if budget and prefetch is not None:
        raise ValueError("expert_budget and prefetch are exclusive: the budget keeps resident experts first, and "
                         "prefetch changes which are resident; drop one")
    if route_bias is not None and skip_cold is not None:
        raise ValueError("route_bias and skip_cold are exclusive: both decide what happens to a selected expert that "
                         "is not resident (substitute it or compute it on zeros); measure one at a time")
    if route_bias is not None and prefetch is not None:
        raise ValueError("route_bias and prefetch are exclusive: cache-aware routing's choice depends on which experts "
                         "are resident, and prefetch changes that with its predictions")
    if ak is not None and skip_cold is not None:
        raise ValueError("adaptive_k and skip_cold are exclusive: adaptive-k zeroes the weights of dropped slots, which "
                         "skip-cold would take as cold experts; measure one at a time")
    return route_bias, delta, ak, budget


def _skip_cold_tau(lay: ModelLayout, skip_cold) -> float:
    """``skip_cold`` as τ, a router weight in 0..w_max: the weight llama.cpp multiplies an expert's output by
    (docs/DESIGN.md §3a) is a probability, times ``<arch>.expert_weights_scale`` where the model has one
    (llama.cpp's ``build_moe_ffn`` scales the weights by it), so a larger τ is no threshold at all. Raises
    ValueError for a bool (``True`` is not a threshold), a non-number or a value outside the range."""
    w_max = 1.0
    scale = (lay.metadata or {}).get(f"{lay.architecture}.expert_weights_scale")
    if isinstance(scale, numbers.Real) and np.isfinite(scale) and scale > 0:
        w_max = max(1.0, float(scale))
    if isinstance(skip_cold, bool) or not isinstance(skip_cold, numbers.Real) or not np.isfinite(skip_cold) \
            or not 0 <= skip_cold <= w_max:
        raise ValueError(f"skip_cold is the router-weight threshold tau in 0..{w_max:g} (e.g. skip_cold=0.3; None "
                         f"for off), got {skip_cold!r}")
    return float(skip_cold)


def check_options(lay: ModelLayout, *, policy="lru", expert_used=None, io_threads=None, n_threads=None, n_ctx=2048,
                  n_batch=512, n_ubatch=512, n_seq_max=1, pager=True, route_log=None, dense_weights=None, hot_experts=None,
                  skip_cold=None, prefetch=None, prefetch_budget=None, prefetch_depth=1, prefetch_min_precision=None,
                  prefetch_predictor=None, read_segment_bytes=None, pipeline_reads=None,
                  read_rate_limit=None, route_bias=None, route_delta=None, adaptive_k=None, expert_budget=None,
                  expert_addressing="auto", speculative=None, draft_max=None, draft_p_min=None, io_uring=False) -> Options:
    """Check the Session's options against the model ``lay`` (argument meanings: :class:`epqlab.Session`).

    Raises:
        ValueError: the cases listed under :class:`epqlab.Session` "Raises" (unknown policy or predictor,
            ``expert_used`` outside 1..n_expert, thread counts, exclusive knobs, a knob that needs the pager).
        RouteLogError, EpqlabError: a prefetch predictor file that is not one (:func:`~epqlab.engine.prefetch.resolve_predictor`).
    """
    if policy == "belady":
        raise ValueError("policy 'belady' needs the future routes: it runs only in Pager.replay of a recorded "
                         "route log (see epqlab.studies.ablation.eviction); a live Session takes one of " + ", ".join(POLICIES))
    if policy not in POLICIES:
        raise ValueError(f"unknown eviction policy {policy!r}; choose one of {', '.join(POLICIES)}")
    if hot_experts is not None and not (policy == "static" and pager):
        raise ValueError("hot_experts goes with policy='static' and the pager on, e.g. "
                         "Session(model, policy='static', hot_experts=epqlab.studies.ablation.hot_experts(log, n))")
    k = int(expert_used) if expert_used is not None else lay.n_expert_used
    if lay.is_moe and not 1 <= k <= lay.n_expert:
        raise ValueError(f"expert_used={k} is outside 1..{lay.n_expert} (n_expert of {lay.path.name})")
    for name, v, hi in (("n_ctx", n_ctx, None), ("n_batch", n_batch, None), ("n_ubatch", n_ubatch, None),
                        ("n_seq_max", n_seq_max, MAX_SEQ),
                        ("io_threads", 1 if io_threads is None else io_threads, MAX_IO_THREADS),
                        ("n_threads", 1 if n_threads is None else n_threads, MAX_THREADS)):
        _check_int(name, v, hi)
    if n_ctx < MIN_N_CTX:
        raise ValueError(f"n_ctx={n_ctx} is below llama.cpp's smallest context of {MIN_N_CTX} tokens per sequence (it "
                         f"would silently become {MIN_N_CTX}); give n_ctx={MIN_N_CTX} or more")
    if not lay.is_moe and expert_used is not None:
        raise ValueError(f"expert_used applies to MoE models; {lay.path.name} is dense")
    tau = None
    if skip_cold is not None:
        if not pager:
            raise ValueError("skip_cold needs the pager (it skips reads of non-resident experts); drop pager=False")
        tau = _skip_cold_tau(lay, skip_cold)
    rb, delta, ak, budget = check_lossy(route_bias, route_delta, adaptive_k, expert_budget, skip_cold=tau, prefetch=prefetch, pager=bool(pager),
                                n_expert=lay.n_expert if lay.is_moe else None, n_seq_max=int(n_seq_max))
    pf = check_prefetch(prefetch, prefetch_budget, skip_cold, bool(pager), prefetch_depth, prefetch_min_precision)
    n_embd = lay.metadata.get(f"{lay.architecture}.embedding_length") if lay.metadata else None
    predictor = resolve_predictor(prefetch, prefetch_predictor, prefetch_depth, len(lay.layers), lay.n_expert,
                                  int(n_embd) if n_embd else None, lay.path)
    if prefetch == "oracle" and not route_log:
        raise ValueError("prefetch='oracle' replays a recorded run, so record this one too (route_log=PATH): "
                         "recording decodes prompts in its own chunks, which the replayed passes must match")
    if (prefetch == "oracle" and isinstance(prefetch_predictor, (str, os.PathLike))
            and os.path.abspath(prefetch_predictor) == os.path.abspath(route_log)):
        raise ValueError("prefetch='oracle' would overwrite the route log it replays: give route_log another path")
    segment = parse_bytes(read_segment_bytes) if read_segment_bytes else 0
    rate = parse_bytes(read_rate_limit) if read_rate_limit else 0
    if rate and not pager:
        raise ValueError("read_rate_limit paces the pager's expert reads; drop pager=False")
    if pipeline_reads is None:
        pipeline_reads = bool(pager) and skip_cold is None
    if pipeline_reads and skip_cold is not None:
        raise ValueError("pipeline_reads and skip_cold are exclusive: skip-cold decides at a layer's first matmul "
                         "which experts to read; use one of them")
    if pipeline_reads and not pager:
        raise ValueError("pipeline_reads needs the pager (it orders the arena's reads); drop pager=False")
    if not isinstance(io_uring, bool):
        raise ValueError(f"io_uring must be True or False, got {io_uring!r}")
    if expert_addressing not in EXPERT_ADDRESSINGS:
        raise ValueError(f"unknown expert_addressing {expert_addressing!r}; choose one of {', '.join(map(repr, EXPERT_ADDRESSINGS))}")
    if expert_addressing == "slots" and skip_cold is not None:
        raise ValueError("skip_cold maps zeros over a skipped expert's pages, which needs expert_addressing='region' "
                         "(or 'auto', which picks it)")
    if expert_addressing != "auto" and not pager:
        raise ValueError(f"expert_addressing={expert_addressing!r} is how the pager presents experts; drop pager=False")
    spec = check_speculative(lay, speculative, draft_max, draft_p_min, n_seq_max=int(n_seq_max), prefetch=prefetch,
                             route_log=route_log, n_batch=int(n_batch), n_ubatch=int(n_ubatch),
                             lossy=any(x is not None for x in (skip_cold, route_bias, expert_budget)) or ak is not None)
    dense = dense_weights if dense_weights is not None else ("anon" if pager else "mmap")
    if dense not in DENSE_MODES:
        raise ValueError(f"unknown dense_weights {dense_weights!r}; choose one of {', '.join(DENSE_MODES)}")
    return Options(policy=policy, n_expert_used=k, expert_override=k if expert_used is not None else 0,
                   paged=bool(pager), dense_weights=dense, dense_mode=int(DENSE_MODES[dense]), skip_cold=tau,
                   route_bias=rb, route_delta=delta, adaptive_k=ak, expert_budget=budget,
                   prefetch=prefetch if pf[0] else None, prefetch_args=pf, predictor=predictor,
                   pipeline_reads=bool(pipeline_reads), read_segment_bytes=segment, read_rate_limit=rate,
                   n_ctx=int(n_ctx), n_batch=int(n_batch), n_ubatch=int(n_ubatch), n_seq_max=int(n_seq_max),
                   n_threads=None if n_threads is None else int(n_threads),
                   io_threads=None if io_threads is None else int(io_threads),
                   expert_addressing="region" if expert_addressing == "auto" and skip_cold is not None else expert_addressing,
                   io_uring=io_uring, speculative=spec[0], draft_max=spec[1], draft_p_min=spec[2])


__all__ = ["Options", "check_options", "check_lossy", "EXPERT_ADDRESSINGS", "ROUTE_BIASES", "ADAPTIVE_K_DEFAULT", "DENSE_MODES", "MAX_THREADS", "MAX_SEQ"]
