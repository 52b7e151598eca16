"""Fuzzing with hypothesis: GGUF headers with mutated counts, value types, string and array
lengths, string bytes, tensor dims, types and offsets (and truncations) never crash
``epqlab.inspect`` or ``epqlab.Session``: each mutant raises an epqlab error (or runs). Before
these checks, a ``block_count`` of 0 aborted the process inside llama.cpp (GGML_ASSERT) on the
first mutant. The
hypothesis loop runs in a child process (tests/fuzz_gguf.py), so a signal (SIGSEGV, a
GGML_ASSERT abort) fails this test with the mutant that caused it instead of killing pytest.
Examples are derandomized (the same mutants every run) and few, to stay well under a minute.

``test_fuzz_loader_sample`` runs 40 fixed-seed mutants of bench/fuzz_loader.py (tokenizer arrays, type tags,
boundary values; each inspect + Session + decode in a forked child), the CI slice of its >= 1,000-mutant runs."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest


HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def base(mini_gguf):
    """The tiny MoE with a 512-token vocabulary: a 15 KiB header llama.cpp still loads and runs."""
    return mini_gguf


@pytest.mark.parametrize("mode,n", [("inspect", 300), ("session", 100)])
def test_mutated_headers_never_crash(base, tmp_path, mode, n):
    r = subprocess.run([sys.executable, str(HERE / "fuzz_gguf.py"), mode, str(base), str(tmp_path), str(n)],
                       capture_output=True, text=True, errors="replace", timeout=600,
                       env={**os.environ, "PYTHONPATH": str(HERE)})
    tried = [line for line in r.stderr.splitlines() if line.startswith("[fuzz] m")]
    if r.returncode < 0:
        pytest.fail(f"{mode}: killed by {signal.Signals(-r.returncode).name} on mutant {tried[-1] if tried else '?'}")
    assert r.returncode == 0, r.stderr[-4000:]
    assert "fuzz ok" in r.stderr
    assert len(tried) >= n  # hypothesis ran at least the asked examples (it may add shrink attempts)


@pytest.fixture(scope="module")
def fuzz_loader():
    import importlib.util

    path = HERE.parent / "bench" / "fuzz_loader.py"
    spec = importlib.util.spec_from_file_location("fuzz_loader", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow
def test_fuzz_loader_sample(fuzz_loader, mini_gguf, tmp_path):
    """A fixed-seed sample of bench/fuzz_loader.py: 40 mutants of the two bases (header bytes, integer fields,
    type tags, array lengths, tokenizer arrays, truncation), each inspect + Session + a 2-token decode in a forked
    child. No child dies by a signal or hangs, and some mutants get past inspect into llama.cpp (the sample
    exercises the loader, not only inspect)."""
    bases = fuzz_loader.make_bases(tmp_path, mini=mini_gguf)
    recs = fuzz_loader.fuzz(bases, 40, seed=0, workdir=tmp_path, timeout=120)
    bad = [r for r in recs if fuzz_loader.is_failure(r)]
    assert not bad, "\n".join(f"{r['class']}: {'; '.join(r['mutations'])} | {r['stderr']}" for r in bad)
    assert len(recs) == 40
    assert sum(r["stage"] in ("load", "decode", "done") for r in recs) >= 5, fuzz_loader.summary(recs)
