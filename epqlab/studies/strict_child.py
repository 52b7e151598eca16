"""One run of :func:`epqlab.studies.strict.run`, in its own process: ``python -m epqlab.studies.strict_child SPEC OUT``.

SPEC is a JSON file ``{"model", "ram_budget" (bytes or null), "pager", "policy", "prompt",
"n_predict", "forced" (text or null), "route_log" (path or null), "session_kw"}``. The child loads the
model with :class:`epqlab.Session`, generates ``n_predict`` greedy tokens (teacher-forced on ``forced``
when given: :meth:`epqlab.Session.stream`) and writes OUT (JSON): ``status`` (``PASS`` | ``FAIL``), ``reason``,
the run stats of :meth:`Session.generate`, the session's cumulative stats, the text and token ids,
the layout figures the table needs, ``prefill_union_bytes``: the bytes of each prefill ubatch's distinct
experts per layer, summed over its ubatches and layers (the hook's ``layer_unions``; with one ubatch, the
prefill's distinct experts' bytes: what it must read at least into an empty arena), ``sim``: with a route log, the LRU and Belady hit rates of the
run's routes at its arena's slot count (one shared pool, :func:`epqlab.routes.simulate`), and ``io``: storage bytes read (``read_bytes`` of
/proc/self/io) during the load, the prefill and the decode. Exit status: 0 PASS, 3 ArenaTooSmall, 1 other error. A
child killed by its memory limit writes nothing; the parent reports that.
"""
from __future__ import annotations

import json
import sys
import time
import traceback

import numpy as np

from ..engine.session import Session
from ..errors import ArenaTooSmall
from ..memory.usage import read_bytes
from ..routes.simulators import simulate

EXIT_ARENA_TOO_SMALL = 3


def _jsonable(d: dict) -> dict:
    out = {}
    for k, v in d.items():
        if hasattr(v, "item"):
            v = v.item()
        try:
            json.dumps(v)
        except TypeError:
            v = str(v)
        out[k] = v
    return out


def _diff(a, b):
    return None if a is None or b is None else a - b


def _simulated(s) -> dict:
    """LRU and Belady hit rates of this run's route log (prefill and decode) in one pool of the arena's
    slots: the online policy's replay and the offline ceiling at the same capacity."""
    log = s.route_log()
    cap = max(int(s.pager.n_slots), log.k)
    df = simulate(log, [cap], ("lru", "belady"), per_layer=False).set_index("policy")
    pre = log.experts[log.phase == 0]  # [T_prefill, L, k]
    distinct = sum(np.unique(pre[:, li]).size * int(log.expert_bytes[li]) for li in range(pre.shape[1]))
    return {"slots": cap, "lru_hit_rate": float(df.loc["lru", "hit_rate"]),
            "belady_hit_rate": float(df.loc["belady", "hit_rate"]),
            "prefill_distinct_expert_bytes": int(distinct)}


def main(argv: list[str]) -> int:
    spec_path, out_path = argv
    with open(spec_path) as f:
        spec = json.load(f)
    t0 = time.perf_counter()
    io_start = read_bytes()
    res: dict = {"status": "FAIL", "reason": None}
    code = 1
    try:
        try:
            kw = dict(spec.get("session_kw", {}))
            if spec.get("route_log"):
                kw["route_log"] = spec["route_log"]
            with Session(spec["model"], ram_budget=spec.get("ram_budget"), policy=spec.get("policy", "lru"),
                         pager=bool(spec.get("pager", True)), **kw) as s:
                io_loaded = read_bytes()
                io_prefilled = None
                unions0 = s.decoder.engine.layer_unions().copy() if s.pager else None
                union_bytes = None
                stream = s.stream(spec["prompt"], int(spec["n_predict"]), forced=spec.get("forced"))
                for _ in stream:
                    if io_prefilled is None:  # the first piece comes right after the prefill
                        io_prefilled = read_bytes()
                        if unions0 is not None:
                            du = s.decoder.engine.layer_unions() - unions0
                            union_bytes = int(sum(int(n) * l.expert_bytes for n, l in zip(du, s.layout.layers)))
                io_end = read_bytes()
                if io_prefilled is None:
                    io_prefilled = io_end
                lay = s.layout
                g = stream.result
                res.update(
                    status="PASS", text=g.text, tokens=g.tokens, n_prompt=len(g.prompt_tokens),
                    stats=_jsonable(g.stats), session_stats=_jsonable(s.stats),
                    io={"load_read_bytes": _diff(io_loaded, io_start),
                        "prefill_read_bytes": _diff(io_prefilled, io_loaded),
                        "decode_read_bytes": _diff(io_end, io_prefilled)},
                    routed_expert_bytes=lay.routed_expert_bytes, non_expert_bytes=lay.non_expert_bytes,
                    n_routed_experts=sum(c.n_experts for c in lay.slot_classes),
                    used_before_arena=getattr(s, "used_before_arena", None),
                    sim=_simulated(s) if spec.get("simulate_routes") and s.pager else None,
                    prefill_union_bytes=union_bytes,
                    arena_fill_bytes=s.pager.fill_bytes if s.pager else 0,
                )
                code = 0
        except ArenaTooSmall as e:
            res.update(reason=f"ArenaTooSmall: {e}")
            code = EXIT_ARENA_TOO_SMALL
    except MemoryError as e:
        res.update(reason=f"MemoryError: {e}")
    except Exception as e:  # noqa: BLE001 -- every failure becomes a FAIL row with its text
        res.update(reason=f"{type(e).__name__}: {e}", traceback=traceback.format_exc(limit=8))
    res["child_s"] = time.perf_counter() - t0
    with open(out_path, "w") as f:
        json.dump(res, f)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
