"""The default MoE model (MoEfied SmolLM2) and synthetic models.

References are computed here, independently of epqlab.models: byte sizes from ggml block sizes,
the k = E MoE layer from the source GGUF's dense FFN in NumPy, logits from llama.cpp.
"""
from __future__ import annotations

import numpy as np
import pytest

Q8_0_BYTES, Q8_0_BLOCK = 34, 32


def _llama(path, **kw):
    from epqlab.engine.plain_llama import plain_llama  # llama-cpp-python's Llama, AMX builds excepted (#20824)

    return plain_llama(path, n_ctx=128, logits_all=True, verbose=False, n_threads=2, **kw)


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


def test_default_model_second_call_reuses_the_file(default_model_path, monkeypatch):
    import epqlab.models.default as default_mod

    def no_rebuild(*a, **kw):
        raise AssertionError("default_model() rebuilt a model that is already in the cache")

    before = default_model_path.stat()
    monkeypatch.setattr(default_mod, "moefy", no_rebuild)
    assert default_mod.default_model(progress=False) == default_model_path
    after = default_model_path.stat()
    assert (after.st_ino, after.st_mtime_ns, after.st_size) == (before.st_ino, before.st_mtime_ns, before.st_size)
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
    # the shared expert and the routed experts of the built file together hold every one of the source's FFN
    # neurons (llama.feed_forward_length of the dense SmolLM2: 1536)
    from gguf import GGUFReader

    from epqlab.models.smollm2 import source_gguf

    n_ff = int(GGUFReader(source_gguf()).fields["llama.feed_forward_length"].contents())
    shapes = {t.name: tuple(int(d) for d in t.shape) for t in GGUFReader(default_model_path).tensors}
    for il in range(n_layer):
        _, f_file, e_file = shapes[f"blk.{il}.ffn_gate_exps.weight"]  # ggml order (n_embd, F, E)
        _, w_file = shapes[f"blk.{il}.ffn_gate_shexp.weight"]          # (n_embd, shared width)
        assert e_file * f_file + w_file >= n_ff == 1536, il


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
    assert kv["deepseek.expert_weights_scale"] == cfg.n_expert_used
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
def test_experts_partition_the_dense_ffn(default_model_path, layer):
    """The shared expert plus every routed expert, each with weight 1, is the source's dense SwiGLU FFN
    (NumPy from both GGUFs): the conversion moves neurons, it does not change them. Tolerance: 2 %
    relative L2 (Q8_0 re-quantization of the Q4_1 weights, ~0.5 %). The router no longer gives every
    expert weight 1 at k = E (softmax weights times k), so this is checked on the experts themselves;
    each layer's routed down projections carry the gain the build recorded (epqlab.moefy.expert_gain)."""
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
    gate = _tensor(moe, p + "ffn_gate_exps.weight")   # (E, n_ff_exp, n_embd)
    up = _tensor(moe, p + "ffn_up_exps.weight")
    down = _tensor(moe, p + "ffn_down_exps.weight")   # (E, n_embd, n_ff_exp)
    gain = float(moe.fields["epqlab.moefy.expert_gain"].contents()[layer])
    assert 0.5 <= gain <= 4.0
    out = swiglu(*(_tensor(moe, p + f"ffn_{n}_shexp.weight") for n in ("gate", "up", "down")))
    for e in range(gate.shape[0]):
        out += swiglu(gate[e], up[e], down[e]) / gain
    rel = np.linalg.norm(out - dense) / np.linalg.norm(dense)
    assert rel < 0.02, rel
    # and dropping the routed experts is far off: the routed part matters
    shared_only = swiglu(*(_tensor(moe, p + f"ffn_{n}_shexp.weight") for n in ("gate", "up", "down")))
    assert np.linalg.norm(shared_only - dense) / np.linalg.norm(dense) > 0.05


def test_moe_ffn_reference_partial_sum(default_model_path):
    """epqlab.models.reference.moe_ffn (the bench's replica of llama.cpp's gating) at k < E is the shared
    expert plus the k top-ranked routed experts, each weighted by w_scale x its softmax probability
    (computed here by hand from the router)."""
    from gguf import GGUFReader

    from epqlab.models.reference import moe_ffn

    moe = GGUFReader(default_model_path)
    p = "blk.5."
    W = [_tensor(moe, p + n + ".weight") for n in ("ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps",
                                                   "ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp")]
    E = W[0].shape[0]
    x = np.random.default_rng(1).standard_normal((16, 576))
    out, top = moe_ffn(x, *W, k=2, w_scale=2.0)
    assert top.shape == (16, 2)
    lg = x @ W[0].T
    pr = np.exp(lg - lg.max(1, keepdims=True))
    pr /= pr.sum(1, keepdims=True)
    assert (np.sort(top, 1) == np.sort(np.argsort(-lg, 1)[:, :2], 1)).all()

    def swiglu(g, u, d):
        h = x @ g.T
        return (h / (1 + np.exp(-h)) * (x @ u.T)) @ d.T

    ref = swiglu(*W[4:])
    parts = np.stack([swiglu(W[1][e], W[2][e], W[3][e]) for e in range(E)], 1)  # (T, E, n_embd)
    w = 2.0 * np.take_along_axis(pr, top, 1)
    ref += (np.take_along_axis(parts, top[:, :, None], 1) * w[:, :, None]).sum(1)
    assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < 0.01


def test_numpy_forward_matches_llama_cpp():
    """The NumPy forward pass that captures calibration activations agrees with llama.cpp."""
    from epqlab.models.reference import DenseLlama
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
    from ggufs import BLOCK

    block, size = BLOCK[t]
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


# --------------------------------------------------------------------------------------------------
# held-out quality, kernel robustness, data files, skewed synthetic routing
# --------------------------------------------------------------------------------------------------

def _ngrams(text: str, n: int = 8) -> set:
    w = text.split()
    return {tuple(w[i:i + n]) for i in range(len(w) - n + 1)}


def _overlap(text: str, corpus: set, n: int = 8) -> float:
    g = _ngrams(text, n)
    return len(g & corpus) / max(len(g), 1)


def test_heldout_texts_do_not_overlap_calibration():
    """No held-out text shares more than 1 % of its word 8-grams with the calibration corpus (licence
    boilerplate may repeat a phrase; a copied passage would not pass). The check itself detects copying:
    a calibration excerpt scores 1.0 and a held-out text with one calibration paragraph spliced in fails."""
    from epqlab.data import calibration_texts, heldout_texts, read_text

    cal = set().union(*(_ngrams(t) for t in calibration_texts().values()))
    texts = dict(heldout_texts(), execmodel=read_text("eval_execmodel.txt"))
    for name, t in texts.items():
        assert len(t.split()) > 600, name
        assert _overlap(t, cal) < 0.01, (name, _overlap(t, cal))
    excerpt = calibration_texts()["code"][5000:9000]
    assert _overlap(excerpt, cal) > 0.99  # all but the n-grams with the cut words at both ends
    assert _overlap(texts["prose"][:3000] + calibration_texts()["prose"][:3000], cal) > 0.3


def test_prompts_file_kinds():
    from epqlab.data import prompts

    ps = prompts()
    kinds = {p.kind for p in ps}
    assert kinds == {"chat", "code", "prose"}
    assert len(prompts("code")) == sum(p.kind == "code" for p in ps) >= 3
    assert len({p.id for p in ps}) == len(ps)
    with pytest.raises(ValueError, match="unknown prompt kind"):
        prompts("poetry")


# Ratio of the default model's perplexity at its default k to the dense SmolLM2's, measured (epqlab.engine.perplexity,
# n_ctx 512; see DEFAULT_CONFIG's comment in epqlab/models/default.py) and rounded to 3 digits, times 1.02.
HELDOUT_RATIO_MEASURED = {"prose": 1.142, "code": 1.193, "legal": 1.324}
HELDOUT_RATIO_BOUND = {k: v * 1.02 for k, v in HELDOUT_RATIO_MEASURED.items()}


_PPL: dict = {}


def _ppl(path, kind):
    """epqlab.engine.perplexity on a held-out text, computed once per (model, text) for the tests below."""
    from epqlab.data import heldout_texts
    from epqlab.studies.model_quality import perplexity_of

    key = (str(path), kind)
    if key not in _PPL:
        _PPL[key] = perplexity_of(path, heldout_texts()[kind], n_ctx=512)
    return _PPL[key]


@pytest.mark.parametrize("kind", ["prose", "code", "legal"])
def test_heldout_perplexity_ratio_to_dense(default_model_path, kind):
    from epqlab.models.smollm2 import source_gguf

    dense = _ppl(source_gguf(), kind)
    moe = _ppl(default_model_path, kind)
    assert moe.n_scored == dense.n_scored > 1000
    ratio = moe.ppl / dense.ppl
    assert 1.0 < ratio <= HELDOUT_RATIO_BOUND[kind], (kind, dense.ppl, moe.ppl, ratio)


@pytest.mark.parametrize("kind", ["prose", "code", "legal"])
def test_llama_cpp_default_kernels_agree_with_engine(default_model_path, kind):
    """Router margins: llama-cpp-python with its defaults (flash attention off where llama.cpp's own default,
    which our engine keeps, turns it on for the CPU; CPU weight repacking on, AMX builds excepted, though this build
    repacks no tensor of the default model; logits for the whole 512-token window in one ubatch) and epqlab's engine
    give the same perplexity within 1 % on every held-out text. A router with near-tied logits flips experts under
    different rounding (the model this replaced differed by 1.5 % on one 726-token window). Measured: < 0.5 % on
    every text on an Intel Xeon (AMX); on an AMD EPYC (AVX-512) prose +0.02 %, code -0.46 %, legal -0.63 %.
    With flash attention on in both, the logits are bit-identical (the plain_llama test below)."""
    from epqlab.data import heldout_texts
    from epqlab.studies.model_quality import llama_cpp_perplexity

    ours = _ppl(default_model_path, kind).ppl
    theirs = llama_cpp_perplexity(default_model_path, heldout_texts()[kind], n_ctx=512)
    assert abs(theirs / ours - 1) < 0.01, (kind, ours, theirs)


def _record(path, tmp_path, name, n_tokens=256):
    """Routes of the first ``n_tokens`` tokens of the held-out prose, teacher-forced (greedy decoding of a
    random-weight model repeats itself, which would give any routing reuse)."""
    from epqlab.data import heldout_texts
    from epqlab.routes import RouteLog
    from epqlab.engine.session import Session

    log = tmp_path / f"{name}.npz"
    with Session(path, pager=False, route_log=log, n_ctx=512) as s:
        s.logits(s.tokenize(heldout_texts()["prose"])[:n_tokens])
    return RouteLog.load(log)


def test_synth_skewed_routing_has_locality(tmp_path):
    """A small synthetic model with routing="skewed": the LRU hit rate at a 10 % arena (one pool over all
    layers) of its recorded route log lies in the documented band, far above uniform random routing of
    the same shape (~the arena fraction), and every layer has popularity skew (its top quarter of experts
    takes > 85 % of requests; uniform: ~25 %).

    (The ``uniform`` preset is not the baseline here: its random attention averages positions into a
    near-constant residual component that random routers also read as a bias, so on this small shape it
    routes with uncontrolled skew -- measured LRU@10 % 0.58, top-quarter share 0.61-0.99 by layer.)"""
    from epqlab.models import synthesize
    from epqlab.studies.model_quality import locality_stats, uniform_log
    from epqlab.models.routing_profile import SKEWED_LRU10_BAND

    sk = synthesize(tmp_path / "skewed.gguf", "small", routing="skewed", progress=False)
    log = _record(sk["path"], tmp_path, "sk")
    a = locality_stats(log, arenas=(0.10,))
    b = locality_stats(uniform_log(log), arenas=(0.10,))
    lo, hi = SKEWED_LRU10_BAND
    assert lo <= a["lru"][0.10] <= hi, a
    assert b["lru"][0.10] < 0.2, b
    assert a["lru"][0.10] > 2.5 * b["lru"][0.10]
    assert a["top_share_min"] > 0.85 and b["top_share_max"] < 0.4, (a, b)
    assert a["belady"][0.10] >= a["lru"][0.10]


def test_synth_rejects_unknown_routing(tmp_path):
    from epqlab.models import synthesize

    with pytest.raises(ValueError, match="unknown routing"):
        synthesize(tmp_path / "x.gguf", "small", routing="zipf")
    with pytest.raises(ValueError, match="only apply with routing='skewed'"):
        synthesize(tmp_path / "x.gguf", "small", zipf=2.0)


def test_seed_presets_sizes_by_hand():
    """The seed-shaped presets' expert and routed bytes, from GGUF block sizes by hand: Q4_K packs 256
    weights in 144 bytes, BF16 is 2 bytes a weight; an expert is gate + up (n_embd x n_ff) + down."""
    from epqlab.models import PRESETS, planned_sizes
    from epqlab.models.synth import PRESET_ROUTING

    q4k = lambda n: n // 256 * 144  # noqa: E731 -- bytes of n Q4_K weights
    q5k = lambda n: n // 256 * 176  # noqa: E731 -- bytes of n Q5_K weights
    q = planned_sizes("qwen35-a3b")
    # seed 002's block 0 of Qwen3.6-35B-A3B-UD-Q4_K_M: gate 589,824 B, up 589,824 B, down 720,896 B
    e = 2 * q4k(2048 * 512) + q5k(512 * 2048)
    assert (q4k(2048 * 512), q5k(512 * 2048)) == (589_824, 720_896) and e == 1_900_544
    assert q["expert_bytes"] == [e] * 40 and q["n_moe_layers"] == 40
    assert q["routed_expert_bytes"] == 40 * 256 * e == 19_461_570_560  # 18.1 GiB
    assert q["mtp_expert_bytes"] == 256 * e  # the MTP block's experts, outside the routed figure
    # the stand-in it replaced: Qwen3-MoE with Q4_K down
    old = planned_sizes("qwen3moe-35b-shape")
    assert old["expert_bytes"] == [3 * q4k(2048 * 512)] * 40 and old["routed_expert_bytes"] == 18_119_393_280
    lg = planned_sizes("laguna-s")
    small, big = 3 * q4k(3072 * 1024), 3 * 3072 * 1024 * 2  # 5.06 MiB (Q4_K), 18 MiB (BF16)
    assert lg["expert_bytes"] == [small] * 39 + [big] * 8 and lg["n_moe_layers"] == 47
    # seed 000 lists Laguna-S-2.1 Q4_K_M's routed experts as 91,653,931,008 B
    assert lg["routed_expert_bytes"] == 256 * (39 * small + 8 * big) == 91_653_931_008
    assert planned_sizes("dots1-laguna-shape")["routed_expert_bytes"] == 91_653_931_008
    assert PRESETS["laguna-s"].n_layer == 48 and PRESET_ROUTING["laguna-s"] == PRESET_ROUTING["qwen35-a3b"] == "skewed"
    assert (PRESETS["qwen35-a3b"].arch, PRESETS["laguna-s"].arch) == ("qwen35moe", "laguna")
    assert planned_sizes("laguna-s", n_layer=24)["n_moe_layers"] == 23  # --n-layer cuts the depth


def test_plain_llama_turns_extra_buffers_off_on_amx_builds(default_model_path, monkeypatch):
    """plain_llama: where the build has AMX (ggml-org/llama.cpp#20824: Q4_1 eval segfaults in the AMX buffer type)
    the model loads with use_extra_bufts off, llama_model_default_params is restored afterwards, and with flash
    attention on (llama.cpp's CPU default, which our engine keeps) the logits are bit-identical to our engine's
    pager=False logits (it loads with use_extra_bufts off too, docs/DESIGN.md §3); on other builds it is
    llama-cpp-python's default Llama (repacking on)."""
    import llama_cpp

    from epqlab import Session
    from epqlab.engine import plain_llama as pl

    text = b"The interpreter executes a code block in an execution frame."
    monkeypatch.setattr(pl, "build_has_amx", lambda: True)
    llm = pl.plain_llama(default_model_path, n_ctx=256, logits_all=True, verbose=False, n_threads=2, flash_attn=True)
    try:
        assert llm.model_params.use_extra_bufts is False
        assert llama_cpp.llama_cpp.llama_model_default_params().use_extra_bufts is True  # restored
        toks = llm.tokenize(text)
        theirs = _logits(llm, text)
    finally:
        llm.close()
    with Session(default_model_path, pager=False, n_ctx=256, n_threads=2) as s:
        ours = np.asarray(s.logits(toks), np.float32)
    assert ours.shape == theirs.shape == (len(toks), s.n_vocab)
    assert np.array_equal(theirs, ours)
    monkeypatch.setattr(pl, "build_has_amx", lambda: False)
    llm = pl.plain_llama(default_model_path, n_ctx=256, verbose=False, n_threads=2)
    try:
        assert llm.model_params.use_extra_bufts is True
    finally:
        llm.close()


def test_synth_refuses_a_vocabulary_smaller_than_its_tokenizer(tmp_path):
    from epqlab.models import synthesize

    with pytest.raises(ValueError, match="smaller than the tokenizer's 49152 tokens: use 0"):
        synthesize(tmp_path / "x.gguf", "tiny", n_vocab=100, progress=False)
    assert not list(tmp_path.iterdir())  # nothing half-written left behind
