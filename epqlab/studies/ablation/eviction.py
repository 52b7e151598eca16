"""Eviction-policy ablation: live runs per (arena or budget, policy), each replayed through the real
pager to check it and to compute Belady's MIN on the very same route log.

Reproduces the Least-Stale study of seed 000 (LRU vs Least-Stale vs LS + position at 8/16/64 GiB)
and seed 002's hot-pin negative, against SpecMD's claim (arXiv 2602.03921) that Least-Stale beats
LRU; notebooks/03_least_stale.ipynb is its page. See docs/DESIGN.md, "Eviction policies".
"""
from __future__ import annotations

import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from ...constants import STUDY_POLICIES
from .grid import WARMUP_PASSES, MemoryPoint, measure_prompts, memory_points, pass_rates, summarize
from ...data import calibration_texts
from ...data import prompts as shipped_prompts
from ...engine.session import Session
from ...layout import inspect
from ...paging.pager import POLICIES
from ...paging.pager import Pager
from ..sweeps import map_points

DEFAULT_POLICIES = STUDY_POLICIES
"""The live sweep's policies: the seeds' and this project's. Every other online policy (ARC, S3-FIFO, SIEVE, 2Q,
W-TinyLFU, LFUDA, heat, coact) is ranked by the policy tournament (``epqlab ablate policies``,
:mod:`epqlab.studies.ablation.tournament`), which replays them all and confirms its top three live; running all
fourteen live here doubled the study's time."""
# The study's sizes (notebooks/03_least_stale.ipynb's ``preset``). "quick": two arenas, one prompt of each kind
# (chat, code, prose), 16 tokens, one run per setting: a few minutes on the default model on 2 cores, enough for
# hit rates and MB/token (counts do not depend on timing), while speeds from one run are noisy. "full": three
# arenas, every shipped prompt, 32 tokens, speeds as medians of 3 runs (one (arena, policy) run of the 12 prompts
# took 87 s on the default model on a busy 2-core box: the full study is over an hour there).
PRESETS = {
    "quick": {"arenas": [0.25, 0.5], "prompt_ids": ["chat-cache", "code-fib", "prose-story"], "n_predict": 16,
              "repeats": 1, "warmup": 4},
    "full": {"arenas": [0.25, 0.5, 0.75], "prompt_ids": None, "n_predict": 32, "repeats": 3, "warmup": WARMUP_PASSES},
}
_COUNTS = ("requests", "hits", "misses", "evictions", "evictions_stale_left", "evictions_current_left",
           "evictions_stale_right", "evictions_current_right")


def hot_experts(route_log, n: int) -> np.ndarray:
    """The ``n`` experts requested most often in a route log, hottest first: int32 ``[n, 2]`` of
    (GGUF block, expert id). Each routed token counts once for each of its top-k experts; ties go to
    the lower (layer, expert). The hot set of seed 002's static pinning (policy ``"static"``).

    Args:
        route_log: a dict or object with ``experts`` int ``[T, L, k]`` (-1 = not routed) and ``layers``.
        n: how many (clipped to L * n_expert).
    """
    ex = np.asarray(route_log["experts"] if isinstance(route_log, dict) else route_log.experts)
    layers = np.asarray(route_log["layers"] if isinstance(route_log, dict) else route_log.layers)
    n_expert = int(max(int(ex.max()) + 1, int(np.asarray(route_log.get("n_expert", 0) if isinstance(route_log, dict) else 0))))
    counts = np.zeros((ex.shape[1], n_expert), np.int64)
    for li in range(ex.shape[1]):
        col = ex[:, li, :].ravel()
        counts[li] = np.bincount(col[col >= 0], minlength=n_expert)
    order = np.lexsort((np.arange(counts.size), -counts.ravel()))[: max(0, int(n))]
    return np.stack([layers[order // n_expert], order % n_expert], axis=1).astype(np.int32)


def calibration_route_log(model, text: str | None = None, n_tokens: int = 512):
    """Route log (:class:`epqlab.routes.RouteLog`) of a calibration text read teacher-forced (all logits) with every expert resident.

    Args:
        model: MoE GGUF path.
        text: default the shipped calibration chat text (``epqlab.data.calibration_texts()["chat"]``:
            never the evaluation prompts).
        n_tokens: tokens of the text to read.
    """
    text = text if text is not None else calibration_texts()["chat"]
    with tempfile.TemporaryDirectory() as d, Session(model, route_log=Path(d) / "calib.npz", n_ctx=max(512, n_tokens)) as s:
        toks = s.tokenize(text)[:n_tokens]
        s.logits(toks)
        return s.route_log()


def preset_settings(preset: str, **given) -> dict:
    """The study's settings for ``preset`` (:data:`PRESETS`: ``"quick"`` or ``"full"``), each replaced by the
    value in ``given`` that is not None: ``preset_settings("quick", n_predict=24)`` keeps the quick prompts, one
    repeat and warm-up, with 24 tokens. Keys: ``arenas`` (fractions of all expert slots), ``prompt_ids`` (None:
    every shipped prompt), ``n_predict``, ``repeats``, ``warmup``.

    Raises:
        ValueError: an unknown preset or setting name (the message lists the known ones).
    """
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; presets are {', '.join(map(repr, PRESETS))} "
                         f"(quick: {PRESETS['quick']}; full: {PRESETS['full']})")
    bad = sorted(set(given) - set(PRESETS[preset]))
    if bad:
        raise ValueError(f"unknown settings {bad}; a preset sets {', '.join(PRESETS[preset])}")
    return {k: (given[k] if given.get(k) is not None else v) for k, v in PRESETS[preset].items()}


def _replay(layout, arena: int, policy: str, log: dict, hot: np.ndarray | None, k: int, direct_io: bool):
    p = Pager(layout, arena, policy=policy, n_expert_used=k, direct_io=direct_io)
    if hot is not None:
        p.set_hot(hot)
    st = p.replay(log)
    return st, p.pass_history()


def eviction(model, arenas: Sequence | None = (0.25, 0.5, 0.75), policies: Sequence[str] = DEFAULT_POLICIES, *,
             prompts: Sequence | None = None, n_predict: int = 32, repeats: int = 3, budgets: Sequence | None = None,
             warmup: int = WARMUP_PASSES, calibration_text: str | None = None, progress: bool | str = True,
             session_kwargs: dict | None = None, executor=None):
    """Live eviction-policy sweep with replay checks and the Belady bound.

    For each memory point (:func:`epqlab.studies.ablation.grid.memory_points`) and policy, a fresh
    :class:`epqlab.Session` generates ``n_predict`` greedy tokens after each prompt, ``repeats``
    times. Routes are recorded, so prompts are decoded with logits for every token (llama.cpp then
    routes every prompt token through the last layer too). The first repeat's route log is replayed
    through a fresh :class:`epqlab.Pager` of the same arena and policy (its counts must equal the
    live ones: ``replay_equal``) and with policy ``"belady"`` (Belady's MIN under the same
    constraints: slot classes, the pinned layer, per-ubatch unions, staged layers).

    Args:
        model: MoE GGUF path.
        arenas: fractions of all expert slots or byte sizes; budgets: RAM budgets (whole process).
        policies: online policies (:data:`epqlab.paging.pager.POLICIES`); ``"static"`` pins the
            hottest experts of ``calibration_text`` (all slots but one layer's top-k).
        prompts: :class:`epqlab.data.Prompt` objects or strings; default every shipped prompt.
        n_predict: tokens generated per prompt (>= 2).
        repeats: runs per setting; speeds are medians (with min and max).
        warmup: decode passes per prompt left out of the steady-state hit rate.
        progress: a ``tqdm.auto`` bar over the runs; ``"text"``: a plain-text bar on stderr (for a notebook run
            by papermill: a widget bar's saved output keeps its first state, "0/N"); False: none.
        session_kwargs: more :class:`epqlab.Session` arguments (e.g. ``n_threads``).
        executor: a :class:`concurrent.futures.Executor` to run the (point, policy) pairs on (one per
            process at a time, :func:`epqlab.studies.sweeps.map_points`); default None runs them serially
            here: the speed columns are timings, which parallel runs on one box (2 cores, one SSD)
            spoil (see :mod:`epqlab.studies.sweeps`).

    Returns:
        pandas.DataFrame, one row per (point, policy): the point (``point``, ``arena_fraction``,
        ``ram_budget``, ``arena_bytes``, ``slots``), the metrics of
        :func:`epqlab.studies.ablation.grid.measure_prompts` (speeds as medians of the repeats, plus
        ``_min``/``_max``), ``replay_equal``, ``replay_io_wait_s`` (the replay's wait for the same
        reads, s) beside the live ``io_wait_s``, ``belady_hit_rate`` / ``belady_decode_hit_rate`` /
        ``belady_steady_hit_rate``, ``belady_share`` = ``hit_rate / belady_hit_rate`` (the share of
        the bound reached) and ``belady_gap`` = ``belady_hit_rate - hit_rate`` (hit-rate points below it),
        and the same over the steady state (``steady_belady_share``, ``steady_belady_gap``). ``df.attrs`` holds the settings and ``route_log``: the first run's
        route log (:class:`epqlab.routes.RouteLog`; routing does not depend on the policy or the arena: logits are identical).

    Raises:
        ValueError: unknown policy, bad arena, repeats < 1.
    """
    import pandas as pd
    from tqdm import tqdm as text_bar
    from tqdm.auto import tqdm as auto_bar

    tqdm = text_bar if progress == "text" else auto_bar
    bad = [p for p in policies if p not in POLICIES]
    if bad:
        raise ValueError(f"unknown or offline policies {bad}; online policies are {', '.join(POLICIES)} "
                         "(Belady is computed for every row from its own route log)")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    layout = inspect(model)
    kw = dict(session_kwargs or {})
    k = int(kw.get("expert_used") or layout.n_expert_used)
    points: list[MemoryPoint] = memory_points(layout, arenas, budgets, k)
    prompts = list(prompts) if prompts is not None else shipped_prompts()
    ranked = hot_experts(calibration_route_log(model, calibration_text), layout.n_layer * layout.n_expert) \
        if "static" in policies else None

    jobs = [dict(model=model, pt=pt, pol=pol, ranked=ranked, k=k, prompts=prompts, n_predict=n_predict,
                 repeats=repeats, warmup=warmup, kw=kw) for pt in points for pol in policies]
    if executor is None:  # serial, here, with a progress bar over the runs
        bar = tqdm(total=len(jobs) * repeats, desc="eviction ablation", disable=not progress)
        try:
            out = [_point_policy(**j, bar=bar) for j in jobs]
        finally:
            bar.close()  # its final state (n/n) is what an executed notebook keeps
    else:
        out = map_points(_point_policy, jobs, executor)
    rows = [r for r, _ in out]
    first_log = out[0][1] if out else None
    df = pd.DataFrame(rows)
    df.attrs.update(model=str(layout.path), n_expert=layout.n_expert, n_expert_used=k, n_layer=len(layout.layers),
                    n_predict=n_predict, repeats=repeats, warmup=warmup, prompts=[getattr(p, "id", str(p)[:40]) for p in prompts],
                    route_log=first_log)
    return df


def _point_policy(model, pt, pol, ranked, k, prompts, n_predict, repeats, warmup, kw, bar=None):
    """One row of :func:`eviction` and its first run's route log (module level: executors pickle it)."""
    layout = inspect(model)
    runs, log, hot = [], None, None
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(repeats):
            with Session(model, policy=pol, route_log=Path(tmp) / "routes.npz", **pt.session_kwargs(), **kw) as s:
                if pol == "static":
                    hot = ranked[: max(0, s.pager.n_slots - k)]
                    s.pager.set_hot(hot)
                m = measure_prompts(s, prompts, n_predict, warmup)
                runs.append(m)
                if r == 0:
                    log = s.route_log()
                    arena, slots = s.pager.requested_arena_bytes, s.pager.n_slots
                    used, direct = s.pager.arena_bytes, s.pager.direct_io
            if bar is not None:
                bar.update(1)
    row = {**pt.as_dict(), "policy": pol, "arena_bytes": used, "slots": slots,
           "arena_fraction_of_experts": used / max(1, Pager.all_experts_bytes(layout)), **summarize(runs)}
    rep, _ = _replay(layout, arena, pol, log, hot, k, direct)
    row["replay_equal"] = all(rep[c] == runs[0][c] for c in _COUNTS)
    row["replay_hits"] = rep["hits"]
    row["replay_io_wait_s"] = rep["io_wait_us"] / 1e6
    bel, hist = _replay(layout, arena, "belady", log, None, k, direct)
    b = pass_rates(hist, runs[0]["pass_kind"])
    row.update(belady_hit_rate=b["hit_rate"], belady_decode_hit_rate=b["decode_hit_rate"],
               belady_steady_hit_rate=b["steady_hit_rate"], belady_evictions=bel["evictions"])
    for pre, live, bound in (("", row["hit_rate"], b["hit_rate"]), ("steady_", row["steady_hit_rate"], b["steady_hit_rate"])):
        row[f"{pre}belady_share"] = live / bound if bound else float("nan")
        row[f"{pre}belady_gap"] = bound - live
    return row, log
