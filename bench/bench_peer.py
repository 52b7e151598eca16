"""A peer engine side by side (issue 42 item 5): epqlab and BigMoeOnEdge alternately, same GGUF, same tokens, same
expert-cache size, same memory limit, decode tok/s of each and epqlab / peer.

    bench/peer/build_bigmoeonedge.sh /work/peer/src /work/src/llama_cpp_python-0.3.36/vendor/llama.cpp /work/peer/b
    .venv/bin/python bench/bench_peer.py --model /work/big/q35.gguf --peer-bin /work/peer/b/build/cli/bmoe-cli \
        --levels 4GiB,8GiB --n 64 --repeats 3 --epqlab-prefetch off,trained --predictor /work/big/q35.predictor.npz \
        --check-argmax --json bench/results/peer_qwen35-a3b.json

The peer is BigMoeOnEdge (github.com/Helldez/BigMoeOnEdge) built against llama-cpp-python 0.3.36's llama.cpp with
bench/peer/*.patch (bench/README.md, "The peer side by side"). Per level and repeat, each engine runs once as a
child process in a memory cgroup of the level (:func:`epqlab.memory.limits.run_limited`), the model file dropped
from the page cache (:func:`epqlab.memory.usage.drop_page_cache`) before every run of either engine; the order
alternates between rounds (epqlab first in rounds 1, 3, ..., the peer first in 2, 4, ...; the first round runs
epqlab first because its run supplies the token ids and the cache size).

- Tokens: epqlab's tokenizer (the Session in the epqlab child) gives the prompt (``--prompt``, with BOS) and the
  first ``--n`` + 1 tokens of the held-out prose (``epqlab/data/heldout_prose.txt``, as bench_seed_scale.py),
  teacher-forced, one per decode step. Both engines decode the same ``--n`` tokens at the same positions
  (epqlab: ``Session.stream(forced=)``, the last forced token is not decoded; the peer: ``--forced-tokens``).
- Cache: epqlab's Session with ``ram_budget`` = level - 16 MiB sizes its arena; the peer gets ``--cache-mb`` =
  that arena in MiB (``--force-cache`` below its 1500 MiB floor). The peer's rows for a level wait for epqlab's
  first passing run there; without one they are recorded as skipped.
- epqlab runs its Session defaults (prefetch off, ``dense_weights="anon"``) plus ``--epqlab-kw``; with
  ``--epqlab-prefetch off,trained`` a second epqlab row runs ``prefetch="trained"`` with ``--predictor``.
- Both with ``--threads`` compute threads and ``--io-threads`` read threads (default: epqlab's default, <= 8
  for the peer). The peer streams with ``--moe-stream --dense-weights anon`` plus each ``--peer-modes`` entry
  (``serial``: nothing more; ``overlap``: ``--overlap``, reads overlapped with the expert matmuls through the
  expert-ready hook) and ``--peer-args``.
- decode tok/s = decoded tokens / wall time of the decode loop (load and prefill excluded) for both; the peer's
  own figure (``llama_decode`` time only) is kept as ``peer_llama_decode_tok_s``.
- epqlab / peer: an epqlab row over the peer's best row at its level; a peer row: epqlab's best row over it.
- A run killed by the limit, timed out or failed is recorded as such (its reason in the JSON), never fatal.

``--check-argmax`` (round 1 only, not timed): epqlab's child decodes the same tokens once more through its decoder
and keeps the argmax after the prefill and after each decode; the peer prints the same; the table reports how many
steps agree. Run it alone: a build or a test suite beside it measures the contention. Goal (issue 42): epqlab >=
1.5x the peer's decode tok/s at 4 and 8 GiB.
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
from pathlib import Path

HEADROOM = 16 * 2**20
MIB = 2**20
PEER_CACHE_MIN_MB = 1500  # the peer's MoeStreamConfig::cache_min_mb: below it needs --force-cache
PEER_IO_THREADS_MAX = 8
PEER_MODES = {"serial": [], "overlap": ["--overlap"]}


def _epqlab_row(spec: dict, res: dict) -> None:
    """The epqlab child (``bench_peer.py --child SPEC OUT``): one teacher-forced run in a Session at the budget."""
    import numpy as np

    from epqlab.engine.session import Session

    with Session(spec["model"], ram_budget=spec["ram_budget"], **spec["session_kw"]) as s:
        prompt = s.prompt_tokens(spec["prompt"], True)
        forced = s.prompt_tokens(spec["forced"], False)[: spec["n"] + 1]
        g = s.generate(prompt, len(forced), forced=forced)
        st = g.stats
        res.update(prompt_ids=prompt, forced_ids=forced, arena_bytes=s.pager.arena_bytes if s.pager else 0,
                   load_s=s.load_s, memory=s.memory_parts(),
                   row={k: st.get(k) for k in ("decode_tok_s", "decode_s", "decode_passes", "prefill_s",
                                                "decode_hit_rate", "decode_ssd_bytes_per_token", "teacher_forced", "time_split")})
        if spec.get("argmax"):  # the same tokens once more, untimed: the argmax after the prefill and each decode
            d = s.decoder
            with d.lock:
                epoch, _ = d.begin()
                am = [int(np.argmax(d.prefill(prompt, epoch)))]
                for i, t in enumerate(forced[:-1]):
                    am.append(int(np.argmax(d.step(t, len(prompt) + i, epoch))))
            res["argmax"] = am


def run_epqlab(model: str, level: int, a, workdir: Path, tag: str, argmax: bool, kw: dict | None = None) -> dict:
    from epqlab.memory.limits import run_limited
    from epqlab.memory.usage import drop_page_cache

    drop_page_cache(model)
    spec = {"model": model, "ram_budget": level - HEADROOM, "prompt": a.prompt, "forced": a.forced_text, "n": a.n,
            "argmax": argmax, "session_kw": {"n_threads": a.threads, "n_ctx": a.n_ctx, **({"io_threads": a.io_threads} if a.io_threads_set else {}),
                           **a.epqlab_kw, **(kw or {})}}
    sp, op = workdir / f"{tag}.spec.json", workdir / f"{tag}.out.json"
    sp.write_text(json.dumps(spec))
    lim = run_limited([sys.executable, str(Path(__file__).resolve()), "--child", str(sp), str(op)], level,
                      timeout_s=a.timeout)
    out = json.loads(op.read_text()) if op.is_file() else {"status": "FAIL", "reason": lim.reason or lim.stderr[-300:]}
    out.update(cgroup_peak=lim.cgroup_peak, killed=lim.killed, timed_out=lim.timed_out, limit_mode=lim.limit_mode)
    if out.get("status") == "PASS":
        out["tok_s"] = out["row"]["decode_tok_s"]
    return out


def run_peer(model: str, level: int, mode: str, ids: tuple, cache_mb: int, a, workdir: Path, tag: str) -> dict:
    from epqlab.memory.limits import run_limited
    from epqlab.memory.usage import drop_page_cache

    drop_page_cache(model)
    tf = workdir / f"{tag}.tokens"
    tf.write_text(" ".join(map(str, ids[0])) + "\n" + " ".join(map(str, ids[1][:a.n])) + "\n")
    cmd = [a.peer_bin, "-m", model, "-t", str(a.threads), "-c", str(a.n_ctx), "--moe-stream",
           "--cache-mb", str(cache_mb), "--io-threads", str(min(a.io_threads, PEER_IO_THREADS_MAX)),
           "--dense-weights", "anon", "--forced-tokens", str(tf), *PEER_MODES[mode], *a.peer_args.split()]
    if 0 < cache_mb < PEER_CACHE_MIN_MB:
        cmd.append("--force-cache")
    lim = run_limited(cmd, level, timeout_s=a.timeout)
    out = {"cmd": cmd, "cgroup_peak": lim.cgroup_peak, "killed": lim.killed, "timed_out": lim.timed_out,
           "returncode": lim.returncode, "cache_mb": cache_mb, "limit_mode": lim.limit_mode}
    m = re.search(r"^BMOE_FORCED (\{.*\})$", lim.stdout, re.M)
    if lim.returncode == 0 and m:
        row = json.loads(m.group(1))
        out.update(status="PASS", row=row, tok_s=row["decode_tok_s"], argmax=row.pop("argmax"),
                   summary=[x for x in lim.stdout.splitlines() if x.startswith(("moe-", "generation:", "prefill:"))])
    else:
        why = "killed by the memory limit" if lim.killed else "timed out" if lim.timed_out else \
            f"exit {lim.returncode}: {(lim.stderr.strip().splitlines() or [''])[-1][:300]}"
        out.update(status="FAIL", reason=why, stderr_tail=lim.stderr[-2000:])
    return out


def agreement(x: list | None, y: list | None) -> dict | None:
    if not x or not y:
        return None
    n = min(len(x), len(y))
    same = [i for i in range(n) if x[i] == y[i]]
    first = next((i for i in range(n) if x[i] != y[i]), None)
    return {"steps": n, "agree": len(same), "first_mismatch": first}


def main():
    from epqlab.data import heldout_texts
    from epqlab.paging.pager import default_io_threads
    from epqlab.studies.strict import DEFAULT_PROMPT

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="a MoE GGUF both engines can run")
    ap.add_argument("--peer-bin", required=True, help="bmoe-cli built by bench/peer/build_bigmoeonedge.sh")
    ap.add_argument("--levels", default="4GiB,8GiB", help="memory limits (cgroup), e.g. 4GiB,8GiB")
    ap.add_argument("--n", type=int, default=32, help="teacher-forced decode steps per run (default 32)")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved rounds (default 3)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--io-threads", type=int, default=None, help="read threads of both (default: epqlab's default)")
    ap.add_argument("--n-ctx", type=int, default=512)
    ap.add_argument("--prompt", default=DEFAULT_PROMPT, help="prompt text (tokenized by epqlab, with BOS)")
    ap.add_argument("--peer-modes", default="serial,overlap",
                    help="comma-separated peer rows: serial (--moe-stream) and/or overlap (+ --overlap)")
    ap.add_argument("--peer-args", default="", help="extra bmoe-cli flags for every peer run (one string)")
    ap.add_argument("--epqlab-kw", default="{}",
                    help='extra Session keywords for epqlab as JSON, e.g. \'{"prefetch": "lookahead"}\' (default: none)')
    ap.add_argument("--epqlab-prefetch", default="off",
                    help="comma-separated epqlab rows: off (Session defaults) and/or trained (prefetch='trained' with "
                         "--predictor, fitted on the shipped calibration texts, never on the timed prose)")
    ap.add_argument("--predictor", default=None, help="the trained predictor .npz for --epqlab-prefetch trained")
    ap.add_argument("--check-argmax", action="store_true", help="compare the engines' argmax per step (round 1)")
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds per run before it is killed")
    ap.add_argument("--json", default=None, help="write the table and every run here")
    a = ap.parse_args()

    import epqlab
    from epqlab.memory.usage import drop_page_cache
    from epqlab.units import fmt_bytes, parse_bytes

    if not Path(a.peer_bin).is_file():
        raise SystemExit(f"--peer-bin {a.peer_bin} does not exist: build it with bench/peer/build_bigmoeonedge.sh")
    modes = [x.strip() for x in a.peer_modes.split(",") if x.strip()]
    bad = [x for x in modes if x not in PEER_MODES]
    if bad or not modes:
        raise SystemExit(f"--peer-modes: unknown {bad}; choose from {', '.join(PEER_MODES)}")
    a.io_threads_set = a.io_threads is not None  # epqlab gets it only when given (its default otherwise)
    a.io_threads = a.io_threads or default_io_threads()
    a.epqlab_kw = json.loads(a.epqlab_kw)
    a.forced_text = heldout_texts()["prose"]
    model = str(Path(a.model).resolve())
    lay = epqlab.inspect(model)
    levels = [parse_bytes(x) for x in a.levels.split(",") if x.strip()]
    print(f"model {lay.path.name} ({fmt_bytes(lay.file_size)}; {len(lay.layers)} MoE layers x {lay.n_expert} "
          f"experts, top-{lay.n_expert_used}); {a.n} teacher-forced tokens (held-out prose), {a.repeats} interleaved "
          f"rounds, {a.threads} threads, {a.io_threads} read threads; peer {a.peer_bin} ({', '.join(modes)})",
          flush=True)

    variants = [x.strip() for x in a.epqlab_prefetch.split(",") if x.strip()]
    if variants[:1] != ["off"] or not set(variants) <= {"off", "trained"}:
        raise SystemExit("--epqlab-prefetch: off first (it sizes the peer's cache), then optionally trained")
    if "trained" in variants and not (a.predictor and Path(a.predictor).is_file()):
        raise SystemExit("--epqlab-prefetch trained needs --predictor P.npz (epqlab predictor fit MODEL P.npz)")
    engines = ["epqlab"] + (["epqlab trained"] if "trained" in variants else []) + [f"peer {m}" for m in modes]
    runs: dict[tuple, list[dict]] = {(lvl, e): [] for lvl in levels for e in engines}
    ids: tuple | None = None          # (prompt ids, forced ids) from the first passing epqlab run
    cache: dict[int, int] = {}        # level -> epqlab's arena bytes there
    ref_argmax: dict[int, list] = {}  # level -> epqlab's argmax per step
    with tempfile.TemporaryDirectory() as td:
        try:
            for rep in range(a.repeats):
                for lvl in levels:
                    order = engines if rep % 2 == 0 else engines[1:] + engines[:1]
                    for e in order:
                        tag = f"{e.replace(' ', '_')}_{lvl}_r{rep}"
                        if e == "epqlab trained":
                            r = run_epqlab(model, lvl, a, Path(td), tag, argmax=False,
                                           kw={"prefetch": "trained", "prefetch_predictor": str(Path(a.predictor).resolve())})
                        elif e == "epqlab":
                            r = run_epqlab(model, lvl, a, Path(td), tag, argmax=a.check_argmax and rep == 0)
                            if r.get("status") == "PASS":
                                ids = ids or (r["prompt_ids"], r["forced_ids"])
                                cache.setdefault(lvl, r["arena_bytes"])
                                if r.get("argmax"):
                                    ref_argmax.setdefault(lvl, r["argmax"])
                        elif lvl not in cache or ids is None:
                            r = {"status": "SKIP", "reason": "no passing epqlab run at this level yet (cache size)"}
                        else:
                            r = run_peer(model, lvl, e.split()[1], ids, cache[lvl] // MIB, a, Path(td), tag)
                        r["round"] = rep + 1
                        runs[(lvl, e)].append(r)
                        if r.get("status") == "PASS":
                            extra = ""
                            if e != "epqlab" and rep == 0 and a.check_argmax:
                                r["argmax_agreement"] = agreement(ref_argmax.get(lvl), r.get("argmax"))
                                extra = f", argmax agreement {r['argmax_agreement']}"
                            print(f"  {fmt_bytes(lvl)} {e} round {rep + 1}: {r['tok_s']:.2f} tok/s, peak "
                                  f"{fmt_bytes(r['cgroup_peak']) if r.get('cgroup_peak') else '-'}{extra}", flush=True)
                        else:
                            print(f"  {fmt_bytes(lvl)} {e} round {rep + 1}: {r.get('status')} {r.get('reason')}",
                                  flush=True)
        finally:
            drop_page_cache(model)  # do not leave the page cache full of the model

    table = []
    for (lvl, e), rs in runs.items():
        ok = [r for r in rs if r.get("status") == "PASS"]
        t = {"level": fmt_bytes(lvl), "limit": lvl, "engine": e, "runs": len(ok), "failed": len(rs) - len(ok),
             "fail_reasons": sorted({str(r.get("reason")) for r in rs if r.get("status") != "PASS"}),
             "cache_bytes": cache.get(lvl), "tok_s": None, "tok_s_runs": [r["tok_s"] for r in ok],
             "cgroup_peak": max((r.get("cgroup_peak") or 0 for r in rs), default=0) or None}
        if ok:
            t["tok_s"] = statistics.median(t["tok_s_runs"])
            t["ms_per_token"] = 1000.0 / t["tok_s"] if t["tok_s"] else None
            if e.startswith("epqlab"):
                t["hit_rate"] = statistics.median(r["row"]["decode_hit_rate"] or 0 for r in ok)
                t["mb_per_token"] = statistics.median((r["row"]["decode_ssd_bytes_per_token"] or 0) / 1e6 for r in ok)
            else:
                t["hit_rate"] = statistics.median(r["row"]["cache_hit_pct"] / 100 for r in ok)
                t["mb_per_token"] = statistics.median(r["row"]["read_mib"] * MIB / 1e6 / max(1, r["row"]["n_decode"])
                                                      for r in ok)
                t["peer_llama_decode_tok_s"] = statistics.median(r["row"]["llama_decode_tok_s"] for r in ok)
                ag = next((r.get("argmax_agreement") for r in ok if r.get("argmax_agreement")), None)
                t["argmax_agreement"] = ag
        table.append(t)
    for t in table:  # each epqlab row over the peer's best mode at its level, and each peer row under epqlab's best
        mine = [u["tok_s"] for u in table if u["limit"] == t["limit"] and u["engine"].startswith("epqlab") and u["tok_s"]]
        peer = [u["tok_s"] for u in table if u["limit"] == t["limit"] and u["engine"].startswith("peer") and u["tok_s"]]
        if t["tok_s"] and t["engine"].startswith("epqlab") and peer:
            t["epqlab_over_peer"] = t["tok_s"] / max(peer)
        elif t["tok_s"] and t["engine"].startswith("peer") and mine:
            t["epqlab_over_peer"] = max(mine) / t["tok_s"]

    def f(v, spec):
        return "-" if v is None else format(v, spec)

    print("\n| level | engine | cache | decode tok/s (runs) | ms/token | decode hit | MB/token | peak cgroup | "
          "epqlab / peer | argmax agree |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for t in table:
        runs_s = ", ".join(f"{x:.2f}" for x in t["tok_s_runs"]) or "-"
        ag = t.get("argmax_agreement")
        ag_s = f"{ag['agree']}/{ag['steps']}" if ag else "-"
        status = "" if not t["failed"] else f" ({t['failed']} failed: {'; '.join(t['fail_reasons'])[:120]})"
        print(f"| {t['level']} | {t['engine']} | {fmt_bytes(t['cache_bytes']) if t['cache_bytes'] else '-'} | "
              f"{f(t['tok_s'], '.2f')} ({runs_s}){status} | {f(t.get('ms_per_token'), '.0f')} | "
              f"{f(t.get('hit_rate'), '.1%')} | {f(t.get('mb_per_token'), '.1f')} | "
              f"{fmt_bytes(t['cgroup_peak']) if t['cgroup_peak'] else '-'} | {f(t.get('epqlab_over_peer'), '.2f')} | "
              f"{ag_s} |")
    print("\ngoal (issue 42): epqlab / peer >= 1.5 at 4 and 8 GiB")
    if a.json:
        epqlab.results.write_json(json.loads(json.dumps(
            {"model": model, "parameters": {k: v for k, v in vars(a).items() if k != "forced_text"},
             "prompt_ids": ids and ids[0], "forced_ids": ids and ids[1], "rows": table,
             "runs": {f"{fmt_bytes(k[0])} {k[1]}": v for k, v in runs.items()}, "run": epqlab.results.run_info(model)},
            default=str)), a.json)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        from epqlab.studies.child_run import run_child

        sys.exit(run_child(sys.argv[2:], _epqlab_row))
    main()
