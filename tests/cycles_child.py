"""Open/generate/close cycles of paged Sessions, one architecture after another in one process
(tests/test_session_cycles.py). Nothing may grow from one Session to the next: a Jupyter kernel or a sweep
worker opens many.

Usage: ``python tests/cycles_child.py ROWS_JSON DIR N_CYCLES``, ROWS_JSON = ``[[row, arch, knobs], ...]``.
For each row: writes the tiny model of ``arch`` with ``knobs`` (epqlab.models.archs.write_tiny), opens two warm-up
Sessions (the first generation imports modules and maps libraries once per process), reads the usage before
the arena (``used_before_arena``) from the second, then opens ``N_CYCLES`` Sessions under a ``ram_budget`` that
leaves an arena of about half of all expert slots, each generating 4 tokens and closed, and records after each
close RssAnon (after ``gc.collect`` and ``malloc_trim``) and the arena the budget gave that Session. Prints one
JSON line per row: ``{"row", "rss_anon": [bytes...], "arena": [bytes...], "all_experts": bytes}`` or
``{"row", "error": "..."}``.
"""
from __future__ import annotations

import ctypes
import gc
import json
import sys
from pathlib import Path

import epqlab
from epqlab.models.archs import write_tiny

PROMPT = "The arena keeps the experts the router picks; the rest stay on disk."
KW = dict(n_threads=1, n_ctx=256)
_libc = ctypes.CDLL("libc.so.6")


def rss_anon() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


def settle() -> int:
    gc.collect()
    _libc.malloc_trim(0)
    return rss_anon()


def one(path: Path, **kw) -> dict:
    with epqlab.Session(path, **KW, **kw) as s:
        s.generate(PROMPT, 4)
        return s.memory_parts()


def cycles(row: str, arch: str, knobs: dict, folder: Path, n: int) -> dict:
    path = write_tiny(folder / f"{row}.gguf", arch, **knobs)
    lay = epqlab.inspect(path)
    all_experts = sum(lay.n_expert * layer.expert_bytes for layer in lay.layers)
    one(path)
    parts = one(path)
    # an arena of about half the expert bytes: budget = usage before the arena + reserve + read buffers + half
    budget = int(parts["used_before_arena"] + parts["reserve"] + parts["read_buffers"] + all_experts // 2)
    rss, arena = [], []
    for _ in range(n):
        p = one(path, ram_budget=budget)
        rss.append(settle())
        arena.append(int(p["arena"]))
    return {"row": row, "rss_anon": rss, "arena": arena, "all_experts": all_experts, "budget": budget}


def main() -> None:
    rows, folder, n = json.loads(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
    for row, arch, knobs in rows:
        try:
            out = cycles(row, arch, knobs, folder, n)
        except Exception as e:  # one row's refusal must not hide the others' figures
            out = {"row": row, "error": f"{type(e).__name__}: {e}"}
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
