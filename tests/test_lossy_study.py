"""The lossy-knob trade-off study (epqlab.studies.ablation.lossy), notebook 07, papers/07, `epqlab ablate lossy` and the
`epqlab run` lossy flags, with tiny parameters; values checked against plain llama.cpp perplexity computed here."""
from __future__ import annotations

import json

import pytest

from epqlab.data import heldout_texts
from epqlab.studies.ablation import lossy_report
from epqlab.studies.model_quality import perplexity_of
from notebooks import run_notebook

TEXT_CHARS, N_CTX = 150, 32


@pytest.mark.slow
def test_notebook_07_small(default_model_path, tmp_path):
    r = run_notebook("07_lossy_knobs", {"arenas": [0.5], "ks": [2], "taus": [0.3], "deltas": [0.0, 0.2],
                                        "adaptive": [[[1.9], [1, 3]]], "texts": ["prose"], "text_chars": TEXT_CHARS,
                                        "ppl_n_ctx": N_CTX, "batch_sizes": [1, 2], "batch_windows": 2,
                                        "budgets": [4], "batch_deltas": [0.1]}, tmp_path)
    rows = r["rows"]
    assert [(x["knob"], x["setting"]) for x in rows] == [
        ("exact", "off"), ("top-k", "k=2"), ("skip-cold", "tau=0.3"), ("cache-route", "delta=0"),
        ("cache-route", "delta=0.2"), ("adaptive-k", "H<1.9:1,else 3")]
    ex, k2, sk, d0, d2, ak = rows
    # exact (paged, one token per decode) is plain llama.cpp's perplexity, decoded the same way
    ref = perplexity_of(default_model_path, heldout_texts()["prose"][:TEXT_CHARS], n_ctx=N_CTX, n_batch=1, n_ubatch=1)
    assert ex["ppl_prose"] == ref.ppl and ex["ppl_ratio_prose"] == 1.0 and ex["routing_agreement"] == 1.0
    ref2 = perplexity_of(default_model_path, heldout_texts()["prose"][:TEXT_CHARS], n_ctx=N_CTX, n_batch=1, n_ubatch=1,
                         expert_used=2)
    assert k2["ppl_prose"] == ref2.ppl and k2["routing_agreement"] == pytest.approx(2 / 3) and k2["mean_k"] == 2
    # delta 0 examines every slot and changes nothing: the same numbers as exact
    assert d0["ppl_prose"] == ex["ppl_prose"] and d0["ssd_mb_per_token"] == ex["ssd_mb_per_token"]
    assert d0["routing_agreement"] == 1.0
    # paired intervals over the same tokens: delta 0's NLL is exact's token by token, so its interval is x1 exactly;
    # with one text the ratio over all tokens is the ratio of the two perplexities
    assert d0["ppl_ratio_low"] == d0["ppl_ratio_high"] == d0["ppl_ratio_tokens"] == 1.0
    assert k2["ppl_ratio_tokens"] == pytest.approx(k2["ppl_prose"] / ex["ppl_prose"], rel=1e-9)
    assert k2["ppl_ratio_low"] < k2["ppl_ratio_tokens"] < k2["ppl_ratio_high"] and k2["scored_tokens"] == ref.n_scored
    # a wide margin substitutes: fewer bytes, a higher hit rate, agreement below 1
    assert d2["routing_agreement"] < 1 and d2["ssd_mb_per_token"] < ex["ssd_mb_per_token"] and d2["hit_rate"] > ex["hit_rate"]
    assert sk["routing_agreement"] < 1 and sk["ssd_mb_per_token"] < ex["ssd_mb_per_token"]
    assert 1 <= ak["mean_k"] < 3 and ak["ssd_mb_per_token"] < ex["ssd_mb_per_token"]
    assert all(x["decode_tok_s"] > 0 for x in rows)
    # the reading quotes numbers computed from the rows
    assert f"cache-route delta=0.2: PPL x{d2['ppl_ratio_mean']:.3f}" in r["reading"]
    assert f"agreement {d2['routing_agreement']:.1%}" in r["reading"]
    out = tmp_path / "results" / "07_lossy_knobs"
    assert (out / "test.png").stat().st_size > 10_000 and (out / "test.csv").is_file()
    # papers/07 renders from the executed notebook's JSON
    from epqlab.papers import write_papers

    papers = write_papers(tmp_path / "results", tmp_path / "papers")
    text = (tmp_path / "papers" / "07_lossy_knobs.md").read_text()
    assert any(p.endswith("07_lossy_knobs.md") for p in papers)
    assert "| cache-route" in text and f"x{d2['ppl_ratio_mean']:.3f}" in text
    # the batched table: exact, batch-route, budget at batch 1 and 2, rendered in papers/07 with its reading
    b = r["batch_rows"]
    assert [(x["knob"], x["setting"], x["batch"]) for x in b] == [
        (k, s_, n) for k, s_ in (("exact", "off"), ("batch-route", "delta=0.1"), ("expert-budget", "N=4")) for n in (1, 2)]
    assert all(x["ppl_ratio"] == 1.0 for x in b if x["knob"] == "exact")
    bud2 = next(x for x in b if x["knob"] == "expert-budget" and x["batch"] == 2)
    assert bud2["union_after"] < bud2["union_before"] and "**Lossy knobs in batched decode**" in text
    assert f"{bud2['union_before']:.3f}" in text and "exact batching at b = 2" in text


def test_cli_run_and_ablate_lossy(default_model_path, tmp_path, capsys):
    from epqlab.cli import main

    assert main(["run", str(default_model_path), "-n", "4", "--threads", "1", "--route-bias", "cache",
                 "--route-delta", "0.2"]) == 0
    out = capsys.readouterr().out
    assert "lossy knobs" in out and "route_bias=cache (delta 0.2" in out and "routing agreement" in out
    assert main(["run", str(default_model_path), "-n", "2", "--route-bias", "cache", "--route-delta", "0.1",
                 "--skip-cold", "0.1"]) != 0
    assert "route_bias and skip_cold are exclusive" in capsys.readouterr().err
    assert main(["run", str(default_model_path), "-n", "2", "--adaptive-k", "1.5"]) != 0
    assert "THRESHOLDS:KS" in capsys.readouterr().err
    j = tmp_path / "l.json"
    assert main(["ablate", "lossy", str(default_model_path), "--arenas", "0.5", "--ks", "", "--taus", "",
                 "--deltas", "0.1", "--adaptive", "", "--texts", "code", "--text-chars", "100", "--ppl-n-ctx", "32",
                 "--json", str(j)]) == 0
    doc = json.loads(j.read_text())
    assert [(x["knob"], x["setting"]) for x in doc["rows"]] == [("exact", "off"), ("cache-route", "delta=0.1")]
    from epqlab.papers.studies import study_of

    assert study_of(doc) == "07_lossy_knobs"


def test_no_texts_still_feeds_tokens_for_bytes_and_speed(default_model_path):
    """texts=[] (a synthesized model: no perplexity) still decodes the held-out prose teacher-forced, so
    bytes, hit rate and speed are measured; no perplexity column is reported."""
    from epqlab.studies.ablation import lossy_knobs

    df = lossy_knobs(default_model_path, arenas=[0.5], ks=(), taus=(), deltas=(0.1,), adaptive=(), texts=[],
                     text_chars=80, ppl_n_ctx=32)
    assert list(df["knob"]) == ["exact", "cache-route"]
    assert (df["tokens"] > 0).all() and (df["decode_tok_s"] > 0).all()
    assert not [c for c in df.columns if c.startswith("ppl_") and c != "ppl_ratio_mean"]
    from epqlab.studies.ablation.lossy_report import reading

    text = reading(df)
    assert "No perplexity" in text and "PPL x" not in text


def test_small_arena_cache_route_rows_mean_something(default_model_path, monkeypatch):
    """At a 25% arena LRU keeps no expert of a layer until the layer comes round again (hit rate 0), so cache-aware
    routing has nothing to substitute and its row is trivially exact; the study's policy (fnu) keeps some, so the
    row measures a real substitution. Before the first row an untimed warm-up Session runs (not a row)."""
    from epqlab.studies.ablation import lossy as study

    opened = []
    real = study.Session

    def counting(*a, **kw):
        opened.append(kw.get("policy"))
        return real(*a, **kw)

    monkeypatch.setattr(study, "Session", counting)
    kw = dict(arenas=[0.25], ks=(), taus=(), deltas=(0.1,), adaptive=(), texts=[], text_chars=60, ppl_n_ctx=32,
              n_threads=1)
    lru = study.lossy_knobs(default_model_path, policy="lru", warmup=False, **kw)
    assert opened == ["lru", "lru"]
    assert list(lru["hit_rate"]) == [0.0, 0.0] and list(lru["routing_agreement"]) == [1.0, 1.0]
    opened.clear()
    df = study.lossy_knobs(default_model_path, **kw)
    assert opened == [study.DEFAULT_POLICY] * 3 and len(df) == 2  # warm-up + two rows, all with the study's policy
    ex, cr = df.to_dict("records")
    assert ex["hit_rate"] > 0 and cr["routing_agreement"] < 1 and cr["ssd_mb_per_token"] < ex["ssd_mb_per_token"]
    assert df.attrs["session_kw"]["policy"] == "fnu"


def test_notebook_07_refuses_an_unwritable_results_dir_before_the_study(tmp_path):
    """results_dir under a file (unwritable for every user, root included): cell 3 stops before any Session opens."""
    papermill = pytest.importorskip("papermill")
    f = tmp_path / "a-file"
    f.write_text("x")
    with pytest.raises(papermill.PapermillExecutionError) as ei:
        run_notebook("07_lossy_knobs", {"results_dir": str(f / "results"), "arenas": [0.5], "texts": []}, tmp_path)
    assert "cannot write" in str(ei.value) and "is not a folder" in str(ei.value)
    out = json.loads((tmp_path / "07_lossy_knobs.out.ipynb").read_text())
    ran = [c for c in out["cells"] if c["cell_type"] == "code" and c.get("execution_count")]
    assert not any("[lossy]" in "".join(o.get("text", "")) for c in ran for o in c.get("outputs", []))


def _hand_table(high_cache):
    """exact, a cache-route row at PPL x0.996 reading fewer bytes (its 95% interval up to ``high_cache``) and a top-k
    row at x1.030 (95% x1.020..x1.040) reading fewer still, over 300 tokens."""
    import pandas as pd

    base = dict(point="arena 25%", routing_agreement=1.0, decode_tok_s=10.0, hit_rate=0.5, mean_k=3.0,
                scored_tokens=300, ppl_prose=10.0)
    df = pd.DataFrame([
        {**base, "knob": "exact", "setting": "off", "ppl_ratio_prose": 1.0, "ppl_ratio_mean": 1.0,
         "ppl_ratio_tokens": 1.0, "ppl_ratio_low": 1.0, "ppl_ratio_high": 1.0, "ssd_mb_per_token": 2.0},
        {**base, "knob": "cache-route", "setting": "delta=0.1", "ppl_ratio_prose": 0.996, "ppl_ratio_mean": 0.996,
         "ppl_ratio_tokens": 0.996, "ppl_ratio_low": 0.97, "ppl_ratio_high": high_cache, "ssd_mb_per_token": 1.5},
        {**base, "knob": "top-k", "setting": "k=2", "ppl_ratio_prose": 1.03, "ppl_ratio_mean": 1.03,
         "ppl_ratio_tokens": 1.03, "ppl_ratio_low": 1.02, "ppl_ratio_high": 1.04, "ssd_mb_per_token": 1.0}])
    df.attrs.update(texts=["prose"], own_k=3, n_expert=8)
    return df


def test_reading_picks_by_the_interval_not_the_point():
    """A setting at PPL x0.996 is 'within 1%' by its point estimate; on 300 tokens its 95% interval reaches x1.022,
    so the reading does not claim it within 1%; a narrow interval under the limit is a pick, and when every interval
    holds x1 the reading says no setting is distinguishable from exact (mutation-checked: picking by
    ppl_ratio_tokens instead of ppl_ratio_high names cache-route within x1.01)."""
    text = lossy_report.reading(_hand_table(1.022))
    assert ("No lossy setting reads fewer bytes than exact with its 95% interval within PPL x1.01 on these 300 scored "
            "tokens.") in text
    assert ("Fewest bytes with the 95% interval within PPL x1.05: top-k k=2 (1.000 MB/token against exact's 2.000; "
            "x1.030 (95% x1.020..x1.040 over 300 tokens))") in text
    assert "cache-route delta=0.1: PPL x0.996 (prose x0.996; all tokens x0.996 (95% x0.970..x1.022 over 300 tokens: " \
           "not distinguishable from exact))" in text
    assert "distinguishable from exact here" not in text  # top-k's interval excludes x1
    # a narrow interval under the limit is a pick, named with its interval; with top-k gone every interval holds x1
    df = _hand_table(1.004)
    text = lossy_report.reading(df[df.knob != "top-k"])
    assert ("Fewest bytes with the 95% interval within PPL x1.01: cache-route delta=0.1 (1.500 MB/token against "
            "exact's 2.000; x0.996 (95% x0.970..x1.004 over 300 tokens: not distinguishable from exact))") in text
    assert "No lossy setting is distinguishable from exact here: every 95% interval holds x1 over these 300" in text
