"""Run a notebook under papermill for a test and return the JSON it wrote.

The kernel is pinned to *this* interpreter: a throwaway kernelspec (``argv[0] = sys.executable``) is written to a
temporary folder put first on ``JUPYTER_PATH`` and selected by a unique name, so neither a user-installed
``python3`` kernelspec nor another environment's can run the notebook. Notebooks record ``sys.executable`` in
their JSON as ``python``, and :func:`run_notebook` checks it.
"""
from __future__ import annotations

import glob
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
NOTEBOOKS = REPO / "notebooks"
KERNEL_NAME = "epqlab-test-kernel"


def _kernelspec_dir(tmp_path: Path) -> Path:
    root = Path(tmp_path) / "jupyter"
    spec = root / "kernels" / KERNEL_NAME
    spec.mkdir(parents=True, exist_ok=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": f"epqlab tests ({sys.executable})",
        "language": "python",
        "env": {"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
                "MPLBACKEND": "Agg"},
    }))
    return root


def run_notebook(name: str, params: dict, tmp_path, cell_timeout: int = 600) -> dict:
    """Execute ``notebooks/<name>.ipynb`` with ``params`` (``results_dir`` defaults to ``tmp_path/results``,
    ``run_name`` to ``"test"``) and return the parsed ``<results_dir>/<name>/<run_name>.json``. The executed
    notebook is kept as ``tmp_path/<name>.out.ipynb`` for debugging. ``cell_timeout``: seconds one cell may run."""
    import papermill as pm

    tmp_path = Path(tmp_path)
    params = dict(params)
    params.setdefault("results_dir", str(tmp_path / "results"))
    params.setdefault("run_name", "test")
    params.setdefault("interactive", False)
    root = _kernelspec_dir(tmp_path)
    old = os.environ.get("JUPYTER_PATH")
    os.environ["JUPYTER_PATH"] = os.pathsep.join(filter(None, [str(root), old]))
    try:
        pm.execute_notebook(str(NOTEBOOKS / f"{name}.ipynb"), str(tmp_path / f"{name}.out.ipynb"),
                            parameters=params, kernel_name=KERNEL_NAME, cwd=str(REPO),
                            progress_bar=False, log_output=False, execution_timeout=cell_timeout)
    finally:
        if old is None:
            os.environ.pop("JUPYTER_PATH", None)
        else:
            os.environ["JUPYTER_PATH"] = old
    path = Path(params["results_dir"]) / name / f"{params['run_name']}.json"
    if not path.is_file():
        found = glob.glob(str(Path(params["results_dir"]) / name / "*.json"))
        raise AssertionError(f"notebook {name} wrote no {path} (found: {found})")
    result = json.loads(path.read_text())
    if "python" in result:
        assert os.path.realpath(result["python"]) == os.path.realpath(sys.executable), \
            f"notebook ran on {result['python']}, not {sys.executable}"
    return result
