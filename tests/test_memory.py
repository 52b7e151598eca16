"""Honest memory: the load reads only what it keeps, dense weights leave the page cache, and one
RAM budget bounds the whole process -- checked by a hard cgroup limit that charges page cache.

Expected values come from outside the code under test: the file's own tensor table (gguf-py) for
the bytes a load may read, mincore(2) for page-cache residency, the kernel's cgroup counters for
memory, and plain llama.cpp (pager=False, stock mmap load) for logits and text.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import epqlab
import epqlab.models
from epqlab.memory import drop_page_cache, page_cache_bytes

MiB = 2**20
EVAL_TEXT = (Path(epqlab.__file__).parent / "data" / "eval_execmodel.txt").read_text()


@pytest.fixture(scope="module")
def private_model(tmp_path_factory):
    """A private copy of the default model (other processes may read the shared cache's copy)."""
    src = epqlab.models.default_model(progress=False)
    dst = tmp_path_factory.mktemp("mem") / "model.gguf"
    shutil.copyfile(src, dst)
    return dst


def test_lazy_load_relocations_found():
    # Fails loudly after a llama.cpp upgrade that moves mmap/posix_madvise out of libllama's PLT.
    from epqlab.engine.native import core

    assert core.lazy_load_check() == ""


def test_anon_load_reads_only_dense_bytes(private_model):
    lay = epqlab.inspect(private_model)
    dense_bytes = sum(n for _, _, n in lay.dense_tensors)
    assert dense_bytes == lay.non_expert_bytes
    drop_page_cache(private_model)
    assert page_cache_bytes(private_model) < MiB
    with epqlab.Session(private_model, dense_weights="anon", n_threads=1) as s:
        cached = page_cache_bytes(private_model, lay.data_offset)
        rep = s.load_report
        logits = s.logits(s.tokenize("The cache"))[-1]
    assert cached < MiB, f"{cached} bytes of tensor data left in the page cache"
    assert rep["lazy_load"] and rep["populates_stripped"] >= 1
    assert rep["load_bytes_read"] is not None
    assert rep["load_bytes_read"] <= dense_bytes + lay.data_offset + MiB, rep
    # the dense copies hold every dense byte (whole pages, so at least that many)
    assert dense_bytes <= rep["dense_bytes"] <= dense_bytes + 2 * 4096 * len(lay.dense_tensors)
    with epqlab.Session(private_model, pager=False, n_threads=1) as s0:
        ref = s0.logits(s0.tokenize("The cache"))[-1]
    assert np.array_equal(logits, ref)


def test_mmap_load_reads_the_whole_file(private_model):
    # The same measurement sees the stock loader's whole-file read, so the test above can fail.
    drop_page_cache(private_model)
    with epqlab.Session(private_model, dense_weights="mmap", n_threads=1, pager=True) as s:
        rep = s.load_report
    size = os.path.getsize(private_model)
    assert not rep["lazy_load"]
    assert rep["load_bytes_read"] >= 0.9 * size


def test_mlock_refused_names_the_limit(private_model):
    # Without CAP_IPC_LOCK and with RLIMIT_MEMLOCK at 64 KiB, mlock of the dense weights fails.
    if shutil.which("setpriv") is None:
        pytest.skip("setpriv (util-linux) is not installed")
    code = ("import epqlab, sys\n"
            "try:\n"
            f"    epqlab.Session({str(private_model)!r}, dense_weights='mlock', n_threads=1)\n"
            "except epqlab.EpqlabError as e:\n"
            "    print('ERR', e); sys.exit(3)\n")
    cmd = ["prlimit", "--memlock=65536:65536", "setpriv", "--inh-caps=-ipc_lock", "--bounding-set=-ipc_lock",
           sys.executable, "-c", code]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 3, r.stdout + r.stderr
    assert "RLIMIT_MEMLOCK is 65536 bytes" in r.stdout and "anon" in r.stdout


def test_untouched_buffers_counted_wherever_dense_weights_live(private_model):
    """What the budget counts before the arena includes llama.cpp's malloc'd but untouched buffers (the compute
    buffer of a 2048-token ubatch is touched only by the first prompt that long). Its estimate must not depend on
    where the dense weights live: anonymous pages (mapped outside malloc) or the file's page cache. Subtracting the
    anonymous dense pages from malloc's RSS growth is what makes the two agree (without it, anon came out lower by
    the dense bytes, ~120 MiB here, and a Laguna-S prefill at 4 GiB outgrew its budget)."""
    got = {}
    for mode in ("anon", "mmap"):
        with epqlab.Session(private_model, ram_budget=2 * 2**30, n_threads=2, n_ctx=4096, n_ubatch=2048,
                            n_batch=2048, dense_weights=mode) as s:
            m = s.memory_parts()
            got[mode] = (m["used_before_arena"] - m["now"]["total"], m["dense"])
            # the scheduler's split-input buffer (docs/DESIGN.md §5) is never touched, so it is not counted
            assert s.load_report["sched_idle_bytes"] > 0
    assert got["anon"][1] > 64 * MiB and got["mmap"][1] == 0
    assert got["mmap"][0] > 48 * MiB  # the ubatch's compute buffer (~63 MiB here), not yet touched
    assert abs(got["anon"][0] - got["mmap"][0]) < 16 * MiB, got


# -- one budget under a hard limit -----------------------------------------------------------------

def _own_memory_cgroup() -> Path | None:
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, ctrl, path = line.split(":", 2)
            if "memory" in ctrl.split(","):
                p = Path("/sys/fs/cgroup/memory") / path.lstrip("/")
                return p if os.access(p, os.W_OK) else None
    except OSError:
        return None
    return None


CHILD = r"""
import json, sys, epqlab
path, budget, prompt_file, n, log = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), sys.argv[5]
prompt = open(prompt_file).read()
# route recording decodes the prompt with logits for every token: memory must stay bounded too
s = epqlab.Session(path, ram_budget=budget, n_threads=2, n_ctx=512, route_log=log)
print(json.dumps({"arena": s.pager.arena_bytes, "memory": s.memory_parts()}), flush=True)
if n == 0:
    sys.exit(0)
g = s.generate(prompt, n)
ppl = s.perplexity(prompt, n_ctx=128)
print(json.dumps({"text": g.text, "staged_layers": g.stats["staged_layers"], "ppl": ppl,
                  "lent": g.stats["stage_lent_bytes"], "stage_reserve": s.stage_reserve,
                  "peak_total": s.stats["peak_total"]}), flush=True)
s.close()
"""


def run_in_cgroup(cg_parent: Path, limit: int, args: list[str]):
    cg = cg_parent / f"epqlab-test-{os.getpid()}"
    cg.mkdir()
    try:
        (cg / "memory.limit_in_bytes").write_text(str(limit))

        def enter():
            (cg / "cgroup.procs").write_text(str(os.getpid()))

        r = subprocess.run([sys.executable, "-c", CHILD, *args], capture_output=True, text=True, timeout=900,
                           preexec_fn=enter)
        peak = int((cg / "memory.max_usage_in_bytes").read_text())
        oom = (cg / "memory.oom_control").read_text()
        return r, peak, oom
    finally:
        cg.rmdir()


@pytest.mark.slow
def test_budget_holds_under_a_cgroup_limit(private_model, tmp_path):
    cg_parent = _own_memory_cgroup()
    if cg_parent is None:
        pytest.skip("no writable memory cgroup (v1) for this process: cannot enforce a hard limit here")
    lay = epqlab.inspect(private_model)
    prompt = tmp_path / "prompt.txt"
    prompt.write_text(EVAL_TEXT[:1100])  # ~250 tokens: prompt ubatches overflow a small arena
    with epqlab.Session(private_model, pager=False, n_threads=2, n_ctx=512) as s0:
        assert 200 < len(s0.tokenize(prompt.read_text())) < 500
        ref = s0.generate(prompt.read_text(), 12)
        ref_ppl = s0.perplexity(prompt.read_text(), n_ctx=128)
    # learn what the process holds before the arena (load only), with a generous budget
    r, _, _ = run_in_cgroup(cg_parent, 8 * 2**30, [str(private_model), str(4 * 2**30), str(prompt), "0", str(tmp_path / "r0.npz")])
    assert r.returncode == 0, r.stderr
    mem = json.loads(r.stdout.splitlines()[0])["memory"]
    all_experts = epqlab.Pager.all_experts_bytes(lay)
    fixed = mem["used_before_arena"] + mem["reserve"] + mem["read_buffers"]
    assert mem["read_buffers"] > 0  # the readers' bounce buffers are part of the budget
    # No staging buffer beside the arena: a staged matrix borrows the arena's pages (pager.h, lend), so the
    # smallest arena is the larger of one layer's top-k and one expert matrix's span.
    smallest = max(epqlab.Pager.min_arena_bytes(lay), epqlab.Pager.max_stage_bytes(lay))
    for frac in (0.25, 0.0):  # arena ~25% of the experts; then the minimum (prompt layers are staged)
        # +2 MiB: what two children measure before the arena differs by (heap, thread stacks)
        budget = fixed + max(smallest, int(frac * all_experts)) + 2 * MiB
        limit = budget + 16 * MiB
        r, peak, oom = run_in_cgroup(cg_parent, limit, [str(private_model), str(budget), str(prompt), "12", str(tmp_path / "r.npz")])
        assert r.returncode == 0, (frac, r.returncode, r.stderr[-2000:], oom)
        first, last = (json.loads(x) for x in r.stdout.splitlines()[:2])
        assert first["arena"] < all_experts / 2
        assert last["text"] == ref.text, frac
        assert last["ppl"] == ref_ppl, frac
        assert peak <= limit and "oom_kill 0" in oom
        assert last["peak_total"] <= budget, (last["peak_total"], budget)
        assert last["stage_reserve"] == 0
        if frac == 0.0:
            assert last["staged_layers"] > 0
            assert last["lent"] > 0  # the staged pages came out of the arena, inside the cgroup limit
