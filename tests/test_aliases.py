"""The module paths before the rooms (epqlab/_aliases.py) still import, as the very module of the new path,
so user code and monkeypatches keep working; ``epqlab.<subpackage>`` resolves without an explicit import."""
from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

from epqlab._aliases import ALIASES


@pytest.mark.parametrize("old,new", sorted(ALIASES.items()))
def test_old_path_is_the_new_module(old, new):
    assert importlib.import_module(old) is importlib.import_module(new)


def test_from_imports_and_submodules_of_an_old_package():
    from epqlab.ablation.topk import topk as a  # a submodule of the old ablation package
    from epqlab.studies.ablation.topk import topk as b
    from epqlab.strict import run

    assert a is b and run.__module__ == "epqlab.studies.strict"


def test_attributes_without_an_import():
    code = "import epqlab; print(epqlab.models.synthesize.__module__, epqlab.strict.__name__, epqlab.routes.RouteLog.__name__)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["epqlab.models.synth", "epqlab.studies.strict", "RouteLog"]


def test_old_paths_do_not_rebind_names_or_specs():
    """Importing a submodule by its old path leaves what the package exports under that name (the function
    ``topk``, not the module), and the module keeps its own spec, so ``importlib.reload`` reloads it."""
    code = ("import importlib, epqlab.studies.ablation as a\n"
            "import epqlab.ablation.topk, epqlab.ablation.eviction, epqlab.pager\n"
            "import epqlab.paging.pager as q\n"
            "from epqlab.studies.ablation import topk, eviction\n"
            "q.MAX_IO_THREADS = -1; importlib.reload(q)\n"  # a reload runs the module again: the constant is back
            "print(callable(topk), callable(eviction), q.__spec__.name, q.MAX_IO_THREADS > 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["True", "True", "epqlab.paging.pager", "True"]
