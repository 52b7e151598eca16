"""``import epqlab`` and route analysis do not load llama.cpp or epqlab's native engine (checked in a fresh
interpreter); the engine loads with the first Session."""
from __future__ import annotations

import subprocess
import sys

CHILD = """
import sys
import epqlab, epqlab.routes
from epqlab.routes import RouteLog, simulate
log = RouteLog.synthetic(n_tokens=32, n_layers=2, n_expert=8, k=2, locality=0.5, n_prefill=4, seed=0)
simulate(log, [4], policies=["lru"])
S = epqlab.Session  # resolved lazily, still no engine
M = epqlab.models.default_model  # a subpackage as an attribute, without importing it first
print(sorted(m for m in ("llama_cpp", "epqlab._core", "epqlab.engine.native") if m in sys.modules))
"""


def test_import_and_routes_do_not_load_the_engine():
    r = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip() == "[]", r.stdout
