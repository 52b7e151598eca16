"""Tiny random-weight MoE GGUFs, one per llama.cpp MoE architecture, for bit-identity tests.

:func:`write_tiny` writes a model of a few hundred KiB to a few MiB (2-4 blocks, 8-16 experts,
top-2/3) whose keys and tensors are exactly what llama.cpp's loader asks for in that architecture
(``src/models/<arch>.cpp`` of the llama.cpp vendored by llama-cpp-python 0.3.36:
``load_arch_hparams`` / ``load_arch_tensors``), so the file loads and runs the real graph of the
architecture: Mixtral-style ``llama``, ``deepseek`` (leading dense block, shared experts),
``deepseek2`` (MLA attention, sigmoid routing with ``exp_probs_b``, group-limited top-k, weight
norm and scale, optionally fused ``ffn_gate_up_exps``), ``qwen2moe`` (sigmoid-gated shared expert,
q/k/v biases), ``qwen3moe`` (q/k norms), ``gpt-oss`` (expert and router biases, attention sinks,
sliding-window layers, MXFP4 experts) and ``dots1`` (leading dense block, shared expert, sigmoid
routing with ``exp_probs_b``).

Weights are seeded normal draws scaled by ``1/sqrt(fan_in)`` and quantized with gguf-py
(``gguf.quants.quantize``), so logits are finite and the routing varies from token to token; the
text is noise. The tokenizer is a 355-token SentencePiece vocabulary (``<unk>``, ``<s>``,
``</s>``, 256 byte tokens, ``▁`` and printable ASCII), so any text tokenizes (through byte
fallback) without a download.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, fields, replace
from pathlib import Path

import numpy as np
from .synth import per_block

ARCHS = ("llama", "deepseek", "deepseek2", "qwen2moe", "qwen3moe", "gpt-oss", "dots1")
_GATING = {"softmax": 1, "sigmoid": 2, "softmax_weight": 3}  # llama_expert_gating_func_type


@dataclass(frozen=True)
class TinySpec:
    """Shape, types and routing knobs of a tiny model. :data:`DEFAULTS` holds each architecture's.

    Attributes:
        arch: one of :data:`ARCHS`.
        n_layer, n_embd, n_head, n_head_kv, head_dim: transformer shapes (``head_dim`` unused by
            ``deepseek2``, whose heads are set by the MLA fields).
        n_expert, n_expert_used: routed experts per MoE block, top-k.
        n_ff_exp: neurons per routed expert; n_ff_dense: neurons of the leading dense blocks' FFN.
        n_dense_lead: leading dense blocks (``deepseek``, ``deepseek2``, ``dots1``).
        n_shared: shared experts (``deepseek``, ``deepseek2``, ``dots1``; each ``n_ff_exp`` wide);
            ``qwen2moe`` always has one sigmoid-gated shared expert of ``n_ff_shexp`` neurons.
        n_ff_shexp: ``qwen2moe`` shared-expert width.
        expert_types: ggml types of the (gate, up, down) expert matrices; with ``fused`` the gate
            type is the fused ``gate_up`` matrix's and the up type is ignored.
        late_expert_types / n_late_layers: other expert types for the last ``n_late_layers``
            blocks (a second slot class), or None.
        fused: ``ffn_gate_up_exps`` instead of separate gate and up (``deepseek2`` only).
        other_type: ggml type of attention, dense-FFN and shared-expert matrices.
        gating: router function ``softmax`` | ``sigmoid`` | ``softmax_weight``
            (``deepseek2`` / ``dots1`` read it from the file; the others fix it in their graph).
        probs_bias: write ``exp_probs_b.bias`` (selection bias, ``deepseek2`` / ``dots1``).
        weights_norm, weights_scale: normalise the top-k weights / scale them
            (``expert_weights_norm`` / ``expert_weights_scale``; 0 = not written).
        n_group, n_group_used: group-limited routing (``expert_group_count`` /
            ``expert_group_used_count``; 0 = off).
        q_lora_rank, kv_lora_rank, qk_rope, qk_nope, v_head_dim: ``deepseek2`` MLA shapes
            (``q_lora_rank`` 0 = a plain ``attn_q``).
        attn_bias: q/k/v biases (``qwen2moe``, ``gpt-oss``).
        sliding_window: ``gpt-oss`` sliding-window size (tokens) of its SWA layers.
        n_nextn: ``deepseek2`` trailing multi-token-prediction blocks (``nextn_predict_layers``,
            GLM-4.7-Flash style): written after the ``n_layer`` trunk blocks, with routed experts,
            and skipped by llama.cpp's loader (it loads them only when asked for MTP).
        tied_output: no ``output.weight``; llama.cpp reuses ``token_embd`` (not for ``qwen2moe``,
            ``gpt-oss``, ``dots1``, which require it).
        gate_exps: False leaves out ``ffn_gate_exps`` (``llama`` only: its experts are then
            ``down(silu(up x))``).
        alignment: ``general.alignment`` of tensor data, bytes (a multiple of 32).
    """

    arch: str
    n_layer: int = 3
    n_embd: int = 64
    n_head: int = 4
    n_head_kv: int = 2
    head_dim: int = 16
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
    tied_output: bool = False
    gate_exps: bool = True
    alignment: int = 32

    def expert_types_of(self, il: int) -> tuple[str, str, str] | None:
        """(gate, up, down) ggml types of block ``il``'s routed experts; None for a dense block."""
        return per_block(il, self.n_layer, self.n_dense_lead, self.n_late_layers, self.expert_types,
                         self.late_expert_types)


DEFAULTS: dict[str, dict] = {
    # Mixtral-style: every block MoE, softmax top-2 with weights normalised; Q8_0 gate/up, F16 down
    "llama": dict(n_layer=3, expert_types=("Q8_0", "Q8_0", "F16")),
    # DeepSeek-MoE 16B-style: block 0 dense, 2 shared experts, Q4_0 experts, 16 experts
    "deepseek": dict(n_layer=3, n_dense_lead=1, n_shared=2, n_expert=16, expert_types=("Q4_0", "Q4_0", "Q4_0"),
                     weights_scale=1.5),
    # DeepSeek-V3-style: MLA, block 0 dense, 1 shared expert, sigmoid + selection bias, 4 groups
    # of 4 experts with the best 2 groups kept, top-3 normalised and scaled; blocks 1-2 Q8_0,
    # block 3 F16 (two slot classes)
    "deepseek2": dict(n_layer=4, n_dense_lead=1, n_shared=1, n_expert=16, n_expert_used=3, gating="sigmoid",
                      probs_bias=True, weights_norm=True, weights_scale=2.5, n_group=4, n_group_used=2,
                      expert_types=("Q8_0", "Q8_0", "Q8_0"), late_expert_types=("F16", "F16", "F16"),
                      n_late_layers=1),
    # Qwen1.5-MoE-style: q/k/v biases, sigmoid-gated shared expert; BF16 experts
    "qwen2moe": dict(n_layer=3, attn_bias=True, expert_types=("BF16", "BF16", "BF16")),
    # Qwen3-MoE: q/k norms, softmax top-2 normalised; F16 gate/up, Q8_0 down
    "qwen3moe": dict(n_layer=3, expert_types=("F16", "F16", "Q8_0")),
    # gpt-oss: router and expert biases, attention sinks, every other block sliding-window (8
    # tokens), MXFP4 experts, softmax over the top-k logits
    "gpt-oss": dict(n_layer=4, attn_bias=True, sliding_window=8, gating="softmax_weight",
                    expert_types=("MXFP4", "MXFP4", "MXFP4")),
    # dots.llm1: block 0 dense, 1 shared expert, K/V with n_head heads, sigmoid + selection bias,
    # top-2 normalised; F16 gate/up, Q8_0 down
    "dots1": dict(n_layer=3, n_head_kv=4, n_dense_lead=1, n_shared=1, gating="sigmoid", probs_bias=True,
                  weights_norm=True, expert_types=("F16", "F16", "Q8_0")),
}


def tiny_spec(arch: str, **knobs) -> TinySpec:
    """The :class:`TinySpec` :func:`write_tiny` uses: ``arch``'s :data:`DEFAULTS` with ``knobs`` applied.

    Raises:
        ValueError: unknown architecture, unknown knob, or a combination llama.cpp cannot load
            (the message names it).
    """
    if arch not in DEFAULTS:
        raise ValueError(f"unknown architecture {arch!r}; choose one of {', '.join(ARCHS)}")
    names = {f.name for f in fields(TinySpec)} - {"arch"}
    bad = sorted(set(knobs) - names)
    if bad:
        raise ValueError(f"unknown knob(s) {', '.join(bad)} for write_tiny; known: {', '.join(sorted(names))}")
    s = replace(TinySpec(arch, **DEFAULTS[arch]), **knobs)
    _validate(s)
    return s


def _validate(s: TinySpec) -> None:
    if not 1 <= s.n_expert_used <= s.n_expert:
        raise ValueError(f"n_expert_used={s.n_expert_used} must be in 1..n_expert={s.n_expert}")
    if s.n_dense_lead and s.arch not in ("deepseek", "deepseek2", "dots1"):
        raise ValueError(f"{s.arch} has no leading dense blocks in llama.cpp; n_dense_lead must be 0")
    if not 0 <= s.n_dense_lead < s.n_layer:
        raise ValueError(f"n_dense_lead={s.n_dense_lead} must leave at least one MoE block of n_layer={s.n_layer}")
    if s.fused and s.arch != "deepseek2":
        raise ValueError(f"llama.cpp reads ffn_gate_up_exps for deepseek2 among {', '.join(ARCHS)}, not {s.arch}")
    if s.tied_output and s.arch in ("qwen2moe", "gpt-oss", "dots1"):
        raise ValueError(f"llama.cpp requires output.weight for {s.arch}; tied_output must be False")
    if not s.gate_exps and (s.arch != "llama" or s.fused):
        raise ValueError("only llama loads routed experts without ffn_gate_exps; gate_exps must be True")
    if s.n_nextn and s.arch != "deepseek2":
        raise ValueError("n_nextn (MTP blocks) is written for deepseek2 only")
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
    if s.arch in ("llama", "deepseek", "qwen2moe") and s.n_head * s.head_dim != s.n_embd:
        raise ValueError(f"{s.arch} needs n_head * head_dim == n_embd (its q and output are n_embd wide)")
    if s.arch == "gpt-oss" and s.sliding_window < 1:
        raise ValueError("gpt-oss needs sliding_window >= 1")


# ---- tokenizer -----------------------------------------------------------------------------------

def _vocab() -> tuple[list[str], list[float], list[int]]:
    """SentencePiece vocabulary: tokens, scores, token types (1 normal, 2 unknown, 3 control, 6 byte)."""
    toks = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + ["\u2581"] + [chr(c) for c in range(32, 127)]
    types = [2, 3, 3] + [6] * 256 + [1] * (1 + 95)
    scores = [0.0] * 259 + [-float(i) for i in range(1 + 95)]
    return toks, scores, types


# ---- tensors -------------------------------------------------------------------------------------

def _tensors(s: TinySpec) -> list[tuple[str, tuple[int, ...], str, str]]:
    """(name, ggml shape (ne0, ne1, ...), ggml type, init) of every tensor llama.cpp loads for
    ``s.arch``, in file order. init: ``one`` (norm weights), ``bias`` (small normal), ``w``
    (normal / sqrt(ne0)), ``emb`` (normal), ``router``."""
    D, V, ot, E = s.n_embd, len(_vocab()[0]), s.other_type, s.n_expert
    out = [("token_embd.weight", (D, V), ot, "emb"), ("output_norm.weight", (D,), "F32", "one")]
    if not s.tied_output:
        out.append(("output.weight", (D, V), ot, "w"))
    for il in range(s.n_layer + s.n_nextn):
        p = f"blk.{il}."

        def add(name, shape, t=ot, init="w"):
            out.append((p + name, tuple(shape), t, init))

        add("attn_norm.weight", (D,), "F32", "one")
        if s.arch == "deepseek2":
            H, hk = s.n_head, s.qk_nope + s.qk_rope
            if s.q_lora_rank:
                add("attn_q_a_norm.weight", (s.q_lora_rank,), "F32", "one")
            add("attn_kv_a_norm.weight", (s.kv_lora_rank,), "F32", "one")
            if s.q_lora_rank:
                add("attn_q_a.weight", (D, s.q_lora_rank))
                add("attn_q_b.weight", (s.q_lora_rank, H * hk))
            else:
                add("attn_q.weight", (D, H * hk))
            add("attn_kv_a_mqa.weight", (D, s.kv_lora_rank + s.qk_rope))
            add("attn_k_b.weight", (s.qk_nope, s.kv_lora_rank, H))
            add("attn_v_b.weight", (s.kv_lora_rank, s.v_head_dim, H))
            add("attn_output.weight", (H * s.v_head_dim, D))
        else:
            q, kv = s.n_head * s.head_dim, s.n_head_kv * s.head_dim
            if s.arch == "gpt-oss":
                add("post_attention_norm.weight", (D,), "F32", "one")
            add("attn_q.weight", (D, q))
            add("attn_k.weight", (D, kv))
            add("attn_v.weight", (D, kv))
            if s.attn_bias:
                add("attn_q.bias", (q,), "F32", "bias")
                add("attn_k.bias", (kv,), "F32", "bias")
                add("attn_v.bias", (kv,), "F32", "bias")
            add("attn_output.weight", (q, D))
            if s.arch == "gpt-oss":
                add("attn_output.bias", (D,), "F32", "bias")
                add("attn_sinks.weight", (s.n_head,), "F32", "bias")
            if s.arch in ("qwen3moe", "dots1"):
                add("attn_k_norm.weight", (s.head_dim,), "F32", "one")
                add("attn_q_norm.weight", (s.head_dim,), "F32", "one")
        if s.arch != "gpt-oss":
            add("ffn_norm.weight", (D,), "F32", "one")
        et = s.expert_types_of(il)
        if et is None:
            f = s.n_ff_dense
            add("ffn_gate.weight", (D, f))
            add("ffn_down.weight", (f, D))
            add("ffn_up.weight", (D, f))
            continue
        f = s.n_ff_exp
        add("ffn_gate_inp.weight", (D, E), "F32", "router")
        if s.arch == "gpt-oss":
            add("ffn_gate_inp.bias", (E,), "F32", "bias")
        if s.probs_bias:
            add("exp_probs_b.bias", (E,), "F32", "bias")
        if s.fused:
            add("ffn_gate_up_exps.weight", (D, 2 * f, E), et[0])
        else:
            if s.gate_exps:
                add("ffn_gate_exps.weight", (D, f, E), et[0])
            add("ffn_up_exps.weight", (D, f, E), et[1])
        add("ffn_down_exps.weight", (f, D, E), et[2])
        if s.arch == "gpt-oss":
            add("ffn_gate_exps.bias", (f, E), "F32", "bias")
            add("ffn_up_exps.bias", (f, E), "F32", "bias")
            add("ffn_down_exps.bias", (D, E), "F32", "bias")
        if s.arch == "qwen2moe":
            g = s.n_ff_shexp
            add("ffn_gate_inp_shexp.weight", (D,), "F32", "router")
            add("ffn_gate_shexp.weight", (D, g))
            add("ffn_down_shexp.weight", (g, D))
            add("ffn_up_shexp.weight", (D, g))
        elif s.n_shared:
            g = f * s.n_shared
            add("ffn_gate_shexp.weight", (D, g))
            add("ffn_down_shexp.weight", (g, D))
            add("ffn_up_shexp.weight", (D, g))
        if il >= s.n_layer:  # MTP block
            add("nextn.eh_proj.weight", (2 * D, D))
            add("nextn.enorm.weight", (D,), "F32", "one")
            add("nextn.hnorm.weight", (D,), "F32", "one")
            add("nextn.shared_head_norm.weight", (D,), "F32", "one")
    return out


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
    if init == "router":
        return x * np.float32(2.0 / np.sqrt(shape[0]))
    return x * np.float32(1.0 / np.sqrt(shape[0]))


def _encode(x: np.ndarray, ggml_type: str) -> np.ndarray:
    """``x`` in ``ggml_type``'s bytes (uint8, same leading dims) via gguf-py's quantizers."""
    from gguf import GGMLQuantizationType as QT
    from gguf.quants import quantize

    return np.ascontiguousarray(quantize(x, QT[ggml_type])).view(np.uint8)


def write_tiny(path: str | os.PathLike, arch: str, *, seed: int = 0, **knobs) -> Path:
    """Write a tiny random-weight MoE GGUF of architecture ``arch`` to ``path``.

    Args:
        path: output file (written to a temporary name in the same folder, then renamed).
        arch: ``llama`` | ``deepseek`` | ``deepseek2`` | ``qwen2moe`` | ``qwen3moe`` | ``gpt-oss`` | ``dots1``.
        seed: seed of every weight (same seed and knobs -> same bytes).
        **knobs: any :class:`TinySpec` field, e.g. ``fused=True`` (deepseek2),
            ``expert_types=("Q8_0", "Q8_0", "F16")``, ``n_layer=2``.

    Returns:
        the path written.

    Raises:
        ValueError: unknown architecture or knob, or sizes a type cannot hold (rows of a quantized
            type need a multiple of its block: 32 elements for Q8_0 / Q4_0 / MXFP4).
    """
    import gguf
    from gguf import GGMLQuantizationType as QT

    from gguf import GGML_QUANT_SIZES

    s = tiny_spec(arch, **knobs)
    tensors = _tensors(s)
    for name, shape, t, _ in tensors:
        block = GGML_QUANT_SIZES[QT[t]][0]
        if shape[0] % block:
            raise ValueError(f"{name}: {t} rows need a multiple of {block} elements, got {shape[0]}; change the sizes")
    path = Path(path)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    a = s.arch
    w = gguf.GGUFWriter(tmp, a)
    if s.alignment != 32:
        w.add_custom_alignment(s.alignment)
    w.add_name(f"tiny {a}")
    u32 = lambda k, v: w.add_uint32(f"{a}.{k}", int(v))  # noqa: E731
    u32("block_count", s.n_layer + s.n_nextn)
    if s.n_nextn:
        u32("nextn_predict_layers", s.n_nextn)
    u32("context_length", 4096)
    u32("embedding_length", s.n_embd)
    u32("feed_forward_length", s.n_ff_dense if s.n_dense_lead else s.n_ff_exp)
    u32("expert_feed_forward_length", s.n_ff_exp)
    u32("expert_count", s.n_expert)
    u32("expert_used_count", s.n_expert_used)
    u32("attention.head_count", s.n_head)
    w.add_float32(f"{a}.attention.layer_norm_rms_epsilon", 1e-6)
    w.add_float32(f"{a}.rope.freq_base", 10000.0)
    if a == "deepseek2":
        # MLA as llama.cpp's converter writes it: one KV head of kv_lora_rank + rope dims
        u32("attention.head_count_kv", 1)
        u32("attention.q_lora_rank", s.q_lora_rank)  # required (0 = plain attn_q) unless n_layer is a "lite" one
        u32("attention.kv_lora_rank", s.kv_lora_rank)
        u32("attention.key_length", s.kv_lora_rank + s.qk_rope)
        u32("attention.value_length", s.kv_lora_rank)
        u32("attention.key_length_mla", s.qk_nope + s.qk_rope)
        u32("attention.value_length_mla", s.v_head_dim)
        u32("rope.dimension_count", s.qk_rope)
    else:
        u32("attention.head_count_kv", s.n_head_kv)
        u32("attention.key_length", s.head_dim)
        u32("attention.value_length", s.head_dim)
        u32("rope.dimension_count", s.head_dim)
    if a in ("deepseek", "deepseek2", "dots1"):
        u32("leading_dense_block_count", s.n_dense_lead)
        u32("expert_shared_count", s.n_shared)
    if a == "qwen2moe":
        u32("expert_shared_feed_forward_length", s.n_ff_shexp)
    if a in ("deepseek2", "dots1"):
        u32("expert_gating_func", _GATING[s.gating])
    if s.weights_norm:
        w.add_bool(f"{a}.expert_weights_norm", True)
    if s.weights_scale:
        w.add_float32(f"{a}.expert_weights_scale", float(s.weights_scale))
    if s.n_group:
        u32("expert_group_count", s.n_group)
        u32("expert_group_used_count", s.n_group_used)
    if a == "gpt-oss":
        u32("attention.sliding_window", s.sliding_window)
    toks, scores, types = _vocab()
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


__all__ = ["ARCHS", "DEFAULTS", "TinySpec", "tiny_spec", "write_tiny"]
