"""The "what was run" part of a paper: date, machine, model file and its SHA-256, parameters, and the command
that reproduces the run, all taken from the results JSON (its ``run`` block, :func:`epqlab.results.run_info`)."""
from __future__ import annotations

import datetime
import json
import os
import shlex
from pathlib import Path

from ..results import file_sha256
from ..units import fmt_bytes

NOTEBOOKS = Path(__file__).resolve().parent.parent.parent / "notebooks"

_HASHES: dict = {}  # (path, size, mtime) -> sha256, so one report hashes each model file once


def _model_path(doc: dict) -> str | None:
    run = doc.get("run") or {}
    for p in (run.get("model_path"), (doc.get("parameters") or {}).get("model"), doc.get("model"),
              (doc.get("notebook_parameters") or {}).get("model")):
        if isinstance(p, str) and p:
            return p
    return None


def model_lines(doc: dict) -> list[str]:
    """Bullet lines naming the model file, its size and SHA-256. The hash comes from the JSON's ``run`` block;
    for an older JSON without one it is computed now from the file if it exists (and said so)."""
    run = doc.get("run") or {}
    path = _model_path(doc)
    if path is None:
        return ["- model: none (the run read no model file)"]
    sha, size, note = run.get("model_sha256"), run.get("model_bytes"), ""
    if sha is None and os.path.isfile(path):
        st = os.stat(path)
        key = (os.path.abspath(path), st.st_size, st.st_mtime)
        if key not in _HASHES:
            _HASHES[key] = file_sha256(path)
        sha, size, note = _HASHES[key], st.st_size, " (hashed when this report was written; the JSON has no hash)"
    out = [f"- model: `{path}`" + (f" ({fmt_bytes(size)}, {size} bytes)" if size is not None else "")]
    out.append(f"- model SHA-256: `{sha}`{note}" if sha else "- model SHA-256: not recorded, file absent")
    return out


def machine_lines(doc: dict, json_path: Path) -> list[str]:
    """Bullet lines for the date, machine, Python and epqlab version of the run (or say they were not recorded,
    giving the JSON file's modification time instead of a date)."""
    run = doc.get("run") or {}
    if not run:
        mtime = datetime.datetime.fromtimestamp(json_path.stat().st_mtime, datetime.timezone.utc)
        return [f"- date: not recorded (results file written {mtime.isoformat(timespec='seconds')})",
                "- machine: not recorded in the JSON"]
    m = run.get("machine") or {}
    out = [f"- date: {run.get('date')}"]
    if m:
        out.append(f"- machine: {m.get('cpu')}, {m.get('physical_cpus')} cores / {m.get('logical_cpus')} threads, "
                   + (f"{fmt_bytes(m['ram_bytes'])} RAM" if m.get("ram_bytes") else "RAM not recorded") + f", {m.get('platform')}")
    out.append(f"- Python {run.get('python_version')}, epqlab {run.get('epqlab')}")
    return out


def notebook_parameter_names(notebook: str) -> list[str] | None:
    """Names assigned in the cell tagged ``parameters`` of ``notebooks/<notebook>.ipynb`` (parsed with
    :mod:`ast`; papermill's own inspection misreads comments holding ``:`` or ``;``), or None when the notebook
    is not in this tree."""
    import ast

    path = NOTEBOOKS / f"{notebook}.ipynb"
    if not path.is_file():
        return None
    for cell in json.loads(path.read_text())["cells"]:
        if "parameters" in cell.get("metadata", {}).get("tags", []):
            tree = ast.parse("".join(cell["source"]))
            return [t.id for node in tree.body if isinstance(node, ast.Assign) for t in node.targets
                    if isinstance(t, ast.Name)]
    return None


def parameters(doc: dict) -> dict:
    """The run's parameters as the JSON holds them (notebook 04 keeps them as ``notebook_parameters``)."""
    if doc.get("notebook_parameters") or doc.get("parameters"):
        return dict(doc.get("notebook_parameters") or doc["parameters"])
    return {k: v for k, v in doc.items() if k not in ("rows", "run", "reading", "figures", "simulate")}


def reproduce_command(doc: dict, json_path: Path, hand_command: str | None = None) -> str:
    """The command that reproduces the run: papermill with the notebook's parameters (only names the notebook's
    ``parameters`` cell has) for a notebook run; the recorded command line for a CLI run; else
    ``hand_command`` (reconstructed from the settings by the caller)."""
    nb = doc.get("notebook")
    if nb:
        names = notebook_parameter_names(nb)
        params = parameters(doc)
        if names is not None:
            params = {k: v for k, v in params.items() if k in names}
            if "run_name" in names:
                params["run_name"] = doc.get("run_name") or json_path.stem
        return (f"papermill notebooks/{nb}.ipynb {nb}.out.ipynb -p results_dir results "
                f"-y {shlex.quote(json.dumps(params))}")
    argv = (doc.get("run") or {}).get("argv")
    if argv:
        prog = Path(argv[0]).name
        return " ".join(shlex.quote(a) for a in (["epqlab" if prog in ("epqlab", "__main__.py") else argv[0]]
                                                  + list(argv[1:])))
    return hand_command or "(not recorded)"


def section(doc: dict, json_path: Path, hand_command: str | None = None) -> str:
    """The "What was run" Markdown block of one results JSON."""
    cmd = reproduce_command(doc, json_path, hand_command)
    recorded = bool(doc.get("notebook") or (doc.get("run") or {}).get("argv"))
    lines = ["**What was run.**", "", f"- results file: `{json_path.name}`"]
    lines += machine_lines(doc, json_path) + model_lines(doc)
    if doc.get("elapsed_s") is not None:
        lines.append(f"- wall time: {doc['elapsed_s']:.0f} s")
    lines += ["", "Parameters:", "", "```json", json.dumps(parameters(doc), indent=1, default=str), "```", "",
              "Reproduce" + ("" if recorded else " (command reconstructed from the JSON's settings: the file does "
                                                  "not record its command line)") + ":", "", "```", cmd, "```"]
    return "\n".join(lines)


__all__ = ["section", "reproduce_command", "model_lines", "machine_lines", "parameters", "notebook_parameter_names"]
