"""Soak: 50 open/generate/close cycles of a paged Session at its smallest arena (the tiny MoE
with a 512-token vocabulary, split in two shards; a cycle takes well under a second). After the first 5 cycles
(allocator and library warm-up) RSS may grow by at most 4 MiB in total, and after every close
the process is back to the file descriptors and threads it had before the first Session
(measured with psutil in a child process, so nothing else in pytest moves the numbers).
One compute thread: with more, ggml's OpenMP pool keeps its workers for the process's life
after the first decode (plain llama.cpp does the same, pager=False), which is not a leak."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent
MiB = 2**20
N = 50
WARMUP = 5


def test_open_generate_close_cycles_leak_nothing(mini_gguf, tmp_path):
    from ggufs import split_gguf

    model = split_gguf(mini_gguf, tmp_path / "soak", 2)[0]  # two shards: two pager fds, two llama mappings
    r = subprocess.run([sys.executable, str(HERE / "soak_child.py"), str(model), str(N)], capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0 and r.stdout.rstrip().endswith("done"), r.stderr[-3000:]
    base, *rows = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert base.get("base") and len(rows) == N
    growth = rows[-1]["rss"] - rows[WARMUP - 1]["rss"]
    assert growth <= 4 * MiB, f"RSS grew {growth / MiB:.2f} MiB over cycles {WARMUP}..{N}: " + \
        ", ".join(f"{r['rss'] / MiB:.1f}" for r in rows)
    # nothing left open: a Session's model fds, the pager's shard fds, memfd, and the I/O and
    # compute threads all go with close()
    assert {r["fds"] for r in rows} == {base["fds"]}, (base, rows[:3], rows[-3:])
    assert {r["threads"] for r in rows} == {base["threads"]}, (base, rows[:3], rows[-3:])
