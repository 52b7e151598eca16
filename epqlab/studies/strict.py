"""Strict memory levels: generation in a child process under a hard memory limit, level by level.

:func:`run` is the table of seed 000's strict study, measured with a limit the kernel enforces
rather than one the program promises. For each level, each run:

1. drops the model file from the page cache (``posix_fadvise DONTNEED``; column ``cache_dropped``
   says whether it left less than 1 MiB resident), so every run starts cold and pays its own reads;
2. starts ``python -m epqlab.studies.strict_child`` inside a fresh memory limit of ``level`` bytes
   (:func:`epqlab.memory.limits.run_limited`: a child cgroup when one is writable -- it charges the page
   cache too -- else a 20 ms RSS sampler that kills past the limit; column ``limit_mode``);
3. in that child, opens a :class:`epqlab.Session` with ``ram_budget = level - headroom`` and
   generates ``n_predict`` greedy tokens after ``prompt``.

``headroom`` (default 16 MiB) is the part of the limit the Session's budget does not cover: the
interpreter's own growth after the arena is sized (Python objects, the JSON of the result, the
libc arenas of threads that start late), the same slack the issue's acceptance test allows
("a cgroup limit equal to its ram_budget + 16 MiB"). Raise it if runs at a level the budget says
fits are OOM-killed.

A child that is OOM-killed, refuses the budget (ArenaTooSmall) or raises is a FAIL row with the
reason; nothing is raised to the caller. Repeats are interleaved across levels (repeat 1 of every
level, then repeat 2, ...) so slow drift on a shared machine spreads over all levels; the table
gives medians (and min/max of decode tok/s).

Units: bytes unless a column says MB (10**6 bytes) or tok/s. Tables, the reading, figures and JSON:
:mod:`epqlab.studies.strict_report`.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

from ..memory.limits import run_limited
from ..memory.usage import drop_page_cache, page_cache_bytes
from ..errors import EpqlabError, ModelNotFoundError
from ..layout import inspect
from ..models import default_model
from ..units import fmt_bytes, parse_bytes
from .strict_report import format_table, plot, reading, save, to_json  # noqa: F401  (the report, as imported before)

DEFAULT_HEADROOM = 16 * 2**20  # bytes of the limit left outside ram_budget (interpreter growth)
DEFAULT_PROMPT = "A CPU cache is a small, fast memory that"
DEFAULT_TIMEOUT_S = 3600.0
CACHE_DROPPED_BELOW = 2**20  # a drop "worked" when less than this many bytes of the file stay cached


def parse_levels(levels) -> list[int]:
    """Levels as a sorted list of bytes from ``"2GiB,4GiB"``, ``["200MiB", 400 * 2**20]`` or one value.

    Raises ValueError for an empty list or an unparseable size."""
    if isinstance(levels, (str, bytes)):
        levels = [x for x in str(levels).replace(" ", ",").split(",") if x]
    elif isinstance(levels, (int, float)):
        levels = [levels]
    out = sorted({parse_bytes(x) for x in levels})
    if not out:
        raise ValueError("no memory levels given; pass e.g. levels='2GiB,4GiB,8GiB'")
    return out


def _model_files(model: str) -> list:
    """The model's files: every shard of a split GGUF, else ``[model]`` (also when it cannot be read:
    the child then reports why)."""
    try:
        return [str(f) for f in inspect(model, require_moe=False).files]
    except (EpqlabError, OSError, ValueError):
        return [model]


def _run_one(model: str, level: int, budget: int | None, pager: bool, *, prompt, n_predict, policy, session_kw,
             limit_mode, timeout_s, python, workdir: Path, tag: str, forced=None, simulate_routes=False) -> dict:
    files = _model_files(model)
    for f in files:  # every shard of a split model
        drop_page_cache(f)
    resident = sum(page_cache_bytes(f) for f in files)
    spec = {"model": model, "ram_budget": budget, "pager": pager, "policy": policy, "prompt": prompt,
            "n_predict": int(n_predict), "forced": forced, "session_kw": session_kw,
            "simulate_routes": bool(simulate_routes and pager),
            "route_log": (session_kw.get("route_log") or str(workdir / f"{tag}.routes.npz"))
            if simulate_routes and pager else None}
    spec_path, out_path = workdir / f"{tag}.spec.json", workdir / f"{tag}.out.json"
    spec_path.write_text(json.dumps(spec))
    if out_path.exists():
        out_path.unlink()
    lim = run_limited([python, "-m", "epqlab.studies.strict_child", str(spec_path), str(out_path)], level,
                      mode=limit_mode, timeout_s=timeout_s)
    child = json.loads(out_path.read_text()) if out_path.is_file() else None
    row = {"level": level, "pager": pager, "budget": budget, "cache_resident_before": resident,
           "cache_dropped": resident < CACHE_DROPPED_BELOW, **{k: v for k, v in lim.as_dict().items()
                                                                 if k not in ("stdout", "stderr")}}
    fill = int((child or {}).get("arena_fill_bytes") or 0)
    if fill:  # the pager's fill mapping: RssShmem counts the arena's pages twice while the Session lives (DESIGN §5)
        from_rss = row["peak_charged"] == row["peak_rss"]
        row["peak_rss_shmem"] = max(0, row["peak_rss_shmem"] - fill)
        row["peak_rss"] = max(0, row["peak_rss"] - fill)
        if from_rss:
            row["peak_charged"] = row["peak_rss"]
    row["arena_fill_bytes"] = fill
    if lim.killed or lim.timed_out:
        row.update(status="FAIL", reason=lim.reason)
    elif child is None:
        tail = (lim.stderr.strip().splitlines() or [""])[-1][-300:]
        row.update(status="FAIL",
                   reason=lim.reason or f"child exited with status {lim.returncode} and no result: {tail}")
    elif child.get("status") == "PASS" and lim.returncode == 0:
        row.update(status="PASS", reason=None)
    else:
        row.update(status="FAIL", reason=child.get("reason") or f"child exited with status {lim.returncode}")
    if child:
        row["child"] = child
    return row


def run(model=None, levels="2GiB,4GiB,8GiB", *, prompt: str = DEFAULT_PROMPT, n_predict: int = 16,
        forced: str | None = None, simulate_routes: bool = False, policy: str = "lru", pager: bool = True, repeats: int = 3, mmap_baseline: bool = False,
        headroom=DEFAULT_HEADROOM, limit_mode: str | None = None, timeout_s: float | None = DEFAULT_TIMEOUT_S,
        python: str | None = None, progress: bool = False, variants: dict | None = None, between_rounds=None,
        **session_kw):
    """Generate under hard memory limits, one child process per run, and tabulate.

    Args:
        model: GGUF path; None = the default model (:func:`epqlab.models.default_model`).
        levels: memory limits (bytes or strings like ``"4GiB"``; list or comma-separated string).
        prompt, n_predict: the greedy generation each run does (n_predict tokens).
        forced: teacher-forced decode: feed this text one token per decode step instead of the greedy
            tokens (:meth:`epqlab.Session.stream`); use it on a random-weight model, whose own output
            repeats itself and routes alike (hit rates far too high).
        simulate_routes: record each paged run's routes and add ``sim_lru_hit_rate`` and
            ``sim_belady_hit_rate``: LRU and Belady replayed on them in one pool of the run's slots
            (:func:`epqlab.routes.simulate`; the offline ceiling beside the online policy).
        policy: eviction policy, one of :data:`epqlab.constants.ONLINE_POLICIES`.
        pager: page experts (True) or run plain llama.cpp mmap (False) at every level.
        repeats: runs per (level, pager) pair (>= 1; default 3, medians reported).
        mmap_baseline: also run ``pager=False`` under the same limit at every level, and give the
            ratio paged/mmap decode tok/s (``speedup_vs_mmap``) on the paged rows.
        headroom: bytes of each limit kept out of ``ram_budget`` (default 16 MiB; see the module doc).
        limit_mode: ``auto`` (default, or ``$EPQLAB_LIMIT_MODE``) | ``cgroup`` | ``cgroup-v1`` |
            ``cgroup-v2`` | ``sampled`` (:func:`epqlab.memory.limits.run_limited`).
        timeout_s: per-run wall-clock limit (s); a run past it is a FAIL.
        python: interpreter for the children (default ``sys.executable``).
        progress: print one line per run to stderr.
        variants: named extra Session settings for the paged runs, e.g. ``{"off": {}, "trained":
            {"prefetch": "trained", "prefetch_predictor": "p.npz"}}``: every level runs once per variant in
            each round (interleaved), one row per (level, variant), column ``variant`` (None without).
        between_rounds: called as ``between_rounds(r)`` after round ``r`` (every level and variant ran
            once), e.g. to time a reference interleaved with the rounds.
        **session_kw: passed to :class:`epqlab.Session` in the child (e.g. ``n_ctx``, ``n_threads``,
            ``dense_weights``, ``reserve``); must be JSON-serializable.

    Returns:
        pandas.DataFrame, one row per (level, pager) pair, levels ascending, paged before mmap.
        Columns: ``level``, ``mode`` (paged | mmap), ``limit_mode``, ``limit_bytes`` (as set),
        ``cache_dropped``, ``budget``, ``arena_bytes``, ``slots`` ("n x size" per class),
        ``n_slots``, ``coverage`` (fraction of routed (layer, expert) units that have a slot),
        ``peak_rss_anon`` / ``peak_rss_shmem`` / ``peak_rss_file`` / ``peak_rss`` (max over runs,
        sampled every 20 ms), ``cgroup_peak`` and ``failcnt`` (max over runs; None when sampled),
        ``decode_tok_s`` (median) with ``decode_tok_s_min`` / ``_max``, ``prefill_tok_s``,
        ``ssd_mb_per_token`` (pager reads per decoded token, MB), ``io_mb_per_token`` (all storage
        reads of the process per decoded token, /proc/self/io, MB -- includes page-cache misses
        of mmapped weights), ``hit_rate`` (the whole run: prefill and decode), ``decode_hit_rate`` (decode
        passes only, beside ``ssd_mb_per_token``), ``evictions``, ``dense_weights`` (where the Session
        kept the non-expert weights), ``used_before_arena`` (bytes the Session measured before
        sizing the arena), ``stage_reserve``, ``staged_layers``, ``load_s``, ``load_bytes_read``
        (Session stat when it has one), ``load_io_bytes`` (/proc/self/io during the load),
        ``runs``, ``passed``, ``status`` (PASS when every run passed), ``reason`` (first
        failure's), ``text`` and ``same_text`` (all passing runs generated the same tokens); with a
        baseline also ``mmap_decode_tok_s``, ``speedup_vs_mmap`` and ``same_text_as_mmap``.
        ``df.attrs`` holds the parameters, and ``df.attrs["runs"]`` every run's raw record.

    Raises:
        ValueError: bad levels, repeats < 1, a level not above ``headroom``, unknown limit mode.
        OSError: the model cannot be read, or an explicitly requested cgroup mode is unavailable.
    """
    import pandas as pd

    if model is None:
        model = default_model(progress=False)
    model = str(Path(model).resolve())
    if not os.path.isfile(model):
        raise ModelNotFoundError(f"model file not found: {model}")
    lv = parse_levels(levels)
    headroom = parse_bytes(headroom)
    if int(repeats) < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    if lv[0] <= headroom:
        raise ValueError(f"level {fmt_bytes(lv[0])} is not above the headroom {fmt_bytes(headroom)}; "
                         "raise the level or lower headroom")
    json.dumps(session_kw)  # fail here, not in every child
    named = dict(variants) if variants else {None: {}}
    json.dumps({str(k): v for k, v in named.items()})
    # (pager, variant name): the named variants apply to paged runs; the mmap baseline runs once per level
    modes = [(bool(pager), n) for n in (named if pager else [None])] + ([(False, None)] if mmap_baseline and pager else [])
    python = python or sys.executable
    runs: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="epqlab-strict-") as tmp:
        for r in range(int(repeats)):
            for level in lv:
                for vi, (pg, name) in enumerate(modes):
                    budget = level - headroom if pg else None
                    kw = {**session_kw, **(named.get(name) or {})} if pg else session_kw
                    row = _run_one(model, level, budget, pg, prompt=prompt, n_predict=n_predict, policy=policy,
                                   session_kw=kw, limit_mode=limit_mode, timeout_s=timeout_s,
                                   python=python, workdir=Path(tmp), tag=f"r{r}-{level}-{int(pg)}-{vi}",
                                   forced=forced, simulate_routes=simulate_routes)
                    row["repeat"], row["variant"] = r, name
                    runs.append(row)
                    if progress:
                        st = (row.get("child") or {}).get("stats") or {}
                        print(f"[strict] {fmt_bytes(level):>10} {'paged' if pg else 'mmap':5}{' ' + name if name else ''} "
                              f"run {r + 1}/{repeats}: {row['status']} {st.get('decode_tok_s', 0):.2f} tok/s"
                              f"{'  ' + row['reason'][:120] if row['reason'] else ''}", file=sys.stderr, flush=True)
            if between_rounds is not None:
                between_rounds(r)
    rows = [{**_aggregate([x for x in runs if x["level"] == level and x["pager"] == pg and x["variant"] == name]),
             "variant": name} for level in lv for pg, name in modes]
    df = pd.DataFrame(rows)
    if mmap_baseline and pager:
        _add_baseline(df)
    df.attrs.update(model=model, prompt=prompt, n_predict=int(n_predict), forced=forced, policy=policy, repeats=int(repeats),
                    headroom=headroom, mmap_baseline=bool(mmap_baseline), session_kw=session_kw,
                    variants={str(k): v for k, v in named.items()} if variants else None,
                    limit_mode_requested=limit_mode or os.environ.get("EPQLAB_LIMIT_MODE") or "auto",
                    runs=[_clean_run(x) for x in runs])
    return df


def _median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _max(xs):
    xs = [x for x in xs if x is not None]
    return max(xs) if xs else None


def _min(xs):
    xs = [x for x in xs if x is not None]
    return min(xs) if xs else None


def _aggregate(rs: list[dict]) -> dict:
    """One table row from the runs of one (level, pager) pair."""
    ok = [x for x in rs if x["status"] == "PASS"]
    stats = [x["child"]["stats"] for x in ok]
    first = ok[0]["child"] if ok else next((x["child"] for x in rs if x.get("child")), {})
    st0 = first.get("stats") or {}
    classes = st0.get("slot_classes") or []
    n_slots = sum(int(c.get("slots", 0)) for c in classes)
    n_units = first.get("n_routed_experts")
    fails = [x for x in rs if x["status"] != "PASS"]
    io = [x["child"].get("io") or {} for x in ok]

    def per_tok(key):
        vals = []
        for x, i in zip(ok, io):
            st = x["child"]["stats"]
            n = st.get("decode_passes", st.get("n_gen")) or 0  # single-token decode passes run
            if n and i.get(key) is not None:
                vals.append(i[key] / n / 1e6)
        return _median(vals)

    dec = [s.get("decode_tok_s") for s in stats]
    return {
        "level": rs[0]["level"], "mode": "paged" if rs[0]["pager"] else "mmap", "pager": rs[0]["pager"],
        "limit_mode": rs[0]["limit_mode"], "limit_bytes": rs[0]["limit_bytes"],
        "cache_dropped": all(x["cache_dropped"] for x in rs), "budget": rs[0]["budget"],
        "arena_bytes": st0.get("arena_bytes") if rs[0]["pager"] and ok else None,
        "slots": ", ".join(f"{c['slots']} x {fmt_bytes(c['slot_bytes'])}" for c in classes if c.get("slots")) or None,
        "n_slots": n_slots if classes else None,
        "coverage": min(1.0, n_slots / n_units) if classes and n_units else None,
        "peak_rss_anon": _max(x["peak_rss_anon"] for x in rs), "peak_rss_shmem": _max(x["peak_rss_shmem"] for x in rs),
        "peak_rss_file": _max(x["peak_rss_file"] for x in rs), "peak_rss": _max(x["peak_rss"] for x in rs),
        "cgroup_peak": _max(x["cgroup_peak"] for x in rs), "failcnt": _max(x["failcnt"] for x in rs),
        "decode_tok_s": _median(dec), "decode_tok_s_min": _min(dec), "decode_tok_s_max": _max(dec),
        "prefill_tok_s": _median(s.get("prefill_tok_s") for s in stats),
        "ssd_mb_per_token": (_median(s.get("decode_ssd_bytes_per_token") for s in stats) or 0) / 1e6
        if rs[0]["pager"] and stats else None,
        "io_mb_per_token": per_tok("decode_read_bytes"),
        "hit_rate": _median(s.get("hit_rate") for s in stats) if rs[0]["pager"] else None,
        "decode_hit_rate": _median(s.get("decode_hit_rate") for s in stats) if rs[0]["pager"] else None,
        "evictions": _median(s.get("evictions") for s in stats) if rs[0]["pager"] else None,
        "sim_lru_hit_rate": _median((x["child"].get("sim") or {}).get("lru_hit_rate") for x in ok),
        "sim_belady_hit_rate": _median((x["child"].get("sim") or {}).get("belady_hit_rate") for x in ok),
        "prefill_ssd_bytes": _median(s.get("prefill_ssd_bytes") for s in stats) if rs[0]["pager"] else None,
        "prefill_distinct_expert_bytes": _median((x["child"].get("sim") or {}).get("prefill_distinct_expert_bytes")
                                                 for x in ok),
        "prefill_union_bytes": _median(x["child"].get("prefill_union_bytes") for x in ok),
        "teacher_forced": all(s.get("teacher_forced") for s in stats) if stats else None,
        "dense_weights": st0.get("dense_weights"),
        "used_before_arena": _median((s.get("memory") or {}).get("used_before_arena") for s in stats),
        "stage_reserve": _median((s.get("memory") or {}).get("stage_reserve") for s in stats),
        "staged_layers": _median(s.get("staged_layers") for s in stats) if rs[0]["pager"] else None,
        "load_s": _median(s.get("load_s") for s in stats),
        "load_bytes_read": _median(s.get("load_bytes_read") for s in stats),
        "load_io_bytes": _median(i.get("load_read_bytes") for i in io),
        "runs": len(rs), "passed": len(ok), "status": "PASS" if not fails else "FAIL",
        "reason": fails[0]["reason"] if fails else None,
        "text": first.get("text") if ok else None,
        "tokens": first.get("tokens") if ok else None,
        "same_text": len({tuple(x["child"].get("tokens") or ()) for x in ok}) == 1 if ok else None,
    }


def _add_baseline(df) -> None:
    mm = df[df["mode"] == "mmap"].set_index("level")
    dec, same = [], []
    for _, r in df.iterrows():
        b = mm.loc[r["level"]] if r["mode"] == "paged" and r["level"] in mm.index else None
        ok = b is not None and r["status"] == "PASS" and b["status"] == "PASS" and b["decode_tok_s"]
        dec.append(b["decode_tok_s"] if b is not None else None)
        same.append(bool(r["tokens"] == b["tokens"]) if ok else None)
    df["mmap_decode_tok_s"] = dec
    df["speedup_vs_mmap"] = [r / m if r and m else None for r, m in zip(df["decode_tok_s"], dec)]
    df.loc[df["mode"] == "mmap", "speedup_vs_mmap"] = None
    df["same_text_as_mmap"] = same


def _clean_run(x: dict) -> dict:
    """A run's record for JSON: the limit readings, the status and the child's stats."""
    c = x.get("child") or {}
    keep = {k: v for k, v in x.items() if k != "child"}
    keep.update(stats=c.get("stats"), io=c.get("io"), text=c.get("text"), child_s=c.get("child_s"),
                used_before_arena=c.get("used_before_arena"))
    return keep
