"""Writes that never corrupt (epqlab.results.atomic_path, engine.run_stats.append_jsonl): a JSON-lines stats file
stays parseable line by line when the disk fills mid-line, results and figures are whole or absent, and an
output path that cannot be written is refused before the model loads."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

import epqlab

CHILD = r"""
import json, resource, signal, sys
from pathlib import Path
from epqlab.engine.run_stats import append_jsonl
from epqlab.results import write_json
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)          # past the limit write() fails with EFBIG instead
resource.setrlimit(resource.RLIMIT_FSIZE, (600, 600))  # a "disk" of 600 bytes per file
p = Path(sys.argv[1])
append_jsonl(p / "runs.jsonl", {"run": 1, "pad": "a" * 100})
try:
    append_jsonl(p / "runs.jsonl", {"run": 2, "pad": "b" * 2000})
    print("no error")
except OSError as e:
    print("refused", e.errno)
append_jsonl(p / "runs.jsonl", {"run": 3})
write_json({"x": 1}, p / "small.json")
try:
    write_json({"x": "y" * 5000}, p / "small.json")
except OSError as e:
    print("json refused", e.errno)
"""


def test_full_disk_leaves_whole_lines_and_files(tmp_path):
    r = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "refused 27" in r.stdout and "json refused 27" in r.stdout  # EFBIG
    lines = (tmp_path / "runs.jsonl").read_text().splitlines()
    assert [json.loads(x)["run"] for x in lines] == [1, 3]  # the cut line was taken back; nothing glued on
    assert json.loads((tmp_path / "small.json").read_text()) == {"x": 1}  # the old file, whole
    assert not list(tmp_path.glob(".*.part"))  # no temporary left behind


def test_unterminated_line_of_an_older_writer_is_ended(tmp_path):
    from epqlab.engine.run_stats import append_jsonl

    f = tmp_path / "old.jsonl"
    f.write_text('{"run": 0}\n{"run": 1, "cut')
    append_jsonl(f, {"run": 2})
    assert f.read_text().splitlines()[-1] == '{"run": 2}'


def test_unwritable_output_is_refused_before_loading(tmp_path, mini_gguf):
    f = tmp_path / "a-file"
    f.write_text("x")
    with pytest.raises(OSError, match="is not a folder"):
        epqlab.Session(mini_gguf, stats_file=f / "s.jsonl")
    with pytest.raises(OSError, match="is a folder"):
        epqlab.Session(mini_gguf, route_log=tmp_path)


def test_read_only_folder_is_refused_before_loading(tmp_path, mini_gguf):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        if __import__("os").access(ro, __import__("os").W_OK):
            pytest.skip("running as a user that can write read-only folders")
        with pytest.raises(OSError, match="not writable"):
            epqlab.Session(mini_gguf, stats_file=ro / "s.jsonl")
        with pytest.raises(OSError, match="not writable"):
            epqlab.Session(mini_gguf, route_log=ro / "r.npz")
    finally:
        ro.chmod(0o700)


def test_messages_not_tracebacks(tmp_path, mini_gguf, capsys):
    """A lone surrogate, an empty route log, a study reading with no steady-state passes: each a message."""
    import numpy as np
    import pandas as pd

    from epqlab.cli import main
    from epqlab.requests.completion import check_messages
    from epqlab.routes import RouteLog
    from epqlab.studies.ablation.eviction_report import reading

    with epqlab.Session(mini_gguf, n_threads=1, n_ctx=256) as s:
        with pytest.raises(ValueError, match="lone surrogate"):
            s.tokenize("ok \ud800 no")
    with pytest.raises(ValueError, match=r"messages\[0\]: content is not valid Unicode"):
        check_messages([{"role": "user", "content": "a\udc00"}])
    empty = RouteLog(experts=np.zeros((0, 2, 2), np.int32), layers=np.array([0, 1], np.int32),
                     phase=np.zeros(0, np.uint8), expert_bytes=np.array([1, 1], np.int64), n_expert=8, meta={})
    empty.save(tmp_path / "empty.npz")
    assert main(["routes", str(tmp_path / "empty.npz")]) == 1
    assert "holds no routes" in capsys.readouterr().err
    df = pd.DataFrame([{"point": "arena 50%", "policy": "lru", "slots": 4, "steady_hit_rate": None,
                        "replay_equal": True}])
    assert "n_predict <= warmup" in reading(df)


NEW_FILE_CHILD = r"""
import resource, signal, sys
from pathlib import Path
from epqlab.engine.run_stats import append_jsonl
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (50, 50))  # a disk full before the first line fits
try:
    append_jsonl(Path(sys.argv[1]) / "runs.jsonl", {"run": 1, "pad": "a" * 100})
except OSError as e:
    print("refused", e.errno)
"""


def test_full_disk_leaves_no_empty_new_file(tmp_path):
    r = subprocess.run([sys.executable, "-c", NEW_FILE_CHILD, str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert "refused 27" in r.stdout, r.stderr[-2000:]
    assert not (tmp_path / "runs.jsonl").exists()  # no 0-byte runs.jsonl


def test_cli_output_checked_before_the_study_runs(tmp_path, mini_gguf, capsys):
    """An output that cannot be written (here a folder that is a file: refused even for root, who writes read-only
    folders) stops the command before its study, not after it."""
    import time

    from epqlab.cli import main

    f = tmp_path / "a-file"
    f.write_text("x")
    t0 = time.perf_counter()
    assert main(["ablate", "lossy", str(mini_gguf), "--arenas", "0.5", "--texts", "", "--json", str(f / "x.json")]) == 2
    err = capsys.readouterr().err
    assert "cannot write" in err and "is not a folder" in err and "[lossy]" not in err  # no row was run
    assert time.perf_counter() - t0 < 5
