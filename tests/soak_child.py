"""Child of tests/test_soak.py: N open/generate/close cycles of a paged Session at its smallest
arena; prints one JSON line before the first Session (after ``inspect``) and one per cycle with RSS (bytes), open file descriptors and threads
(psutil) measured after close, then ``done``.

    python tests/soak_child.py MODEL N_CYCLES
"""
from __future__ import annotations

import gc
import json
import sys

import psutil

import epqlab


def main(model: str, n: int) -> None:
    proc = psutil.Process()
    from epqlab.engine.native import core  # noqa: F401  (the engine and libllama: what they open stays open)

    lay = epqlab.inspect(model)
    arena = epqlab.Pager.min_arena_bytes(lay)
    first = None
    print(json.dumps({"base": True, "rss": proc.memory_info().rss, "fds": proc.num_fds(), "threads": proc.num_threads()}),
          flush=True)
    for i in range(n):
        with epqlab.Session(model, arena_bytes=arena, n_threads=1, io_threads=3, n_ctx=256) as s:
            g = s.generate([1, 2, 3, 4, 5], 4)
            assert s.stats["evictions"] > 0, "the arena must page"
        del s
        gc.collect()
        first = first or g.tokens
        assert g.tokens == first, (i, g.tokens, first)
        print(json.dumps({"cycle": i, "rss": proc.memory_info().rss, "fds": proc.num_fds(),
                          "threads": proc.num_threads()}), flush=True)
    print("done", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
