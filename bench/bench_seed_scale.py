"""The seeds' tables at scale, held against the roofline: strict memory levels with teacher-forced decode.

    .venv/bin/epqlab model synth qwen35-a3b /work/big/q35.gguf          # 20.8 GiB, Qwen3.6-35B-A3B's shape, skewed routing
    .venv/bin/python bench/bench_seed_scale.py --model /work/big/q35.gguf --levels 4GiB,8GiB,16GiB --n 64 --repeats 3

1. ``epqlab.studies.strict`` at every level (a memory cgroup that charges page cache, the file dropped
   from the page cache before each run, repeats interleaved over the levels): a Session generating ``--n``
   tokens **teacher-forced** on the held-out prose (one token per decode step: a random-weight model's
   own output repeats itself and routes alike), its routes replayed with LRU and Belady at the run's slot
   count (seed 002 measured 70% / 78.9% on the real model at 18.9% coverage).
2. plain llama.cpp (mmap, pager off) under the first level: ``--mmap-n`` tokens, one run (~20 s/token).
3. The device: ``epqlab.probe_io`` at one expert matrix per request and the pager's I/O threads.
4. ``T_plain``: plain llama.cpp with every weight in RAM (the file read into the page cache, no limit, the
   same threads, context and kernels), the same teacher-forced tokens, one timed run after each round of
   the paged runs (interleaved with them: this box's speed drifts by 10-30% over an hour), median of
   ``--repeats`` (``epqlab.studies.roofline``). Skipped, with the reason, when the file cannot fit in RAM.
5. A ``--prefill``-token prompt at the first level: prefill tok/s against plain's, and the pager's bytes
   read in the prefill over the bytes of the distinct experts it routed to (1.0 = each read once; the hook's
   per-ubatch unions, no route log: recording routes would split the prompt into 16 MiB logits blocks).

``--prefetch off,trained`` runs every level once per prefetch setting in each round (``trained``: the
learned next-layer predictor, ``--predictor`` or fitted first on the shipped calibration texts, never on the
held-out prose timed here; DESIGN §3c). Each paged row reports time/token / max(T_plain, miss bytes per token / probe bandwidth) and tok/s /
plain tok/s. Run it alone: a build, a test suite or a helper beside it measures the contention.
"""
from __future__ import annotations

import argparse
import atexit
import dataclasses
import json
import os
import shutil
import statistics
import tempfile
import time

import epqlab
from epqlab.data import heldout_texts
from epqlab.engine.predictor import ExpertPredictor
from epqlab.paging.pager import default_io_threads
from epqlab.studies import roofline, strict, strict_report
from epqlab.studies.strict import DEFAULT_PROMPT
from epqlab.units import fmt_bytes


def prompt_ids(model: str, n: int) -> list[int]:
    """The first ``n`` tokens of the held-out legal text (+ BOS), from the model's own vocabulary."""
    import llama_cpp

    llm = llama_cpp.Llama(model, vocab_only=True, verbose=False)
    try:
        ids = llm.tokenize(heldout_texts()["legal"].encode(), add_bos=True)
    finally:
        llm.close()
    if len(ids) < n:
        raise SystemExit(f"the held-out text has {len(ids)} tokens, fewer than --prefill {n}")
    return ids[:n]


def prefetch_variants(a) -> dict:
    """``--prefetch`` as strict.run variants: name -> Session settings; ``trained`` fits a predictor on the
    shipped calibration texts first when ``--predictor`` does not exist yet (~2 min on the 35B shape)."""
    out = {}
    for name in a.prefetch.split(","):
        name = name.strip()
        if name == "off":
            out[name] = {}
        elif name == "trained" or name.startswith("trained-"):
            path = a.predictor or os.path.splitext(a.model)[0] + ".predictor.npz"
            if not os.path.exists(path):
                from epqlab.studies.predictor_fit import fit_for_model

                print(f"fitting the prefetch predictor on the shipped calibration texts -> {path}", flush=True)
                fit_for_model(a.model, depth=1).save(path)
            if name != "trained":  # trained-bf16, trained-q8_0: a copy of it kept in that weight type
                p = ExpertPredictor.load(path)
                tmp = tempfile.mkdtemp(prefix="epq-pred-")
                atexit.register(shutil.rmtree, tmp, True)  # the copy (84 MB on the 35B shape) goes with the bench
                path = dataclasses.replace(p, weight_type=name.split("-", 1)[1]).save(os.path.join(tmp, f"{name}.npz"))
            out[name] = {"prefetch": "trained", "prefetch_predictor": str(path)}
        else:
            out[name] = {"prefetch": name}
    addrs = [x.strip() for x in a.addressing.split(",")]
    if addrs != ["auto"]:  # the cross product: "off slots", "trained region", ... (docs/DESIGN.md §3f)
        out = {f"{name} {ad}": {**kw, "expert_addressing": ad} for name, kw in out.items() for ad in addrs}
    rings = [x.strip() for x in a.io_uring.split(",")]
    if rings == ["on"]:
        out = {name: {**kw, "io_uring": True} for name, kw in out.items()}
    elif rings != ["off"]:  # "off uring", "off pread", ... (docs/DESIGN.md §3e)
        out = {f"{name} {'uring' if r == 'on' else 'pread'}": {**kw, "io_uring": r == "on"} for name, kw in out.items()
               for r in rings}
    return out


def split_medians(df, row) -> dict:
    """Median over the passing runs of one (level, variant) row of each time-split part (ms/token)."""
    runs = [x for x in df.attrs["runs"] if x["level"] == row["level"] and x.get("variant") == row["variant"]
            and x["status"] == "PASS" and x["pager"]]
    splits = [(x.get("stats") or {}).get("time_split") or {} for x in runs]
    keys = {k for sp in splits for k in sp if isinstance(sp.get(k), (int, float))}
    return {k: statistics.median(sp[k] for sp in splits if k in sp) for k in sorted(keys)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--levels", default="4GiB,8GiB,16GiB")
    ap.add_argument("--n", type=int, default=64, help="teacher-forced decode tokens per run (default 64)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--n-ctx", type=int, default=1024)
    ap.add_argument("--n-batch", type=int, default=512, help="prompt tokens per llama_decode (and per ubatch)")
    ap.add_argument("--mmap-n", type=int, default=8, help="tokens of the mmap baseline run (0: skip it)")
    ap.add_argument("--prefill", type=int, default=512, help="prompt tokens of the prefill run (0: skip it)")
    ap.add_argument("--no-plain", action="store_true", help="skip the plain-in-RAM reference")
    ap.add_argument("--prefetch", default="off", help="comma-separated: off and/or a predictor (lookahead, trained, ...); "
                    "trained-bf16 / trained-q8_0: the trained predictor kept in that weight type")
    ap.add_argument("--predictor", default=None, help="prefetch=trained: a predictor .npz (fitted and saved here if absent)")
    ap.add_argument("--io-uring", default="off",
                    help="comma-separated: off (pread, the Session default) and/or on (reads into io_uring registered "
                         "buffers): with both, each runs once per prefetch setting in every round")
    ap.add_argument("--addressing", default="auto",
                    help="comma-separated expert addressings to compare (slots, region; default auto): each prefetch "
                         "setting runs once per addressing in every round")
    ap.add_argument("--json", default=None, help="write every table and run here")
    a = ap.parse_args()
    lay = epqlab.inspect(a.model)
    forced = heldout_texts()["prose"]
    kw = {"n_threads": a.threads, "n_ctx": a.n_ctx, "n_batch": a.n_batch, "n_ubatch": a.n_batch}
    levels = strict.parse_levels(a.levels)
    print(f"model {lay.path} ({fmt_bytes(lay.file_size)}; {len(lay.layers)} MoE layers x {lay.n_expert} experts, "
          f"top-{lay.n_expert_used}; routed {fmt_bytes(lay.routed_expert_bytes)}); {a.n} teacher-forced tokens "
          f"(held-out prose), {a.repeats} interleaved repeats, {a.threads} threads", flush=True)
    out: dict = {"model": str(lay.path), "levels": levels, "n": a.n, "repeats": a.repeats, "threads": a.threads,
                 "parameters": {k: v for k, v in vars(a).items() if k != "json"}}  # what papers/05 shows as the run's settings

    variants = prefetch_variants(a)
    plain_runs: list[dict] = []

    def plain_round(r):
        if not a.no_plain and (not plain_runs or plain_runs[0] is not None):
            try:  # one timed run per round, between the paged rounds
                plain_runs.append(roofline.plain_reference(a.model, DEFAULT_PROMPT, forced, a.n, repeats=1, **kw))
                print(f"[plain] round {r + 1}: {plain_runs[-1]['ms_per_token']:.1f} ms/token", flush=True)
            except epqlab.EpqlabError as e:
                print(f"plain-in-RAM reference skipped: {e}")
                plain_runs.append(None)

    # 1. paged at every level, and 4. the plain reference, interleaved
    df = strict.run(a.model, levels, n_predict=a.n, forced=forced, simulate_routes=True, repeats=a.repeats,
                    progress=True, variants=variants, between_rounds=plain_round, **kw)
    print(strict_report.format_table(df), flush=True)
    out["paged"] = strict.to_json(df)
    out["run"] = out["paged"]["run"]  # date, machine, model hash, command line: papers/05 renders it (epqlab report --extra)

    # 2. mmap under the first level
    mm = None
    if a.mmap_n:
        mdf = strict.run(a.model, levels[:1], n_predict=a.mmap_n, forced=forced, pager=False, repeats=1,
                         progress=True, **kw)
        mm = mdf.iloc[0]
        print(strict_report.format_table(mdf), flush=True)
        out["mmap"] = strict.to_json(mdf)

    # 3. the device
    mat = max(t.expert_bytes for l in lay.layers for t in l.tensors)
    # a new seed each run: the same offsets again would come from the virtual disk's host cache (DESIGN §3 item 7)
    probe = epqlab.probe_io(a.model, request_bytes=[mat], concurrency=[default_io_threads()], n_requests=64,
                            seed=time.time_ns() % 2**31, progress=False)
    bw = float(probe["mb_s"].iloc[0]) * 1e6
    print(f"probe: {fmt_bytes(mat)} reads x {default_io_threads()} threads: {bw / 1e6:.0f} MB/s", flush=True)
    out["probe_mb_s"] = bw / 1e6

    # 5. prefill at the first level (before the plain reference fills the page cache)
    pre = None
    if a.prefill:
        ids = prompt_ids(a.model, a.prefill)
        # No route log here: recording routes asks llama.cpp for every token's logits (its last layer routes only
        # output rows), which splits the prompt into 16 MiB logits blocks (16 MiB / (4 x n_vocab) tokens each) and
        # reads each block's union again. The hook's per-ubatch unions give the distinct experts instead.
        pdf = strict.run(a.model, levels[:1], prompt=ids, n_predict=2, repeats=1, **kw)
        pre = pdf.iloc[0]
        out["prefill"] = strict.to_json(pdf)

    # 4. plain llama.cpp, all in RAM (timed between the rounds above)
    plain = plain_pre = None
    if plain_runs and plain_runs[0] is not None:
        ms = [p["ms_per_token"] for p in plain_runs]
        plain = {"ms_per_token": statistics.median(ms), "decode_tok_s": 1000.0 / statistics.median(ms),
                 "ms_per_token_runs": ms}
        if a.prefill:
            plain_pre = roofline.plain_reference(a.model, ids, forced, 2, repeats=1, **kw)
        if plain:
            print(f"plain llama.cpp, all weights in RAM: {plain['ms_per_token']:.1f} ms/token "
                  f"({plain['decode_tok_s']:.2f} tok/s; runs {', '.join(f'{x:.1f}' for x in plain['ms_per_token_runs'])} ms)",
                  flush=True)
            out["plain"] = plain
            out["plain_prefill"] = plain_pre

    # decode hit = the decode passes' own rate, beside their SSD MB/token; the LRU and Belady replays run this
    # run's whole route log (prefill + decode) through one pool of its slots, so they compare with "run hit"
    print("\n| level | prefetch | arena | cover | peak | decode tok/s (min-max) | ms/tok | decode SSD MB/tok | decode hit | "
          "run hit | LRU replay (run) | Belady (run) | miss/BW ms | T_plain ms | / max(T_plain, miss/BW) | x plain | x mmap |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    rows = []
    for _, r in df.iterrows():
        if r["status"] != "PASS":
            print(f"| {fmt_bytes(r['level'])} | {r['variant']} | FAIL: {str(r['reason'])[:100]} |")
            continue
        ms = 1000.0 / r["decode_tok_s"]
        b = roofline.bound_ratios(ms, plain["ms_per_token"], r["ssd_mb_per_token"] * 1e6, bw) if plain else None
        x_mm = r["decode_tok_s"] / mm["decode_tok_s"] if mm is not None and r["level"] == levels[0] and mm["decode_tok_s"] else None
        rows.append({"level": int(r["level"]), "prefetch": r["variant"], "ms_per_token": ms, **(b or {}),
                     "decode_hit_rate": r.get("decode_hit_rate"), "run_hit_rate": r["hit_rate"],
                     "x_mmap": x_mm, "time_split": split_medians(df, r)})

        def f(v, fmt):
            return "-" if v is None else format(v, fmt)

        print(f"| {fmt_bytes(r['level'])} | {r['variant']} | {fmt_bytes(r['arena_bytes'])} | {r['coverage']:.1%} | "
              f"{fmt_bytes(r['cgroup_peak'] or r['peak_rss'])} | {r['decode_tok_s']:.2f} ({r['decode_tok_s_min']:.2f}-"
              f"{r['decode_tok_s_max']:.2f}) | {ms:.0f} | {r['ssd_mb_per_token']:.1f} | {f(r.get('decode_hit_rate'), '.1%')} | "
              f"{r['hit_rate']:.1%} | "
              f"{f(r['sim_lru_hit_rate'], '.1%')} | {f(r['sim_belady_hit_rate'], '.1%')} | {f(b and b['io_ms'], '.0f')} | "
              f"{f(plain and plain['ms_per_token'], '.0f')} | {f(b and b['roofline_ratio'], '.2f')} | "
              f"{f(b and b['plain_ratio'], '.2f')} | {f(x_mm, '.1f')} |")
    out["rows"] = rows
    print("\ntime split per token, ms (medians over the runs): level, prefetch: attn / experts / io wait / map / "
          "predict / other")
    for x in rows:
        t = x["time_split"]
        if t:
            print(f"  {fmt_bytes(x['level'])}, {x['prefetch']}: " + " / ".join(
                f"{t.get(k, 0):.0f}" for k in ("attn_ms", "expert_ms", "io_ms", "map_ms", "predict_ms", "other_ms")))
    print("\nseed 002 for comparison (the real Qwen3.6-35B-A3B at 18.9% coverage): decode hit rate 70%, Belady 78.9%; "
          "LRU sim and Belady above replay this run's own routes (prefill and decode) in one pool of its slots")
    if mm is not None:
        print(f"\nmmap under {fmt_bytes(levels[0])}: {mm['decode_tok_s']:.3f} tok/s ({a.mmap_n} tokens, 1 run)")
    if pre is not None and pre["status"] == "PASS":
        ratio = pre["prefill_ssd_bytes"] / pre["prefill_union_bytes"] if pre["prefill_union_bytes"] else float("nan")
        pp = plain_pre["prefill_tok_s"] if plain_pre else None
        vs = f" vs plain in RAM {pp:.1f} tok/s ({pre['prefill_tok_s'] / pp:.2f}x)" if pp else ""
        print(f"prefill of {a.prefill} tokens under {fmt_bytes(levels[0])}: {pre['prefill_tok_s']:.1f} tok/s{vs}; "
              f"pager read {fmt_bytes(pre['prefill_ssd_bytes'])} for {fmt_bytes(pre['prefill_union_bytes'])} "
              f"of distinct experts ({-(-a.prefill // a.n_batch)} ubatch(es) of <= {a.n_batch}): {ratio:.2f}x (goal <= 2x)")
    if a.json:
        epqlab.results.write_json(json.loads(json.dumps(out, default=str)), a.json)


if __name__ == "__main__":
    main()
