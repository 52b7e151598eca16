"""Route analysis: what routing locality allows paging to achieve, from a route log alone (no engine).

- :class:`RouteLog`: the NPZ format of docs/DESIGN.md §6 (load, save, validate, synthetic logs).
- Analyses (:mod:`.analysis`): :func:`reuse_histogram`, :func:`one_off_share`, :func:`union_sizes` (U(k)),
  :func:`popularity`, :func:`hot_set_hit_rate`.
- Offline cache simulators (:mod:`.simulate`): :func:`simulate` for ``lru``, ``ls``, ``ls_pos`` and Belady's
  MIN over many capacities at once, and the slow literal :func:`simulate_reference` they are tested against.
- :func:`summarize`: everything above as one dict of plain numbers (CLI, notebook JSON).

Nothing here imports the engine: logs are recorded by :mod:`epqlab.route_recording` (or
``Session(route_log=...)``); policy names live in :mod:`epqlab.constants`.
"""
from __future__ import annotations

from .analysis import (expert_counts, hot_set, hot_set_hit_rate, one_off_share, popularity, reuse_distances,
                       reuse_histogram, union_sizes)
from .log import RouteLog, RouteLogError
from .reference import GROUPS, POLICIES, simulate_reference
from .report import default_capacities, summarize
from .simulate import simulate, slots_for_bytes, stack_distances

__all__ = [
    "RouteLog", "RouteLogError", "POLICIES", "GROUPS", "simulate", "simulate_reference", "slots_for_bytes",
    "stack_distances", "reuse_distances", "reuse_histogram", "one_off_share", "union_sizes", "expert_counts",
    "hot_set", "hot_set_hit_rate", "popularity", "summarize", "default_capacities",
]
