"""``epqlab plan``: what a MoE GGUF will do on this machine at each RAM budget, before a long run.

:func:`plan` reads the layout from the header, probes the device under the model (cached,
:mod:`epqlab.studies.plan_probe`), and runs a short teacher-forced calibration at the **smallest** budget asked
for (the process never holds more): one Session with prefetch off and one with the predictor (``trained`` when
a fitted predictor for this model is given or lies beside it as ``<model>.predictor.npz``, else router
``lookahead``, labelled so), and a third that measures the compute of a step that reads nothing: the resident
run (:data:`RESIDENT_RUN`) where that budget's arena holds top-k experts of every layer, else plain llama.cpp
under the same limit where the whole file fits in it. From them it takes the terms of
:mod:`epqlab.studies.plan_model` (compute per step, µs per missed expert, the ratio of measured io wait to the
probe's read time, the predictor's cost and coverage) and the route trace, which the eviction simulators replay at every budget's slots. The forecast
rows are a :class:`Plan`; :meth:`Plan.verify` measures every row under a hard memory limit
(:mod:`epqlab.studies.strict`) on text the calibration did not see, and puts the error beside each forecast.

Texts: the calibration decodes the first half of the held-out prose (``epqlab.data.heldout_texts``, or the
first half of ``text``), teacher-forced; verification the second half. The trained predictor is fitted on
the shipped calibration texts (:mod:`epqlab.studies.predictor_fit`), which neither half is.
"""
from __future__ import annotations

import os
import re
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..constants import DEFAULT_POLICY
from ..data import heldout_texts
from ..engine.prefetch import resolve_predictor
from ..memory.auto_budget import auto_budget
from ..errors import ArenaTooSmall, EpqlabError
from ..layout import inspect
from ..models.smollm2 import cache_dir
from ..paging.pager import Pager, default_io_threads
from ..routes.log import RouteLog
from ..routes.simulators import simulate, stack_distances
from ..units import fmt_bytes, parse_bytes
from .plan_model import (DeviceTable, LayerShape, Terms, decode_us_off, decode_us_prefetch, expected_union, fit_compute,
                         compute_line, prefetch_wait_us, prefill_us, resident_compute, step_read_us,
                         step_waits)
from . import strict
from .plan_probe import ProbeUnusableError, probe_for_plan
from .strict import _run_one

HEADROOM = 16 * 2**20   # bytes of each limit left outside the Session's ram_budget (epqlab.studies.strict)
DEFAULT_N = 48           # teacher-forced decode steps of the calibration (and of each verification run)
DEFAULT_PROMPT = "A CPU cache is a small, fast memory that"
PREFILL_TOKENS = 512     # the prompt length the prefill forecast is for
MIN_TEXT_TOKENS = 16     # a calibration needs at least this many decode steps
FIT_TOKENS = 1024        # tokens `epqlab predictor fit` decodes (epqlab.studies.predictor_fit.fit_for_model)
PLAN_POLICIES = ("lru", "ls", "ls_pos", "lfu", "fnu", "heat")
"""Policies ``plan`` simulates by default: the fast simulators' three and the policy tournament's leaders (``epqlab
ablate policies``: heat first at the 35B-A3B shape's 4 GiB, 55% of the LRU-to-Belady gap; fnu first on the default
model; lfu close behind both). The others cost 2-5 s each per budget on a 35B trace (docs/DESIGN.md §9)."""
RESIDENT_RUN = {"route_bias": "cache", "route_delta": 1.0}
"""The resident run's Session settings: cache-aware routing with a margin of 1 gives every non-resident choice a
resident expert of its layer, so once each layer holds top-k experts a decode step reads nothing and computes
what an all-resident step computes (top-k expert matmuls per layer, the same shapes); its logits differ, its
time is the compute term's zero-read point (docs/DESIGN.md §9)."""
KNEE = 0.05              # the recommended budget: the smallest within this share of the fastest forecast
PAYS = 0.05              # prefetch is recommended when it forecasts at least this much faster than off


class PlanInputError(EpqlabError, ValueError):
    """An input ``plan`` / ``tune`` cannot use (a text too short, a budget list it cannot read, ...)."""


def split_text(text: str) -> tuple[str, str]:
    """(calibration half, verification half) of ``text``, cut at the paragraph or line break nearest the middle."""
    mid = len(text) // 2
    cut = text.rfind("\n\n", 0, mid)
    if cut < len(text) // 4:
        cut = text.rfind("\n", 0, mid)
    if cut < len(text) // 4:
        cut = mid
    return text[:cut], text[cut:]


def parse_budgets(budgets) -> list[int] | str:
    """Budgets in bytes, ascending, from ``"4GiB,8GiB"`` / a list, or ``"auto"``.

    Raises PlanInputError for an empty or unreadable list."""
    if isinstance(budgets, str) and budgets.strip() == "auto":
        return "auto"
    items = [x for x in str(budgets).replace(" ", ",").split(",") if x] if isinstance(budgets, str) else list(budgets)
    try:
        out = sorted({parse_bytes(x) for x in items})
    except (ValueError, TypeError) as e:
        raise PlanInputError(f"cannot read the budgets {budgets!r}: {e}; write e.g. 4GiB,8GiB,16GiB or auto") from None
    if not out or out[0] <= 0:
        raise PlanInputError(f"no positive budgets in {budgets!r}; write e.g. 4GiB,8GiB,16GiB or auto")
    return out


def default_predictor_path(model) -> str:
    return os.path.splitext(os.fspath(model))[0] + ".predictor.npz"


@dataclass
class Calibration:
    """What one calibration Session measured (µs, bytes, counts over its decode steps)."""
    prefetch: str | None
    used_before_arena: int
    reserve: int
    read_buffers: int
    arena_bytes: int
    class_slots: dict          # slot bytes -> slots
    n_steps: int
    wall_us: float             # sum over decode steps
    compute_us: float          # sum of wall - io - map - predict
    io_us: float
    map_us: float
    predict_us: float
    misses: int                # live decode misses
    decode_hit_rate: float
    layer_compute_us: float    # mean (attn + expert) per MoE layer and decode step
    prefill_tokens: int
    prefill_s: float           # the prompt's wall time (its reads included)
    prefill_read_bytes: int
    decode_read_bytes: int     # SSD bytes the decode steps read (demand and prefetch)
    prefetch_used: int = 0
    prefetch_wasted_bytes: int = 0
    decode_tok_s: float = 0.0
    log: RouteLog | None = None
    seconds: float = 0.0
    peak_charged: int = 0      # the child's peak charged memory (cgroup or sampled RSS), bytes
    limit_mode: str = ""
    step_compute_us: tuple = ()  # per single-token decode step: wall - io wait - map, µs
    step_wall_us: tuple = ()     # per single-token decode step: wall, µs


@dataclass
class PlanRow:
    """One forecast: a budget, a policy and a prefetch setting. Times in ms per token, speeds in tok/s."""
    budget: int
    arena_bytes: int
    slots: int
    coverage: float                  # arena slots / routed experts
    policy: str
    prefetch: str                    # "off", "trained" or "lookahead"
    hit_rate: float                  # simulated decode hit rate at these slots
    miss_mb_per_token: float
    decode_ms: float
    decode_tok_s: float
    parts_ms: dict                   # compute, io, map, predict
    roofline_ms: float               # max(compute, miss bytes / best device bandwidth)
    prefill_tok_s: float | None
    session_kwargs_: dict = field(default_factory=dict)
    measured_tok_s: float | None = None
    measured_runs: list = field(default_factory=list)
    measured_reason: str | None = None
    measured_hit_rate: float | None = None        # median decode hit rate of the verification runs
    measured_mb_per_token: float | None = None    # median decode SSD MB per token of the verification runs
    waits_per_token: float = 0.0                  # MoE layers per step that wait on a read (W, plan_model)

    @property
    def error_pct(self) -> float | None:
        """(forecast - measured) / measured, in %; None before :meth:`Plan.verify`."""
        if not self.measured_tok_s:
            return None
        return 100.0 * (self.decode_tok_s - self.measured_tok_s) / self.measured_tok_s

    def session_kwargs(self) -> dict:
        """Keyword arguments for :class:`epqlab.Session` that run this row: ``Session(model, **row.session_kwargs())``."""
        return dict(self.session_kwargs_)


@dataclass
class Plan:
    """Forecast rows and how they were made. ``rows``: every (budget, policy, prefetch) forecast;
    ``policies``: simulated hit rates per budget and policy (Belady beside them); ``terms``: the calibrated
    model terms (:class:`epqlab.studies.plan_model.Terms` per prefetch setting); ``best``: the recommended row."""
    model: str
    budgets: list[int]
    rows: list[PlanRow]
    policies: list[dict]
    terms: dict
    probe: dict
    calibration: dict
    best: PlanRow
    recommendation: dict
    seconds: float
    n_steps: int
    prompt: str
    verify_text: str
    n_threads: int
    n_ctx: int
    predictor: str | None
    verified: bool = False

    def to_frame(self):
        """pandas.DataFrame, one row per forecast (``error_pct`` after :meth:`verify`)."""
        import pandas as pd

        recs = []
        for r in self.rows:
            d = {k: getattr(r, k) for k in ("budget", "arena_bytes", "slots", "coverage", "policy", "prefetch", "hit_rate",
                                             "miss_mb_per_token", "decode_ms", "decode_tok_s", "roofline_ms",
                                             "prefill_tok_s", "measured_tok_s", "measured_hit_rate",
                                             "measured_mb_per_token", "waits_per_token")}
            d.update({f"{k}_ms": v for k, v in r.parts_ms.items()})
            d["error_pct"] = r.error_pct
            recs.append(d)
        return pd.DataFrame(recs)

    def verify(self, *, repeats: int = 3, headroom="16MiB", limit_mode=None, progress: bool = False,
               timeout_s: float | None = 3600) -> "Plan":
        """Measure every row: decode ``n_steps`` tokens teacher-forced on the verification half of the text,
        under a memory limit of the budget + ``headroom`` (``epqlab.studies.strict.run``: a child process per
        run, the model dropped from the page cache first, repeats interleaved); sets each row's
        ``measured_tok_s`` (median) and ``measured_runs``. Returns self."""

        head = parse_bytes(headroom)
        for policy in sorted({r.policy for r in self.rows}):
            mine = [r for r in self.rows if r.policy == policy]
            variants = {r.prefetch: {k: v for k, v in r.session_kwargs().items() if k not in ("ram_budget", "policy")}
                        for r in mine}
            kw = {k: v for k, v in (("n_threads", self.n_threads), ("n_ctx", self.n_ctx)) if v}
            df = strict.run(self.model, sorted({r.budget + head for r in mine}), prompt=self.prompt,
                            n_predict=self.n_steps, forced=self.verify_text, policy=policy, repeats=repeats,
                            headroom=head, limit_mode=limit_mode, timeout_s=timeout_s, progress=progress,
                            variants=variants, **kw)
            runs = df.attrs.get("runs") or []
            for r in mine:
                got = [x for x in runs if x.get("level") == r.budget + head and x.get("variant") == r.prefetch]
                r.measured_runs = [float(x["stats"]["decode_tok_s"]) if x.get("status") == "PASS" and x.get("stats")
                                   else None for x in got]
                ok = [t for t in r.measured_runs if t]
                r.measured_tok_s = statistics.median(ok) if ok else None
                r.measured_reason = next((x.get("reason") for x in got if x.get("status") != "PASS"), None)
                sts = [x["stats"] for x in got if x.get("status") == "PASS" and x.get("stats")]
                if sts:
                    r.measured_hit_rate = statistics.median(float(st.get("decode_hit_rate") or 0.0) for st in sts)
                    r.measured_mb_per_token = statistics.median(
                        float(st.get("decode_ssd_bytes_per_token") or 0.0) / 1e6 for st in sts)
        self.verified = True
        return self


# ------------------------------------------------------------------------------------------- calibration
def _calibrate(model, limit: int, prompt: str, text: str, n: int, workdir: str, *, prefetch=None, predictor=None,
               n_threads=None, n_ctx=None, io_threads=None, policy=DEFAULT_POLICY, headroom=HEADROOM,
               limit_mode=None, extra: dict | None = None, tag: str | None = None) -> Calibration:
    """One calibration run: a child process under a hard limit of ``limit`` bytes (Session ram_budget = limit -
    headroom), exactly as :meth:`Plan.verify` and :mod:`epqlab.studies.strict` run each row, its routes recorded.
    ``extra``: more Session settings (the resident run's cache routing); ``tag`` names its route log."""

    t0 = time.perf_counter()
    log_path = os.path.join(workdir, f"routes-{tag or prefetch or 'off'}.npz")
    kw = dict(route_log=log_path, io_threads=io_threads, **(extra or {}))
    for k, v in (("n_threads", n_threads), ("n_ctx", n_ctx)):
        if v:
            kw[k] = v
    if prefetch:
        kw["prefetch"] = prefetch
        if prefetch == "trained":
            kw["prefetch_predictor"] = os.fspath(predictor)
    df = strict.run(model, [limit], prompt=prompt, n_predict=n, forced=text, policy=policy, repeats=1,
                    headroom=headroom, limit_mode=limit_mode, **kw)
    run = (df.attrs.get("runs") or [{}])[0]
    if run.get("status") != "PASS":
        reason = run.get("reason") or "the calibration run failed"
        if "ArenaTooSmall" in reason:
            raise ArenaTooSmall(reason.split("ArenaTooSmall: ", 1)[-1] + f" (the calibration runs under a limit of "
                                f"{fmt_bytes(limit)}, ram_budget = the limit - {fmt_bytes(headroom)})")
        raise EpqlabError(f"the calibration run at {fmt_bytes(limit)} failed: {reason}")
    st = run["stats"]
    if int(st.get("n_gen") or 0) < n:
        raise PlanInputError(f"the calibration text gave {st.get('n_gen')} decode steps, fewer than the {n} asked for: "
                             "give a longer --text or a smaller --n")
    ts = st.get("time_split") or {}
    steps = int(ts.get("calls") or 0)
    mem = st.get("memory") or {}
    log = RouteLog.load(log_path)
    io_ms = ts.get("io_ms", 0.0)
    return Calibration(
        prefetch=prefetch, used_before_arena=int(run.get("used_before_arena") or mem.get("used_before_arena") or 0),
        reserve=int(mem.get("reserve") or 0), read_buffers=int(mem.get("read_buffers") or 0),
        arena_bytes=int(st.get("arena_bytes") or 0),
        class_slots={int(c["slot_bytes"]): int(c["slots"]) for c in st.get("slot_classes") or []},
        n_steps=steps, wall_us=1e3 * steps * ts.get("wall_ms", 0.0),
        compute_us=1e3 * steps * (ts.get("wall_ms", 0.0) - io_ms - ts.get("map_ms", 0.0) - ts.get("predict_ms", 0.0)),
        io_us=1e3 * steps * io_ms, map_us=1e3 * steps * ts.get("map_ms", 0.0), predict_us=1e3 * steps * ts.get("predict_ms", 0.0),
        misses=int(st.get("decode_misses") or 0), decode_hit_rate=float(st.get("decode_hit_rate") or 0.0),
        layer_compute_us=1e3 * (ts.get("attn_ms", 0.0) + ts.get("expert_ms", 0.0)) / max(1, log.n_layers),
        prefill_tokens=int(st.get("n_prompt") or 0), prefill_s=float(st.get("prefill_s") or 0.0),
        prefill_read_bytes=int(st.get("prefill_ssd_bytes") or 0),
        decode_read_bytes=int(float(st.get("decode_ssd_bytes_per_token") or 0.0) * steps),
        prefetch_used=int(st.get("prefetch_used") or 0), prefetch_wasted_bytes=int(st.get("prefetch_wasted_bytes") or 0),
        decode_tok_s=float(st.get("decode_tok_s") or 0.0), log=log, seconds=time.perf_counter() - t0,
        peak_charged=int(run.get("peak_charged") or 0), limit_mode=str(run.get("limit_mode")),
        step_compute_us=tuple(1e3 * float(x) for x in (st.get("time_split_tokens") or {}).get("t_compute_ms", [])),
        step_wall_us=tuple(1e3 * float(x) for x in (st.get("time_split_tokens") or {}).get("wall_ms", [])))


# ------------------------------------------------------------------------------------------- simulation
def _classes(lay):
    """Per MoE layer: its slot bytes (the pager's slot class) and its :class:`LayerShape`."""
    slot = [int(b) for b in Pager.unit_slot_bytes(lay)]
    shapes = [LayerShape(int(l.expert_bytes), len(l.tensors)) for l in lay.layers]
    return slot, shapes


def slots_at(lay, arena: int) -> dict:
    """Slot bytes -> slots of the pager's arena of ``arena`` bytes (the pager's own split into classes)."""
    p = Pager(lay, arena, prefault=False)
    try:
        return {int(c["slot_bytes"]): int(c["slots"]) for c in p.stats["slot_classes"]}
    finally:
        del p


def _sublog(log: RouteLog, idx) -> RouteLog:
    return RouteLog(experts=np.ascontiguousarray(log.experts[:, idx]), layers=log.layers[idx], phase=log.phase,
                    expert_bytes=log.expert_bytes[idx], n_expert=log.n_expert, ubatch=log.ubatch,
                    probs=None if log.probs is None else np.ascontiguousarray(log.probs[:, idx]))


def simulate_misses(log: RouteLog, layer_slot_bytes, class_slots: dict, policies=()) -> tuple[np.ndarray, dict]:
    """Misses per (token, layer) under LRU, int ``[T, L]``, each slot class a shared pool of its slots over its
    layers (stack distances: a request misses iff its distance exceeds the pool's slots), and per policy the
    hits and requests over the trace (``{policy: (hits, requests)}``, :func:`epqlab.routes.simulate`)."""
    T, L, k = log.experts.shape
    miss = np.zeros((T, L), np.int64)
    agg: dict = {}
    for sb, cap in class_slots.items():
        idx = np.array([i for i, b in enumerate(layer_slot_bytes) if b == sb], np.int64)
        if idx.size == 0:
            continue
        sub = _sublog(log, idx)
        cap = max(int(cap), k)
        d = stack_distances(sub, per_layer=False)
        miss[:, idx] = (d > cap).sum(2)
        if policies:
            df = simulate(sub, [cap], tuple(policies), per_layer=False)
            for _, r in df.iterrows():
                h, q = agg.get(r.policy, (0, 0))
                agg[r.policy] = (h + int(r.hits), q + int(r.requests))
    return miss, agg


# ------------------------------------------------------------------------------------------- the plan
def _fit_steps(cal: Calibration, miss, shapes, probe_kappa: float, zero_us: float | None = None,
               zero_how: str | None = None) -> tuple[float, float, float, str]:
    """``(C0, kappa, c_wait, how)`` for a calibration ``cal`` (prefetch off), with ``miss`` ``[T, L]`` its simulated
    misses (LRU at its arena: the live pager's count; steps matched from the end, the decode steps the time split
    saw).

    - with a zero-read point ``zero_us`` (``zero_how``: ``"resident"``, the median compute of the resident run's
      steps that read nothing, :func:`~epqlab.studies.plan_model.resident_compute`; or ``"plain"``, plain
      llama.cpp's µs per decode step inside the same limit): C0 = ``zero_us``, c_wait the line from (0 waits, C0)
      to ``cal``'s (mean layers waiting per step, median compute) (:func:`~epqlab.studies.plan_model.compute_line`),
      kappa 0.
    - else :func:`~epqlab.studies.plan_model.fit_compute` of ``cal``'s per-step compute against its steps' MB
      (``"fit"`` or ``"median"``); without a per-step series the mean compute less ``probe_kappa`` x MB per step
      (``"probe"``)."""
    steps = max(1, cal.n_steps)
    y = np.asarray(cal.step_compute_us, float)
    mb = miss.astype(float) @ np.array([sh.unit_bytes for sh in shapes], float) / 1e6
    n = min(y.size, mb.size)
    if n == 0:
        mb_cal = cal.decode_read_bytes / steps / 1e6
        return max(0.0, cal.compute_us / steps - probe_kappa * mb_cal), probe_kappa, 0.0, "probe"
    if zero_us:
        c0, cw = compute_line(zero_us, y[-n:], step_waits(miss)[-n:])
        return c0, 0.0, cw, zero_how
    c0, kappa, how = fit_compute(y[-n:], mb[-n:])
    return c0, kappa, 0.0, how


def _plain_step_us(model, limit: int, prompt: str, text: str, n: int, *, headroom=HEADROOM, limit_mode=None,
                   n_threads=None, n_ctx=None) -> tuple[float | None, dict]:
    """``(µs per decode step or None, what the run measured)`` of plain llama.cpp (``pager=False``: every weight
    through mmap and the page cache) under the same hard limit, teacher-forced on ``text``; None when the run failed
    (the file did not fit, ...). The dict has the calibration fields ``plan`` reports (``decode_tok_s``,
    ``n_steps``, ``peak_charged``, ``limit_mode``, ``seconds``, ``status``)."""
    t0 = time.perf_counter()
    kw = {k: v for k, v in (("n_threads", n_threads), ("n_ctx", n_ctx)) if v}
    df = strict.run(model, [limit], prompt=prompt, n_predict=n, forced=text, pager=False, repeats=1,
                    headroom=headroom, limit_mode=limit_mode, **kw)
    run = (df.attrs.get("runs") or [{}])[0]
    st = run.get("stats") or {}
    tok_s = float(st.get("decode_tok_s") or 0.0) if run.get("status") == "PASS" else 0.0
    info = {"prefetch": None, "decode_tok_s": tok_s, "n_steps": max(0, int(st.get("n_gen") or 0) - 1),
            "peak_charged": int(run.get("peak_charged") or 0), "limit_mode": str(run.get("limit_mode")),
            "seconds": time.perf_counter() - t0, "status": run.get("status"), "reason": run.get("reason")}
    return (1e6 / tok_s if tok_s > 0 else None), info


def resident_run_possible(lay, class_slots: dict) -> str | None:
    """None when the arena of ``class_slots`` (slot bytes -> slots) can hold top-k experts of every MoE layer at
    once (each slot class: its layers x k slots), so the resident run can reach steps that read nothing; else why
    not, in words."""
    slot_b, _ = _classes(lay)
    k = int(lay.n_expert_used or 1)
    for sb in sorted(set(slot_b)):
        need = k * sum(1 for b in slot_b if b == sb)
        have = int(class_slots.get(sb, 0))
        if have < need:
            return (f"the smallest budget's arena holds {have} slots of {fmt_bytes(sb)}, fewer than top-{k} for each of "
                    f"its {need // k} layers ({need}): no decode step can read nothing there")
    return None


def _terms(cal_off: Calibration, cal_pf: Calibration | None, lay, dev: DeviceTable, io_threads: int,
           kappa: float = 0.0, cal_res: Calibration | None = None, res_why: str | None = None,
           plain_us: float | None = None) -> dict:
    slot_b, shapes = _classes(lay)
    dec = cal_off.log.phase != 0
    m_off, _ = simulate_misses(cal_off.log, slot_b, cal_off.class_slots)
    model_read = float(step_read_us(m_off[dec], shapes, io_threads, dev).sum())
    steps = max(1, cal_off.n_steps)
    k_io = cal_off.io_us / model_read if model_read > 0 and cal_off.io_us > 0 else 1.0
    # compute with nothing read (the resident run's or plain llama.cpp's) and per layer waiting (_fit_steps)
    res_c0, res_steps = (resident_compute(cal_res.step_wall_us, cal_res.step_compute_us) if cal_res is not None
                         else (None, 0))
    zero = (res_c0, "resident") if res_c0 is not None else (plain_us, "plain")
    c0, kappa, c_wait, how = _fit_steps(cal_off, m_off[dec], shapes, kappa, *zero)
    base = dict(compute_us=c0, kappa_us_per_mb=kappa, wait_us_per_layer=c_wait,
                map_us_per_miss=cal_off.map_us / cal_off.misses if cal_off.misses else 0.0,
                k_io=k_io, io_threads=io_threads, window_us=cal_off.layer_compute_us,
                prefill_us_per_token=max(0.0, 1e6 * cal_off.prefill_s - 1e6 * cal_off.prefill_read_bytes
                                         / (dev.best(float(np.mean([sh.unit_bytes / sh.n_mat for sh in shapes]))) * 1e6))
                / max(1, cal_off.prefill_tokens))
    out = {"off": Terms(**base, notes={"model_read_us": model_read, "measured_io_us": cal_off.io_us, "compute_fit": how,
                                       "sim_decode_misses": int(m_off[dec].sum()), "live_decode_misses": cal_off.misses,
                                       "resident_steps": res_steps, "resident_why": res_why, "plain_us": plain_us})}
    if cal_pf is not None:
        psteps = max(1, cal_pf.n_steps)
        served = cal_pf.prefetch_used + cal_pf.misses
        unit = float(np.mean([sh.unit_bytes for sh in shapes]))
        t = Terms(**base, predict_us=cal_pf.predict_us / psteps, phi=cal_pf.prefetch_used / served if served else 0.0,
                  waste_per_layer=cal_pf.prefetch_wasted_bytes / unit / psteps / len(shapes))
        m_pf, _ = simulate_misses(cal_pf.log, slot_b, cal_pf.class_slots)
        pdec = cal_pf.log.phase != 0
        t.predict_misses_per_step = float(m_pf[pdec].sum(1).mean()) if pdec.any() else 0.0
        model_wait = float(prefetch_wait_us(m_pf[pdec], shapes, t, dev).sum())
        t.k_pf = cal_pf.io_us / model_wait if model_wait > 0 and cal_pf.io_us > 0 else 1.0
        t.notes = {"model_wait_us": model_wait, "measured_io_us": cal_pf.io_us, "prefetch_used": cal_pf.prefetch_used,
                   "live_decode_misses": cal_pf.misses}
        out[cal_pf.prefetch] = t
    return out


def plan(model, budgets="auto", *, text: str | None = None, n: int = DEFAULT_N, prompt: str = DEFAULT_PROMPT,
         predictor=None, n_threads: int | None = None, n_ctx: int | None = None, io_threads: int | None = None,
         policies=None, reprobe: bool = False, progress: bool = False, cache_root=None, limit_mode=None,
         row_policies: str = "best+default") -> Plan:
    """Forecast decode and prefill speed of ``model`` at each RAM budget, per eviction policy and prefetch setting.

    Args:
        model: path to a MoE GGUF.
        budgets: ``"4GiB,8GiB"``, a list of sizes, or ``"auto"`` (:func:`auto_budgets`: arenas of 1/8, 1/4,
            1/2 and all of the routed experts).
        text: the text whose first half the calibration decodes teacher-forced (its second half is
            :meth:`Plan.verify`'s); default the held-out prose shipped with epqlab.
        n: calibration decode steps (and each verification run's), >= 16.
        predictor: an :class:`~epqlab.engine.predictor.ExpertPredictor` path for the trained-prefetch rows;
            default ``<model>.predictor.npz`` when it exists, else the rows use router lookahead.
        n_threads, n_ctx, io_threads: as :class:`epqlab.Session`.
        policies: eviction policies to simulate (default
            :data:`PLAN_POLICIES`, Belady beside them; any of :data:`epqlab.constants.ONLINE_POLICIES` but static).
        reprobe: probe the device even when a cached probe exists.
        cache_root: where the probe cache lives (default the epqlab cache).
        limit_mode: how the calibration runs' memory limit is enforced (:func:`epqlab.memory.limits.run_limited`).
        row_policies: which policies get forecast rows at each budget: ``"best+default"`` (the best simulated
            one and :data:`epqlab.constants.DEFAULT_POLICY`) or ``"best"``.

    Each calibration run (prefetch off, the predictor, and the resident run or plain llama.cpp: see the module
    docstring) is a child process with ``Session(ram_budget=<smallest budget>)`` under a hard memory
    limit of that budget + 16 MiB (:mod:`epqlab.studies.strict`, as each :meth:`Plan.verify` row); this
    process loads no model.

    Returns:
        :class:`Plan`.

    Raises:
        ArenaTooSmall: the smallest budget cannot open the model (the message quotes the smallest that can).
        PlanInputError: unreadable budgets, n < 16, a text too short for n decode steps.
        ProbeUnusableError, ProbeCacheError: see :func:`epqlab.studies.plan_probe.probe_for_plan`.
        ValueError: a predictor fitted on another model; EpqlabError: a predictor file that is not one.
    """
    t0 = time.perf_counter()
    if int(n) < MIN_TEXT_TOKENS:
        raise PlanInputError(f"n must be >= {MIN_TEXT_TOKENS} calibration decode steps, got {n}")
    if os.path.exists(model) and not os.path.isfile(model):
        raise ProbeUnusableError(f"{model} is not a regular file (a pipe or a device?): the pager reads a model file "
                                 "with O_DIRECT at offsets; give the path of the .gguf itself")
    lay = inspect(model)
    io_threads = int(io_threads or default_io_threads())
    if text is None:
        text = heldout_texts()["prose"]
    cal_text, verify_text = split_text(text)
    if len(cal_text.split()) < n or len(verify_text.split()) < n:
        raise PlanInputError(f"the text has {len(text.split())} words: too short to calibrate on its first half and verify "
                             f"on its second with {n} tokens each; give a longer --text or a smaller --n")
    pred_path = predictor if predictor is not None else default_predictor_path(model)
    have_pred = predictor is not None or os.path.exists(pred_path)
    if have_pred:
        resolve_predictor("trained", pred_path, 1, len(lay.layers), lay.n_expert, None, model=lay.path)
    pf_mode = "trained" if have_pred else "lookahead"
    pols = tuple(policies or PLAN_POLICIES)
    b = parse_budgets(budgets)
    exact, smallest, refusal = quote(model, n_threads=n_threads, n_ctx=n_ctx, io_threads=io_threads)
    if b == "auto":
        b = auto_budgets(model, exact)
    elif b[0] < exact:
        raise ArenaTooSmall(f"ram_budget {fmt_bytes(b[0])} is too small for " + refusal.split(" is too small for ", 1)[-1])
    b0 = b[0]

    dev_df, probe_info = probe_for_plan(lay, io_threads, cache_root or cache_dir(), reprobe=reprobe, progress=progress)
    dev = DeviceTable.from_frame(dev_df)
    common = dict(n_threads=n_threads, n_ctx=n_ctx, io_threads=io_threads)
    with tempfile.TemporaryDirectory(prefix="epq-plan-") as td:
        cal_off = _calibrate(model, b0 + HEADROOM, prompt, cal_text, n, td, limit_mode=limit_mode, **common)
        cal_pf = _calibrate(model, b0 + HEADROOM, prompt, cal_text, n, td, prefetch=pf_mode,
                            predictor=pred_path if have_pred else None, limit_mode=limit_mode, **common)
        # the compute term's zero-read point: steps that read nothing where the smallest budget's arena holds
        # top-k of every layer; else plain llama.cpp where the whole file fits in the limit (mmap: the process
        # holds what it holds before the arena, with the experts' pages in place of an arena)
        res_why = resident_run_possible(lay, cal_off.class_slots)
        cal_res = plain_us = plain_info = None
        short = max(MIN_TEXT_TOKENS, int(n) // 2)
        if res_why is None:
            cal_res = _calibrate(model, b0 + HEADROOM, prompt, cal_text, short, td, limit_mode=limit_mode,
                                 extra=RESIDENT_RUN, tag="resident", **common)
        elif cal_off.used_before_arena + Pager.all_experts_bytes(lay) <= b0:
            plain_us, plain_info = _plain_step_us(model, b0 + HEADROOM, prompt, cal_text, short, limit_mode=limit_mode,
                                                  n_threads=n_threads, n_ctx=n_ctx)
    terms = _terms(cal_off, cal_pf, lay, dev, io_threads, kappa=float(probe_info.get("cpu_us_per_mb") or 0.0),
                   cal_res=cal_res, res_why=res_why, plain_us=plain_us)
    if row_policies not in ("best+default", "best"):
        raise PlanInputError(f"row_policies must be 'best+default' or 'best', got {row_policies!r}")
    rows, pol_rows = _forecast(lay, b, cal_off, cal_pf, terms, dev, pols, pf_mode, pred_path if have_pred else None,
                               with_default=row_policies == "best+default")
    best, rec = _recommend(rows, pf_mode, have_pred, cal_off)
    calib = {k: {f: getattr(c, f) for f in ("prefetch", "used_before_arena", "arena_bytes", "n_steps", "wall_us",
                                            "compute_us", "io_us", "map_us", "predict_us", "misses", "decode_hit_rate",
                                            "decode_tok_s", "prefetch_used", "prefetch_wasted_bytes", "seconds",
                                            "peak_charged", "limit_mode", "step_wall_us", "step_compute_us")}
             for k, c in (("off", cal_off), (pf_mode, cal_pf), ("resident", cal_res)) if c is not None}
    if plain_info is not None:
        calib["plain"] = plain_info
    return Plan(model=str(lay.path), budgets=b, rows=rows, policies=pol_rows, terms=terms,
                probe={**probe_info, "table": dev.mb_s}, calibration=calib, best=best, recommendation=rec,
                seconds=time.perf_counter() - t0, n_steps=int(n), prompt=prompt, verify_text=verify_text,
                n_threads=int(n_threads or 0) or None, n_ctx=n_ctx, predictor=pred_path if have_pred else None)


AUTO_FRACTIONS = (0.125, 0.25, 0.5, 1.0)  # ``budgets="auto"``: arenas of these shares of every routed expert
AUTO_MARGIN = 2**20                       # added to each auto budget for what a later load measures more


def quote(model, **kw) -> tuple[int, int, str]:
    """What a Session of ``model`` needs, measured in a child process (opened with a 1 MiB budget under a limit of
    what ``ram_budget="auto"`` allows): ``(exact, smallest, message)``: the usage before the arena plus reserve, read
    buffers and the smallest arena, "as measured now"; the smallest budget :class:`epqlab.ArenaTooSmall` quotes
    (with its margin for a later load); and the refusal's text."""

    lay = inspect(model)
    with tempfile.TemporaryDirectory(prefix="epq-plan-") as td:
        row = _run_one(str(lay.path), auto_budget().budget, 2**20, True, prompt="a", n_predict=1, policy=DEFAULT_POLICY,
                       session_kw={k: v for k, v in kw.items() if v}, limit_mode=None, timeout_s=600,
                       python=sys.executable, workdir=Path(td), tag="quote")
    reason = str(row.get("reason") or "")
    m = re.search(r"The smallest budget that works is (\d+) bytes .*that is (\d+) bytes as measured now", reason)
    if not m:
        raise EpqlabError(f"could not find the smallest budget of {lay.path.name}: {reason or row.get('status')}")
    return int(m.group(2)), int(m.group(1)), reason.split("ArenaTooSmall: ", 1)[-1]


def auto_budgets(model, exact: int | None = None, **kw) -> list[int]:
    """``budgets="auto"``: the process's usage before the arena, as a Session measures it (``exact`` from
    :func:`quote`, less the arena it needs), plus arenas of 1/8, 1/4, 1/2 and all of the routed experts (at
    least the smallest arena that works) and 1 MiB; those above what ``ram_budget="auto"`` would allow on this
    machine are left out (the smallest is always kept). Bytes, rounded up to MiB, ascending."""
    lay = inspect(model)
    if exact is None:
        exact = quote(model, **kw)[0]
    all_b = Pager.all_experts_bytes(lay)
    need = max(Pager.min_arena_bytes(lay), Pager.max_stage_bytes(lay))
    base = exact - need
    out = sorted({-(-(base + max(need, int(f * all_b)) + AUTO_MARGIN) // 2**20) * 2**20 for f in AUTO_FRACTIONS})
    cap = auto_budget().budget
    return [out[0]] + [b for b in out[1:] if b <= cap]


def _forecast(lay, budgets, cal_off, cal_pf, terms, dev, pols, pf_mode, pred_path, with_default=True):
    slot_b, shapes = _classes(lay)
    log = cal_off.log
    dec = log.phase != 0
    n_dec = max(1, int(dec.sum()))
    routed = sum(c.n_experts for c in lay.slot_classes)
    all_bytes = Pager.all_experts_bytes(lay)
    counts = np.zeros((log.n_layers, log.n_expert))
    for li in range(log.n_layers):
        ids, c = np.unique(log.experts[:, li][log.experts[:, li] >= 0], return_counts=True)
        counts[li, ids] = c
    union = expected_union(counts, log.n_tokens, PREFILL_TOKENS)
    rows, pol_rows = [], []
    for B in budgets:
        for pf in ("off", pf_mode):
            cal = cal_off if pf == "off" else cal_pf
            arena = min(all_bytes, B - cal.used_before_arena - cal.reserve - cal.read_buffers)
            if arena < Pager.min_arena_bytes(lay):
                continue
            cs = slots_at(lay, arena)
            if pf == "off":
                miss, agg = simulate_misses(log, slot_b, cs, pols + ("belady",))
            else:  # the predictor's copy makes this arena a little smaller: LRU again, the others' ratios kept
                miss, lru_here = simulate_misses(log, slot_b, cs, ("lru",))
                scale_lru = (lru_here["lru"][1] - lru_here["lru"][0]) / max(1, agg["lru"][1] - agg["lru"][0])
                agg = {p: (q - (q - h) * scale_lru, q) for p, (h, q) in agg.items()}
            lru_m = miss[dec]
            hit = {p: h / q for p, (h, q) in agg.items()}
            if pf == "off":
                pol_rows.append({"budget": B, "arena_bytes": arena, "slots": sum(cs.values()), **{p: hit[p] for p in hit}})
            best_pol = max(pols, key=lambda p: (round(hit[p], 6), p == DEFAULT_POLICY))
            lru_miss_total = max(1, agg["lru"][1] - agg["lru"][0]) if "lru" in agg else 1
            for pol in sorted(({best_pol, DEFAULT_POLICY} if with_default else {best_pol}) & set(pols)):
                s = (agg[pol][1] - agg[pol][0]) / lru_miss_total if "lru" in agg else 1.0
                m = lru_m * s
                t = terms["off"] if pf == "off" else terms[pf_mode]
                parts = decode_us_off(m, shapes, t, dev) if pf == "off" else decode_us_prefetch(m, shapes, t, dev)
                miss_bytes = float((m * np.array([sh.unit_bytes for sh in shapes])[None, :]).sum()) / n_dec
                bw = dev.best(float(np.mean([sh.unit_bytes / sh.n_mat for sh in shapes])))
                roof = max(t.compute_us, miss_bytes / (bw * 1e6) * 1e6) / 1e3
                pre = prefill_us(PREFILL_TOKENS, union, shapes, t, dev)
                dec_req = n_dec * log.k * log.n_layers
                kw = {"ram_budget": B, "policy": pol}
                if pf != "off":
                    kw["prefetch"] = pf
                    if pf == "trained":
                        kw["prefetch_predictor"] = pred_path
                rows.append(PlanRow(
                    budget=B, arena_bytes=int(arena), slots=sum(cs.values()), coverage=min(1.0, sum(cs.values()) / routed),
                    policy=pol, prefetch=pf, hit_rate=1.0 - float(m.sum()) / dec_req,
                    miss_mb_per_token=miss_bytes / 1e6, waits_per_token=float(step_waits(m).mean()) if m.size else 0.0,
                    decode_ms=parts["total"] / 1e3,
                    decode_tok_s=1e6 / parts["total"], parts_ms={k: v / 1e3 for k, v in parts.items() if k != "total"},
                    roofline_ms=roof, prefill_tok_s=PREFILL_TOKENS / (pre["total"] / 1e6) if pre["total"] else None,
                    session_kwargs_=kw))
    if not rows:
        raise PlanInputError("no budget leaves an arena for one layer's experts")
    return rows, pol_rows


def _recommend(rows, pf_mode, have_pred, cal_off):
    fastest = max(rows, key=lambda r: r.decode_tok_s)
    ok = [r for r in rows if r.decode_tok_s >= (1 - KNEE) * fastest.decode_tok_s]
    best = min(ok, key=lambda r: (r.budget, -r.decode_tok_s))
    same = [r for r in rows if r.budget == best.budget and r.policy == best.policy]
    off = next((r for r in same if r.prefetch == "off"), None)
    pf = next((r for r in same if r.prefetch != "off"), None)
    why = (f"the smallest budget within {KNEE:.0%} of the fastest forecast ({fastest.decode_tok_s:.2f} tok/s at "
           f"{fmt_bytes(fastest.budget)})")
    fit = None
    if pf and off and pf.decode_tok_s >= (1 + PAYS) * off.decode_tok_s:
        if not have_pred:
            mins = FIT_TOKENS * (cal_off.wall_us / max(1, cal_off.n_steps)) / 6e7
            fit = {"minutes": round(mins + 0.5, 1),
                   "why": f"router lookahead already forecasts {pf.decode_tok_s / off.decode_tok_s:.2f}x off; a fitted "
                          "predictor recalls more (docs/DESIGN.md §3c)"}
    elif best.prefetch != "off" and off is not None:
        best = off  # prefetch that does not pay by PAYS is not worth its reads
    return best, {"why": why, "fit_predictor": fit}


__all__ = ["plan", "auto_budgets", "quote", "PLAN_POLICIES", "Plan", "PlanRow", "Calibration", "PlanInputError", "parse_budgets", "split_text",
           "simulate_misses", "slots_at", "default_predictor_path"]
