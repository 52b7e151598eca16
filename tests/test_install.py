"""epqlab installs like a Python package: the sdist that ``python -m build`` makes, installed with plain
``pip install`` (build isolation on: pyproject.toml's build requirements bring llama-cpp-python, from pip's
wheel cache once it was built on this machine) into a fresh venv, runs ``epqlab demo`` from a directory
outside the checkout; its engine module finds the *installed* llama_cpp's libraries through an
$ORIGIN-relative rpath and holds no path into pip's temporary build environment; the demo's paged tokens
equal plain llama.cpp's.

Slow by nature: a C++ compile in pip's build env and a venv of the dependencies (from pip's cache and the
index): 6.9 min on 2 busy cores (4 developers' tests at once), the compile most of it."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytest.importorskip("build")


def _run(cmd, **kw) -> subprocess.CompletedProcess:
    r = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, **kw)
    assert r.returncode == 0, f"{' '.join(map(str, cmd))} exited {r.returncode}:\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}"
    return r


@pytest.mark.slow
def test_sdist_installs_into_a_fresh_venv_and_runs_the_demo(tmp_path, default_model_path):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PIP_NO_BUILD_ISOLATION")}
    # the sdist needs only scikit-build-core, which this venv has (no isolated env: seconds saved)
    _run([sys.executable, "-m", "build", "--sdist", "--no-isolation", "--skip-dependency-check", "-o", tmp_path / "dist",
          ROOT], env=env)
    sdist, = (tmp_path / "dist").glob("epqlab-*.tar.gz")
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", venv], env=env)
    py = venv / "bin" / "python"
    _run([py, "-m", "pip", "install", "-q", sdist], env=env, cwd=tmp_path)  # isolated build (pip's default)
    site = Path(_run([py, "-c", "import epqlab, os; print(os.path.dirname(epqlab.__file__))"], env=env,
                     cwd=tmp_path).stdout.strip())
    assert site.is_relative_to(venv)  # the installed copy, not the checkout
    core, = site.glob("_core*.so")
    blob = core.read_bytes()
    assert b"$ORIGIN/../llama_cpp/lib" in blob and b"pip-build-env" not in blob and b"build-env" not in blob
    assert (site.parent / "llama_cpp" / "lib").is_dir()  # where that rpath points: the run-time dependency
    # the default model is the suite's (EPQLAB_CACHE or ~/.cache/epqlab), so the demo builds nothing
    r = _run([venv / "bin" / "epqlab", "demo", "-n", "8", "--threads", "1", "--n-ctx", "256"], env=env, cwd=tmp_path)
    row = [ln.split() for ln in r.stdout.splitlines() if ln.strip().startswith("same tokens")]
    assert row == [["same", "tokens", "yes"]], r.stdout
