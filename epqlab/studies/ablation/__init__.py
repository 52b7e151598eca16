"""Ablations: sweeps of one knob (eviction policy, top-k, the lossy skip-cold threshold) over arenas or RAM
budgets, with the metrics defined once in :mod:`epqlab.studies.ablation.grid`."""
from .eviction import DEFAULT_POLICIES, PRESETS as EVICTION_PRESETS, calibration_route_log, eviction, hot_experts
from .eviction import preset_settings as eviction_preset
from .eviction_report import figures as eviction_figures, reading as eviction_reading
from .eviction_report import hit_table as eviction_hit_table, replay_table as eviction_replay_table
from .eviction_report import speed_table as eviction_speed_table
from .routing_cap import reading as routing_cap_reading, routing_cap, uniform_routes
from .grid import WARMUP_PASSES, MemoryPoint, measure_prompts, memory_points, save, summarize
from .skip_cold import skip_cold
from .topk import topk
from .lossy import lossy_knobs

__all__ = ["lossy_knobs", "eviction", "eviction_figures", "eviction_reading", "eviction_hit_table", "eviction_speed_table",
           "eviction_replay_table", "EVICTION_PRESETS", "eviction_preset", "hot_experts", "calibration_route_log",
           "DEFAULT_POLICIES", "memory_points", "MemoryPoint",
           "measure_prompts", "summarize", "save", "WARMUP_PASSES", "topk", "skip_cold", "routing_cap",
           "routing_cap_reading", "uniform_routes"]
