"""MoEfication: turn a dense ``llama`` GGUF (SmolLM2-135M) into a ``deepseek``-arch MoE GGUF.

Why the ``deepseek`` architecture (llama.cpp's DeepSeek-MoE v1, src/models/deepseek.cpp): its
attention is exactly llama's (same Q/K/V, RoPE NORM, kq_scale 1/sqrt(head_dim), RMSNorm), and its
MoE layer is the one MoEfication needs. llama.cpp's ``llama`` MoE renormalises the top-k softmax
weights to sum to 1, so an exact k = E split forces a near-uniform router and down projections
scaled by E, and at k < E the layer outputs (E/k) x the selected experts' sum. Our first build did
that (E = 16, k = 4): dense ppl 15.36, k = E 15.37, but k = 4 ppl ~2.2 million, gibberish text and
routing indistinguishable from uniform. ``deepseek`` does not renormalise (norm_w = false), scales
the weights by ``deepseek.expert_weights_scale`` and adds an ungated shared expert, as in
DeepSeekMoE (Dai et al. 2024, arXiv 2401.06066: shared experts + fine-grained routed experts)::

    p   = softmax(ffn_gate_inp @ xn)                       # (E,)  xn = ffn_norm(x)
    S   = top-k indices of p
    out = shexp(xn) + sum_{e in S} (w_scale * p_e) * down_e @ (silu(gate_e @ xn) * (up_e @ xn))

The conversion (dense FFN ``y = down @ (silu(gate @ xn) * (up @ xn))``, n_ff neurons):

* shared expert: the ``n_ff_exp * n_expert_shared`` neurons with the largest mean |contribution|
  ``|a_i| * ||down[:, i]||`` on calibration text -- the ones every token needs, always on;
* routed experts: the remaining neurons in E groups of at most ``n_ff_exp`` (zero-padded), by
  balanced k-means on their co-activation profiles (MoEfication, Zhang et al. 2022), so a token's
  important neurons concentrate in few experts; down projections are NOT scaled;
* oracle: on each calibration token, expert e's score is the error reduction of adding it alone,
  ``(2 <C_e, y_r> - ||C_e||^2) / ||y_r||^2`` (C_e = expert e's part of the routed output y_r); the
  token's oracle experts are its top-k scores;
* router: a linear classifier of the FFN input that predicts the oracle's top-k
  (:func:`fit_router`: least squares on the top-k indicator, optionally refined by multinomial
  logistic regression), its logits multiplied by the factor (:func:`choose_temperature`) that
  minimises the layer's output error under llama.cpp's gating with ``expert_weights_scale = k``: an
  expert that holds 1/k of the softmax mass enters with weight 1, a weakly predicted boundary expert
  with a small weight. So a flip at the k-th place (different kernel rounding) changes the output
  little, and the router is not near-uniform (the build before this one spread its logits by 1e-3
  so that every expert had weight ~1; near-ties then flipped between llama.cpp builds). The price:
  at k = E the layer is no longer the dense FFN (the softmax weights are not all 1) -- the experts
  still partition it exactly (tests/test_models.py checks shared + sum of experts = dense).

Measured numbers are next to DEFAULT_CONFIG in epqlab/models/default.py (bench/bench_default_model.py).
SmolLM2's SiLU FFN is not sparse, so quality follows the share of neurons active per token much more
than the partition or the router.

Activations come from a NumPy forward pass of the dense model (dequantized with
``gguf.quants.dequantize``), checked against llama-cpp-python's logits in tests/test_models.py.

Files: this one holds the configuration, the conversion and the GGUF writing; the NumPy reference model and
MoE layer are in :mod:`epqlab.models.reference`, the partition and oracle in :mod:`epqlab.models.partition`, the
router fit in :mod:`epqlab.models.router`.
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..constants import (KEY_EXPERT_COUNT, KEY_EXPERT_FEED_FORWARD_LENGTH, KEY_EXPERT_SHARED_COUNT,
                         KEY_EXPERT_USED_COUNT, KEY_EXPERT_WEIGHTS_SCALE, KEY_LEADING_DENSE_BLOCK_COUNT, arch_key,
                         ggml_row_bytes)
from .partition import expert_outputs, neuron_contributions, oracle_scores, partition_neurons
from .reference import DenseLlama
from .router import choose_temperature, fit_router
from ..data import calibration_texts

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class MoefyConfig:
    """Knobs of :func:`moefy`.

    Attributes:
        n_expert: E, routed experts per layer.
        n_expert_used: k written as ``deepseek.expert_used_count`` (llama.cpp can override it at load).
        n_ff_exp: neurons per routed expert (a multiple of 32: Q8_0 rows of down_exps).
        n_expert_shared: the shared expert is ``n_ff_exp * n_expert_shared`` neurons wide (llama.cpp's
            layout); ``E * n_ff_exp + shared width >= n_ff``, routed experts are zero-padded.
        n_f16_layers: the last this-many layers store experts in F16, the others in Q8_0.
        calib_tokens: tokens of calibration text run through the dense model to fit the routers, split
            evenly over the genres of :func:`epqlab.data.calibration_texts`.
        chunk: sequence length of one calibration forward pass (tokens, BOS included).
        router_ridge: L2 penalty of the logistic-regression router, relative to the mean feature variance.
        router_steps: gradient steps of the router fit.
        partition: ``"coactivation"`` (balanced k-means of neurons that fire together) or
            ``"random"`` (a baseline).
        seed: RNG seed; the build is deterministic for a given source and config.
    """

    n_expert: int = 8
    n_expert_used: int = 3
    n_ff_exp: int = 32
    n_expert_shared: int = 40
    n_f16_layers: int = 4
    calib_tokens: int = 4096
    chunk: int = 512
    router_ridge: float = 1e-3
    router_steps: int = 0
    partition: str = "coactivation"
    seed: int = 0

    @property
    def weights_scale(self) -> float:
        """``deepseek.expert_weights_scale``: k, so an expert holding 1/k of the softmax mass enters with weight 1."""
        return float(self.n_expert_used)

    @property
    def shared_width(self) -> int:
        return self.n_ff_exp * self.n_expert_shared


# ---------------------------------------------------------------------------------------------
# The conversion
# ---------------------------------------------------------------------------------------------


def calibration_tokens(src: Path, texts: dict[str, str] | str, n_tokens: int, chunk: int) -> list[list[int]]:
    """Calibration sequences: each text tokenized with the source model's own tokenizer (llama.cpp, vocab
    only; ChatML markers parsed as special tokens), its first ``n_tokens / len(texts)`` tokens cut into
    sequences of at most ``chunk - 1`` tokens (BOS is prepended later), genres interleaved."""
    from llama_cpp import Llama

    if isinstance(texts, str):
        texts = {"text": texts}
    per = max(1, n_tokens // len(texts))
    llm = Llama(str(src), vocab_only=True, verbose=False)
    try:
        seqs = []
        for name in sorted(texts):
            toks = llm.tokenize(texts[name].encode(), add_bos=False, special=True)[:per]
            seqs.append([toks[i:i + chunk - 1] for i in range(0, len(toks), chunk - 1)])
    finally:
        llm.close()
    out = []
    for i in range(max(len(s) for s in seqs)):
        out += [s[i] for s in seqs if i < len(s)]
    return out


def capture_activations(model: DenseLlama, seqs: list[list[int]], bar=None) -> list[np.ndarray]:
    """FFN inputs xn (N, n_embd) of every layer of the dense model on ``seqs`` (each run from position 0
    with BOS prepended; BOS positions are dropped)."""
    capture: list[list[np.ndarray]] = [[] for _ in range(model.n_layer)]
    bos = 1
    for seq in seqs:
        cap: list[list[np.ndarray]] = [[] for _ in range(model.n_layer)]
        model.forward([bos] + list(seq), cap)
        for il in range(model.n_layer):
            capture[il].append(cap[il][0][1:])
        if bar is not None:
            bar.update(1)
    return [np.concatenate(c) for c in capture]


def convert_layer(model: DenseLlama, il: int, xn: np.ndarray, cfg: MoefyConfig, rng
                  ) -> tuple[dict[str, np.ndarray], dict]:
    """Float32 MoE tensors of block ``il`` (GGUF names without the ``blk.N.`` prefix) and fit statistics
    (``temperature``: factor applied to the router; ``rel_err``: relative squared error of the routed
    output at k on the calibration tokens; ``oracle_rel_err``: the same with the oracle's experts and
    weight 1; ``margin``: median gap between the k-th and (k+1)-th router logit)."""
    E, F, W, k = cfg.n_expert, cfg.n_ff_exp, model.n_embd, cfg.n_expert_used
    n_sh = min(cfg.shared_width, model.n_ff)
    if E * F + cfg.shared_width < model.n_ff:
        raise ValueError(f"E * n_ff_exp + shared width = {E * F + cfg.shared_width} < n_ff {model.n_ff}")
    p = f"blk.{il}."
    gate, up, down = (model.W[p + f"ffn_{n}.weight"] for n in ("gate", "up", "down"))
    a, _ = model.ffn(il, xn)
    contrib = neuron_contributions(a, down)
    shared = np.sort(np.argsort(-contrib.mean(0), kind="stable")[:n_sh])
    rest = np.setdiff1d(np.arange(model.n_ff), shared)
    lab = partition_neurons(contrib[:, rest], E, F, cfg.partition, rng)
    C = expert_outputs(a[:, rest], down[:, rest], lab, E)
    scores = oracle_scores(C)
    router = fit_router(xn, scores, k, ridge=cfg.router_ridge, steps=cfg.router_steps)
    t, gain, err = choose_temperature(xn, router, C, k, cfg.weights_scale)
    router = router * np.float32(t)
    y = C.sum(0)
    top_o = np.argsort(-scores, axis=1, kind="stable")[:, :k]
    yo = C[top_o.T, np.arange(len(xn))[None, :]].sum(0)
    lg = np.sort(xn @ router.T, axis=1)[:, ::-1]
    pr = np.exp(lg - lg[:, :1])
    pr /= pr.sum(1, keepdims=True)
    stats = {"temperature": t, "gain": gain, "rel_err": err, "oracle_rel_err": float(((yo - y) ** 2).sum() / (y * y).sum()),
             "margin": float(np.median(lg[:, k - 1] - lg[:, k])) if k < E else float("inf"),
             "boundary_weight": float(np.median(pr[:, k - 1])) * cfg.weights_scale}
    out = {
        "ffn_gate_inp.weight": router,
        "ffn_gate_exps.weight": np.zeros((E, F, W), np.float32),
        "ffn_up_exps.weight": np.zeros((E, F, W), np.float32),
        "ffn_down_exps.weight": np.zeros((E, W, F), np.float32),
        "ffn_gate_shexp.weight": np.zeros((cfg.shared_width, W), np.float32),
        "ffn_up_shexp.weight": np.zeros((cfg.shared_width, W), np.float32),
        "ffn_down_shexp.weight": np.zeros((W, cfg.shared_width), np.float32),
    }
    for e in range(E):
        idx = rest[lab == e]
        out["ffn_gate_exps.weight"][e, :len(idx)] = gate[idx]
        out["ffn_up_exps.weight"][e, :len(idx)] = up[idx]
        out["ffn_down_exps.weight"][e, :, :len(idx)] = down[:, idx] * np.float32(gain)
    out["ffn_gate_shexp.weight"][:n_sh] = gate[shared]
    out["ffn_up_shexp.weight"][:n_sh] = up[shared]
    out["ffn_down_shexp.weight"][:, :n_sh] = down[:, shared]
    return out, stats


def moefy(src: str | os.PathLike, dst: str | os.PathLike, cfg: MoefyConfig = MoefyConfig(),
          calib_text: str | None = None, progress: bool = True,
          activations: list[np.ndarray] | None = None) -> dict:
    """Convert the dense llama GGUF ``src`` into a ``deepseek`` MoE GGUF at ``dst`` (written to a temp
    name and renamed, so ``dst`` is either absent or complete).

    ``activations``: precomputed :func:`capture_activations` output for the same calibration tokens
    (to try several configs without re-running the dense model).

    Returns a report dict: n_expert, n_expert_used, n_ff_exp, shared width, expert_bytes per type,
    seconds per stage.
    """
    import gguf
    from gguf import GGMLQuantizationType as QT
    from tqdm.auto import tqdm

    src, dst = Path(src), Path(dst)
    E = cfg.n_expert
    if cfg.n_ff_exp % 32:
        raise ValueError(f"n_ff_exp {cfg.n_ff_exp} must be a multiple of 32 (Q8_0 rows of down_exps)")
    rep: dict = {"n_expert": E, "n_expert_used": cfg.n_expert_used, "n_ff_exp": cfg.n_ff_exp,
                 "shared_width": cfg.shared_width, "seconds": {}, "layers": []}
    t0 = time.perf_counter()
    model = DenseLlama(src)
    n_embd = model.n_embd
    if calib_text is None:
        calib_text = calibration_texts()
    seqs = calibration_tokens(src, calib_text, cfg.calib_tokens, cfg.chunk)
    rep["seconds"]["load"] = time.perf_counter() - t0

    # 1. activations: FFN inputs of every layer on the calibration text (dense model)
    bar = tqdm(total=(0 if activations else len(seqs)) + model.n_layer, desc="moefy", unit="step",
               disable=not progress)
    t1 = time.perf_counter()
    xns = activations if activations is not None else capture_activations(model, seqs, bar)
    rep["seconds"]["activations"] = time.perf_counter() - t1

    # 2. per layer: shared neurons, partition, router, expert tensors
    t2 = time.perf_counter()
    rng = np.random.default_rng(cfg.seed)
    first_f16 = model.n_layer - cfg.n_f16_layers
    new: dict[str, tuple[np.ndarray, QT]] = {}
    for il in range(model.n_layer):
        qt = QT.F16 if il >= first_f16 else QT.Q8_0
        tensors, st = convert_layer(model, il, xns[il], cfg, rng)
        rep["layers"].append(st)
        for name, arr in tensors.items():
            if name == "ffn_gate_inp.weight":
                new[f"blk.{il}.{name}"] = (arr, QT.F32)
                continue
            arr = np.ascontiguousarray(arr, dtype=np.float32)
            data = arr.astype(np.float16) if qt == QT.F16 else gguf.quants.quantize(arr, qt)
            new[f"blk.{il}.{name}"] = (data, qt)
        bar.update(1)
    bar.close()
    rep["seconds"]["experts"] = time.perf_counter() - t2

    # 3. write: llama.* hparams renamed deepseek.*, other KVs and non-FFN tensors copied as is
    t3 = time.perf_counter()
    r = model.reader
    tmp = dst.with_name(dst.name + f".tmp{os.getpid()}")
    w = gguf.GGUFWriter(tmp, "deepseek")
    U32, F32, STR = gguf.GGUFValueType.UINT32, gguf.GGUFValueType.FLOAT32, gguf.GGUFValueType.STRING
    ds = "deepseek"
    override = {
        arch_key(KEY_EXPERT_COUNT, ds): (E, U32),
        arch_key(KEY_EXPERT_USED_COUNT, ds): (cfg.n_expert_used, U32),
        arch_key(KEY_EXPERT_FEED_FORWARD_LENGTH, ds): (cfg.n_ff_exp, U32),
        arch_key(KEY_EXPERT_SHARED_COUNT, ds): (cfg.n_expert_shared, U32),
        arch_key(KEY_LEADING_DENSE_BLOCK_COUNT, ds): (0, U32),
        arch_key(KEY_EXPERT_WEIGHTS_SCALE, ds): (cfg.weights_scale, F32),
        "general.file_type": (int(gguf.LlamaFileType.MOSTLY_Q8_0), U32),
        "general.name": (f"SmolLM2-135M-Instruct MoEfied deepseek {E}x{cfg.n_ff_exp} top-{cfg.n_expert_used} "
                         f"+ shared {cfg.shared_width}", STR),
    }
    for key, f in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        if key.startswith("llama."):
            key = "deepseek." + key[len("llama."):]
        if key in override:
            continue
        vtype = f.types[0]
        sub = f.types[1] if vtype == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, f.contents(), vtype, sub)
    for key, (val, vtype) in override.items():
        w.add_key_value(key, val, vtype)
    w.add_string("epqlab.moefy.partition", cfg.partition)
    w.add_uint32("epqlab.moefy.calib_tokens", sum(len(q) for q in seqs))
    w.add_string("epqlab.moefy.router", "logistic")
    w.add_array("epqlab.moefy.router_margin", [float(st["margin"]) for st in rep["layers"]])
    w.add_array("epqlab.moefy.boundary_weight", [float(st["boundary_weight"]) for st in rep["layers"]])
    w.add_array("epqlab.moefy.expert_gain", [float(st["gain"]) for st in rep["layers"]])
    w.add_string("epqlab.moefy.source", src.name)

    for t in r.tensors:
        if ".ffn_gate.weight" in t.name or ".ffn_up.weight" in t.name or ".ffn_down.weight" in t.name:
            continue
        w.add_tensor(t.name, np.asarray(t.data), raw_shape=np.asarray(t.data).shape, raw_dtype=t.tensor_type)
    for name, (data, qt) in new.items():
        w.add_tensor(name, data, raw_shape=data.shape, raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file(progress=False)
    w.close()
    os.replace(tmp, dst)
    rep["seconds"]["write"] = time.perf_counter() - t3
    rep["seconds"]["total"] = time.perf_counter() - t0
    F = cfg.n_ff_exp
    rep["expert_bytes"] = {"Q8_0": 3 * F * ggml_row_bytes("Q8_0", n_embd), "F16": 3 * F * ggml_row_bytes("F16", n_embd)}
    rep["n_f16_layers"] = cfg.n_f16_layers
    logger.info("moefy %s -> %s in %.1fs", src.name, dst, rep["seconds"]["total"])
    return rep
