"""The arithmetic of ``epqlab plan``: a paged decode step's time from a route trace, a device probe and the
calibrated terms, with nothing measured here (the engine side is :mod:`epqlab.studies.plan`).

The model (docs/DESIGN.md §9, "Forecasts"), per decode step t, in µs:

    T_off(t)   = C(t) + k_io * sum_l read(m[t,l]) + c_map * m[t]
    T_pf(t)    = C(t) + P(t) + k_pf * sum_l ( read((1 - phi) m[t,l]) + max(0, read(phi m[t,l] + w_l) - W) ) + c_map * m[t]
    C(t)       = C0 + kappa * MB(t) + c_wait * W(t),   W(t) = sum_l min(1, m[t,l])

- ``m[t,l]``: experts of layer l that step t misses at the arena's slots (the route trace replayed by the
  eviction simulators, :func:`epqlab.routes.simulate` / stack distances: exact for LRU, scaled for other policies);
  ``m[t]`` their sum.
- ``read(n)``: seconds to read n experts of layer l when their matrices are queued together on the pager's
  I/O threads: ``n * n_mat`` reads of ``unit_bytes / n_mat`` bytes at ``min(n * n_mat, io_threads)`` in flight,
  at the aggregate MB/s the device probe measured at that size and concurrency (linear between probed
  concurrencies).
- ``C(t)``: compute per decode step (attention + expert matmuls + the rest of the call, io wait and mapping taken
  out). A step that reads costs more compute than one that reads nothing: reads in flight take CPU from the two
  compute threads (pinning pages, completions: docs/DESIGN.md §3e measured 6-23 ms per token on the 35B shape),
  and each MoE layer that waits on a read stalls the compute threads' pool and resumes it. The second grows with
  the layers that wait, ``W(t)`` (a layer with one miss waits as long as one with k), not with the bytes: on the
  default model at 55% hits 25 of 30 layers still wait and compute stays near the all-miss value.
  ``C0`` is measured where the smallest budget can hold top-k experts of every layer: the resident run
  (cache-aware routing with a margin of 1, so each choice is served by a resident expert of its layer) decodes
  steps that read nothing, and C0 is their median compute (:func:`resident_compute`); elsewhere plain llama.cpp
  under the same limit, where the whole file fits it (its µs per step). ``c_wait`` is then the line from
  (0 waits, C0) to the paged calibration's (mean W, median compute) (:func:`compute_line`) and kappa = 0.
  Without either, ``C0`` and ``kappa`` are fitted on the calibration's own steps (:func:`fit_compute`): each
  step's measured compute against the MB its simulated misses read (a cold arena's first steps read far more
  than its last, which spreads MB(t)), a Theil-Sen line; where the steps' MB barely vary, kappa = 0 and C0 = the
  median step's compute. ``c_map``: mapping and bookkeeping µs per missed expert, from the same run; ``P``: the
  predictor's µs per step, from the prefetch calibration, scaled by a step's would-be misses over the
  calibration's (its reads and the evictions they cause are most of it; :func:`predict_us`).
- ``k_io``: measured io wait over the model's read time at the calibration budget (1 = the device delivers what
  the probe promised; above 1: reads slow each other and compute, or pay a latency the probe did not see).
- Prefetch: ``phi`` = share of would-be misses the predictor's reads served (its ``prefetch_used`` over
  ``prefetch_used + misses``, measured), started a window ``W`` (one layer's compute, µs) before they are
  needed; ``w_l`` the wasted (mispredicted) expert reads per layer and step that share the device; ``k_pf``
  calibrated as ``k_io`` on the prefetch run.

Prefill of an ``n``-token prompt from a cold arena: ``n * c_pre + read_bytes / BW``, with ``c_pre`` the
calibration prompt's compute per token and the bytes those of each layer's expected distinct experts over n
tokens, ``U_l(n) = sum_e 1 - (1 - q_le)^n`` (q_le: share of the trace's tokens that routed to expert e),
read at the device's best aggregate MB/s for the matrix size.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class DeviceTable:
    """Aggregate read bandwidth by request size and concurrency, from :func:`epqlab.probe_io`.

    ``mb_s[size]`` = (concurrencies ascending, MB/s at each; MB = 10**6 bytes)."""
    mb_s: dict[int, tuple[tuple[int, ...], tuple[float, ...]]]

    @classmethod
    def from_frame(cls, df) -> "DeviceTable":
        out = {}
        for size, g in df.groupby("request_bytes"):
            g = g.sort_values("concurrency")
            out[int(size)] = (tuple(int(c) for c in g.concurrency), tuple(float(x) for x in g.mb_s))
        if not out:
            raise ValueError("the device probe table is empty")
        return cls(out)

    def bandwidth(self, size: float, concurrency: float) -> float:
        """MB/s for ``size``-byte reads at ``concurrency`` in flight: the probed size nearest in log scale,
        linear between probed concurrencies, the end values outside them."""
        cs, bw = self.mb_s[self.nearest(size)]
        return float(np.interp(concurrency, cs, bw))

    def best(self, size: float) -> float:
        """The best MB/s at any concurrency for the probed size nearest ``size`` in log scale."""
        return float(max(self.mb_s[self.nearest(size)][1]))

    def nearest(self, size: float) -> int:
        """The probed request size (bytes) nearest ``size`` in log scale."""
        sizes = np.array(sorted(self.mb_s), np.float64)
        return int(sizes[np.argmin(np.abs(np.log(sizes) - np.log(max(size, 1.0))))])


def read_us(n_experts: float, unit_bytes: int, n_mat: int, io_threads: int, dev: DeviceTable) -> float:
    """µs to read ``n_experts`` units of ``unit_bytes`` split in ``n_mat`` matrix reads, queued together on
    ``io_threads`` threads (module docstring). 0 for no experts; fractional counts scale the bytes."""
    if n_experts <= 0:
        return 0.0
    reads = n_experts * n_mat
    size = unit_bytes / n_mat
    bw = dev.bandwidth(size, min(max(reads, 1.0), io_threads))
    return reads * size / (bw * 1e6) * 1e6


@dataclass
class Terms:
    """The calibrated terms of the model (module docstring), each measured on this machine by ``plan``."""
    compute_us: float            # C0: per decode step, with nothing read
    map_us_per_miss: float       # c_map
    k_io: float                  # measured io wait / modelled read time, prefetch off
    kappa_us_per_mb: float = 0.0  # kappa: compute µs added per MB read in the step
    wait_us_per_layer: float = 0.0  # c_wait: compute µs added per MoE layer whose step waits on a read
    predict_us: float = 0.0      # P, measured at predict_misses_per_step would-be misses per step
    predict_misses_per_step: float = 0.0  # 0: P is fixed; else P scales with a step's misses, capped at P
    phi: float = 0.0             # share of would-be misses served by prefetch reads
    waste_per_layer: float = 0.0  # w_l: wasted expert reads per layer and step
    window_us: float = 0.0       # W: one layer's compute
    k_pf: float = 1.0            # as k_io, on the prefetch run
    prefill_us_per_token: float = 0.0  # c_pre
    io_threads: int = 1
    notes: dict = field(default_factory=dict)


@dataclass
class LayerShape:
    """What a layer's miss costs to read: its unit (one expert's matrices) and the number of matrices."""
    unit_bytes: int
    n_mat: int


def step_read_us(misses_tl: np.ndarray, shapes: list[LayerShape], io_threads: int, dev: DeviceTable) -> np.ndarray:
    """Modelled read µs of each step, ``sum_l read(m[t,l])``: float ``[T]`` from misses ``[T, L]``."""
    out = np.zeros(misses_tl.shape[0])
    for li, sh in enumerate(shapes):
        col = misses_tl[:, li]
        for n in np.unique(col):
            if n > 0:
                out[col == n] += read_us(float(n), sh.unit_bytes, sh.n_mat, io_threads, dev)
    return out


def step_mb(misses_tl: np.ndarray, shapes, extra_per_layer: float = 0.0) -> np.ndarray:
    """MB (10**6 bytes) each step reads: its misses' units plus ``extra_per_layer`` units per layer: float ``[T]``."""
    unit = np.array([sh.unit_bytes for sh in shapes], np.float64)
    return ((misses_tl + extra_per_layer) * unit[None, :]).sum(1) / 1e6


def step_waits(misses_tl: np.ndarray) -> np.ndarray:
    """MoE layers per step whose step waits on a read, ``W(t) = sum_l min(1, m[t,l])``: float ``[T]`` (a fractional
    count, as the policies' scaled misses are, is the chance that the layer misses)."""
    return np.minimum(1.0, np.asarray(misses_tl, float)).sum(1)


def compute_us(misses_tl: np.ndarray, shapes, terms: Terms, extra_per_layer: float = 0.0) -> float:
    """Mean compute µs per step, ``C0 + kappa * MB(t) + c_wait * W(t)`` (module docstring)."""
    mb = step_mb(misses_tl, shapes, extra_per_layer)
    w = step_waits(misses_tl)
    return (terms.compute_us + terms.kappa_us_per_mb * (float(mb.mean()) if mb.size else 0.0)
            + terms.wait_us_per_layer * (float(w.mean()) if w.size else 0.0))


def predict_us(misses_tl: np.ndarray, terms: Terms) -> float:
    """The predictor's µs per step: ``P`` scaled by the step's would-be misses over those it was measured at
    (``P * min(1, mean m[t] / predict_misses_per_step)``: issuing its reads and the evictions they cause scale with
    the misses it covers), or ``P`` when that count is 0."""
    if terms.predict_misses_per_step <= 0:
        return terms.predict_us
    m = float(np.asarray(misses_tl, float).sum(1).mean()) if np.size(misses_tl) else 0.0
    return terms.predict_us * min(1.0, m / terms.predict_misses_per_step)


def decode_us_off(misses_tl: np.ndarray, shapes, terms: Terms, dev: DeviceTable) -> dict:
    """Mean µs per decode step with prefetch off and its parts: ``{"total", "compute", "io", "map"}``."""
    io = terms.k_io * step_read_us(misses_tl, shapes, terms.io_threads, dev)
    mp = terms.map_us_per_miss * misses_tl.sum(1)
    comp = compute_us(misses_tl, shapes, terms)
    parts = {"compute": comp, "io": float(io.mean()) if io.size else 0.0,
             "map": float(mp.mean()) if mp.size else 0.0, "predict": 0.0}
    parts["total"] = parts["compute"] + parts["io"] + parts["map"]
    return parts


def prefetch_wait_us(misses_tl: np.ndarray, shapes, terms: Terms, dev: DeviceTable) -> np.ndarray:
    """Modelled wait µs per step with prefetch (module docstring, before ``k_pf``): float ``[T]``."""
    out = np.zeros(misses_tl.shape[0])
    phi, W = terms.phi, terms.window_us
    for li, sh in enumerate(shapes):
        col = misses_tl[:, li]
        for n in np.unique(col):
            late = read_us((1 - phi) * n, sh.unit_bytes, sh.n_mat, terms.io_threads, dev)
            early = read_us(phi * n + terms.waste_per_layer, sh.unit_bytes, sh.n_mat, terms.io_threads, dev)
            out[col == n] += late + max(0.0, early - W)
    return out


def decode_us_prefetch(misses_tl: np.ndarray, shapes, terms: Terms, dev: DeviceTable) -> dict:
    """Mean µs per decode step with prefetch and its parts: ``{"total", "compute", "io", "map", "predict"}``."""
    io = terms.k_pf * prefetch_wait_us(misses_tl, shapes, terms, dev)
    mp = terms.map_us_per_miss * misses_tl.sum(1)
    comp = compute_us(misses_tl, shapes, terms, terms.waste_per_layer)
    parts = {"compute": comp, "io": float(io.mean()) if io.size else 0.0,
             "map": float(mp.mean()) if mp.size else 0.0, "predict": predict_us(misses_tl, terms)}
    parts["total"] = parts["compute"] + parts["io"] + parts["map"] + parts["predict"]
    return parts


def expected_union(counts_le: np.ndarray, n_routed: int, n_tokens: int) -> np.ndarray:
    """Expected distinct experts per layer over ``n_tokens`` tokens, ``U_l(n) = sum_e 1 - (1 - q_le)^n`` with
    ``q_le = counts_le / n_routed`` (tokens of the trace routed to e over tokens routed): float ``[L]``."""
    q = np.clip(np.asarray(counts_le, np.float64) / max(int(n_routed), 1), 0.0, 1.0)
    return (1.0 - (1.0 - q) ** int(n_tokens)).sum(1)


def prefill_us(n_tokens: int, union_l: np.ndarray, shapes, terms: Terms, dev: DeviceTable) -> dict:
    """µs for an ``n_tokens`` prompt from a cold arena: ``{"total", "compute", "io", "read_bytes"}``."""
    read_bytes = float(sum(u * sh.unit_bytes for u, sh in zip(union_l, shapes)))
    io = sum(u * sh.unit_bytes / (dev.best(sh.unit_bytes / sh.n_mat) * 1e6) * 1e6 for u, sh in zip(union_l, shapes))
    comp = n_tokens * terms.prefill_us_per_token
    return {"total": comp + io, "compute": comp, "io": io, "read_bytes": read_bytes}


__all__ = ["DeviceTable", "LayerShape", "Terms", "read_us", "step_mb", "step_read_us", "decode_us_off", "decode_us_prefetch",
           "prefetch_wait_us", "expected_union", "prefill_us", "fit_compute", "resident_compute", "compute_line", "step_waits",
           "compute_us", "predict_us"]


FIT_MIN_SPREAD = 0.25  # (max - min) of the steps' MB over their mean below which kappa is not fitted


def fit_compute(step_us, step_mb) -> tuple[float, float, str]:
    """``(C0 µs, kappa µs/MB, how)`` from per-step compute ``step_us`` (µs, wall - io wait - map) and the MB each
    step read ``step_mb``: the Theil-Sen line (the median of the pairwise slopes, clipped at 0, then the median
    intercept; Sen 1968, doi:10.1080/01621459.1968.10480934), robust to the few steps a page fault or a busy core
    slows. ``how``: ``"fit"``, or ``"median"`` (kappa 0, C0 the median) when fewer than 8 steps or their MB spread
    is under :data:`FIT_MIN_SPREAD` of the mean. Raises ValueError when the two differ in length."""
    y = np.asarray(step_us, float)
    x = np.asarray(step_mb, float)
    if x.shape != y.shape:
        raise ValueError(f"{y.size} step times but {x.size} step MB")
    if y.size == 0:
        return 0.0, 0.0, "median"
    mean = float(x.mean())
    if y.size < 8 or mean <= 0 or (float(x.max()) - float(x.min())) < FIT_MIN_SPREAD * mean:
        return float(np.median(y)), 0.0, "median"
    i, j = np.triu_indices(y.size, 1)
    dx = x[j] - x[i]
    ok = np.abs(dx) > 1e-9
    slope = max(0.0, float(np.median((y[j] - y[i])[ok] / dx[ok]))) if ok.any() else 0.0
    c0 = float(np.median(y - slope * x))
    if c0 < 0:  # a line through the cold steps that predicts negative compute at zero reads: not trusted
        return float(np.median(y)), 0.0, "median"
    return c0, slope, "fit"


RESIDENT_SHARE = 0.02   # a step "read nothing" when its io wait + mapping is at most this share of its wall time
RESIDENT_MIN_STEPS = 4  # fewer such steps than this: no resident compute


def resident_compute(step_wall_us, step_compute_us) -> tuple[float | None, int]:
    """``(C0 µs or None, steps)``: the median compute of the decode steps that read nothing, from a run whose
    experts were all resident (the calibration's cache-routed run, :func:`epqlab.studies.plan.plan`): a step
    whose io wait + mapping (``wall - compute``) is at most :data:`RESIDENT_SHARE` of its wall time. None when
    fewer than :data:`RESIDENT_MIN_STEPS` steps qualify. Raises ValueError when the series differ in length."""
    w = np.asarray(step_wall_us, float)
    c = np.asarray(step_compute_us, float)
    if w.shape != c.shape:
        raise ValueError(f"{w.size} step wall times but {c.size} step compute times")
    ok = (w - c) <= RESIDENT_SHARE * w
    n = int(ok.sum())
    return (float(np.median(c[ok])) if n >= RESIDENT_MIN_STEPS else None), n


def compute_line(c0_us: float, off_compute_us, off_x) -> tuple[float, float]:
    """``(C0 µs, slope µs per unit of x)``: the compute line from the zero-read point ``(0, c0_us)`` (the resident
    run's or plain llama.cpp's compute per step) to the paged calibration's (mean of ``off_x`` per step, median of
    ``off_compute_us``); ``plan`` gives x = the MoE layers that wait on a read, so the slope is c_wait. The slope
    is clipped at 0 (reads do not speed compute up; a slower zero-read run is noise), and is 0 when the
    calibration's steps have no x (nothing to draw the line to)."""
    y = np.asarray(off_compute_us, float)
    x = np.asarray(off_x, float)
    if y.size == 0 or x.size == 0 or float(x.mean()) <= 0:
        return float(c0_us), 0.0
    return float(c0_us), max(0.0, (float(np.median(y)) - float(c0_us)) / float(x.mean()))
