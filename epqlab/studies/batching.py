"""The batching study (notebooks/06_batching.ipynb, ``bench/bench_batching.py``): what decoding several
sequences per forward pass buys when experts stream, and whether speculation would.

- :func:`batching`: per (memory point, batch size b), one :meth:`epqlab.Session.generate_batch` of b
  sequences: aggregate and per-sequence decode tok/s, SSD bytes per generated token, the measured union of
  experts per layer per step U(b), hit rate, the time split per step. ``teacher_forced`` feeds each
  sequence a real text one token per step (the tokens are the text's, the timing and routing the model's;
  on a random-weight model its own output repeats itself and flatters every cache).
- :func:`union_curve`: U(k) of k consecutive tokens of one sequence from a route log (notebook 02's curve),
  to set beside U(b) of b sequences at one step.
- :func:`speculation`: n-gram (prompt-lookup) drafting simulated on real token sequences: the drafter finds
  the last n tokens earlier in the context and proposes the k that followed; the accepted length is how many
  of them the text continues with (greedy verification against the text). Seed 002 §4.2 left this open;
  prompt-lookup decoding is Saxena 2023 (github.com/apoorvumang/prompt-lookup-decoding), llama.cpp's
  ``lookup`` example.
- :func:`draft_reads`: what verifying k drafted tokens reads: the union of experts of k + 1 consecutive
  tokens per layer (route log) per token it advances, against one token per pass; ds4 #458 reports only
  10-30% overlap between a draft's tokens.
"""
from __future__ import annotations

import os
import statistics
import tempfile
import time
from collections.abc import Sequence

import numpy as np
import pandas as pd

from ..data import heldout_texts, prompts as shipped_prompts
from ..engine import run_stats
from ..engine.batch import Batcher, Request
from ..engine.sampling import Sampler
from ..engine.session import Session
from ..layout import inspect
from ..models import default_model
from ..routes import union_sizes
from .ablation.grid import memory_points

BATCH_SIZES = (1, 2, 4, 8)
NGRAM_NS = (2, 3, 4, 6, 8)
DRAFT_K = 8


def forced_sequences(session, n: int, prompt_tokens: int, n_predict: int, texts: dict[str, str] | None = None):
    """``n`` real token sequences for teacher forcing: windows of ``prompt_tokens + n_predict`` tokens cut
    from the held-out texts (:func:`epqlab.data.heldout_texts`, never calibrated on), text after text, each
    window starting where the previous one of its text ended. Returns ``[(prompt ids, forced ids)]``.

    Raises:
        ValueError: the texts hold fewer than ``n`` windows."""
    texts = texts or heldout_texts()
    w = prompt_tokens + n_predict
    per_text = []
    for text in texts.values():
        t = session.tokenize(text)
        per_text.append([(t[o:o + prompt_tokens], t[o + prompt_tokens:o + w]) for o in range(0, len(t) - w + 1, w)])
    # interleaved, so that a batch mixes the genres: window 0 of every text, then window 1, ...
    mixed = [ws[i] for i in range(max(map(len, per_text), default=0)) for ws in per_text if i < len(ws)]
    if len(mixed) < n:
        raise ValueError(f"the texts hold {len(mixed)} windows of {w} tokens, fewer than the {n} sequences asked for")
    return mixed[:n]


def _prompt_ids(session, prompts, n: int) -> list[list[int]]:
    ps = list(prompts) if prompts else shipped_prompts()
    texts = [p.text(session) if hasattr(p, "text") else str(p) for p in ps]
    return [session.tokenize(texts[i % len(texts)], add_special=not hasattr(ps[i % len(ps)], "kind")
                             or ps[i % len(ps)].kind != "chat") for i in range(n)]


def measure(session, b: int, n_predict: int, *, teacher_forced: bool = True, prompt_tokens: int = 32,
            prompts=None, score: bool = False, offset: int = 0, token_nll: list | None = None) -> dict:
    """One batch of ``b`` sequences on ``session`` (greedy, or teacher-forced on held-out text): the batch
    stats of :func:`epqlab.engine.run_stats.batch_stats` reduced to one row, plus the time split's mean µs
    per decode step (attn, experts, io wait, map, other), and the lossy knobs' counters per decode step
    (``union_before`` / ``union_after``: the router's and the rewritten distinct experts per layer and step;
    ``routing_agreement``; ``budget_dropped``, ``route_substituted``). ``score`` (teacher-forced only) adds
    ``nll`` (mean negative log-likelihood, nats, of the forced tokens fed from decode steps: the first forced
    token, fed from the prompt's logits, is left out as no knob touches it) and ``nll_tokens``; ``offset`` skips
    that many windows of the held-out texts (so several batches score different text); ``token_nll``: a list that
    receives each of those scored tokens' NLL, in order (for a paired interval, :mod:`epqlab.studies.paired`)."""
    if score and not teacher_forced:
        raise ValueError("score is the likelihood of the forced text: it needs teacher_forced=True")
    if teacher_forced:
        seqs = forced_sequences(session, b + int(offset), prompt_tokens, n_predict)[int(offset):]
        reqs = [Request(p, n_predict, Sampler(session.n_vocab, temperature=0.0), forced=f, index=i, score=score)
                for i, (p, f) in enumerate(seqs)]
    else:
        reqs = [Request(p, n_predict, Sampler(session.n_vocab, temperature=0.0), index=i)
                for i, p in enumerate(_prompt_ids(session, prompts, b))]
    session.reset_stats()
    bt = Batcher(session, b)
    with session.decoder.lock:
        c0, t0 = run_stats.counters(session), time.perf_counter()
        bt.run(reqs)
        c1 = run_stats.counters(session)
        st = run_stats.batch_stats(session, bt, reqs, c0, c1, time.perf_counter() - t0)
    steps = st["steps"]
    per_seq = [x["decode_tok_s"] for x in st["sequences"] if x.get("decode_tok_s")]
    ts = session.time_split("token")
    multi = ts[ts["n_tokens"] == b] if "n_tokens" in ts else ts.tail(len(steps))  # the decode steps (prompts are longer)
    split = {f"{c[:-3]}_ms": float(multi[c].mean()) / 1000 for c in ("attn_us", "expert_us", "io_us", "map_us", "other_us")
             if c in multi and len(multi)}
    c = {k: c1.get(k, 0) - c0.get(k, 0) for k in run_stats.LOSSY_COUNTERS}
    lossy = {}
    n_steps_layers = max(1, st["decode_steps"]) * max(1, len(session.layout.layers))
    if c.get("lossy_slots"):
        lossy = {"union_before": c["lossy_union_before"] / n_steps_layers,
                 "union_after": c["lossy_union_after"] / n_steps_layers,
                 "routing_agreement": run_stats.lossy_fields(session, c)["routing_agreement"],
                 "budget_dropped": c["budget_dropped"], "route_substituted": c["route_substituted"],
                 "adaptive_dropped": c["adaptive_dropped"], "budget_overflow": c["budget_overflow"]}
    if score:
        nll = [x for r in reqs for x in (r.nll or [])[1:]]
        lossy.update(nll=float(np.mean(nll)) if nll else float("nan"), nll_tokens=len(nll))
        if token_nll is not None:
            token_nll.extend(nll)
    return {
        **lossy,
        "batch": b, "sequences": len(reqs), "steps": st["decode_steps"], "decode_tok_s": st["decode_tok_s"],
        "per_seq_tok_s": statistics.median(per_seq) if per_seq else 0.0,
        "mean_batch": st["mean_batch"], "union_per_layer": st["union_per_layer"],
        "ssd_mb_per_token": st["decode_ssd_bytes"] / max(1, st["decode_tokens"]) / 1e6,
        "hit_rate": st["decode_hit_rate"], "n_gen": st["n_gen"], "prefill_s": st["prefill_s"],
        "step_ms": 1000 * st["decode_s"] / max(1, st["decode_steps"]), **split,
        "teacher_forced": teacher_forced,
    }


def batching(model=None, batch_sizes: Sequence[int] = BATCH_SIZES, *, arenas: Sequence | None = (0.25,),
             budgets: Sequence | None = None, n_predict: int = 32, repeats: int = 1, teacher_forced: bool = True,
             prompt_tokens: int = 32, prompts=None, n_ctx: int = 256, progress: bool = False,
             **session_kw) -> pd.DataFrame:
    """The batching table: one row per (memory point, batch size), speeds the median of ``repeats`` runs
    (interleaved: repeat 1 of every row, then repeat 2, ...), counts from the first.

    Args:
        model: a MoE GGUF (default: the embedded default model).
        batch_sizes: sequences per batch.
        arenas, budgets: memory points (:func:`epqlab.studies.ablation.grid.memory_points`).
        n_predict: tokens per sequence (>= 2 for a decode step).
        teacher_forced: feed held-out text (default; :func:`forced_sequences`) instead of greedy generation
            from the shipped prompts.
        session_kw: more :class:`epqlab.Session` arguments (``n_threads``, ``policy``).

    Columns: ``point``, ``batch``, ``decode_tok_s`` (aggregate, every sequence), ``per_seq_tok_s``
    (median of the sequences'), ``speedup`` (decode tok/s over batch 1's at the point), ``ssd_mb_per_token``
    (decode reads per generated token), ``mb_ratio`` (over batch 1's), ``union_per_layer`` (U(b)), ``hit_rate``,
    ``step_ms`` and the time split per step (``attn_ms``, ``expert_ms``, ``io_ms``, ``map_ms``, ``other_ms``),
    ``*_min`` / ``*_max`` of the speeds.

    Raises:
        ValueError: a batch size < 1, ``n_predict`` < 2, or the memory points' errors.
    """
    model = str(model or default_model(progress=False))
    sizes = sorted({int(b) for b in batch_sizes})
    if not sizes or sizes[0] < 1:
        raise ValueError(f"batch sizes must be >= 1, got {list(batch_sizes)}")
    if n_predict < 2:
        raise ValueError(f"n_predict must be >= 2 (a decode step needs a token after the prefill), got {n_predict}")
    lay = inspect(model)
    points = memory_points(lay, arenas, budgets)
    runs: dict[tuple, list[dict]] = {}
    for rep in range(int(repeats)):
        for pt in points:
            with Session(model, n_seq_max=max(sizes), n_ctx=n_ctx, **pt.session_kwargs(), **session_kw) as s:
                for b in sizes:
                    row = measure(s, b, n_predict, teacher_forced=teacher_forced, prompt_tokens=prompt_tokens,
                                  prompts=prompts)
                    row.update(pt.as_dict(), arena_bytes=s.pager.arena_bytes if s.pager else 0)
                    runs.setdefault((pt.label, b), []).append(row)
                    if progress:
                        print(f"[batching] {pt.label} b={b} rep {rep + 1}: {row['decode_tok_s']:.1f} tok/s, "
                              f"{row['ssd_mb_per_token']:.2f} MB/token, U={row['union_per_layer']:.1f}", flush=True)
    rows = []
    for (label, b), rs in runs.items():
        row = dict(rs[0])
        for k in ("decode_tok_s", "per_seq_tok_s", "step_ms"):
            vals = [r[k] for r in rs]
            row[k] = statistics.median(vals)
            row[k + "_min"], row[k + "_max"] = min(vals), max(vals)
        row["repeats"] = len(rs)
        rows.append(row)
    df = pd.DataFrame(rows)
    base = df[df.batch == sizes[0]].set_index("point")
    df["speedup"] = [r.decode_tok_s / base.loc[r.point, "decode_tok_s"] if base.loc[r.point, "decode_tok_s"] else None
                     for r in df.itertuples()]
    df["mb_ratio"] = [r.ssd_mb_per_token / base.loc[r.point, "ssd_mb_per_token"]
                      if base.loc[r.point, "ssd_mb_per_token"] else None for r in df.itertuples()]
    df.attrs.update(model=model, batch_sizes=sizes, n_predict=n_predict, repeats=int(repeats),
                    teacher_forced=teacher_forced, n_expert_used=lay.n_expert_used, n_expert=lay.n_expert,
                    n_moe_layers=len(lay.layers))
    return df


def union_curve(log, ks: Sequence[int] = BATCH_SIZES) -> pd.DataFrame:
    """U(k): mean distinct experts per layer among k consecutive tokens of one sequence
    (:func:`epqlab.routes.union_sizes` of a route log), columns ``k``, ``union``, ``saving``."""
    u = union_sizes(log, ks=sorted({1, *map(int, ks)}))
    return u[["k", "union", "saving"]].reset_index(drop=True)


def ngram_draft(context: Sequence[int], n: int, k: int) -> list[int]:
    """The prompt-lookup draft: the ``k`` tokens that followed the most recent earlier occurrence of the
    last ``n`` tokens of ``context`` (fewer if the context ends first; [] when the n-gram does not recur)."""
    if len(context) <= n:
        return []
    key = list(context[-n:])
    for s in range(len(context) - n - 1, -1, -1):
        if list(context[s:s + n]) == key:
            return list(context[s + n:s + n + k])
    return []


def accepted_lengths(tokens: Sequence[int], n: int, k: int, start: int) -> list[int]:
    """Simulate prompt-lookup speculation along ``tokens`` from position ``start`` (the tokens before are the
    prompt): at each verification step draft with :func:`ngram_draft` over everything so far, accept the
    longest prefix of the draft the text continues with, and advance by that plus the one token the
    verification pass itself produces. Returns the accepted length of every step."""
    out, t = [], int(start)
    toks = list(tokens)
    while t < len(toks):
        d = ngram_draft(toks[:t], n, k)
        a = 0
        while a < len(d) and t + a < len(toks) and d[a] == toks[t + a]:
            a += 1
        out.append(a)
        t += a + 1
    return out


def speculation(sequences: dict[str, Sequence[int]], ns: Sequence[int] = NGRAM_NS, k: int = DRAFT_K,
                prompt_fraction: float = 0.25) -> pd.DataFrame:
    """Prompt-lookup speculation on real token sequences (module docstring): one row per (sequence, n) with
    ``steps`` (verification passes), ``drafted_share`` (passes that had a draft), ``mean_accepted`` (drafted
    tokens accepted per pass), ``tokens_per_pass`` (``mean_accepted + 1``: what a pass advances). The first
    ``prompt_fraction`` of each sequence is its prompt (context the drafter may look up, not scored)."""
    rows = []
    for name, toks in sequences.items():
        start = max(1, int(len(toks) * prompt_fraction))
        for n in ns:
            acc = accepted_lengths(toks, int(n), int(k), start)
            t, had = start, 0
            for a in acc:  # count passes that had a draft
                had += bool(ngram_draft(list(toks[:t]), int(n), int(k)))
                t += a + 1
            rows.append({"sequence": name, "n": int(n), "k": int(k), "tokens": len(toks) - start, "steps": len(acc),
                         "drafted_share": had / len(acc) if acc else 0.0,
                         "mean_accepted": float(np.mean(acc)) if acc else 0.0,
                         "tokens_per_pass": float(np.mean(acc)) + 1 if acc else 1.0})
    return pd.DataFrame(rows)


def text_routes(model=None, n_tokens: int = 600, texts: dict[str, str] | None = None, **session_kw):
    """The held-out texts' first ``n_tokens`` token ids each and the route log of decoding them (plain
    llama.cpp, each text from an empty context, every token routed through every layer): the inputs of
    :func:`speculation` and :func:`draft_reads`. Returns ``(sequences {name: ids}, RouteLog)``."""
    if int(n_tokens) < 2:
        raise ValueError(f"n_tokens must be >= 2 (spec_tokens: tokens of each held-out text to draft over), got {n_tokens}")
    model = str(model or default_model(progress=False))
    texts = texts or heldout_texts()
    with tempfile.TemporaryDirectory() as td, Session(model, pager=False, n_ctx=max(256, n_tokens),
                                                       route_log=os.path.join(td, "routes.npz"), **session_kw) as s:
        seqs = {k: s.tokenize(v)[:n_tokens] for k, v in texts.items()}
        for ids in seqs.values():
            s.logits(ids)
        return seqs, s.route_log()


def draft_reads(log, tokens_per_pass: float, k: int = DRAFT_K) -> dict:
    """Expert reads of speculation against plain decode, from a route log of real text: verifying a draft of
    ``k`` tokens computes k + 1 consecutive tokens in one pass, reading U(k+1) distinct experts per layer and
    advancing ``tokens_per_pass`` tokens; plain decode reads U(1) (= top-k) per token. Returns ``union_1``,
    ``union_k1``, ``overlap`` (1 - U(k+1) / ((k+1) U(1)): the share of the draft's expert requests it shares),
    ``reads_per_token_ratio`` (U(k+1) / tokens_per_pass / U(1): < 1 means speculation reads less per
    generated token)."""
    u = union_sizes(log, ks=(1, k + 1)).set_index("k")["union"]
    u1, uk = float(u.loc[1]), float(u.loc[k + 1])
    return {"k": int(k), "union_1": u1, "union_k1": uk, "overlap": 1 - uk / ((k + 1) * u1),
            "tokens_per_pass": float(tokens_per_pass), "reads_per_token_ratio": uk / tokens_per_pass / u1}


__all__ = ["batching", "measure", "forced_sequences", "union_curve", "speculation", "accepted_lengths", "ngram_draft",
           "draft_reads", "text_routes", "BATCH_SIZES", "NGRAM_NS", "DRAFT_K"]
