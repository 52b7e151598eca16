"""One row of the MTP speculation bench (bench/bench_mtp.py) in its own process, meant to run under a memory limit
(:func:`epqlab.memory.limits.run_limited`): ``python -m epqlab.studies.speculative_child SPEC OUT``.

SPEC is a JSON file ``{"model", "ram_budget" (bytes or null), "n_predict", "prompt_tokens", "accept" (a, or null for
a run without speculation), "draft_max", "seed", "session_kw"}``; the child opens a Session (``speculative="mtp"``
when ``accept`` is given), runs :func:`epqlab.studies.speculative.measure` and writes OUT (JSON): ``status``
(``PASS`` | ``FAIL``), ``reason``, ``row``, ``memory`` (:meth:`epqlab.Session.memory_parts`), ``arena_bytes``,
``load_s``. Exit status: 0 PASS, 1 otherwise. A child killed by its memory limit writes nothing.
"""
from __future__ import annotations

import sys

from ..engine.session import Session
from .child_run import run_child
from .speculative import measure


def _row(spec: dict, res: dict) -> None:
    accept = spec.get("accept")
    kw = dict(spec.get("session_kw", {}))
    if accept is not None:
        kw.update(speculative="mtp", draft_max=int(spec["draft_max"]))
    with Session(spec["model"], ram_budget=spec.get("ram_budget"), **kw) as s:
        res["row"] = measure(s, int(spec["n_predict"]), accept=accept, prompt_tokens=int(spec.get("prompt_tokens", 32)),
                             seed=int(spec.get("seed", 0)), window=int(spec.get("window", 0)))
        res["memory"] = s.memory_parts()
        res["load_s"] = s.load_s
        res["arena_bytes"] = s.pager.arena_bytes if s.pager else 0
        res["peak_total"] = s.peak.peak_total


def main(argv: list[str]) -> int:
    return run_child(argv, _row)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
