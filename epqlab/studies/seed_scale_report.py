"""The seed-scale table (bench/bench_seed_scale.py's ``--json``) for papers/05: one row per (memory level, prefetch),
the paged run's strict figures beside the roofline ratios, then a reading with plain llama.cpp in RAM, mmap, the
device, the prefill and the time split. The comparison with seed studies 000 and 002 is the JSON's own rows
against the seeds' published figures, quoted in the reading with their source.

A JSON with ``transcribed_from`` holds rows copied from a published table whose raw JSON was not kept (the
stand-in runs of bench/README.md); the reading says so and names the source.
"""
from __future__ import annotations

import pandas as pd

from ..units import fmt_bytes

COLUMNS = {"level_": "limit", "prefetch": "prefetch", "arena_": "arena", "slots": "slots", "coverage_": "coverage",
           "peak_": "peak", "tok_s_": "decode tok/s (min-max)", "ms_per_token": "ms/token",
           "ssd_mb_per_token": "decode SSD MB/token", "decode_hit_": "decode hit", "run_hit_": "run hit",
           "lru_": "LRU replay (run)", "belady_": "Belady (run)", "io_ms": "miss/BW ms",
           "plain_ms": "plain ms/token", "roofline_ratio": "/ max(plain, miss/BW)", "plain_ratio": "x plain",
           "x_mmap": "x mmap"}


def is_seed_scale(doc: dict) -> bool:
    """A bench_seed_scale JSON (or a transcription of one): summary ``rows`` with a ``prefetch`` column."""
    rows = doc.get("rows") or [{}]
    return "levels" in doc and isinstance(rows[0], dict) and {"level", "prefetch", "ms_per_token"} <= set(rows[0])


def _pct(v) -> str:
    return "-" if v is None or v != v else f"{v:.1%}"


def frame(doc: dict) -> pd.DataFrame:
    """The summary rows joined with the paged strict rows of the same (level, prefetch) (medians over repeats)."""
    paged = {(int(r["level"]), r.get("variant", "off")): r for r in (doc.get("paged") or {}).get("rows", [])
             if r.get("mode", "paged") == "paged"}
    plain = (doc.get("plain") or {}).get("ms_per_token")
    out = []
    for r in doc["rows"]:
        p = {**r, **paged.get((int(r["level"]), r["prefetch"]), {})}
        lo, hi = p.get("decode_tok_s_min"), p.get("decode_tok_s_max")
        tok_s = p.get("decode_tok_s") or (1000.0 / r["ms_per_token"])
        out.append({**r, "level_": fmt_bytes(r["level"]),
                    "arena_": fmt_bytes(p["arena_bytes"]) if p.get("arena_bytes") else "-",
                    "slots": p.get("slots") or "-", "coverage_": _pct(p.get("coverage")),
                    "peak_": fmt_bytes(p.get("cgroup_peak") or p.get("peak_rss") or 0) if (p.get("cgroup_peak") or p.get("peak_rss")) else "-",
                    "tok_s_": f"{tok_s:.2f}" + (f" ({lo:.2f}-{hi:.2f})" if lo and hi else ""),
                    "ssd_mb_per_token": p.get("ssd_mb_per_token", r.get("ssd_mb_per_token")),
                    "decode_hit_": _pct(r.get("decode_hit_rate")), "run_hit_": _pct(r.get("run_hit_rate")),
                    "lru_": _pct(p.get("sim_lru_hit_rate", r.get("sim_lru_hit_rate"))),
                    "belady_": _pct(p.get("sim_belady_hit_rate", r.get("sim_belady_hit_rate"))),
                    "plain_ms": r.get("plain_ms", plain)})
    df = pd.DataFrame(out)
    for c in COLUMNS:
        if c not in df:
            df[c] = None
    return df


def reading(doc: dict) -> str:
    """Sentences from the JSON: what was measured against what, and the figures beside the table."""
    s = []
    if doc.get("transcribed_from"):
        s.append(f"These rows are transcribed from {doc['transcribed_from']} (that run's JSON was not kept).")
    if doc.get("note"):
        s.append(str(doc["note"]))
    s.append(f"{doc.get('n')} teacher-forced decode tokens of the held-out prose per run, {doc.get('repeats')} "
             f"interleaved repeats (medians), {doc.get('threads')} threads, each run in a memory cgroup child with the "
             f"model dropped from the page cache.")
    plain = doc.get("plain") or {}
    if plain.get("ms_per_token"):
        runs = plain.get("ms_per_token_runs") or []
        s.append(f"Plain llama.cpp with every weight in RAM (same shape, threads and tokens): {plain['ms_per_token']:.0f} "
                 f"ms/token" + (f" (runs {', '.join(f'{x:.0f}' for x in runs)})" if runs else "") + ".")
    elif not doc.get("transcribed_from"):
        s.append("No plain-in-RAM reference: the model file is larger than this machine's RAM.")
    if doc.get("probe_mb_s"):
        s.append(f"Device probe (one expert matrix per read, the pager's reader threads): {doc['probe_mb_s']:.0f} MB/s.")
    mm = ((doc.get("mmap") or {}).get("rows") or [None])[0]
    if mm and mm.get("decode_tok_s"):
        s.append(f"Plain llama.cpp on mmap under {fmt_bytes(mm['level'])}: {mm['decode_tok_s']:.3f} tok/s "
                 f"({mm.get('n_gen', '?')} tokens, 1 run).")
    pre = ((doc.get("prefill") or {}).get("rows") or [None])[0]
    if pre and pre.get("status") == "PASS" and pre.get("prefill_union_bytes"):
        pp = (doc.get("plain_prefill") or {}).get("prefill_tok_s")
        n_pre = pre.get("n_prompt") or (doc.get("parameters") or {}).get("prefill")
        s.append(f"Prefill of {n_pre} tokens under {fmt_bytes(pre['level'])}: {pre['prefill_tok_s']:.1f} tok/s"
                 + (f" against {pp:.1f} plain in RAM ({pre['prefill_tok_s'] / pp:.2f}x)" if pp else "")
                 + f"; the pager read {fmt_bytes(pre['prefill_ssd_bytes'])} for {fmt_bytes(pre['prefill_union_bytes'])} "
                   f"of distinct experts ({pre['prefill_ssd_bytes'] / pre['prefill_union_bytes']:.2f}x)"
                 + (f", {pre['staged_layers']} (layer, ubatch) pairs staged" if pre.get("staged_layers") else "") + ".")
    splits = [(r, r.get("time_split")) for r in doc["rows"] if r.get("time_split")]
    if splits:
        s.append("Time split per token, ms (attention / expert matmuls / io wait / predict / other): " + "; ".join(
            f"{fmt_bytes(r['level'])} {r['prefetch']} " + " / ".join(
                f"{t.get(k, 0):.0f}" for k in ("attn_ms", "expert_ms", "io_ms", "predict_ms", "other_ms"))
            for r, t in splits) + ".")
    s.append("Decode hit is the decode passes' own rate, beside their SSD MB/token; run hit, the LRU replay and "
             "Belady's MIN cover the whole run (prefill and decode) through one pool of the run's slots.")
    return " ".join(s)


__all__ = ["COLUMNS", "frame", "is_seed_scale", "reading"]
