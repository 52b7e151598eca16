"""Synthetic MoE GGUFs with real architecture shapes and random weights, written fast.

The files load in llama.cpp and give finite logits, so they exercise the pager at real sizes
(Qwen3.6-35B-A3B in its own ``qwen35moe`` architecture, Laguna-S in ``laguna``, Qwen3-30B-A3B) without any
download. The text they produce is noise. Tensor names, shapes and GGUF keys come from the one table per
architecture in :mod:`epqlab.models.archs` (what llama.cpp's loader asks for); this module only fills them
fast: tensor bytes are tiles of one random buffer per ggml type, each a run of valid blocks (K-quant
blocks have finite f16 ``d``/``dmin`` with ``dmin = 7.5 d``, so weights are centred, random 6-bit scales and
random quants; F16/BF16/F32 are small normals). The tokenizer is SmolLM2's (49152 tokens), copied from the
source GGUF of the default model, padded with unused tokens where a preset's vocabulary is larger (the
output head then has the published number of rows, so its cost per token is the real model's).
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from ..constants import ggml_block, ggml_row_bytes

from .archs import ArchSpec, arch_kv, arch_tensors
from .routing_profile import ROUTINGS, SKEWED, RoutingProfile, embedding_rows, encode, router_matrix
from .smollm2 import source_gguf


@dataclass(frozen=True)
class SynthSpec:
    """Shape and types of a synthetic model. Use a preset from :data:`PRESETS` and override fields.

    Attributes:
        arch: a llama.cpp MoE architecture of :data:`epqlab.models.archs.ARCH_TABLES` (the presets use
            ``qwen35moe``, ``laguna``, ``qwen3moe`` and ``dots1``).
        n_layer, n_embd, n_head, n_head_kv, head_dim: transformer shapes (``n_layer``: the trunk; MTP blocks
            of ``arch_knobs``' ``n_nextn`` come after it).
        n_expert, n_expert_used: routed experts per MoE layer, top-k.
        n_ff_exp: neurons per routed expert; n_ff_dense: neurons of the dense layers' FFN.
        n_dense_lead: leading dense layers.
        expert_type: ggml type of routed-expert gate and up matrices (and down, unless ``down_type``).
        down_type: ggml type of the routed experts' down matrices, or None (= ``expert_type``): a Q4_K_M-like
            mix keeps down in more bits (Q5_K / Q6_K).
        late_expert_type / n_late_layers: a second expert type (all three matrices) for the last
            ``n_late_layers`` layers (two slot classes like Laguna's Q4_K + BF16), or None.
        other_type: ggml type of attention, recurrent, dense-FFN and shared-expert matrices.
        embd_type, output_type: ggml types of ``token_embd`` / ``output`` (None: ``other_type``).
        n_vocab: vocabulary size (rows of ``token_embd`` and ``output``); 0 = the tokenizer's 49152. A larger
            one pads the tokenizer with unused tokens.
        arch_knobs: further :class:`epqlab.models.archs.ArchSpec` fields as ``(name, value)`` pairs
            (``n_nextn``, ``n_ff_shexp``, ``full_attn_interval``, ``ssm_*``, ``n_rot``, ``rope_sections``,
            ``sliding_window``, ``gating``, ``weights_norm``, ``weights_scale``, ``n_shared``, ...).
        kv: GGUF key/values written instead of the table's, ``(key without the arch prefix, value)`` pairs
            (published values the table does not carry, e.g. ``rope.freq_base``).
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
    down_type: str | None = None
    late_expert_type: str | None = None
    n_late_layers: int = 0
    other_type: str = "Q8_0"
    embd_type: str | None = None
    output_type: str | None = None
    n_vocab: int = 0
    arch_knobs: tuple = ()
    kv: tuple = ()
    unaligned: bool = False
    seed: int = 0
    name: str = "synthetic"

    def expert_type_of(self, il: int) -> str | None:
        """ggml type of block ``il``'s routed gate/up matrices, None for a dense block."""
        t = self.arch_spec().expert_types_of(il)
        return None if t is None else t[0]

    def arch_spec(self) -> ArchSpec:
        """The :class:`~epqlab.models.archs.ArchSpec` whose table rows this model is written from."""
        late = (self.late_expert_type,) * 3 if self.late_expert_type else None
        return ArchSpec(self.arch, n_layer=self.n_layer, n_embd=self.n_embd, n_head=self.n_head,
                        n_head_kv=self.n_head_kv, head_dim=self.head_dim, n_vocab=self.n_vocab or SMOLLM2_VOCAB,
                        n_expert=self.n_expert, n_expert_used=self.n_expert_used, n_ff_exp=self.n_ff_exp,
                        n_ff_dense=self.n_ff_dense or self.n_ff_exp, n_dense_lead=self.n_dense_lead,
                        expert_types=(self.expert_type, self.expert_type, self.down_type or self.expert_type),
                        late_expert_types=late, n_late_layers=self.n_late_layers if late else 0,
                        other_type=self.other_type, **dict(self.arch_knobs))


SMOLLM2_VOCAB = 49152  # tokens of the SmolLM2 tokenizer the synthetic models carry

# Qwen3.6-35B-A3B (Qwen/Qwen3.6-35B-A3B config.json, text_config; the same as Qwen3.5-35B-A3B's): hidden 2048,
# 40 layers, layer_types 3 x linear_attention (Gated DeltaNet) then 1 x full_attention (full_attention_interval
# 4), full attention 16 query / 2 KV heads of head_dim 256 with attn_output_gate, partial_rotary_factor 0.25
# (64 rotary dims) in mrope sections [11, 11, 10], rope_theta 1e7; DeltaNet linear_num_key_heads 16,
# linear_num_value_heads 32, key/value head dims 128, linear_conv_kernel_dim 4; num_experts 256,
# num_experts_per_tok 8, moe_intermediate_size 512, shared_expert_intermediate_size 512 (one sigmoid-gated
# shared expert per layer); mtp_num_hidden_layers 1; vocab_size 248,320; rms_norm_eps 1e-6.
_QWEN35_A3B = dict(
    n_nextn=1, n_ff_shexp=512, full_attn_interval=4, n_rot=64, rope_sections=(11, 11, 10, 0), ssm_d_conv=4,
    ssm_d_state=128, ssm_n_group=16, ssm_dt_rank=32, weights_norm=True, context_length=262144)
# Laguna-S-2.1 (poolside/Laguna-S-2.1-GGUF metadata; seed 000's table): 48 blocks, block 0 dense
# (feed_forward_length 12288), 256 experts top-10 of expert_feed_forward_length 1024, one shared expert of 1024,
# sigmoid gating (expert_gating_func 2) with exp_probs_b, normalised, expert_weights_scale 2.5, embedding 3072,
# 8 KV heads of 128, sliding window 512 (every 4th block full attention), vocabulary 100,352, rope freq base
# 500000. Its head_count is per block, [48, 72, 72, 72] x 12: the table has one head count, so every block
# gets the sliding-window blocks' 72 (ours; the full-attention blocks' q/o are 1.5x the published).
_LAGUNA_S = dict(n_ff_shexp=1024, sliding_window=512, gating="sigmoid", weights_norm=True, weights_scale=2.5,
                 context_length=262144)

PRESETS: dict[str, SynthSpec] = {
    # Qwen3-30B-A3B: 48 layers, 128 experts, top-8, n_embd 2048, expert n_ff 768, 32 q / 4 kv heads of 128
    "qwen3-30b-a3b": SynthSpec("qwen3moe", 48, 2048, 32, 4, 128, 128, 8, 768, name="synthetic Qwen3-30B-A3B"),
    # Qwen3.6-35B-A3B at its true shape (arch qwen35moe, _QWEN35_A3B above). Expert types: gate/up Q4_K, down
    # Q5_K, as seed 002 measured block 0 of Qwen3.6-35B-A3B-UD-Q4_K_M (gate 589,824 B, up 589,824 B, down 720,896
    # B: 1,900,544 B an expert, ~1.9 MB; its 8 GB run held 1,936 of them); the same mix in every block is ours
    # (the published file may vary down's type by block). Dense matrices Q8_0, token_embd Q4_0 and output Q6_K
    # are ours (a Q4_K_M-like size: Q4_0 packs 32 weights in 18 bytes as Q4_K packs 256 in 144).
    "qwen35-a3b": SynthSpec("qwen35moe", 40, 2048, 16, 2, 256, 256, 8, 512, down_type="Q5_K", embd_type="Q4_0",
                            output_type="Q6_K", n_vocab=248320, arch_knobs=tuple(_QWEN35_A3B.items()),
                            kv=(("rope.freq_base", 1e7),), name="synthetic Qwen3.6-35B-A3B"),
    # Laguna-S-2.1 at its true shape (arch laguna, _LAGUNA_S above): layers 1-39 Q4_K experts (5.06 MiB), 40-47
    # BF16 experts (18 MiB), 91,653,931,008 routed bytes as seed 000 lists; dense matrices Q8_0, token_embd Q4_0,
    # output Q6_K (ours)
    "laguna-s": SynthSpec("laguna", 48, 3072, 72, 8, 128, 256, 10, 1024, n_ff_dense=12288, n_dense_lead=1,
                          late_expert_type="BF16", n_late_layers=8, embd_type="Q4_0", output_type="Q6_K",
                          n_vocab=100352, arch_knobs=tuple(_LAGUNA_S.items()), kv=(("rope.freq_base", 5e5),),
                          name="synthetic Laguna-S-2.1"),
    # the stand-ins the seed tables were first measured on, kept for comparison: seed 002's expert count and
    # size in Qwen3-MoE's architecture (1.03 GiB dense, SmolLM2's vocabulary, no DeltaNet, no shared expert),
    # and seed 000's expert table in dots.llm1's (softmax routing, no sliding window)
    "qwen3moe-35b-shape": SynthSpec("qwen3moe", 40, 2048, 32, 4, 128, 256, 8, 512,
                                    name="synthetic Qwen3-MoE of the 35B-A3B expert shape"),
    "dots1-laguna-shape": SynthSpec("dots1", 48, 3072, 24, 24, 128, 256, 10, 1024, n_ff_dense=8192, n_dense_lead=1,
                                    late_expert_type="BF16", n_late_layers=8,
                                    arch_knobs=(("n_shared", 1), ("weights_norm", True)),
                                    name="synthetic dots.llm1 of the Laguna-S expert shape"),
    # tests: 4 layers, 8 experts, two slot classes (Q4_K, BF16)
    "tiny": SynthSpec("qwen3moe", 4, 256, 4, 2, 64, 8, 2, 256, late_expert_type="BF16", n_late_layers=1,
                      name="synthetic tiny"),
    # routing statistics tests: 4 layers of 64 experts, top-4 (k/E = 1/16 as in Qwen3-30B-A3B), small experts
    "small": SynthSpec("qwen3moe", 4, 256, 4, 2, 64, 64, 4, 64, expert_type="Q8_0", name="synthetic small"),
}


def _random_blocks(t: str, nbytes: int, rng: np.random.Generator) -> np.ndarray:
    """``nbytes`` (a whole number of blocks) of valid random ``t`` data, as uint8."""
    size = ggml_block(t)[1]
    if t in ("Q4_K", "Q5_K"):  # d, dmin (f16) first, then 6-bit scales/mins and the quants
        nb = nbytes // size
        blk = rng.integers(0, 256, size=(nb, size), dtype=np.uint8)
        d = (rng.uniform(0.5, 1.0, nb) * (2e-4 if t == "Q4_K" else 1e-4)).astype(np.float16)
        blk[:, 0:2] = d.view(np.uint8).reshape(nb, 2)
        blk[:, 2:4] = (d.astype(np.float32) * (7.5 if t == "Q4_K" else 15.5)).astype(np.float16).view(np.uint8).reshape(nb, 2)
        return blk.reshape(-1)
    if t == "Q6_K":  # ql[128], qh[64], int8 scales[16], then d (f16) last; weight = d * scale * (q - 32)
        nb = nbytes // size
        blk = rng.integers(0, 256, size=(nb, size), dtype=np.uint8)
        blk[:, 192:208] = rng.integers(1, 64, size=(nb, 16), dtype=np.int8).view(np.uint8)
        blk[:, 208:210] = (rng.uniform(0.5, 1.0, nb) * 2e-5).astype(np.float16).view(np.uint8).reshape(nb, 2)
        return blk.reshape(-1)
    if t in ("Q4_0", "Q4_1"):  # d (f16) first (Q4_1: then m), then 4-bit quants
        nb = nbytes // size
        blk = rng.integers(0, 256, size=(nb, size), dtype=np.uint8)
        blk[:, 0:2] = (rng.uniform(0.5, 1.0, nb) * 4e-3).astype(np.float16).view(np.uint8).reshape(nb, 2)
        if t == "Q4_1":
            blk[:, 2:4] = (rng.uniform(0.5, 1.0, nb) * -3e-2).astype(np.float16).view(np.uint8).reshape(nb, 2)
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


def _tensors(s: SynthSpec) -> list[tuple[str, tuple[int, ...], str, str]]:
    """(name, ggml shape (ne0, ne1, ...), type, init) of every tensor, in file order: the architecture's table
    (:func:`epqlab.models.archs.arch_tensors`) with ``embd_type`` / ``output_type`` applied."""
    out = []
    for name, shape, t, init in arch_tensors(s.arch_spec()):
        if name == "token_embd.weight" and s.embd_type:
            t = s.embd_type
        elif name == "output.weight" and s.output_type:
            t = s.output_type
        out.append((name, shape, t, init))
    return out


def _block(name: str) -> int:
    """Block index of a ``blk.N.`` tensor name, -1 for the others."""
    return int(name.split(".")[1]) if name.startswith("blk.") else -1


def _nbytes(shape, t) -> int:
    n = ggml_row_bytes(t, shape[0])
    for d in shape[1:]:
        n *= d
    return n


def _make_unaligned(s: SynthSpec) -> SynthSpec:
    s = replace(s, expert_type="Q8_0", down_type=None, late_expert_type=None, n_late_layers=0)
    for f in sorted(range(32, 4 * s.n_ff_exp + 1, 32), key=lambda f: abs(f - s.n_ff_exp)):
        sizes = [ggml_row_bytes("Q8_0", s.n_embd) * f, ggml_row_bytes("Q8_0", f) * s.n_embd]
        if all(b % 4096 for b in sizes):
            return replace(s, n_ff_exp=f)
    raise ValueError(f"n_embd {s.n_embd}: every Q8_0 expert slice is a multiple of 4096 bytes; use a smaller n_embd")


PRESET_ROUTING = {"qwen35-a3b": "skewed", "laguna-s": "skewed", "qwen3moe-35b-shape": "skewed",
                  "dots1-laguna-shape": "skewed"}
"""Presets written with skewed routing unless ``routing=`` says otherwise (the others: uniform). The seed
shapes target their studies' figures: ``qwen35-a3b`` 40 x 256 experts of 1,900,544 B (18.1 GiB routed, 0.45 GiB
of MTP experts, 2.2 GiB dense, a 20.8 GiB file; seed 002 measured a 70% decode hit rate at 18.9% coverage,
Belady 78.9%), ``laguna-s`` 48 layers (1 dense, 39 of 256 Q4_K experts of 5.06 MiB, 8 of 256 BF16 experts of
18 MiB): 91,653,931,008 routed bytes (85.4 GiB), as seed 000 lists for Laguna-S-2.1 Q4_K_M (96.0 GB file);
``--n-layer`` cuts it to fit a disk (the last 8 MoE layers stay BF16). Their stand-ins likewise."""


def planned_sizes(preset: str, **overrides) -> dict:
    """Sizes a preset (with ``overrides``, as :func:`synthesize` takes them) would write, without writing:
    ``expert_bytes`` (list, bytes of one expert's gate+up+down slices per MoE layer of the trunk),
    ``routed_expert_bytes`` (all routed experts of the trunk), ``mtp_expert_bytes`` (the MTP blocks' routed
    experts, which an ordinary context never routes), ``dense_bytes`` (every other tensor), ``tensor_bytes``
    (every tensor's data, the file less its header and padding), ``n_moe_layers``.

    Raises:
        ValueError: unknown preset.
    """
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    s = replace(PRESETS[preset], **overrides)
    per_layer: dict[int, int] = {}
    total = 0
    for name, shape, t, _ in _tensors(s):
        n = _nbytes(shape, t)
        total += n
        if "_exps.weight" in name:
            il = _block(name)
            per_layer[il] = per_layer.get(il, 0) + n // shape[-1]
    eb = [per_layer[i] for i in sorted(per_layer) if i < s.n_layer]
    mtp = [per_layer[i] for i in sorted(per_layer) if i >= s.n_layer]
    return {"expert_bytes": eb, "routed_expert_bytes": sum(eb) * s.n_expert, "tensor_bytes": total,
            "n_moe_layers": len(eb), "mtp_expert_bytes": sum(mtp) * s.n_expert,
            "dense_bytes": total - (sum(eb) + sum(mtp)) * s.n_expert}


def _add_arch_kv(w, s: SynthSpec) -> None:
    """The architecture table's GGUF keys for ``s`` (:func:`epqlab.models.archs.arch_kv`), with ``s.kv``'s
    values in place of the table's."""
    from gguf import GGUFValueType as VT

    over = {f"{s.arch}.{k}": v for k, v in s.kv}
    for key, kind, v in arch_kv(s.arch_spec()):
        v = over.pop(key, v)
        if kind == "u32":
            w.add_uint32(key, int(v))
        elif kind == "f32":
            w.add_float32(key, float(v))
        elif kind == "bool":
            w.add_bool(key, bool(v))
        elif kind == "i32s":
            w.add_array(key, [int(x) for x in v])
        else:
            w.add_key_value(key, [int(x) for x in v], VT.ARRAY, VT.UINT32)
    for key, v in over.items():  # keys the table does not write
        w.add_float32(key, v) if isinstance(v, float) else w.add_uint32(key, int(v))


def _add_tokenizer(w, n_vocab: int) -> None:
    """SmolLM2's tokenizer keys, its token list padded to ``n_vocab`` with unused tokens (token type 5,
    ``LLAMA_TOKEN_TYPE_UNUSED``: never produced by tokenizing, decoded as their own text)."""
    import gguf

    r = gguf.GGUFReader(source_gguf())
    n_tok = len(r.fields["tokenizer.ggml.tokens"].data)
    if n_vocab < n_tok:
        raise ValueError(f"n_vocab {n_vocab} is smaller than the tokenizer's {n_tok} tokens: use 0 (the tokenizer's "
                         f"own) or at least {n_tok}")
    pad = n_vocab - n_tok
    for key, f in r.fields.items():
        if not key.startswith("tokenizer."):
            continue
        v = f.contents()
        sub = f.types[1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        if pad and key == "tokenizer.ggml.tokens":
            v = list(v) + [f"<|epqlab_unused_{i}|>" for i in range(pad)]
        elif pad and key == "tokenizer.ggml.token_type":
            v = list(v) + [5] * pad
        elif pad and key == "tokenizer.ggml.scores":
            v = list(v) + [0.0] * pad
        w.add_key_value(key, v, f.types[0], sub)


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
    w.add_name(s.name)
    _add_arch_kv(w, s)
    _add_tokenizer(w, s.arch_spec().n_vocab)
    for name, shape, t, _ in tensors:
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

    total = sum(_nbytes(sh, t) for _, sh, t, _ in tensors)
    bar = tqdm(total=total, unit="B", unit_scale=True, desc=f"synth {preset}", disable=not progress)
    pos = fout.tell()
    pad = (-pos) % align
    fout.write(b"\0" * pad)
    pos += pad
    for name, shape, t, init in tensors:
        n = _nbytes(shape, t)
        if init == "one" or name.endswith("_norm.weight"):
            fout.write(memoryview(encode(np.ones(int(np.prod(shape)), np.float32), t)))
        elif init == "neg":  # decay rates (ssm_a): negative, as the architecture's recurrence expects
            x = -(0.1 + np.abs(rng.standard_normal(int(np.prod(shape)), dtype=np.float32)) / 2)
            fout.write(memoryview(encode(x, t)))
        elif prof is not None and name == "token_embd.weight":
            V = shape[1]
            for r0 in range(0, V, 4096):
                fout.write(memoryview(encode(embedding_rows(prof, s.n_embd, r0, min(V, r0 + 4096)), t)))
        elif prof is not None and name.endswith("ffn_gate_inp.weight"):
            fout.write(memoryview(encode(router_matrix(prof, s.n_embd, s.n_expert, _block(name)), t)))
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
