"""One architecture's row of the arch table (tests/test_archs.py::test_arch_table), run in a child process so
that a llama.cpp abort fails that architecture's test instead of killing pytest.

Usage: ``python tests/arch_child.py ARCH KNOBS_JSON GGUF_PATH``. Writes the tiny model of ``ARCH``
(epqlab.models.archs.write_tiny with the knobs), then compares each paged column with plain llama.cpp
(``pager=False``) bit for bit, and prints one JSON line: column -> ``"exact"``, ``"refused: <message>"``
(a ValueError epqlab raised before running, e.g. slot addressing on slices that are not whole pages) or
``"DIFFERS: <what>"``; or, for an architecture epqlab.inspect refuses (UnsupportedArchError),
``{"refused": <message>, "plain_llama_cpp_loads": bool, ...}`` after loading the file with plain llama.cpp.
"""
from __future__ import annotations

import json
import sys

import numpy as np

import epqlab
from epqlab.models.archs import write_tiny

N_STEPS = 8
TEXT = ("Paging experts from disk keeps the arena small, and the logits must not change by a single bit. "
        "The router of every layer picks the experts of each token; a miss reads them with O_DIRECT.")
MORE = " A second request shares the first one's prefix."
KW = dict(n_threads=1, n_ctx=256)


class Recorder:
    """Copies of every logits row the session's decoder returns (prefill and decode steps)."""

    def __init__(self, s):
        self.rows: list[np.ndarray] = []
        d = s.decoder
        pre, step = d.prefill, d.step

        def prefill(*a, **k):
            out = pre(*a, **k)
            self.rows.append(np.array(out, copy=True))
            return out

        def stepf(*a, **k):
            out = step(*a, **k)
            self.rows.append(np.array(out, copy=True))
            return out

        d.prefill, d.step = prefill, stepf


def _same(a, b) -> bool:
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.shape == b.shape and np.array_equal(a, b)
    return a == b


def serial_features(s, toks):
    """Prefix reuse, teacher forcing and perplexity on one session, in that order: the logits rows of each."""
    rec = Recorder(s)
    first = s.generate(toks, 4)
    second = s.generate(list(toks) + first.tokens + s.tokenize(MORE, add_bos=False), N_STEPS, reuse_kv=True)
    reuse = (rec.rows[:], first.tokens, second.tokens, second.stats["n_prompt_reused"])
    rec.rows.clear()
    forced = s.generate(toks[:12], N_STEPS, forced=toks[12:12 + N_STEPS])
    force = (rec.rows[:], forced.tokens)
    ppl = s.perplexity(TEXT + MORE, n_ctx=32)
    return {"prefix_reuse": reuse, "forced": force, "perplexity": ppl}


def main() -> None:
    arch, knobs, path = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
    for k in ("expert_types", "late_expert_types", "rope_sections"):
        if isinstance(knobs.get(k), list):
            knobs[k] = tuple(knobs[k])
    write_tiny(path, arch, **knobs)
    try:
        lay = epqlab.inspect(path)
    except epqlab.UnsupportedArchError as e:  # refused by name: show that plain llama.cpp loads the file
        import llama_cpp

        llama_cpp.llama_backend_init()
        model = llama_cpp.llama_model_load_from_file(path.encode(), llama_cpp.llama_model_default_params())
        if model:
            llama_cpp.llama_model_free(model)
        print(json.dumps({"refused": str(e), "plain_llama_cpp_loads": bool(model)}))
        return
    out: dict[str, str] = {}
    ref = {}
    for ub in (1, 512):
        with epqlab.Session(path, pager=False, n_ubatch=ub, **KW) as s:
            toks = s.tokenize(TEXT)[:40]
            ref[ub] = s.greedy_trace(toks, N_STEPS)
    if not (np.isfinite(ref[1][0]).all() and np.isfinite(ref[1][1]).all()):
        raise SystemExit("plain llama.cpp gives non-finite logits: the tiny model's weights are broken")
    half = epqlab.Pager.all_experts_bytes(lay) // 2
    least = epqlab.Pager.min_arena_bytes(lay)
    arenas = {"half": (half, 1), "min_ub1": (least, 1), "min_ub512": (least, 512)}

    def run(cols, fn, want, **sk):
        """One paged session: ``fn(s)`` returns {column: value}, each compared with ``want[column]``."""
        try:
            with epqlab.Session(path, **KW, **sk) as s:
                got, stats = fn(s), dict(s.stats)
        except ValueError as e:
            out.update({c: f"refused: {e}" for c in cols})
            return
        for c in cols:
            if not _same(got[c], want[c]):
                out[c] = "DIFFERS: logits or tokens"
            elif stats.get("misses", 0) <= 0:
                out[c] = "DIFFERS: no expert was paged (misses 0)"
            else:
                out[c] = "exact"

    for name, (arena, ub) in arenas.items():
        for addr in ("slots", "region"):
            col = f"{name}/{addr}"
            run([col], lambda s, col=col: {col: s.greedy_trace(toks, N_STEPS)}, {col: ref[ub]},
                arena_bytes=arena, n_ubatch=ub, expert_addressing=addr)
    prompts = [toks[:30], toks[5:40]]
    with epqlab.Session(path, pager=False, n_seq_max=2, **KW) as s:
        bref = s.batch_trace(prompts, N_STEPS)
    run(["batch"], lambda s: {"batch": s.batch_trace(prompts, N_STEPS)}, {"batch": bref}, arena_bytes=half,
        n_seq_max=2)
    with epqlab.Session(path, pager=False, **KW) as s:
        sref = serial_features(s, toks)
    if sref["prefix_reuse"][3] <= 0:
        raise SystemExit("plain llama.cpp reused no prompt tokens: the prefix-reuse column tests nothing")
    run(list(sref), lambda s: serial_features(s, toks), sref, arena_bytes=least)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
