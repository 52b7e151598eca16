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
