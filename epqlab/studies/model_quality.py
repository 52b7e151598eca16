"""Quality and routing checks of a MoE model: held-out perplexity at every k, the same perplexity through
llama-cpp-python's default kernels, route logs over the shipped prompts, and their locality statistics.

Used by bench/bench_default_model.py and tests/test_models.py.
"""
from __future__ import annotations

import os

import numpy as np

from ..constants import KEY_EXPERT_USED_COUNT, arch_key
from ..data import prompts
from ..engine.perplexity import PerplexityResult, perplexity, windowed_perplexity
from ..engine.plain_llama import plain_llama
from ..engine.session import Session
from ..routes import RouteLog, expert_counts, reuse_distances, simulate, union_sizes


def perplexity_of(model, text: str, *, n_ctx: int = 512, stride: int | None = None, **session_kw) -> PerplexityResult:
    """:func:`epqlab.engine.perplexity.perplexity` of ``text`` under the GGUF ``model`` (MoE or dense), in a
    Session opened for it and closed afterwards: context ``max(n_ctx, 256)`` tokens, ``session_kw`` passed on
    (default ``pager=False``, plain llama.cpp; ``expert_used=k`` changes top-k).

    Raises:
        ValueError: as :func:`~epqlab.engine.perplexity.perplexity`; the Session's errors for a bad model.
    """
    session_kw.setdefault("pager", False)
    with Session(model, n_ctx=max(int(n_ctx), 256), **session_kw) as s:
        return perplexity(s, text, n_ctx=n_ctx, stride=stride)


def perplexity_table(model, dense, texts: dict[str, str], ks, *, n_ctx: int = 512) -> dict:
    """Perplexity of every text under the dense model and the MoE model at each top-k, all with
    :func:`perplexity_of` (plain llama.cpp, ``pager=False``).

    Returns ``{text name: {"tokens": n_scored, "dense": ppl, k: ppl, ...}}`` (k are ints)."""
    out: dict = {}
    for name, text in texts.items():
        r = perplexity_of(dense, text, n_ctx=n_ctx)
        row = {"tokens": r.n_scored, "dense": r.ppl}
        for k in ks:
            row[int(k)] = perplexity_of(model, text, n_ctx=n_ctx, expert_used=int(k)).ppl
        out[name] = row
    return out


def llama_cpp_perplexity(path: str | os.PathLike, text: str, *, n_ctx: int = 512, expert_used: int | None = None,
                         n_threads: int = 2) -> float:
    """Perplexity of ``text`` through plain llama-cpp-python with its default settings (CPU weight
    repacking on except on an AMX build, see :mod:`epqlab.engine.plain_llama`; flash attention off, the whole
    window in one ubatch), through the same windowing and scoring as
    :func:`epqlab.engine.perplexity.perplexity` (:func:`~epqlab.engine.perplexity.windowed_perplexity`, ``stride = n_ctx``).
    This is the comparison that shows whether routing hangs on kernel rounding (near-tied router logits flip expert choices).

    Raises:
        ValueError: fewer than 2 tokens.
    """
    from gguf import GGUFReader  # gguf-py (~0.3 s): only this reference needs it

    kv = None
    if expert_used:
        arch = GGUFReader(path).fields["general.architecture"].contents()
        kv = {arch_key(KEY_EXPERT_USED_COUNT, arch): int(expert_used)}
    llm = plain_llama(path, n_ctx=max(n_ctx, 256), n_batch=n_ctx, logits_all=True, verbose=False,
                      n_threads=n_threads, kv_overrides=kv)

    def window_logits(win):
        llm.reset()
        llm.eval(win.tolist())
        yield np.asarray(llm.scores[:len(win)], np.float32)

    try:
        toks = llm.tokenize(text.encode(), add_bos=True, special=True)
        return windowed_perplexity(toks, window_logits, n_ctx=n_ctx, stride=n_ctx).ppl
    finally:
        llm.close()


def record_prompt_routes(model, path: str | os.PathLike, *, n_predict: int = 48, kinds=None,
                         expert_used: int | None = None, **session_kw):
    """Generate ``n_predict`` greedy tokens for each prompt of :func:`epqlab.data.prompts` (chat prompts in
    the model's chat template) in one plain-llama.cpp :class:`epqlab.Session` recording routes, save the
    route log (NPZ, docs/DESIGN.md §6) to ``path`` and return it as a :class:`~epqlab.routes.RouteLog`
    (prefill and decode tokens of every prompt, in order). ``session_kw`` go to the Session
    (e.g. ``n_threads``)."""
    kw = {"expert_used": expert_used} if expert_used else {}
    with Session(model, pager=False, route_log=path, n_ctx=512, **kw, **session_kw) as s:
        for p in prompts():
            if kinds is None or p.kind in kinds:
                s.generate(p.text(s), n_predict=n_predict)
    return RouteLog.load(path)


def uniform_log(log, seed: int = 0):
    """A route log of the same shape as ``log`` with every token's experts drawn uniformly at random
    (without replacement) in every layer: the no-locality baseline."""
    rng = np.random.default_rng(seed)
    T, L, k = log.experts.shape
    e = np.argsort(rng.random((T, L, log.n_expert)), axis=2)[:, :, :k].astype(np.int32)
    return RouteLog(experts=e, layers=log.layers.copy(), phase=log.phase.copy(), expert_bytes=log.expert_bytes.copy(),
                    n_expert=log.n_expert, meta={"uniform_baseline": True})


def locality_stats(log, arenas=(0.10, 0.25, 0.50), union_ks=(2, 4, 8), top_frac: float = 0.25) -> dict:
    """Routing locality of ``log`` as plain numbers:

    - ``repeat_prev``: share of requests whose (layer, expert) the previous token also used (uniform: k/E);
    - ``union_saving``: {k: 1 - U(k) / (k U(1))}, the I/O a batch of k consecutive tokens saves by loading
      each expert once (:func:`epqlab.routes.union_sizes`);
    - ``top_share``: share of requests that go to each layer's ``top_frac`` most requested experts, the
      mean over layers and its min/max (uniform: ``top_frac`` up to sampling noise);
    - ``lru`` / ``belady``: {arena fraction: hit rate} for one shared pool of ``round(frac * L * E)`` slots
      (at least k) over all layers (:func:`epqlab.routes.simulate`, ``per_layer=False``).
    """
    T, L, k = log.experts.shape
    E = log.n_expert
    d = reuse_distances(log)
    repeat = float((d[1:] == 1).mean()) if T > 1 else float("nan")
    u = union_sizes(log, ks=(1,) + tuple(union_ks))
    sav = {int(r.k): float(r.saving) for r in u.itertuples() if r.k != 1}
    c = expert_counts(log)
    ntop = max(1, int(round(top_frac * E)))
    share = np.sort(c, axis=1)[:, ::-1][:, :ntop].sum(1) / np.maximum(c.sum(1), 1)
    caps = {f: max(k, int(round(f * L * E))) for f in arenas}
    sim = simulate(log, sorted(set(caps.values())), ("lru", "belady"), per_layer=False)
    hit = {(r.policy, r.capacity): float(r.hit_rate) for r in sim.itertuples()}
    return {"tokens": T, "layers": L, "k": k, "n_expert": E, "repeat_prev": repeat, "union_saving": sav,
            "top_frac": top_frac, "top_share": float(share.mean()), "top_share_min": float(share.min()),
            "top_share_max": float(share.max()),
            "lru": {f: hit[("lru", c_)] for f, c_ in caps.items()},
            "belady": {f: hit[("belady", c_)] for f, c_ in caps.items()}}
