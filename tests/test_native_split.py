"""The native link split (docs/DESIGN.md, "Native modules"): the pager and the I/O probe live in
``epqlab._pager_core`` (linked only to ``libepqlab_pager.so``) and load and run in a process that never maps
libllama; the engine module ``epqlab._core`` takes that module's Pager objects; the stats dicts come from one
field table per struct, whose names are exported."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np

CHILD = textwrap.dedent("""
    import json, sys
    import numpy as np
    from epqlab.layout import inspect
    from epqlab.paging.pager import Pager
    from epqlab.paging.probe import probe_io

    model = sys.argv[1]
    lay = inspect(model)
    p = Pager(lay, Pager.all_experts_bytes(lay) // 2, policy="lru", direct_io=False)
    L, E, k = len(lay.layers), lay.n_expert, lay.n_expert_used
    rng = np.random.default_rng(0)
    experts = np.argsort(rng.random((20, L, E)), axis=2)[:, :, :k].astype(np.int32)  # 20 tokens, k distinct each
    st = p.replay(experts)
    df = probe_io(model, request_bytes=[4096], concurrency=[1], n_requests=2, direct=False, progress=False)
    maps = open("/proc/self/maps").read()
    print(json.dumps({
        "stats": {x: st[x] for x in ("requests", "hits", "misses", "bytes_read")}, "expect_requests": 20 * L * k,
        "probe_rows": len(df),
        "llama_mapped": sorted({l.split()[-1] for l in maps.splitlines() if "libllama" in l or "libggml" in l}),
        "pager_lib_mapped": any("libepqlab_pager" in l for l in maps.splitlines()),
        "modules": sorted(m for m in sys.modules if m.startswith(("llama_cpp", "epqlab._core", "epqlab.session_"))),
    }))
""")


def test_pager_and_probe_run_without_libllama(default_model_path, tmp_path):
    r = subprocess.run([sys.executable, "-c", CHILD, str(default_model_path)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["llama_mapped"] == [], out["llama_mapped"]
    assert out["modules"] == [], out["modules"]  # neither llama_cpp nor the engine module was imported
    assert out["pager_lib_mapped"]  # the pager really ran, from the shared library
    s = out["stats"]
    assert s["requests"] == out["expect_requests"] and s["hits"] + s["misses"] == s["requests"] and s["misses"] > 0
    assert s["bytes_read"] > 0 and out["probe_rows"] == 1


def test_engine_module_takes_the_pager_modules_pager(mini_gguf):
    import epqlab
    from epqlab.engine.native import engine_core
    from epqlab.paging.native import pager_core

    with epqlab.Session(mini_gguf, arena_bytes=None, n_ctx=256) as s:
        assert type(s.pager.native) is pager_core.Pager  # noqa: E721  (the class, exactly)
        s.generate("Hello", 2)
        assert s.stats["requests"] > 0 and s.stats["tokens_routed"] > 0
    assert hasattr(engine_core, "Engine") and not hasattr(engine_core, "Pager")
    assert not hasattr(pager_core, "Engine")


def test_counter_names_come_from_the_native_tables(mini_gguf):
    from epqlab.engine.native import core
    from epqlab.layout import inspect
    from epqlab.paging.pager import Pager
    from epqlab.engine.run_stats import COUNTERS as _COUNTERS

    lay = inspect(mini_gguf)
    p = Pager(lay, Pager.all_experts_bytes(lay), direct_io=False)
    raw = p.native.stats()
    assert list(raw)[:len(core.PAGER_COUNTERS)] == list(core.PAGER_COUNTERS)
    assert set(raw) - set(core.PAGER_COUNTERS) == {"layer_requests", "layer_hits", "resident"}
    # every counter the Session differences is one the native tables export (a renamed C++ field fails here)
    assert set(_COUNTERS) <= set(core.PAGER_COUNTERS) | set(core.HOOK_COUNTERS)
    ids = np.array([0, 1], dtype=np.int32)
    p.native.load_layer(0, ids)
    assert p.native.stats()["requests"] == 2 and p.native.stats()["misses"] == 2
