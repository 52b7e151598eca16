"""Perplexity under top-k changes: paged equals plain llama.cpp exactly at every k, and the one
definition equals an independent computation from Session.logits; the ``epqlab ppl`` command."""
from __future__ import annotations

import json

import numpy as np
import pytest

import epqlab
from epqlab.data import heldout_texts
from epqlab.engine.perplexity import perplexity
from epqlab.studies.model_quality import perplexity_of


def text_tokens(n: int = 110) -> str:
    """About ``n`` tokens of the held-out prose (whole words, no tokenizer needed)."""
    words = heldout_texts()["prose"].split()
    return " ".join(words[:int(n * 0.7)])


def test_paged_equals_plain_at_every_k(default_model_path):
    """At each k in 1..n_expert, perplexity with the pager at a small arena (25 % of the expert
    slots, at least one layer's top-k: prefill ubatches stage, decode evicts) equals pager=False
    exactly (same float64 NLL)."""
    lay = epqlab.inspect(default_model_path)
    total = epqlab.Pager.all_experts_bytes(lay)
    text = text_tokens()
    seen = set()
    for k in range(1, lay.n_expert + 1):
        plain = perplexity_of(default_model_path, text, n_ctx=64, expert_used=k)
        arena = max(epqlab.Pager.min_arena_bytes(lay, k), total // 4)
        with epqlab.Session(default_model_path, arena_bytes=arena, expert_used=k, n_ctx=256) as s:
            paged = perplexity(s, text, n_ctx=64)
            assert s.stats["misses"] > 0 and s.stats["evictions"] > 0
        assert paged == plain, (k, paged, plain)
        assert plain.n_windows >= 2
        seen.add(round(plain.ppl, 6))
    assert len(seen) >= lay.n_expert - 1  # k changes the numbers (not one value for every k)


def _nll_from_logits(s, toks, n_ctx, stride):
    """The module docstring's windowing, computed here from Session.logits with a float64 log-softmax."""
    total, count = 0.0, 0
    for start in range(0, len(toks) - 1, stride):
        win = toks[start:start + n_ctx]
        lg = s.logits(win).astype(np.float64)
        logp = lg - (np.log(np.exp(lg - lg.max(1, keepdims=True)).sum(1)) + lg.max(1))[:, None]
        lo = 0 if start == 0 else n_ctx - stride - 1
        for j in range(lo, len(win) - 1):
            total -= logp[j, win[j + 1]]
            count += 1
        if start + n_ctx >= len(toks):
            break
    return total / count, count


@pytest.mark.parametrize("n_ctx,stride", [(None, None), (48, 20)], ids=["one-window", "overlapping"])
def test_matches_logits_at_model_k(default_model_path, n_ctx, stride):
    lay = epqlab.inspect(default_model_path)
    arena = max(epqlab.Pager.min_arena_bytes(lay), epqlab.Pager.all_experts_bytes(lay) // 4)
    with epqlab.Session(default_model_path, arena_bytes=arena, n_ctx=256) as s:
        toks = s.tokenize(text_tokens(90))
        n_ctx = n_ctx or len(toks)
        stride = stride or n_ctx
        r = perplexity(s, text_tokens(90), n_ctx=n_ctx, stride=stride)
        nll, count = _nll_from_logits(s, toks, n_ctx, stride)
    assert r.n_scored == count == len(toks) - 1
    assert abs(r.nll - nll) <= 1e-9 * abs(nll)
    assert abs(r.ppl - np.exp(nll)) <= 1e-9 * np.exp(nll)


def test_ppl_cli(default_model_path, tmp_path, capsys):
    from epqlab.cli import main

    f = tmp_path / "t.txt"
    f.write_text(text_tokens(80))
    out = tmp_path / "r.json"
    assert main(["ppl", str(default_model_path), str(f), "--expert-used", "2", "--n-ctx", "64",
                 "--arena", "0.25", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    ref = perplexity_of(default_model_path, f.read_text(), n_ctx=64, expert_used=2)
    assert r["ppl"] == ref.ppl and r["n_expert_used"] == 2 and r["paged"]
    assert r["stats"]["bytes_read"] > 0
    assert f"PPL = {ref.ppl:.4f}" in capsys.readouterr().out
    # bad input: one clean line naming the fix
    assert main(["ppl", str(default_model_path), "no-such-text"]) == 1
    assert "held-out" in capsys.readouterr().err
    assert main(["ppl", str(default_model_path), "prose", "--skip-cold", "0.5"]) == 1
    assert "--arena" in capsys.readouterr().err
