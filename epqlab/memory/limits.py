"""Hard memory limits for a child process, and the page cache of a file.

:func:`run_limited` starts a command under a memory limit that is in force *before* the command
runs, and reports how much memory it took and whether the limit killed it. Three ways, tried in
this order (``limit_mode``):

- ``"cgroup-v1"``: a child of this process's own memory cgroup (``/proc/self/cgroup`` line
  ``N:memory:/path``, mounted at ``/sys/fs/cgroup/memory/path``) with ``memory.limit_in_bytes``
  (and, when the machine has swap, ``memory.memsw.limit_in_bytes`` too, so the limit cannot be
  dodged by swapping; without swap it is left alone: with it set, Linux 6.18 stopped counting limit
  hits in ``memory.failcnt``). The kernel charges anonymous memory, shared memory (memfd, tmpfs)
  *and the page cache the child faults in* (kernel docs: admin-guide/cgroup-v1/memory.rst §2.2), and
  OOM-kills the child when reclaim cannot keep it under the limit. Peak:
  ``memory.max_usage_in_bytes``; times the limit was hit: ``memory.failcnt`` (+
  ``memory.memsw.failcnt``); kills: ``oom_kill`` in ``memory.oom_control``.
- ``"cgroup-v2"``: the same with ``memory.max`` (and ``memory.swap.max = 0``); peak from
  ``memory.peak`` (kernel >= 5.19), limit hits from ``max`` and kills from ``oom_kill`` in
  ``memory.events`` (admin-guide/cgroup-v2.rst "Memory Interface Files").
- ``"sampled"``: no writable cgroup. The parent reads ``/proc/<pid>/status`` every 20 ms and sends
  SIGKILL once RssAnon + RssShmem + RssFile exceeds the limit, confirmed with
  ``/proc/<pid>/smaps_rollup`` as RssAnon + RssFile + Pss_Shmem (a memfd mapped twice in one
  process -- the pager's arena and its mirror -- counts twice in RssShmem but once in
  Pss_Shmem, as it does in a cgroup). Bursts shorter than 20 ms can pass unseen, and the page
  cache the child fills but no longer maps is not counted: a weaker limit than a cgroup's.

In every mode the parent also samples RssAnon / RssShmem / RssFile every 20 ms and reports their
peaks. Force a mode with ``mode=`` or the environment variable ``EPQLAB_LIMIT_MODE``
(``auto`` | ``cgroup`` | ``cgroup-v1`` | ``cgroup-v2`` | ``sampled``).

The page-cache helpers the strict runner uses (drop a file, measure what of it is cached) are
:func:`epqlab.memory.drop_page_cache` and :func:`epqlab.memory.page_cache_bytes`.
"""
from __future__ import annotations

import itertools
import mmap
import os
import signal
import subprocess
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .usage import sample

SAMPLE_INTERVAL_S = 0.02  # parent's sampling period (s), as in seed 000's strict_bench.py
MODES = ("auto", "cgroup", "cgroup-v1", "cgroup-v2", "sampled")
_counter = itertools.count()


# -- process memory -----------------------------------------------------------------------------
def _status(pid: int) -> tuple[int, int, int] | None:
    """(RssAnon, RssShmem, RssFile) of ``pid`` in bytes (:func:`epqlab.memory.sample`), or None
    once it is gone."""
    try:
        m = sample(pid)
    except (FileNotFoundError, ProcessLookupError):
        return None
    return m.rss_anon, m.rss_shmem, m.rss_file


def charged_bytes(pid: int) -> int | None:
    """RssAnon + RssFile + Pss_Shmem of ``pid`` (bytes) from /proc/<pid>/smaps_rollup: the
    resident set with shared memory mapped twice in the process counted once. None if gone."""
    vals = {"Rss": 0, "Pss_Shmem": 0, "Pss_Anon": 0}
    st = _status(pid)
    if st is None:
        return None
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            text = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    for line in text.splitlines():
        key = line.split(":", 1)[0]
        if key in vals:
            vals[key] = int(line.split()[1]) * 1024
    if "Pss_Shmem" not in text:  # kernels < 5.x: no split; fall back to the double-counting sum
        return sum(st)
    return st[0] + st[2] + vals["Pss_Shmem"]


# -- cgroups ------------------------------------------------------------------------------------
def _mounts() -> list[tuple[str, str, str]]:
    out = []
    try:
        with open("/proc/self/mounts") as f:
            for line in f:
                p = line.split()
                if len(p) >= 4 and p[2] in ("cgroup", "cgroup2"):
                    out.append((p[1], p[2], p[3]))
    except OSError:
        pass
    return out


def own_cgroup_dirs() -> dict[str, Path]:
    """Directories of this process's own memory cgroup: ``{"cgroup-v1": ..., "cgroup-v2": ...}``
    for each hierarchy that is mounted and has the memory controller (either may be absent)."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return {}
    out: dict[str, Path] = {}
    mounts = _mounts()
    for line in lines:
        hid, ctrls, path = line.split(":", 2)
        if "memory" in ctrls.split(","):
            for mnt, typ, opts in mounts:
                if typ == "cgroup" and "memory" in opts.split(","):
                    out["cgroup-v1"] = Path(mnt + path.rstrip("/"))
                    break
        elif hid == "0" and ctrls == "":
            for mnt, typ, _ in mounts:
                if typ == "cgroup2":
                    d = Path(mnt + path.rstrip("/"))
                    if "memory" in _read(d / "cgroup.subtree_control", "").split():
                        out["cgroup-v2"] = d
                    break
    return out


def _swap_total() -> int:
    """SwapTotal from /proc/meminfo, bytes (0 when unreadable)."""
    for line in (_read(Path("/proc/meminfo")) or "").splitlines():
        if line.startswith("SwapTotal:"):
            return int(line.split()[1]) * 1024
    return 0


def _read(p: Path, default=None):
    try:
        return p.read_text()
    except OSError:
        return default


def _kv(text: str | None) -> dict[str, int]:
    out = {}
    for line in (text or "").splitlines():
        p = line.split()
        if len(p) == 2 and p[1].lstrip("-").isdigit():
            out[p[0]] = int(p[1])
    return out


class CgroupLimit:
    """A fresh child memory cgroup with a hard limit; remove it with :meth:`remove`.

    Raises OSError (e.g. PermissionError) when it cannot be created or the limit cannot be set."""

    def __init__(self, parent: Path, version: str, limit_bytes: int):
        self.version = version
        self.limit_bytes = int(limit_bytes)
        self.dir = parent / f"epqlab-{os.getpid()}-{next(_counter)}"
        self.dir.mkdir()
        try:
            if version == "cgroup-v1":
                (self.dir / "memory.limit_in_bytes").write_text(str(self.limit_bytes))
                sw = self.dir / "memory.memsw.limit_in_bytes"
                if sw.exists() and _swap_total() > 0:
                    try:
                        sw.write_text(str(self.limit_bytes))
                    except OSError:
                        pass
                got = int((self.dir / "memory.limit_in_bytes").read_text())
            else:
                (self.dir / "memory.max").write_text(str(self.limit_bytes))
                try:
                    (self.dir / "memory.swap.max").write_text("0")
                except OSError:
                    pass
                got = int((self.dir / "memory.max").read_text())
            if got > self.limit_bytes:
                raise OSError(f"{self.dir} did not take the limit {self.limit_bytes} (reads {got})")
            self.limit_bytes = got  # the kernel rounds down to a page multiple
        except BaseException:
            self.remove()
            raise

    @property
    def procs(self) -> Path:
        return self.dir / "cgroup.procs"

    def readings(self) -> dict:
        """``cgroup_peak`` (bytes), ``failcnt`` (times the limit was hit), ``oom_kills``."""
        if self.version == "cgroup-v1":
            peak = _read(self.dir / "memory.max_usage_in_bytes")
            # With swap accounting the mem+swap counter is charged first, so a hit of that (equal)
            # limit is counted in memsw.failcnt instead of failcnt: the two are disjoint, add them.
            fail = [int(x) for x in (_read(self.dir / "memory.failcnt"), _read(self.dir / "memory.memsw.failcnt")) if x]
            oom = _kv(_read(self.dir / "memory.oom_control")).get("oom_kill")
            return {"cgroup_peak": int(peak) if peak else None, "failcnt": sum(fail) if fail else None,
                    "oom_kills": oom}
        peak = _read(self.dir / "memory.peak")
        ev = _kv(_read(self.dir / "memory.events"))
        return {"cgroup_peak": int(peak) if peak and peak.strip().isdigit() else None,
                "failcnt": ev.get("max"), "oom_kills": ev.get("oom_kill")}

    def remove(self) -> None:
        """rmdir the cgroup (its remaining page-cache charges move to the parent). Retries briefly
        while the kernel finishes releasing the exited child."""
        for i in range(50):
            try:
                self.dir.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.02 * (i + 1) if i < 10 else 0.2)


def make_limit(limit_bytes: int, mode: str = "auto") -> CgroupLimit | None:
    """A :class:`CgroupLimit` for ``mode`` (``auto`` tries v1 then v2; ``cgroup`` likewise but
    raises when neither works), or None for ``sampled`` or when auto finds no writable cgroup.

    Raises:
        ValueError: unknown mode.
        OSError: a cgroup mode was asked for explicitly and cannot be set up (the message says why).
    """
    mode = mode or "auto"
    if mode not in MODES:
        raise ValueError(f"unknown limit mode {mode!r}; choose one of {', '.join(MODES)}")
    if mode == "sampled":
        return None
    dirs = own_cgroup_dirs()
    want = ["cgroup-v1", "cgroup-v2"] if mode in ("auto", "cgroup") else [mode]
    errors = []
    for v in want:
        if v not in dirs:
            errors.append(f"{v}: no memory controller for this process")
            continue
        try:
            return CgroupLimit(dirs[v], v, limit_bytes)
        except OSError as e:
            errors.append(f"{v}: {dirs[v]}: {e}")
    if mode == "auto":
        return None
    raise OSError(f"cannot set a {mode} memory limit ({'; '.join(errors)}); use mode='sampled' or run as a user "
                  "allowed to create child cgroups")


def cgroup_unavailable_reason() -> str | None:
    """None when a child memory cgroup can be created here, else why not (for skips and logs)."""
    try:
        lim = make_limit(64 * 2**20, "cgroup")
    except OSError as e:
        return str(e)
    lim.remove()
    return None


# -- running a child ----------------------------------------------------------------------------
@dataclass
class LimitedRun:
    """What :func:`run_limited` observed. Bytes unless stated.

    ``returncode`` is the child's exit status (negative: killed by that signal). ``killed`` is
    True when the limit ended the child: a cgroup OOM kill or the sampler's SIGKILL; ``reason``
    says which in words. ``peak_rss_*`` are the sampled peaks of /proc/<pid>/status (every 20 ms;
    ``peak_rss`` is the peak of their sum). ``cgroup_peak`` / ``failcnt`` / ``oom_kills`` are None
    in sampled mode."""

    limit_mode: str
    limit_bytes: int
    returncode: int | None = None
    killed: bool = False
    reason: str | None = None
    timed_out: bool = False
    wall_s: float = 0.0
    peak_rss_anon: int = 0
    peak_rss_shmem: int = 0
    peak_rss_file: int = 0
    peak_rss: int = 0
    peak_charged: int = 0
    cgroup_peak: int | None = None
    failcnt: int | None = None
    oom_kills: int | None = None
    stdout: str = field(default="", repr=False)
    stderr: str = field(default="", repr=False)

    def as_dict(self) -> dict:
        return asdict(self)


_JOIN = 'echo $$ > "$0" || exit 97; exec "$@"'  # join the cgroup, then become the command (same pid)
JOIN_FAILED = 97


def run_limited(argv: list[str], limit_bytes: int, *, mode: str | None = None, timeout_s: float | None = None,
                env: dict | None = None, cwd=None, interval_s: float = SAMPLE_INTERVAL_S) -> LimitedRun:
    """Run ``argv`` under a hard memory limit of ``limit_bytes`` and report what happened.

    The child joins its cgroup before ``exec`` (a ``/bin/sh`` that writes its pid to
    ``cgroup.procs`` and then execs ``argv``), so everything the command maps, allocates or reads
    through the page cache is charged. The cgroup is removed afterwards. stdout/stderr are
    captured. Never raises for what the child does (killed, crashed, timed out): see the result.

    Args:
        argv: the command.
        limit_bytes: the limit (bytes; the kernel rounds a cgroup limit down to a page multiple).
        mode: ``auto`` (default; ``$EPQLAB_LIMIT_MODE`` when set) | ``cgroup`` | ``cgroup-v1`` |
            ``cgroup-v2`` | ``sampled``.
        timeout_s: kill the child after this many seconds (``timed_out``).
        interval_s: sampling period (default 20 ms).

    Raises:
        ValueError: unknown mode, limit_bytes < 1 page.
        OSError: an explicitly requested cgroup mode is unavailable.
    """
    limit_bytes = int(limit_bytes)
    if limit_bytes < mmap.PAGESIZE:
        raise ValueError(f"limit_bytes must be at least one page ({mmap.PAGESIZE}), got {limit_bytes}")
    mode = mode or os.environ.get("EPQLAB_LIMIT_MODE") or "auto"
    cg = make_limit(limit_bytes, mode)
    res = LimitedRun(cg.version if cg else "sampled", cg.limit_bytes if cg else limit_bytes)
    cmd = ["/bin/sh", "-c", _JOIN, str(cg.procs), *argv] if cg else list(argv)
    t0 = time.perf_counter()
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=cwd,
                                text=True, errors="replace")
        out: dict[str, str] = {}
        readers = [threading.Thread(target=lambda k, s: out.__setitem__(k, s.read()), args=(k, s), daemon=True)
                   for k, s in (("stdout", proc.stdout), ("stderr", proc.stderr))]
        for t in readers:
            t.start()
        deadline = None if timeout_s is None else t0 + timeout_s
        while proc.poll() is None:
            st = _status(proc.pid)
            if st is not None:
                res.peak_rss_anon = max(res.peak_rss_anon, st[0])
                res.peak_rss_shmem = max(res.peak_rss_shmem, st[1])
                res.peak_rss_file = max(res.peak_rss_file, st[2])
                res.peak_rss = max(res.peak_rss, sum(st))
                if cg is None and sum(st) > res.limit_bytes:
                    charged = charged_bytes(proc.pid)
                    if charged is not None:
                        res.peak_charged = max(res.peak_charged, charged)
                    if charged is not None and charged > res.limit_bytes:
                        _kill(proc)
                        res.killed = True
                        res.reason = (f"killed by the sampler: resident {charged} bytes (RssAnon+RssFile+Pss_Shmem) "
                                      f"> limit {res.limit_bytes}")
                        break
            if deadline is not None and time.perf_counter() > deadline:
                _kill(proc)
                res.timed_out = True
                res.reason = f"timed out after {timeout_s:.0f} s"
                break
            time.sleep(interval_s)
        proc.wait()
        for t in readers:
            t.join()
        res.wall_s = time.perf_counter() - t0
        res.returncode = proc.returncode
        res.stdout, res.stderr = out.get("stdout", ""), out.get("stderr", "")
        if cg is not None:
            r = cg.readings()
            res.cgroup_peak, res.failcnt, res.oom_kills = r["cgroup_peak"], r["failcnt"], r["oom_kills"]
            if proc.returncode == JOIN_FAILED and not res.stdout:
                res.reason = f"could not join the cgroup {cg.dir}: {res.stderr.strip()[-200:]}"
            elif res.oom_kills and not res.timed_out:
                res.killed = True
                res.reason = (f"OOM-killed by the {res.limit_mode} limit of {res.limit_bytes} bytes "
                              f"(signal {-proc.returncode if proc.returncode < 0 else proc.returncode}, "
                              f"oom_kill {res.oom_kills}, failcnt {res.failcnt})")
        if res.peak_charged == 0:
            res.peak_charged = res.peak_rss
    finally:
        if cg is not None:
            cg.remove()
    return res


def _kill(proc: subprocess.Popen) -> None:
    try:
        proc.send_signal(signal.SIGKILL)
    except ProcessLookupError:
        pass
