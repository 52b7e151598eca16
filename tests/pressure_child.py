"""A Session with ``follow_memory=True`` decoding while a memory hog in the same cgroup takes memory and gives
it back (tests/test_resize.py; the test runs this in a fresh memory cgroup).

Usage: ``python tests/pressure_child.py MODEL HOG_MIB N_TOKENS``. Greedy-decodes ``N_TOKENS`` tokens of
tests/exact.py's prompt; at token 8 starts a hog process (a child, so in the same cgroup) that allocates and
touches ``HOG_MIB`` MiB; keeps decoding until the follower has shrunk the arena, then ends the hog, and keeps
decoding until the arena has grown back or the tokens run out (padding with more tokens is not needed: the
follower looks between steps, and the grow hold is set to 0.5 s here). Prints one JSON line: ``{"tokens":
[ids], "arena": [bytes after each token], "events": [ResizeEvent dicts], "hog_at": i, "hog_end": j}``.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time

import epqlab
from epqlab.engine import arena_resize

HOG = "import sys,time; b=bytearray({n}); [b.__setitem__(i,1) for i in range(0,len(b),4096)]; print('up',flush=True); sys.stdin.read()"


def main(model: str, hog_mib: int, n_tokens: int) -> None:
    arena_resize.GROW_HOLD_S = 0.5  # the test's clock: grow back soon after the hog ends
    from exact import PROMPT, THREADS  # tests/ is the script's directory, so on sys.path

    with epqlab.Session(model, ram_budget="auto", follow_memory=True, n_threads=THREADS, io_threads=2,
                        n_ctx=512) as s:
        toks = s.tokenize(PROMPT)
        arena, hog, hog_at, hog_end = [], None, None, None
        full = s.pager.arena_bytes
        gen = s.stream(toks, n_predict=n_tokens, temperature=0.0)
        for i, _ in enumerate(gen):
            arena.append(s.pager.arena_bytes)
            if i == 8:
                hog = subprocess.Popen([sys.executable, "-c", HOG.format(n=hog_mib * 2**20)], stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, text=True)
                hog.stdout.readline()  # its pages are touched
                hog_at = i
            if hog is not None and hog_end is None and s.pager.arena_bytes < full:
                hog.stdin.close()  # the hog exits and its memory goes back
                hog.wait()
                hog_end = i
            if hog_end is not None and s.pager.arena_bytes == full:
                break
            time.sleep(0.02)  # the follower looks every 0.25 s: a few looks per phase
        ids = list(gen.tokens)
        gen.close()
        if hog is not None and hog.poll() is None:
            hog.kill()
        print(json.dumps({"tokens": ids, "arena": arena, "full": full, "hog_at": hog_at, "hog_end": hog_end,
                          "psi": arena_resize.read_psi(),
                          "events": [e.as_dict() for e in s.resize_events]}))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
