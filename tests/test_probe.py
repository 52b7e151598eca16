"""epqlab.probe_io, the `epqlab probe` CLI and notebooks/01_io_probe.ipynb, on small files.

Checks are on values worked out independently of the probe (row counts from the arguments, MB/s
and IOPS from the same row's bytes, requests and wall time, latency orderings, request sizes from
the GGUF written here); none depends on how fast the disk is.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

import epqlab
from epqlab.errors import ProbeFileTooSmallError
from epqlab.paging.probe import COLUMNS, model_request_sizes, summarize
from epqlab.studies.probe_report import reading, summary_line

SIZES = [4096, 65536, 100_000]  # 100_000 is not a multiple of 4096: O_DIRECT must round it up
CONC = [1, 2, 3]
N = 4  # reads per thread per cell


def scratch_probe(tmp_path, **kw):
    args = dict(request_bytes=SIZES, concurrency=CONC, n_requests=N, scratch_bytes="4MiB", scratch_dir=tmp_path,
                progress=False)
    args.update(kw)
    return epqlab.probe_io(None, **args)


def check_table(df, sizes, conc, n, mode):
    assert list(df.columns) == COLUMNS
    assert len(df) == len(sizes) * len(conc)
    assert sorted(zip(df.request_bytes, df.concurrency)) == sorted((s, c) for s in sizes for c in conc)
    assert (df["mode"] == mode).all() and df.attrs["mode"] == mode
    for r in df.itertuples():
        assert r.n_requests == r.concurrency * n
        if mode == "direct":
            assert r.read_bytes % 4096 == 0 and r.request_bytes <= r.read_bytes < r.request_bytes + 4096
        else:
            assert r.read_bytes == r.request_bytes
        # Scratch sizes are page multiples, so no read stops at end of file: every read is whole.
        assert r.total_bytes == r.n_requests * r.read_bytes
        assert r.wall_s > 0
        assert r.mb_s == pytest.approx(r.total_bytes / r.wall_s / 1e6, rel=1e-12)
        assert r.iops == pytest.approx(r.n_requests / r.wall_s, rel=1e-12)
        assert 0 < r.lat_min_us <= r.lat_median_us <= r.lat_p90_us <= r.lat_p99_us <= r.lat_max_us
        assert r.lat_min_us <= r.lat_mean_us <= r.lat_max_us
        # Each thread's reads run one after another inside the cell's wall time.
        assert r.lat_mean_us * r.n_requests <= r.concurrency * r.wall_s * 1e6 * (1 + 1e-9)


def o_direct_works(folder) -> bool:
    """Whether the file system under ``folder`` serves an O_DIRECT read, found out here with os.open/preadv
    (not with the probe): an aligned 4 KiB read of a 4 KiB file."""
    import mmap
    import os

    f = os.path.join(folder, "o_direct_check.bin")
    with open(f, "wb") as fh:
        fh.write(b"\1" * 4096)
    buf = mmap.mmap(-1, 4096)  # page-aligned
    try:
        fd = os.open(f, os.O_RDONLY | os.O_DIRECT)
        try:
            return os.preadv(fd, [buf], 0) == 4096
        finally:
            os.close(fd)
    except OSError:
        return False
    finally:
        buf.close()
        os.unlink(f)


def test_scratch_direct(tmp_path):
    # This machine's ext4 (and tmpfs on kernels >= 6.6) accept O_DIRECT; elsewhere the probe must say buffered,
    # and where O_DIRECT works it must not have fallen back silently.
    expected = "direct" if o_direct_works(tmp_path) else "buffered"
    df = scratch_probe(tmp_path, direct=True)
    check_table(df, SIZES, CONC, N, expected)
    assert df.attrs["scratch"] and df.attrs["file_size"] == 4 * 1024**2
    assert list(tmp_path.iterdir()) == [], "scratch file must be removed"


def test_scratch_buffered(tmp_path):
    df = scratch_probe(tmp_path, direct=False, drop_cache=False)
    check_table(df, SIZES, CONC, N, "buffered")
    assert list(tmp_path.iterdir()) == []


def test_existing_file_not_page_multiple(tmp_path):
    f = tmp_path / "data.bin"
    f.write_bytes(np.random.default_rng(1).bytes(300_001))  # odd size: O_DIRECT reads may end at EOF
    df = epqlab.probe_io(f, request_bytes=[4096, 300_001], concurrency=[1, 2], n_requests=3, progress=False)
    assert len(df) == 4 and f.exists()
    for r in df.itertuples():
        assert r.request_bytes * r.n_requests <= r.total_bytes <= r.read_bytes * r.n_requests
        assert r.mb_s == pytest.approx(r.total_bytes / r.wall_s / 1e6, rel=1e-12)
    assert df.attrs["path"] == str(f) and not df.attrs["scratch"]


def test_too_small_file(tmp_path):
    f = tmp_path / "small.bin"
    f.write_bytes(b"x" * 10_000)
    with pytest.raises(ProbeFileTooSmallError, match="10000 bytes, smaller than the largest request .65536"):
        epqlab.probe_io(f, request_bytes=[4096, 65536], concurrency=[1], n_requests=1, progress=False)
    assert issubclass(ProbeFileTooSmallError, ValueError) and issubclass(ProbeFileTooSmallError, epqlab.EpqlabError)
    with pytest.raises(ProbeFileTooSmallError):
        epqlab.probe_io(None, request_bytes=[1_900_000], scratch_bytes="1MiB", scratch_dir=tmp_path, progress=False)
    assert [p.name for p in tmp_path.iterdir()] == ["small.bin"]


def test_bad_arguments(tmp_path):
    with pytest.raises(FileNotFoundError):
        epqlab.probe_io(tmp_path / "missing.bin", progress=False)
    with pytest.raises(ValueError):
        scratch_probe(tmp_path, concurrency=[0])
    with pytest.raises(ValueError):
        scratch_probe(tmp_path, n_requests=0)
    with pytest.raises(ValueError):
        scratch_probe(tmp_path, request_bytes=[0, 4096])


def test_native_errors_become_python_exceptions(tmp_path):
    from epqlab.engine.native import core

    with pytest.raises(FileNotFoundError) as ei:
        core.IoProbe(str(tmp_path / "missing.bin"), True)
    assert ei.value.filename == str(tmp_path / "missing.bin") and ei.value.errno == 2 and ei.value.offset == -1
    with pytest.raises(ValueError, match="not a regular file"):
        core.IoProbe(str(tmp_path), True)
    f = tmp_path / "f.bin"
    f.write_bytes(b"\0" * 8192)
    p = core.IoProbe(str(f), False)
    with pytest.raises(ValueError, match="smaller than"):
        p.run(8193, 1, 1, 0, True)


def write_moe_gguf(path):
    """A llama-arch GGUF with one MoE block: gate/up F32 [64, 128, 64] and down F16 [128, 64, 64]
    (ggml order ne0, ne1, n_expert). Per-matrix bytes: 64*128*4 = 32768 and 128*64*2 = 16384;
    per-expert: 2*32768 + 16384 = 81920; file > 1.9 MB so the default sizes fit."""
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_expert_count(64)
    w.add_expert_used_count(2)
    w.add_tensor("token_embd.weight", np.zeros((16, 64), np.float32))
    w.add_tensor("blk.0.ffn_gate_exps.weight", np.ones((64, 128, 64), np.float32))
    w.add_tensor("blk.0.ffn_up_exps.weight", np.ones((64, 128, 64), np.float32))
    w.add_tensor("blk.0.ffn_down_exps.weight", np.ones((64, 64, 128), np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_gguf_default_sizes(tmp_path):
    f = tmp_path / "moe.gguf"
    write_moe_gguf(f)
    sizes = model_request_sizes(f)
    assert [(n, src) for n, _, src in sizes] == [(16384, "model:matrix"), (32768, "model:matrix"), (81920, "model:expert")]
    df = epqlab.probe_io(f, concurrency=[1, 2], n_requests=2, progress=False)
    expect = sorted({4096, 65536, 1_900_000, 16384, 32768, 81920})
    assert sorted(set(df.request_bytes)) == expect and len(df) == 2 * len(expect)
    assert set(df[df.request_bytes == 81920].source) == {"model:expert"}
    assert set(df[df.request_bytes == 4096].source) == {"default"}


def test_dense_gguf_uses_default_sizes(tmp_path):
    import gguf

    f = tmp_path / "dense.gguf"
    w = gguf.GGUFWriter(str(f), "llama")
    w.add_tensor("token_embd.weight", np.zeros((8192, 64), np.float32))  # 2 MiB, no experts
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    df = epqlab.probe_io(f, concurrency=[1], n_requests=1, progress=False)
    assert sorted(df.request_bytes) == [4096, 65536, 1_900_000]


def test_summary_and_reading_are_computed(tmp_path):
    df = scratch_probe(tmp_path)
    s = summarize(df)
    big = df[df.request_bytes == 100_000]
    assert s["single_stream_mb_s"] == big[big.concurrency == 1].mb_s.iloc[0]
    assert s["best_mb_s"] == df.mb_s.max()
    assert s["lat_small_us"] == df[(df.request_bytes == 4096) & (df.concurrency == 1)].lat_median_us.iloc[0]
    line = summary_line(df)
    assert f"{s['single_stream_mb_s']:.0f} MB/s" in line and f"{s['lat_small_us']:.0f} us" in line
    text = reading(df, expert_bytes=65536, top_k=2)
    r1 = df[(df.request_bytes == 65536) & (df.concurrency == 1)].iloc[0]
    assert f"{r1.lat_median_us / 1000:.2f} ms median" in text and f"{r1.mb_s:.0f} MB/s" in text


def test_cli(tmp_path, capsys):
    from epqlab.cli import main

    out = tmp_path / "probe.json"
    rc = main(["probe", str(tmp_path), "--scratch-size", "4MiB", "--sizes", "4KiB,64KiB", "-c", "1,2", "-n", "2", "-q",
               "--json", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "single stream" in text and "best aggregate" in text and "4 KiB latency" in text
    d = json.loads(out.read_text())
    assert len(d["rows"]) == 4 and [p.name for p in tmp_path.iterdir()] == ["probe.json"]
    small = tmp_path / "small.bin"
    small.write_bytes(b"x" * 100)
    assert main(["probe", str(small), "-q"]) == 1
    assert "smaller than the largest request" in capsys.readouterr().err


def test_notebook(tmp_path):
    from notebooks import run_notebook

    sizes, conc = [4096, 65536], [1, 2]
    d = run_notebook("01_io_probe", {"sizes": sizes, "concurrency": conc, "n_requests": 3, "scratch_bytes": "2MiB",
                                     "scratch_dir": str(tmp_path), "run_name": "tiny"}, tmp_path)
    assert d["notebook"] == "01_io_probe" and d["run_name"] == "tiny"
    assert d["parameters"]["sizes"] == sizes and d["parameters"]["concurrency"] == conc
    rows = d["rows"]
    assert len(rows) == len(sizes) * len(conc)
    assert sorted((r["request_bytes"], r["concurrency"]) for r in rows) == [(s, c) for s in sizes for c in conc]
    for r in rows:
        assert r["n_requests"] == 3 * r["concurrency"]
        assert r["mb_s"] == pytest.approx(r["total_bytes"] / r["wall_s"] / 1e6, rel=1e-9)
        assert r["lat_median_us"] > 0
    res = tmp_path / "results" / "01_io_probe"
    assert (res / d["figures"]["probe"]).stat().st_size > 1000 and (res / d["csv"]).stat().st_size > 0
    first = next(r for r in rows if r["request_bytes"] == 4096 and r["concurrency"] == 1)
    assert f"{first['lat_median_us']:.0f} us median alone" in d["reading"]
    assert not list(tmp_path.glob("epqlab-probe-*")), "scratch file must be removed"


def test_probe_defaults(tmp_path):
    """What notebook 01 probes when given a MoE GGUF, another file, or nothing."""
    from epqlab.paging.probe import DEFAULT_REQUEST_BYTES, REFERENCE_EXPERT_BYTES
    from epqlab.studies.probe_report import probe_defaults

    m = tmp_path / "moe.gguf"
    write_moe_gguf(m)
    assert probe_defaults(m) == (81920, 2, None)  # per-expert bytes worked out in write_moe_gguf; top-k 2
    assert probe_defaults(m, sizes=[4096], top_k=5) == (81920, 5, [4096])
    other = tmp_path / "data.bin"
    other.write_bytes(b"x" * 8192)
    expected_sizes = sorted(set(DEFAULT_REQUEST_BYTES) | {REFERENCE_EXPERT_BYTES})
    assert probe_defaults(other) == (REFERENCE_EXPERT_BYTES, 4, expected_sizes)
    assert probe_defaults(None) == (REFERENCE_EXPERT_BYTES, 4, expected_sizes)
