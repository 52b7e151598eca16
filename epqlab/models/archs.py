"""MoE GGUF writers for every llama.cpp MoE architecture, from one table of tensor specs per architecture.

:data:`ARCH_TABLES` (in :mod:`epqlab.models.arch_tables`) holds, per architecture, the GGUF keys and the tensors that llama.cpp's loader asks
for (``src/models/<arch>.cpp`` of the llama.cpp vendored by llama-cpp-python 0.3.36:
``load_arch_hparams`` / ``load_arch_tensors``; tensor and key names from ``src/llama-arch.cpp``). The
table is data: each tensor row gives its name, its ggml shape as expressions of the :class:`ArchSpec`
fields, its type, its initialisation and the blocks it belongs to (an expression of the block's flags).
:func:`arch_tensors` and :func:`arch_kv` evaluate the table for a spec of any size (the tiny test models
here, or the real-size synthetic presets); :func:`write_tiny` writes a model of a few hundred KiB to a
few MiB whose keys and tensors are exactly what llama.cpp loads, so the file runs the real graph of the
architecture.

Stable public API (the synthetic presets of :mod:`epqlab.models.synth` build on it): :class:`ArchSpec`
(construct it directly at any size, e.g. ``ArchSpec("qwen35moe", n_layer=40, n_vocab=248320, ...)``),
:func:`arch_tensors` ``(spec) -> [(name, ggml shape, ggml type name, init)]``, :func:`arch_kv`
``(spec) -> [(key, kind, value)]``, :func:`add_kv` ``(gguf.GGUFWriter, spec)``, :func:`validate`,
:func:`tiny_spec`, :func:`write_tiny`, :data:`ARCHS`, :data:`DEFAULTS`. Both evaluators leave the tokenizer
keys to the caller.

Weights are seeded normal draws scaled by ``1/sqrt(fan_in)`` and quantized with gguf-py
(``gguf.quants.quantize``), so logits are finite and the routing varies from token to token; the
text is noise. The tiny tokenizer is a 355-token SentencePiece vocabulary (``<unk>``, ``<s>``,
``</s>``, 256 byte tokens, ``▁`` and printable ASCII), so any text tokenizes (through byte
fallback) without a download.

Expressions may use every :class:`ArchSpec` field by name and these short names: ``D`` n_embd,
``V`` vocabulary size, ``E`` n_expert, ``F`` n_ff_exp, ``Fd`` n_ff_dense, ``Fs`` n_ff_shexp, ``H``
n_head, ``Hkv`` n_head_kv, ``Dh`` head_dim, ``R`` rope dimensions (n_rot or head_dim), ``Di`` the Mamba-2
inner width (ssm_d_inner or ssm_d_state x ssm_dt_rank); block conditions
also ``il`` (block index), ``moe`` (block has routed experts), ``dense``, ``mtp`` (a trailing
``nextn_predict_layers`` block) and the architecture's own flags (e.g. ``recr``: a recurrent block).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, fields, replace
from pathlib import Path

import numpy as np

from .arch_tables import ARCH_TABLES, ARCHS, COMMON_KV, DEFAULTS, ArchTable

_GATING = {"softmax": 1, "sigmoid": 2, "softmax_weight": 3}  # llama_expert_gating_func_type


@dataclass(frozen=True)
class ArchSpec:
    """Shape, types and routing knobs of a model of one architecture. :data:`DEFAULTS` holds each
    architecture's tiny test values; any field may be set to real sizes (nothing in the tables assumes
    tiny dims or the tiny vocabulary).

    Attributes:
        arch: a key of :data:`ARCH_TABLES`.
        n_layer, n_embd, n_head, n_head_kv, head_dim: transformer shapes (``head_dim`` unused by
            ``deepseek2``, whose heads are set by the MLA fields).
        n_vocab: vocabulary size (rows of ``token_embd`` / ``output``); 0 = the tiny tokenizer's 355.
        n_rot: rotary dimensions per head (``rope.dimension_count``); 0 = ``head_dim``.
        rope_sections: ``rope.dimension_sections`` (qwen35moe's multi-section RoPE; 2x their sum = n_rot).
        n_expert, n_expert_used: routed experts per MoE block, top-k.
        n_ff_exp: neurons per routed expert; n_ff_dense: neurons of the dense blocks' FFN.
        n_dense_lead: leading dense blocks (architectures whose table reads ``leading_dense_block_count``).
        n_shared: shared experts (``deepseek``, ``deepseek2``, ``dots1``: each ``n_ff_exp`` wide).
        n_ff_shexp: width of the single shared expert of ``qwen2moe``, ``qwen35moe``, ``laguna``.
        expert_types: ggml types of the (gate, up, down) expert matrices; with ``fused`` the gate
            type is the fused ``gate_up`` matrix's and the up type is ignored.
        late_expert_types / n_late_layers: other expert types for the last ``n_late_layers``
            blocks (a second slot class; trailing MTP blocks count among them), or None.
        fused: ``ffn_gate_up_exps`` instead of separate gate and up (architectures loading it through
            ``create_tensor_gate_up_exps`` or a fused row of their own).
        other_type: ggml type of attention, dense-FFN and shared-expert matrices.
        gating: router function ``softmax`` | ``sigmoid`` | ``softmax_weight`` (written where the
            architecture reads ``expert_gating_func``; the others fix it in their graph).
        probs_bias: write ``exp_probs_b.bias`` (selection bias) where the architecture makes it optional.
        weights_norm, weights_scale: normalise the top-k weights / scale them
            (``expert_weights_norm`` / ``expert_weights_scale``; 0 = not written).
        n_group, n_group_used: group-limited routing (``expert_group_count`` /
            ``expert_group_used_count``; 0 = off).
        q_lora_rank, kv_lora_rank, qk_rope, qk_nope, v_head_dim: ``deepseek2`` MLA shapes
            (``q_lora_rank`` 0 = a plain ``attn_q``).
        attn_bias: q/k/v biases (``qwen2moe``, ``gpt-oss``).
        sliding_window: sliding-window size (tokens) of the SWA blocks (``gpt-oss``, ``laguna``).
        n_nextn: trailing multi-token-prediction blocks (``nextn_predict_layers``): written after
            the ``n_layer`` trunk blocks, with routed experts; llama.cpp skips them unless asked for MTP.
        moe_layer_step: every this-many-th block has routed experts, the others a dense FFN
            (``interleave_moe_layer_step``: ``llama4``, ``ernie4_5-moe``).
        full_attn_interval: every this-many-th block is full attention, the others recurrent
            (``full_attention_interval``: ``qwen35moe``).
        ssm_d_conv, ssm_d_state, ssm_n_group, ssm_dt_rank: Gated-DeltaNet shapes (``ssm.conv_kernel``,
            ``ssm.state_size`` = key/value head dim, ``ssm.group_count`` = key heads,
            ``ssm.time_step_rank`` = value heads; ``ssm.inner_size`` = state_size x time_step_rank); for
            Mamba-2 blocks (nemotron_h_moe, granitehybrid) ssm_dt_rank is the head count and ssm_d_inner the
            inner width (0 = ssm_d_state x ssm_dt_rank).
        indexer_n_head, indexer_head_size, indexer_top_k: the sparse-attention indexer of ``deepseek32``
            (``attention.indexer.head_count`` / ``key_length`` / ``top_k``: keys kept per query).
        tied_output: no ``output.weight``; llama.cpp reuses ``token_embd``.
        expert_scales: write per-expert F32 scales ``blk.N.ffn_{gate,up,down}_exps.scale`` ([n_expert]; llama.cpp's
            load_tensors reads them for every architecture, build_moe_ffn multiplies each expert's output).
        gate_exps: False leaves out ``ffn_gate_exps`` (``llama`` only: its experts are then
            ``down(silu(up x))``).
        context_length: ``context_length`` (training context, tokens).
        alignment: ``general.alignment`` of tensor data, bytes (a multiple of 32).
    """

    arch: str
    n_layer: int = 3
    n_embd: int = 64
    n_head: int = 4
    n_head_kv: int = 2
    head_dim: int = 16
    n_vocab: int = 0
    n_rot: int = 0
    rope_sections: tuple[int, ...] = (0, 0, 0, 0)
    n_expert: int = 8
    n_expert_used: int = 2
    n_ff_exp: int = 96
    n_ff_dense: int = 128
    n_dense_lead: int = 0
    n_shared: int = 0
    n_ff_shexp: int = 64
    expert_types: tuple[str, str, str] = ("Q8_0", "Q8_0", "Q8_0")
    late_expert_types: tuple[str, str, str] | None = None
    n_late_layers: int = 0
    fused: bool = False
    other_type: str = "F16"
    gating: str = "softmax"
    probs_bias: bool = False
    weights_norm: bool = False
    weights_scale: float = 0.0
    n_group: int = 0
    n_group_used: int = 0
    q_lora_rank: int = 32
    kv_lora_rank: int = 32
    qk_rope: int = 16
    qk_nope: int = 16
    v_head_dim: int = 16
    attn_bias: bool = False
    sliding_window: int = 0
    n_nextn: int = 0
    full_attn_interval: int = 4
    moe_layer_step: int = 1
    ssm_d_conv: int = 4
    ssm_d_state: int = 16
    ssm_n_group: int = 2
    ssm_dt_rank: int = 4
    ssm_d_inner: int = 0
    tied_output: bool = False
    gate_exps: bool = True
    expert_scales: bool = False
    indexer_n_head: int = 4
    indexer_head_size: int = 64
    indexer_top_k: int = 16
    context_length: int = 4096
    alignment: int = 32

    def expert_types_of(self, il: int) -> tuple[str, str, str] | None:
        """(gate, up, down) ggml types of block ``il``'s routed experts; None for a dense block."""
        if not _block_flags(self, il)["moe"]:
            return None
        if self.late_expert_types and il >= self.n_layer - self.n_late_layers:
            return self.late_expert_types
        return self.expert_types


TinySpec = ArchSpec  # the name tests and older callers use


def tiny_spec(arch: str, **knobs) -> ArchSpec:
    """The :class:`ArchSpec` :func:`write_tiny` uses: ``arch``'s :data:`DEFAULTS` with ``knobs`` applied.

    Raises:
        ValueError: unknown architecture, unknown knob, or a combination llama.cpp cannot load
            (the message names it).
    """
    if arch not in ARCH_TABLES:
        raise ValueError(f"unknown architecture {arch!r}; choose one of {', '.join(ARCHS)}")
    names = {f.name for f in fields(ArchSpec)} - {"arch"}
    bad = sorted(set(knobs) - names)
    if bad:
        raise ValueError(f"unknown knob(s) {', '.join(bad)} for write_tiny; known: {', '.join(sorted(names))}")
    s = replace(ArchSpec(arch, **DEFAULTS[arch]), **knobs)
    validate(s)
    return s


def _with(cap: str) -> str:
    return ", ".join(a for a, t in ARCH_TABLES.items() if cap in t.caps) or "none"


def validate(s: ArchSpec) -> None:
    """Check ``s`` against what its architecture's llama.cpp loader accepts.

    Raises:
        ValueError: naming the field and the fix (unknown architecture, top-k outside 1..n_expert,
            a knob the architecture does not read, bad groups or head counts, bad alignment).
    """
    if s.arch not in ARCH_TABLES:
        raise ValueError(f"unknown architecture {s.arch!r}; choose one of {', '.join(ARCHS)}")
    t = ARCH_TABLES[s.arch]
    if not 1 <= s.n_expert_used <= s.n_expert:
        raise ValueError(f"n_expert_used={s.n_expert_used} must be in 1..n_expert={s.n_expert}")
    if s.n_dense_lead and "dense_lead" not in t.caps:
        raise ValueError(f"{s.arch} has no leading dense blocks in llama.cpp; n_dense_lead must be 0")
    if not 0 <= s.n_dense_lead < s.n_layer:
        raise ValueError(f"n_dense_lead={s.n_dense_lead} must leave at least one MoE block of n_layer={s.n_layer}")
    if s.fused and "fused" not in t.caps:
        raise ValueError(f"llama.cpp reads ffn_gate_up_exps for {_with('fused')}, not {s.arch}")
    if s.tied_output and "tied" not in t.caps:
        raise ValueError(f"llama.cpp requires output.weight for {s.arch}; tied_output must be False")
    if not s.gate_exps and ("nogate" not in t.caps or s.fused):
        raise ValueError(f"only {_with('nogate')} load routed experts without ffn_gate_exps; gate_exps must be True")
    if s.n_nextn and "nextn" not in t.caps:
        raise ValueError(f"n_nextn (MTP blocks) is written for {_with('nextn')} only, not {s.arch}")
    if s.n_shared and "shared" not in t.caps:
        raise ValueError(f"{s.arch} does not read expert_shared_count; n_shared must be 0")
    if s.n_group and "groups" not in t.caps:
        raise ValueError(f"{s.arch} has no group-limited routing in llama.cpp; n_group must be 0")
    if s.arch == "nemotron_h_moe" and s.gate_exps:
        raise ValueError("nemotron_h_moe experts are down(relu(up x)^2) with no ffn_gate_exps: gate_exps must be False")
    if s.alignment < 32 or s.alignment % 32:
        raise ValueError(f"alignment must be a positive multiple of 32 bytes, got {s.alignment}")
    if s.gating not in _GATING:
        raise ValueError(f"gating must be one of {', '.join(_GATING)}, got {s.gating!r}")
    if s.n_group:
        if s.n_expert % s.n_group or s.n_expert // s.n_group < 2 or not 0 < s.n_group_used < s.n_group:
            raise ValueError("group routing needs n_expert divisible by n_group, >= 2 experts per group and "
                             f"0 < n_group_used < n_group; got {s.n_expert}, {s.n_group}, {s.n_group_used}")
        if s.n_expert_used > s.n_group_used * (s.n_expert // s.n_group):
            raise ValueError("n_expert_used exceeds the experts of the n_group_used groups kept")
    if s.arch != "deepseek2" and s.n_head % s.n_head_kv:
        raise ValueError(f"n_head={s.n_head} must be a multiple of n_head_kv={s.n_head_kv}")
    if s.arch == "dots1" and s.n_head_kv != s.n_head:
        raise ValueError("dots1 keys and values have n_head heads: set n_head_kv = n_head")
    if s.arch == "olmoe" and s.n_head_kv != s.n_head:
        raise ValueError("olmoe's k norm is n_embd wide: set n_head_kv = n_head")
    if s.arch in ("granitehybrid", "jamba") and (s.ssm_d_inner or s.ssm_d_state * s.ssm_dt_rank) != 2 * s.n_embd:
        raise ValueError(f"{s.arch}'s Mamba inner width must be 2 x n_embd (its load_arch_tensors asserts it): "
                         f"set ssm_d_inner = {2 * s.n_embd}")
    if s.arch == "grovemoe" and s.n_expert % 2:
        raise ValueError("grovemoe here groups experts in pairs: n_expert must be even")
    if s.moe_layer_step < 1:
        raise ValueError(f"moe_layer_step must be >= 1, got {s.moe_layer_step}")
    q_is_n_embd = ("llada-moe", "llama", "deepseek", "qwen2moe", "olmoe", "bailingmoe2", "lfm2moe", "dbrx", "grok", "arctic", "phimoe")
    if s.arch in q_is_n_embd and s.n_head * s.head_dim != s.n_embd:
        raise ValueError(f"{s.arch} needs n_head * head_dim == n_embd (its q and output are n_embd wide)")
    if s.arch == "gemma4" and s.n_layer < 4:
        raise ValueError("gemma4 here has a full-attention block every 4th: n_layer must be >= 4")
    if s.arch in ("gpt-oss", "gemma4", "exaone-moe", "mimo2", "cohere2moe", "maple", "step35", "granite_swa") and s.sliding_window < 1:
        raise ValueError(f"{s.arch} needs sliding_window >= 1")
    if s.arch in ("qwen35moe", "qwen3vlmoe") and (2 * sum(s.rope_sections) != (s.n_rot or s.head_dim)
                                                  or len(s.rope_sections) != 4):
        raise ValueError(f"{s.arch} needs 4 rope_sections summing to n_rot/2 = {(s.n_rot or s.head_dim) // 2}, "
                         f"got {s.rope_sections}")
    if s.arch in ("qwen35moe", "qwen3next"):
        if s.ssm_dt_rank % s.ssm_n_group:
            raise ValueError(f"ssm_dt_rank={s.ssm_dt_rank} (value heads) must be a multiple of ssm_n_group="
                             f"{s.ssm_n_group} (key heads)")
        if s.full_attn_interval < 1:
            raise ValueError("full_attn_interval must be >= 1")
    if s.late_expert_types is not None and not 0 < s.n_late_layers <= s.n_layer + s.n_nextn:
        raise ValueError(f"late_expert_types needs 0 < n_late_layers <= {s.n_layer + s.n_nextn}")


# ---- evaluating the table --------------------------------------------------------------------------

_SAFE = {"__builtins__": {}, "min": min, "max": max, "range": range}


def _eval(expr: str, ns: dict):
    """Value of a table expression (our own constant text) over the spec's names ``ns``."""
    return eval(expr, {**_SAFE, **ns})  # noqa: S307


def _names(s: ArchSpec) -> dict:
    """Spec fields and the short names of the module docstring."""
    ns = {f.name: getattr(s, f.name) for f in fields(ArchSpec)}
    ns.update(D=s.n_embd, V=vocab_size(s), E=s.n_expert, F=s.n_ff_exp, Fd=s.n_ff_dense, Fs=s.n_ff_shexp,
              H=s.n_head, Hkv=s.n_head_kv, Dh=s.head_dim, R=s.n_rot or s.head_dim, GATING=_GATING[s.gating],
              Di=s.ssm_d_inner or s.ssm_d_state * s.ssm_dt_rank)
    return ns


def _block_flags(s: ArchSpec, il: int) -> dict:
    ns = _names(s)
    ns.update(il=il, mtp=il >= s.n_layer)
    table = ARCH_TABLES[s.arch]
    ns["moe"] = bool(_eval(table.flags.get("moe", "il >= n_dense_lead"), ns))
    ns["dense"] = not ns["moe"]
    for k, expr in table.flags.items():
        if k != "moe":
            ns[k] = bool(_eval(expr, ns))
    return ns


def vocab_size(s: ArchSpec) -> int:
    """Rows of the embedding and output matrices: ``s.n_vocab``, or the tiny tokenizer's size when 0."""
    return s.n_vocab or len(_vocab()[0])


def arch_tensors(spec: ArchSpec) -> list[tuple[str, tuple[int, ...], str, str]]:
    """Every tensor llama.cpp loads for ``spec.arch``, in file order, from :data:`ARCH_TABLES`.

    Args:
        spec: an :class:`ArchSpec` (of any size; :func:`validate` is called).

    Returns:
        ``(name, ggml shape (ne0, ne1, ...), ggml type name, init)`` per tensor; init as in
        :class:`ArchTable` (``one`` | ``bias`` | ``w`` | ``emb`` | ``router`` | ``neg`` | ``scale``).

    Raises:
        ValueError: as :func:`validate`.
    """
    validate(spec)
    table = ARCH_TABLES[spec.arch]
    ns = _names(spec)
    out = [("token_embd.weight", (spec.n_embd, ns["V"]), spec.other_type, "emb"),
           (table.output_norm, (spec.n_embd,), "F32", "one")]
    if not spec.tied_output:
        out.append(("output.weight", (spec.n_embd, ns["V"]), spec.other_type, "w"))
    for name, shape, typ, init, when in table.top:
        if _eval(when, ns):
            out.append((name, tuple(int(d) for d in _eval(f"({shape},)", ns)), spec.other_type if typ == "ot" else typ,
                        init))
    for il in range(spec.n_layer + spec.n_nextn):
        flags = _block_flags(spec, il)
        et = spec.expert_types_of(il)
        for name, shape, typ, init, when in table.block:
            if not _eval(when, flags):
                continue
            dims = _eval(f"({shape},)", flags)
            if typ == "ot":
                typ = spec.other_type
            elif typ.startswith("exp."):
                typ = et[("exp.gate", "exp.up", "exp.down").index(typ)]
            out.append((f"blk.{il}.{name}", tuple(int(d) for d in dims), typ, init))
    return out


def arch_kv(spec: ArchSpec) -> list[tuple[str, str, object]]:
    """The architecture's GGUF key/values for ``spec`` (no tokenizer keys), from :data:`COMMON_KV` and
    the architecture's :class:`ArchTable` ``kv`` rows.

    Returns:
        ``(key with the "<arch>." prefix, kind, value)``; kind ``u32`` | ``f32`` | ``bool`` | ``i32s`` |
        ``u32s`` | ``bools`` (values of the arrays are lists).

    Raises:
        ValueError: as :func:`validate`.
    """
    validate(spec)
    ns = _names(spec)
    rows: dict[str, tuple] = {}
    for row in COMMON_KV + ARCH_TABLES[spec.arch].kv:
        key, kind, expr, *cond = row
        if cond and not _eval(cond[0], ns):
            rows.pop(key, None)
            continue
        rows[key] = (kind, expr)
    out = []
    for key, (kind, expr) in rows.items():
        if expr is None:
            continue
        v = _eval(expr, ns)
        v = {"u32": int, "f32": float, "bool": bool, "bools": lambda x: [bool(e) for e in x]}.get(
            kind, lambda x: [int(e) for e in x])(v)
        out.append((f"{spec.arch}.{key}", kind, v))
    return out


# ---- tokenizer -----------------------------------------------------------------------------------

def _vocab() -> tuple[list[str], list[float], list[int]]:
    """SentencePiece vocabulary: tokens, scores, token types (1 normal, 2 unknown, 3 control, 6 byte)."""
    toks = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + ["\u2581"] + [chr(c) for c in range(32, 127)]
    types = [2, 3, 3] + [6] * 256 + [1] * (1 + 95)
    scores = [0.0] * 259 + [-float(i) for i in range(1 + 95)]
    return toks, scores, types


# ---- writing -------------------------------------------------------------------------------------

def _values(shape: tuple[int, ...], init: str, rng: np.random.Generator) -> np.ndarray:
    """float32 values, numpy shape = reversed ggml shape."""
    np_shape = tuple(reversed(shape))
    if init == "one":
        return np.ones(np_shape, np.float32)
    x = rng.standard_normal(np_shape, dtype=np.float32)
    if init == "emb":
        return x
    if init == "bias":
        return x * np.float32(0.1)
    if init == "neg":
        return -(np.float32(0.1) + np.abs(x) * np.float32(0.5))
    if init == "scale":
        return np.float32(0.5) + rng.random(np_shape, dtype=np.float32)
    if init == "router":
        return x * np.float32(2.0 / np.sqrt(shape[0]))
    return x * np.float32(1.0 / np.sqrt(shape[0]))


def _encode(x: np.ndarray, ggml_type: str) -> np.ndarray:
    """``x`` in ``ggml_type``'s bytes (uint8, same leading dims) via gguf-py's quantizers."""
    from gguf import GGMLQuantizationType as QT
    from gguf.quants import quantize

    return np.ascontiguousarray(quantize(x, QT[ggml_type])).view(np.uint8)


def add_kv(writer, spec: ArchSpec) -> None:
    """Add :func:`arch_kv`'s keys to a ``gguf.GGUFWriter`` (no tokenizer keys)."""
    from gguf import GGUFValueType as VT

    for key, kind, v in arch_kv(spec):
        if kind == "u32":
            writer.add_uint32(key, v)
        elif kind == "f32":
            writer.add_float32(key, v)
        elif kind == "bool":
            writer.add_bool(key, v)
        else:
            writer.add_array(key, v) if kind in ("i32s", "bools") else writer.add_key_value(key, v, VT.ARRAY, VT.UINT32)


def write_tiny(path: str | os.PathLike, arch: str, *, seed: int = 0, omit: tuple[str, ...] = (), **knobs) -> Path:
    """Write a tiny random-weight MoE GGUF of architecture ``arch`` to ``path``.

    Args:
        path: output file (written to a temporary name in the same folder, then renamed).
        arch: a key of :data:`ARCH_TABLES` (:data:`ARCHS`).
        seed: seed of every weight (same seed and knobs -> same bytes).
        omit: tensor names left out (to write a damaged file that a loader check must refuse).
        **knobs: any :class:`ArchSpec` field, e.g. ``fused=True`` (deepseek2, qwen35moe),
            ``expert_types=("Q8_0", "Q8_0", "F16")``, ``n_layer=2``.

    Returns:
        the path written.

    Raises:
        ValueError: unknown architecture or knob, or sizes a type cannot hold (rows of a quantized
            type need a multiple of its block: 32 elements for Q8_0 / Q4_0 / MXFP4), or ``n_vocab``
            other than the tiny tokenizer's.
    """
    import gguf
    from gguf import GGML_QUANT_SIZES
    from gguf import GGMLQuantizationType as QT

    s = tiny_spec(arch, **knobs)
    toks, scores, types = _vocab()
    if s.n_vocab not in (0, len(toks)):
        raise ValueError(f"write_tiny writes its {len(toks)}-token tokenizer; n_vocab must be 0 or {len(toks)}")
    tensors = arch_tensors(s)
    unknown = sorted(set(omit) - {t[0] for t in tensors})
    if unknown:
        raise ValueError(f"omit names tensors {s.arch} does not have: {', '.join(unknown)}")
    tensors = [t for t in tensors if t[0] not in omit]
    for name, shape, t, _ in tensors:
        block = GGML_QUANT_SIZES[QT[t]][0]
        if shape[0] % block:
            raise ValueError(f"{name}: {t} rows need a multiple of {block} elements, got {shape[0]}; change the sizes")
    path = Path(path)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    w = gguf.GGUFWriter(tmp, s.arch)
    if s.alignment != 32:
        w.add_custom_alignment(s.alignment)
    w.add_name(f"tiny {s.arch}")
    add_kv(w, s)
    w.add_tokenizer_model("llama")
    w.add_token_list(toks)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(True)

    rng = np.random.default_rng(seed)
    try:
        for name, shape, t, init in tensors:
            w.add_tensor(name, _encode(_values(shape, init, rng), t), raw_dtype=QT[t])
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


__all__ = ["ARCHS", "ARCH_TABLES", "ArchSpec", "ArchTable", "COMMON_KV", "DEFAULTS", "TinySpec", "add_kv",
           "arch_kv", "arch_tensors", "tiny_spec", "validate", "vocab_size", "write_tiny"]
