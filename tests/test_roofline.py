"""epqlab.studies.roofline: the plain-in-RAM reference and the bound every paged row is held against."""
from __future__ import annotations

import os

import pytest

from epqlab.errors import EpqlabError
from epqlab.memory.usage import drop_page_cache, page_cache_bytes
from epqlab.studies.roofline import bound_ratios, plain_reference, warm_file


def test_bound_ratios_by_hand():
    # 100 ms/token paged; plain 40 ms; 30 MB missed per token at 1 GB/s = 30 ms -> bound 40 ms
    r = bound_ratios(100.0, 40.0, 30e6, 1e9)
    assert r["io_ms"] == pytest.approx(30.0) and r["bound_ms"] == 40.0
    assert r["roofline_ratio"] == pytest.approx(2.5) and r["plain_ratio"] == pytest.approx(0.4)
    # disk-bound: 90 MB at 1 GB/s = 90 ms > 40 ms
    assert bound_ratios(100.0, 40.0, 90e6, 1e9)["roofline_ratio"] == pytest.approx(100 / 90)
    assert bound_ratios(100.0, 40.0, 90e6, None)["bound_ms"] == 40.0  # no bandwidth: compute only


def test_warm_file_fills_the_page_cache_and_refuses_what_cannot_fit(default_path):
    drop_page_cache(default_path)
    w = warm_file(default_path)
    assert w["bytes"] == os.path.getsize(default_path)
    assert page_cache_bytes(default_path) >= 0.95 * w["bytes"]
    with pytest.raises(EpqlabError, match="cannot hold it in RAM"):
        warm_file(default_path, margin=1 << 50)


def test_plain_reference_times_teacher_forced_decode(default_path):
    r = plain_reference(default_path, "The cache", "A CPU cache is a small fast memory.", 6, repeats=2,
                        n_threads=1, n_ctx=256)
    assert len(r["ms_per_token_runs"]) == 2 and r["ms_per_token"] > 0
    assert r["decode_tok_s"] == pytest.approx(1000 / r["ms_per_token"])
    with pytest.raises(ValueError, match="repeats"):
        plain_reference(default_path, "x", "y", 2, repeats=0)
