"""Forecast against measured: ``epqlab plan`` over several model shapes and budgets, prefetch off and with the
predictor, each row verified under a hard memory limit on text the calibration did not see.

    .venv/bin/epqlab model synth qwen35-a3b /work/big/q35.gguf                      # 20.8 GiB, the 35B-A3B shape
    .venv/bin/epqlab model synth laguna-s /work/big/laguna12.gguf --n-layer 12
    .venv/bin/epqlab predictor fit /work/big/q35.gguf /work/big/q35.predictor.npz --depth 1   # the trained rows
    .venv/bin/python bench/bench_plan.py --model default=default --budgets default=auto \\
        --model q35=/work/big/q35.gguf --budgets q35=4GiB,8GiB,16GiB --repeats 3 --json bench/results/plan.json

For each model: ``epqlab.plan`` (timed: the goal is <= 2 min on the 35B shape) with the budgets given, then
``Plan.verify(repeats)``: every row measured alone, the runs interleaved over budgets and prefetch settings, the
model dropped from the page cache before each. A ``<model>.predictor.npz`` beside a model makes its prefetch rows
"trained" (else router lookahead). Nothing of the forecast is fitted to these measurements: its terms come from
the plan's own calibration. Prints per model the plan's table with measured and error columns, and at the end the
median and max |error| over all rows (goal: median <= 10%, every row <= 20%). Run it alone: a build, a test suite
or a helper beside it measures the contention.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

from epqlab.models import default_model
from epqlab.results import run_info, write_json
from epqlab.studies.plan import plan
from epqlab.studies.plan_report import format_plan, to_json


def _pairs(items, what):
    out = {}
    for x in items or []:
        if "=" not in x:
            raise SystemExit(f"--{what} takes NAME=VALUE, got {x!r}")
        k, v = x.split("=", 1)
        out[k] = v
    return out


def tune_vs_grid(model, quality, n, repeats, threads, budget=None) -> dict:
    """``epqlab.tune``'s pick against the fastest qualifying setting of an exhaustive grid at the same budget and
    quality rule: every online policy x prefetch off / the plan's predictor, top-k at every k below the model's,
    cache routing at four margins and both adaptive-k rules (with tune's policy), all measured as tune measures (same windows, repeats,
    interleaved), at ``budget`` (default the plan's recommended one). Goal: the pick within 5% of the grid's best."""
    import pandas as pd

    from epqlab.constants import ONLINE_POLICIES
    from epqlab.layout import inspect
    from epqlab.studies.ablation.lossy import DEFAULT_ADAPTIVE, knob_settings
    from epqlab.studies.plan import split_text
    from epqlab.data import heldout_texts
    from epqlab.studies.sweeps import sweep
    from epqlab.studies.tune import pick, tune, tune_point

    t0 = time.perf_counter()
    t = tune(model, quality, budget=budget, n=n, repeats=repeats, n_threads=threads)
    tune_s = time.perf_counter() - t0
    print(f"== tune ({tune_s:.0f} s)", flush=True)
    lay = inspect(model)
    k = lay.n_expert_used
    pf = next((r for r in t.plan.rows if r.prefetch != "off"), None)
    grid = []
    for pol in ONLINE_POLICIES:
        if pol == "static":
            continue  # needs hot experts from a calibration
        grid.append((f"grid {pol}, off", False, {"policy": pol}))
        if pf is not None:
            kw = {kk: v for kk, v in pf.session_kwargs().items() if kk not in ("ram_budget", "policy")}
            grid.append((f"grid {pol}, prefetch {pf.prefetch}", False, {"policy": pol, **kw}))
    for knob, setting, kw in knob_settings(k, ks=tuple(range(1, k)), taus=(), deltas=(0.02, 0.05, 0.1, 0.2),
                                           adaptive=DEFAULT_ADAPTIVE):
        if knob != "exact":
            pol = t.best["session_kwargs"].get("policy", "lru")
            grid.append((f"grid {knob} {setting}, {pol}", True, {"policy": pol, **kw}))
    _, second = split_text(heldout_texts()["prose"])
    points = [dict(model=str(lay.path), ram_budget=t.budget, label=lab, lossy=lossy, kw=kw, prompt=t.plan.prompt,
                   windows=[second], n=n, batch=1, n_threads=threads)
              for _ in range(repeats) for lab, lossy, kw in grid]
    df = sweep(tune_point, points, progress=False)
    g = df.groupby("label", sort=False)
    frame = pd.DataFrame({"lossy": g["lossy"].first(), "decode_tok_s": g["decode_tok_s"].median(),
                          "tok_s_min": g["decode_tok_s"].min(), "tok_s_max": g["decode_tok_s"].max()}).reset_index()
    nll = {lab: next(r["nll"] for r in df.to_dict(orient="records") if r["label"] == lab) for lab in frame.label}
    frame, top, why = pick(frame, nll, t.quality)
    ratio = t.best["decode_tok_s"] / float(top.decode_tok_s)
    print(f"tune picked {t.best['label']} ({t.best['decode_tok_s']:.2f} tok/s); the grid's best {top.label} "
          f"({top.decode_tok_s:.2f}): {ratio:.3f}", flush=True)
    return {"tune_s": tune_s, "pick": t.best, "why": t.why, "grid_best": {"label": top.label, "decode_tok_s":
            float(top.decode_tok_s), "lossy": bool(top.lossy), "why": why}, "ratio": ratio,
            "grid": frame.drop(columns=[c for c in ("kwargs",) if c in frame]).to_dict(orient="records"),
            "tune_frame": t.frame.drop(columns=["kwargs"]).to_dict(orient="records")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    ap.add_argument("--model", action="append", required=True, metavar="NAME=PATH", help="'default' = the default model")
    ap.add_argument("--budgets", action="append", metavar="NAME=LIST", help="per model (default auto)")
    ap.add_argument("-n", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--row-policies", default="best", choices=["best", "best+default"],
                    help="forecast rows per budget: the best simulated policy (default), or it and lru")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("--results-dir", default=None, metavar="DIR",
                    help="also write each model's plan as DIR/08_plan/<name>.json (for epqlab report: papers/08_plan.md)")
    ap.add_argument("--tune", default=None, metavar="NAME", help="also check tune on this model against an exhaustive grid")
    ap.add_argument("--quality", default="0.5%")
    ap.add_argument("--tune-budget", default=None, metavar="SIZE",
                    help="the budget tune and the grid run at (default the plan's recommended one)")
    a = ap.parse_args(argv)
    models = _pairs(a.model, "model")
    budgets = _pairs(a.budgets, "budgets")
    out = {"run": run_info(None), "models": {}, "n": a.n, "repeats": a.repeats}
    errs = []
    for name, path in models.items():
        path = str(default_model(progress=False)) if path == "default" else path
        t0 = time.perf_counter()
        p = plan(path, budgets.get(name, "auto"), n=a.n, n_threads=a.threads, row_policies=a.row_policies)
        plan_s = time.perf_counter() - t0
        p.verify(repeats=a.repeats, progress=True)
        print(f"== {name}: plan {plan_s:.0f} s, verify {time.perf_counter() - t0 - plan_s:.0f} s", flush=True)
        print(format_plan(p), flush=True)
        doc = to_json(p)
        doc["plan_s"] = plan_s
        out["models"][name] = doc
        if a.results_dir:
            write_json({**doc, "notebook": "08_plan", "run_name": f"bench-{name}", "bench": "bench/bench_plan.py",
                        "parameters": {"model": path, "budgets": budgets.get(name, "auto"), "n": a.n,
                                       "repeats": a.repeats, "n_threads": a.threads}},
                       f"{a.results_dir}/08_plan/bench-{name}.json")
        errs += [abs(r.error_pct) for r in p.rows if r.error_pct is not None]
        if a.json:
            write_json(out, a.json)
    if a.tune:
        path = models[a.tune]
        path = str(default_model(progress=False)) if path == "default" else path
        out["tune"] = tune_vs_grid(path, a.quality, a.n, a.repeats, a.threads, a.tune_budget)
        if a.json:
            write_json(out, a.json)
    if errs:
        out["summary"] = {"rows": len(errs), "median_abs_error_pct": statistics.median(errs), "max_abs_error_pct": max(errs),
                          "within_10": sum(e <= 10 for e in errs), "within_20": sum(e <= 20 for e in errs)}
        print(f"all models: |error| median {statistics.median(errs):.1f}%, max {max(errs):.1f}% over {len(errs)} rows; "
              f"{out['summary']['within_10']} within 10%, {out['summary']['within_20']} within 20%")
    if a.json:
        write_json(out, a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
