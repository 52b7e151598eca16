"""The top-k ablation (epqlab.studies.ablation.topk), its skip-cold sweep, notebook 04 and `epqlab ablate topk`:
values checked against numbers computed here (plain llama.cpp perplexity, hand-worked divergences)."""
from __future__ import annotations

import json
import math

import pytest

from epqlab.studies.ablation.topk import divergence, parse_ks, resolve_prompts, resolve_texts
from epqlab.data import heldout_texts
from epqlab.studies.model_quality import perplexity_of
from notebooks import run_notebook

SMALL = dict(texts=["prose"], text_chars=400, ppl_n_ctx=64, prompts=["chat-cache", "code-fib"], n_predict=6)


def test_divergence_by_hand():
    assert divergence([5, 6, 7, 8], [5, 6, 9, 8]) == (2, 2)
    assert divergence([5, 6, 7], [5, 6, 7]) == (None, 3)
    assert divergence([1, 2], [3, 2]) == (0, 0)
    assert divergence([1, 2, 3], [1, 2]) == (None, 2)


def test_bad_inputs_name_the_fix():
    assert parse_ks("2,4,7", 8) == [2, 4, 7] and parse_ks(None, 3) == [1, 2, 3]
    with pytest.raises(ValueError, match="outside 1..8"):
        parse_ks([0, 2], 8)
    with pytest.raises(ValueError, match="not an integer"):
        parse_ks("2,x", 8)
    with pytest.raises(ValueError, match="prose"):
        resolve_texts(["poetry"])
    with pytest.raises(ValueError, match="chat-cache"):
        resolve_prompts(["nope"])
    assert resolve_texts(["code"], 10) == {"code": heldout_texts()["code"][:10]}


def test_notebook_04_small_grid(default_model_path, tmp_path):
    r = run_notebook("04_topk", {**SMALL, "ks": [1, 3], "arenas": [0.25], "repeats": 1, "taus": [0.0, 1.0], "tau_text_chars": 400,
                                 "session_kw": {"n_ctx": 256}}, tmp_path)
    rows = r["rows"]
    assert [(x["k"], x["point"]) for x in rows] == [(1, rows[0]["point"]), (3, rows[0]["point"])]
    text = heldout_texts()["prose"][:400]
    # perplexity per k equals plain llama.cpp's, computed here (paging is exact)
    for x in rows:
        ref = perplexity_of(default_model_path, text, n_ctx=64, expert_used=x["k"])
        assert x["ppl_prose"] == ref.ppl, x["k"]
    own = r["parameters"]["own_k"]
    assert own == 3
    div = {(d["k"], d["prompt"]): d for d in r["divergence"]}
    assert all(div[(3, p)]["common_prefix"] == 6 and div[(3, p)]["first_diff"] is None for p in SMALL["prompts"])
    assert all(x["decode_tok_s"] > 0 for x in rows)
    # fewer experts per token read fewer bytes per decoded token
    assert rows[0]["ssd_mb_per_token"] < rows[1]["ssd_mb_per_token"]
    sk = r["skip_cold"]["rows"]
    assert [x["tau"] for x in sk] == [None, 0.0, 1.0]
    assert sk[1]["ppl_prose"] == sk[0]["ppl_prose"] and sk[1]["ppl_skipped_per_token"] == 0
    assert sk[2]["ppl_skipped_per_token"] > 0 and sk[2]["ppl_ssd_mb_per_token"] < sk[0]["ppl_ssd_mb_per_token"]
    # the reading quotes numbers computed from the rows
    ratio = rows[0]["ppl_prose"] / rows[1]["ppl_prose"]
    assert f"k=1: x{ratio:.3f}" in r["reading"]
    assert f"τ=1: PPL x{sk[2]['ppl_mean'] / sk[0]['ppl_mean']:.3f}" in r["reading"]
    out = tmp_path / "results" / "04_topk"
    assert (out / "test.png").stat().st_size > 10_000
    assert (out / "test.csv").is_file() and (out / "test_skip_cold.csv").is_file() and (out / "test_divergence.csv").is_file()


def test_cli_ablate_topk(default_model_path, tmp_path, capsys):
    from epqlab.cli import main

    out = tmp_path / "t.json"
    assert main(["ablate", "topk", str(default_model_path), "--ks", "2,3", "--arenas", "0.5", "--texts", "code",
                 "--text-chars", "300", "--ppl-n-ctx", "64", "--prompts", "prose-story", "-n", "4", "--repeats", "2",
                 "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert [x["k"] for x in doc["rows"]] == [2, 3] and doc["parameters"]["repeats"] == 2
    assert len(doc["runs"]) == 4
    ref = perplexity_of(default_model_path, heldout_texts()["code"][:300], n_ctx=64, expert_used=2)
    assert doc["rows"][0]["ppl_code"] == ref.ppl
    printed = capsys.readouterr().out
    assert "ppl_code" in printed and doc["reading"].split("\n")[0] in printed
    assert main(["ablate", "topk", str(default_model_path), "--ks", "9"]) == 1
    assert "outside 1..8" in capsys.readouterr().err
