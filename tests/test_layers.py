"""epqlab's rooms and the one direction of their imports (docs/DESIGN.md §1), read from the source with
``ast``: every import of an epqlab module, at module level or inside a function, must go to the same room or
downhill; module-level imports form no cycle; imports inside functions are only the native loaders (the
engine and the pager extension load on first use, so ``import epqlab`` stays light) and third-party packages;
``paging/`` (and everything below it) never imports ``llama_cpp``.

    entry points (cli, commands, server/, widgets) -> papers -> {studies, requests} -> engine -> paging
        -> {memory, models, routes} -> vocabulary (errors, constants, units, results, layout, loader_checks, data)

A request goes one way: server/ -> requests/ (the request surface: OpenAI's shapes, tools, structured output)
-> engine/ (the runtime); the runtime never imports the request surface, and studies (which drive the runtime)
never import it either.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "epqlab"

# room -> rank; a module may import its own room and any room of a lower rank. Rooms of one rank are
# independent of each other (memory, models and routes never import one another; nor do studies and requests).
RANKS = {
    "entry": 6, "papers": 5, "studies": 4, "requests": 4, "engine": 3, "paging": 2,
    "memory": 1, "models": 1, "routes": 1, "vocabulary": 0,
}
VOCABULARY = {"errors", "constants", "units", "results", "layout", "loader_checks", "data"}
ENTRY = {"cli", "commands", "server", "widgets", "__main__"}
ROOT_MODULES = {"epqlab", "epqlab._aliases"}  # the package root re-exports and keeps the old paths
# function-level imports allowed inside epqlab: the native loaders (heavy: libllama, the engine)
LAZY_OK = {"epqlab.engine.native", "epqlab.paging.native"}


def room(module: str) -> str | None:
    parts = module.split(".")
    if module in ROOT_MODULES or parts[0] != "epqlab" or len(parts) < 2:
        return None
    head = parts[1]
    if head in ENTRY:
        return "entry"
    if head in VOCABULARY:
        return "vocabulary"
    if head.startswith("_") and head not in ("_aliases",):  # compiled extensions epqlab._core, _pager_core
        return "paging" if head == "_pager_core" or head == "libepqlab_pager" else "engine"
    return head if head in RANKS else None


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def imports(path: Path, root: Path = ROOT):
    """(target module, line, inside a function) for every import of an epqlab module in ``path``."""
    mod = module_name(path, root)
    pkg = mod if path.name == "__init__.py" else mod.rsplit(".", 1)[0]
    tree = ast.parse(path.read_text())
    funcs = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    inner = {id(x) for f in funcs for x in ast.walk(f) if x is not f}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")[:len(pkg.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            targets = [target] if node.module else [f"{target}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            continue
        for t in targets:
            if t == "epqlab" or t.startswith("epqlab."):
                yield t, node.lineno, id(node) in inner
            elif t.split(".")[0] == "llama_cpp":
                yield "llama_cpp", node.lineno, id(node) in inner


def violations(root: Path = ROOT) -> list[str]:
    out = []
    for path in sorted(root.rglob("*.py")):
        mod = module_name(path, root)
        src = room(mod)
        for target, line, lazy in imports(path, root):
            where = f"{path.relative_to(root.parent)}:{line} ({mod} -> {target})"
            if target == "llama_cpp":
                if src in (None, "vocabulary", "memory", "routes", "paging"):
                    out.append(f"{where}: llama_cpp is imported only by the engine, studies' references and "
                               "models' builders (its tokenizer), never by paging/ or below")
                continue
            if lazy and target not in LAZY_OK and src != "entry" and mod not in ROOT_MODULES:
                out.append(f"{where}: an import inside a function; import at module level (only the native "
                           "loaders load lazily)")
            dst = room(target)
            if src is None or dst is None or src == dst:
                continue
            if RANKS[dst] >= RANKS[src]:
                out.append(f"{where}: {src} may not import {dst} (imports run downhill: docs/DESIGN.md §1)")
    return out


def cycles(root: Path = ROOT) -> list[list[str]]:
    """Cycles of the module-level import graph among epqlab's modules."""
    graph: dict[str, set[str]] = {}
    mods = {module_name(p, root): p for p in root.rglob("*.py")}
    for mod, path in mods.items():
        graph[mod] = set()
        for target, _, lazy in imports(path, root):
            if lazy or target == "llama_cpp":
                continue
            while target not in mods and "." in target:
                target = target.rsplit(".", 1)[0]  # `from pkg import name`: the package
            if target in mods and target != mod and not mod.startswith(target + "."):
                graph[mod].add(target)
    found, state, stack = [], {}, []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                found.append(stack[stack.index(n):] + [n])
            elif n not in state:
                visit(n)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    return found


def test_imports_run_downhill():
    assert violations() == []


def test_no_import_cycle():
    assert cycles() == []


def test_every_module_has_a_room():
    homeless = [module_name(p) for p in ROOT.rglob("*.py") if module_name(p) not in ROOT_MODULES
                and room(module_name(p)) is None]
    assert homeless == []


@pytest.mark.parametrize("line,expect", [
    ("from ..studies.sweeps import map_points", "engine may not import studies"),
    ("from ..engine.session import Session", "paging may not import engine"),
    ("from ..requests.completion import create_completion", "engine may not import requests"),
    ("from ..requests.tools import parse_reply", "studies may not import requests"),
    ("import llama_cpp", "llama_cpp is imported only"),
])
def test_an_upward_import_fails(tmp_path, line, expect):
    assert not any(expect in v for v in violations())
    """The checker itself: a copy of the package with one upward import added is caught."""
    import shutil

    copy = tmp_path / "epqlab"
    shutil.copytree(ROOT, copy, ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    target = copy / {"engine": "engine/run_stats.py", "studies": "studies/sweeps.py"}.get(
        expect.split()[0], "paging/read_segments.py")
    target.write_text(target.read_text() + "\n" + line + "\n")
    assert any(expect in v for v in violations(copy))


def test_a_function_level_import_fails(tmp_path):
    import shutil

    copy = tmp_path / "epqlab"
    shutil.copytree(ROOT, copy, ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    target = copy / "engine" / "run_stats.py"
    target.write_text(target.read_text() + "\n\ndef _late():\n    from ..units import fmt_bytes\n")
    assert any("inside a function" in v for v in violations(copy))


def test_a_cycle_fails(tmp_path):
    import shutil

    copy = tmp_path / "epqlab"
    shutil.copytree(ROOT, copy, ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    target = copy / "engine" / "tokens.py"  # tokens <- decoder <- session; session -> tokens closes a circle
    target.write_text(target.read_text() + "\nfrom .decoder import Decoder  # noqa\n")
    assert cycles(copy)
