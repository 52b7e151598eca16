"""Routing profiles for synthetic models: weights that make random-weight MoEs route like real ones.

``uniform`` (the default of :func:`epqlab.models.synthesize`): random routers, so every expert is
equally likely and consecutive tokens share experts only by chance (k/E).

``skewed``: the weights alone (no engine change) give per-layer popularity skew and reuse. Every token
embedding is ``embd_scale * u + token_std * embd_scale * n_t`` with ``u`` a fixed +/-1 vector (a constant
component carried by the residual stream, as real LLMs carry large near-constant activations) and
``n_t`` a per-token standard normal. After RMSNorm the FFN input is ~``u + token_std * n_t``, and
expert e of layer l reads it through router row ::

    R[l, e] = bias[l, e] * u / D  +  (1 / token_std) * g[l, e] / sqrt(D)      (g orthogonal to u)

so its logit is ``bias[l, e]`` (a per-expert bias, the same for every token) plus a token-dependent part
~N(0, 1). ``bias[l, e] = -zipf * log(rank + 1)`` over a random permutation of ranks per layer: a
Zipf-like popularity whose steepness is ``zipf`` (0 = uniform popularity). Whatever the random
attention and FFN layers add to the residual stream adds to the token-dependent part.

The preset :data:`SKEWED` targets the statistics of a real MoE measured in seed study 002 (Qwen3.6-35B-A3B,
40 layers x 256 experts, top-8, llama.cpp with an 8 GB arena of 1936 slots = 18.9 % of the experts):
LRU hit rate 70 % at that arena and a U(4) saving of 38.5 %. Simulated with i.i.d. tokens (logit =
bias + N(0, 1)), ``zipf = 1.0`` gives LRU 54 % at a 10 % arena and 84 % at 25 % (~72 % at 18.9 %) and a
U(4) saving of 41 %. Measured on the ``small`` preset (4 layers x 64 experts, top-4), routes of 256
teacher-forced tokens of held-out prose: LRU 57.8 % / Belady 77.8 % at a 10 % arena, LRU 88.7 % at
25 %, U(4) saving 43 %, previous-token repeat 44 %, top quarter of experts 92-95 % of each layer's
requests; uniform random routing of the same shape: LRU ~10 % at a 10 % arena. The test band
:data:`SKEWED_LRU10_BAND` is wide because the random layers add an uncontrolled part to the logits.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

ROUTINGS = ("uniform", "skewed")


@dataclass(frozen=True)
class RoutingProfile:
    """Knobs of ``routing="skewed"``.

    Attributes:
        zipf: steepness of the per-layer expert bias ``-zipf * log(rank + 1)`` (logit units; 0 = none).
        token_std: relative size of the token-dependent part of the embeddings (sets how strongly a
            router's token part is amplified; its logit std is 1 by construction).
        embd_scale: magnitude of each element of the constant embedding component (keeps it dominant over
            what the random layers add).
        seed: RNG seed of biases, router directions and embeddings.
    """

    zipf: float = 1.0
    token_std: float = 0.3
    embd_scale: float = 8.0
    seed: int = 1


SKEWED = RoutingProfile()
SKEWED_LRU10_BAND = (0.35, 0.75)  # LRU hit rate at a 10 % arena, skewed small test model (tests/test_models.py)


def constant_direction(n_embd: int, seed: int) -> np.ndarray:
    """The fixed +/-1 vector ``u`` (float32, (n_embd,))."""
    return np.where(np.random.default_rng([seed, 7]).random(n_embd) < 0.5, -1.0, 1.0).astype(np.float32)


def embedding_rows(p: RoutingProfile, n_embd: int, start: int, stop: int) -> np.ndarray:
    """Float32 embeddings (stop - start, n_embd) of token ids start..stop-1:
    ``embd_scale * (u + token_std * n_t)``; the normals come from one generator per block of
    :data:`EMBD_BLOCK` rows (``start`` must be a multiple of it), so the file is reproducible."""
    if start % EMBD_BLOCK:
        raise ValueError(f"start {start} must be a multiple of {EMBD_BLOCK}")
    u = constant_direction(n_embd, p.seed)
    parts = []
    for r0 in range(start, stop, EMBD_BLOCK):
        n = min(EMBD_BLOCK, stop - r0)
        parts.append(np.random.default_rng([p.seed, 11, r0]).standard_normal((n, n_embd), dtype=np.float32))
    out = np.concatenate(parts) if len(parts) > 1 else parts[0]
    out *= np.float32(p.token_std)
    out += u
    out *= np.float32(p.embd_scale)
    return out


EMBD_BLOCK = 4096


def router_matrix(p: RoutingProfile, n_embd: int, n_expert: int, layer: int) -> np.ndarray:
    """Router of block ``layer`` as (n_expert, n_embd) float32 (GGUF ``ffn_gate_inp`` rows)."""
    rng = np.random.default_rng([p.seed, 13, layer])
    u = constant_direction(n_embd, p.seed)
    rank = rng.permutation(n_expert)
    bias = -p.zipf * np.log(rank + 1.0)
    bias -= bias.mean()
    g = rng.standard_normal((n_expert, n_embd))
    g -= np.outer(g @ u, u) / n_embd  # orthogonal to u
    R = np.outer(bias, u) / n_embd + g / (np.sqrt(n_embd) * p.token_std)
    return R.astype(np.float32)


def quantize_q8_0(x: np.ndarray) -> np.ndarray:
    """ggml Q8_0 bytes of float32 rows x (..., n) with n a multiple of 32 (d = max|x| / 127 per block of
    32, q = round(x / d)), as uint8 (..., n // 32 * 34); ggml's reference quantizer."""
    sh = x.shape
    b = x.reshape(-1, 32).astype(np.float32)
    amax = np.abs(b).max(1)
    d = (amax / 127.0).astype(np.float32)
    inv = np.where(d > 0, 1.0 / np.where(d > 0, d, 1), 0.0).astype(np.float32)
    q = np.clip(np.round(b * inv[:, None]), -127, 127).astype(np.int8)
    out = np.empty((len(b), 34), np.uint8)
    out[:, :2] = d.astype(np.float16).view(np.uint8).reshape(-1, 2)
    out[:, 2:] = q.view(np.uint8)
    return out.reshape(*sh[:-1], sh[-1] // 32 * 34)


def encode(x: np.ndarray, t: str) -> np.ndarray:
    """float32 array -> bytes of ggml type ``t`` (``Q8_0``, ``Q4_0``, ``Q4_1``, ``Q5_0``, ``Q5_1``, ``F16``, ``BF16``,
    ``F32``), as uint8."""
    if t == "Q8_0":
        return quantize_q8_0(x).reshape(-1)
    if t == "F16":
        return x.astype(np.float16).view(np.uint8).reshape(-1)
    if t == "BF16":
        return (x.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16).view(np.uint8).reshape(-1)
    if t == "F32":
        return x.astype(np.float32).view(np.uint8).reshape(-1)
    if t in ("Q4_0", "Q4_1", "Q5_0", "Q5_1"):  # gguf-py's reference quantizers (no K-quants there)
        from gguf import GGMLQuantizationType as QT
        from gguf.quants import quantize

        return np.ascontiguousarray(quantize(x.astype(np.float32), QT[t])).view(np.uint8).reshape(-1)
    raise ValueError(f"routing='skewed' needs token_embd and routers of type Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, F16, BF16 "
                     f"or F32, got {t}")
