"""The top-k ablation: perplexity, speed and SSD I/O per (k, arena or budget), and how far greedy
generation at each k drifts from the model's own k.

Changing top-k (``n_expert_used``) is a *lossy* setting: the graph computes a different function.
Paging stays exact at every k (perplexity with the pager equals plain llama.cpp's; tests/test_ppl.py),
so perplexity is measured once per k and holds for every arena. Memory points (arenas, budgets) and the
speed/I/O metrics are the eviction ablation's (:mod:`epqlab.studies.ablation.grid`), so the two studies share
their grid and metric definitions. Perplexity is :func:`epqlab.engine.perplexity.perplexity` (one definition).
"""
from __future__ import annotations

import sys
import time
from collections.abc import Mapping, Sequence

from ...data import Prompt, heldout_texts
from ...data import prompts as shipped_prompts
from ...layout import inspect
from ...engine.perplexity import perplexity
from .grid import measure_prompts, memory_points, summarize
from ...engine.session import Session
from ...models import default_model
from ..sweeps import map_points


def resolve_texts(texts, max_chars: int | None = None) -> dict[str, str]:
    """Evaluation texts as ``{name: text}``: None = every held-out text (:func:`epqlab.data.heldout_texts`),
    a list (or comma-separated string) of held-out names, or a mapping of your own; each cut to its
    first ``max_chars`` characters (None = whole). An empty list gives no texts (no perplexity: for a
    synthesized model with random weights, whose perplexity means nothing).

    Raises:
        ValueError: an unknown held-out name, ``max_chars`` < 1, a text that is empty (or only whitespace).
    """
    held = heldout_texts()
    if texts is None:
        out = held
    elif isinstance(texts, Mapping):
        out = {str(k): str(v) for k, v in texts.items()}
    else:
        if isinstance(texts, str):
            texts = [t for t in texts.split(",") if t]
        out = {}
        for t in texts:
            if t not in held:
                raise ValueError(f"unknown held-out text {t!r}; choose from {', '.join(held)} or pass {{name: text}}")
            out[t] = held[t]
    if max_chars is not None and int(max_chars) < 1:
        raise ValueError(f"max_chars (--text-chars) must be >= 1 characters, or None for whole texts; got {max_chars}")
    out = {k: v[:int(max_chars)] if max_chars else v for k, v in out.items()}
    empty = [k for k, v in out.items() if not v.strip()]
    if empty:
        raise ValueError(f"text{'s' if len(empty) > 1 else ''} {', '.join(map(repr, empty))} "
                         f"{'are' if len(empty) > 1 else 'is'} empty: a perplexity needs at least 2 tokens; pass some "
                         "text, or no texts at all (texts=[], --texts '') for no perplexity")
    return out


def resolve_prompts(prompts) -> list[Prompt]:
    """Prompts: None = every shipped prompt (:func:`epqlab.data.prompts`), a list (or comma-separated
    string) of their ids, or :class:`epqlab.data.Prompt` objects.

    Raises:
        ValueError: an unknown prompt id, or no prompt.
    """
    ship = shipped_prompts()
    if prompts is None:
        return ship
    if isinstance(prompts, str):
        prompts = [p for p in prompts.split(",") if p]
    by_id = {p.id: p for p in ship}
    out = []
    for p in prompts:
        if isinstance(p, Prompt):
            out.append(p)
        elif p in by_id:
            out.append(by_id[p])
        else:
            raise ValueError(f"unknown prompt id {p!r}; the shipped ids are {', '.join(by_id)}")
    if not out:
        raise ValueError("no prompts given")
    return out


def parse_ks(ks, n_expert: int) -> list[int]:
    """Top-k values: None = 1..n_expert, a list, or a comma-separated string ("2,4,7").

    Raises:
        ValueError: a value that is not an integer in 1..n_expert.
    """
    if ks is None:
        return list(range(1, n_expert + 1))
    if isinstance(ks, str):
        ks = [x for x in ks.split(",") if x.strip()]
    out = []
    for k in ks:
        try:
            v = int(k)
        except (TypeError, ValueError):
            raise ValueError(f"top-k {k!r} is not an integer") from None
        if not 1 <= v <= n_expert:
            raise ValueError(f"top-k {v} is outside 1..{n_expert} (the model's n_expert)")
        out.append(v)
    if not out:
        raise ValueError("no top-k values given")
    return out


def greedy_tokens(session, prompt: Prompt, n_predict: int) -> list[int]:
    """``n_predict`` greedy token ids after ``prompt`` (end-of-generation tokens do not stop it), from
    :meth:`epqlab.Session.greedy_trace`."""
    toks = session.tokenize(prompt.text(session), add_special=prompt.kind != "chat")
    return [int(t) for t in session.greedy_trace(toks, n_predict)[2]]


def divergence(ref: Sequence[int], other: Sequence[int]) -> tuple[int | None, int]:
    """``(first_diff, common_prefix)`` of two token sequences: the index of the first differing token
    (None when none differs within the shorter one, as with identical runs) and the length of the
    common prefix (tokens)."""
    n = 0
    for a, b in zip(ref, other):
        if a != b:
            return n, n
        n += 1
    return None, n


def topk(model=None, ks=None, *, arenas=(0.25, 0.5), texts=None, prompts=None, n_predict: int = 32,
         repeats: int = 3, budgets=None, ppl_n_ctx: int = 512, text_chars: int | None = None,
         n_ctx: int = 1024, progress: bool = False, executor=None, **session_kw):
    """Sweep top-k over memory points.

    Args:
        model: GGUF path (MoE); None = the default model.
        ks: top-k values (see :func:`parse_ks`); None = every k from 1 to n_expert.
        arenas: arena sizes, fractions of all expert slots or bytes, and ``budgets``: RAM budgets
            (bytes or "4GiB"), as :func:`epqlab.studies.ablation.grid.memory_points` turns them into points.
        texts: evaluation texts (see :func:`resolve_texts`; ``text_chars`` cuts each); perplexity
            with windows of ``ppl_n_ctx`` tokens; ``[]`` = no perplexity.
        prompts: generation prompts (see :func:`resolve_prompts`); ``n_predict`` greedy tokens each.
        repeats: speed runs per (k, point) (>= 1), each in a fresh session (cold arena), summarized by
            :func:`epqlab.studies.ablation.grid.summarize` (speeds: median, min, max; counts: the first run's).
        n_ctx: the sessions' context (tokens).
        progress: one line per run on stderr.
        executor: a :class:`concurrent.futures.Executor` to run the ks on (one k per process at a time,
            :func:`epqlab.studies.sweeps.map_points`); default None runs everything serially here, because the
            speed columns are timings that parallel runs on one box spoil (see :mod:`epqlab.studies.sweeps`).
        **session_kw: further :class:`epqlab.Session` arguments (policy, n_threads, ...).

    Returns:
        pandas.DataFrame, one row per (k, point), ks in the order given: ``k``, ``own_k`` (the model's
        k), ``point`` (label), ``ppl_<text>`` per text (measured once per k, at its first point:
        paging is exact, so it holds at every point), the :func:`~epqlab.studies.ablation.grid.summarize`
        fields of the speed runs (decode and prefill tok/s, SSD MB/token, requests/token, hit
        rates, evictions, ...), and ``greedy_common_prefix_mean`` (mean over prompts of the greedy
        common prefix with the model's own k, tokens). ``df.attrs``: ``divergence`` (one record
        per (k, prompt): ``first_diff``, ``common_prefix``, ``n_predict``), ``runs`` (every speed
        run's metrics) and the parameters.

    Raises:
        ValueError: a k outside 1..n_expert, repeats < 1, bad texts or prompts.
    """
    import pandas as pd

    if model is None:
        model = default_model(progress=False)
    lay = inspect(model)
    ks = parse_ks(ks, lay.n_expert)
    if int(repeats) < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    txt = resolve_texts(texts, text_chars)
    pr = resolve_prompts(prompts)
    own = lay.n_expert_used

    common = dict(model=model, arenas=arenas, budgets=budgets, txt=txt, pr=pr, n_predict=n_predict, repeats=repeats,
                  ppl_n_ctx=ppl_n_ctx, n_ctx=n_ctx, progress=progress, session_kw=session_kw)
    rows, runs, greedy = [], [], {}
    for k, (r, ru, g) in zip(ks, map_points(_k_rows, [dict(k=k, **common) for k in ks], executor)):
        rows += r
        runs += ru
        greedy[k] = g
    if own not in greedy:  # the model's own k was not swept: its reference, with plain llama.cpp (exact)
        with Session(model, n_ctx=n_ctx, pager=False) as s:
            greedy[own] = {p.id: greedy_tokens(s, p, n_predict) for p in pr}
    div = []
    for k in ks:
        for p in pr:
            first, common = divergence(greedy[own][p.id], greedy[k][p.id])
            div.append({"k": k, "prompt": p.id, "kind": p.kind, "first_diff": first, "common_prefix": common,
                        "n_predict": int(n_predict)})
    df = pd.DataFrame(rows)
    means = pd.DataFrame(div).groupby("k")["common_prefix"].mean()
    df["greedy_common_prefix_mean"] = df["k"].map(means)
    df.attrs.update(model=str(lay.path), n_expert=lay.n_expert, own_k=own, ks=ks, texts=list(txt),
                    prompts=[p.id for p in pr], n_predict=int(n_predict), repeats=int(repeats),
                    ppl_n_ctx=int(ppl_n_ctx), text_chars=text_chars, n_ctx=int(n_ctx),
                    session_kw=dict(session_kw), divergence=div, runs=runs)
    return df


def _k_rows(model, k, arenas, budgets, txt, pr, n_predict, repeats, ppl_n_ctx, n_ctx, progress, session_kw):
    """Rows, speed runs and greedy tokens of one k of :func:`topk` (module level: executors pickle it)."""
    lay = inspect(model)
    own = lay.n_expert_used
    rows, runs, greedy, ppl = [], [], {}, None
    for pt in memory_points(lay, arenas=arenas, budgets=budgets, k=k):
        rs = []
        for r in range(int(repeats)):  # each repeat a fresh session (cold arena), as in the eviction sweep
            with Session(model, expert_used=k, n_ctx=n_ctx, **{**session_kw, **pt.session_kwargs()}) as s:
                t0 = time.perf_counter()
                m = measure_prompts(s, pr, n_predict)
                rs.append(m)
                runs.append({"k": k, "point": pt.label, "repeat": r,
                             **{x: v for x, v in m.items() if x != "pass_kind"}})
                if progress:
                    print(f"[topk] k={k} {pt.label} run {r + 1}/{repeats}: {m['decode_tok_s']:.2f} tok/s "
                          f"({time.perf_counter() - t0:.1f} s)", file=sys.stderr, flush=True)
                if ppl is None:  # once per k: paging is exact, so every point gives the same numbers
                    ppl = {name: perplexity(s, t, n_ctx=min(ppl_n_ctx, s.n_ctx)).ppl for name, t in txt.items()}
                    greedy = {p.id: greedy_tokens(s, p, n_predict) for p in pr}
        rows.append({"k": k, "own_k": own, "point": pt.label, **{f"ppl_{n}": v for n, v in ppl.items()},
                     **summarize(rs)})
    return rows, runs, greedy


__all__ = ["topk", "divergence", "greedy_tokens", "parse_ks", "resolve_texts", "resolve_prompts"]
