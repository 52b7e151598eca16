"""Synthetic MoE GGUFs with real architecture shapes and random weights, written fast.

The files load in llama.cpp and give finite logits, so they exercise the pager at real sizes
(Qwen3-30B-A3B: 17 GB, Laguna-S class: 48 layers x 256 experts) without any download. The text
they produce is noise. Tensor bytes are tiles of one random buffer per ggml type, each a run of
valid blocks: Q4_K blocks have finite f16 ``d``/``dmin`` with ``dmin = 7.5 d`` (so weights are
centred), random 6-bit scales and random 4-bit quants; F16/BF16/F32 are small normals. The
tokenizer is SmolLM2's (49152 tokens), copied from the source GGUF of the default model.

Layout rules we rely on (llama.cpp, this repo's vendored version):
- ``qwen3moe``: every layer MoE, q/k RMS norms, no shared expert.
- ``dots1``: ``leading_dense_block_count`` dense layers first, then MoE layers with one shared
  expert; K and V have ``n_head`` heads (n_head_kv = n_head).
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from ..constants import (KEY_BLOCK_COUNT, KEY_CONTEXT_LENGTH, KEY_EXPERT_COUNT, KEY_EXPERT_FEED_FORWARD_LENGTH,
                         KEY_EXPERT_SHARED_COUNT, KEY_EXPERT_USED_COUNT, KEY_FEED_FORWARD_LENGTH,
                         KEY_LEADING_DENSE_BLOCK_COUNT, arch_key, ggml_block, ggml_row_bytes)

from .routing_profile import ROUTINGS, SKEWED, RoutingProfile, embedding_rows, encode, router_matrix
from .smollm2 import source_gguf


def per_block(il: int, n_layer: int, n_dense_lead: int, n_late_layers: int, main, late=None):
    """The setting of block ``il`` in a stack of ``n_layer`` blocks: None for the ``n_dense_lead`` leading dense
    blocks, ``late`` for the last ``n_late_layers`` blocks when ``late`` is set, else ``main`` (how
    :class:`SynthSpec` and :class:`epqlab.models.archs.ArchSpec` type their experts)."""
    if il < n_dense_lead:
        return None
    if late and il >= n_layer - n_late_layers:
        return late
    return main


@dataclass(frozen=True)
class SynthSpec:
    """Shape and types of a synthetic model. Use a preset from :data:`PRESETS` and override fields.

    Attributes:
        arch: ``qwen3moe`` or ``dots1`` (leading dense layers + a shared expert).
        n_layer, n_embd, n_head, n_head_kv, head_dim: transformer shapes.
        n_expert, n_expert_used: routed experts per MoE layer, top-k.
        n_ff_exp: neurons per routed expert; n_ff_dense: neurons of the dense layers' FFN.
        n_dense_lead: leading dense layers (``dots1`` only).
        expert_type: ggml type of routed-expert tensors in most layers.
        late_expert_type / n_late_layers: a second expert type for the last ``n_late_layers`` layers
            (two slot classes like Laguna's Q4_K + BF16), or None.
        other_type: ggml type of attention, dense FFN and shared-expert matrices.
        unaligned: store experts as Q8_0 and pick n_ff_exp so that no expert slice is a multiple of
            4096 bytes (pager tests need that); raises ValueError where the shapes make it impossible.
    """

    arch: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_expert: int
    n_expert_used: int
    n_ff_exp: int
    n_ff_dense: int = 0
    n_dense_lead: int = 0
    expert_type: str = "Q4_K"
    late_expert_type: str | None = None
    n_late_layers: int = 0
    other_type: str = "Q8_0"
    unaligned: bool = False
    seed: int = 0
    name: str = "synthetic"

    def expert_type_of(self, il: int) -> str | None:
        """ggml type of block ``il``'s routed experts, None for a dense block."""
        return per_block(il, self.n_layer, self.n_dense_lead, self.n_late_layers, self.expert_type,
                         self.late_expert_type)


PRESETS: dict[str, SynthSpec] = {
    # Qwen3-30B-A3B: 48 layers, 128 experts, top-8, n_embd 2048, expert n_ff 768, 32 q / 4 kv heads of 128
    "qwen3-30b-a3b": SynthSpec("qwen3moe", 48, 2048, 32, 4, 128, 128, 8, 768, name="synthetic Qwen3-30B-A3B"),
    # seed 002's Qwen3.6-35B-A3B shape (moe-stream's model): 40 layers x 256 experts, top-8, expert n_ff 512
    # (Q4_K: 1.69 MiB per expert, 16.9 GiB routed, 17.9 GiB in all); written with skewed routing by default
    "qwen35-a3b": SynthSpec("qwen3moe", 40, 2048, 32, 4, 128, 256, 8, 512, name="synthetic Qwen3.6-35B-A3B"),
    # Laguna-S class: layer 0 dense, layers 1-39 Q4_K experts (5.06 MiB), 40-47 BF16 experts (18 MiB)
    "laguna-s": SynthSpec("dots1", 48, 3072, 24, 24, 128, 256, 10, 1024, n_ff_dense=8192, n_dense_lead=1,
                          late_expert_type="BF16", n_late_layers=8, name="synthetic Laguna-S"),
    # tests: 4 layers, 8 experts, two slot classes (Q4_K, BF16)
    "tiny": SynthSpec("qwen3moe", 4, 256, 4, 2, 64, 8, 2, 256, late_expert_type="BF16", n_late_layers=1,
                      name="synthetic tiny"),
    # routing statistics tests: 4 layers of 64 experts, top-4 (k/E = 1/16 as in Qwen3-30B-A3B), small experts
    "small": SynthSpec("qwen3moe", 4, 256, 4, 2, 64, 64, 4, 64, expert_type="Q8_0", name="synthetic small"),
}


def _random_blocks(t: str, nbytes: int, rng: np.random.Generator) -> np.ndarray:
    """``nbytes`` (a whole number of blocks) of valid random ``t`` data, as uint8."""
    size = ggml_block(t)[1]
    if t == "Q4_K":
        nb = nbytes // size
        blk = rng.integers(0, 256, size=(nb, size), dtype=np.uint8)
        d = (rng.uniform(0.5, 1.0, nb) * 2e-4).astype(np.float16)
        blk[:, 0:2] = d.view(np.uint8).reshape(nb, 2)
        blk[:, 2:4] = (d.astype(np.float32) * 7.5).astype(np.float16).view(np.uint8).reshape(nb, 2)
        return blk.reshape(-1)
    if t == "Q8_0":
        nb = nbytes // size
        blk = rng.integers(-127, 128, size=(nb, size), dtype=np.int8).view(np.uint8)
        blk[:, 0:2] = (rng.uniform(0.5, 1.0, nb) * 3e-4).astype(np.float16).view(np.uint8).reshape(nb, 2)
        return blk.reshape(-1)
    x = rng.standard_normal(nbytes // size, dtype=np.float32) * 0.02
    if t == "F32":
        return x.view(np.uint8)
    if t == "F16":
        return x.astype(np.float16).view(np.uint8)
    if t == "BF16":
        return (x.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    raise ValueError(f"unsupported type {t}")


def _tensors(s: SynthSpec) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, ggml shape (ne0, ne1, ...), type) for every tensor, in file order."""
    V, D, ot = 49152, s.n_embd, s.other_type
    q, kv = s.n_head * s.head_dim, s.n_head_kv * s.head_dim
    out = [("token_embd.weight", (D, V), ot), ("output_norm.weight", (D,), "F32"), ("output.weight", (D, V), ot)]
    for il in range(s.n_layer):
        p = f"blk.{il}."
        out += [(p + "attn_norm.weight", (D,), "F32"), (p + "attn_q.weight", (D, q), ot),
                (p + "attn_k.weight", (D, kv), ot), (p + "attn_v.weight", (D, kv), ot),
                (p + "attn_output.weight", (q, D), ot), (p + "attn_q_norm.weight", (s.head_dim,), "F32"),
                (p + "attn_k_norm.weight", (s.head_dim,), "F32"), (p + "ffn_norm.weight", (D,), "F32")]
        et = s.expert_type_of(il)
        if et is None:
            f = s.n_ff_dense
            out += [(p + "ffn_gate.weight", (D, f), ot), (p + "ffn_up.weight", (D, f), ot), (p + "ffn_down.weight", (f, D), ot)]
            continue
        E, f = s.n_expert, s.n_ff_exp
        out += [(p + "ffn_gate_inp.weight", (D, E), "F32"), (p + "ffn_gate_exps.weight", (D, f, E), et),
                (p + "ffn_up_exps.weight", (D, f, E), et), (p + "ffn_down_exps.weight", (f, D, E), et)]
        if s.arch == "dots1":
            out += [(p + "ffn_gate_shexp.weight", (D, f), ot), (p + "ffn_up_shexp.weight", (D, f), ot),
                    (p + "ffn_down_shexp.weight", (f, D), ot)]
    return out


def _nbytes(shape, t) -> int:
    n = ggml_row_bytes(t, shape[0])
    for d in shape[1:]:
        n *= d
    return n


def _make_unaligned(s: SynthSpec) -> SynthSpec:
    s = replace(s, expert_type="Q8_0", late_expert_type=None, n_late_layers=0)
    for f in sorted(range(32, 4 * s.n_ff_exp + 1, 32), key=lambda f: abs(f - s.n_ff_exp)):
        sizes = [ggml_row_bytes("Q8_0", s.n_embd) * f, ggml_row_bytes("Q8_0", f) * s.n_embd]
        if all(b % 4096 for b in sizes):
            return replace(s, n_ff_exp=f)
    raise ValueError(f"n_embd {s.n_embd}: every Q8_0 expert slice is a multiple of 4096 bytes; use a smaller n_embd")


PRESET_ROUTING = {"qwen35-a3b": "skewed", "laguna-s": "skewed"}
"""Presets written with skewed routing unless ``routing=`` says otherwise (the others: uniform). The two
seed shapes target their studies' figures: ``qwen35-a3b`` 40 x 256 experts of 1.69 MiB (16.9 GiB routed,
17.9 GiB file; seed 002 measured a 70% decode hit rate at 18.9% coverage, Belady 78.9%), ``laguna-s``
48 layers (1 dense, 39 of 256 Q4_K experts of 5.06 MiB, 8 of 256 BF16 experts of 18 MiB): 91,653,931,008
routed bytes (85.4 GiB), as seed 000 lists for Laguna-S-2.1 Q4_K_M (96.0 GB file)."""


def planned_sizes(preset: str, **overrides) -> dict:
    """Sizes a preset (with ``overrides``, as :func:`synthesize` takes them) would write, without writing:
    ``expert_bytes`` (list, bytes of one expert's gate+up+down slices per MoE layer), ``routed_expert_bytes``
    (all routed experts), ``tensor_bytes`` (every tensor's data, the file less its header and padding),
    ``n_moe_layers``.

    Raises:
        ValueError: unknown preset.
    """
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    s = replace(PRESETS[preset], **overrides)
    per_layer: dict[int, int] = {}
    total = 0
    for name, shape, t in _tensors(s):
        n = _nbytes(shape, t)
        total += n
        if "_exps." in name:
            il = int(name.split(".")[1])
            per_layer[il] = per_layer.get(il, 0) + n // shape[-1]
    eb = [per_layer[i] for i in sorted(per_layer)]
    return {"expert_bytes": eb, "routed_expert_bytes": sum(eb) * s.n_expert, "tensor_bytes": total,
            "n_moe_layers": len(eb)}


def synthesize(path: str | os.PathLike, preset: str = "tiny", *, sparse: bool = False, progress: bool = True,
               routing: str | None = None, **overrides) -> dict:
    """Write a synthetic MoE GGUF to ``path``.

    Args:
        path: output file (written to a temp name, then renamed).
        preset: a key of :data:`PRESETS` (``qwen3-30b-a3b``, ``laguna-s``, ``tiny``, ``small``).
        sparse: leave the routed-expert bytes as holes (fast, tiny on disk, reads as zeros, so
            logits are not meaningful); the default writes real random bytes.
        routing: ``"uniform"`` (random routers: no popularity skew, reuse only by chance) or
            ``"skewed"`` (token embeddings and routers written so that routing has per-layer popularity
            skew and reuse like a real MoE; see :mod:`epqlab.models.routing_profile`); None: the preset's
            (:data:`PRESET_ROUTING`, else uniform).
        **overrides: any :class:`SynthSpec` field, e.g. ``n_layer=96`` to make a ~30 GB file, or any
            :class:`~epqlab.models.routing_profile.RoutingProfile` field (``zipf``, ``token_std``,
            ``embd_scale``) with ``routing="skewed"``.

    Returns:
        dict with ``path``, ``bytes``, ``seconds``, ``mb_per_s`` (MB = 1e6 bytes), ``spec``, ``routing``
        (the RoutingProfile, or None for uniform).

    Raises:
        ValueError: unknown preset, routing or override name.
    """
    import gguf
    from gguf import GGMLQuantizationType as QT
    from tqdm.auto import tqdm

    from dataclasses import fields

    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    if routing is None:
        routing = PRESET_ROUTING.get(preset, "uniform")
    if routing not in ROUTINGS:
        raise ValueError(f"unknown routing {routing!r}; choose one of {', '.join(ROUTINGS)}")
    rknobs = {f.name for f in fields(RoutingProfile)}
    sknobs = {f.name for f in fields(SynthSpec)}
    bad = sorted(set(overrides) - rknobs - sknobs)
    if bad:
        raise ValueError(f"unknown override(s) {', '.join(bad)}; SynthSpec fields: {', '.join(sorted(sknobs))}; "
                         f"routing knobs (routing='skewed'): {', '.join(sorted(rknobs))}")
    rover = {k: overrides.pop(k) for k in list(overrides) if k in rknobs and k not in sknobs}
    if "seed" in overrides and routing == "skewed":
        rover["seed"] = overrides["seed"]
    if rover and routing != "skewed":
        raise ValueError(f"{', '.join(sorted(rover))} only apply with routing='skewed'")
    prof = replace(SKEWED, **rover) if routing == "skewed" else None
    s = replace(PRESETS[preset], **overrides)
    if s.unaligned:
        s = _make_unaligned(s)
    path = Path(path)
    t0 = time.perf_counter()
    tensors = _tensors(s)

    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    w = gguf.GGUFWriter(tmp, s.arch)
    a = s.arch
    w.add_name(s.name)
    w.add_uint32(arch_key(KEY_BLOCK_COUNT, a), s.n_layer)
    w.add_uint32(arch_key(KEY_CONTEXT_LENGTH, a), 4096)
    w.add_uint32(f"{a}.embedding_length", s.n_embd)
    w.add_uint32(arch_key(KEY_FEED_FORWARD_LENGTH, a), s.n_ff_dense or s.n_ff_exp)
    w.add_uint32(arch_key(KEY_EXPERT_FEED_FORWARD_LENGTH, a), s.n_ff_exp)
    w.add_uint32(f"{a}.attention.head_count", s.n_head)
    w.add_uint32(f"{a}.attention.head_count_kv", s.n_head_kv)
    w.add_uint32(f"{a}.attention.key_length", s.head_dim)
    w.add_uint32(f"{a}.attention.value_length", s.head_dim)
    w.add_uint32(f"{a}.rope.dimension_count", s.head_dim)
    w.add_float32(f"{a}.rope.freq_base", 1e6)
    w.add_float32(f"{a}.attention.layer_norm_rms_epsilon", 1e-6)
    w.add_uint32(arch_key(KEY_EXPERT_COUNT, a), s.n_expert)
    w.add_uint32(arch_key(KEY_EXPERT_USED_COUNT, a), s.n_expert_used)
    if a == "dots1":
        w.add_uint32(arch_key(KEY_LEADING_DENSE_BLOCK_COUNT, a), s.n_dense_lead)
        w.add_uint32(arch_key(KEY_EXPERT_SHARED_COUNT, a), 1)
        w.add_bool(f"{a}.expert_weights_norm", True)
        w.add_uint32(f"{a}.expert_gating_func", 1)  # softmax
    # SmolLM2's tokenizer
    r = gguf.GGUFReader(source_gguf())
    for key, f in r.fields.items():
        if key.startswith("tokenizer."):
            sub = f.types[1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
            w.add_key_value(key, f.contents(), f.types[0], sub)
    for name, shape, t in tensors:
        w.add_tensor_info(name, tuple(reversed(shape)), np.float32, _nbytes(shape, t), raw_dtype=QT[t])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    fout = w.fout[0]
    align = w.data_alignment
    rng = np.random.default_rng(s.seed)
    pools: dict[str, np.ndarray] = {}
    POOL = 16 << 20

    def pool(t):
        if t not in pools:
            blk = ggml_block(t)[1]
            pools[t] = _random_blocks(t, POOL // (blk * 256) * blk * 256, rng)
        return pools[t]

    total = sum(_nbytes(sh, t) for _, sh, t in tensors)
    bar = tqdm(total=total, unit="B", unit_scale=True, desc=f"synth {preset}", disable=not progress)
    pos = fout.tell()
    pad = (-pos) % align
    fout.write(b"\0" * pad)
    pos += pad
    for name, shape, t in tensors:
        n = _nbytes(shape, t)
        if name.endswith("_norm.weight"):
            buf = np.ones(n // 4, dtype=np.float32).view(np.uint8)
            fout.write(buf)
        elif prof is not None and name == "token_embd.weight":
            V = shape[1]
            for r0 in range(0, V, 4096):
                fout.write(memoryview(encode(embedding_rows(prof, s.n_embd, r0, min(V, r0 + 4096)), t)))
        elif prof is not None and name.endswith("ffn_gate_inp.weight"):
            il = int(name.split(".")[1])
            fout.write(memoryview(encode(router_matrix(prof, s.n_embd, s.n_expert, il), t)))
        elif sparse and "_exps." in name:
            fout.seek(n, os.SEEK_CUR)
        else:
            p = pool(t)
            # rotate the start inside the pool so neighbouring experts differ
            off = int(rng.integers(0, len(p) // ggml_block(t)[1])) * ggml_block(t)[1]
            left = n
            while left:
                chunk = p[off: off + min(left, len(p) - off)]
                fout.write(memoryview(chunk))
                left -= len(chunk)
                off = 0
        pad = (-n) % align
        if pad:
            fout.write(b"\0" * pad)
        bar.update(n)
    fout.truncate()
    fout.flush()
    w.close()
    bar.close()
    os.replace(tmp, path)
    dt = time.perf_counter() - t0
    size = path.stat().st_size
    return {"path": path, "bytes": size, "seconds": dt, "mb_per_s": size / 1e6 / dt, "spec": s, "routing": prof}
