"""The papermill command lines the docs give (README.md's notebook section, each notebook's intro, papers/README.md)
work as written.

Fast: each line runs through papermill's own command line (its click command, in this process) with ``--prepare-only`` (papermill parses ``-p``/``-y``
and injects the parameters cell, without a kernel), and the injected values must be parameters the notebook
declares, of the kind its defaults are (a list where the default is a list: ``-p arenas '[...]'`` arrived as the
string "[..."), with no "Passed unknown parameter" warning. Slow: each README line is executed as written, in a
folder where ``model.gguf`` is the default model, with tiny parameters added after it (a later ``-y``; keys the
line sets are never overridden, so the line's own values are the ones that run)."""
from __future__ import annotations

import ast
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from notebooks import KERNEL_NAME, NOTEBOOKS, REPO, _kernelspec_dir

pytest.importorskip("papermill")

_LINE = re.compile(r"^(?:\.venv/bin/)?papermill notebooks/\S+\.ipynb .*$")


def _lines(text: str) -> list[str]:
    return [m.group(0).strip() for l in text.splitlines() if (m := _LINE.match(l.strip()))]


README_LINES = _lines((REPO / "README.md").read_text())
DOC_LINES = README_LINES + sorted({l for p in [REPO / "papers" / "README.md", *NOTEBOOKS.glob("*.ipynb")]
                    for l in _lines("".join("".join(c["source"]) + "\n" for c in json.loads(p.read_text())["cells"]
                                            if c["cell_type"] == "markdown") if p.suffix == ".ipynb"
                                    else p.read_text())})


def _args(line: str) -> list[str]:
    argv = shlex.split(line)
    assert argv[0].endswith("papermill"), line
    return argv[1:]


def _parameters(cells) -> dict:
    """name -> value of a parameters cell's assignments (literals only, as the notebooks write them)."""
    out = {}
    for c in cells:
        for node in ast.parse("".join(c["source"])).body:
            if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
                out[node.targets[0].id] = ast.literal_eval(node.value)
    return out


def _tagged(nb: dict, tag: str) -> list:
    return [c for c in nb["cells"] if tag in c.get("metadata", {}).get("tags", [])]


def _prepare(line: str, cwd: Path, caplog=None) -> tuple[dict, dict]:
    """Run ``line`` through papermill's command line (click, in this process) with --prepare-only, writing to
    ``cwd``: (the notebook's defaults, the injected values)."""
    from click.testing import CliRunner
    from papermill.cli import papermill

    args = _args(line)
    out = cwd / "prepared.ipynb"
    args[1] = str(out)
    old = os.getcwd()
    os.chdir(REPO)
    try:
        r = CliRunner().invoke(papermill, [*args, "--prepare-only"], catch_exceptions=False)
    finally:
        os.chdir(old)
    assert r.exit_code == 0, f"{line}\n{r.output[-3000:]}"
    nb = json.loads(out.read_text())
    return _parameters(_tagged(nb, "parameters")), _parameters(_tagged(nb, "injected-parameters"))


def _same_kind(default, value) -> bool:
    if default is None or value is None:  # None is a documented value of these notebooks' parameters
        return True
    if isinstance(default, bool):
        return isinstance(value, bool)
    if isinstance(default, (int, float)):
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if isinstance(default, (list, tuple)):
        return isinstance(value, (list, tuple))
    return isinstance(value, type(default))


def test_docs_have_papermill_lines():
    names = {_args(l)[0].split("/")[-1] for l in README_LINES}
    assert names == {p.name for p in NOTEBOOKS.glob("*.ipynb")}, "the README gives one line per notebook"


@pytest.mark.parametrize("line", DOC_LINES, ids=lambda l: _args(l)[0].split("/")[-1][:2] + ":" + " ".join(_args(l)[2:])[:60])
def test_documented_line_parses(line, tmp_path, caplog):
    defaults, injected = _prepare(line, tmp_path)
    assert injected, f"{line}: papermill injected no parameters"
    assert "unknown parameter" not in caplog.text.lower(), caplog.text
    for name, value in injected.items():
        assert name in defaults, f"{line}: {name} is not a parameter of the notebook"
        assert not (isinstance(value, str) and value.lstrip()[:1] in ("[", "{")), \
            f"{line}: {name} arrived as the string {value!r}: lists and dicts go through -y (papermill's -p passes strings)"
        assert _same_kind(defaults[name], value), \
            f"{line}: {name} = {value!r} ({type(value).__name__}), the default is {defaults[name]!r}"


# Parameters that make each notebook's README line quick (seconds), added after the line as one more -y.
TINY = {
    "01_io_probe": {"sizes": [4096, 65536], "concurrency": [1, 2], "n_requests": 4},
    "02_route_overlap": {},
    "03_least_stale": {"policies": ["lru", "fnu"], "prompt_ids": ["code-fib"], "n_predict": 4, "warmup": 1},
    "04_topk": {"texts": ["prose"], "text_chars": 300, "ppl_n_ctx": 64, "prompts": ["code-fib"], "n_predict": 3,
                "repeats": 1, "tau_text_chars": 200, "session_kw": {"n_ctx": 256}},
    "05_memory_levels": {"n_predict": 2, "repeats": 1, "mmap_baseline": False},
    "06_batching": {"n_predict": 3, "prompt_tokens": 8, "spec_ns": [2], "spec_tokens": 64},
    "07_lossy_knobs": {"arenas": [0.5], "ks": [2], "taus": [0.3], "adaptive": [True], "texts": ["prose"],
                       "text_chars": 120, "ppl_n_ctx": 32},
    "08_plan": {"n": 16, "verify": False},
}


# Notebooks whose execution under papermill a study test already covers (with its own checks of the results):
# their README lines are checked by test_documented_line_parses above (every parameter declared, of its kind), and
# running them again here would execute the same notebook twice in CI.
EXECUTED_ELSEWHERE = {
    "03_least_stale": "tests/test_eviction.py::test_notebook_03_defaults",
    "04_topk": "tests/test_topk.py::test_notebook_04_small_grid",
    "05_memory_levels": "tests/test_strict.py::test_notebook_05_two_levels",
    "06_batching": "tests/test_batch.py::test_batching_notebook",
    "07_lossy_knobs": "tests/test_lossy_study.py::test_notebook_07_small",
    "08_plan": "tests/test_plan.py::test_notebook_08_defaults",
}


def test_executed_elsewhere_names_real_tests():
    for name, test in EXECUTED_ELSEWHERE.items():
        path, func = test.split("::")
        assert f"def {func}(" in (REPO / path).read_text(), test
        assert (NOTEBOOKS / f"{name}.ipynb").is_file()


@pytest.mark.slow
@pytest.mark.parametrize("line", [l for l in README_LINES if Path(_args(l)[0]).stem not in EXECUTED_ELSEWHERE],
                         ids=lambda l: _args(l)[0].split("/")[-1][:2])
def test_readme_line_runs(line, tmp_path, default_model_path):
    """The line itself, from a folder holding ``notebooks/`` and a ``model.gguf`` (the default model), plus the
    tiny parameters; the results JSON must carry the line's own values."""
    args = _args(line)
    name = Path(args[0]).stem
    _, given = _prepare(line, tmp_path)
    tiny = {k: v for k, v in TINY.get(name, {}).items() if k not in given}
    (tmp_path / "notebooks").symlink_to(NOTEBOOKS)
    (tmp_path / "model.gguf").symlink_to(default_model_path)
    env = {**os.environ, "JUPYTER_PATH": os.pathsep.join(filter(None, [str(_kernelspec_dir(tmp_path)),
                                                                        os.environ.get("JUPYTER_PATH")])),
           "MPLBACKEND": "Agg"}
    extra = ["-y", json.dumps({**tiny, "run_name": "readme"}), "-k", KERNEL_NAME]
    r = subprocess.run([sys.executable, "-m", "papermill", *args, *extra], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"{line}\n{r.stderr[-4000:]}"
    doc = json.loads((tmp_path / "results" / name / "readme.json").read_text())
    params = doc.get("parameters") or {}
    for k, v in given.items():
        if k == "model":
            assert (tmp_path / params[k]).resolve() == Path(default_model_path).resolve()  # relative to the run
        elif k in params:
            assert params[k] == v, (k, params[k], v)
