"""The protocol of a bench row run in its own process under a memory limit (``python -m epqlab.studies.<x>_child SPEC
OUT``; :func:`epqlab.memory.limits.run_limited` runs it): read SPEC (JSON), run the row, write OUT (JSON) with
``status`` ``PASS`` | ``FAIL``, ``reason`` and ``traceback`` on failure. Exit status 0 for PASS, 1 otherwise; a child
killed by its limit writes nothing, and the parent reports that."""
from __future__ import annotations

import json
import traceback
from collections.abc import Callable

from ..results import clean_json


def run_child(argv: list[str], row: Callable[[dict, dict], None]) -> int:
    """``argv`` = [SPEC path, OUT path]; ``row(spec, res)`` fills ``res`` (any exception becomes a FAIL row)."""
    spec_path, out_path = argv
    with open(spec_path) as f:
        spec = json.load(f)
    res: dict = {"status": "FAIL", "reason": None}
    try:
        row(spec, res)
        res["status"] = "PASS"
    except Exception as e:  # noqa: BLE001 - reported in OUT, the parent makes it a FAIL row
        res["reason"] = f"{type(e).__name__}: {e}"
        res["traceback"] = traceback.format_exc()[-4000:]
    with open(out_path, "w") as f:
        json.dump(clean_json(res), f)
    return 0 if res["status"] == "PASS" else 1


__all__ = ["run_child"]
