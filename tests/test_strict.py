"""Hard memory limits (epqlab.memory.limits), the strict memory-level runner (epqlab.studies.strict), `epqlab
strict` and notebooks/05_memory_levels.ipynb, on the default model at small levels."""
from __future__ import annotations

import json
import mmap
import os
import re
import shutil
import stat
import sys
import textwrap
from pathlib import Path

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from notebooks import REPO, run_notebook  # noqa: E402

import epqlab  # noqa: E402
from epqlab.memory import limits  # noqa: E402
from epqlab.studies import strict  # noqa: E402
from epqlab.memory import drop_page_cache, page_cache_bytes  # noqa: E402
from epqlab.engine.session import DEFAULT_RESERVE  # noqa: E402

MiB = 2**20
LEVEL = 320 * MiB  # a limit the default model loads in (n_ctx 256)
CG_REASON = limits.cgroup_unavailable_reason()
needs_cgroup = pytest.mark.skipif(CG_REASON is not None, reason=f"no writable memory cgroup here: {CG_REASON}")


def _fs_type(path: Path) -> str:
    """Filesystem type of the mount holding ``path`` (longest mount-point prefix in /proc/mounts)."""
    best, typ = "", "?"
    p = str(path.resolve())
    with open("/proc/mounts") as f:
        for line in f:
            mnt, t = line.split()[1], line.split()[2]
            if (p == mnt or p.startswith(mnt.rstrip("/") + "/")) and len(mnt) > len(best):
                best, typ = mnt, t
    return typ


@pytest.fixture(scope="module")
def disk_dir(tmp_path_factory):
    """A directory on a disk filesystem (tmpfs pages cannot be dropped from the page cache)."""
    tmp = tmp_path_factory.mktemp("strict")
    for cand in (tmp, Path("/var/tmp"), REPO):
        if _fs_type(cand) not in ("tmpfs", "ramfs") and os.access(cand, os.W_OK):
            d = cand if cand == tmp else Path(cand) / f"epqlab-strict-test-{os.getpid()}"
            d.mkdir(exist_ok=True)
            yield d
            if d != tmp:
                for f in d.iterdir():
                    f.unlink()
                d.rmdir()
            return
    pytest.skip("no disk-backed writable directory (all tmpfs)")


@pytest.fixture(scope="module")
def model(default_model_path, disk_dir):
    """A private copy of the default model: other processes reading the shared one would refill
    its page cache between our drop and our run (and the cgroup would not be charged for it)."""
    p = disk_dir / "default.gguf"
    shutil.copyfile(default_model_path, p)
    return str(p)


@pytest.fixture(scope="module")
def too_small(model):
    """One run whose budget cannot hold an arena (a 1 GiB reserve inside LEVEL), and the smallest
    budget that works with the default reserve, parsed from the ArenaTooSmall message."""
    df = strict.run(model, [LEVEL], n_predict=4, repeats=1, reserve="1GiB", n_ctx=256)
    r = df.iloc[0]
    m = re.search(r"that is (\d+) bytes as measured now", str(r["reason"]))  # the quote less its margin
    smallest = int(m.group(1)) - 2**30 + DEFAULT_RESERVE if m else None
    return r, smallest


def level_for(model, smallest, coverage):
    """The limit whose arena holds about ``coverage`` of the routed experts."""
    return int(smallest + strict.DEFAULT_HEADROOM + coverage * epqlab.inspect(model).routed_expert_bytes)


# -- page cache (epqlab.memory's helpers, which the runner relies on) -----------------------------
def test_page_cache_bytes_follows_drop_and_reads(disk_dir):
    page = mmap.PAGESIZE
    size = 8 * MiB + 100  # the last page is partly past the end of the file
    path = disk_dir / "pc.bin"
    with open(path, "wb") as f:
        f.write(os.urandom(size))
    drop_page_cache(path)  # written back, then dropped
    assert page_cache_bytes(path) == 0

    # Read exactly 1 MiB at 2 MiB with readahead off: exactly those pages become resident.
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        assert len(os.pread(fd, MiB, 2 * MiB)) == MiB
    finally:
        os.close(fd)
    assert page_cache_bytes(path) == MiB
    assert page_cache_bytes(path, 2 * MiB, 3 * MiB) == MiB
    assert page_cache_bytes(path, 0, 2 * MiB) == 0
    assert page_cache_bytes(path, 3 * MiB) == 0
    assert page_cache_bytes(path, 2 * MiB + 10, 2 * MiB + 11) == page  # whole pages

    path.read_bytes()
    assert page_cache_bytes(path) == 8 * MiB + page  # every page, the partial last one whole
    drop_page_cache(path)
    assert page_cache_bytes(path) == 0


# -- the limit itself --------------------------------------------------------------------------
HOG = "b = bytearray({n}); b[::4096] = b'x' * len(b[::4096]); print('survived')"


@pytest.mark.parametrize("version", ["cgroup-v1", "cgroup-v2"])
def test_cgroup_limit_oom_kills_a_hog_and_spares_a_small_child(version):
    try:
        limits.make_limit(MiB, version).remove()
    except OSError as e:
        pytest.skip(f"no writable {version} memory cgroup here: {e}")
    lim = 64 * MiB
    r = limits.run_limited([sys.executable, "-c", HOG.format(n=2 * lim)], lim, mode=version)
    assert r.limit_mode == version
    assert r.killed and r.returncode == -9 and r.oom_kills >= 1, r
    assert r.reason.startswith("OOM-killed")
    assert "survived" not in r.stdout
    assert r.cgroup_peak is not None and r.cgroup_peak <= lim
    ok = limits.run_limited([sys.executable, "-c", HOG.format(n=lim // 4)], lim, mode=version)
    assert (ok.returncode, ok.killed, ok.oom_kills, ok.stdout.strip()) == (0, False, 0, "survived"), ok
    assert lim // 4 <= ok.cgroup_peak <= lim  # the bytearray was charged
    mine = f"epqlab-{os.getpid()}-"  # removed afterwards (other processes may hold their own)
    assert not any(p.name.startswith(mine) for p in limits.own_cgroup_dirs()[r.limit_mode].iterdir())


@needs_cgroup
def test_cgroup_limit_charges_page_cache(disk_dir):
    # Reading a file twice the limit through the page cache: the cgroup is charged for the cache,
    # hits its limit (failcnt) and reclaims it; the reader is not killed (page cache is reclaimable).
    lim = 64 * MiB
    path = disk_dir / "cache-hog.bin"
    with open(path, "wb") as f:
        for _ in range(2 * lim // MiB):
            f.write(os.urandom(MiB))
    drop_page_cache(path)
    code = f"f = open({str(path)!r}, 'rb')\nwhile f.read(1 << 20): pass\nprint('read')"
    r = limits.run_limited([sys.executable, "-c", code], lim)
    path.unlink()
    assert (r.returncode, r.killed, r.stdout.strip()) == (0, False, "read"), r
    assert 0.9 * lim <= r.cgroup_peak <= lim   # the cache filled the limit, never more
    assert r.failcnt > 0                       # and the limit was hit


@needs_cgroup
def test_headroom_counts_a_file_just_read_as_room(disk_dir):
    # A child in a 512 MiB cgroup reads a 64 MiB file it never read before: the cgroup is charged for its page
    # cache, but that clean cache is reclaimable, so the budget check's headroom must not drop by it (the
    # strict 4 GiB level once refused a trained-prefetch Session for a 84 MB predictor .npz just read).
    f = disk_dir / "cache64.bin"
    f.write_bytes(os.urandom(64 * MiB))
    drop_page_cache(f)
    code = textwrap.dedent(f"""
        from pathlib import Path
        from epqlab.memory.auto_budget import cgroup_headroom
        own = [l.split(":", 2)[2] for l in open("/proc/self/cgroup").read().splitlines() if "memory" in l.split(":")[1].split(",")]
        usage = lambda: int(open("/sys/fs/cgroup/memory" + own[0] + "/memory.usage_in_bytes").read()) if own else 0
        h0, u0 = cgroup_headroom()[0], usage()
        Path({str(f)!r}).read_bytes()
        h1, u1 = cgroup_headroom()[0], usage()
        print(h0 - h1, u1 - u0)
    """)
    r = limits.run_limited([sys.executable, "-c", code], 512 * MiB, mode="cgroup")
    assert r.returncode == 0, r.stderr[-2000:]
    dh, du = (int(x) for x in r.stdout.split())
    if r.limit_mode == "cgroup-v1":
        assert du >= 48 * MiB  # the read was charged ...
    assert dh < 16 * MiB, (dh, du)  # ... and is not counted against the headroom
    f.unlink()


def test_sampled_limit_kills_a_hog_and_spares_a_small_child(monkeypatch):
    monkeypatch.setenv("EPQLAB_LIMIT_MODE", "sampled")  # forced through the environment
    lim = 96 * MiB
    r = limits.run_limited([sys.executable, "-c", HOG.format(n=4 * lim) + "; import time; time.sleep(5)"], lim)
    assert r.limit_mode == "sampled" and r.cgroup_peak is None
    assert r.killed and r.returncode == -9, r
    assert r.reason.startswith("killed by the sampler")
    assert r.peak_charged > lim
    # it lives 0.3 s after allocating, so 20 ms samples see its peak
    ok = limits.run_limited([sys.executable, "-c", HOG.format(n=lim // 4) + "; import time; time.sleep(0.3)"], lim)
    assert (ok.returncode, ok.killed, ok.stdout.strip()) == (0, False, "survived"), ok
    assert lim // 4 <= ok.peak_rss_anon <= lim


def _hog_python(tmp_path: Path, n: int) -> str:
    """An 'interpreter' for strict.run that ignores its arguments and allocates n bytes."""
    p = tmp_path / "hog-python"
    p.write_text(f"#!/bin/sh\nexec {sys.executable} -c \"{HOG.format(n=n)}; import time; time.sleep(2)\"\n")
    p.chmod(p.stat().st_mode | stat.S_IXUSR)
    return str(p)


@pytest.mark.parametrize("mode", ["cgroup", "sampled"])
def test_runner_reports_a_killed_child_as_fail(model, tmp_path, mode):
    if mode == "cgroup" and CG_REASON is not None:
        pytest.skip(f"no writable memory cgroup here: {CG_REASON}")
    level = 96 * MiB
    df = strict.run(model, [level], repeats=1, limit_mode=mode, timeout_s=60,
                    python=_hog_python(tmp_path, 3 * level))
    r = df.iloc[0]
    assert r["status"] == "FAIL" and r["passed"] == 0
    assert r["reason"].startswith("OOM-killed" if mode == "cgroup" else "killed by the sampler"), r["reason"]
    assert r["cache_dropped"]


# -- the runner on the default model -----------------------------------------------------------
def test_budget_too_small_is_a_fail_row_naming_arena_too_small(too_small):
    # A 1 GiB reserve inside a 320 MiB level leaves no arena: the Session refuses, the row says why.
    r, smallest = too_small
    assert r["status"] == "FAIL" and r["passed"] == 0
    assert r["reason"].startswith("ArenaTooSmall: ") and "smallest budget that works is" in r["reason"]
    assert smallest is not None and smallest > 0
    assert r["decode_tok_s"] is None or r["decode_tok_s"] != r["decode_tok_s"]  # None/NaN: nothing measured
    assert r["cgroup_peak"] is None or r["cgroup_peak"] <= LEVEL


@needs_cgroup
def test_default_model_passes_under_a_cgroup_limit(model, too_small):
    # Arena about 30% of the routed experts; the limit is the budget + 16 MiB headroom (epqlab.studies.strict DEFAULT_HEADROOM).
    level = level_for(model, too_small[1], 0.3)
    df = strict.run(model, [level], n_predict=4, repeats=1, mmap_baseline=True, n_ctx=256)
    paged, mm = df.iloc[0], df.iloc[1]
    assert (paged["mode"], mm["mode"]) == ("paged", "mmap")
    mode = next(iter(limits.own_cgroup_dirs()))  # v1 first, as make_limit tries it
    for r in (paged, mm):
        assert r["status"] == "PASS", r["reason"]
        assert r["limit_mode"] == mode and level - mmap.PAGESIZE < r["limit_bytes"] <= level
        assert r["cache_dropped"]
        assert 0 < r["cgroup_peak"] <= r["limit_bytes"]
        assert r["failcnt"] is not None and r["decode_tok_s"] > 0
    assert paged["budget"] == level - strict.DEFAULT_HEADROOM
    assert paged["cgroup_peak"] >= paged["arena_bytes"] > 0   # the arena's shared memory is charged
    assert 0.1 < paged["coverage"] < 0.5                       # a real paging run, below half of the experts
    assert paged["ssd_mb_per_token"] > 0 and 0 <= paged["hit_rate"] < 1
    assert paged["same_text_as_mmap"] is True and paged["text"] == mm["text"]  # greedy text equals plain llama.cpp
    assert paged["speedup_vs_mmap"] == pytest.approx(paged["decode_tok_s"] / mm["decode_tok_s"])


def test_variants_run_interleaved_with_a_callback_between_rounds(model, too_small, monkeypatch):
    # Two named Session settings at one level, two rounds: the runs go round by round, each variant once per
    # round, and between_rounds(r) comes right after round r. Pipelined reads change only timing: same text.
    level = level_for(model, too_small[1], 0.3)
    events = []
    real = strict._run_one

    def spy(model_, level_, budget, pager, **kw):
        events.append(("run", kw["session_kw"].get("pipeline_reads", True)))
        return real(model_, level_, budget, pager, **kw)

    monkeypatch.setattr(strict, "_run_one", spy)
    df = strict.run(model, [level], n_predict=3, repeats=2, n_ctx=256,
                    variants={"pipelined": {}, "serial": {"pipeline_reads": False}},
                    between_rounds=lambda r: events.append(("round", r)))
    assert events == [("run", True), ("run", False), ("round", 0), ("run", True), ("run", False), ("round", 1)]
    assert list(df["variant"]) == ["pipelined", "serial"] and list(df["runs"]) == [2, 2]
    assert all(df["status"] == "PASS"), list(df["reason"])
    assert df.iloc[0]["text"] == df.iloc[1]["text"]
    assert [(x["repeat"], x["variant"]) for x in df.attrs["runs"]] == [
        (0, "pipelined"), (0, "serial"), (1, "pipelined"), (1, "serial")]
    assert df.attrs["variants"] == {"pipelined": {}, "serial": {"pipeline_reads": False}}


def test_bad_arguments_are_clear_errors(model):
    with pytest.raises(ValueError, match="repeats must be >= 1"):
        strict.run(model, [LEVEL], repeats=0)
    with pytest.raises(ValueError, match="not above the headroom"):
        strict.run(model, ["8MiB"])
    with pytest.raises(ValueError, match="not a byte count"):
        strict.run(model, "3 lots")
    with pytest.raises(ValueError, match="unknown limit mode"):
        limits.run_limited(["true"], LEVEL, mode="cgroup-v3")
    assert strict.parse_levels("2GiB, 512MiB") == [512 * MiB, 2 * 2**30]


# -- CLI and notebook --------------------------------------------------------------------------
def test_cli_strict_json_sampled(model, too_small, tmp_path, capsys):
    from epqlab.cli import main

    level = level_for(model, too_small[1], 0.5) // MiB * MiB
    out = tmp_path / "strict.json"
    rc = main(["strict", str(model), "--levels", f"{level // MiB}MiB", "--repeats", "1", "-n", "4",
               "--n-ctx", "256", "--limit-mode", "sampled", "--json", str(out), "-q"])
    printed = capsys.readouterr().out
    assert rc == 0
    doc = json.loads(out.read_text())
    (row,) = doc["rows"]
    assert row["status"] == "PASS" and row["limit_mode"] == "sampled" and row["cgroup_peak"] is None
    assert row["level"] == level and row["budget"] == level - strict.DEFAULT_HEADROOM
    assert 0 < row["peak_rss"] <= level + row["peak_rss_shmem"]  # shared arena may be counted twice in RSS
    assert doc["parameters"]["n_predict"] == 4 and len(doc["runs"]) == 1
    assert epqlab.fmt_bytes(level) in printed and "PASS" in printed and "sampled" in printed
    assert doc["reading"] in printed


def test_notebook_05_two_levels(model, too_small, tmp_path):
    lo, hi = level_for(model, too_small[1], 0.5), level_for(model, too_small[1], 0.9)
    r = run_notebook("05_memory_levels", {"model": model, "levels": [lo, hi], "n_predict": 4, "repeats": 1,
                                          "mmap_baseline": True, "session_kw": {"n_ctx": 256}}, tmp_path)
    assert r["parameters"]["levels"] == [lo, hi] and r["parameters"]["repeats"] == 1
    rows = r["rows"]
    assert [(x["level"], x["mode"]) for x in rows] == [(lo, "paged"), (lo, "mmap"), (hi, "paged"), (hi, "mmap")]
    assert all(x["status"] == "PASS" for x in rows), [x["reason"] for x in rows]
    p0, p1 = rows[0], rows[2]
    # a higher level buys a bigger arena, by about the difference (slots are whole experts)
    assert p1["arena_bytes"] - p0["arena_bytes"] == pytest.approx(hi - lo, abs=4 * MiB)
    for x in (p0, p1):
        assert x["speedup_vs_mmap"] == pytest.approx(x["decode_tok_s"] / x["mmap_decode_tok_s"])
    out = Path(tmp_path) / "results" / "05_memory_levels"
    assert (out / "test.png").stat().st_size > 10_000 and (out / "test.csv").is_file()
    assert f"passes at {epqlab.fmt_bytes(lo)}, {epqlab.fmt_bytes(hi)}" in r["reading"]


def test_cli_strict_teacher_forced_with_route_replay(model, too_small, tmp_path):
    """--teacher-forced feeds the held-out prose (its tokens are the run's tokens); --simulate-routes adds
    LRU and Belady replays of the run's routes (Belady >= LRU: it is the offline optimum) and the prefill's
    distinct-expert bytes (the arena starts empty, so the prefill reads each of them at least once)."""
    from epqlab.cli import main
    from epqlab.data import heldout_texts

    level = level_for(model, too_small[1], 0.5) // MiB * MiB
    out = tmp_path / "strict.json"
    rc = main(["strict", str(model), "--levels", f"{level // MiB}MiB", "--repeats", "1", "-n", "6", "--n-ctx", "256",
               "--limit-mode", "sampled", "--teacher-forced", "--simulate-routes", "--json", str(out), "-q"])
    assert rc == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["status"] == "PASS" and row["teacher_forced"] is True
    with epqlab.Session(model, pager=False, n_ctx=256) as s:
        want = s.tokenize(heldout_texts()["prose"], add_special=False)[:6]
    assert row["tokens"] == want
    assert 0 <= row["sim_lru_hit_rate"] <= row["sim_belady_hit_rate"] <= 1
    assert 0 < row["prefill_distinct_expert_bytes"] <= row["prefill_ssd_bytes"]
    # the hook's per-ubatch unions sum over the prompt's logits blocks: never below the distinct experts
    assert row["prefill_distinct_expert_bytes"] <= row["prefill_union_bytes"] <= row["prefill_ssd_bytes"]
