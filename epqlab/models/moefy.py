"""MoEfication: turn a dense ``llama`` GGUF (SmolLM2-135M) into a ``llama``-arch MoE GGUF.

What llama.cpp computes for a ``llama`` MoE layer (src/models/llama.cpp, build_moe_ffn with
norm_w = true, softmax gating, no weight scale)::

    p   = softmax(ffn_gate_inp @ xn)                 # (E,)  xn = ffn_norm(x), (n_embd,)
    S   = top-k indices of p
    out = sum_{e in S} (p_e / sum_{j in S} p_j) * down_e @ (silu(gate_e @ xn) * (up_e @ xn))

The dense FFN is ``y = down @ (silu(gate @ xn) * (up @ xn))`` with ``n_ff`` neurons. We split the
neurons into E equal groups (expert e gets rows ``gate[idx_e]``, ``up[idx_e]`` and columns
``down[:, idx_e]``) and multiply each expert's down projection by E. The router logits are kept
tiny (their spread across experts is ``router_spread``, default 1e-3), so p is uniform to within
~0.1 %: with k = E every weight is ~1/E and ``out = sum_e C_e = y`` (C_e = expert e's share of y).

The invariant that costs quality: because llama.cpp renormalises the selected weights, with k < E
``out = (E/k) * sum_{e in S} C_e`` -- an estimate of y from k of the E groups, not the sum of the
k "biggest" groups (that would overshoot by up to E/k). So the router is fitted to pick the groups
whose E-scaled output is closest to y (target ``-||E*C_e - y|| / ||y||``, least squares from xn
on activations of real text), and neurons are assigned to groups so that every group is a small
stratified sample of the whole FFN (see :func:`partition_neurons`). The logit *order* carries the
routing; the logit *size* stays tiny so that k = E stays exact.

Activations come from a NumPy forward pass of the dense model (dequantized with
``gguf.quants.dequantize``), checked against llama-cpp-python's logits in tests/test_models.py.
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class MoefyConfig:
    """Knobs of :func:`moefy`.

    Attributes:
        n_expert: E, experts per layer; ``n_ff % E == 0`` and ``(n_ff // E) % 32 == 0`` (Q8_0 rows).
        n_expert_used: k written as ``llama.expert_used_count`` (llama.cpp can override it at load).
        n_f16_layers: the last this-many layers store experts in F16, the others in Q8_0.
        calib_tokens: tokens of calibration text run through the dense model to fit the routers.
        chunk: sequence length of one calibration forward pass (tokens, BOS included).
        router_spread: std of the router logits across experts; small keeps k = E exact.
        partition: ``"stratified"`` (each expert a cross-section of the FFN) or ``"coactivation"``
            (balanced clusters of neurons that fire together, the MoEfication paper's choice).
        n_shared_neurons: neurons with the largest peak contribution, copied into every expert with
            an unscaled down column (llama arch has no shared expert); n_ff - this must divide by E.
        seed: RNG seed; the build is deterministic for a given source and config.
    """

    n_expert: int = 16
    n_expert_used: int = 4
    n_f16_layers: int = 4
    calib_tokens: int = 2048
    chunk: int = 512
    router_spread: float = 1e-3
    n_shared_neurons: int = 0
    partition: str = "stratified"
    seed: int = 0


# ---------------------------------------------------------------------------------------------
# NumPy forward pass of a dense llama GGUF (used to capture FFN inputs on calibration text)
# ---------------------------------------------------------------------------------------------


class DenseLlama:
    """A dense ``llama``-arch GGUF evaluated in NumPy (float32), for activations and as a reference.

    Weights are dequantized with gguf-py; matrices keep GGUF's row layout, i.e. a tensor of ggml
    shape ``[ne0, ne1]`` becomes a NumPy array ``(ne1, ne0)`` = (out, in), so ``y = x @ W.T``.
    RoPE is llama.cpp's NORM mode (adjacent pairs), as for every ``llama`` GGUF.
    """

    def __init__(self, path: str | os.PathLike):
        from gguf import GGUFReader
        from gguf.quants import dequantize

        self.path = Path(path)
        r = GGUFReader(self.path)

        def kv(key, default=None):
            f = r.fields.get(key)
            return f.contents() if f is not None else default

        arch = kv("general.architecture")
        if arch != "llama":
            raise ValueError(f"{path}: architecture {arch!r}, expected a dense 'llama' GGUF")
        self.n_layer = int(kv("llama.block_count"))
        self.n_embd = int(kv("llama.embedding_length"))
        self.n_ff = int(kv("llama.feed_forward_length"))
        self.n_head = int(kv("llama.attention.head_count"))
        self.n_head_kv = int(kv("llama.attention.head_count_kv"))
        self.eps = float(kv("llama.attention.layer_norm_rms_epsilon"))
        self.rope_base = float(kv("llama.rope.freq_base", 10000.0))
        self.head_dim = self.n_embd // self.n_head
        self.reader = r
        self.tensors = {t.name: t for t in r.tensors}
        # token_embd stays quantized: rows are dequantized on lookup (it is 49152 x 576).
        self.W = {n: dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
                  for n, t in self.tensors.items() if n != "token_embd.weight"}
        self._dequantize = dequantize

    def embed(self, toks: np.ndarray) -> np.ndarray:
        t = self.tensors["token_embd.weight"]
        rows = np.asarray(t.data)[toks]
        return self._dequantize(rows, t.tensor_type).astype(np.float32).reshape(len(toks), self.n_embd)

    def output_matrix(self) -> np.ndarray:
        """(n_vocab, n_embd) output projection (tied to token_embd when there is no output.weight)."""
        if "output.weight" in self.W:
            return self.W["output.weight"]
        t = self.tensors["token_embd.weight"]
        return self._dequantize(t.data, t.tensor_type).astype(np.float32)

    def _rms(self, x, w):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + self.eps) * w

    def ffn(self, il: int, xn: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Dense SwiGLU FFN of block ``il``: xn (T, n_embd) -> (a (T, n_ff), y (T, n_embd))."""
        p = f"blk.{il}."
        g = xn @ self.W[p + "ffn_gate.weight"].T
        a = g / (1.0 + np.exp(-g)) * (xn @ self.W[p + "ffn_up.weight"].T)
        return a, a @ self.W[p + "ffn_down.weight"].T

    def forward(self, toks, capture: list | None = None, ffn=None) -> np.ndarray:
        """Run ``toks`` (one sequence, positions 0..T-1) and return the final hidden states (T, n_embd)
        after output_norm. ``capture[il]`` (a list per layer) receives each layer's FFN input xn;
        ``ffn(il, xn) -> (T, n_embd)`` replaces the dense FFN when given."""
        toks = np.asarray(toks)
        T, nh, nkv, hd = len(toks), self.n_head, self.n_head_kv, self.head_dim
        x = self.embed(toks)
        inv = self.rope_base ** (-np.arange(0, hd, 2, dtype=np.float64) / hd)
        ang = np.arange(T, dtype=np.float64)[:, None] * inv[None, :]
        cos = np.cos(ang)[:, None, :].astype(np.float32)  # (T, 1, hd/2)
        sin = np.sin(ang)[:, None, :].astype(np.float32)
        mask = np.triu(np.full((T, T), -np.inf, dtype=np.float32), 1)

        def rope(v):  # (T, H, hd), rotate pairs (2i, 2i+1)
            v0, v1 = v[..., 0::2], v[..., 1::2]
            out = np.empty_like(v)
            out[..., 0::2] = v0 * cos - v1 * sin
            out[..., 1::2] = v0 * sin + v1 * cos
            return out

        for il in range(self.n_layer):
            p = f"blk.{il}."
            xn = self._rms(x, self.W[p + "attn_norm.weight"])
            q = rope((xn @ self.W[p + "attn_q.weight"].T).reshape(T, nh, hd)).transpose(1, 0, 2)  # (nh, T, hd)
            k = rope((xn @ self.W[p + "attn_k.weight"].T).reshape(T, nkv, hd)).transpose(1, 0, 2)
            v = (xn @ self.W[p + "attn_v.weight"].T).reshape(T, nkv, hd).transpose(1, 0, 2)
            k = np.repeat(k, nh // nkv, axis=0)
            v = np.repeat(v, nh // nkv, axis=0)
            att = q @ k.transpose(0, 2, 1) / np.float32(np.sqrt(hd)) + mask  # (nh, T, T)
            att = np.exp(att - att.max(-1, keepdims=True))
            att /= att.sum(-1, keepdims=True)
            o = (att @ v).transpose(1, 0, 2).reshape(T, nh * hd)
            x = x + o @ self.W[p + "attn_output.weight"].T
            xn = self._rms(x, self.W[p + "ffn_norm.weight"])
            if capture is not None:
                capture[il].append(xn)
            x = x + (ffn(il, xn) if ffn is not None else self.ffn(il, xn)[1])
        return self._rms(x, self.W["output_norm.weight"])


# ---------------------------------------------------------------------------------------------
# Partition and router
# ---------------------------------------------------------------------------------------------


def _balanced_assign(cost: np.ndarray, cap: int) -> np.ndarray:
    """Greedy balanced assignment: rows (items) to columns (groups), each group exactly ``cap`` items,
    cheapest (item, group) pairs first. cost (n, G) with n == G * cap."""
    n, G = cost.shape
    lab = np.full(n, -1, dtype=np.int64)
    cnt = np.zeros(G, dtype=np.int64)
    for idx in np.argsort(cost, axis=None, kind="stable"):
        i, g = divmod(int(idx), G)
        if lab[i] < 0 and cnt[g] < cap:
            lab[i] = g
            cnt[g] += 1
    return lab


def partition_neurons(a: np.ndarray, down: np.ndarray, n_expert: int, method: str, rng) -> np.ndarray:
    """Assign each of the n_ff neurons to one of ``n_expert`` equal groups. Returns labels (n_ff,).

    a: (N, n_ff) activations ``silu(gate xn) * (up xn)`` on calibration tokens; down: (n_embd, n_ff).

    ``coactivation``: balanced k-means on the neurons' |activation| profiles (MoEfication).
    ``stratified``: the same k-means with n_ff/E clusters of E similar neurons each, then every
    expert takes one neuron of each cluster -- experts become similar cross-sections of the FFN,
    which is what the E/k-scaled renormalised average of k experts needs.
    """
    n_ff = a.shape[1]
    # neuron features: contribution-size profile |a| * ||down col|| over a random projection of the
    # calibration tokens (64 dims; an SVD here would cost seconds per layer on 2 cores)
    f = np.abs(a) * np.linalg.norm(down, axis=0)[None, :]  # (N, n_ff)
    proj = rng.standard_normal((64, f.shape[0])).astype(np.float32) / np.sqrt(f.shape[0])
    feat = (proj @ f).T  # (n_ff, 64)
    if method == "coactivation":
        G, cap = n_expert, n_ff // n_expert
    elif method == "stratified":
        G, cap = n_ff // n_expert, n_expert
    else:
        raise ValueError(f"unknown partition method {method!r}")
    cent = feat[rng.choice(n_ff, G, replace=False)]
    lab = None
    for _ in range(6):
        d = ((feat[:, None, :] - cent[None]) ** 2).sum(-1)
        new = _balanced_assign(d, cap)
        if lab is not None and np.array_equal(new, lab):
            break
        lab = new
        cent = np.stack([feat[lab == g].mean(0) for g in range(G)])
    if method == "coactivation":
        return lab
    out = np.empty(n_ff, dtype=np.int64)
    for g in range(G):  # spread each cluster of E similar neurons over the E experts
        members = np.flatnonzero(lab == g)
        out[members] = rng.permutation(n_expert)
    return out


def fit_router(xn: np.ndarray, a: np.ndarray, down: np.ndarray, labels: np.ndarray, n_expert: int,
               spread: float) -> np.ndarray:
    """Least-squares router (n_expert, n_embd) whose logits rank experts by how close their E-scaled
    output is to the dense output, rescaled so the logits' std across experts is ``spread``.

    xn: (N, n_embd) FFN inputs; a: (N, n_ff) activations; down: (n_embd, n_ff)."""
    y = a @ down.T  # (N, n_embd)
    yn = np.linalg.norm(y, axis=-1, keepdims=True) + 1e-6
    target = np.empty((len(xn), n_expert), dtype=np.float32)
    for e in range(n_expert):
        m = labels == e
        ce = a[:, m] @ down[:, m].T
        target[:, e] = -np.linalg.norm(n_expert * ce - y, axis=-1) / yn[:, 0]
    target -= target.mean(1, keepdims=True)
    R, *_ = np.linalg.lstsq(xn.astype(np.float64), target.astype(np.float64), rcond=None)  # (n_embd, E)
    logits = xn @ R
    scale = spread / max(float(logits.std(axis=1).mean()), 1e-12)
    return (R * scale).T.astype(np.float32)


# ---------------------------------------------------------------------------------------------
# The conversion
# ---------------------------------------------------------------------------------------------


def calibration_tokens(src: Path, text: str, n_tokens: int) -> list[int]:
    """Tokenize ``text`` with the source model's own tokenizer (llama.cpp, vocab only)."""
    from llama_cpp import Llama

    llm = Llama(str(src), vocab_only=True, verbose=False)
    try:
        toks = llm.tokenize(text.encode(), add_bos=False, special=False)
    finally:
        llm.close()
    return toks[:n_tokens]


def moefy(src: str | os.PathLike, dst: str | os.PathLike, cfg: MoefyConfig = MoefyConfig(),
          calib_text: str | None = None, progress: bool = True) -> dict:
    """Convert the dense llama GGUF ``src`` into a MoE GGUF at ``dst`` (written to a temp name and
    renamed, so ``dst`` is either absent or complete).

    Returns a report dict: n_expert, n_expert_used, expert_bytes per type, seconds per stage.
    """
    import gguf
    from gguf import GGMLQuantizationType as QT
    from tqdm.auto import tqdm

    src, dst = Path(src), Path(dst)
    rep: dict = {"n_expert": cfg.n_expert, "n_expert_used": cfg.n_expert_used, "seconds": {}}
    t0 = time.perf_counter()
    model = DenseLlama(src)
    E, n_ff, n_embd = cfg.n_expert, model.n_ff, model.n_embd
    n_shared = cfg.n_shared_neurons
    if (n_ff - n_shared) % E:
        raise ValueError(f"n_ff {n_ff} - n_shared_neurons {n_shared} must split into {E} equal groups")
    n_own = (n_ff - n_shared) // E
    n_ff_e = -(-(n_own + n_shared) // 32) * 32  # Q8_0 rows of down_exps need a multiple of 32
    if calib_text is None:
        from importlib.resources import files

        calib_text = files("epqlab.data").joinpath("calib_reference.txt").read_text(encoding="utf-8")
    toks = calibration_tokens(src, calib_text, cfg.calib_tokens)
    rep["seconds"]["load"] = time.perf_counter() - t0

    # 1. activations: FFN inputs of every layer on the calibration text (dense model)
    chunks = [toks[i:i + cfg.chunk - 1] for i in range(0, len(toks), cfg.chunk - 1)]
    bar = tqdm(total=len(chunks) + model.n_layer, desc="moefy", unit="step", disable=not progress)
    capture: list[list[np.ndarray]] = [[] for _ in range(model.n_layer)]
    t1 = time.perf_counter()
    bos = 1
    for c in chunks:
        model.forward([bos] + c, capture)
        bar.update(1)
    rep["seconds"]["activations"] = time.perf_counter() - t1

    # 2. per layer: partition, router, expert tensors
    t2 = time.perf_counter()
    rng = np.random.default_rng(cfg.seed)
    first_f16 = model.n_layer - cfg.n_f16_layers
    new: dict[str, tuple[np.ndarray, QT]] = {}
    for il in range(model.n_layer):
        p = f"blk.{il}."
        xn = np.concatenate(capture[il])
        capture[il] = []
        gate, up, down = (model.W[p + f"ffn_{n}.weight"] for n in ("gate", "up", "down"))
        a, _ = model.ffn(il, xn)
        # shared neurons: the largest single contributions (massive activations) go into every expert
        # with an unscaled down column, so any k reproduces them exactly (weights sum to 1)
        peak = (np.abs(a) * np.linalg.norm(down, axis=0)[None, :]).max(0)
        shared = np.sort(np.argsort(-peak, kind="stable")[:n_shared])
        rest = np.setdiff1d(np.arange(n_ff), shared)
        lab = partition_neurons(a[:, rest], down[:, rest], E, cfg.partition, rng)
        own = np.stack([rest[lab == e] for e in range(E)])  # (E, n_own)
        router = fit_router(xn, a[:, rest], down[:, rest], lab, E, cfg.router_spread)
        g_e = np.zeros((E, n_ff_e, n_embd), np.float32)  # rows: own | shared | zero padding
        u_e = np.zeros((E, n_ff_e, n_embd), np.float32)
        d_e = np.zeros((E, n_embd, n_ff_e), np.float32)
        g_e[:, :n_own], g_e[:, n_own:n_own + n_shared] = gate[own], gate[shared][None]
        u_e[:, :n_own], u_e[:, n_own:n_own + n_shared] = up[own], up[shared][None]
        d_e[:, :, :n_own] = (down[:, own] * E).transpose(1, 0, 2)
        d_e[:, :, n_own:n_own + n_shared] = down[:, shared][None]
        qt = QT.F16 if il >= first_f16 else QT.Q8_0
        for name, arr in (("gate", g_e), ("up", u_e), ("down", d_e)):
            arr = np.ascontiguousarray(arr, dtype=np.float32)
            data = arr.astype(np.float16) if qt == QT.F16 else gguf.quants.quantize(arr, qt)
            new[p + f"ffn_{name}_exps.weight"] = (data, qt)
        new[p + "ffn_gate_inp.weight"] = (router, QT.F32)
        bar.update(1)
    bar.close()
    rep["seconds"]["experts"] = time.perf_counter() - t2

    # 3. write: every source KV and non-FFN tensor copied as is, FFN tensors replaced
    t3 = time.perf_counter()
    r = model.reader
    tmp = dst.with_name(dst.name + f".tmp{os.getpid()}")
    w = gguf.GGUFWriter(tmp, "llama")
    override = {
        "llama.expert_count": (E, gguf.GGUFValueType.UINT32),
        "llama.expert_used_count": (cfg.n_expert_used, gguf.GGUFValueType.UINT32),
        "llama.feed_forward_length": (n_ff_e, gguf.GGUFValueType.UINT32),
        "general.file_type": (int(gguf.LlamaFileType.MOSTLY_Q8_0), gguf.GGUFValueType.UINT32),
        "general.name": (f"SmolLM2-135M-Instruct MoEfied {E}x{n_ff_e} top-{cfg.n_expert_used}",
                         gguf.GGUFValueType.STRING),
    }
    for key, f in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or key in override:
            continue
        vtype = f.types[0]
        sub = f.types[1] if vtype == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, f.contents(), vtype, sub)
    for key, (val, vtype) in override.items():
        w.add_key_value(key, val, vtype)
    w.add_string("epqlab.moefy.partition", cfg.partition)
    w.add_uint32("epqlab.moefy.calib_tokens", len(toks))
    w.add_float32("epqlab.moefy.router_spread", cfg.router_spread)
    w.add_uint32("epqlab.moefy.n_shared_neurons", n_shared)
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
    q8 = 3 * n_ff_e * (n_embd // 32) * 34
    rep["expert_bytes"] = {"Q8_0": q8, "F16": 3 * n_ff_e * n_embd * 2}
    rep["n_f16_layers"] = cfg.n_f16_layers
    logger.info("moefy %s -> %s in %.1fs", src.name, dst, rep["seconds"]["total"])
    return rep
