"""Write-ups generated from results: ``papers/<NN>_<study>.md`` from ``<results_dir>/<NN>_<study>/*.json``
and the figures beside them (``epqlab report RESULTS_DIR --out papers/``).

Each paper has one section per results JSON: what was run (:mod:`epqlab.papers.provenance`), tables and the
reading (:mod:`epqlab.papers.studies`, computed from the JSON's rows by the library functions the notebooks
use) and the run's figures, copied to ``<out>/figures/<study>/`` and shrunk below 200 KB. Nothing in a paper is
typed by hand: regenerate it instead of editing it.
"""
from __future__ import annotations

import json
import os
import re
import shlex
from pathlib import Path

from ..results import atomic_path
from .markdown import figure
from .provenance import NOTEBOOKS, section
from .studies import STUDIES, study_of


def _title(study: str) -> str:
    """The notebook's first heading (``# 01 · Device I/O probe``), or the study name."""
    path = NOTEBOOKS / f"{study}.ipynb"
    if path.is_file():
        for cell in json.loads(path.read_text())["cells"]:
            if cell["cell_type"] == "markdown":
                first = "".join(cell["source"]).strip().splitlines()[0]
                if first.startswith("# "):
                    return first
                break
    return f"# {study}"


def _figures_of(json_path: Path, doc: dict) -> list[Path]:
    """PNG files of this run beside its JSON: ``<stem>.png`` and ``<stem>[-_]*.png``, plus any the JSON names."""
    d, stem = json_path.parent, json_path.stem
    found = {p for p in d.glob("*.png") if p.stem == stem or p.name.startswith((stem + "-", stem + "_"))}
    named = doc.get("figures")
    for f in (named.values() if isinstance(named, dict) else named or []):
        p = d / Path(str(f)).name
        if p.is_file():
            found.add(p)
    return sorted(found)


def _hand_command(study: str, doc: dict, json_path: Path) -> str | None:
    """For a CLI JSON that does not record its command line, the ``epqlab`` command its settings imply."""
    rows = doc.get("rows") or []
    q = shlex.quote
    if study == "03_least_stale":
        fr = sorted({r["arena_fraction"] for r in rows if r.get("arena_fraction") is not None})
        pol = list(dict.fromkeys(r["policy"] for r in rows))
        cmd = (f"epqlab ablate eviction {q(str(doc.get('model')))} --arenas {','.join(f'{x:g}' for x in fr)} "
               f"--policies {','.join(pol)} -n {doc.get('n_predict')} --repeats {doc.get('repeats')} "
               f"--warmup {doc.get('warmup')}")
        if doc.get("prompts"):
            cmd += f" --prompts {','.join(doc['prompts'])}"
        return cmd + f" --json {q(json_path.name)}"
    if study == "04_topk":
        p = doc.get("parameters") or {}
        kw = p.get("session_kw") or {}
        fr = sorted({float(m.group(1)) / 100 for r in rows
                     if (m := re.fullmatch(r"arena (\d+(?:\.\d+)?)%", str(r.get("point", ""))))})
        cmd = f"epqlab ablate topk {q(str(p.get('model')))} --ks {','.join(str(k) for k in p.get('ks') or [])}"
        if fr:
            cmd += f" --arenas {','.join(f'{x:g}' for x in fr)}"
        cmd += f" --texts {q(','.join(p.get('texts') or []))}"
        if p.get("prompts"):
            cmd += f" --prompts {','.join(p['prompts'])}"
        cmd += f" -n {p.get('n_predict')} --repeats {p.get('repeats')}"
        if kw.get("policy"):
            cmd += f" --policy {kw['policy']}"
        if kw.get("n_threads"):
            cmd += f" --threads {kw['n_threads']}"
        return cmd + f" --json {q(json_path.name)}"
    return None


def render_run(study: str, json_path: str | os.PathLike, out_dir: str | os.PathLike, heading: str) -> str:
    """One section of a paper: ``heading``, what was run, tables and reading, figures (copied under
    ``<out_dir>/figures/<study>/``) for the results JSON at ``json_path``."""
    json_path = Path(json_path)
    doc = json.loads(json_path.read_text())
    parts = [heading, section(doc, json_path, _hand_command(study, doc, json_path)), STUDIES[study](doc)]
    figs = [figure(p, Path(out_dir), f"figures/{study}", p.stem) for p in _figures_of(json_path, doc)]
    if figs:
        parts += ["**Figures.**", "\n\n".join(figs)]
    return "\n\n".join(parts) + "\n"


def write_papers(results_dir: str | os.PathLike, out_dir: str | os.PathLike = "papers",
                 extra: list | tuple = ()) -> list[str]:
    """Write ``<out_dir>/<study>.md`` for every study folder of ``results_dir`` that holds results JSON (one
    section per JSON, sorted by name), plus a section per file in ``extra`` (results JSON written by
    ``epqlab ablate ... --json`` and the like; the study is recognised from its content). Returns the paths
    of the papers written.

    Raises:
        FileNotFoundError: ``results_dir`` or a file in ``extra`` does not exist.
        ValueError: no results were found, or an ``extra`` file belongs to no known study.
    """
    results_dir, out_dir = Path(results_dir), Path(out_dir)
    if not results_dir.is_dir():
        raise FileNotFoundError(f"results folder {results_dir} does not exist; run the notebooks into it first "
                                f"(see papers/README.md)")
    runs: dict = {s: [(p, f"## Run `{p.stem}`") for p in sorted((results_dir / s).glob("*.json"))]
                  for s in STUDIES}
    for e in extra:
        e = Path(e)
        if not e.is_file():
            raise FileNotFoundError(f"extra results file {e} does not exist")
        study = study_of(json.loads(e.read_text()))
        if study is None:
            raise ValueError(f"{e} is not the results of a known study ({', '.join(STUDIES)}); pass the JSON "
                             f"a notebook or 'epqlab ablate|strict|probe --json' wrote")
        runs[study].append((e, f"## Hand run `{e.name}`"))
    if not any(runs.values()):
        raise ValueError(f"no results JSON under {results_dir}/<study>/ for any of {', '.join(STUDIES)}")
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for study, items in runs.items():
        if not items:
            continue
        body = [_title(study), f"Generated by `epqlab report` from {len(items)} results file(s); do not edit by "
                               f"hand (see README.md here to regenerate)."]
        body += [render_run(study, p, out_dir, h) for p, h in items]
        path = out_dir / f"{study}.md"
        with atomic_path(path) as tmp:  # whole or not at all
            Path(tmp).write_text("\n\n".join(body))
        written.append(str(path))
    return written


__all__ = ["write_papers", "render_run"]
