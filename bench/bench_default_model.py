"""Quality and routing of the default MoE model.

Prints, as JSON blocks and tables:

1. E, k, bytes per expert of each type; build time (``--build-runs N`` rebuilds it N times into a temp
   directory: median and all runs, with the 1-minute load average before each).
2. Perplexity (epqlab.engine.perplexity.perplexity, windows of 512 tokens, plain llama.cpp) of the dense
   SmolLM2 and of the MoE model at every k from 1 to E, on each held-out text (epqlab.data.heldout_texts)
   and on the Python reference chapter (eval_execmodel.txt); ratio to dense at the default k.
3. The same perplexity at the default k through llama-cpp-python's own defaults (CPU weight repacking on)
   next to epqlab's engine, per text; per-layer router margins (median gap between the k-th and
   (k+1)-th router logit on the calibration tokens, stored in the GGUF by the build).
4. Routing locality from a route log recorded over epqlab.data.prompts() (chat, code, prose; prefill
   and ``--n-predict`` decoded tokens each), next to uniform random routing of the same shape:
   previous-token repeat rate, U(k) savings, per-layer popularity skew, LRU and Belady hit rates at
   arenas of 10/25/50 % (one pool of slots over all layers).
5. The greedy answer to a CPU-cache question at the default k.

    python bench/bench_default_model.py [--ks 1 4 16] [--build-runs 3] [--n-predict 48] [--synth-layers 4]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time


def build_times(runs: int) -> list[tuple[float, float]]:
    """(seconds, 1-min load average before the run) of ``runs`` fresh builds of the default model."""
    from epqlab.models import DEFAULT_CONFIG
    from epqlab.models.moefy import moefy
    from epqlab.models.smollm2 import source_gguf

    out = []
    src = source_gguf()
    with tempfile.TemporaryDirectory() as d:
        for i in range(runs):
            load = os.getloadavg()[0]
            t0 = time.perf_counter()
            moefy(src, os.path.join(d, f"m{i}.gguf"), DEFAULT_CONFIG, progress=False)
            out.append((time.perf_counter() - t0, load))
    return out


def fmt_table(rows: list[dict], cols: list[str]) -> str:
    w = {c: max(len(c), *(len(f"{r.get(c, '')}") for r in rows)) for c in cols}
    lines = ["  ".join(c.rjust(w[c]) for c in cols)]
    lines += ["  ".join(f"{r.get(c, '')}".rjust(w[c]) for c in cols) for r in rows]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ks", type=int, nargs="*", default=None, help="top-k values (default: 1..E)")
    ap.add_argument("--build-runs", type=int, default=0, help="time this many fresh builds")
    ap.add_argument("--n-predict", type=int, default=48, help="decoded tokens per prompt for the route log")
    ap.add_argument("--route-log", default="/tmp/epqlab-default-routes.npz")
    ap.add_argument("--synth-layers", type=int, default=0, help="also time synthesize(qwen3-30b-a3b, n_layer=N)")
    ap.add_argument("--synth-out", default="/tmp/epqlab-synth-bench.gguf")
    args = ap.parse_args()

    from gguf import GGUFReader

    from epqlab.data import heldout_texts, read_text
    from epqlab.layout import inspect
    from epqlab.models import DEFAULT_CONFIG, default_model
    from epqlab.studies.model_quality import (llama_cpp_perplexity, locality_stats, perplexity_of, perplexity_table,
                                       record_prompt_routes, uniform_log)
    from epqlab.models.smollm2 import source_gguf

    res: dict = {}
    t0 = time.perf_counter()
    path = default_model()
    res["default_model_seconds"] = round(time.perf_counter() - t0, 1)
    src = source_gguf()
    lay = inspect(path)
    E, k = lay.n_expert, lay.n_expert_used
    res.update(path=str(path), arch=lay.architecture, E=E, k=k, n_ff_exp=DEFAULT_CONFIG.n_ff_exp,
               shared_width=DEFAULT_CONFIG.shared_width,
               expert_bytes={"/".join(c.types): c.expert_bytes for c in lay.slot_classes})
    if args.build_runs:
        bt = build_times(args.build_runs)
        res["build_seconds"] = [round(s, 1) for s, _ in bt]
        res["build_load_avg"] = [round(a, 2) for _, a in bt]
        res["build_seconds_median"] = round(statistics.median(s for s, _ in bt), 1)
    print(json.dumps(res, indent=1), flush=True)

    texts = dict(heldout_texts(), execmodel=read_text("eval_execmodel.txt"))
    ks = args.ks or list(range(1, E + 1))
    tab = perplexity_table(path, src, texts, ks)
    rows = []
    for name, r in tab.items():
        row = {"text": name, "tokens": r["tokens"], "dense": f"{r['dense']:.2f}"}
        row.update({f"k={kk}": f"{r[kk]:.2f}" for kk in ks})
        if k in r:
            row[f"ratio@k={k}"] = f"{r[k] / r['dense']:.3f}"
        rows.append(row)
    print("\nperplexity (epqlab.engine.perplexity, n_ctx 512, plain llama.cpp):")
    print(fmt_table(rows, ["text", "tokens", "dense"] + [f"k={kk}" for kk in ks] + [f"ratio@k={k}"]), flush=True)

    print(f"\nllama-cpp-python defaults (repacking on) vs epqlab engine, k = {k}:")
    for name, text in texts.items():
        ours = perplexity_of(path, text, n_ctx=512).ppl
        theirs = llama_cpp_perplexity(path, text, n_ctx=512)
        print(f"  {name:10s} engine {ours:.4f}  llama-cpp-python {theirs:.4f}  diff {100 * (theirs / ours - 1):+.3f} %")
    r = GGUFReader(path)
    f = r.fields.get("epqlab.moefy.router_margin")
    if f is not None:
        m = [float(x) for x in f.contents()]
        print("  router margin (median k-th minus (k+1)-th logit, calibration tokens) per layer: "
              + " ".join(f"{x:.2f}" for x in m))
        fr = r.fields.get("epqlab.moefy.boundary_weight")
        if fr is not None:
            print("  weight of the k-th expert (median, w_scale x softmax) per layer: "
                  + " ".join(f"{float(x):.2f}" for x in fr.contents()))

    t1 = time.perf_counter()
    log = record_prompt_routes(path, args.route_log, n_predict=args.n_predict)
    st = locality_stats(log)
    un = locality_stats(uniform_log(log))
    print(f"\nrouting over {log.n_tokens} tokens of {len(__import__('epqlab.data', fromlist=['x']).prompts())} prompts "
          f"({int((log.phase == 1).sum())} decoded), {log.n_layers} layers, top-{k} of {E} "
          f"(recorded in {time.perf_counter() - t1:.1f} s; log {args.route_log}):")
    rows = [
        {"statistic": "previous-token repeat rate", "model": f"{st['repeat_prev']:.3f}", "uniform": f"{un['repeat_prev']:.3f}"},
        *({"statistic": f"U({u}) saving", "model": f"{st['union_saving'][u]:.3f}", "uniform": f"{un['union_saving'][u]:.3f}"}
          for u in st["union_saving"]),
        {"statistic": f"share of top {int(st['top_frac'] * 100)} % experts (mean over layers)",
         "model": f"{st['top_share']:.3f} [{st['top_share_min']:.2f}-{st['top_share_max']:.2f}]",
         "uniform": f"{un['top_share']:.3f}"},
        *({"statistic": f"LRU hit rate, arena {int(a * 100)} %", "model": f"{st['lru'][a]:.3f}", "uniform": f"{un['lru'][a]:.3f}"}
          for a in st["lru"]),
        *({"statistic": f"Belady hit rate, arena {int(a * 100)} %", "model": f"{st['belady'][a]:.3f}",
           "uniform": f"{un['belady'][a]:.3f}"} for a in st["belady"]),
    ]
    print(fmt_table(rows, ["statistic", "model", "uniform"]), flush=True)

    from epqlab.engine.session import Session

    with Session(path, pager=False, n_ctx=512) as s:
        q = "Explain what a CPU cache is in two sentences."
        g = s.generate(s.chat_prompt([{"role": "user", "content": q}]), n_predict=80)
        print(f"\n[greedy, k = {k}] {q}\n{g.text}", flush=True)

    if args.synth_layers:
        from epqlab.models import synthesize

        r = synthesize(args.synth_out, "qwen3-30b-a3b", n_layer=args.synth_layers)
        print(f"\nsynthesize qwen3-30b-a3b n_layer={args.synth_layers}: {r['bytes'] / 1e9:.2f} GB in "
              f"{r['seconds']:.1f} s = {r['mb_per_s']:.0f} MB/s")


if __name__ == "__main__":
    main()
