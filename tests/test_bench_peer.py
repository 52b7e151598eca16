"""bench/bench_peer.py's harness end to end on the default model, with a stand-in for the peer (the real one is built
from its source and is no CI dependency): the token file handed to the peer holds exactly the prompt and forced ids
epqlab decoded, its cache is epqlab's arena in MiB, epqlab's argmax per step equals plain llama.cpp's (computed here
from ``pager=False`` logits), the stand-in's argmax (also plain llama.cpp's) agrees at every step, and the ratio is
epqlab's median tok/s over the peer's best row."""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np

BENCH = Path(__file__).resolve().parent.parent / "bench" / "bench_peer.py"

FAKE = r'''
import json, os, sys
import numpy as np
import epqlab
a = sys.argv[1:]
model, cache_mb, tf = a[a.index("-m") + 1], int(a[a.index("--cache-mb") + 1]), a[a.index("--forced-tokens") + 1]
lines = open(tf).read().splitlines()
prompt, forced = [int(x) for x in lines[0].split()], [int(x) for x in lines[1].split()]
with open(os.environ["FAKE_PEER_LOG"], "a") as f:
    f.write(json.dumps({"prompt": prompt, "forced": forced, "cache_mb": cache_mb, "argv": a}) + "\n")
with epqlab.Session(model, pager=False, n_ctx=512) as s:
    lg = s.logits(prompt + forced)
am = [int(np.argmax(lg[len(prompt) - 1 + i])) for i in range(len(forced) + 1)]
speed = 2.0 if "--overlap" in a else 1.0
print("BMOE_FORCED " + json.dumps({"n_prompt": len(prompt), "n_decode": len(forced), "decode_s": len(forced) / speed,
      "decode_tok_s": speed, "llama_decode_tok_s": speed, "cache_hit_pct": 50.0, "read_mib": 1.0, "argmax": am}))
'''


def test_bench_peer_harness(default_model_path, tmp_path):
    fake = tmp_path / "fake_peer.py"
    fake.write_text(FAKE)
    peer = tmp_path / "bmoe-cli"
    peer.write_text(f"#!/bin/sh\nexec {sys.executable} {fake} \"$@\"\n")
    peer.chmod(0o755)
    out = tmp_path / "p.json"
    p = subprocess.run([sys.executable, str(BENCH), "--model", default_model_path, "--peer-bin", str(peer),
                        "--levels", "1GiB", "--n", "6", "--repeats", "2", "--check-argmax", "--json", str(out)],
                       capture_output=True, text=True, timeout=900, env=os.environ | {"FAKE_PEER_LOG": str(tmp_path / "seen.jsonl")})
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    r = json.loads(out.read_text())
    rows = {x["engine"]: x for x in r["rows"]}
    assert set(rows) == {"epqlab", "peer serial", "peer overlap"} and all(x["runs"] == 2 for x in rows.values())
    prompt, forced = r["prompt_ids"], r["forced_ids"]
    assert len(forced) == 7  # n + 1: the last forced token is not decoded
    # plain llama.cpp's argmax after the prompt and after each decoded token
    import epqlab

    with epqlab.Session(default_model_path, pager=False, n_ctx=512) as s:
        lg = s.logits(prompt + forced[:6])
    want = [int(np.argmax(lg[len(prompt) - 1 + i])) for i in range(7)]
    ep_run = r["runs"]["1.00 GiB epqlab"][0]
    assert ep_run["argmax"] == want
    arena_mib = ep_run["arena_bytes"] // 2**20
    assert arena_mib > 0
    seen = [json.loads(x) for x in (tmp_path / "seen.jsonl").read_text().splitlines()]
    assert len(seen) == 4  # 2 modes x 2 rounds, each handed epqlab's exact tokens and arena
    assert all(x["prompt"] == prompt and x["forced"] == forced[:6] and x["cache_mb"] == arena_mib for x in seen)
    for mode, speed in (("serial", 1.0), ("overlap", 2.0)):
        run = r["runs"][f"1.00 GiB peer {mode}"][0]
        assert run["cache_mb"] == arena_mib and ("--overlap" in run["cmd"]) == (mode == "overlap")
        assert rows[f"peer {mode}"]["tok_s"] == speed
        assert rows[f"peer {mode}"]["argmax_agreement"] == {"steps": 7, "agree": 7, "first_mismatch": None}
    ep = rows["epqlab"]
    assert ep["tok_s"] == statistics.median(ep["tok_s_runs"])
    assert ep["epqlab_over_peer"] == ep["tok_s"] / 2.0  # over the peer's best row (overlap here)
    assert rows["peer serial"]["epqlab_over_peer"] == ep["tok_s"] / 1.0
