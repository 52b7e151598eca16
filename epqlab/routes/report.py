"""One-call summaries and figures of a route log, for ``epqlab routes`` and notebooks/02_route_overlap.ipynb.
No engine here: logs are recorded by :mod:`epqlab.studies.route_recording`."""
from __future__ import annotations

import numpy as np
import pandas as pd

from ..results import write_json  # noqa: F401  (notebooks written before epqlab.results import it from here)
from .analysis import one_off_share, popularity, reuse_histogram, union_sizes
from .log import RouteLog
from .reference import POLICIES
from .simulators import simulate


def default_capacities(log: RouteLog, per_layer: bool = True, n: int = 12) -> list[int]:
    """About ``n`` capacities spaced geometrically from k to every expert (per layer, or of all layers)."""
    hi = log.n_expert if per_layer else log.n_expert * log.n_layers
    return sorted({int(round(x)) for x in np.geomspace(log.k, max(hi, log.k), n)})


def summarize(log: RouteLog, capacities=None, *, window: int = 48, per_layer: bool = True,
              policies=POLICIES) -> dict:
    """Every analysis of the log as plain numbers: log shape, one-off share in ``window``, cache simulation
    (records of :func:`~epqlab.routes.simulate`), U(k), reuse histogram and popularity (records)."""
    caps = list(capacities) if capacities is not None else default_capacities(log, per_layer)
    sim = simulate(log, caps, policies, per_layer=per_layer)
    return {
        "log": {"n_tokens": log.n_tokens, "n_layers": log.n_layers, "k": log.k, "n_expert": log.n_expert,
                "n_prefill": int((log.phase == 0).sum()), "n_decode": int((log.phase == 1).sum()),
                "requests": log.n_requests, "meta": log.meta},
        "capacity_mode": "per_layer" if per_layer else "total",
        "window": window,
        "one_off_share": one_off_share(log, window),
        "simulation": sim.to_dict("records"),
        "union": union_sizes(log).to_dict("records"),
        "reuse": reuse_histogram(log).to_dict("records"),
        "popularity": popularity(log).to_dict("records"),
    }


def summary_table(summary: dict) -> pd.DataFrame:
    """Hit rate per capacity (rows) and policy (columns), the table ``epqlab routes`` prints."""
    sim = pd.DataFrame(summary["simulation"])
    return sim.pivot(index="capacity", columns="policy", values="hit_rate")[
        [p for p in POLICIES if p in set(sim.policy)]]


def make_figures(summary: dict) -> dict:
    """matplotlib Figures keyed by name: ``hit_rate`` (per policy vs capacity, Belady on top), ``reuse``,
    ``union`` (U(k) and saving), ``popularity``."""
    import matplotlib.pyplot as plt

    figs = {}
    sim = pd.DataFrame(summary["simulation"])
    fig, ax = plt.subplots(figsize=(6, 4))
    style = {"belady": dict(color="k", lw=2.5, zorder=5), "lru": dict(ls="-"), "ls": dict(ls="--"),
             "ls_pos": dict(ls=":")}
    for pol in [p for p in POLICIES if p in set(sim.policy)]:
        d = sim[sim.policy == pol]
        ax.plot(d.capacity, d.hit_rate, marker="o", ms=3, label=pol, **style.get(pol, {}))
    ax.set_xscale("log")
    unit = "slots per layer" if summary["capacity_mode"] == "per_layer" else "total slots"
    ax.set(xlabel=f"capacity ({unit})", ylabel="hit rate", title="Hit rate vs capacity")
    ax.legend()
    figs["hit_rate"] = fig

    reuse = pd.DataFrame(summary["reuse"])
    fig, ax = plt.subplots(figsize=(6, 4))
    r = reuse[reuse.distance > 0]
    ax.bar(r.distance, r.share, width=1.0)
    first = float(reuse.loc[reuse.distance == 0, "share"].sum())
    ax.set(xlabel="reuse distance (tokens)", ylabel="share of requests",
           title=f"Reuse distance (first touches: {first:.1%})")
    if len(r) and r.distance.max() > 50:
        ax.set_xscale("log")
    figs["reuse"] = fig

    u = pd.DataFrame(summary["union"])
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(u.k, u.union, marker="o", label="U(k)")
    ax.set(xlabel="tokens per batch k", ylabel="distinct experts per layer U(k)", title="Union over k tokens")
    ax2 = ax.twinx()
    ax2.plot(u.k, u.saving, color="C1", marker="s", label="I/O saving")
    ax2.set_ylabel("saving 1 - U(k)/(k U(1))")
    figs["union"] = fig

    pop = pd.DataFrame(summary["popularity"])
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(pop.n, pop.top_share, marker="o", label="top-N share (in-sample)")
    ax.plot(pop.n, pop.hot_set_hit_rate, marker="s", label="pin list from 1st half, on 2nd half")
    ax.set_xscale("log")
    ax.set(xlabel="experts pinned per layer N", ylabel="share of requests", title="Expert popularity")
    ax.legend()
    figs["popularity"] = fig
    return figs


def reading(summary: dict) -> str:
    """A short Markdown reading of :func:`summarize`'s output; every number in it is computed from ``summary``.
    Per capacity it names the best online policy and its share of Belady's hit rate (the bound no online policy
    beats, Belady 1966); then the one-off share, what batching k tokens saves (U(k)) and how much a static pin
    list of the k most popular experts holds out of sample."""
    sim = pd.DataFrame(summary["simulation"])
    log = summary["log"]
    unit = "slots per layer" if summary["capacity_mode"] == "per_layer" else "slots in all"
    out = [f"**Reading** ({log['n_tokens']} tokens, {log['n_layers']} layers, top-{log['k']} of {log['n_expert']} "
           f"experts, {log['requests']} requests).", ""]
    online = [p for p in POLICIES if p != "belady" and p in set(sim.policy)]
    for cap, g in sim.groupby("capacity"):
        g = g.set_index("policy")
        if not online:
            break
        best = max(online, key=lambda p: (g.loc[p, "hit_rate"], -online.index(p)))
        b = float(g.loc[best, "hit_rate"])
        line = f"- {int(cap)} {unit}: best online policy {best}, hit rate {b:.1%}"
        if "belady" in g.index:
            bel = float(g.loc["belady", "hit_rate"])
            line += f"; Belady {bel:.1%}" + (f" ({b / bel:.0%} of the bound)" if bel > 0 else "")
        if "lru" in g.index and best != "lru":
            line += f"; LRU {float(g.loc['lru', 'hit_rate']):.1%}"
        out.append(line + ".")
    out.append(f"- {summary['one_off_share']:.1%} of requests in {summary['window']}-token windows are one-offs "
               f"(the expert is not requested again in the window): no cache can hit them within it.")
    u = pd.DataFrame(summary["union"])
    if len(u) > 1:
        last = u.iloc[-1]
        out.append(f"- A batch of {int(last.k)} tokens needs {last.union:.1f} distinct experts per layer (U(1) = "
                   f"{u.iloc[0].union:.1f}): loading each once saves {last.saving:.0%} of the reads.")
    pop = pd.DataFrame(summary["popularity"])
    row = pop[pop.n == log["k"]]
    if len(row):
        r = row.iloc[0]
        out.append(f"- The {log['k']} most requested experts per layer take {r.top_share:.1%} of requests in sample; "
                   f"pinned from the first half of the log they serve {r.hot_set_hit_rate:.1%} of the second half.")
    return "\n".join(out)
