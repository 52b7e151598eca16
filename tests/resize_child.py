"""A paged Session that shrinks and grows its arena inside a memory cgroup (tests/test_resize.py).

Usage: ``python tests/resize_child.py MODEL``. Opens ``MODEL`` with a budget whose arena holds every expert,
then resizes to a budget whose arena is about 1/8 of that, then back. After each step prints the cgroup's
charge (``memory.usage_in_bytes`` on cgroup v1, ``memory.current`` on v2, of this process's own cgroup: the
test runs it in a fresh one) and the arena's bytes. One JSON line:
``{"usage": [open, shrunk, grown], "arena": [open, shrunk, grown], "resident": [...]}``.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import psutil

import epqlab
from epqlab.engine.arena_resize import budget_for_arena


def cgroup_usage() -> int:
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, ctrl, path = line.split(":", 2)
        if ctrl == "memory":
            return int((Path("/sys/fs/cgroup/memory") / path.lstrip("/") / "memory.usage_in_bytes").read_text())
        if ctrl == "" and line.startswith("0::"):
            return int((Path("/sys/fs/cgroup") / path.lstrip("/") / "memory.current").read_text())
    raise RuntimeError("no memory cgroup in /proc/self/cgroup")


def main(model: str) -> None:
    lay = epqlab.inspect(model)
    big = psutil.Process().memory_info().rss + 768 * 2**20
    with epqlab.Session(model, ram_budget=big, n_threads=1, io_threads=2, n_ctx=256) as s:
        s.generate("The arena keeps the experts the router picks.", n_predict=4)
        small = budget_for_arena(s, max(epqlab.Pager.all_experts_bytes(lay) // 8, epqlab.Pager.max_stage_bytes(lay),
                           epqlab.Pager.min_arena_bytes(lay), s.pager.min_resize_bytes))
        out = {"usage": [cgroup_usage()], "arena": [s.pager.arena_bytes], "resident": [s.pager.arena_resident_bytes]}
        for b in (small, big):
            s.resize(b)
            out["usage"].append(cgroup_usage())
            out["arena"].append(s.pager.arena_bytes)
            out["resident"].append(s.pager.arena_resident_bytes)
        print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1])
