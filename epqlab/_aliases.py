"""The module paths of epqlab before its rooms (docs/DESIGN.md §1), kept importable.

``import epqlab.strict`` or ``from epqlab.pager import Pager`` still work: a meta-path finder maps each old
path to its module in a room, and both names refer to the one module object (so ``monkeypatch`` on either
patches both). New code imports the rooms' paths.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

ALIASES: dict[str, str] = {
    # memory/
    "epqlab.auto_budget": "epqlab.memory.auto_budget",
    "epqlab.limits": "epqlab.memory.limits",
    # paging/
    "epqlab.pager": "epqlab.paging.pager",
    "epqlab.probe": "epqlab.paging.probe",
    "epqlab.read_segments": "epqlab.paging.read_segments",
    "epqlab._pager_native": "epqlab.paging.native",
    # engine/
    "epqlab.session": "epqlab.engine.session",
    "epqlab.generation": "epqlab.engine.generation",
    "epqlab.sampling": "epqlab.engine.sampling",
    "epqlab.tokens": "epqlab.engine.tokens",
    "epqlab.perplexity": "epqlab.engine.perplexity",
    "epqlab.run_stats": "epqlab.engine.run_stats",
    "epqlab.time_split": "epqlab.engine.time_split",
    "epqlab.arena_sizing": "epqlab.engine.arena_sizing",
    "epqlab.prefetch": "epqlab.engine.prefetch",
    "epqlab.predictor": "epqlab.engine.predictor",
    "epqlab._native": "epqlab.engine.native",
    # requests/ (the request surface, out of engine/: its engine paths and the older top-level one)
    "epqlab.completion": "epqlab.requests.completion",
    "epqlab.engine.completion": "epqlab.requests.completion",
    "epqlab.engine.completion_run": "epqlab.requests.completion_run",
    "epqlab.engine.tools": "epqlab.requests.tools",
    "epqlab.engine.structured": "epqlab.requests.structured",
    "epqlab.engine.schema_ints": "epqlab.requests.schema_ints",
    # studies/ (a package: its submodules follow, e.g. epqlab.ablation.topk)
    "epqlab.ablation": "epqlab.studies.ablation",
    "epqlab.strict": "epqlab.studies.strict",
    "epqlab.strict_child": "epqlab.studies.strict_child",
    "epqlab.sweeps": "epqlab.studies.sweeps",
    "epqlab.route_recording": "epqlab.studies.route_recording",
    "epqlab.probe_report": "epqlab.studies.probe_report",
    "epqlab.models.quality": "epqlab.studies.model_quality",
}


def target(name: str) -> str | None:
    """The room path of an old module path (a package's submodules included), or None."""
    for old, new in ALIASES.items():
        if name == old or name.startswith(old + "."):
            return new + name[len(old):]
    return None


class _AliasLoader(importlib.abc.Loader):
    def __init__(self, new: str):
        self.new = new
        self._spec = None

    def create_module(self, spec):
        mod = importlib.import_module(self.new)
        self._spec = mod.__spec__
        return mod

    def exec_module(self, module):
        # the target module ran when it was imported; the import system has just set its __spec__ to the
        # alias's: give it back its own, so that importlib.reload (and IPython's autoreload) reload it
        module.__spec__ = self._spec


class AliasFinder(importlib.abc.MetaPathFinder):
    """Finds an old epqlab module path and hands back the module at its new path."""

    def find_spec(self, name, path=None, target_=None):
        new = target(name)
        if new is None:
            return None
        mod = importlib.import_module(new)
        if hasattr(mod, "__path__"):
            # a package: its submodules already loaded go into sys.modules under the old names too, so that
            # importing one by its old name finds it there and the import system does not bind the submodule
            # over a name the package exports (epqlab.ablation.topk must not replace the function topk)
            for k, m in list(sys.modules.items()):
                if k.startswith(new + ".") and m is not None:
                    sys.modules.setdefault(name + k[len(new):], m)
        spec = importlib.util.spec_from_loader(name, _AliasLoader(new), is_package=hasattr(mod, "__path__"))
        if hasattr(mod, "__path__"):
            spec.submodule_search_locations = list(mod.__path__)
        return spec


def install() -> None:
    if not any(isinstance(f, AliasFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, AliasFinder())
