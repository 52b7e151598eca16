"""Route analysis: what routing locality allows paging to achieve, from a route log alone (no engine).

- :class:`RouteLog`: the NPZ format of docs/DESIGN.md §6 (load, save, validate, synthetic logs).
- Analyses (:mod:`.analysis`): :func:`reuse_histogram`, :func:`one_off_share`, :func:`union_sizes` (U(k)),
  :func:`popularity`, :func:`hot_set_hit_rate`.
- Offline cache simulators (:mod:`.simulators`): :func:`simulate` for ``lru``, ``ls``, ``ls_pos`` and Belady's
  MIN over many capacities at once, and the slow literal :func:`simulate_reference` they are tested against.
- :func:`summarize`: everything above as one dict of plain numbers (CLI, notebook JSON).

Nothing here imports the engine: logs are recorded by :mod:`epqlab.studies.route_recording` (or
``Session(route_log=...)``); policy names live in :mod:`epqlab.constants`.
"""
from __future__ import annotations

import importlib

# name -> submodule defining it, imported on first access (PEP 562): the pager imports the route-log
# format (.log) at ``import epqlab`` without pulling in pandas for the analyses
_LAZY = {
    "RouteLog": ".log", "RouteLogError": ".log",
    "expert_counts": ".analysis", "hot_set": ".analysis", "hot_set_hit_rate": ".analysis", "one_off_share": ".analysis",
    "popularity": ".analysis", "reuse_distances": ".analysis", "reuse_histogram": ".analysis", "union_sizes": ".analysis",
    "GROUPS": ".reference", "POLICIES": ".reference", "simulate_reference": ".reference",
    "default_capacities": ".report", "summarize": ".report",
    "simulate_online": ".online", "policy_params": ".policy_params",
    "simulate": ".simulators", "slots_for_bytes": ".simulators", "stack_distances": ".simulators",
}


def __getattr__(name: str):
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'epqlab.routes' has no attribute {name!r}")
    value = getattr(importlib.import_module(mod, __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "RouteLog", "RouteLogError", "POLICIES", "GROUPS", "simulate", "simulate_online", "policy_params", "simulate_reference", "slots_for_bytes",
    "stack_distances", "reuse_distances", "reuse_histogram", "one_off_share", "union_sizes", "expert_counts",
    "hot_set", "hot_set_hit_rate", "popularity", "summarize", "default_capacities",
]
