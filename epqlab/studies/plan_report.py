"""The text, JSON and figures of a :class:`epqlab.studies.plan.Plan`: the forecast table with the model's terms
printed so a reader can redo the arithmetic (:mod:`epqlab.studies.plan_model`), the recommended command and
Session call, and after ``verify`` the measured speed and the error of each forecast."""
from __future__ import annotations

import statistics

from ..units import fmt_bytes


def _gib(b) -> str:
    return fmt_bytes(int(b))


def size_arg(b: int) -> str:
    """A byte count as a ``--ram-budget`` argument: ``8GiB``, ``386MiB`` or bytes."""
    b = int(b)
    for unit, n in (("GiB", 2**30), ("MiB", 2**20)):
        if b % n == 0:
            return f"{b // n}{unit}"
    return str(b)


def terms_lines(p) -> list[str]:
    out = []
    for name, t in p.terms.items():
        head = (f"  {name:<10} C0 {t.compute_us / 1e3:.1f} ms/step + kappa {t.kappa_us_per_mb:.1f} µs/MB read + c_wait "
                f"{t.wait_us_per_layer:.0f} µs/layer waiting, c_map {t.map_us_per_miss:.0f} µs/miss, k_io {t.k_io:.2f}")
        if name == "off":
            n = t.notes
            head += (f" (measured io wait {n['measured_io_us'] / 1e3:.1f} ms over the probe's {n['model_read_us'] / 1e3:.1f} ms "
                     f"for {n['sim_decode_misses']} simulated / {n['live_decode_misses']} live misses)")
            fit = n.get("compute_fit")
            if fit == "resident":
                head += (f"; C0 = the median compute of the resident run's {n.get('resident_steps')} steps that read "
                         "nothing, c_wait the line to the calibration's")
            elif fit == "plain":
                head += (f"; C0 = plain llama.cpp's {n['plain_us'] / 1e3:.1f} ms per step inside the same limit (every "
                         f"weight in the page cache; {n.get('resident_why')}), c_wait the line to the calibration's")
            elif fit:
                head += f"; C0, kappa: {fit} of the calibration's steps" + (f" ({n['resident_why']})" if n.get("resident_why") else "")
        else:
            n = t.notes
            head += (f", P {t.predict_us / 1e3:.2f} ms/step at {t.predict_misses_per_step:.1f} misses/step, phi {t.phi:.2f}, w {t.waste_per_layer:.2f} wasted/layer, "
                     f"W {t.window_us / 1e3:.2f} ms, k_pf {t.k_pf:.2f} (measured {n['measured_io_us'] / 1e3:.1f} ms over "
                     f"modelled {n['model_wait_us'] / 1e3:.1f} ms)")
        out.append(head)
    t = p.terms["off"]
    out.append(f"  prefill    c_pre {t.prefill_us_per_token / 1e3:.2f} ms/token compute; reads at the probe's best MB/s")
    return out


def format_plan(p) -> str:
    """The whole report as text (what ``epqlab plan`` prints)."""
    c = p.calibration["off"]
    lines = [f"epqlab plan  {p.model}", ""]
    pr = p.probe
    dev = "; ".join(f"{fmt_bytes(s)} reads " + ", ".join(f"{cc}: {bw:.0f}" for cc, bw in zip(*pr["table"][s]))
                    for s in sorted(pr["table"]))
    lines.append(f"device   {'cached ' + pr['cache'] if pr['cached'] else 'probed in %.1f s, cached %s' % (pr['seconds'], pr['cache'])}")
    lines.append(f"         MB/s by reads in flight: {dev}")
    lines.append(f"calibration at {_gib(p.budgets[0])}: {c['n_steps']} teacher-forced steps, {c['decode_tok_s']:.2f} tok/s "
                 f"(hit {c['decode_hit_rate']:.3f}), used before the arena {_gib(c['used_before_arena'])}; "
                 + "; ".join(f"{k} {v['decode_tok_s']:.2f} tok/s" for k, v in p.calibration.items() if k != "off"))
    lines.append("terms (T_off = C + k_io*read(m) + c_map*m; T_pf = C + P + "
                 "k_pf*(read((1-phi)m) + max(0, read(phi m + w) - W)) + c_map*m; C = C0 + kappa*MB + c_wait*layers waiting; "
                 "m: a step's misses per layer):")
    lines += terms_lines(p)
    lines.append("")
    lines.append("simulated hit rate on the calibration trace (every slot class a shared pool):")
    pols = [k for k in p.policies[0] if k not in ("budget", "arena_bytes", "slots")] if p.policies else []
    lines.append(f"  {'budget':>10} {'arena':>10} {'slots':>6}  " + "  ".join(f"{x:>7}" for x in pols))
    for r in p.policies:
        lines.append(f"  {_gib(r['budget']):>10} {_gib(r['arena_bytes']):>10} {r['slots']:>6}  "
                     + "  ".join(f"{r[x]:>7.3f}" for x in pols))
    lines.append("")
    hdr = (f"  {'budget':>10} {'cover':>5} {'policy':>7} {'prefetch':>9} {'hit':>5} {'MB/tok':>7} {'compute':>7} {'io':>6} "
           f"{'map':>5} {'pred':>5} {'ms/tok':>7} {'tok/s':>6} {'roof ms':>7} {'pre512':>7}")
    if p.verified:
        hdr += f" {'measured':>8} {'err %':>6}"
    lines.append("forecast, decode after a short prompt (ms per token, tok/s; pre512: prefill tok/s of a 512-token prompt):")
    lines.append(hdr)
    for r in p.rows:
        pm = r.parts_ms
        s = (f"  {_gib(r.budget):>10} {r.coverage:>5.2f} {r.policy:>7} {r.prefetch:>9} {r.hit_rate:>5.3f} "
             f"{r.miss_mb_per_token:>7.2f} {pm['compute']:>7.1f} {pm['io']:>6.1f} {pm['map']:>5.1f} {pm['predict']:>5.1f} "
             f"{r.decode_ms:>7.1f} {r.decode_tok_s:>6.2f} {r.roofline_ms:>7.1f} {r.prefill_tok_s or 0:>7.1f}")
        if p.verified:
            s += (f" {r.measured_tok_s:>8.2f} {r.error_pct:>+6.1f}" if r.measured_tok_s
                  else f" {'FAIL':>8} {'':>6}  {(r.measured_reason or '')[:80]}")
        lines.append(s)
    if p.verified:
        errs = [abs(r.error_pct) for r in p.rows if r.error_pct is not None]
        if errs:
            lines.append(f"  |error|: median {statistics.median(errs):.1f}%, max {max(errs):.1f}% over {len(errs)} rows "
                         "(measured: median of the runs, each under a hard limit of the budget + 16 MiB, on the second "
                         "half of the text)")
    lines.append("")
    lines += recommendation_lines(p)
    lines.append(f"plan took {p.seconds:.0f} s")
    return "\n".join(lines)


def recommendation_lines(p) -> list[str]:
    b = p.best
    kw = b.session_kwargs()
    cli = [f"--ram-budget {size_arg(kw['ram_budget'])}", f"--policy {kw['policy']}"]
    if kw.get("prefetch"):
        cli.append(f"--prefetch {kw['prefetch']}")
        if kw.get("prefetch_predictor"):
            cli.append(f"--predictor {kw['prefetch_predictor']}")
    args = ", ".join(f"{k}={size_arg(v)!r}" if k == "ram_budget" else f"{k}={v!r}" for k, v in kw.items())
    out = [f"recommended: {b.decode_tok_s:.2f} tok/s forecast at {_gib(b.budget)}, policy {b.policy}, prefetch {b.prefetch} "
           f"({p.recommendation['why']})",
           f"  epqlab run {p.model} {' '.join(cli)}",
           f"  epqlab serve {p.model} {' '.join(cli)}",
           f"  Session({p.model!r}, {args})"]
    fit = p.recommendation.get("fit_predictor")
    if fit:
        out.append(f"  prefetch pays here: fit the trained predictor first (about {fit['minutes']} min; {fit['why']}):")
        out.append(f"  epqlab predictor fit {p.model} {p.model.rsplit('.', 1)[0]}.predictor.npz --depth 1, then plan again")
    return out


def to_json(p) -> dict:
    """The plan as JSON-ready data (the table, the terms, the probe, the calibration, the recommendation)."""
    import dataclasses

    df = p.to_frame()
    return {"model": p.model, "budgets": p.budgets, "rows": df.to_dict(orient="records"), "policies": p.policies,
            "terms": {k: dataclasses.asdict(t) for k, t in p.terms.items()},
            "probe": {k: v for k, v in p.probe.items() if k != "table"}
            | {"table": {str(s): {"concurrency": list(c), "mb_s": list(bw)} for s, (c, bw) in p.probe["table"].items()}},
            "calibration": p.calibration, "recommendation": p.recommendation,
            "best": {"budget": p.best.budget, "policy": p.best.policy, "prefetch": p.best.prefetch,
                     "session_kwargs": p.best.session_kwargs()},
            "seconds": p.seconds, "n_steps": p.n_steps, "verified": p.verified,
            "measured_runs": [r.measured_runs for r in p.rows]}


COLUMNS = {"budget_s": "budget", "coverage": "cover", "policy": "policy", "prefetch": "prefetch",
           "hit_rate": "hit", "miss_mb_per_token": "MB/token", "compute_ms": "compute ms", "io_ms": "io ms",
           "map_ms": "map ms", "predict_ms": "predict ms", "decode_tok_s": "forecast tok/s",
           "measured_tok_s": "measured tok/s", "error_pct": "error, % of measured", "prefill_tok_s": "prefill 512 tok/s"}
"""Columns of the forecast table a paper shows (``budget_s``: the budget in words)."""


def frame(doc: dict):
    """The forecast rows of a plan JSON (:func:`to_json`) as a DataFrame with ``budget_s`` added."""
    import pandas as pd

    df = pd.DataFrame(doc["rows"])
    df.insert(0, "budget_s", [fmt_bytes(int(b)) for b in df.budget])
    return df


def reading(doc: dict) -> str:
    """What the plan says, from its JSON alone: the recommendation, the terms that dominate, and (verified) how far
    the forecasts were from measurement, naming the rows that missed by more than 20%."""
    df = frame(doc)
    best = doc["best"]
    t = doc["terms"]["off"]
    out = [f"The plan recommends {fmt_bytes(best['budget'])} with policy {best['policy']} and prefetch {best['prefetch']} "
           f"({doc['recommendation']['why']}). Compute is {t['compute_us'] / 1e3:.1f} ms per step; the device "
           f"delivered its probed reads at 1/{t['k_io']:.2f} of the probe's speed during decode (k_io)."]
    if doc.get("verified") and df.error_pct.notna().any():
        e = df.error_pct.dropna().abs()
        bad = df[df.error_pct.abs() > 20]
        out.append(f"Against measurement ({len(e)} rows): median |error| {e.median():.1f}%, max {e.max():.1f}%; "
                   f"{(e <= 10).sum()} of {len(e)} rows within 10%, {(e <= 20).sum()} within 20%.")
        if len(bad):
            out.append("Rows off by more than 20%: " + "; ".join(
                f"{r.budget_s} {r.policy} {r.prefetch} (forecast {r.decode_tok_s:.2f}, measured {r.measured_tok_s:.2f})"
                for r in bad.itertuples()) + ".")
    fit = doc["recommendation"].get("fit_predictor")
    if fit:
        out.append(f"Prefetch pays here; fitting the trained predictor takes about {fit['minutes']} min.")
    return " ".join(out)


def plot(p):
    """Forecast against measured decode tok/s (after verify), one point per row, and the error distribution:
    a matplotlib Figure."""
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    rows = [r for r in p.rows if r.measured_tok_s]
    for pf in sorted({r.prefetch for r in rows}):
        xs = [r.measured_tok_s for r in rows if r.prefetch == pf]
        ys = [r.decode_tok_s for r in rows if r.prefetch == pf]
        a.scatter(xs, ys, label=f"prefetch {pf}")
    if rows:
        hi = max(max(r.measured_tok_s, r.decode_tok_s) for r in rows) * 1.1
        a.plot([0, hi], [0, hi], "k--", lw=1)
        a.fill_between([0, hi], [0, 0.9 * hi], [0, 1.1 * hi], color="grey", alpha=0.15, label="±10%")
        b.hist([r.error_pct for r in rows], bins=10)
    a.set_xlabel("measured decode tok/s")
    a.set_ylabel("forecast decode tok/s")
    a.legend()
    b.set_xlabel("forecast error, % of measured")
    b.set_ylabel("rows")
    fig.tight_layout()
    return fig


__all__ = ["COLUMNS", "frame", "reading", "format_plan", "recommendation_lines", "terms_lines", "to_json", "plot"]
