"""The batched lossy trade-off (epqlab.studies.ablation.batch_lossy, ``epqlab ablate lossy --batches``): its
perplexity against a NumPy computation from plain llama.cpp's logits, its union columns against the hook's own
counts, and the command's table and JSON."""
from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np

import epqlab
from epqlab.studies.ablation.batch_lossy import batch_lossy, batch_settings, best_tradeoff
from epqlab.studies.batching import forced_sequences

PROMPT, N = 16, 12


def _numpy_ppl(path, windows):
    """Perplexity of the forced tokens fed from decode steps (all but each window's first), from plain llama.cpp's
    logits of prompt + forced tokens, one window at a time, log-softmax in float64."""
    nll = []
    with epqlab.Session(path, pager=False, n_ctx=256, n_threads=2) as s:
        for prompt, forced in forced_sequences(s, windows, PROMPT, N):
            lg = s.logits(list(prompt) + list(forced)).astype(np.float64)  # [len, n_vocab]: row i predicts token i+1
            for j in range(1, len(forced)):
                row = lg[len(prompt) - 1 + j]
                m = row.max()
                nll.append(m + math.log(np.exp(row - m).sum()) - row[forced[j]])
    return math.exp(float(np.mean(nll)))


def test_batch_curve_ppl_and_unions(default_path):
    settings = [s for s in batch_settings(3, deltas=(), budgets=(2,))]
    assert [x[0] for x in settings] == ["exact", "expert-budget"]
    df = batch_lossy(default_path, (1, 2), settings, arenas=(0.5,), windows=2, n_predict=N, prompt_tokens=PROMPT,
                     n_threads=2)
    ex = df[df.knob == "exact"].set_index("batch")
    ref = _numpy_ppl(default_path, 2)
    # batched decode computes the same tokens with other matmul shapes: equal to float rounding, not bit for bit
    assert math.isclose(ex.loc[1, "ppl"], ref, rel_tol=2e-3) and math.isclose(ex.loc[2, "ppl"], ref, rel_tol=2e-3)
    assert (ex.ppl_ratio == 1.0).all() and ex.loc[1, "speedup"] == 1.0
    assert ex.loc[1, "union_before"] == ex.loc[1, "union_after"] == 3.0  # one token: its top-3
    bud = df[df.knob == "expert-budget"].set_index("batch")
    # two tokens' union (3..6) capped at 2: at most 2 per step-layer, plus at most one per token left with none
    assert bud.loc[2, "union_before"] > 3.0 and bud.loc[2, "union_after"] <= 2.0 + 2
    assert bud.loc[2, "union_after"] < bud.loc[2, "union_before"] and bud.loc[2, "routing_agreement"] < 1.0
    # budget 2 with one token: a cap on its own 3 experts, so it also acts at batch 1
    assert bud.loc[1, "union_after"] <= 2.0 + 1e-9 and bud.loc[1, "ppl_ratio"] != 1.0
    best = best_tradeoff(df, batch=2, max_ppl_ratio=10.0)
    assert best is not None and best["batch"] == 2


def test_ablate_lossy_batches_command(default_path, tmp_path):
    out = tmp_path / "bl.json"
    r = subprocess.run([sys.executable, "-m", "epqlab", "ablate", "lossy", str(default_path), "--batches", "1,2",
                        "--windows", "2", "--budgets", "4", "--batch-deltas", "0.1", "--texts", "prose", "--json", str(out),
                        "--threads", "2"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "| arena 50% | expert-budget | N=4" in r.stdout and "| arena 25% | batch-route   | delta=0.1" in r.stdout
    doc = json.loads(out.read_text())
    assert doc["kind"] == "batch_lossy" and len(doc["rows"]) == 2 * 3 * 2  # arenas x settings x batches


def test_ablate_lossy_batch_flags_are_checked(default_path, capsys):
    from epqlab.cli import main

    assert main(["ablate", "lossy", str(default_path), "--budgets", "4"]) != 0
    assert "--budgets apply to the batched table only: add --batches" in capsys.readouterr().err
    assert main(["ablate", "lossy", str(default_path), "--batches", "1,2", "--windows", "0"]) != 0
    assert "--windows must be >= 1" in capsys.readouterr().err
    assert main(["ablate", "lossy", str(default_path), "--batches", "1,2", "--budgets", "2.5"]) != 0
    assert "--budgets takes integers" in capsys.readouterr().err
