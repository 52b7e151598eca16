"""The eviction-policy tournament (issue 50): every online policy replayed on the routes of a held-out text
at several arena sizes, scored against LRU and Belady's MIN, and the top three per arena confirmed live.

- The routes are recorded once (teacher-forced decode of the text: one token per forward pass after a short
  prompt); routing never depends on paging (logits are bit-identical), so one route log serves every policy,
  arena and live run.
- Each policy is simulated by :func:`epqlab.routes.online.simulate_online` with the arena's own slot classes
  and the expert addressing a live Session uses there (slot addressing keeps each expert in a slot of its own
  size class, docs/DESIGN.md §3f; region addressing lets it take a larger one), which predicts the live pager
  hit for hit; Belady's MIN is :meth:`epqlab.Pager.replay` of the same log under the same constraints. The
  live runs ask for that addressing by name, so a simulation and its live run never differ in it.
- Score: ``gap_share = (hit − LRU) / (Belady − LRU)`` (hit rates over every request; NaN where Belady does not
  beat LRU), per arena and per MoE layer.
- Live: the top three online policies of each arena run the same forced text through a real Session; their
  hits, misses and evictions must equal the simulation's (``live_equal``); decode tok/s is measured there.
  Other prefetch modes (``"trained"`` needs a predictor) run live only: prefetch cancels mispredicted reads by
  timing, so its hit counts cannot be simulated.
"""
from __future__ import annotations

import math
import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd

from ...constants import ONLINE_POLICIES
from ...data import heldout_texts
from ...engine.session import Session
from ...layout import inspect
from ...paging.pager import Pager
from ...routes.online import simulate_online
from .eviction import calibration_route_log, hot_experts
from .grid import memory_points

TOURNAMENT_POLICIES = tuple(p for p in ONLINE_POLICIES if p != "static")
"""Default entrants: every online policy but ``static`` (it needs a calibration hot set; name it to include
it, its hot set then being the hottest half of the slots on the calibration chat text)."""
PROMPT = "Text:"


def record_routes(model, text: str, n_tokens: int, session_kwargs: dict | None = None):
    """Route log of ``text`` read teacher-forced (``n_tokens`` decode steps after :data:`PROMPT`), every
    expert resident. Returns a :class:`epqlab.routes.RouteLog`."""
    with tempfile.TemporaryDirectory() as d, Session(model, route_log=Path(d) / "r.npz", n_ctx=max(256, n_tokens + 64),
                                                      **(session_kwargs or {})) as s:
        s.generate(PROMPT, n_tokens, forced=text)
        return s.route_log()


def slot_addressed(lay, arena: int) -> bool:
    """Whether a Session with ``arena`` bytes (``expert_addressing="auto"``) addresses experts by slot: the
    pager's own test (``set_slot_addressing``), on a pager with the fill mapping a Session has."""
    p = Pager(lay, arena, prefault=True)
    try:
        return not p.native.set_slot_addressing(True)
    finally:
        del p


def _replay_stats(lay, arena: int, policy: str, log, slots: bool, hot=None) -> dict:
    """:meth:`epqlab.Pager.replay`'s stats of ``log`` (slot addressing when ``slots``: the replay then needs the
    arena's fill mapping)."""
    p = Pager(lay, arena, policy=policy, prefault=slots)
    if slots and p.native.set_slot_addressing(True):
        raise RuntimeError("slot addressing was possible at this arena a moment ago")
    if policy == "static":
        p.set_hot([[lay.moe_layers[li], e] for li, e in hot])
    return p.replay(log)


def _replay(lay, arena: int, policy: str, log, hot, slots: bool = False) -> dict:
    """The counters of :func:`simulate_online` from the native pager's replay of ``log``."""
    st = _replay_stats(lay, arena, policy, log, slots, hot)
    req = [int(x) for x in st["layer_requests"]]
    return dict(hits=st["hits"], misses=st["misses"], evictions=st["evictions"], requests=st["requests"],
                requests_by_layer=req, misses_by_layer=[r - int(h) for r, h in zip(req, st["layer_hits"])])


def _gap(hit: float, lru: float, bel: float) -> float:
    return (hit - lru) / (bel - lru) if bel - lru > 1e-12 else float("nan")


def tournament(model, budgets: Sequence, text: str | None = None, *, policies: Sequence[str] = TOURNAMENT_POLICIES,
               n_tokens: int = 256, prefetch: Sequence[str] = ("off",), predictor: str | None = None,
               confirm: int = 3, session_kwargs: dict | None = None, simulator: str = "python") -> pd.DataFrame:
    """Run the tournament; one row per (arena point, policy, prefetch mode, kind) with kind ``"sim"`` (every
    policy, Belady included, prefetch off) or ``"live"`` (the top ``confirm`` per point and prefetch mode).

    Args:
        model: MoE GGUF path.
        budgets: arena sizes: fractions in (0, 1] of all expert slots, or sizes (``"64MiB"``, bytes).
        text: the evaluation text (default the shipped held-out prose, never used for calibration).
        policies: online policies to rank (:data:`TOURNAMENT_POLICIES` by default).
        n_tokens: decode steps of the forced text.
        prefetch: prefetch modes; ``"off"`` is simulated and confirmed live, the others run live only.
        predictor: a trained predictor NPZ (``epqlab predictor fit``) for prefetch ``"trained"``.
        confirm: live runs per point (the best simulated online policies).
        session_kwargs: passed to every Session (e.g. ``n_threads``).
        simulator: ``"python"``: :func:`epqlab.routes.online.simulate_online` (no reads: minutes on the 35B
            shape); ``"native"``: :meth:`epqlab.Pager.replay`, which reads every miss from the file (on the 35B
            shape at a 1.4 GiB arena ~75 GB per policy, ~20 min for the field). tests/test_eviction_policies.py
            holds the two equal on every counter, so the ranking is the same; the live runs check whichever ran.

    Columns: point, arena_bytes, slots, addressing (``"slots"`` or ``"region"``), policy, prefetch, kind, hit_rate, lru_hit_rate, belady_hit_rate,
    gap_share, layer_gap_share (list per MoE layer), ssd_mb_per_token (simulated: misses x expert bytes per
    decode token; live: bytes read), decode_tok_s (live), live_equal (live: counts equal the simulation's),
    rank (by simulated hit rate within the point).

    Raises:
        ValueError: an unknown policy (lists the valid ones), ``"belady"`` among the entrants, a budget the
            arena cannot hold, ``"trained"`` prefetch without a predictor, ``n_tokens`` < 1, an unknown
            ``simulator``.
    """
    bad = [p for p in policies if p not in ONLINE_POLICIES]
    if bad:
        raise ValueError(f"unknown online policy {bad[0]!r}; choose among {', '.join(ONLINE_POLICIES)} "
                         "(belady is the bound every row is scored against)")
    if not policies:
        raise ValueError("no policies given")
    if simulator not in ("native", "python"):
        raise ValueError(f"simulator must be 'native' or 'python', got {simulator!r}")
    if n_tokens < 1:
        raise ValueError(f"n_tokens must be >= 1, got {n_tokens}")
    prefetch = list(prefetch) or ["off"]
    if "trained" in prefetch and not predictor:
        raise ValueError("prefetch 'trained' needs predictor= (fit one with `epqlab predictor fit MODEL p.npz`)")
    kw = dict(session_kwargs or {})
    lay = inspect(model)
    points = memory_points(lay, arenas=list(budgets))
    text = text if text is not None else heldout_texts()["prose"]
    log = record_routes(model, text, n_tokens, kw)
    ub = Pager.unit_slot_bytes(lay)
    decode = max(1, int((log.phase == 1).sum()))
    hot = None
    if "static" in policies:
        hot_log = calibration_route_log(model)
    rows = []
    for pt in points:
        probe = Pager(lay, pt.arena_bytes, prefault=False)
        classes = [(c["slot_bytes"], c["slots"]) for c in probe.stats["slot_classes"]]
        slots = probe.n_slots
        del probe
        by_slot = slot_addressed(lay, pt.arena_bytes)
        addressing = "slots" if by_slot else "region"
        bst = _replay_stats(lay, pt.arena_bytes, "belady", log, by_slot)
        bel_rate = bst["hits"] / bst["requests"]
        bel_l = np.asarray(bst["layer_hits"]) / np.maximum(1, np.asarray(bst["layer_requests"]))
        sims = {}
        for p in dict.fromkeys(["lru", *policies]):
            if p == "static":
                hot = [(int(np.searchsorted(lay.moe_layers, b)), int(e)) for b, e in hot_experts(hot_log, slots // 2)]
            if simulator == "python":
                sims[p] = simulate_online(log, None, p, slot_classes=classes, unit_bytes=ub, slot_mode=by_slot,
                                          hot=hot if p == "static" else None)
            else:
                sims[p] = _replay(lay, pt.arena_bytes, p, log, hot, by_slot)
        lru = sims["lru"]
        lru_rate = lru["hits"] / lru["requests"]
        req_l = np.asarray(lru["requests_by_layer"])
        lru_l = 1 - np.asarray(lru["misses_by_layer"]) / np.maximum(1, req_l)
        base = dict(point=pt.label, arena_bytes=pt.arena_bytes, slots=slots, addressing=addressing, lru_hit_rate=lru_rate,
                    belady_hit_rate=bel_rate)
        ranked = sorted(policies, key=lambda p: (-sims[p]["hits"], p))
        for p in [*policies, "belady"]:
            if p == "belady":
                hit, mis_l = bel_rate, np.asarray(bst["layer_requests"]) - np.asarray(bst["layer_hits"])
            else:
                hit, mis_l = sims[p]["hits"] / sims[p]["requests"], np.asarray(sims[p]["misses_by_layer"])
            hit_l = 1 - mis_l / np.maximum(1, req_l)
            rows.append(dict(base, policy=p, prefetch="off", kind="sim", hit_rate=hit, gap_share=_gap(hit, lru_rate, bel_rate),
                             layer_gap_share=[_gap(h, a, b) for h, a, b in zip(hit_l, lru_l, bel_l)],
                             ssd_mb_per_token=float((mis_l * log.expert_bytes).sum()) / decode / 1e6,
                             decode_tok_s=float("nan"), live_equal=None,
                             rank=ranked.index(p) + 1 if p in ranked else None))
        for mode in prefetch:
            for p in ranked[:confirm]:
                pk = dict(kw, arena_bytes=pt.arena_bytes, policy=p, expert_addressing=addressing)
                if p == "static":
                    pk["hot_experts"] = np.array([[lay.moe_layers[li], e] for li, e in hot], np.int32)
                if mode != "off":
                    pk["prefetch"] = mode
                    if mode == "trained":
                        pk["prefetch_predictor"] = predictor
                # a route log makes the live run route every token through every layer, as the recording did
                # (without one, llama.cpp skips the last layer of a prompt token that gives no logits)
                with tempfile.TemporaryDirectory() as d, \
                        Session(model, n_ctx=max(256, n_tokens + 64), route_log=Path(d) / "live.npz", **pk) as s:
                    g = s.generate(PROMPT, n_tokens, forced=text)
                    st = s.stats
                hit = st["hits"] / st["requests"] if st["requests"] else float("nan")
                same = (st["hits"], st["misses"], st["evictions"]) == (sims[p]["hits"], sims[p]["misses"], sims[p]["evictions"])
                rows.append(dict(base, policy=p, prefetch=mode, kind="live", hit_rate=hit,
                                 gap_share=_gap(hit, lru_rate, bel_rate), layer_gap_share=None,
                                 ssd_mb_per_token=st["bytes_read"] / decode / 1e6,
                                 decode_tok_s=float(g.stats.get("decode_tok_s", float("nan"))),
                                 live_equal=same if mode == "off" else None, rank=ranked.index(p) + 1))
    df = pd.DataFrame(rows)
    df.attrs.update(model=str(model), n_tokens=n_tokens, decode_tokens=decode, policies=list(policies),
                    prefetch=prefetch, budgets=[str(b) for b in budgets], layers=[int(x) for x in log.layers])
    return df


def winners(df: pd.DataFrame) -> pd.DataFrame:
    """Per point: the best simulated online policy, its hit rate and gap share, and whether it never loses to
    LRU at any point (``never_below_lru``)."""
    sim = df[(df.kind == "sim") & (df.policy != "belady")]
    below = sim.groupby("policy").apply(lambda g: bool((g.hit_rate >= g.lru_hit_rate - 1e-12).all()),
                                        include_groups=False)
    best = sim.sort_values(["point", "rank"]).groupby("point", sort=False).head(1)
    out = best[["point", "slots", "policy", "hit_rate", "lru_hit_rate", "belady_hit_rate", "gap_share"]].copy()
    out["never_below_lru"] = out.policy.map(below)
    return out.reset_index(drop=True)


def layer_table(df: pd.DataFrame, point: str) -> pd.DataFrame:
    """Per-layer gap share of every simulated online policy at ``point``: one row per MoE layer (GGUF block in
    the index), one column per policy; NaN where Belady does not beat LRU in that layer."""
    sim = df[(df.kind == "sim") & (df.point == point) & ~df.policy.isin(["belady"])]
    blocks = df.attrs.get("layers") or list(range(len(sim.layer_gap_share.iloc[0])))
    return pd.DataFrame({r.policy: r.layer_gap_share for r in sim.itertuples()}, index=pd.Index(blocks, name="layer"))


def _layers(df: pd.DataFrame, point: str, policy: str) -> str:
    g = layer_table(df, point)[policy].dropna()
    if g.empty:
        return ""
    return (f"; per layer (the {len(g)} with a gap) median {g.median():.0%}, lowest {g.min():.0%}, "
            f"{int((g >= 0.4).sum())} at 40 % or more")


def reading(df: pd.DataFrame) -> str:
    """A few plain sentences: the winner per point and its gap share, which policies never lose to LRU, and
    whether the live runs matched the simulation."""
    w = winners(df)
    lines = []
    for r in w.itertuples():
        g = "n/a (Belady does not beat LRU)" if math.isnan(r.gap_share) else f"{r.gap_share:.0%}"
        lines.append(f"- **{r.point}** ({r.slots} slots): best online policy {r.policy}, hit rate "
                     f"{r.hit_rate:.1%} (LRU {r.lru_hit_rate:.1%}, Belady {r.belady_hit_rate:.1%}): gap share {g}"
                     f"{_layers(df, r.point, r.policy)}.")
    sim = df[(df.kind == "sim") & ~df.policy.isin(["belady", "lru"])]
    never = sorted(p for p, g in sim.groupby("policy") if bool((g.hit_rate >= g.lru_hit_rate - 1e-12).all()))
    lines.append(f"- Never below LRU at any point: {', '.join(never) if never else 'none'}.")
    live = df[(df.kind == "live") & (df.prefetch == "off")]
    if len(live):
        ok = bool(live.live_equal.all())
        lines.append(f"- Live confirmation: {len(live)} runs; hits, misses and evictions "
                     f"{'equal the simulation in every one' if ok else 'DIFFER from the simulation'}.")
    return "\n".join(lines)
