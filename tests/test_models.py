"""The default MoE model (MoEfied SmolLM2) and synthetic models.

References are computed here, independently of epqlab.models: byte sizes from ggml block sizes,
the k = E MoE layer from the source GGUF's dense FFN in NumPy, logits from llama.cpp.
"""
from __future__ import annotations

import time

import numpy as np
import pytest

Q8_0_BYTES, Q8_0_BLOCK = 34, 32


def _llama(path, **kw):
    from llama_cpp import Llama

    return Llama(str(path), n_ctx=128, logits_all=True, verbose=False, n_threads=2, **kw)


def _logits(llm, text: bytes) -> np.ndarray:
    toks = llm.tokenize(text)
    llm.eval(toks)
    return np.array(llm.scores[: len(toks)])


def test_default_model_loads_and_gives_finite_logits(default_model_path):
    llm = _llama(default_model_path)
    L = _logits(llm, b"The interpreter executes a code block in an execution frame.")
    assert np.isfinite(L).all()
    assert L.std() > 0.5  # not a constant / degenerate output
    llm.close()


def test_default_model_second_call_is_instant_and_complete(default_model_path):
    from epqlab.models import default_model

    t0 = time.perf_counter()
    assert default_model(progress=False) == default_model_path
    assert time.perf_counter() - t0 < 1.0
    assert not list(default_model_path.parent.glob("*.tmp*")), "a temp file was left in the cache"


def test_default_model_has_two_expert_sizes(default_model_path):
    from epqlab.layout import inspect
    from epqlab.models import DEFAULT_CONFIG as cfg

    lay = inspect(default_model_path)
    E, n_embd, n_layer, F = cfg.n_expert, 576, 30, cfg.n_ff_exp
    q8 = 3 * F * (n_embd // Q8_0_BLOCK) * Q8_0_BYTES  # gate, up: F rows of n_embd; down: n_embd rows of F
    f16 = 3 * F * n_embd * 2
    assert lay.architecture == "deepseek" and lay.n_expert == E and lay.n_expert_used == cfg.n_expert_used
    classes = {c.expert_bytes: c for c in lay.slot_classes}
    assert set(classes) == {q8, f16}
    assert classes[f16].layers == tuple(range(n_layer - cfg.n_f16_layers, n_layer))
    assert classes[q8].types == ("Q8_0",) and classes[f16].types == ("F16",)
    # routed experts are most of the FFN: E * F neurons routed vs the shared expert's width
    assert E * F > cfg.shared_width and E * F + cfg.shared_width >= 1536


def test_default_model_deepseek_hparams(default_model_path):
    """Every llama hparam is carried over as deepseek.*, plus the MoE keys llama.cpp's deepseek loader
    reads (src/models/deepseek.cpp); the shared expert tensors have the width it expects."""
    from gguf import GGUFReader

    from epqlab.models import DEFAULT_CONFIG as cfg
    from epqlab.models.smollm2 import source_gguf

    src, moe = GGUFReader(source_gguf()), GGUFReader(default_model_path)
    kv = {k: f.contents() for k, f in moe.fields.items()}
    assert kv["general.architecture"] == "deepseek"
    assert not [k for k in kv if k.startswith("llama.")]
    for k, f in src.fields.items():
        if k.startswith("llama.") and k != "llama.feed_forward_length":
            assert kv["deepseek." + k[6:]] == f.contents(), k
        if k.startswith("tokenizer."):
            assert kv[k] == f.contents(), k
    assert kv["deepseek.context_length"] == 8192
    assert kv["deepseek.expert_count"] == cfg.n_expert
    assert kv["deepseek.expert_feed_forward_length"] == cfg.n_ff_exp
    assert kv["deepseek.expert_shared_count"] == cfg.n_expert_shared
    assert kv["deepseek.leading_dense_block_count"] == 0
    assert kv["deepseek.expert_weights_scale"] == cfg.n_expert
    shapes = {t.name: tuple(int(d) for d in t.shape) for t in moe.tensors}
    W = cfg.shared_width
    assert shapes["blk.0.ffn_gate_shexp.weight"] == (576, W) and shapes["blk.29.ffn_down_shexp.weight"] == (W, 576)
    assert shapes["blk.0.ffn_gate_exps.weight"] == (576, cfg.n_ff_exp, cfg.n_expert)
    assert not [n for n in shapes if n.endswith((".ffn_gate.weight", ".ffn_up.weight", ".ffn_down.weight"))]


def _tensor(reader, name):
    from gguf.quants import dequantize

    t = next(t for t in reader.tensors if t.name == name)
    return dequantize(t.data, t.tensor_type).astype(np.float64)


@pytest.mark.parametrize("layer", [3, 28])  # a Q8_0 layer and an F16 layer
def test_k_equals_E_matches_dense_ffn(default_model_path, layer):
    """llama.cpp's deepseek MoE at k = E (softmax, top-k = all, no renormalisation, weights times
    expert_weights_scale, plus the ungated shared expert) in NumPy vs the source's dense SwiGLU FFN.
    Tolerance: 2 % relative L2 -- Q8_0 re-quantization of Q4_1 weights (~0.5 %) plus the router's
    1e-3 logit spread."""
    from gguf import GGUFReader

    from epqlab.models.smollm2 import source_gguf

    src, moe = GGUFReader(source_gguf()), GGUFReader(default_model_path)
    p = f"blk.{layer}."
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 576)) * _tensor(src, p + "ffn_norm.weight")  # FFN inputs, (T, n_embd)

    def silu(v):
        return v / (1 + np.exp(-v))

    def swiglu(g, u, d):
        return (silu(x @ g.T) * (x @ u.T)) @ d.T

    dense = swiglu(*(_tensor(src, p + f"ffn_{n}.weight") for n in ("gate", "up", "down")))
    router = _tensor(moe, p + "ffn_gate_inp.weight")  # (E, n_embd)
    gate = _tensor(moe, p + "ffn_gate_exps.weight")   # (E, n_ff_exp, n_embd)
    up = _tensor(moe, p + "ffn_up_exps.weight")
    down = _tensor(moe, p + "ffn_down_exps.weight")   # (E, n_embd, n_ff_exp)
    scale = float(moe.fields["deepseek.expert_weights_scale"].contents())
    E = router.shape[0]
    logits = x @ router.T
    w = np.exp(logits - logits.max(1, keepdims=True))
    w /= w.sum(1, keepdims=True)                       # softmax over all E; top-k = all, not renormalised
    out = swiglu(*(_tensor(moe, p + f"ffn_{n}_shexp.weight") for n in ("gate", "up", "down")))
    for e in range(E):
        out += scale * w[:, e:e + 1] * swiglu(gate[e], up[e], down[e])
    rel = np.linalg.norm(out - dense) / np.linalg.norm(dense)
    assert rel < 0.02, rel
    assert abs(w.max() * E - 1) < 0.05 and abs(w.min() * E - 1) < 0.05  # each expert enters with weight ~1
    assert scale == E


def test_moe_ffn_reference_partial_sum(default_model_path):
    """epqlab.models.moefy.moe_ffn (the bench's replica of llama.cpp's gating) at k < E is the shared
    expert plus the k top-ranked routed experts, each with weight ~1."""
    from gguf import GGUFReader

    from epqlab.models.moefy import moe_ffn

    moe = GGUFReader(default_model_path)
    p = "blk.5."
    W = [_tensor(moe, p + n + ".weight") for n in ("ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps",
                                                   "ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp")]
    E = W[0].shape[0]
    x = np.random.default_rng(1).standard_normal((16, 576))
    out, top = moe_ffn(x, *W, k=2, w_scale=E)
    assert top.shape == (16, 2)

    def swiglu(g, u, d):
        h = x @ g.T
        return (h / (1 + np.exp(-h)) * (x @ u.T)) @ d.T

    ref = swiglu(*W[4:])
    parts = np.stack([swiglu(W[1][e], W[2][e], W[3][e]) for e in range(E)], 1)  # (T, E, n_embd)
    ref += np.take_along_axis(parts, top[:, :, None], 1).sum(1)
    assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < 0.01


def test_numpy_forward_matches_llama_cpp():
    """The NumPy forward pass that captures calibration activations agrees with llama.cpp."""
    from epqlab.models.moefy import DenseLlama
    from epqlab.models.smollm2 import source_gguf

    path = source_gguf()
    llm = _llama(path)
    toks = llm.tokenize(b"A Python program is constructed from code blocks. A block is a piece of program text.")
    llm.eval(toks)
    ref = np.array(llm.scores[: len(toks)])
    llm.close()
    m = DenseLlama(path)
    h = m.forward(toks)
    L = h @ m.output_matrix().T
    assert np.corrcoef(L.ravel(), ref.ravel())[0, 1] > 0.995
    assert (L.argmax(1) == ref.argmax(1)).mean() >= 0.85


def test_eval_text_is_long_prose():
    from importlib.resources import files

    from epqlab.models import eval_text
    from epqlab.models.smollm2 import source_gguf

    text = eval_text()
    assert files("epqlab.data").joinpath("LICENSE-python-docs.txt").is_file()
    from llama_cpp import Llama

    llm = Llama(str(source_gguf()), vocab_only=True, verbose=False)
    assert len(llm.tokenize(text.encode())) >= 800
    words = text.split()
    assert sum(w.isalpha() for w in words) / len(words) > 0.6  # mostly words, not code


def _expert_bytes(t, ne0, ne1):
    block, size = {"Q4_K": (256, 144), "BF16": (1, 2), "Q8_0": (32, 34)}[t]
    return ne0 // block * size * ne1


def test_synth_tiny_loads_with_two_expert_sizes(tmp_path):
    from epqlab.layout import inspect
    from epqlab.models import PRESETS, synthesize

    s = PRESETS["tiny"]
    r = synthesize(tmp_path / "tiny.gguf", "tiny", progress=False)
    lay = inspect(r["path"])
    D, F = s.n_embd, s.n_ff_exp
    want = {t: 2 * _expert_bytes(t, D, F) + _expert_bytes(t, F, D) for t in ("Q4_K", "BF16")}
    assert {c.expert_bytes for c in lay.slot_classes} == set(want.values())
    assert lay.n_expert == s.n_expert and len(lay.layers) == s.n_layer
    llm = _llama(r["path"])
    L = _logits(llm, b"Hello, world. The cache is warm.")
    assert np.isfinite(L).all()
    llm.close()


def test_synth_unaligned_expert_slices(tmp_path):
    from epqlab.layout import inspect
    from epqlab.models import synthesize

    r = synthesize(tmp_path / "u.gguf", "tiny", unaligned=True, progress=False)
    lay = inspect(r["path"])
    for layer in lay.layers:
        for t in layer.tensors:
            assert t.expert_bytes % 4096 != 0, (t.name, t.expert_bytes)
    llm = _llama(r["path"])
    assert np.isfinite(_logits(llm, b"Unaligned experts still load.")).all()
    llm.close()


def test_synth_sparse_and_n_layer_override(tmp_path):
    from epqlab.layout import inspect
    from epqlab.models import synthesize

    r = synthesize(tmp_path / "s.gguf", "qwen3-30b-a3b", n_layer=2, sparse=True, progress=False)
    lay = inspect(r["path"])
    assert lay.n_layer == 2 and lay.n_expert == 128 and lay.n_expert_used == 8
    assert lay.max_expert_bytes == 3 * _expert_bytes("Q4_K", 2048, 768)
    st = r["path"].stat()
    assert st.st_blocks * 512 < st.st_size  # expert bytes are holes


def test_cli_model_synth(tmp_path, capsys):
    from epqlab.cli import main

    out = tmp_path / "cli.gguf"
    assert main(["model", "synth", "tiny", str(out), "--n-layer", "2"]) == 0
    assert out.is_file() and str(out) in capsys.readouterr().out
