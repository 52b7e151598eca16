"""Per study: the tables and the reading of one results JSON, rebuilt from the JSON's rows with the same
library functions the notebooks use (so the paper's numbers are the JSON's, none typed by hand).

Each renderer takes the parsed JSON and returns Markdown (tables, then the reading); figures are added by
:func:`epqlab.papers.write_papers`.
"""
from __future__ import annotations

import pandas as pd

from ..routes import report as routes_report
from ..studies import batching_report, plan_report, probe_report, seed_scale_report, speculative_report, strict_report
from ..studies.ablation import eviction_reading, routing_cap_reading
from ..studies.ablation import tournament as tournament_study
from ..studies.ablation import batch_lossy_report, lossy_report, topk_report
from ..units import fmt_bytes
from .markdown import table


def _frame(rows, attrs: dict | None = None) -> pd.DataFrame:
    df = pd.DataFrame(rows)
    df.attrs.update(attrs or {})
    return df


def io_probe(doc: dict) -> str:
    """01: latency and bandwidth per (request size, reads in flight), and :func:`epqlab.studies.probe_report.reading`."""
    df = _frame(doc["rows"], doc.get("attrs"))
    rows = df.assign(size=[f"{fmt_bytes(b)}" for b in df.request_bytes])
    t = table(rows, {"size": "request", "source": "size of", "concurrency": "in flight",
                     "lat_median_us": "median µs", "lat_p99_us": "p99 µs", "mb_s": "MB/s", "mode": "mode"},
              floatfmt=".0f")
    note = probe_report.reading(df, expert_bytes=doc.get("expert_bytes"), top_k=doc.get("top_k"))
    return "\n\n".join(["**Latency and bandwidth.**", t, note])


def route_overlap(doc: dict) -> str:
    """02: hit rate per capacity and policy, U(k), popularity, and :func:`epqlab.routes.report.reading`."""
    hit = routes_report.summary_table(doc).reset_index()
    pct = {c: f"{c} %" for c in hit.columns if c != "capacity"}
    parts = ["**Hit rate (%) per capacity and policy** (simulated on the route log).",
             table(hit, {"capacity": "capacity", **pct}),
             "**U(k): distinct experts per layer over k tokens.**",
             table(doc["union"], {"k": "k", "union": "U(k)", "saving": "saving %"}, floatfmt=".2f"),
             "**Popularity: share of requests served by each layer's N most requested experts.**",
             table(doc["popularity"], {"n": "N", "top_share": "in sample %",
                                       "hot_set_hit_rate": "1st half → 2nd half %"}),
             routes_report.reading(doc)]
    return "\n\n".join(parts)


def tournament(rows: list, attrs: dict | None = None) -> str:
    """03's tournament (``epqlab ablate policies``, notebook 03's tournament cells): gap share per policy and point
    (simulated), the live confirmation rows, the winners, and
    :func:`epqlab.studies.ablation.tournament.reading`."""
    df = _frame(rows, attrs)
    sim = df[df.kind == "sim"]
    gap = sim.pivot(index="policy", columns="point", values="gap_share")
    gap = gap.sort_values(gap.columns[0], ascending=False).reset_index()
    hit = sim.pivot(index="policy", columns="point", values="hit_rate").reset_index()
    live = df[df.kind == "live"]
    model = (attrs or {}).get("model")
    head = (f"**Tournament** ({'model `' + str(model) + '`, ' if model else ''}held-out text read teacher-forced; "
            "every online policy replayed with the arena's slot classes and addressing, Belady beside it; "
            "gap share = (hit − LRU) / (Belady − LRU)).")
    parts = [head, "Gap share per policy and arena, % (simulated):",
             table(gap, {"policy": "policy", **{c: f"{c} %" for c in gap.columns if c != "policy"}}),
             "Hit rate per policy and arena, % (simulated):",
             table(hit, {"policy": "policy", **{c: f"{c} %" for c in hit.columns if c != "policy"}})]
    if len(live):
        parts += ["Live runs (the best three per arena; `live_equal`: hits, misses and evictions equal the "
                  "simulation's; prefetch modes other than off are not simulated; tok/s of one run each):",
                  table(live, {"point": "point", "policy": "policy", "prefetch": "prefetch", "hit_rate": "hit %",
                               "gap_share": "gap share %", "ssd_mb_per_token": "SSD MB/token",
                               "decode_tok_s": "decode tok/s", "live_equal": "live = sim"})]
    parts += [table(tournament_study.winners(df), {"point": "point", "slots": "slots", "policy": "best", "hit_rate": "hit %",
                                                   "lru_hit_rate": "LRU %", "belady_hit_rate": "Belady %",
                                                   "gap_share": "gap share %", "never_below_lru": "never below LRU"}),
              tournament_study.reading(df)]
    return "\n\n".join(parts)


def _is_tournament(rows) -> bool:
    return bool(rows) and isinstance(rows[0], dict) and {"gap_share", "kind", "policy"} <= set(rows[0])


def least_stale(doc: dict) -> str:
    """03: hit rates, SSD MB/token and decode speed per (memory point, policy), and
    :func:`epqlab.studies.ablation.eviction_reading`; a tournament (its own JSON from ``epqlab ablate policies
    --json``, or the notebook's ``tournament`` records) as :func:`tournament`."""
    if _is_tournament(doc.get("rows")):
        return tournament(doc["rows"], {k: doc[k] for k in ("model", "n_tokens", "decode_tokens", "layers") if k in doc})
    df = _frame(doc["rows"])
    t = table(df, {"point": "point", "policy": "policy", "slots": "slots", "hit_rate": "hit %",
                   "decode_hit_rate": "decode hit %", "steady_hit_rate": "steady hit %",
                   "belady_steady_hit_rate": "Belady steady %", "ssd_mb_per_token": "SSD MB/token",
                   "decode_tok_s": "decode tok/s", "io_wait_share": "I/O wait %", "replay_equal": "replay = live"})
    parts = ["**Eviction policies** (live runs; Belady replayed on the same route log).", t]
    if doc.get("simulate"):
        sim = pd.DataFrame(doc["simulate"]).pivot(index="capacity", columns="policy", values="hit_rate").reset_index()
        parts += ["**Idealised simulator** (one shared pool, no live constraints): hit rate %.",
                  table(sim, {"capacity": "slots", **{c: f"{c} %" for c in sim.columns if c != "capacity"}})]
    parts.append(eviction_reading(df))
    if doc.get("routing_cap"):
        cap = pd.DataFrame(doc["routing_cap"])
        parts += ["**What routing allows** (`epqlab.studies.ablation.routing_cap`: i.i.d. uniform routes of the same shape "
                  "replayed through the pager; no online policy can exceed slots / (L x E) on them).",
                  table(cap, {"point": "point", "slots": "slots", "uniform_bound": "uniform bound %",
                              "uniform_best_online": "uniform best online %", "uniform_belady": "uniform Belady %",
                              "model_best_online": "model best online %", "model_belady": "model Belady %"}),
                  "\n\n".join(routing_cap_reading(cap).splitlines())]
    if doc.get("tournament"):
        parts.append(tournament(doc["tournament"], {"layers": (doc.get("tournament_attrs") or {}).get("layers")}))
    return "\n\n".join(parts)


def topk(doc: dict) -> str:
    """04: perplexity, speed and SSD reads per (k, memory point), greedy divergence, skip-cold, and
    :func:`epqlab.studies.ablation.topk_report.reading`."""
    df = _frame(doc["rows"], {**(doc.get("parameters") or {}), "divergence": doc.get("divergence") or []})
    for c in ("k", "own_k"):  # older JSON wrote them as floats (2.0): the reading names top-k by integer
        if c in df and df[c].notna().all() and (df[c] % 1 == 0).all():
            df[c] = df[c].astype(int)
    ppl = {c: c.replace("ppl_", "ppl ") for c in df.columns if c.startswith("ppl_") and c != "ppl_mean"}
    parts = ["**Top-k per memory point.**",
             table(df, {"k": "k", "point": "point", **ppl, "decode_tok_s": "decode tok/s",
                        "prefill_tok_s": "prefill tok/s", "ssd_mb_per_token": "SSD MB/token", "hit_rate": "hit %",
                        "greedy_common_prefix_mean": "greedy prefix (tokens)"})]
    skip = None
    if doc.get("skip_cold"):
        skip = _frame(doc["skip_cold"]["rows"], doc["skip_cold"].get("parameters"))
        sp = {f"ppl_{t}": f"ppl {t}" for t in skip.attrs.get("texts") or []}
        parts += ["**Skip-cold (lossy) against τ.**",
                  table(skip, {"tau": "τ", **sp, "ppl_ssd_mb_per_token": "SSD MB/token (perplexity)",
                               "ppl_skipped_per_token": "skipped/token (perplexity)", "decode_tok_s": "decode tok/s",
                               "ssd_mb_per_token": "SSD MB/token (generation)",
                               "skipped_per_token": "skipped/token (generation)"})]
    parts.append(topk_report.reading(df, skip))
    return "\n\n".join(parts)


def memory_levels(doc: dict) -> str:
    """05: one row per (memory level, paged or mmap), and :func:`epqlab.studies.strict_report.reading`; a
    bench/bench_seed_scale.py JSON: :mod:`epqlab.studies.seed_scale_report`'s table and reading."""
    if seed_scale_report.is_seed_scale(doc):
        df = seed_scale_report.frame(doc)
        return "\n\n".join(["**Seed scale, held against plain llama.cpp in RAM and the roofline.**",
                             table(df, seed_scale_report.COLUMNS, floatfmt=".3g"), seed_scale_report.reading(doc)])
    df = _frame(doc["rows"], doc.get("parameters"))
    shown = df.assign(level_=[fmt_bytes(v) for v in df.level],
                      arena_=[("-" if v is None or v != v else fmt_bytes(v)) for v in df.get("arena_bytes", [None] * len(df))],
                      peak_=[("-" if v is None or v != v else fmt_bytes(v)) for v in df.get("peak_rss_anon", [None] * len(df))])
    t = table(shown, {"level_": "limit", "mode": "mode", "limit_mode": "enforced by", "arena_": "arena",
                      "coverage": "coverage %", "peak_": "peak anon RSS", "decode_tok_s": "decode tok/s",
                      "prefill_tok_s": "prefill tok/s", "ssd_mb_per_token": "SSD MB/token", "hit_rate": "hit %",
                      "status": "status"})
    return "\n\n".join(["**Runs under a hard memory limit.**", t, strict_report.reading(df)])


def batching(doc: dict) -> str:
    """06: one row per (memory point, batch size), the speculation table, and
    :func:`epqlab.studies.batching_report.reading`."""
    if speculative_report.is_mtp_bench(doc):
        df = speculative_report.frame(doc)
        p = doc.get("parameters") or {}
        return "\n\n".join([f"**MTP speculative decoding with paged experts** ({p.get('n')} teacher-forced tokens of "
                             f"held-out text per run, acceptance set: each draft the text's next token, wrong with "
                             f"probability 1 - a; medians of {p.get('repeats')} interleaved runs; plain: llama.cpp with "
                             "every weight in RAM).", table(df, speculative_report.COLUMNS, floatfmt=".3g"),
                             "\n".join(f"- {s}" for s in speculative_report.reading(doc))])
    df = _frame(doc["rows"], doc.get("parameters"))
    parts = ["**Several sequences per forward pass.**", table(df, batching_report.COLUMNS)]
    spec = doc.get("speculation") or {}
    if spec.get("table"):
        st = pd.DataFrame(spec["table"])
        parts += ["**Prompt-lookup speculation on the held-out texts.**", table(st, {c: c for c in st.columns})]
    sp = pd.DataFrame(spec["rows"]) if spec.get("rows") else None
    uk = pd.DataFrame(doc["union_k"]) if doc.get("union_k") else None
    parts.append("\n".join(f"- {s}" for s in batching_report.reading(df, sp, doc.get("draft_reads"), uk)))
    return "\n\n".join(parts)


def _batch_lossy(rows) -> list[str]:
    df = _frame(rows)
    return ["**Lossy knobs in batched decode** (the same held-out windows teacher-forced at every batch size; ratios "
            "over exact at batch 1 of the same point, perplexity over exact at the same batch).",
            table(df, batch_lossy_report.COLUMNS, floatfmt=".3f"), batch_lossy_report.reading(df)]


def lossy_knobs(doc: dict) -> str:
    """07: every lossy knob's perplexity ratio per text, agreement, SSD MB/token, speed and hit rate per arena, and
    :func:`epqlab.studies.ablation.lossy_report.reading`; the batched knobs' table where the JSON has one
    (``batch_rows`` of the notebook, ``epqlab ablate lossy --batches`` JSON); a ``bench/bench_batching.py --lossy``
    JSON: its speed and bytes table under the memory limit."""
    if batch_lossy_report.is_bench(doc):
        df = batch_lossy_report.bench_frame(doc)
        lim = doc.get("limit")
        return "\n\n".join([f"**Lossy knobs in batched decode under a {fmt_bytes(lim) if lim else 'no'} memory limit** "
                             f"({doc.get('n')} teacher-forced tokens per sequence, medians of {doc.get('repeats')} "
                             "interleaved runs; plain: llama.cpp with every weight in RAM, same sequences and threads).",
                             table(df, batch_lossy_report.BENCH_COLUMNS, floatfmt=".3g")])
    if doc.get("kind") == "batch_lossy":
        return "\n\n".join(_batch_lossy(doc["rows"]))
    df = _frame(doc["rows"], doc.get("parameters"))
    cols = {c: h + " %" if c in ("routing_agreement", "hit_rate") else h for c, h in lossy_report.columns(df).items()}
    parts = ["**Lossy knobs against exact** (teacher-forced, one token per decode step; speeds are wall clock on the "
             "machine that ran it).", table(df[list(cols)], cols, floatfmt=".3f"),
             lossy_report.reading(df)]
    if doc.get("batch_rows"):
        parts += _batch_lossy(doc["batch_rows"])
    return "\n\n".join(parts)


def plan(doc: dict) -> str:
    """08: the forecast table (forecast against measured where verified), the terms, and
    :func:`epqlab.studies.plan_report.reading`."""
    df = plan_report.frame(doc)
    cols = {c: h for c, h in plan_report.COLUMNS.items() if c in df.columns and (c != "measured_tok_s" or
                                                                                  df[c].notna().any())}
    if not df.get("error_pct", pd.Series(dtype=float)).notna().any():
        cols.pop("error_pct", None)
    terms = pd.DataFrame([{"prefetch": k, **{f: v for f, v in t.items() if f != "notes"}} for k, t in doc["terms"].items()])
    return "\n\n".join(["**Forecast per budget, policy and prefetch** (ms per token; tok/s).",
                         table(df, cols, floatfmt=".3g"), "**The model's terms, as calibrated.**",
                         table(terms, {c: c for c in terms.columns}, floatfmt=".3g"), plan_report.reading(doc)])


# study folder -> renderer; the folder name is also the notebook's name and the paper's file name
STUDIES = {"01_io_probe": io_probe, "02_route_overlap": route_overlap, "03_least_stale": least_stale,
           "04_topk": topk, "05_memory_levels": memory_levels, "06_batching": batching,
           "07_lossy_knobs": lossy_knobs, "08_plan": plan}


def study_of(doc: dict) -> str | None:
    """Which study a results JSON belongs to: its ``notebook`` field, else recognised by its columns (JSON
    written by ``epqlab ablate eviction|topk --json``, ``epqlab strict --json``, ``epqlab probe --json``)."""
    if doc.get("notebook") in STUDIES:
        return doc["notebook"]
    if {"terms", "recommendation", "rows"} <= set(doc):
        return "08_plan"
    rows = doc.get("rows") or [{}]
    cols = set(rows[0]) if isinstance(rows[0], dict) else set()
    if "divergence" in doc and "k" in cols:
        return "04_topk"
    if {"policy", "belady_hit_rate"} <= cols:
        return "03_least_stale"
    if {"level", "mode", "status"} <= cols or seed_scale_report.is_seed_scale(doc):
        return "05_memory_levels"
    if {"request_bytes", "concurrency"} <= cols:
        return "01_io_probe"
    if "simulation" in doc and "union" in doc:
        return "02_route_overlap"
    if speculative_report.is_mtp_bench(doc):
        return "06_batching"
    if batch_lossy_report.is_bench(doc) or doc.get("kind") == "batch_lossy":
        return "07_lossy_knobs"
    if {"batch", "union_per_layer"} <= cols:
        return "06_batching"
    if {"knob", "setting", "routing_agreement"} <= cols:
        return "07_lossy_knobs"
    return None


__all__ = ["STUDIES", "study_of", "io_probe", "route_overlap", "least_stale", "topk", "memory_levels", "batching", "lossy_knobs", "plan"]
