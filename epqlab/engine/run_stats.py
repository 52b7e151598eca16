"""Run statistics of a :class:`epqlab.Session`: the counters read from the pager and the hook, the
stats dict of one generation (field meanings: :meth:`epqlab.Session.generate`), the cumulative
``Session.stats``, memory parts, and the JSON-lines stats file. docs/DESIGN.md lists the run-stats fields."""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from ..results import check_writable, clean_json

from ..memory.usage import read_bytes, sample
from .time_split import decode_series, decode_summary

# Counters the pager and the hook keep for prefetch (differenced per run like the others).
PREFETCH_COUNTERS = ("prefetch_units", "prefetch_bytes", "prefetch_used", "prefetch_used_bytes", "prefetch_failed",
                     "prefetch_cancelled", "prefetch_wait_us", "prefetch_map_us", "pred_layers", "pred_experts", "pred_actual", "pred_correct",
                     "pred_gated")

# The hook's counters of the lossy knobs (skip-cold, cache/batch-aware routing, adaptive-k, the union budget;
# native/engine/hook.h).
LOSSY_COUNTERS = ("lossy_slots", "route_changed", "route_substituted", "adaptive_dropped", "lossy_bytes_saved",
                  "budget_dropped", "budget_overflow", "lossy_union_before", "lossy_union_after")

# Pager + hook counters differenced per run (pager.h / hook.h name each one).
COUNTERS = ("requests", "hits", "misses", "evictions", "evictions_stale_left", "evictions_current_left",
            "evictions_stale_right", "evictions_current_right", "bytes_read", "read_us", "io_wait_us", "map_us", "evict_unmap_us", "evict_unmap_io_us",
            "load_calls", "ubatches", "layer_loads", "staged_layers", "staged_tokens", "staged_bytes",
            "staged_reads", "staged_copies", "stage_lends", "stage_lent_bytes", "stage_lent_evictions", "tokens_routed", "cold_skipped", "pipelined_loads", "pipelined_early",
            "admission_staged",
            "graph_asks", "graph_pieces") + PREFETCH_COUNTERS + LOSSY_COUNTERS


def lossy_fields(session, d: dict) -> dict:
    """The lossy knobs' settings and derived rates from counters ``d``: ``route_bias``, ``route_delta``,
    ``adaptive_k`` (``[thresholds, ks]`` or None), ``expert_budget`` (0 = off), and ``routing_agreement``: the share of (token, layer,
    slot) choices a lossy knob examined that were computed with the router's own expert (1.0 when none
    was examined; skip-cold's skipped experts, substitutions and adaptive-k's dropped slots count as changed)."""
    ak = getattr(session, "adaptive_k", None)
    return {"route_bias": getattr(session, "route_bias", None), "route_delta": getattr(session, "route_delta", 0.0),
            "adaptive_k": [list(ak[0]), list(ak[1])] if ak else None, "expert_budget": getattr(session, "expert_budget", 0),
            "routing_agreement": 1.0 - d["route_changed"] / d["lossy_slots"] if d.get("lossy_slots") else 1.0}


def counters(session) -> dict:
    """Current pager and hook counters of ``session`` (every name of :data:`COUNTERS`, 0 when absent),
    plus ``pass_count`` (forward passes in the pager's history) and ``storage_read_bytes``
    (``/proc/self/io`` read_bytes, None where unavailable), which are not differenced the same way."""
    pager = session.pager
    c = dict(pager.stats) if pager else {}
    c.update(session.decoder.hook_stats())
    out = {k: c.get(k, 0) for k in COUNTERS}
    out["pass_count"] = len(pager.pass_history()[0]) if pager else 0
    out["storage_read_bytes"] = read_bytes()
    return out


WARMUP_PASSES = 8
"""Decode passes per prompt left out of the steady-state hit rate (the arena fills with the prompt's working set first)."""


def pass_rates(history: tuple[np.ndarray, np.ndarray], kind: np.ndarray) -> dict:
    """Hit rates from a pager's per-pass history (``Pager.pass_history()``) and each pass's kind
    (0 prefill, 1 decode warm-up, 2 steady decode): ``hit_rate`` (all), ``decode_hit_rate``,
    ``steady_hit_rate``, and the decode request count ``decode_requests``."""
    req, hit = (np.asarray(a, np.int64) for a in history)
    if len(req) != len(kind):
        raise ValueError(f"pass history has {len(req)} passes but {len(kind)} pass kinds were given")

    def rate(mask):
        r = int(req[mask].sum())
        return int(hit[mask].sum()) / r if r else 0.0

    return {"hit_rate": rate(slice(None)), "decode_hit_rate": rate(kind >= 1), "steady_hit_rate": rate(kind == 2),
            "decode_requests": int(req[kind >= 1].sum())}


def prefetch_fields(d: dict) -> dict:
    """Run-stat fields from differenced counters ``d`` (PREFETCH_COUNTERS).

    precision = |predicted ∩ selected| / |predicted|, recall = |predicted ∩ selected| / |selected|,
    summed over the (token, layer) pairs that had a prediction; ``prefetch_wasted_bytes`` = bytes
    read speculatively whose expert was not requested before it was evicted or the run ended.
    """
    pe, pa, pc = d.get("pred_experts", 0), d.get("pred_actual", 0), d.get("pred_correct", 0)
    return {
        "prefetch_precision": pc / pe if pe else 0.0,
        "prefetch_recall": pc / pa if pa else 0.0,
        "prefetch_wasted_bytes": max(0, d.get("prefetch_bytes", 0) - d.get("prefetch_used_bytes", 0)),
    }


def scoped_rates(session, c0: dict, c1: dict, c2: dict) -> dict:
    """decode_hit_rate and steady_hit_rate of one run (counters before the run, after its prefill,
    after it), by the definitions of this module (steady state: decode passes after the first
    :data:`WARMUP_PASSES`)."""
    pager = session.pager
    if not pager:
        return {"decode_hit_rate": 0.0, "steady_hit_rate": 0.0}
    a, b, c = c0["pass_count"], c1["pass_count"], c2["pass_count"]
    hist = tuple(h[a:c] for h in pager.pass_history())
    kind = np.zeros(c - a, np.int8)
    kind[b - a:] = 1
    kind[b - a + WARMUP_PASSES:] = 2
    r = pass_rates(hist, kind)
    return {"decode_hit_rate": r["decode_hit_rate"], "steady_hit_rate": r["steady_hit_rate"]}


def peak_fields(session) -> dict:
    """Peaks of the session's memory sampler, bytes (sampled per decode call)."""
    p = session.peak.peak
    return {"peak_rss_anon": p.rss_anon, "peak_rss_shmem": p.rss_shmem, "peak_rss_file": p.rss_file,
            "peak_arena_resident": p.arena_resident, "peak_total": session.peak.peak_total}


def memory_parts(session) -> dict:
    """How the RAM budget is spent, bytes: see :meth:`epqlab.Session.memory_parts`."""
    pager = session.pager
    now = sample(arena_resident=pager.arena_resident_bytes if pager else 0, fill_mapped=pager.fill_bytes if pager else 0)
    return {"budget": session.budget_bytes, "used_before_arena": session.used_before_arena,
            "dense": int(session.load_report.get("dense_bytes", 0)),
            "arena": pager.arena_bytes if pager else 0, "stage_reserve": session.stage_reserve,
            "reserve": session.reserve_bytes, "read_buffers": getattr(session, "read_buffer_bytes", 0),
            "now": {"rss_anon": now.rss_anon, "shmem": now.shmem, "rss_file": now.rss_file, "total": now.total}}


def run_stats(session, n_prompt: int, n_gen: int, passes: int, t_prefill: float, t_decode: float,
              c0: dict, c1: dict, c2: dict, n_prompt_reused: int = 0) -> dict:
    """Stats of one generation: counters ``c0`` (before), ``c1`` (after the prefill), ``c2`` (after);
    ``passes``: single-token decode passes run (the first generated token comes from the prefill, so
    usually n_gen - 1; decode rates divide by it); times in s; ``n_prompt_reused``: prompt tokens
    whose KV entries were kept from the previous call (not decoded again)."""
    d = {k: c2[k] - c0[k] for k in COUNTERS}
    lay = session.layout
    pager = session.pager
    n_decoded = n_prompt - n_prompt_reused
    return {
        "model": str(lay.path), "arch": lay.architecture, "pager": session.paged,
        "budget_bytes": session.budget_bytes, "arena_bytes": pager.arena_bytes if pager else 0,
        "slot_classes": pager.stats["slot_classes"] if pager else [],
        "policy": session.policy if pager else None, "n_expert_used": session.n_expert_used,
        "io_threads": pager.io_threads if pager else 0,
        "expert_addressing": getattr(session, "expert_addressing", None),
        "io_uring": getattr(session, "io_uring", None),
        "direct_io": pager.direct_io if pager else False,
        "n_threads": session.decoder.n_threads, "skip_cold": session.skip_cold,
        "n_prompt": n_prompt, "n_prompt_reused": n_prompt_reused, "n_gen": n_gen,
        "prefill_s": t_prefill, "decode_s": t_decode,
        "prefill_tok_s": n_decoded / t_prefill if t_prefill > 0 else 0.0,
        "decode_passes": passes,
        "decode_tok_s": passes / t_decode if t_decode > 0 and passes else 0.0,
        **d,
        "hit_rate": d["hits"] / d["requests"] if d["requests"] else 0.0,
        **scoped_rates(session, c0, c1, c2),
        "decode_misses": d["misses"] - (c1["misses"] - c0["misses"]),
        "ssd_bytes": d["bytes_read"],
        "prefill_ssd_bytes": c1["bytes_read"] - c0["bytes_read"],
        "ssd_bytes_per_token": d["bytes_read"] / max(1, n_decoded + n_gen),
        "decode_ssd_bytes_per_token": (c2["bytes_read"] - c1["bytes_read"]) / max(1, passes),
        # graph pieces per decode pass: each is a thread-pool kick-off and barrier (hook.h, hook_stats)
        "decode_graph_pieces_per_pass": (c2["graph_pieces"] - c1["graph_pieces"]) / max(1, passes),
        "io_wait_s": d["io_wait_us"] / 1e6,
        "decode_io_wait_s": (c2["io_wait_us"] - c1["io_wait_us"]) / 1e6,
        "storage_read_bytes": (c2["storage_read_bytes"] - c0["storage_read_bytes"]
                               if c0["storage_read_bytes"] is not None and c2["storage_read_bytes"] is not None else None),
        "load_s": session.load_s, "load_bytes_read": session.load_report["load_bytes_read"],
        "dense_weights": session.dense_weights,
        **peak_fields(session), "memory": memory_parts(session),
        "memory_limit_mode": "sampled",
        "prefetch": session.prefetch, "read_segment_bytes": session.read_segment_bytes, **prefetch_fields(d),
        **decode_split(session, passes), **lossy_fields(session, d),
    }


def batch_stats(session, batcher, requests, c0: dict, c1: dict, wall_s: float) -> dict:
    """Stats of one batched call (:meth:`epqlab.Session.generate_batch`): counters ``c0`` before and ``c1``
    after, ``wall_s`` seconds. Fields: the run's settings (model, pager, policy, arena, ``n_seq_max``,
    ``max_batch``); ``n_sequences``, ``n_prompt`` and ``n_gen`` (summed); :meth:`Batcher.summary
    <epqlab.engine.batch.Batcher.summary>` of its decode steps (``decode_tok_s`` aggregate over every sequence,
    ``mean_batch``, ``batch_sizes``, ``union_per_layer``, ``ssd_bytes_per_token`` over decode steps, the
    steps' ``hit_rate``); ``ssd_bytes`` and ``hit_rate`` of the whole call (prefills included); ``sequences``
    (each one's figures) and ``steps`` (every step's record: tokens, wall, bytes read, union per layer)."""
    d = {k: c1[k] - c0[k] for k in COUNTERS}
    pager = session.pager
    summary = batcher.summary()
    seqs = [r.result.stats if r.result is not None else {} for r in requests]
    n_gen = sum(len(r.out) for r in requests)
    return {
        "kind": "batch", "model": str(session.layout.path), "arch": session.layout.architecture, "pager": session.paged,
        "budget_bytes": session.budget_bytes, "arena_bytes": pager.arena_bytes if pager else 0,
        "policy": session.policy if pager else None, "n_expert_used": session.n_expert_used,
        "n_threads": session.decoder.n_threads, "n_seq_max": session.n_seq_max, "max_batch": batcher.max_batch,
        "n_sequences": len(requests), "n_prompt": sum(len(r.tokens) for r in requests), "n_gen": n_gen,
        "wall_s": wall_s, "tok_s": n_gen / wall_s if wall_s > 0 else 0.0,
        "prefill_s": sum(x.get("prefill_s", 0.0) for x in seqs),
        **{f"decode_{k}" if k in ("steps", "tokens") else k: v for k, v in summary.items()
           if k not in ("active", "waiting", "max_batch", "ssd_bytes", "hit_rate")},
        "decode_ssd_bytes": summary["ssd_bytes"], "decode_hit_rate": summary["hit_rate"],
        "ssd_bytes": d["bytes_read"], "hit_rate": d["hits"] / d["requests"] if d["requests"] else 0.0,
        "requests": d["requests"], "hits": d["hits"], "misses": d["misses"], "evictions": d["evictions"],
        "staged_layers": d["staged_layers"], "io_wait_s": d["io_wait_us"] / 1e6,
        **peak_fields(session), "sequences": seqs, "steps": list(batcher.step_log),
    }


def decode_split(session, passes: int) -> dict:
    """The time split (:mod:`epqlab.engine.time_split`) of the last ``passes`` decode calls, from one frame:
    ``time_split`` (per-token means) and ``time_split_tokens`` (per-step series)."""
    session.time_split_log.take(session.decoder.engine)
    if not passes:
        return {"time_split": {}, "time_split_tokens": {}}
    frame = session.time_split_log.frame("token").tail(passes)
    return {"time_split": decode_summary(frame), "time_split_tokens": decode_series(frame)}


def cumulative_stats(session) -> dict:
    """Counters since the last reset plus arena, memory and load fields: :attr:`epqlab.Session.stats`."""
    pager = session.pager
    c = counters(session)
    c["hit_rate"] = c["hits"] / c["requests"] if c["requests"] else 0.0
    c.update(arena_bytes=pager.arena_bytes if pager else 0,
             slots=pager.n_slots if pager else 0,
             slot_classes=pager.stats["slot_classes"] if pager else [],
             policy=session.policy, n_expert_used=session.n_expert_used, load_s=session.load_s,
             expert_addressing=getattr(session, "expert_addressing", None),
             io_uring=getattr(session, "io_uring", None),
             fixed_reads=pager.native.fixed_reads if pager else 0, plain_reads=pager.native.plain_reads if pager else 0,
             budget_bytes=session.budget_bytes, used_before_arena=session.used_before_arena,
             arena_capacity_bytes=pager.capacity_bytes if pager else 0,
             resizes=len(getattr(session, "resize_events", ())),
             load_bytes_read=session.load_report["load_bytes_read"], dense_weights=session.dense_weights,
             memory=memory_parts(session), **peak_fields(session), skip_cold=session.skip_cold,
             **lossy_fields(session, c))
    return c


def append_jsonl(path, stats: dict) -> None:
    """Append ``stats`` as one line to the JSON-lines file ``path`` (folder created): one ``write`` of the
    whole line, and on any failure (a full disk, a file size limit) the file is cut back to where it was, so
    it stays parseable line by line (a file this call created is removed: no 0-byte file is left). A last line left unterminated by an older writer is ended first.

    Raises:
        OSError: the line could not be written (the file is as before).
    """
    line = (json.dumps(clean_json(stats)) + "\n").encode()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd, created = os.open(path, os.O_RDWR | os.O_APPEND), False
    except FileNotFoundError:
        try:
            fd, created = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_EXCL, 0o644), True
        except FileExistsError:  # another writer made it meanwhile
            fd, created = os.open(path, os.O_RDWR | os.O_APPEND), False
    try:
        start = os.fstat(fd).st_size
        if start and os.pread(fd, 1, start - 1) != b"\n":
            line = b"\n" + line
        try:
            view = memoryview(line)
            while view:
                view = view[os.write(fd, view):]
        except BaseException:
            os.ftruncate(fd, start)
            if created and start == 0:  # a file this call made: none rather than an empty one
                os.unlink(path)
            raise
    finally:
        os.close(fd)


def stats_frame(runs: list[dict]):
    """Run stats as a pandas DataFrame, one row per run (``slot_classes`` dropped: a list per row)."""
    import pandas as pd

    return pd.DataFrame([{k: v for k, v in r.items() if k != "slot_classes"} for r in runs])


__all__ = ["COUNTERS", "counters", "run_stats", "batch_stats", "cumulative_stats", "memory_parts", "append_jsonl",
           "check_writable", "stats_frame"]
