"""NumPy reference implementations for MoEfication (:mod:`epqlab.models.moefy`): a dense ``llama`` GGUF
evaluated in float32 (:class:`DenseLlama`, checked against llama-cpp-python's logits in tests/test_models.py),
and llama.cpp's ``deepseek`` MoE layer (:func:`moe_ffn`)."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np


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


def moe_ffn(xn: np.ndarray, router: np.ndarray, gate_e: np.ndarray, up_e: np.ndarray, down_e: np.ndarray,
            gate_s: np.ndarray, up_s: np.ndarray, down_s: np.ndarray, k: int, w_scale: float
            ) -> tuple[np.ndarray, np.ndarray]:
    """NumPy replica of llama.cpp's ``deepseek`` MoE layer: softmax gating, top-k, no renormalisation,
    weights times ``w_scale``, plus the ungated shared expert. Returns (out (T, n_embd), top (T, k)).

    xn (T, n_embd); router (E, n_embd); gate_e/up_e (E, n_ff_exp, n_embd); down_e (E, n_embd, n_ff_exp);
    gate_s/up_s (n_shared, n_embd); down_s (n_embd, n_shared)."""
    def swiglu(x, g, u, d):
        h = x @ g.T
        return (h / (1.0 + np.exp(-h)) * (x @ u.T)) @ d.T

    logits = xn @ router.T
    pr = np.exp(logits - logits.max(1, keepdims=True))
    pr /= pr.sum(1, keepdims=True)
    top = np.argsort(-pr, axis=1, kind="stable")[:, :k]
    w = np.take_along_axis(pr, top, 1) * w_scale
    out = swiglu(xn, gate_s, up_s, down_s)
    for j in range(k):
        for e in np.unique(top[:, j]):
            rows = top[:, j] == e
            out[rows] += w[rows, j:j + 1] * swiglu(xn[rows], gate_e[e], up_e[e], down_e[e])
    return out, top


__all__ = ["DenseLlama", "moe_ffn"]
