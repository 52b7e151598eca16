"""Parameters of the eviction policies: names, defaults (each as its paper sets it) and valid ranges.

One table for the simulators (:mod:`epqlab.routes.online`) and the native pager (:class:`epqlab.Pager`
``policy_params=``), so both run a policy with the same numbers. :func:`policy_params` fills in defaults and
refuses an unknown name or a value out of range with a ValueError that names the range.
"""
from __future__ import annotations

import math

from ..constants import PAGER_POLICIES

# policy -> {parameter: (default, low, high, low_open, high_open, integer)}; the sources are in
# epqlab.routes.online's policy docstrings.
_SPEC: dict[str, dict[str, tuple]] = {
    "fnu": {"fnu_alpha": (0.3, 0.0, 1.0, True, False, False)},          # EMA weight of the newest pass
    "heat": {"half_life": (128.0, 0.0, math.inf, True, True, False)},   # forward passes (ftllm: 128)
    "gate_rank": {"half_life": (128.0, 0.0, math.inf, True, True, False)},  # forward passes (as heat)
    "2q": {"kin": (0.25, 0.0, 1.0, True, True, False),                  # A1in share of the slots (paper: 25%)
           "kout": (0.5, 0.0, 4.0, True, False, False)},                # A1out ghosts per slot (paper: 50%)
    "s3fifo": {"small_ratio": (0.1, 0.0, 1.0, True, True, False),       # S share of the slots (paper: 10%)
               "ghost_ratio": (0.9, 0.0, 4.0, True, False, False),      # G entries per slot (paper: 90%)
               "move_threshold": (2, 1, 3, False, False, True)},        # S -> M when freq >= this (paper: > 1)
    "wtinylfu": {"window": (0.01, 0.0, 1.0, True, True, False),         # window LRU share (paper: 1%)
                 "protected": (0.8, 0.0, 1.0, True, True, False),       # SLRU protected share of main (80%)
                 "sample_factor": (10, 1, 1000, False, False, True)},   # reset after sample_factor x slots
    "lirs": {"hir_ratio": (0.01, 0.0, 1.0, True, True, False)},         # resident HIR share of the slots (paper: 1%)
}


# policy -> {parameter: its values, the default first}; the native pager takes a value's index.
# admit (issue 50's admission knob): "slot", every miss takes a slot (demand paging); "stage", a miss TinyLFU
# refuses at a full arena is read into the staging buffer for its layer step and takes no slot
# (epqlab.routes.policy_tinylfu.WTinyLfu).
_CHOICES: dict[str, dict[str, tuple[str, ...]]] = {
    "wtinylfu": {"admit": ("slot", "stage")},
    "2q": {"admit": ("slot", "stage")},      # stage: a miss not in A1out is staged, its id put in A1out
    "s3fifo": {"admit": ("slot", "stage")},  # stage: a miss not in the ghost FIFO G is staged, its id put in G
}


def native_params(policy: str, params: dict) -> dict[str, float]:
    """Checked ``params`` (:func:`policy_params`) as the native pager takes them: numbers, a choice as its index."""
    ch = _CHOICES.get(policy, {})
    return {k: float(ch[k].index(v)) if k in ch else float(v) for k, v in params.items()}


def param_spec(policy: str) -> dict[str, tuple]:
    """``{name: (default, low, high, low_open, high_open, integer)}`` of ``policy`` (empty when it has none)."""
    return dict(_SPEC.get(policy, {}))


def policy_params(policy: str, params: dict | None = None) -> dict[str, float]:
    """Every parameter of ``policy``: ``params`` over the defaults, checked.

    Raises:
        ValueError: unknown policy (the message lists the valid ones), a parameter the policy does not have
            (lists its parameters), or a value outside its range (names the range).
    """
    if policy not in PAGER_POLICIES:
        raise ValueError(f"unknown eviction policy {policy!r}; choose one of {', '.join(PAGER_POLICIES)}")
    spec = _SPEC.get(policy, {})
    choices = _CHOICES.get(policy, {})
    params = dict(params or {})
    extra = sorted(set(params) - set(spec) - set(choices))
    if extra:
        have = ", ".join([*spec, *choices]) or "none"
        raise ValueError(f"policy {policy!r} has no parameter {extra[0]!r} (its parameters: {have})")
    out: dict[str, float] = {}
    for name, (default, lo, hi, lo_open, hi_open, integer) in spec.items():
        v = params.get(name, default)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or (integer and float(v) != int(v)):
            kind = "an integer" if integer else "a number"
            raise ValueError(f"{policy} {name} must be {kind}, got {v!r}")
        v = int(v) if integer else float(v)
        below = v <= lo if lo_open else v < lo
        above = v >= hi if hi_open else v > hi
        if below or above or v != v:
            rng = f"{'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}"
            raise ValueError(f"{policy} {name} must lie in {rng}, got {v!r}")
        out[name] = v
    for name, values in choices.items():
        v = params.get(name, values[0])
        if v not in values:
            raise ValueError(f"{policy} {name} must be one of {', '.join(values)}, got {v!r}")
        out[name] = v
    return out
