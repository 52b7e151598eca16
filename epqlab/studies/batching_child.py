"""One row of the batching bench (bench/bench_batching.py) in its own process, meant to run under a memory
limit (:func:`epqlab.memory.limits.run_limited`): ``python -m epqlab.studies.batching_child SPEC OUT``.

SPEC is a JSON file ``{"model", "ram_budget" (bytes or null), "batch", "n_predict", "teacher_forced",
"prompt_tokens", "session_kw"}``; the child opens a Session with ``n_seq_max = batch``, runs
:func:`epqlab.studies.batching.measure` and writes OUT (JSON): ``status`` (``PASS`` | ``FAIL``), ``reason``,
``row`` (the measured row), ``memory`` (:meth:`epqlab.Session.memory_parts`), ``load_s``. Exit status: 0 PASS,
1 otherwise. A child killed by its memory limit writes nothing; the parent reports that.
"""
from __future__ import annotations

import sys

from ..engine.session import Session
from .batching import measure
from .child_run import run_child


def _row(spec: dict, res: dict) -> None:
    with Session(spec["model"], ram_budget=spec.get("ram_budget"), n_seq_max=int(spec["batch"]),
                 **spec.get("session_kw", {})) as s:
        res["row"] = measure(s, int(spec["batch"]), int(spec["n_predict"]),
                             teacher_forced=bool(spec.get("teacher_forced", True)),
                             prompt_tokens=int(spec.get("prompt_tokens", 32)))
        res["memory"] = s.memory_parts()
        res["load_s"] = s.load_s
        res["arena_bytes"] = s.pager.arena_bytes if s.pager else 0


def main(argv: list[str]) -> int:
    return run_child(argv, _row)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
