"""Session: paged generation is bit-identical to plain llama.cpp at every budget, policy and I/O
thread count; hit counts equal an independent LRU simulation of the run's own route log; the
memory budget holds; bad input raises clear exceptions."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import epqlab
from epqlab.models import synthesize
from epqlab.routes import RouteLog
from refpager import RefPager

PROMPT = ("A CPU cache is a small, fast memory that sits between the processor and main memory. "
          "It keeps copies of recently used data so that the processor does not have to wait for "
          "the slower DRAM. Explain why caches work")
N_STEPS = 16
THREADS = 1


@pytest.fixture(scope="module")
def default_path():
    return epqlab.models.default_model(progress=False)


@pytest.fixture(scope="module")
def unaligned_path(tmp_path_factory):
    p = tmp_path_factory.mktemp("synth") / "tiny-unaligned.gguf"
    synthesize(p, "tiny", unaligned=True, progress=False)
    return p


def reference(path, tokens, **kw):
    with epqlab.Session(path, pager=False, n_threads=THREADS, **kw) as s:
        return s.greedy_trace(tokens, N_STEPS)


def budgets(layout):
    mn = epqlab.Pager.min_arena_bytes(layout)
    tot = epqlab.Pager.all_experts_bytes(layout)
    return {"all": tot, "quarter": max(mn, tot // 4), "min": mn}


def check_identical(path, policies, io_threads_list, n_ubatch=512, dense_modes=("anon",)):
    lay = epqlab.inspect(path)
    with epqlab.Session(path, pager=False, n_threads=THREADS) as s0:
        toks = s0.tokenize(PROMPT)
    assert len(toks) >= 32
    ref_prompt, ref_steps, ref_gen = reference(path, toks, n_ubatch=n_ubatch)
    assert np.isfinite(ref_prompt).all()
    seen = []
    runs = [(d, io) for d in dense_modes for io in io_threads_list[:1]] + [(dense_modes[0], io) for io in io_threads_list[1:]]
    for name, arena in budgets(lay).items():
        for policy in policies:
            for dense, io in runs:
                with epqlab.Session(path, arena_bytes=arena, policy=policy, io_threads=io, n_threads=THREADS,
                                    n_ubatch=n_ubatch, dense_weights=dense) as s:
                    p, st, gen = s.greedy_trace(toks, N_STEPS)
                    stats = s.stats
                key = (name, policy, dense, io)
                assert np.array_equal(p, ref_prompt), key
                assert np.array_equal(st, ref_steps), key
                assert gen == ref_gen, key
                assert stats["requests"] > 0
                assert stats["dense_weights"] == dense
                if name != "all":
                    assert stats["arena_bytes"] < epqlab.Pager.all_experts_bytes(lay)
                    assert stats["evictions"] > 0, key
                seen.append((name, stats["misses"], stats["staged_layers"]))
    return seen


@pytest.mark.parametrize("policy", ["lru", "ls", "ls_pos"])
def test_default_model_bit_identical(default_path, policy):
    # every dense-weight mode once (with LRU); the policies change only which experts are resident
    modes = ("anon", "mlock", "mmap") if policy == "lru" else ("anon",)
    seen = check_identical(default_path, [policy], [None, 1], dense_modes=modes)
    # the minimum arena cannot hold a whole prompt ubatch's experts: those layers are staged
    # matrix by matrix and are still identical
    assert any(name == "min" and fb > 0 for name, _, fb in seen)


def test_default_model_small_ubatch_pages_everything(default_path):
    # n_ubatch 4 keeps every (ubatch, layer) union within the quarter arena: nothing staged there
    seen = check_identical(default_path, ["lru"], [None], n_ubatch=4)
    assert all(fb == 0 for name, _, fb in seen if name in ("all", "quarter"))


def test_unaligned_synth_bit_identical(unaligned_path):
    lay = epqlab.inspect(unaligned_path)
    assert any(t.expert_bytes % 4096 for l in lay.layers for t in l.tensors)
    assert any(t.offset % 4096 for l in lay.layers for t in l.tensors)
    check_identical(unaligned_path, ["lru", "ls", "ls_pos"], [1, None], n_ubatch=8)


def test_greedy_text_identical_across_budgets(default_path):
    lay = epqlab.inspect(default_path)
    texts = []
    with epqlab.Session(default_path, pager=False, n_threads=THREADS) as s:
        texts.append(s.generate(PROMPT, 24).text)
    for arena in budgets(lay).values():
        with epqlab.Session(default_path, arena_bytes=arena, n_threads=THREADS) as s:
            texts.append(s.generate(PROMPT, 24).text)
    assert len(set(texts)) == 1 and texts[0].strip()


def test_hits_equal_lru_simulation_of_route_log(default_path, tmp_path):
    lay = epqlab.inspect(default_path)
    arena = budgets(lay)["quarter"]
    log_path = tmp_path / "routes.npz"
    n_ubatch = 4
    with epqlab.Session(default_path, arena_bytes=arena, n_ubatch=n_ubatch, n_threads=THREADS, route_log=log_path) as s:
        g = s.generate(PROMPT, 20)
        stats = s.stats
        classes = s.pager.stats["slot_classes"]
    log = RouteLog.load(log_path)
    experts, phase = log.experts, log.phase
    assert experts.shape == (len(g.prompt_tokens) + len(g.tokens) - 1, len(lay.layers), lay.n_expert_used)
    assert list(log.layers) == lay.moe_layers and log.n_expert == lay.n_expert
    assert (phase[:len(g.prompt_tokens)] == 0).all() and (phase[len(g.prompt_tokens):] == 1).all()
    # Independent LRU: each forward pass (llama.cpp ubatch, as logged) requests per layer the
    # sorted union of its tokens' experts, or a single token's experts in router order; the layer
    # being loaded is pinned, the previous one released.
    ub = epqlab.Pager.unit_slot_bytes(lay)
    ref = RefPager(ub, classes, "lru")
    ubatch = log.ubatch
    assert (np.diff(ubatch) >= 0).all()
    assert max(np.bincount(ubatch)[ubatch[: len(g.prompt_tokens)]]) <= n_ubatch
    ref.replay(experts, ubatch)
    assert stats["staged_layers"] == 0
    assert (stats["hits"], stats["misses"], stats["evictions"]) == (ref.hits, ref.misses, ref.evictions)


CHILD = r"""
import sys, json, epqlab
path, budget = sys.argv[1], sys.argv[2]
s = epqlab.Session(path, ram_budget=int(budget), n_threads=2, n_ctx=512)
print(json.dumps({"used": s.used_before_arena, "arena": s.pager.arena_bytes,
                  "read_buffers": s.memory_parts()["read_buffers"]}), flush=True)
g = s.generate("A CPU cache is a small, fast memory that", 16)
print(json.dumps({"misses": g.stats["misses"], "evictions": g.stats["evictions"], "n_gen": len(g.tokens)}), flush=True)
s.close()
"""


def run_child(path, budget, sample=True):
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(path), str(budget)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    peak = 0
    while proc.poll() is None:
        try:
            m = epqlab.memory.sample(proc.pid)
            peak = max(peak, m.total)
        except (FileNotFoundError, ProcessLookupError):
            break
        time.sleep(0.02)
    out, err = proc.communicate(timeout=600)
    return proc.returncode, out, err, peak


def test_peak_memory_stays_within_budget(default_path):
    lay = epqlab.inspect(default_path)
    # first learn what the process uses before the arena, with a generous budget
    rc, out, err, _ = run_child(default_path, 4 * 2**30)
    assert rc == 0, err
    first = json.loads(out.splitlines()[0])
    used, read_buffers = first["used"], first["read_buffers"]
    from epqlab.paging.pager import default_io_threads
    assert read_buffers == (default_io_threads() + 1) * epqlab.Pager.bounce_bytes()  # one per reader + the caller
    quarter = budgets(lay)["quarter"]
    budget = used + 64 * 2**20 + read_buffers + quarter
    rc, out, err, peak = run_child(default_path, budget)
    assert rc == 0, err
    first, second = (json.loads(l) for l in out.splitlines()[:2])
    assert first["arena"] < lay.routed_expert_bytes  # experts do not fit
    assert second["evictions"] > 0 and second["n_gen"] > 0
    assert 0 < peak <= budget, (peak, budget)


# ---- bad input -------------------------------------------------------------------------------

def test_missing_and_dense(tmp_path):
    with pytest.raises(epqlab.ModelNotFoundError):
        epqlab.Session(tmp_path / "missing.gguf")
    from epqlab.models.smollm2 import source_gguf

    with pytest.raises(epqlab.NotMoEError):
        epqlab.Session(source_gguf())


def test_budget_below_minimum_names_it(default_path):
    with pytest.raises(epqlab.ArenaTooSmall) as ei:
        epqlab.Session(default_path, ram_budget="64MiB", n_threads=THREADS)
    msg = str(ei.value)
    smallest = int(msg.split("smallest budget that works is ")[1].split(" bytes")[0])
    # the quote opens as given: in this process (which now holds more than before its first load) ...
    for _ in range(3):
        with epqlab.Session(default_path, ram_budget=smallest, n_threads=THREADS) as s:
            assert s.pager.arena_bytes >= epqlab.Pager.min_arena_bytes(s.layout)
            assert s.generate("Hello", 4).tokens
    # ... and in a fresh one
    code = (f"import epqlab; s = epqlab.Session({str(default_path)!r}, ram_budget={smallest}, n_threads=1); "
            "print(len(s.generate('Hello', 2).tokens))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "2", r.stderr[-2000:]


def test_expert_used_bounds_and_override(default_path, tmp_path):
    lay = epqlab.inspect(default_path)
    with pytest.raises(ValueError, match="expert_used"):
        epqlab.Session(default_path, expert_used=lay.n_expert + 1)
    with pytest.raises(ValueError, match="expert_used"):
        epqlab.Session(default_path, expert_used=0)
    k = max(1, lay.n_expert_used // 2)
    with epqlab.Session(default_path, expert_used=k, n_threads=THREADS, route_log=tmp_path / "r.npz") as s:
        s.generate("Hello there", 3)
    assert RouteLog.load(tmp_path / "r.npz").k == k
    with epqlab.Session(default_path, expert_used=k, pager=False, n_threads=THREADS) as a, \
            epqlab.Session(default_path, expert_used=k, n_threads=THREADS, arena_bytes=epqlab.Pager.min_arena_bytes(lay, k)) as b:
        toks = a.tokenize(PROMPT)
        assert np.array_equal(a.logits(toks), b.logits(toks))


def test_model_shrunk_while_open(unaligned_path, tmp_path):
    p = tmp_path / "copy.gguf"
    shutil.copy(unaligned_path, p)
    lay = epqlab.inspect(p)
    last = lay.layers[-1].tensors[-1]
    assert last.offset + last.n_bytes == p.stat().st_size  # experts are the file's tail: safe to cut
    with epqlab.Session(p, arena_bytes=epqlab.Pager.min_arena_bytes(lay), n_threads=THREADS) as s:
        s.generate("Hi", 2)
        os.truncate(p, last.offset + last.expert_bytes)  # only expert 0 of the last tensor remains
        # refused before any byte of the changed file is read (the pager's own short-read path is
        # covered in test_pager with a file truncated before the pager opened it)
        with pytest.raises(epqlab.ModelChangedError, match="changed on disk"):
            s.generate("The quick brown fox jumps over the lazy dog", 8)
        with pytest.raises(epqlab.ModelChangedError):
            s.logits([1, 2, 3])
    with pytest.raises(epqlab.EpqlabError, match="closed"):
        s.logits([1, 2, 3])


def test_closed_session_raises(default_path):
    s = epqlab.Session(default_path, n_threads=THREADS)
    s.close()
    with pytest.raises(epqlab.EpqlabError, match="closed"):
        s.generate("x", 1)


def test_stats_and_stats_file(default_path, tmp_path):
    sf = tmp_path / "stats.jsonl"
    with epqlab.Session(default_path, arena_bytes=budgets(epqlab.inspect(default_path))["quarter"],
                        n_threads=THREADS, stats_file=sf) as s:
        g1 = s.generate(PROMPT, 8)
        g2 = s.chat([{"role": "user", "content": "What is a CPU cache?"}], n_predict=8)
        df = s.stats_frame()
        cum = s.stats
    rows = [json.loads(l) for l in sf.read_text().splitlines()]
    assert len(rows) == 2 == len(df)
    for r, g in zip(rows, (g1, g2)):
        assert r["n_gen"] == len(g.tokens) and r["n_prompt"] == len(g.prompt_tokens)
        assert r["hits"] + r["misses"] == r["requests"]
        assert r["hit_rate"] == pytest.approx(r["hits"] / r["requests"])
        assert r["ssd_bytes_per_token"] == pytest.approx(r["ssd_bytes"] / (r["n_prompt"] + r["n_gen"]))
    assert cum["requests"] == rows[0]["requests"] + rows[1]["requests"]


def test_cli_run_and_demo(default_path, tmp_path):
    env = dict(os.environ)
    r = subprocess.run([sys.executable, "-m", "epqlab", "run", str(default_path), "-p", "Hello", "-n", "6",
                        "--ram-budget", "4GiB", "--stats-file", str(tmp_path / "s.jsonl")],
                       capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr
    assert "hit rate" in r.stdout and "decode" in r.stdout
    r = subprocess.run([sys.executable, "-m", "epqlab", "demo", "-n", "6"], capture_output=True, text=True,
                       timeout=600, env=env)
    assert r.returncode == 0, r.stderr
    assert "arena" in r.stdout and "evictions" in r.stdout
    # the header's share of the experts and the table's agree: slots against one per routed expert
    import re

    lay = epqlab.inspect(default_path)
    head = int(re.search(r"\((\d+)% of the bytes that give every expert a slot\)", r.stdout).group(1))
    row = next(l for l in r.stdout.splitlines() if l.startswith("arena "))
    n, total, pct = map(int, re.search(r"\((\d+) of (\d+) expert slots \((\d+)%\)\)", row).groups())
    assert total == len(lay.layers) * lay.n_expert
    assert n == sum(int(c) for c in re.findall(r"(\d+) x [\d.]+ [KMG]iB", row))
    assert pct == round(100 * n / total) and abs(pct - head) <= 1
    r = subprocess.run([sys.executable, "-m", "epqlab", "run", str(tmp_path / "nope.gguf")], capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 1 and "not found" in r.stderr and "Traceback" not in r.stderr


def test_arena_share_counts_slots(tiny_gguf):
    """``epqlab run``'s arena line counts slots against one per routed expert: a full arena on the tiny model
    is 100% (bytes against the experts' own bytes said 107%: slots are sized by class)."""
    from epqlab.commands.run import arena_share

    lay = epqlab.inspect(tiny_gguf)
    total = len(lay.layers) * lay.n_expert
    with epqlab.Session(tiny_gguf, arena_bytes=epqlab.Pager.all_experts_bytes(lay), n_threads=1) as s:
        assert arena_share(s) == f"{total} of {total} expert slots (100%)"


def test_bad_tokens_and_context_overflow(default_path):
    with epqlab.Session(default_path, n_threads=THREADS, n_ctx=256) as s:
        with pytest.raises(ValueError, match="no tokens"):
            s.logits([])
        with pytest.raises(ValueError, match="token ids"):
            s.logits([s.n_vocab])
        with pytest.raises(ValueError, match="n_ctx"):
            s.generate("word " * (s.n_ctx + 10), 4)
        assert s.generate("word " * (s.n_ctx // 2), 2).tokens  # decoded in n_batch chunks
        with pytest.raises(ValueError, match="empty prompt"):
            s.generate("", 4, add_special=False)
        assert s.generate("Hello", 0).tokens == []
        assert s.generate("Hello", 3).tokens  # still usable


def test_bad_arguments_are_clean_errors(default_path):
    with pytest.raises(ValueError, match="io_threads"):
        epqlab.Session(default_path, io_threads=-3)
    with epqlab.Session(default_path, n_threads=THREADS) as s:
        with pytest.raises(ValueError, match="n_predict"):
            s.generate("Hello", -1)
        for bad in ("hello", [{"role": "user"}], []):
            with pytest.raises(ValueError, match="messages"):
                s.chat(bad)
    for args in (["--ram-budget", "abc"], ["--expert-used", "0"], ["--n-ctx", "0"], ["--io-threads", "0"]):
        r = subprocess.run([sys.executable, "-m", "epqlab", "run", str(default_path), "-n", "2", *args],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == (2 if args[0] == "--n-ctx" else 1) and "epqlab: error:" in r.stderr and "Traceback" not in r.stderr, (args, r.stderr)
