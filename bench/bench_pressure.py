"""Living beside other programs: the arena under a memory hog, and time to first token from the prompt cache on disk.

    .venv/bin/epqlab model synth qwen35-a3b /work/big/q35.gguf
    .venv/bin/python bench/bench_pressure.py --model /work/big/q35.gguf --limit 12GiB --hog 4GiB \\
        --ttft-model /work/big/q30b12.gguf --json bench/results/pressure_<date>.json

1. **Pressure** (``--model``): a child process in a fresh memory cgroup of ``--limit`` (``epqlab.memory.limits``:
   it charges page cache too) opens ``Session(ram_budget="auto", follow_memory=True)`` and decodes ``--n`` tokens
   teacher-forced on the held-out prose (one token per forward pass; a random-weight model's own output repeats
   itself). After ``--hog-at`` tokens it starts a hog, a child of its own (so in the same cgroup), that touches
   ``--hog`` bytes and holds them ``--hold`` seconds, then exits. Reported: tok/s in windows of 8 tokens, the arena
   over time, the time from the hog's pages being touched to the first shrink and from its exit to the arena being
   whole again, the resizes, and the cgroup's OOM kills.
2. **TTFT** (``--ttft-model``, a model with attention-only memory: a hybrid model's recurrent state reuses only a
   whole saved sequence, epqlab/engine/prompt_disk_cache.py): a server (the app in-process) answers a
   ``--prompt``-token prompt; then a restarted one (new Session and app on the same ``--prompt-cache-dir``) answers
   its next turn (the same tokens and 40 more), and a fresh one without the directory answers that turn cold.
   Time to first token = the request's wall time at ``max_tokens=1``, ``--repeats`` interleaved pairs, medians.
   Under ``--prompt-cache exact`` only whole ubatches of the saved prompt are reused (the answer stays a fresh
   run's bit for bit), so ``--n-ubatch`` bounds the reuse: 1,536 of 2,040 tokens at 512, 1,920 at 128.

Run it alone: a build, a test suite or a helper beside it measures the contention.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time

import epqlab
from epqlab.data import heldout_texts
from epqlab.memory.limits import run_limited
from epqlab.units import fmt_bytes, parse_bytes

HOG = ("import sys,time; b=bytearray({n}); [b.__setitem__(i,1) for i in range(0,len(b),4096)]; "
       "print('up',flush=True); time.sleep({hold})")


def child(a) -> None:
    """The pressure run itself (inside the cgroup): one JSON line on stdout."""
    with epqlab.Session(a.model, ram_budget="auto", follow_memory=True, n_threads=a.threads, n_ctx=1024) as s:
        ids = s.tokenize(heldout_texts()["prose"])
        prompt, forced = ids[:16], ids[16:16 + a.n]
        full = s.pager.arena_bytes
        t0 = time.monotonic()
        steps, hog, t_up, t_gone, t_spawn = [], None, None, None, None
        for i, _ in enumerate(s.stream(prompt, n_predict=len(forced), forced=forced)):
            now = time.monotonic() - t0
            steps.append((now, s.pager.arena_bytes, s.budget_bytes))
            if i == a.hog_at:
                t_spawn = time.monotonic() - t0
                hog = subprocess.Popen([sys.executable, "-c", HOG.format(n=a.hog, hold=a.hold)], stdout=subprocess.PIPE,
                                       text=True)
                hog.stdout.readline()
                t_up = time.monotonic() - t0
            if hog is not None and t_gone is None and hog.poll() is not None:
                t_gone = time.monotonic() - t0
        ev = [dict(e.as_dict(), t=e.t - (time.time() - (time.monotonic() - t0))) for e in s.resize_events]
        print(json.dumps({"steps": steps, "full": full, "t_up": t_up, "t_gone": t_gone, "events": ev, "t_spawn": t_spawn,
                          "budget0": s.memory_follower.ceiling}))


def pressure(a) -> dict:
    argv = [sys.executable, __file__, "--child", "--model", a.model, "--n", str(a.n), "--hog", str(a.hog),
            "--hog-at", str(a.hog_at), "--hold", str(a.hold), "--threads", str(a.threads)]
    r = run_limited(argv, a.limit, mode="cgroup", timeout_s=3600)
    res = {"limit_bytes": a.limit, "hog_bytes": a.hog, "oom_kills": r.oom_kills, "killed": r.killed,
           "returncode": r.returncode, "cgroup_peak": r.cgroup_peak}
    if r.returncode != 0:
        res["stderr"] = r.stderr[-3000:]
        return res
    out = json.loads(r.stdout.strip().splitlines()[-1])
    st = out["steps"]
    win = [(st[i + 8][0] - st[i][0]) for i in range(0, len(st) - 8, 8)]
    res["tok_s_windows"] = [{"t": st[i][0], "tok_s": 8 / w, "arena": st[i][1]} for i, w in zip(range(0, len(st) - 8, 8), win)]
    # the hog takes its memory over a few seconds: the arena follows it step by step; report when the arena reached
    # its smallest against when the hog had all its pages, and the cgroup's peak against its limit
    shrinks = [e for e in out["events"] if e["arena_after"] < e["arena_before"] and e["t"] >= (out["t_spawn"] or 0)]
    res["first_shrink_after_spawn_s"] = shrinks[0]["t"] - out["t_spawn"] if shrinks else None
    res["last_shrink_after_hog_up_s"] = shrinks[-1]["t"] - out["t_up"] if shrinks and out["t_up"] is not None else None
    res["shrink_steps"] = len(shrinks)
    res["headroom_at_peak_bytes"] = (a.limit - r.cgroup_peak) if r.cgroup_peak else None
    back = [t for t, arena, _ in st if out["t_gone"] is not None and t > out["t_gone"] and arena >= out["full"]]
    res["time_to_grow_back_s"] = back[0] - out["t_gone"] if back else None
    res.update(full_arena=out["full"], min_arena=min(x[1] for x in st), resizes=len(out["events"]),
               events=out["events"], t_hog_up=out["t_up"], t_hog_gone=out["t_gone"])

    def med(lo, hi):
        xs = [w["tok_s"] for w in res["tok_s_windows"] if lo <= w["t"] < hi]
        return statistics.median(xs) if xs else None
    tu, tg = out["t_up"] or 0, out["t_gone"] or 1e9
    res["tok_s_before"], res["tok_s_during"], res["tok_s_after"] = med(0, tu), med(tu, tg), med(tg, 1e9)
    return res


def ttft(a) -> dict:
    from fastapi.testclient import TestClient

    from epqlab.server import create_app

    with epqlab.Session(a.ttft_model, pager=False, n_threads=a.threads, n_ctx=a.prompt + 256) as s:
        ids = s.tokenize(heldout_texts()["legal"] + "\n\n" + heldout_texts()["prose"])  # legal alone: < 2,040 tokens
    if len(ids) < a.prompt + 40:
        raise SystemExit(f"the held-out texts give {len(ids)} tokens, fewer than --prompt {a.prompt} + 40")
    first, second = ids[:a.prompt], ids[:a.prompt + 40]
    kw = dict(n_threads=a.threads, n_ctx=a.prompt + 256, ram_budget=a.ttft_budget, n_ubatch=a.n_ubatch)

    def request(cache_dir, tokens) -> tuple[float, int]:
        with epqlab.Session(a.ttft_model, **kw) as s, \
                TestClient(create_app(s, prompt_cache_dir=cache_dir)) as c:
            t = time.perf_counter()
            r = c.post("/v1/completions", json={"prompt": tokens, "max_tokens": 1, "temperature": 0})
            dt = time.perf_counter() - t
            assert r.status_code == 200, r.text
            return dt, r.json()["epqlab"]["n_prompt_reused"]

    cold, disk, reused = [], [], []
    for _ in range(a.repeats):
        with tempfile.TemporaryDirectory(dir=a.cache_root) as d:
            request(d, first)  # the first turn; its state is saved as it ends
            dt, n = request(d, second)  # after a restart
            disk.append(dt)
            reused.append(n)
        cold.append(request(None, second)[0])
    return {"model": a.ttft_model, "prompt_tokens": len(second), "n_ubatch": a.n_ubatch, "cold_s": cold, "disk_s": disk, "reused": reused,
            "cold_median_s": statistics.median(cold), "disk_median_s": statistics.median(disk),
            "ratio": statistics.median(disk) / statistics.median(cold)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model")
    p.add_argument("--limit", default="12GiB")
    p.add_argument("--hog", default="4GiB")
    p.add_argument("--hog-at", type=int, default=24)
    p.add_argument("--hold", type=float, default=40.0)
    p.add_argument("--n", type=int, default=160)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--ttft-model")
    p.add_argument("--ttft-budget", default="4GiB")
    p.add_argument("--prompt", type=int, default=2000)
    p.add_argument("--n-ubatch", type=int, default=128,
                   help="the server's n_ubatch: the exact rule reuses whole ubatches of the saved prompt (default 128)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--cache-root", default=None, help="where the prompt cache directories go (default: /tmp)")
    p.add_argument("--json")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    a.hog = parse_bytes(a.hog)
    a.limit = parse_bytes(a.limit)
    if a.child:
        child(a)
        return 0
    out = {}
    if a.model:
        out["pressure"] = r = pressure(a)
        print(f"pressure: {fmt_bytes(a.hog)} hog in a {fmt_bytes(a.limit)} cgroup: OOM kills {r['oom_kills']}, "
              f"arena {fmt_bytes(r.get('full_arena', 0))} -> min {fmt_bytes(r.get('min_arena', 0))}, "
              f"{r.get('shrink_steps')} shrinks from {r.get('first_shrink_after_spawn_s')} s after the hog started to "
              f"{r.get('last_shrink_after_hog_up_s')} s after it held all its pages, cgroup peak "
              f"{fmt_bytes(r.get('cgroup_peak') or 0)}, grown back {r.get('time_to_grow_back_s')} s after "
              f"it left; tok/s before/during/after {r.get('tok_s_before')} / {r.get('tok_s_during')} / "
              f"{r.get('tok_s_after')}", flush=True)
    if a.ttft_model:
        out["ttft"] = t = ttft(a)
        print(f"ttft: {t['prompt_tokens']}-token turn: cold {t['cold_median_s']:.2f} s, from disk "
              f"{t['disk_median_s']:.2f} s (x{t['ratio']:.3f}; reused {t['reused']})", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
