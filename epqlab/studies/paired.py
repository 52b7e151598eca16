"""How far a lossy setting's perplexity is from exact's, with the noise of the scored tokens: one paired interval
that every reading uses (``epqlab tune``, ``epqlab ablate lossy`` per token and batched, notebook 07).

Both runs score the same forced tokens, so the difference is taken token by token: d_i = nll_i - nll_exact_i
(nats), mean d and its standard error sd(d) / sqrt(n), and a normal-approximation 95% interval mean d -/+ 1.96 se.
The perplexity ratio to exact is exp(mean d) (the ratio of the two perplexities over those tokens), its interval
exp(mean d -/+ 1.96 se). A ratio whose interval holds 1 is not distinguishable from exact on those tokens: a few
hundred scored tokens often leave an interval a percent or more wide, so a point estimate such as x0.996 says
nothing by itself.
"""
from __future__ import annotations

import math

import numpy as np

Z95 = 1.96  # the normal quantile of a two-sided 95% interval


def paired_cost(nll, nll_exact, z: float = Z95) -> tuple[float, float, float]:
    """Perplexity cost of a setting against exact on the same forced tokens, with a normal-approximation interval of
    the paired per-token NLL difference: ``(cost, low, high)`` = exp(mean d) - 1 and exp(mean d -/+ z se) - 1, d_i =
    nll_i - nll_exact_i (nats), se = sd(d) / sqrt(n) (sd with n - 1; one token: an infinite interval). Raises
    ValueError when the token counts differ or there are none."""
    d = np.asarray(nll, np.float64) - np.asarray(nll_exact, np.float64) if len(nll) == len(nll_exact) else None
    if d is None or d.size == 0:
        raise ValueError(f"paired cost needs the same scored tokens: {len(nll)} vs {len(nll_exact)}")
    m = float(d.mean())
    se = float(d.std(ddof=1) / math.sqrt(d.size)) if d.size > 1 else float("inf")
    return math.expm1(m), math.expm1(m - z * se), math.expm1(m + z * se)


def ratio_interval(nll, nll_exact, z: float = Z95) -> tuple[float, float, float]:
    """:func:`paired_cost` as perplexity ratios to exact: ``(ratio, low, high)``, each 1 + the cost."""
    return tuple(1.0 + c for c in paired_cost(nll, nll_exact, z))


def worded(ratio: float, low: float, high: float, n: int) -> str:
    """``x1.004 (95% x0.998..x1.010 over 412 tokens)``, and ``: not distinguishable from exact`` when the interval
    holds 1."""
    same = ": not distinguishable from exact" if low <= 1.0 <= high else ""
    return f"x{ratio:.3f} (95% x{low:.3f}..x{high:.3f} over {n} tokens{same})"


__all__ = ["paired_cost", "ratio_interval", "worded", "Z95"]
