"""Batched decode (epqlab.engine.batch, docs/DESIGN.md §3d): several sequences per forward pass.

Paging never changes the math: every sequence of a batch gets logits bit-identical to the same batch with
``pager=False``, for every policy at a small arena; a batch of one is today's single-sequence decode bit for
bit. Sequences with different prompt lengths, stops and limits finish independently; a cancelled sequence's
KV cells are freed and reused; the per-step union is the hand-counted union of the step's routes.
"""
from __future__ import annotations

import numpy as np
import pytest

import epqlab
from epqlab.constants import ONLINE_POLICIES
from epqlab.engine.batch import Batcher, Request
from epqlab.engine.sampling import Sampler
from exact import small_arena

PROMPTS = ["A CPU cache is", "The capital of France is a city that", "def fib(n):", "Once upon a time, in a"]
N = 10
THREADS = 1


@pytest.fixture(scope="module")
def unpaged(default_model_path):
    with epqlab.Session(default_model_path, pager=False, n_seq_max=4, n_ctx=256, n_threads=THREADS) as s:
        yield s


@pytest.fixture(scope="module")
def batch_ref(unpaged):
    return unpaged.batch_trace(PROMPTS, N)


@pytest.mark.parametrize("policy", ONLINE_POLICIES)
def test_paged_batch_is_bit_identical_to_unpaged(default_model_path, batch_ref, policy):
    with epqlab.Session(default_model_path, n_seq_max=4, n_ctx=256, n_threads=THREADS, policy=policy,
                        arena_bytes=small_arena(default_model_path, 2.0)) as s:
        got = s.batch_trace(PROMPTS, N)
        st = s.stats
    for (lg, toks), (rl, rt) in zip(got, batch_ref):
        assert toks == rt and np.array_equal(lg, rl)
    assert st["misses"] > 0 and st["evictions"] > 0  # the arena really paged


def _last_logits_prefill(s, toks):
    """The prompt's last logits as a single-sequence generation computes them: only the last position outputs
    (greedy_trace outputs every position, and the output head's many-row matmul rounds differently from its
    one-row path on CPUs without AVX-512)."""
    d = s.decoder
    with d.lock:
        epoch, _ = d.begin()
        return d.decode(toks, 0, False, 0, epoch)[-1]


def test_batch_of_one_is_single_sequence_decode(default_model_path, unpaged):
    toks = unpaged.tokenize(PROMPTS[1])
    _, steps, gen = unpaged.greedy_trace(toks, N)
    first = _last_logits_prefill(unpaged, toks)
    (lg, out), = unpaged.batch_trace([PROMPTS[1]], N)
    assert out == gen and np.array_equal(lg[0], first) and np.array_equal(lg[1:], steps[1:])
    # and a context of one sequence gives the same numbers as one of four
    with epqlab.Session(default_model_path, pager=False, n_ctx=256, n_threads=THREADS) as one:
        assert np.array_equal(one.greedy_trace(toks, N)[1], steps)


def test_batched_rows_differ_from_alone_only_by_kernel_rounding(unpaged, batch_ref):
    """llama.cpp's batched matmuls round differently from its one-column path (the prefill row is
    identical, decode rows move by a little): the reason the server compares against unpaged batches."""
    toks = unpaged.tokenize(PROMPTS[0])
    _, alone, _ = unpaged.greedy_trace(toks, N)
    rows = batch_ref[0][0]
    assert np.array_equal(rows[0], _last_logits_prefill(unpaged, toks))
    diff = np.abs(rows[1:4] - alone[1:4]).max()
    assert diff < 1.0  # rounding, not another computation


def test_sequences_finish_independently_and_cells_are_reused(default_model_path):
    """Four requests on two sequences: a stop string, a short limit, a long prompt and a cancelled one. Each
    ends for its own reason; freed sequences are reused; the schedule is the same paged and unpaged, so the
    tokens are too."""
    def requests(s, stop):
        mk = lambda p, n, stops=(): Request(s.tokenize(p), n, Sampler(s.n_vocab, temperature=0.0), stops)
        return [mk(PROMPTS[0], 12, stop), mk(PROMPTS[1], 3), mk(PROMPTS[2] + " " + PROMPTS[3] * 6, 9),
                mk(PROMPTS[3], 40)]

    def run(stop=("CPU",), **kw):
        with epqlab.Session(default_model_path, n_seq_max=2, n_ctx=256, n_threads=THREADS, **kw) as s:
            reqs = requests(s, stop)
            b = Batcher(s)
            for r in reqs:
                b.submit(r)
            with s.decoder.lock:
                while b.step():
                    if len(reqs[3].out) == 5:
                        reqs[3].cancel()
            left = [s.decoder.engine.seq_pos_max(q) for q in range(2)]
            return reqs, left, [x["n_tokens"] for x in b.step_log]

    plain, left, sizes = run(pager=False)
    paged, _, sizes1 = run(arena_bytes=small_arena(default_model_path, 2.0))
    assert [r.result.tokens for r in plain] == [r.result.tokens for r in paged] and sizes == sizes1
    assert [r.result.finish_reason for r in plain] == ["stop", "length", "length", "cancelled"]
    assert [len(r.result.tokens) for r in plain[1:]] == [3, 9, 5]
    # the stopped text is the unstopped one cut before "CPU" (its steps are the same until it stops)
    free, _, _ = run(stop=(), pager=False)
    assert "CPU" in free[0].result.text and plain[0].result.text == free[0].result.text.split("CPU")[0]
    seqs = [r.result.stats["seq"] for r in plain]
    assert sorted(set(seqs)) == [0, 1]  # 4 requests on 2 sequences: cells reused
    assert left == [-1, -1]  # every sequence's KV cells freed at the end
    assert max(sizes) == 2 and 1 in sizes  # pairs shared steps, and a lone survivor went on


def test_stop_string_in_a_batch(unpaged):
    gens = unpaged.generate_batch(PROMPTS[:2], 24, stop=["."])
    for g in gens:
        assert "." not in g.text
    alone = unpaged.generate(PROMPTS[0], 24, stop=["."])
    assert gens[0].text.split(".")[0] == gens[0].text and alone.finish_reason in ("stop", "length")


def test_step_union_equals_the_routes(default_model_path, tmp_path):
    """The per-step union per layer the batcher reports is the number of distinct experts among the
    step's tokens' routes, counted here from the route log."""
    with epqlab.Session(default_model_path, n_seq_max=3, n_ctx=256, n_threads=THREADS, arena_bytes="6MiB",
                        route_log=tmp_path / "r.npz") as s:
        gens = s.generate_batch(PROMPTS[:3], 6)
        log = s.route_log()
    steps = gens[0].stats["batch"]["steps"]
    ub = np.asarray(log.ubatch)
    ids, starts = np.unique(ub, return_index=True)
    passes = [np.flatnonzero(ub == i) for i in ids[np.argsort(starts)]]
    batched = [p for p in passes if len(p) > 1 and (log.phase[p] == 1).all()]
    assert len(batched) == len(steps) and all(len(p) == x["n_tokens"] for p, x in zip(batched, steps))
    for p, x in zip(batched, steps):
        want = [len(np.unique(log.experts[p, l])) for l in range(log.n_layers)]
        assert x["union"] == want
    st = gens[0].stats["batch"]
    assert st["mean_batch"] > 1 and 0 < st["union_per_layer"] <= 3 * log.k
    assert st["n_gen"] == sum(len(g.tokens) for g in gens)


def test_batch_arguments_are_checked(unpaged, default_model_path):
    with pytest.raises(TypeError, match="list of prompts"):
        unpaged.generate_batch("one string", 4)
    with pytest.raises(ValueError, match="no prompts"):
        unpaged.generate_batch([], 4)
    with pytest.raises(ValueError, match="n_predict"):
        unpaged.generate_batch(["a"], -1)
    with pytest.raises(ValueError, match="no room in the context"):
        unpaged.generate_batch(["a " * 400], 4)
    with pytest.raises(ValueError, match="n_seq_max"):
        epqlab.Session(default_model_path, n_seq_max=0)
    with pytest.raises(ValueError, match="max_batch"):
        Batcher(unpaged, 0)
    # nothing to generate: nothing generated (as generate(n_predict=0)), and a stream yields nothing
    assert [g.tokens for g in unpaged.generate_batch(["a", "b"], 0)] == [[], []] == [unpaged.generate("a", 0).tokens] * 2
    assert list(unpaged.stream_batch(["a", "b"], 0)) == []


def test_stream_batch_yields_every_sequence(unpaged):
    st = unpaged.stream_batch(PROMPTS, 6)
    pieces: dict[int, str] = {}
    for i, piece in st:
        pieces[i] = pieces.get(i, "") + piece
    assert sorted(pieces) == [0, 1, 2, 3]
    assert [pieces[i] for i in range(4)] == [g.text for g in st.results]
    assert st.results[0].stats["batch"]["decode_steps"] >= 1


def test_prompt_lookup_acceptance_by_hand():
    """[1 2 3 1 2 3 1 2 4], n = 2, k = 3, prompt = first 3 tokens: at 3 and 4 the bigram ([2 3], [3 1]) has
    no earlier occurrence (no draft, the pass advances 1); at 5 [1 2] occurred at 0, the draft [3 1 2] is
    what the text continues with: 3 accepted, the pass advances 4, to the end."""
    from epqlab.studies.batching import accepted_lengths, ngram_draft, speculation

    toks = [1, 2, 3, 1, 2, 3, 1, 2, 4]
    assert ngram_draft(toks[:5], 2, 3) == [3, 1, 2] and ngram_draft(toks[:3], 2, 3) == []
    assert accepted_lengths(toks, 2, 3, 3) == [0, 0, 3]
    row = speculation({"t": toks}, ns=[2], k=3, prompt_fraction=1 / 3).iloc[0]
    assert row.steps == 3 and row.mean_accepted == 1.0 and row.tokens_per_pass == 2.0
    assert row.drafted_share == pytest.approx(1 / 3)


def test_batching_notebook(tmp_path, default_model_path):
    """notebooks/06_batching.ipynb under papermill with tiny parameters: the table's rows, its ratios to batch 1
    computed again here from the rows, and papers/06 rendered from its JSON."""
    from epqlab.papers import write_papers
    from notebooks import run_notebook

    doc = run_notebook("06_batching", {"batch_sizes": [1, 2], "n_predict": 4, "spec_tokens": 200,
                                       "session_kw": {"n_threads": 1}}, tmp_path)
    rows = {r["batch"]: r for r in doc["rows"]}
    assert sorted(rows) == [1, 2]
    assert rows[2]["speedup"] == pytest.approx(rows[2]["decode_tok_s"] / rows[1]["decode_tok_s"])
    assert rows[2]["mb_ratio"] == pytest.approx(rows[2]["ssd_mb_per_token"] / rows[1]["ssd_mb_per_token"])
    assert rows[1]["union_per_layer"] == doc["parameters"]["n_expert_used"]  # one token: its top-k
    # the default arena: 4 of a layer's 8 experts for a top-3 model, so an expert can outlive a token and LRU hits
    # (at 25%, 2 slots for 3 experts, every row showed 0.0% hit)
    assert rows[1]["point"] == "arena 50%" and rows[1]["hit_rate"] > 0
    assert rows[2]["mean_batch"] == 2 and rows[1]["union_per_layer"] <= rows[2]["union_per_layer"] <= 2 * rows[1]["union_per_layer"]
    assert [r["n"] for r in doc["speculation"]["table"]] == [2, 3, 4, 6, 8]
    assert doc["reading"] and doc["draft_reads"]["k"] == 8
    out = write_papers(tmp_path / "results", tmp_path / "papers")
    text = (tmp_path / "papers" / "06_batching.md").read_text()
    assert "Several sequences per forward pass" in text and "Prompt-lookup" in text


def test_four_sequences_inside_a_cgroup_of_their_budget(tmp_path, default_model_path):
    """epqlab.studies.batching_child (one bench row) in a memory cgroup of ram_budget + 16 MiB: a Session with
    4 KV streams (all inside the budget) decodes 4 teacher-forced sequences and stays under the limit."""
    import json
    import sys

    from epqlab.memory import limits

    if limits.cgroup_unavailable_reason() is not None:
        pytest.skip(f"no writable memory cgroup here: {limits.cgroup_unavailable_reason()}")
    budget = 420 * 2**20
    spec = {"model": str(default_model_path), "ram_budget": budget, "batch": 4, "n_predict": 6,
            "teacher_forced": True, "prompt_tokens": 16, "session_kw": {"n_threads": 1, "n_ctx": 256}}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    lim = limits.run_limited([sys.executable, "-m", "epqlab.studies.batching_child", str(tmp_path / "spec.json"),
                              str(tmp_path / "out.json")], budget + 16 * 2**20, timeout_s=600)
    assert not lim.killed and lim.returncode == 0, (lim.reason, lim.stderr[-2000:])
    out = json.loads((tmp_path / "out.json").read_text())
    assert out["status"] == "PASS", out.get("reason")
    assert out["row"]["mean_batch"] == 4 and out["row"]["n_gen"] == 24
    assert out["memory"]["budget"] == budget and 0 < out["arena_bytes"] < budget
    assert lim.cgroup_peak is not None and lim.cgroup_peak <= budget + 16 * 2**20
