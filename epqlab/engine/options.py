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

from ..constants import DenseMode
from ..layout import ModelLayout
from ..paging.pager import MAX_IO_THREADS, POLICIES
from ..units import parse_bytes
from .prefetch import check_prefetch, resolve_predictor

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
        (native code), skip_cold (tau or None), prefetch (name or None) and prefetch_args (mode code,
        budget bytes per layer, depth, gate: for the native hook), predictor (an ExpertPredictor, the
        oracle's route table, or None), pipeline_reads, read_segment_bytes and read_rate_limit (bytes,
        bytes/s; 0 = off), n_ctx / n_batch / n_ubatch (tokens; n_ctx per sequence), n_seq_max (sequences
        decoded side by side), n_threads / io_threads (None = default).
    """

    policy: str
    n_expert_used: int
    expert_override: int
    paged: bool
    dense_weights: str
    dense_mode: int
    skip_cold: float | None
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


def _check_int(name: str, v, hi: int | None = None) -> None:
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
        raise ValueError(f"{name} must be an integer, got {v!r}")
    if int(v) < 1:
        raise ValueError(f"{name} must be >= 1, got {v}")
    if hi is not None and int(v) > hi:
        raise ValueError(f"{name} must be <= {hi}, got {v}")


def check_options(lay: ModelLayout, *, policy="lru", expert_used=None, io_threads=None, n_threads=None, n_ctx=2048,
                  n_batch=512, n_ubatch=512, n_seq_max=1, pager=True, route_log=None, dense_weights=None, hot_experts=None,
                  skip_cold=None, prefetch=None, prefetch_budget=None, prefetch_depth=1, prefetch_min_precision=None,
                  prefetch_predictor=None, read_segment_bytes=None, pipeline_reads=None,
                  read_rate_limit=None) -> Options:
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
    if not lay.is_moe and expert_used is not None:
        raise ValueError(f"expert_used applies to MoE models; {lay.path.name} is dense")
    tau = None
    if skip_cold is not None:
        if not pager:
            raise ValueError("skip_cold needs the pager (it skips reads of non-resident experts); drop pager=False")
        tau = float(skip_cold)
        if not np.isfinite(tau) or tau < 0:
            raise ValueError(f"skip_cold must be a finite router weight >= 0 (or None for off), got {skip_cold!r}")
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
    dense = dense_weights if dense_weights is not None else ("anon" if pager else "mmap")
    if dense not in DENSE_MODES:
        raise ValueError(f"unknown dense_weights {dense_weights!r}; choose one of {', '.join(DENSE_MODES)}")
    return Options(policy=policy, n_expert_used=k, expert_override=k if expert_used is not None else 0,
                   paged=bool(pager), dense_weights=dense, dense_mode=int(DENSE_MODES[dense]), skip_cold=tau,
                   prefetch=prefetch if pf[0] else None, prefetch_args=pf, predictor=predictor,
                   pipeline_reads=bool(pipeline_reads), read_segment_bytes=segment, read_rate_limit=rate,
                   n_ctx=int(n_ctx), n_batch=int(n_batch), n_ubatch=int(n_ubatch), n_seq_max=int(n_seq_max),
                   n_threads=None if n_threads is None else int(n_threads),
                   io_threads=None if io_threads is None else int(io_threads))


__all__ = ["Options", "check_options", "DENSE_MODES", "MAX_THREADS", "MAX_SEQ"]
