"""Next-layer expert prefetch: the knob's validation and its run-stat fields.

While layer l computes, the hook reads the experts layer l+1 will probably need into free or
evictable slots (never pinned experts, never l+1's own predictions); at l+1 it waits for that
read and loads what is still missing (native/engine/hook.h "Prefetch", native/pager/pager.h
``prefetch_start``). Prefetch changes only when bytes are read, never which bytes are computed:
logits stay bit-identical to plain llama.cpp. Predictors:

- ``"lookahead"``: layer l+1's router weights (``ffn_gate_inp``) applied to layer l's router
  input taken from the graph (the hidden state barely changes between layers), top-k.
- ``"previous"``: the experts layer l+1 used for the previous token.
- ``"union"``: lookahead first, then previous, capped at ``prefetch_budget`` bytes per layer.
- ``"trained"``: lookahead with weights learned from the model's own router inputs
  (:mod:`epqlab.engine.predictor`; pass ``prefetch_predictor``): a linear map per layer and depth.
- ``"oracle"``: the ceiling of every predictor, for studies, not a predictor: it replays the routes of an
  earlier identical run (``prefetch_predictor``: its route log, recorded with the same prompt, settings
  and calls), so the wait that remains is the mechanism's own (prefetch window, device order), not a
  wrong guess. The n-th single-token forward pass of the Session uses the n-th one of the log; past
  the log's end nothing is predicted. The replaying Session must record too (``route_log``): recording
  decodes prompts in its own chunks, and a chunk of one token is a single-token pass. Its predictions
  past the last layer are the next token's first layers when the log's next pass is the next row
  (native/engine/hook.h). A log of another run gives
  wrong predictions, visible as precision < 1; logits stay exact either way.

The gate (``prefetch_min_precision``, default 0.5; 0 turns it off): a predicted expert that is not
resident is read only while the predictions of its rank (its position in the predictor's list) that
were not resident have been selected at their layer at least that often, an EMA scored at every
layer whether read or not (native/engine/hook.h). A predictor is right most often about experts that are
resident anyway, which cost nothing: measured on the skewed 8 GiB model at a 1 GiB arena, lookahead's
precision was 0.82 while only 37% of the reads it issued were used (ranks 5-8: ~22%).

``prefetch_depth`` d > 1 also starts, at layer l, the same predictor's batches for layers l+2 ..
l+d (applied that many layers ahead), queued behind l+1's: the device keeps reading while l+1
computes, at the price of a lower precision. A batch stays in flight until its layer's router;
demand reads always go ahead of queued speculative ones.

Only single-token (decode) steps prefetch. Off by default: whether it pays depends on the device
and the predictor's precision (bench/bench_overlap.py measures it).
"""
from __future__ import annotations

import numbers
import os

import numpy as np

from ..constants import MAX_PREFETCH_DEPTH, PrefetchMode
from ..routes.log import RouteLog, RouteLogError
from ..units import parse_bytes
from .predictor import ExpertPredictor, router_fingerprint

# Layers ahead a prefetch may read: MAX_PREFETCH_DEPTH (native expert_hook::kMaxDepth). bench_overlap,
# skewed 8 GiB model, 500 MB/s device: the oracle's balanced steps took 1.09x their bound at depth 8,
# 1.10x at 4 (docs/DESIGN.md "Oracle").
PREFETCH_MODES = {m.name.lower(): m for m in PrefetchMode if m is not PrefetchMode.OFF}
"""Predictor name -> the hook's mode code (:class:`epqlab.constants.PrefetchMode`)."""
# The gate's default: read a predicted, non-resident expert only while predictions of its rank
# were selected at least half the time (a read more likely useful than wasted).
DEFAULT_MIN_PRECISION = 0.5
def check_prefetch(prefetch, prefetch_budget, skip_cold, paged: bool, depth=1,
                   min_precision=None) -> tuple[int, int, int, float]:
    """Validate the Session's prefetch arguments.

    Returns:
        (mode code for the native hook, budget in bytes per layer (0 = no cap), depth in layers,
        the gate's minimum precision: ``min_precision``, or :data:`DEFAULT_MIN_PRECISION` when None).

    Raises:
        ValueError: unknown predictor, prefetch without the pager, a negative or malformed budget,
            a depth outside 1..MAX_PREFETCH_DEPTH (8), a min_precision outside [0, 1], or prefetch together with ``skip_cold`` (skip-cold skips non-resident experts, so its
            choice would depend on what prefetch made resident: the run would not be reproducible).
    """
    if prefetch_budget is not None and prefetch is None:
        raise ValueError("prefetch_budget needs prefetch='union' (or another predictor)")
    if isinstance(depth, bool) or not isinstance(depth, numbers.Integral) or not 1 <= depth <= MAX_PREFETCH_DEPTH:
        raise ValueError(f"prefetch_depth must be an int in 1..{MAX_PREFETCH_DEPTH} (layers ahead), got {depth!r}")
    if min_precision is not None and (isinstance(min_precision, bool) or not isinstance(min_precision, numbers.Real)
                                      or not 0 <= min_precision <= 1):
        raise ValueError(f"prefetch_min_precision must be a number in [0, 1] (0 reads every prediction), got {min_precision!r}")
    if prefetch is None or prefetch is False or prefetch == "off":
        if depth != 1:
            raise ValueError("prefetch_depth needs a predictor (prefetch='lookahead', ...)")
        if min_precision is not None:
            raise ValueError("prefetch_min_precision needs a predictor (prefetch='lookahead', ...)")
        return 0, 0, 1, 0.0
    if prefetch not in PREFETCH_MODES:
        raise ValueError(f"unknown prefetch predictor {prefetch!r}; choose one of {', '.join(PREFETCH_MODES)} (or None)")
    if not paged:
        raise ValueError("prefetch needs the pager (it reads experts into the arena); drop pager=False")
    if skip_cold is not None:
        raise ValueError("prefetch and skip_cold are exclusive: skip-cold skips experts that are not resident, and "
                         "prefetch changes which are, so results would depend on I/O timing; use one of them")
    budget = 0
    if prefetch_budget is not None:
        budget = parse_bytes(prefetch_budget) if not isinstance(prefetch_budget, numbers.Integral) else int(prefetch_budget)
        if budget <= 0:
            raise ValueError(f"prefetch_budget must be > 0 bytes per layer, got {prefetch_budget!r}")
    gate = DEFAULT_MIN_PRECISION if min_precision is None else float(min_precision)
    return int(PREFETCH_MODES[prefetch]), budget, int(depth), gate


def resolve_predictor(prefetch, predictor, depth: int, n_layers: int, n_expert: int, n_embd: int | None,
                      model=None):
    """The :class:`epqlab.engine.predictor.ExpertPredictor` for ``prefetch="trained"`` (``predictor``: one,
    or the path of one saved with ``.save``), the routes of :func:`oracle_routes` for ``"oracle"``,
    or None for the other predictors.

    Raises:
        ValueError: "trained" without a predictor, a predictor with another predictor, one fitted
            for another model shape (layers, experts, width) or on another model (its
            ``model_fingerprint`` is not ``model``'s), or a depth beyond the predictor's; the errors
            of :func:`oracle_routes` for "oracle".
        EpqlabError: the path is not a saved predictor (RouteLogError: not a route log, for "oracle").
    """
    if prefetch == "oracle":
        return oracle_routes(predictor, n_layers, n_expert)
    if prefetch != "trained":
        if predictor is not None:
            raise ValueError("prefetch_predictor is used by prefetch='trained' and 'oracle' only")
        return None
    if predictor is None:
        raise ValueError("prefetch='trained' needs prefetch_predictor: fit one with epqlab.studies.predictor_fit.fit_for_model "
                         "(or `epqlab predictor fit`) and pass it or its .npz path")
    p = predictor if isinstance(predictor, ExpertPredictor) else ExpertPredictor.load(predictor)
    p.check_model(n_layers, n_expert, n_embd)
    if p.model_fingerprint and model is not None:
        if router_fingerprint(model) != p.model_fingerprint:
            raise ValueError(f"the predictor was fitted on another model (its router fingerprint is not {model}'s): "
                             "fit one on this model (epqlab predictor fit)")
    if depth > p.depth:
        raise ValueError(f"prefetch_depth {depth} exceeds the predictor's depth {p.depth}; fit it with depth={depth}")
    return p


def oracle_routes(route_log, n_layers: int, n_expert: int):
    """The ``"oracle"`` predictor's table: the routes of ``route_log``'s single-token forward passes (its
    decode steps) in order, int32 ``[n_steps, n_layers, k]``, and per row whether the log's next forward
    pass is the next row (uint8 ``[n_steps]``; not at the end of a generation, whose next pass is a prompt).

    Args:
        route_log: an :class:`epqlab.routes.RouteLog` or the path of one (``Session(route_log=...)``)
            recorded from the same model, prompt and calls as the run that replays it.

    Raises:
        ValueError: no route log, or one of another model shape (MoE layers, experts per layer).
        TypeError: ``route_log`` is neither a RouteLog nor a path.
        RouteLogError: the path is not a valid route log, or it predates ubatch ids (record it again).
    """
    if route_log is None:
        raise ValueError("prefetch='oracle' needs prefetch_predictor: the route log of an earlier run of the same "
                         "prompt (Session(route_log=PATH)); the oracle replays its routes")
    if not isinstance(route_log, (RouteLog, str, os.PathLike)):
        raise TypeError(f"prefetch='oracle': prefetch_predictor must be a route log (a RouteLog or the path of an "
                        f".npz written by Session(route_log=...)), got {type(route_log).__name__}")
    log = route_log if isinstance(route_log, RouteLog) else RouteLog.load(route_log)
    if log.ubatch is None:
        raise RouteLogError("this route log has no ubatch ids, so its decode steps cannot be told apart; "
                            "record it again with Session(route_log=...)")
    if log.n_layers != n_layers or log.n_expert != n_expert:
        raise ValueError(f"the route log is of a model with {log.n_layers} MoE layers x {log.n_expert} experts, "
                         f"this one has {n_layers} x {n_expert}: record the oracle's log on this model")
    # one forward pass = a run of equal consecutive ubatch ids (logs of older versions restart them at
    # Session.reset_stats, so only consecutive runs are passes)
    ub = np.asarray(log.ubatch)
    starts = np.flatnonzero(np.r_[True, ub[1:] != ub[:-1]])
    single = np.diff(np.r_[starts, len(ub)]) == 1
    rows = np.flatnonzero(single)  # pass numbers of the single-token passes
    follows = np.r_[single[1:], False][rows]  # the pass after is single-token too: the next row
    return (np.ascontiguousarray(log.experts[starts[rows]], dtype=np.int32),
            np.ascontiguousarray(follows, dtype=np.uint8))
