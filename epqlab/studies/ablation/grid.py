"""The grid every ablation sweeps (arenas or RAM budgets) and the metrics of one run over prompts.

The rates are defined once, in :mod:`epqlab.engine.run_stats` (a Session's run stats use the same ones);
shared by :func:`epqlab.studies.ablation.eviction` and :func:`epqlab.studies.ablation.topk`:

- *lifetime* hit rate: hits / requests over every forward pass of the run (prefill included);
- *decode* hit rate: over the single-token decode passes only;
- *steady-state* hit rate: over the decode passes of each prompt after its first ``warmup``
  (default :data:`WARMUP_PASSES`), once the arena holds the prompt's working set;
- per-token figures (requests, misses, SSD bytes) divide decode counts by decode passes (the
  first generated token comes from the prefill pass, so a prompt of n generated tokens runs
  n - 1 decode passes);
- I/O-wait share: time the decode passes waited for expert reads / decode wall time.
"""
from __future__ import annotations

import statistics
from pathlib import Path
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ...constants import EVICTION_GROUPS
from ...engine.run_stats import WARMUP_PASSES, pass_rates
from ...layout import ModelLayout
from ...results import run_info, save_csv, write_json
from ...units import fmt_bytes, parse_bytes
from ...paging.pager import Pager



@dataclass(frozen=True)
class MemoryPoint:
    """One memory setting of a sweep: a fixed arena (``arena_bytes``, with the fraction of all expert
    slots it came from, if any) or a RAM budget for the whole process (``ram_budget``, bytes)."""

    label: str
    arena_fraction: float | None = None
    arena_bytes: int | None = None
    ram_budget: int | None = None

    def session_kwargs(self) -> dict:
        """Keyword arguments for :class:`epqlab.Session` that realise this point."""
        return {"arena_bytes": self.arena_bytes} if self.arena_bytes is not None else {"ram_budget": self.ram_budget}

    def as_dict(self) -> dict:
        return {"point": self.label, "arena_fraction": self.arena_fraction, "arena_request_bytes": self.arena_bytes,
                "ram_budget": self.ram_budget}


def memory_points(layout: ModelLayout, arenas: Sequence | None = None, budgets: Sequence | None = None,
                  k: int | None = None) -> list[MemoryPoint]:
    """The memory settings of a sweep, arenas first.

    Args:
        layout: from :func:`epqlab.inspect`.
        arenas: each a fraction in (0, 1] of the bytes at which every routed expert has a slot
            (:meth:`epqlab.Pager.all_experts_bytes`), or a size in bytes (int > 1 or ``"256MiB"``).
        budgets: RAM budgets for the whole process (bytes or ``"1GiB"``), as ``Session(ram_budget=)``.
        k: top-k the arena must hold for one layer (default the model's).

    Raises:
        ValueError: no point given, a fraction outside (0, 1], or an arena smaller than one
            layer's top-k experts (the message names the smallest fraction that works).
    """
    arenas, budgets = list(arenas or []), list(budgets or [])
    if not arenas and not budgets:
        raise ValueError("give at least one arena (fraction of all expert slots, or bytes) or one RAM budget")
    full = Pager.all_experts_bytes(layout)
    need = Pager.min_arena_bytes(layout, k)
    out = []
    for a in arenas:
        if isinstance(a, str) and not a.strip().replace(".", "", 1).isdigit():
            b, frac = parse_bytes(a), None
        elif float(a) <= 1.0:
            frac = float(a)
            if not 0 < frac <= 1:
                raise ValueError(f"arena fraction {a} must lie in (0, 1]")
            b = int(round(frac * full))
        else:
            b, frac = int(float(a)), None
        if b < need:
            hint = (f" (a number above 1 is a byte count: {a!r} means {b} bytes; fractions of all expert slots lie "
                    "in (0, 1], sizes read like '256MiB')" if frac is None and not isinstance(a, str) else "")
            raise ValueError(f"arena {a} ({fmt_bytes(b)}) cannot hold one layer's top-{k or layout.n_expert_used} experts "
                             f"of {layout.path.name}; the smallest arena is {need} bytes = {need / full:.3f} of all "
                             f"expert slots{hint}")
        out.append(MemoryPoint(f"arena {frac:.0%}" if frac is not None else f"arena {fmt_bytes(b)}", frac, b, None))
    for r in budgets:
        b = parse_bytes(r)
        out.append(MemoryPoint(f"budget {fmt_bytes(b)}", None, None, b))
    return out


def _prompt_text(p, session) -> str:
    return p.text(session) if hasattr(p, "text") else str(p)


def measure_prompts(session, prompts: Sequence, n_predict: int, warmup: int = WARMUP_PASSES) -> dict:
    """Generate ``n_predict`` tokens (greedy) after each prompt in turn on one session and return the
    run's metrics (module docstring for each definition).

    Args:
        session: an open :class:`epqlab.Session` (paged or not); its arena carries over from one
            prompt to the next, as in a chat.
        prompts: :class:`epqlab.data.Prompt` objects (chat prompts get the chat template) or strings.
        n_predict: tokens to generate per prompt.
        warmup: decode passes per prompt left out of the steady-state hit rate.

    Returns:
        dict: counts (``requests``, ``hits``, ``misses``, ``evictions`` and ``evictions_<group>``,
        ``ssd_bytes``), rates (``hit_rate``, ``decode_hit_rate``, ``steady_hit_rate``),
        ``prefill_tok_s`` and ``decode_tok_s`` (tok/s), ``requests_per_token``,
        ``misses_per_token``, ``ssd_mb_per_token`` (decode, MB = 1e6 bytes), ``io_wait_share``,
        times in s, and ``pass_kind``: int8 per forward pass (0 prefill, 1 decode warm-up,
        2 steady-state decode) for replays of the run's route log.
    """
    if not prompts:
        raise ValueError("no prompts")
    if n_predict < 2:
        raise ValueError(f"n_predict must be >= 2 (the first token comes from the prefill), got {n_predict}")
    pg = session.pager
    kinds: list[np.ndarray] = []
    runs = []
    start = len(pg.pass_history()[0]) if pg else 0  # the session may have run before: count from here
    for p in prompts:
        n0 = len(pg.pass_history()[0]) if pg else 0
        # A chat prompt already carries the template's special tokens: no second BOS.
        chat = getattr(p, "kind", None) == "chat"
        g = session.generate(_prompt_text(p, session), n_predict, add_special=not chat)
        st = g.stats
        runs.append(st)
        if pg:
            n = len(pg.pass_history()[0]) - n0
            dec = st["decode_passes"]
            kind = np.zeros(n, np.int8)
            kind[n - dec:] = 1
            kind[n - dec + min(warmup, dec):] = 2
            kinds.append(kind)
    tot = {k: sum(r[k] for r in runs) for k in ("n_prompt", "n_gen", "decode_passes", "prefill_s", "decode_s",
                                                "requests", "hits", "misses", "evictions", "ssd_bytes",
                                                "io_wait_s", "decode_io_wait_s", "decode_misses")}
    for g in EVICTION_GROUPS:
        tot[f"evictions_{g}"] = sum(r.get(f"evictions_{g}", 0) for r in runs)
    kind = np.concatenate(kinds) if kinds else np.zeros(0, np.int8)
    hist = tuple(a[start:] for a in pg.pass_history()) if pg else (np.zeros(0), np.zeros(0))
    rates = pass_rates(hist, kind)
    dec = max(1, tot["decode_passes"])
    dec_bytes = sum(r["decode_ssd_bytes_per_token"] * r["decode_passes"] for r in runs)
    return {
        **tot, **rates,
        "prefill_tok_s": tot["n_prompt"] / tot["prefill_s"] if tot["prefill_s"] > 0 else 0.0,
        "decode_tok_s": tot["decode_passes"] / tot["decode_s"] if tot["decode_s"] > 0 else 0.0,
        "requests_per_token": rates["decode_requests"] / dec,
        "misses_per_token": tot["decode_misses"] / dec,
        "ssd_mb_per_token": dec_bytes / dec / 1e6,
        "io_wait_share": tot["decode_io_wait_s"] / tot["decode_s"] if tot["decode_s"] > 0 else 0.0,
        "pass_kind": kind,
    }


SPEED_KEYS = ("decode_tok_s", "prefill_tok_s", "io_wait_share", "decode_s", "prefill_s", "io_wait_s")


def summarize(runs: Sequence[dict]) -> dict:
    """One row from repeated runs of the same setting: speeds (:data:`SPEED_KEYS`) as median with
    ``_min`` and ``_max``; every other number from the first run, and ``counts_repeat`` True when
    the counts (requests, hits, misses, evictions, SSD bytes) were identical in every repeat."""
    if not runs:
        raise ValueError("no runs to summarize")
    row = {k: v for k, v in runs[0].items() if not isinstance(v, np.ndarray)}
    for k in SPEED_KEYS:
        if k in row:
            vals = [r[k] for r in runs]
            row[k] = statistics.median(vals)
            row[k + "_min"], row[k + "_max"] = min(vals), max(vals)
    row["repeats"] = len(runs)
    row["counts_repeat"] = all(all(r[k] == runs[0][k] for k in ("requests", "hits", "misses", "evictions", "ssd_bytes"))
                               for r in runs)
    return row


def save(df, out_dir, stem: str, meta: dict | None = None) -> dict:
    """Write a result table as ``<stem>.csv`` and ``<stem>.json`` (``{**meta, "rows": [...]}``, strict
    JSON through :func:`epqlab.results.write_json`: NaN becomes null) in ``out_dir`` (created);
    ``meta`` gains ``run`` (:func:`epqlab.results.run_info` of ``df.attrs["model"]``) unless it has one.
    Returns the paths written."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    csv, js = out / f"{stem}.csv", out / f"{stem}.json"
    save_csv(df, csv)
    meta = dict(meta or {})
    meta.setdefault("run", run_info(df.attrs.get("model")))
    write_json({**meta, "rows": df.to_dict(orient="records")}, js)
    return {"csv": str(csv), "json": str(js)}
