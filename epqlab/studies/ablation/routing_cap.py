"""How much of Belady's bound any online eviction policy can reach, given how predictable routing is.

Belady's MIN knows every future route; an online policy knows only the past. Under the independent
reference model (each forward pass picks its experts independently of the past) the best online
policy is A0, "keep the most probable experts" (Aho, Denning & Ullman, "Principles of optimal page
replacement", J. ACM 18(1), 1971). When routing is also *uniform* — every expert of a layer equally
likely — an online policy cannot do better than chance: a layer's picks are an exchangeable random
subset of its E experts, so each requested expert is resident with probability r_l / E, where r_l is
the number of that layer's experts resident at the request. Summed over the L MoE layers, r_l cannot
exceed the arena's slot count, so

    online hit rate  <=  slots / (L * E)                                  (the uniform-routing bound)

while Belady's MIN on the same uniform routes hits far more often (it keeps exactly the experts that
are about to be picked). Routing that is close to uniform therefore caps every online policy well
below Belady, whatever its rule. :func:`routing_cap` measures this next to a live sweep: it replays
i.i.d. uniform routes *of the same shape* as the run's route log (same tokens, ubatches, layers, k,
rows that were not routed) through the real pager — Belady and the online policies, same arena —
so the model's own "best online / Belady" can be read against the routing-free reference.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from ...layout import inspect
from ...paging.pager import Pager

REFERENCE_POLICIES = ("lru", "ls_pos", "lfu", "fnu")


def uniform_routes(experts, n_expert: int, seed: int = 0) -> np.ndarray:
    """I.i.d. uniform routes shaped like ``experts``: int32 ``[T, L, k]``; each (token, layer) row holding
    top-k ids gets k distinct ids drawn uniformly from ``[0, n_expert)``; rows of -1 (not routed) stay -1.

    Raises:
        ValueError: ``experts`` is not ``[T, L, k]`` or k > n_expert."""
    ex = np.asarray(experts)
    if ex.ndim != 3:
        raise ValueError(f"experts must be [T, L, k], got shape {ex.shape}")
    T, L, k = ex.shape
    if k > n_expert:
        raise ValueError(f"top-k {k} exceeds n_expert {n_expert}")
    rng = np.random.default_rng(seed)
    # k distinct ids per row: the first k of a random permutation (argsort of uniform keys).
    out = np.argsort(rng.random((T, L, n_expert)), axis=2)[:, :, :k].astype(np.int32)
    out[(ex < 0).any(axis=2)] = -1
    return out


def routing_cap(model, df, policies: Sequence[str] = REFERENCE_POLICIES, *, seed: int = 0):
    """Uniform-routing reference for an eviction sweep (:func:`epqlab.studies.ablation.eviction`).

    For each memory point of ``df`` (its ``arena_bytes``), replays the first run's route log
    (``df.attrs["route_log"]``) and i.i.d. uniform routes of the same shape (:func:`uniform_routes`)
    through fresh :class:`epqlab.Pager` objects: Belady's MIN and each online policy in ``policies``.
    Hit rates are lifetime (every pass, prefill included), as in ``df``'s ``hit_rate`` column.

    Args:
        model: the MoE GGUF path the sweep ran on.
        df: the DataFrame returned by :func:`epqlab.studies.ablation.eviction`.
        policies: online policies replayed on the uniform routes.
        seed: RNG seed of the uniform routes.

    Returns:
        pandas.DataFrame, one row per point: ``point``, ``slots``, ``uniform_bound`` (slots / (L * E),
        capped at 1: no online policy can exceed it on uniform routes, see the module docstring),
        ``uniform_best_online`` and ``uniform_best_policy``, ``uniform_belady``, ``uniform_ratio``
        (best online / Belady on uniform routes), and the same for the model's own log: ``model_best_online``
        (best of ``df``'s live policies at that point), ``model_best_policy``, ``model_belady``,
        ``model_ratio``.
    """
    import pandas as pd

    log = df.attrs["route_log"]

    def field(name):  # a dict or a RouteLog
        return log.get(name) if isinstance(log, dict) else getattr(log, name, None)

    layout = inspect(model)
    ex = np.asarray(field("experts"), np.int32)
    k = int(df.attrs.get("n_expert_used") or ex.shape[2])
    E = int(layout.n_expert)
    uni = {"experts": uniform_routes(ex, E, seed), "layers": np.asarray(field("layers")), "ubatch": field("ubatch")}
    rows = []
    for point, g in df.groupby("point", sort=False):
        arena = int(g["arena_bytes"].iloc[0])
        rates = {}
        for pol in (*policies, "belady"):
            p = Pager(layout, arena, policy=pol, n_expert_used=k)
            st = p.replay(uni)
            rates[pol] = st["hits"] / st["requests"] if st["requests"] else 0.0
            slots = p.n_slots
        best = max(policies, key=lambda q: rates[q])
        live = g.set_index("policy")["hit_rate"]
        mbest = live.idxmax()
        mbel = float(g["belady_hit_rate"].iloc[0])
        rows.append({"point": point, "slots": slots, "uniform_bound": min(1.0, slots / (ex.shape[1] * E)),
                     "uniform_best_online": rates[best], "uniform_best_policy": best, "uniform_belady": rates["belady"],
                     "uniform_ratio": rates[best] / rates["belady"] if rates["belady"] else float("nan"),
                     "model_best_online": float(live[mbest]), "model_best_policy": mbest, "model_belady": mbel,
                     "model_ratio": float(live[mbest]) / mbel if mbel else float("nan")})
    return pd.DataFrame(rows)


def reading(cap) -> str:
    """One line per point from :func:`routing_cap`'s table: the model's best online share of Belady beside
    the share uniform routing allows."""
    lines = []
    for r in cap.itertuples():
        lines.append(
            f"{r.point} ({r.slots} slots): on the model's routes the best online policy ({r.model_best_policy}) reaches "
            f"{r.model_ratio:.0%} of Belady ({r.model_best_online:.1%} vs {r.model_belady:.1%}); on uniform routes of the "
            f"same shape the best ({r.uniform_best_policy}) reaches {r.uniform_ratio:.0%} ({r.uniform_best_online:.1%} vs "
            f"{r.uniform_belady:.1%}), and no online policy can exceed slots / (L x E) = {r.uniform_bound:.1%} there.")
    return "\n".join(lines)
