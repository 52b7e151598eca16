"""The per-architecture tables of :mod:`epqlab.models.archs`: what llama.cpp's loader reads for each MoE
architecture, as data.

One :class:`ArchTable` per architecture in :data:`ARCH_TABLES`: its GGUF keys and its per-block tensor rows,
read off ``src/models/<arch>.cpp`` (``load_arch_hparams`` / ``load_arch_tensors``) of the llama.cpp vendored
by llama-cpp-python 0.3.36, names from ``src/llama-arch.cpp``. Shapes and conditions are expressions over an
:class:`epqlab.models.archs.ArchSpec` (names listed in that module's docstring); :data:`DEFAULTS` holds each
architecture's tiny test spec. Evaluated by :func:`epqlab.models.archs.arch_tensors` / ``arch_kv``.
"""
from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class ArchTable:
    """One architecture's GGUF keys and tensors, as data.

    Attributes:
        kv: rows ``(key, kind, value expression[, condition])`` added to / replacing :data:`COMMON_KV`
            (same key: replaced; value None: the key is dropped). kind: ``u32`` | ``f32`` | ``bool`` |
            ``i32s`` (array) | ``u32s``.
        block: rows ``(name, shape expressions, type, init, condition)`` for each block ``blk.N.``;
            type: a ggml type name, ``ot`` (``other_type``) or ``exp.gate`` / ``exp.up`` / ``exp.down``
            (the block's expert types); init: ``one`` (norm weights), ``bias`` (small normal), ``w``
            (normal / sqrt(ne0)), ``emb`` (normal), ``router`` (normal x 2 / sqrt(ne0)), ``neg``
            (negative decay rates, -(0.1 + |normal|/2)), ``scale`` (positive, 0.5 + uniform[0, 1)).
        flags: the architecture's own block flags, name -> expression (``moe`` overrides the default
            ``il >= n_dense_lead``).
        caps: optional knobs this architecture's loader accepts: ``dense_lead``, ``fused``, ``tied``,
            ``nogate``, ``nextn``, ``shared`` (n_shared > 0), ``groups``.
        output_required: llama.cpp requires ``output.weight`` (no tied embedding fallback).
        output_norm: name of the final norm's tensor (lfm2moe's is ``token_embd_norm.weight``).
        top: rows of further tensors outside the blocks, as ``block`` rows (condition over the spec's names).
        source: the llama.cpp file the rows come from.
    """

    kv: tuple
    block: tuple
    flags: dict
    caps: frozenset
    output_required: bool = False
    source: str = ""
    output_norm: str = "output_norm.weight"
    top: tuple = ()


# ---- shared rows -----------------------------------------------------------------------------------

def _norm(name, shape="D", when="True"):
    return (name, shape, "F32", "one", when)


COMMON_KV = (
    ("block_count", "u32", "n_layer + n_nextn"),
    ("nextn_predict_layers", "u32", "n_nextn", "n_nextn"),
    ("context_length", "u32", "context_length"),
    ("embedding_length", "u32", "D"),
    ("feed_forward_length", "u32", "Fd if n_dense_lead else F"),
    ("expert_feed_forward_length", "u32", "F"),
    ("expert_count", "u32", "E"),
    ("expert_used_count", "u32", "n_expert_used"),
    ("attention.head_count", "u32", "H"),
    ("attention.head_count_kv", "u32", "Hkv"),
    ("attention.key_length", "u32", "Dh"),
    ("attention.value_length", "u32", "Dh"),
    ("attention.layer_norm_rms_epsilon", "f32", "1e-6"),
    ("rope.freq_base", "f32", "10000.0"),
    ("rope.dimension_count", "u32", "R"),
    ("expert_weights_norm", "bool", "True", "weights_norm"),
    ("expert_weights_scale", "f32", "weights_scale", "weights_scale"),
    ("expert_group_count", "u32", "n_group", "n_group"),
    ("expert_group_used_count", "u32", "n_group_used", "n_group"),
)
KV_DENSE_LEAD = (("leading_dense_block_count", "u32", "n_dense_lead"),)
KV_SHARED = (("expert_shared_count", "u32", "n_shared"),)
KV_GATING = (("expert_gating_func", "u32", "GATING"),)
KV_SHEXP_FF = (("expert_shared_feed_forward_length", "u32", "Fs"),)

ATTN_QKVO = (
    ("attn_q.weight", "D, H*Dh", "ot", "w", "True"),
    ("attn_k.weight", "D, Hkv*Dh", "ot", "w", "True"),
    ("attn_v.weight", "D, Hkv*Dh", "ot", "w", "True"),
    ("attn_output.weight", "H*Dh, D", "ot", "w", "True"),
)
ATTN_QKV_BIAS = (
    ("attn_q.bias", "H*Dh", "F32", "bias", "attn_bias"),
    ("attn_k.bias", "Hkv*Dh", "F32", "bias", "attn_bias"),
    ("attn_v.bias", "Hkv*Dh", "F32", "bias", "attn_bias"),
)
QK_NORM = (_norm("attn_k_norm.weight", "Dh"), _norm("attn_q_norm.weight", "Dh"))
DENSE_FFN = (
    ("ffn_gate.weight", "D, Fd", "ot", "w", "dense"),
    ("ffn_down.weight", "Fd, D", "ot", "w", "dense"),
    ("ffn_up.weight", "D, Fd", "ot", "w", "dense"),
)
ROUTER = (("ffn_gate_inp.weight", "D, E", "F32", "router", "moe"),)
PROBS_BIAS = (("exp_probs_b.bias", "E", "F32", "bias", "moe"),)
EXPERTS = (
    ("ffn_gate_up_exps.weight", "D, 2*F, E", "exp.gate", "w", "moe and fused"),
    ("ffn_gate_exps.weight", "D, F, E", "exp.gate", "w", "moe and not fused and gate_exps"),
    ("ffn_up_exps.weight", "D, F, E", "exp.up", "w", "moe and not fused"),
    ("ffn_down_exps.weight", "F, D, E", "exp.down", "w", "moe"),
    # per-expert scales (llama-model.cpp load_tensors: "MoE expert weight scales (per-expert, shape {n_expert})",
    # blocks whose experts are loaded: not the skipped MTP blocks)
    ("ffn_gate_exps.scale", "E", "F32", "scale", "moe and expert_scales and not mtp and not fused and gate_exps"),
    ("ffn_up_exps.scale", "E", "F32", "scale", "moe and expert_scales and not mtp and not fused"),
    ("ffn_down_exps.scale", "E", "F32", "scale", "moe and expert_scales and not mtp"),
)
SHEXP_N = (  # n_shared experts of n_ff_exp neurons each, fused into one FFN
    ("ffn_gate_shexp.weight", "D, F*n_shared", "ot", "w", "moe and n_shared"),
    ("ffn_down_shexp.weight", "F*n_shared, D", "ot", "w", "moe and n_shared"),
    ("ffn_up_shexp.weight", "D, F*n_shared", "ot", "w", "moe and n_shared"),
)
SHEXP_FS = (  # one shared expert of n_ff_shexp neurons
    ("ffn_gate_shexp.weight", "D, Fs", "ot", "w", "moe"),
    ("ffn_down_shexp.weight", "Fs, D", "ot", "w", "moe"),
    ("ffn_up_shexp.weight", "D, Fs", "ot", "w", "moe"),
)
SHEXP_GATE = (("ffn_gate_inp_shexp.weight", "D", "F32", "router", "moe"),)
NEXTN = (
    ("nextn.eh_proj.weight", "2*D, D", "ot", "w", "mtp"),
    _norm("nextn.enorm.weight", when="mtp"),
    _norm("nextn.hnorm.weight", when="mtp"),
    _norm("nextn.shared_head_norm.weight", when="mtp"),
)
ATTN_NORM = (_norm("attn_norm.weight"),)
FFN_NORM = (_norm("ffn_norm.weight"),)


def _when(rows, cond):
    """``rows`` with ``cond`` and-ed into each row's condition."""
    return tuple((n, s, t, i, f"({cond}) and ({w})") for n, s, t, i, w in rows)


# MLA attention (deepseek2.cpp, deepseek32.cpp): q through a LoRA (q_lora_rank; 0 = a plain attn_q), keys and
# values from one compressed kv_lora_rank latent plus qk_rope rotary dims, k_b / v_b per head
MLA = (
            _norm("attn_q_a_norm.weight", "q_lora_rank", "q_lora_rank"),
            _norm("attn_kv_a_norm.weight", "kv_lora_rank"),
            ("attn_q_a.weight", "D, q_lora_rank", "ot", "w", "q_lora_rank"),
            ("attn_q_b.weight", "q_lora_rank, H*(qk_nope+qk_rope)", "ot", "w", "q_lora_rank"),
            ("attn_q.weight", "D, H*(qk_nope+qk_rope)", "ot", "w", "not q_lora_rank"),
            ("attn_kv_a_mqa.weight", "D, kv_lora_rank + qk_rope", "ot", "w", "True"),
            ("attn_k_b.weight", "qk_nope, kv_lora_rank, H", "ot", "w", "True"),
            ("attn_v_b.weight", "kv_lora_rank, v_head_dim, H", "ot", "w", "True"),
            ("attn_output.weight", "H*v_head_dim, D", "ot", "w", "True"),
)
KV_MLA = (
    ("attention.head_count_kv", "u32", "1"),
    ("attention.q_lora_rank", "u32", "q_lora_rank"),
    ("attention.kv_lora_rank", "u32", "kv_lora_rank"),
    ("attention.key_length", "u32", "kv_lora_rank + qk_rope"),
    ("attention.value_length", "u32", "kv_lora_rank"),
    ("attention.key_length_mla", "u32", "qk_nope + qk_rope"),
    ("attention.value_length_mla", "u32", "v_head_dim"),
    ("rope.dimension_count", "u32", "qk_rope"),
)

# Gated-DeltaNet hybrids (qwen35moe.cpp, qwen3next.cpp): key/value heads of ssm_d_state, ssm_n_group key
# heads, ssm_dt_rank value heads; q, k, v of the recurrent blocks in one attn_qkv (its conv1d is as wide)
_GDN_QKV = "2*ssm_n_group*ssm_d_state + ssm_dt_rank*ssm_d_state"
KV_GDN = KV_SHEXP_FF + (
    ("ssm.conv_kernel", "u32", "ssm_d_conv"),
    ("ssm.inner_size", "u32", "ssm_d_state * ssm_dt_rank"),
    ("ssm.state_size", "u32", "ssm_d_state"),
    ("ssm.time_step_rank", "u32", "ssm_dt_rank"),
    ("ssm.group_count", "u32", "ssm_n_group"),
    ("full_attention_interval", "u32", "full_attn_interval"),
    ("feed_forward_length", "u32", "F"),
)
GDN_FLAGS = {"recr": "not mtp and (il + 1) % full_attn_interval != 0"}
GDN_BLOCK_HEAD = ATTN_NORM + (_norm("post_attention_norm.weight"),) + _when((
    ("attn_q.weight", "D, 2*H*Dh", "ot", "w", "True"),
) + ATTN_QKVO[1:] + QK_NORM, "not recr")
GDN_RECR = (
    ("attn_qkv.weight", f"D, {_GDN_QKV}", "ot", "w", "True"),
    ("attn_gate.weight", "D, ssm_dt_rank*ssm_d_state", "ot", "w", "True"),
    ("ssm_conv1d.weight", f"ssm_d_conv, {_GDN_QKV}", "F32", "w", "True"),
    ("ssm_dt.bias", "ssm_dt_rank", "F32", "bias", "True"),
    ("ssm_a", "ssm_dt_rank", "F32", "neg", "True"),
    _norm("ssm_norm.weight", "ssm_d_state"),
    ("ssm_out.weight", "ssm_dt_rank*ssm_d_state, D", "ot", "w", "True"),
)
GDN_BLOCK_TAIL = ROUTER + EXPERTS + SHEXP_GATE + SHEXP_FS + NEXTN

# Mamba-2 blocks (mamba-base.cpp build_mamba2_layer): ssm_dt_rank heads, inner width Di, ssm_n_group groups of
# B/C of ssm_d_state; ssm_conv1d.bias is optional in the loaders but always added in the graph
MAMBA2 = (
    ("ssm_in.weight", "D, 2*Di + 2*ssm_n_group*ssm_d_state + ssm_dt_rank", "ot", "w", "True"),
    ("ssm_conv1d.weight", "ssm_d_conv, Di + 2*ssm_n_group*ssm_d_state", "F32", "w", "True"),
    ("ssm_conv1d.bias", "Di + 2*ssm_n_group*ssm_d_state", "F32", "bias", "True"),
    ("ssm_dt.bias", "ssm_dt_rank", "F32", "bias", "True"),
    ("ssm_a", "1, ssm_dt_rank", "F32", "neg", "True"),
    ("ssm_d", "1, ssm_dt_rank", "F32", "bias", "True"),
    ("ssm_norm.weight", "Di // ssm_n_group, ssm_n_group", "F32", "one", "True"),
    ("ssm_out.weight", "Di, D", "ot", "w", "True"),
)
KV_MAMBA2 = (
    ("ssm.conv_kernel", "u32", "ssm_d_conv"),
    ("ssm.inner_size", "u32", "Di"),
    ("ssm.state_size", "u32", "ssm_d_state"),
    ("ssm.time_step_rank", "u32", "ssm_dt_rank"),
    ("ssm.group_count", "u32", "ssm_n_group"),
)


# ---- the tables ------------------------------------------------------------------------------------

ARCH_TABLES: dict[str, ArchTable] = {
    # src/models/llama.cpp: Mixtral-style, every block MoE
    "llama": ArchTable(
        kv=(), source="llama.cpp", caps=frozenset({"tied", "nogate"}), flags={},
        block=ATTN_NORM + ATTN_QKVO + FFN_NORM + ROUTER + EXPERTS),
    # src/models/deepseek.cpp: leading dense blocks, n_shared shared experts
    "deepseek": ArchTable(
        kv=KV_DENSE_LEAD + KV_SHARED, source="deepseek.cpp", flags={},
        caps=frozenset({"dense_lead", "shared", "tied"}),
        block=ATTN_NORM + ATTN_QKVO + FFN_NORM + DENSE_FFN + ROUTER + EXPERTS + SHEXP_N),
    # src/models/deepseek2.cpp: MLA (one KV head of kv_lora_rank + rope dims, as the converter writes it),
    # sigmoid routing with exp_probs_b, groups, optional fused gate_up, optional MTP blocks
    "deepseek2": ArchTable(
        kv=KV_DENSE_LEAD + KV_SHARED + KV_GATING + KV_MLA,
        source="deepseek2.cpp", flags={}, caps=frozenset({"dense_lead", "shared", "tied", "fused", "nextn", "groups"}),
        block=ATTN_NORM + MLA + FFN_NORM + DENSE_FFN + ROUTER + _when(PROBS_BIAS, "probs_bias") + EXPERTS + SHEXP_N + NEXTN),
    # src/models/qwen2moe.cpp: q/k/v biases, one sigmoid-gated shared expert
    "qwen2moe": ArchTable(
        kv=KV_SHEXP_FF, source="qwen2moe.cpp", flags={}, caps=frozenset(), output_required=True,
        block=ATTN_NORM + ATTN_QKVO[:3] + ATTN_QKV_BIAS + ATTN_QKVO[3:] + FFN_NORM + ROUTER + EXPERTS
        + SHEXP_GATE + SHEXP_FS),
    # src/models/qwen3moe.cpp: q/k RMS norms
    "qwen3moe": ArchTable(
        kv=(), source="qwen3moe.cpp", flags={}, caps=frozenset({"tied"}),
        block=ATTN_NORM + ATTN_QKVO + QK_NORM + FFN_NORM + ROUTER + EXPERTS),
    # src/models/openai-moe.cpp: router and expert biases, attention sinks, sliding-window blocks
    "gpt-oss": ArchTable(
        kv=(("attention.sliding_window", "u32", "sliding_window"),), source="openai-moe.cpp", flags={},
        caps=frozenset(), output_required=True,
        block=ATTN_NORM + (_norm("post_attention_norm.weight"),) + ATTN_QKVO[:3] + ATTN_QKV_BIAS + ATTN_QKVO[3:] + (
            ("attn_output.bias", "D", "F32", "bias", "True"),
            ("attn_sinks.weight", "H", "F32", "bias", "True"),
        ) + ROUTER + (("ffn_gate_inp.bias", "E", "F32", "bias", "moe"),) + EXPERTS + (
            ("ffn_gate_exps.bias", "F, E", "F32", "bias", "moe"),
            ("ffn_up_exps.bias", "F, E", "F32", "bias", "moe"),
            ("ffn_down_exps.bias", "D, E", "F32", "bias", "moe"),
        )),
    # src/models/dots1.cpp: leading dense blocks, shared experts, sigmoid + exp_probs_b, K/V of n_head heads
    "dots1": ArchTable(
        kv=KV_DENSE_LEAD + KV_SHARED + KV_GATING, source="dots1.cpp", flags={},
        caps=frozenset({"dense_lead", "shared"}), output_required=True,
        block=ATTN_NORM + ATTN_QKVO + QK_NORM + FFN_NORM + DENSE_FFN + ROUTER + _when(PROBS_BIAS, "probs_bias")
        + EXPERTS + SHEXP_N),
    # src/models/qwen35moe.cpp: Gated-DeltaNet (recurrent) blocks and full-attention blocks (every
    # full_attn_interval-th), routed experts + a sigmoid-gated shared expert in every block, an optional
    # trailing MTP block with its own experts. Full attention: q and its output gate in one attn_q of
    # 2*H*Dh rows, q/k norms, multi-section RoPE.
    "qwen35moe": ArchTable(
        kv=KV_GDN + (("rope.dimension_sections", "i32s", "rope_sections"),),
        source="qwen35moe.cpp", caps=frozenset({"tied", "fused", "nextn"}), flags=GDN_FLAGS,
        block=GDN_BLOCK_HEAD + _when(GDN_RECR + (
            ("ssm_beta.weight", "D, ssm_dt_rank", "ot", "w", "True"),
            ("ssm_alpha.weight", "D, ssm_dt_rank", "ot", "w", "True"),
        ), "recr") + GDN_BLOCK_TAIL),
    # src/models/qwen3next.cpp: as qwen35moe with beta and alpha in one ssm_ba matrix and plain RoPE
    "qwen3next": ArchTable(
        kv=KV_GDN, source="qwen3next.cpp", caps=frozenset({"tied", "fused", "nextn"}), flags=GDN_FLAGS,
        block=GDN_BLOCK_HEAD + _when(GDN_RECR + (("ssm_ba.weight", "D, 2*ssm_dt_rank", "ot", "w", "True"),), "recr")
        + GDN_BLOCK_TAIL),
    # src/models/laguna.cpp: q/k norms, a softplus per-head attention output gate, sliding-window blocks
    # (pattern 4, full first), leading dense blocks, sigmoid routing with exp_probs_b, routed scaling,
    # one shared expert
    "laguna": ArchTable(
        kv=KV_DENSE_LEAD + KV_GATING + KV_SHEXP_FF + (
            ("expert_shared_count", "u32", "1"),
            ("attention.sliding_window", "u32", "sliding_window", "sliding_window"),
            ("attention.sliding_window_pattern", "u32", "4", "sliding_window"),
        ),
        source="laguna.cpp", flags={}, caps=frozenset({"dense_lead", "tied"}),
        block=ATTN_NORM + ATTN_QKVO + QK_NORM + (("attn_gate.weight", "D, H", "ot", "w", "True"),) + FFN_NORM
        + ROUTER + PROBS_BIAS + EXPERTS + SHEXP_FS + DENSE_FFN),
    # src/models/olmoe.cpp: q/k RMS norms over the whole projection (n_embd wide: K has n_head heads)
    "olmoe": ArchTable(
        kv=(), source="olmoe.cpp", flags={}, caps=frozenset(), output_required=True,
        block=ATTN_NORM + ATTN_QKVO + (_norm("attn_q_norm.weight"), _norm("attn_k_norm.weight")) + FFN_NORM
        + ROUTER + EXPERTS),
    # src/models/granite.cpp (LLM_ARCH_GRANITE_MOE): mu-P scales (embedding, residual, attention, logits),
    # experts n_ff (feed_forward_length) wide, optional shared expert
    "granitemoe": ArchTable(
        kv=(("logit_scale", "f32", "4.0"), ("residual_scale", "f32", "0.5"), ("embedding_scale", "f32", "2.0"),
            ("attention.scale", "f32", "1.0 / Dh"), ("expert_shared_feed_forward_length", "u32", "Fs", "n_shared")),
        source="granite.cpp", flags={}, caps=frozenset({"tied", "shared"}),
        block=ATTN_NORM + ATTN_QKVO + FFN_NORM + ROUTER + EXPERTS + _when(SHEXP_FS, "n_shared")),
    # src/models/ernie4-5.cpp (load) / ernie4-5-moe.cpp (graph): every moe_layer_step-th block past the dense
    # lead is MoE, optional selection bias, one shared expert of n_ff_shexp
    "ernie4_5-moe": ArchTable(
        kv=KV_DENSE_LEAD + KV_SHEXP_FF + (("interleave_moe_layer_step", "u32", "moe_layer_step"),),
        source="ernie4-5.cpp", flags={"moe": "il >= n_dense_lead and (il + 1) % moe_layer_step == 0"},
        caps=frozenset({"tied", "dense_lead"}),
        block=ATTN_NORM + ATTN_QKVO + FFN_NORM + ROUTER + _when(PROBS_BIAS, "probs_bias") + EXPERTS + SHEXP_FS
        + DENSE_FFN),
    # src/models/hunyuan-moe.cpp: q/k norms, experts n_ff wide, one shared expert of n_ff_shexp
    "hunyuan-moe": ArchTable(
        kv=KV_SHEXP_FF, source="hunyuan-moe.cpp", flags={}, caps=frozenset({"tied"}),
        block=ATTN_NORM + ATTN_QKVO + QK_NORM + FFN_NORM + ROUTER + EXPERTS + SHEXP_FS),
    # src/models/glm4-moe.cpp: q/k/v biases, q/k norms, post-attention norm, leading dense blocks,
    # sigmoid + exp_probs_b, n_shared shared experts, optional MTP blocks
    "glm4moe": ArchTable(
        kv=KV_DENSE_LEAD + KV_SHARED + KV_GATING, source="glm4-moe.cpp", flags={},
        caps=frozenset({"tied", "dense_lead", "shared", "nextn"}),
        block=ATTN_NORM + ATTN_QKVO[:3] + ATTN_QKV_BIAS + ATTN_QKVO[3:] + QK_NORM
        + (_norm("post_attention_norm.weight"),) + DENSE_FFN + ROUTER + PROBS_BIAS + EXPERTS + SHEXP_N + NEXTN),
    # src/models/minimax-m2.cpp: q/k norms over all heads, sigmoid + exp_probs_b, experts n_ff wide
    "minimax-m2": ArchTable(
        kv=KV_GATING, source="minimax-m2.cpp", flags={}, caps=frozenset(), output_required=True,
        block=ATTN_NORM + ATTN_QKVO + (_norm("attn_q_norm.weight", "H*Dh"), _norm("attn_k_norm.weight", "Hkv*Dh"))
        + FFN_NORM + ROUTER + PROBS_BIAS + EXPERTS),
    # src/models/llama4.cpp: every moe_layer_step-th block MoE (experts + one shared expert of n_ff_exp),
    # the others dense; chunked attention on 3 of 4 blocks
    "llama4": ArchTable(
        kv=(("interleave_moe_layer_step", "u32", "moe_layer_step"), ("feed_forward_length", "u32", "Fd")),
        source="llama4.cpp",
        flags={"moe": "(il + 1) % moe_layer_step == 0"}, caps=frozenset({"tied"}),
        block=ATTN_NORM + ATTN_QKVO + FFN_NORM + ROUTER + EXPERTS + (
            ("ffn_gate_shexp.weight", "D, F", "ot", "w", "moe"),
            ("ffn_down_shexp.weight", "F, D", "ot", "w", "moe"),
            ("ffn_up_shexp.weight", "D, F", "ot", "w", "moe"),
        ) + DENSE_FFN),
    # src/models/bailingmoe2.cpp: fused attn_qkv, q/k norms, leading dense blocks, sigmoid + optional
    # exp_probs_b, n_shared shared experts of n_ff_shexp, optional MTP blocks (skipped by the loader)
    "bailingmoe2": ArchTable(
        kv=KV_DENSE_LEAD + KV_SHARED + KV_GATING + KV_SHEXP_FF, source="bailingmoe2.cpp", flags={},
        caps=frozenset({"dense_lead", "shared", "nextn"}), output_required=True,
        block=ATTN_NORM + (("attn_qkv.weight", "D, H*Dh + 2*Hkv*Dh", "ot", "w", "True"),) + ATTN_QKVO[3:]
        + QK_NORM + FFN_NORM + DENSE_FFN + ROUTER + _when(PROBS_BIAS, "probs_bias") + EXPERTS + (
            ("ffn_gate_shexp.weight", "D, Fs*n_shared", "ot", "w", "moe"),
            ("ffn_down_shexp.weight", "Fs*n_shared, D", "ot", "w", "moe"),
            ("ffn_up_shexp.weight", "D, Fs*n_shared", "ot", "w", "moe"),
        ) + NEXTN + (_norm("layer_output_norm.weight", when="mtp"),)),
    # src/models/lfm2moe.cpp: short-convolution (recurrent) blocks and attention blocks (those with
    # head_count_kv > 0: every full_attn_interval-th here), leading dense blocks, sigmoid + exp_probs_b
    "lfm2moe": ArchTable(
        kv=KV_DENSE_LEAD + KV_GATING + (
            ("shortconv.l_cache", "u32", "ssm_d_conv"),
            ("feed_forward_length", "u32", "Fd"),
            ("attention.head_count_kv", "u32s",
             "[Hkv if (il + 1) % full_attn_interval == 0 else 0 for il in range(n_layer)]"),
        ),
        source="lfm2moe.cpp", flags={"recr": "(il + 1) % full_attn_interval != 0"},
        caps=frozenset({"tied", "dense_lead"}), output_norm="token_embd_norm.weight",
        block=FFN_NORM + DENSE_FFN + ROUTER + EXPERTS + PROBS_BIAS + ATTN_NORM + _when(QK_NORM + ATTN_QKVO, "not recr")
        + _when((
            ("shortconv.conv.weight", "ssm_d_conv, D", "F32", "w", "True"),
            ("shortconv.in_proj.weight", "D, 3*D", "ot", "w", "True"),
            ("shortconv.out_proj.weight", "D, D", "ot", "w", "True"),
        ), "recr")),
    # src/models/nemotron-h.cpp (LLM_ARCH_NEMOTRON_H_MOE): three kinds of block, each with only attn_norm:
    # Mamba-2 (recurrent: head_count_kv and feed_forward_length 0), attention (head_count_kv > 0), MoE
    # (feed_forward_length > 0: experts with up and down only, relu^2, sigmoid + exp_probs_b, one shared
    # expert of n_ff_shexp); here in the repeating order Mamba-2, attention, MoE
    "nemotron_h_moe": ArchTable(
        kv=KV_SHEXP_FF + (
            ("attention.head_count_kv", "u32s", "[Hkv if il % 3 == 1 else 0 for il in range(n_layer)]"),
            ("feed_forward_length", "u32s", "[F if il % 3 == 2 else 0 for il in range(n_layer)]"),
            ("attention.layer_norm_epsilon", "f32", "1e-5"),
            ("ssm.conv_kernel", "u32", "ssm_d_conv"),
            ("ssm.inner_size", "u32", "Di"),
            ("ssm.state_size", "u32", "ssm_d_state"),
            ("ssm.time_step_rank", "u32", "ssm_dt_rank"),
            ("ssm.group_count", "u32", "ssm_n_group"),
        ),
        source="nemotron-h.cpp", flags={"moe": "il % 3 == 2", "recr": "il % 3 == 0"}, caps=frozenset({"tied", "nogate"}),
        block=ATTN_NORM + _when(MAMBA2, "recr") + _when(ATTN_QKVO, "not recr and not moe") + ROUTER + PROBS_BIAS
        + EXPERTS + (
            ("ffn_down_shexp.weight", "Fs, D", "ot", "w", "moe"),
            ("ffn_up_shexp.weight", "D, Fs", "ot", "w", "moe"),
        )),
    # src/models/gemma4.cpp: every block has a dense FFN and routed experts (router on the attention output,
    # rms-normed and scaled by ffn_gate_inp.scale), sliding-window blocks from a per-layer bool array, one
    # shared rope_freqs for the full-attention blocks
    "gemma4": ArchTable(
        kv=(
            ("attention.sliding_window_pattern", "bools", "[(il + 1) % 4 != 0 for il in range(n_layer)]"),
            ("attention.sliding_window", "u32", "sliding_window"),
            ("embedding_length_per_layer_input", "u32", "0"),
            ("attention.key_length_swa", "u32", "Dh"),
            ("attention.value_length_swa", "u32", "Dh"),
            ("feed_forward_length", "u32", "Fd"),
        ),
        source="gemma4.cpp", flags={"moe": "True"}, caps=frozenset({"tied", "fused"}),
        top=(_norm("rope_freqs.weight", "Dh // 2", "n_layer >= 4"),),
        block=ATTN_NORM + ATTN_QKVO + QK_NORM + (_norm("post_attention_norm.weight"),) + FFN_NORM
        + tuple((n, sh, t, i, "True") for n, sh, t, i, _ in DENSE_FFN) + (_norm("post_ffw_norm.weight"),) + ROUTER + (
            _norm("ffn_gate_inp.scale", when="moe"),
            _norm("pre_ffw_norm_2.weight", when="moe"),
            _norm("post_ffw_norm_1.weight", when="moe"),
            _norm("post_ffw_norm_2.weight", when="moe"),
        ) + EXPERTS),
    # src/models/qwen3vlmoe.cpp: qwen3moe with multi-section RoPE (text positions in every section)
    "qwen3vlmoe": ArchTable(
        kv=(("rope.dimension_sections", "i32s", "rope_sections"),), source="qwen3vlmoe.cpp", flags={},
        caps=frozenset({"tied"}),
        block=ATTN_NORM + ATTN_QKVO + QK_NORM + FFN_NORM + ROUTER + EXPERTS),
    # src/models/smallthinker.cpp: no ffn_norm reading beyond the usual, router from the file's gating function
    "smallthinker": ArchTable(
        kv=KV_GATING, source="smallthinker.cpp", flags={}, caps=frozenset({"tied"}),
        block=ATTN_NORM + ATTN_QKVO + FFN_NORM + ROUTER + EXPERTS),
    # src/models/dbrx.cpp: fused attn_qkv, LayerNorm eps, clamped q/k/v, attn_output_norm before the experts
    # (no ffn_norm), experts n_ff wide
    "dbrx": ArchTable(
        kv=(("attention.layer_norm_epsilon", "f32", "1e-5"), ("attention.clamp_kqv", "f32", "8.0")),
        source="dbrx.cpp", flags={}, caps=frozenset(), output_required=True,
        block=ATTN_NORM + (("attn_qkv.weight", "D, D + 2*Hkv*Dh", "ot", "w", "True"),) + ATTN_QKVO[3:]
        + (_norm("attn_output_norm.weight"),) + ROUTER + EXPERTS),
    # src/models/grok.cpp: attn_output_norm and ffn_norm around attention, layer_output_norm after the experts,
    # built-in logit, embedding and attention-output scales and soft-capping
    "grok": ArchTable(
        kv=(), source="grok.cpp", flags={}, caps=frozenset({"tied"}),
        block=ATTN_NORM + ATTN_QKVO + (_norm("attn_output_norm.weight"),) + FFN_NORM + ROUTER + EXPERTS
        + (_norm("layer_output_norm.weight"),)),
    # src/models/arctic.cpp: a dense residual FFN n_embd wide in every block beside the experts (n_ff wide),
    # with its own ffn_norm_exps
    "arctic": ArchTable(
        kv=(), source="arctic.cpp", flags={}, caps=frozenset({"tied"}),
        block=ATTN_NORM + ATTN_QKVO + FFN_NORM + (
            ("ffn_gate.weight", "D, D", "ot", "w", "True"),
            ("ffn_down.weight", "D, D", "ot", "w", "True"),
            ("ffn_up.weight", "D, D", "ot", "w", "True"),
            _norm("ffn_norm_exps.weight"),
        ) + ROUTER + EXPERTS),
    # src/models/bailingmoe.cpp: q/k/v of n_rot-wide heads, n_shared shared experts of n_ff_exp each
    "bailingmoe": ArchTable(
        kv=KV_SHARED, source="bailingmoe.cpp", flags={}, caps=frozenset({"tied", "shared"}),
        block=ATTN_NORM + ATTN_QKVO + FFN_NORM + ROUTER + EXPERTS + SHEXP_N),
    # src/models/exaone-moe.cpp: q/k norms, sliding-window blocks (3 of 4), leading dense blocks, gating from
    # the file, optional exp_probs_b, one shared expert of n_ff_shexp
    "exaone-moe": ArchTable(
        kv=KV_DENSE_LEAD + KV_GATING + KV_SHEXP_FF + (
            ("expert_shared_count", "u32", "1"),
            ("attention.sliding_window", "u32", "sliding_window"),
            ("feed_forward_length", "u32", "Fd"),
        ),
        source="exaone-moe.cpp", flags={}, caps=frozenset({"tied", "dense_lead"}),
        block=ATTN_QKVO + ATTN_NORM + QK_NORM + FFN_NORM + DENSE_FFN + ROUTER + _when(PROBS_BIAS, "probs_bias")
        + EXPERTS + SHEXP_FS),
    # src/models/afmoe.cpp: post-attention and post-FFN norms, q/k norms, a sigmoid attention gate, leading
    # dense blocks, sigmoid + exp_probs_b, n_shared shared experts of n_ff_exp each; sliding-window blocks (3 of
    # 4; the graph always builds the SWA attention input, so the window is required: loader_checks)
    "afmoe": ArchTable(
        kv=KV_DENSE_LEAD + KV_SHARED + KV_GATING + (
            ("attention.sliding_window", "u32", "sliding_window", "sliding_window"),
        ),
        source="afmoe.cpp", flags={},
        caps=frozenset({"tied", "dense_lead", "shared"}),
        block=ATTN_NORM + (_norm("post_attention_norm.weight"),) + ATTN_QKVO + QK_NORM
        + (("attn_gate.weight", "D, H*Dh", "ot", "w", "True"),) + FFN_NORM + (_norm("post_ffw_norm.weight"),)
        + ROUTER + PROBS_BIAS + EXPERTS + SHEXP_N + DENSE_FFN),
    # src/models/mimo2.cpp: sliding-window blocks from a per-layer bool array, attention sinks, blocks with a
    # router are MoE (sigmoid, optional exp_probs_b), the others dense
    "mimo2": ArchTable(
        kv=(
            ("attention.sliding_window_pattern", "bools", "[(il + 1) % 4 != 0 for il in range(n_layer)]"),
            ("attention.sliding_window", "u32", "sliding_window"),
            ("feed_forward_length", "u32", "Fd"),
        ),
        source="mimo2.cpp", flags={}, caps=frozenset({"tied", "dense_lead"}),
        block=ATTN_QKVO + ATTN_NORM + (("attn_sinks.weight", "H", "F32", "bias", "True"),) + FFN_NORM + DENSE_FFN
        + ROUTER + EXPERTS + _when(PROBS_BIAS, "probs_bias")),
    # src/models/cohere2moe.cpp: attention and FFN in parallel from one norm (no ffn_norm), logit scale,
    # sliding-window blocks (3 of 4, full first), leading dense blocks, sigmoid, optional shared experts
    "cohere2moe": ArchTable(
        kv=KV_DENSE_LEAD + KV_GATING + (
            ("attention.sliding_window", "u32", "sliding_window"),
            ("logit_scale", "f32", "0.5"),
            ("expert_shared_count", "u32", "n_shared", "n_shared"),
            ("feed_forward_length", "u32", "Fd"),
        ),
        source="cohere2moe.cpp", flags={}, caps=frozenset({"tied", "dense_lead", "shared", "fused"}),
        block=ATTN_NORM + ATTN_QKVO + DENSE_FFN + ROUTER + EXPERTS + SHEXP_N),
    # src/models/phimoe.cpp: LayerNorm-style biases on every norm, attention output and output head
    "phimoe": ArchTable(
        kv=(), source="phimoe.cpp", flags={}, caps=frozenset(), output_required=True,
        top=(("output_norm.bias", "D", "F32", "bias", "True"), ("output.bias", "V", "F32", "bias", "True")),
        block=ATTN_NORM + (("attn_norm.bias", "D", "F32", "bias", "True"),) + ATTN_QKVO
        + (("attn_output.bias", "D", "F32", "bias", "True"),) + FFN_NORM
        + (("ffn_norm.bias", "D", "F32", "bias", "True"),) + ROUTER + EXPERTS),
    # src/models/grovemoe.cpp: q/k norms, and beside the routed experts n_expert / n_group "chunk" experts of
    # expert_chunk_feed_forward_length (one per group of routed experts; not paged: not ffn_*_exps)
    "grovemoe": ArchTable(
        kv=(("expert_chunk_feed_forward_length", "u32", "Fs"), ("expert_group_scale", "f32", "0.05"),
            ("experts_per_group", "u32", "2")),
        source="grovemoe.cpp", flags={}, caps=frozenset({"tied"}),
        block=ATTN_NORM + ATTN_QKVO + QK_NORM + FFN_NORM + ROUTER + EXPERTS + (
            ("ffn_gate_chexps.weight", "D, Fs, E // 2", "ot", "w", "moe"),
            ("ffn_down_chexps.weight", "Fs, D, E // 2", "ot", "w", "moe"),
            ("ffn_up_chexps.weight", "D, Fs, E // 2", "ot", "w", "moe"),
        )),
    # src/models/granite-hybrid.cpp: Mamba-2 blocks (head_count_kv 0) and attention blocks, every block with
    # ffn_norm and routed experts (n_ff wide) + an optional shared expert; mu-P scales
    "granitehybrid": ArchTable(
        kv=KV_MAMBA2 + (
            ("attention.head_count_kv", "u32s",
             "[Hkv if (il + 1) % full_attn_interval == 0 else 0 for il in range(n_layer)]"),
            ("logit_scale", "f32", "4.0"), ("residual_scale", "f32", "0.5"), ("embedding_scale", "f32", "2.0"),
            ("attention.scale", "f32", "1.0 / Dh"), ("expert_shared_feed_forward_length", "u32", "Fs", "n_shared"),
        ),
        source="granite-hybrid.cpp", flags={"recr": "(il + 1) % full_attn_interval != 0"},
        caps=frozenset({"tied", "shared"}),
        block=ATTN_NORM + _when(MAMBA2, "recr") + _when(ATTN_QKVO, "not recr") + FFN_NORM + ROUTER + EXPERTS
        + _when(SHEXP_FS, "n_shared")),
    # src/models/jamba.cpp: Mamba (1) blocks (head_count_kv 0) and attention blocks; blocks with a router are
    # MoE (experts n_ff wide), the others a dense FFN of n_ff; here attention every full_attn_interval-th
    # block and MoE every moe_layer_step-th
    "jamba": ArchTable(
        kv=(
            ("ssm.conv_kernel", "u32", "ssm_d_conv"),
            ("ssm.inner_size", "u32", "Di"),
            ("ssm.state_size", "u32", "ssm_d_state"),
            ("ssm.time_step_rank", "u32", "ssm_dt_rank"),
            ("attention.head_count_kv", "u32s",
             "[Hkv if (il + 1) % full_attn_interval == 0 else 0 for il in range(n_layer)]"),
        ),
        source="jamba.cpp", caps=frozenset({"tied"}),
        flags={"recr": "(il + 1) % full_attn_interval != 0", "moe": "(il + 1) % moe_layer_step == 0"},
        block=ATTN_NORM + _when((
            ("ssm_in.weight", "D, 2*Di", "ot", "w", "True"),
            ("ssm_conv1d.weight", "ssm_d_conv, Di", "F32", "w", "True"),
            ("ssm_conv1d.bias", "Di", "F32", "bias", "True"),
            ("ssm_x.weight", "Di, ssm_dt_rank + 2*ssm_d_state", "ot", "w", "True"),
            _norm("ssm_dt_norm.weight", "ssm_dt_rank"),
            ("ssm_dt.weight", "ssm_dt_rank, Di", "ot", "w", "True"),
            ("ssm_dt.bias", "Di", "F32", "bias", "True"),
            _norm("ssm_b_norm.weight", "ssm_d_state"),
            _norm("ssm_c_norm.weight", "ssm_d_state"),
            ("ssm_a", "ssm_d_state, Di", "F32", "neg", "True"),
            ("ssm_d", "Di", "F32", "bias", "True"),
            ("ssm_out.weight", "Di, D", "ot", "w", "True"),
        ), "recr") + _when(ATTN_QKVO, "not recr") + FFN_NORM + ROUTER + EXPERTS + (
            ("ffn_gate.weight", "D, F", "ot", "w", "dense"),
            ("ffn_down.weight", "F, D", "ot", "w", "dense"),
            ("ffn_up.weight", "D, F", "ot", "w", "dense"),
        )),
    # src/models/mistral3.cpp (with experts): experts n_ff wide (its shared-expert rows need an n_ff_shexp that
    # load_arch_hparams never reads, so there is none)
    "mistral3": ArchTable(
        kv=(), source="mistral3.cpp", flags={}, caps=frozenset({"tied"}),
        block=ATTN_NORM + ATTN_QKVO + FFN_NORM + ROUTER + EXPERTS),
    # src/models/minimax-01.cpp: lightning-attention (linear, recurrent) blocks with a fused attn_qkv, an output
    # gate and attn_norm_2, and softmax-attention blocks every full_attn_interval-th; experts n_ff wide
    "minimax-01": ArchTable(
        kv=(("residual_scale", "f32", "1.0"), ("full_attention_interval", "u32", "full_attn_interval")),
        source="minimax-01.cpp", flags={"recr": "(il + 1) % full_attn_interval != 0"}, caps=frozenset({"tied"}),
        block=ATTN_NORM + _when(ATTN_QKVO[:3], "not recr") + _when((
            _norm("attn_norm_2.weight", "H*Dh"),
            ("attn_qkv.weight", "D, 3*H*Dh", "ot", "w", "True"),
            ("attn_gate.weight", "D, H*Dh", "ot", "w", "True"),
        ), "recr") + ATTN_QKVO[3:] + FFN_NORM + ROUTER + EXPERTS),
    # src/models/hy-v3.cpp: q/k norms, sigmoid + selection bias (blk.N.exp_probs_b, no suffix), one shared
    # expert of n_ff_shexp, optional fused gate_up
    "hy_v3": ArchTable(
        kv=KV_GATING + KV_SHEXP_FF, source="hy-v3.cpp", flags={}, caps=frozenset({"tied", "fused"}),
        block=ATTN_NORM + ATTN_QKVO + QK_NORM + FFN_NORM + ROUTER + (("exp_probs_b", "E", "F32", "bias", "moe"),)
        + EXPERTS + SHEXP_FS),
    # src/models/maple.cpp: q/k norms, sliding-window blocks from a per-layer bool array, clamped SwiGLU experts
    "maple": ArchTable(
        kv=(
            ("attention.sliding_window_pattern", "bools", "[(il + 1) % 4 != 0 for il in range(n_layer)]"),
            ("attention.sliding_window", "u32", "sliding_window"),
            ("swiglu_clamp_exp", "f32", "7.0"),
        ),
        source="maple.cpp", flags={}, caps=frozenset({"tied"}),
        block=ATTN_NORM + ATTN_QKVO + QK_NORM + FFN_NORM + ROUTER + EXPERTS),
    # src/models/mellum.cpp: q/k norms, optional sliding-window blocks (3 of 4)
    "mellum": ArchTable(
        kv=(("attention.sliding_window", "u32", "sliding_window", "sliding_window"),), source="mellum.cpp",
        flags={}, caps=frozenset({"tied"}),
        block=ATTN_NORM + ATTN_QKVO + QK_NORM + FFN_NORM + ROUTER + EXPERTS),
    # src/models/step35.cpp: q/k norms, a per-head attention gate, sliding-window blocks from a per-layer bool
    # array, blocks with a router MoE (sigmoid + exp_probs_b, a shared expert of n_ff_shexp), rotary over half
    # of rope.dimension_count
    "step35": ArchTable(
        kv=KV_GATING + KV_SHEXP_FF + (
            ("attention.sliding_window_pattern", "bools", "[(il + 1) % 4 != 0 for il in range(n_layer)]"),
            ("attention.sliding_window", "u32", "sliding_window"),
            ("feed_forward_length", "u32", "Fd"),
        ),
        source="step35.cpp", flags={}, caps=frozenset({"tied", "dense_lead"}),
        block=ATTN_NORM + QK_NORM + ATTN_QKVO + (("attn_gate.weight", "D, H", "ot", "w", "True"),) + FFN_NORM
        + DENSE_FFN + ROUTER + EXPERTS + PROBS_BIAS + SHEXP_FS),
    # src/models/kimi-linear.cpp: Kimi-Delta-Attention (recurrent) blocks (head_count_kv 0: q/k/v short
    # convolutions, decay and gate low-rank projections) and MLA attention blocks (one KV head of
    # kv_lora_rank + rope dims, as deepseek2), leading dense blocks, gating from the file + exp_probs_b,
    # n_shared shared experts; KDA head dim = head_dim
    "kimi-linear": ArchTable(
        kv=KV_DENSE_LEAD + KV_SHARED + KV_GATING + KV_MLA + (
            ("attention.head_count_kv", "u32s",
             "[1 if (il + 1) % full_attn_interval == 0 else 0 for il in range(n_layer)]"),
            ("attention.q_lora_rank", "u32", None),
            ("ssm.conv_kernel", "u32", "ssm_d_conv"),
            ("kda.head_dim", "u32", "Dh"),
        ),
        source="kimi-linear.cpp", flags={"recr": "(il + 1) % full_attn_interval != 0"},
        caps=frozenset({"tied", "dense_lead", "shared"}),
        block=ATTN_NORM + _when((
            ("ssm_conv1d_q.weight", "ssm_d_conv, 1, Dh*H", "F32", "w", "True"),
            ("ssm_conv1d_k.weight", "ssm_d_conv, 1, Dh*H", "F32", "w", "True"),
            ("ssm_conv1d_v.weight", "ssm_d_conv, 1, Dh*H", "F32", "w", "True"),
            ("attn_q.weight", "D, Dh*H", "ot", "w", "True"),
            ("attn_k.weight", "D, Dh*H", "ot", "w", "True"),
            ("attn_v.weight", "D, Dh*H", "ot", "w", "True"),
            ("ssm_f_a.weight", "D, Dh", "ot", "w", "True"),
            ("ssm_f_b.weight", "Dh, Dh*H", "ot", "w", "True"),
            ("ssm_beta.weight", "D, H", "ot", "w", "True"),
            ("ssm_a", "1, H", "F32", "neg", "True"),
            ("ssm_dt.bias", "Dh*H", "F32", "bias", "True"),
            ("ssm_g_a.weight", "D, Dh", "ot", "w", "True"),
            ("ssm_g_b.weight", "Dh, Dh*H", "ot", "w", "True"),
            _norm("ssm_norm.weight", "Dh"),
            ("attn_output.weight", "Dh*H, D", "ot", "w", "True"),
        ), "recr") + _when((
            _norm("attn_kv_a_norm.weight", "kv_lora_rank"),
            ("attn_q.weight", "D, H*(qk_nope+qk_rope)", "ot", "w", "True"),
            ("attn_kv_a_mqa.weight", "D, kv_lora_rank + qk_rope", "ot", "w", "True"),
            ("attn_k_b.weight", "qk_nope, kv_lora_rank, H", "ot", "w", "True"),
            ("attn_v_b.weight", "kv_lora_rank, v_head_dim, H", "ot", "w", "True"),
            ("attn_output.weight", "H*v_head_dim, D", "ot", "w", "True"),
        ), "not recr") + FFN_NORM + DENSE_FFN + ROUTER + EXPERTS + SHEXP_N + PROBS_BIAS),
    # src/models/llada-moe.cpp: diffusion LM (non-causal attention set in load_arch_hparams), q/k norms, experts
    "llada-moe": ArchTable(
        kv=(), source="llada-moe.cpp", flags={}, caps=frozenset({"tied"}),
        block=ATTN_NORM + ATTN_QKVO + QK_NORM + FFN_NORM + ROUTER + EXPERTS),
    # src/models/rnd1.cpp: diffusion LM (non-causal attention set in load_arch_hparams), q/k norms, experts
    "rnd1": ArchTable(
        kv=(), source="rnd1.cpp", flags={}, caps=frozenset({"tied"}),
        block=ATTN_NORM + ATTN_QKVO + QK_NORM + FFN_NORM + ROUTER + EXPERTS),
    # src/models/deepseek32.cpp: deepseek2's MLA (q LoRA required) plus a sparse-attention indexer per block
    # (indexer.*: its own q from the q latent, k, per-head weights), gating from the file
    "deepseek32": ArchTable(
        kv=KV_DENSE_LEAD + KV_SHARED + KV_GATING + KV_MLA + (
            ("attention.indexer.head_count", "u32", "indexer_n_head"),
            ("attention.indexer.key_length", "u32", "indexer_head_size"),
            ("attention.indexer.top_k", "u32", "indexer_top_k"),
        ),
        source="deepseek32.cpp", flags={}, caps=frozenset({"dense_lead", "shared", "tied", "groups"}),
        block=ATTN_NORM + MLA + FFN_NORM + (
            _norm("indexer.k_norm.weight", "indexer_head_size"),
            ("indexer.k_norm.bias", "indexer_head_size", "F32", "bias", "True"),
            ("indexer.proj.weight", "D, indexer_n_head", "ot", "w", "True"),
            ("indexer.attn_k.weight", "D, indexer_head_size", "ot", "w", "True"),
            ("indexer.attn_q_b.weight", "q_lora_rank, indexer_n_head*indexer_head_size", "ot", "w", "True"),
        ) + DENSE_FFN + ROUTER + _when(PROBS_BIAS, "probs_bias") + EXPERTS + SHEXP_N),
    # src/models/granite-swa.cpp: attention sinks, sliding-window blocks from a per-layer bool array, mu-P scales,
    # experts n_ff wide (optional fused gate_up), an optional shared expert with gate and up fused in ffn_up_shexp
    "granite_swa": ArchTable(
        kv=(
            ("attention.sliding_window_pattern", "bools", "[(il + 1) % 4 != 0 for il in range(n_layer)]"),
            ("attention.sliding_window", "u32", "sliding_window"),
            ("logit_scale", "f32", "4.0"), ("residual_scale", "f32", "0.5"), ("embedding_scale", "f32", "2.0"),
            ("attention.scale", "f32", "1.0 / Dh"), ("expert_shared_feed_forward_length", "u32", "Fs", "n_shared"),
        ),
        source="granite-swa.cpp", flags={}, caps=frozenset({"tied", "shared", "fused"}),
        block=ATTN_NORM + ATTN_QKVO + (("attn_sinks.weight", "H", "F32", "bias", "True"),) + FFN_NORM + ROUTER
        + EXPERTS + (
            ("ffn_up_shexp.weight", "D, 2*Fs", "ot", "w", "n_shared"),
            ("ffn_down_shexp.weight", "Fs, D", "ot", "w", "n_shared"),
        )),
    # src/models/bailingmoe3.cpp: Kimi-Delta-Attention (recurrent) blocks (head_count_kv 0; full-rank decay
    # and gate projections, a bounded gate) and MLA attention blocks with a per-head output gate, leading dense
    # blocks, sigmoid + exp_probs_b, a shared expert of n_ff_shexp; KDA head dim = head_dim
    "bailingmoe3": ArchTable(
        kv=KV_DENSE_LEAD + KV_SHARED + KV_GATING + KV_SHEXP_FF + KV_MLA + (
            ("attention.head_count_kv", "u32s",
             "[1 if (il + 1) % full_attn_interval == 0 else 0 for il in range(n_layer)]"),
            ("attention.q_lora_rank", "u32", "0"),
            ("ssm.conv_kernel", "u32", "ssm_d_conv"),
            ("kda.head_dim", "u32", "Dh"),
            ("kda.gate_lower_bound", "f32", "-5.0"),
        ),
        source="bailingmoe3.cpp", flags={"recr": "(il + 1) % full_attn_interval != 0"},
        caps=frozenset({"tied", "dense_lead", "shared"}),
        block=ATTN_NORM + _when((
            ("ssm_conv1d_q.weight", "ssm_d_conv, 1, Dh*H, 1", "F32", "w", "True"),
            ("ssm_conv1d_k.weight", "ssm_d_conv, 1, Dh*H, 1", "F32", "w", "True"),
            ("ssm_conv1d_v.weight", "ssm_d_conv, 1, Dh*H, 1", "F32", "w", "True"),
            ("attn_q.weight", "D, Dh*H", "ot", "w", "True"),
            ("attn_k.weight", "D, Dh*H", "ot", "w", "True"),
            ("attn_v.weight", "D, Dh*H", "ot", "w", "True"),
            ("ssm_f_a.weight", "D, Dh*H", "ot", "w", "True"),
            ("ssm_beta.weight", "D, H", "ot", "w", "True"),
            ("ssm_a", "1, H", "F32", "neg", "True"),
            ("ssm_dt.bias", "Dh*H", "F32", "bias", "True"),
            ("ssm_g_a.weight", "D, Dh*H", "ot", "w", "True"),
            _norm("ssm_norm.weight", "Dh"),
            ("attn_output.weight", "Dh*H, D", "ot", "w", "True"),
        ), "recr") + _when((
            ("attn_q.weight", "D, H*(qk_nope+qk_rope)", "ot", "w", "True"),
            ("attn_kv_a_mqa.weight", "D, kv_lora_rank + qk_rope", "ot", "w", "True"),
            _norm("attn_kv_a_norm.weight", "kv_lora_rank"),
            ("attn_k_b.weight", "qk_nope, kv_lora_rank, H", "ot", "w", "True"),
            ("attn_v_b.weight", "kv_lora_rank, v_head_dim, H", "ot", "w", "True"),
            ("attn_gate.weight", "D, H", "ot", "w", "True"),
            ("attn_output.weight", "H*v_head_dim, D", "ot", "w", "True"),
        ), "not recr") + FFN_NORM + DENSE_FFN + ROUTER + PROBS_BIAS + EXPERTS + SHEXP_FS),
    # src/models/minimax-m3.cpp: q/k norms, leading dense blocks, sigmoid + exp_probs_b, n_shared shared experts
    # of n_ff_exp, and in MoE blocks a block-sparse-attention indexer (indexer.q_proj / k_proj / norms; the sparse
    # path runs with flash attention only)
    "minimax-m3": ArchTable(
        kv=KV_DENSE_LEAD + KV_SHARED + KV_GATING + (
            ("attention.indexer.head_count", "u32", "indexer_n_head"),
            ("attention.indexer.key_length", "u32", "indexer_head_size"),
            ("attention.indexer.top_k", "u32", "indexer_top_k"),
            ("attention.indexer.block_size", "u32", "16"),
            ("attention.indexer.local_blocks", "u32", "1"),
        ),
        source="minimax-m3.cpp", flags={}, caps=frozenset({"dense_lead", "shared"}), output_required=True,
        block=ATTN_QKVO + ATTN_NORM + QK_NORM + FFN_NORM + DENSE_FFN + ROUTER + PROBS_BIAS + EXPERTS + SHEXP_N + (
            ("indexer.q_proj.weight", "D, indexer_n_head*indexer_head_size", "ot", "w", "moe"),
            ("indexer.k_proj.weight", "D, indexer_head_size", "ot", "w", "moe"),
            _norm("indexer.q_norm.weight", "indexer_head_size", "moe"),
            _norm("indexer.k_norm.weight", "indexer_head_size", "moe"),
        )),
}

# src/models/glm-dsa.cpp (GLM-5): deepseek32's tensors and keys (sigmoid the default gating; every indexer full
# below a 1M training context)
ARCH_TABLES["glm-dsa"] = replace(ARCH_TABLES["deepseek32"], source="glm-dsa.cpp")
ARCHS = tuple(ARCH_TABLES)

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
    # Qwen3.5/3.6-MoE-style: blocks 0-2 Gated-DeltaNet, block 3 full attention (interval 4), 16 experts
    # top-3 + a gated shared expert, one MTP block with its own experts, partial rotary (8 of 16 dims)
    # in sections 2+1+1; F16 experts of 64 neurons (8 KiB slices: slot addressing applies)
    "qwen35moe": dict(n_layer=4, n_nextn=1, n_expert=16, n_expert_used=3, weights_norm=True, n_rot=8,
                      rope_sections=(2, 1, 1, 0), n_ff_exp=64, expert_types=("F16", "F16", "F16")),
    # Qwen3-Next-style: blocks 0-2 Gated-DeltaNet, block 3 full attention, 16 experts top-3 + a gated shared
    # expert; BF16 experts of 64 neurons
    "qwen3next": dict(n_layer=4, n_expert=16, n_expert_used=3, weights_norm=True, n_ff_exp=64,
                      expert_types=("BF16", "BF16", "BF16")),
    # LFM2-8B-A1B-style: block 0 dense, blocks 0-2 short convolution, block 3 attention, sigmoid + bias
    # top-3 normalised; F16 experts
    "lfm2moe": dict(n_layer=4, n_dense_lead=1, n_expert=16, n_expert_used=3, gating="sigmoid", weights_norm=True,
                    ssm_d_conv=3, n_ff_exp=64, expert_types=("F16", "F16", "F16")),
    # Nemotron-3-Nano-style: blocks 0/3 Mamba-2, 1/4 attention, 2/5 MoE (16 experts top-3 normalised, a
    # shared expert); F16 experts
    "nemotron_h_moe": dict(n_layer=6, gate_exps=False, n_expert=16, n_expert_used=3, weights_norm=True, n_ff_exp=64,
                           expert_types=("F16", "F16", "F16")),
    # Gemma-4-26B-A4B-style: blocks 0-2 sliding-window (8 tokens), block 3 full attention; a dense FFN and
    # 16 experts top-3 in every block; F16 experts
    "gemma4": dict(n_layer=4, n_expert=16, n_expert_used=3, sliding_window=8, n_ff_exp=64,
                   expert_types=("F16", "F16", "F16")),
    # Qwen3-VL-30B-A3B-style (text only): sections 3+3+2; F16 gate/up, BF16 down
    "qwen3vlmoe": dict(n_layer=3, weights_norm=True, rope_sections=(3, 3, 2, 0), n_ff_exp=64,
                       expert_types=("F16", "F16", "BF16")),
    # SmallThinker-21B-A3B-style: sigmoid router, top-2 normalised; Q8_0 experts
    "smallthinker": dict(n_layer=3, gating="sigmoid", weights_norm=True),
    # DBRX-style: 16 experts top-4; Q8_0 gate/up, F16 down
    "dbrx": dict(n_layer=3, n_expert=16, n_expert_used=4, expert_types=("Q8_0", "Q8_0", "F16")),
    # Grok-1-style: 8 experts top-2; BF16 experts
    "grok": dict(n_layer=3, n_ff_exp=64, expert_types=("BF16", "BF16", "BF16")),
    # Snowflake-Arctic-style: a dense residual FFN beside 8 experts top-2; F16 experts
    "arctic": dict(n_layer=3, n_ff_exp=64, expert_types=("F16", "F16", "F16")),
    # Ling-lite-style: 2 shared experts, top-2 normalised; Q8_0 experts
    "bailingmoe": dict(n_layer=3, n_shared=2, weights_norm=True),
    # EXAONE-MoE-style: block 0 dense, sigmoid + bias, top-3 normalised and scaled, sliding window 8;
    # BF16 experts
    "exaone-moe": dict(n_layer=4, n_dense_lead=1, n_expert=16, n_expert_used=3, gating="sigmoid", probs_bias=True,
                       weights_norm=True, weights_scale=2.5, sliding_window=8, n_ff_exp=64,
                       expert_types=("BF16", "BF16", "BF16")),
    # AFMoE (Trinity)-style: block 0 dense, sigmoid + bias, 1 shared expert, top-3 normalised and scaled;
    # F16 experts
    "afmoe": dict(n_layer=3, n_dense_lead=1, n_shared=1, n_expert=16, n_expert_used=3, gating="sigmoid",
                  weights_norm=True, weights_scale=2.5, sliding_window=8, n_ff_exp=64,
                  expert_types=("F16", "F16", "F16")),
    # MiMo-V2-Flash-style: block 0 dense, sliding window 8 on 3 of 4 blocks, sigmoid + bias top-3
    # normalised; F16 experts
    "mimo2": dict(n_layer=4, n_dense_lead=1, n_expert=16, n_expert_used=3, gating="sigmoid", probs_bias=True,
                  weights_norm=True, sliding_window=8, n_ff_exp=64, expert_types=("F16", "F16", "F16")),
    # Command-A-MoE-style: block 0 dense, parallel attention and FFN, sliding window 8, sigmoid top-3
    # normalised, 1 shared expert; BF16 experts
    "cohere2moe": dict(n_layer=4, n_dense_lead=1, n_shared=1, n_expert=16, n_expert_used=3, gating="sigmoid",
                       weights_norm=True, sliding_window=8, n_ff_exp=64, expert_types=("BF16", "BF16", "BF16")),
    # Phi-3.5-MoE-style: 16 experts top-2, biased norms; Q8_0 gate/up, F16 down
    "phimoe": dict(n_layer=3, n_expert=16, expert_types=("Q8_0", "Q8_0", "F16")),
    # GroveMoE-style: 8 experts top-2 in groups of 2 with 4 chunk experts of 32; F16 experts
    "grovemoe": dict(n_layer=3, weights_norm=True, n_ff_exp=64, n_ff_shexp=32, expert_types=("F16", "F16", "F16")),
    # Granite-4.0-H-style: blocks 0-2 Mamba-2 (8 heads, inner 128 = 2 x n_embd), block 3 attention, every
    # block 8 experts top-2 + a shared expert; BF16 experts
    "granitehybrid": dict(n_layer=4, n_shared=1, ssm_dt_rank=8, ssm_d_inner=128, n_ff_exp=64,
                          expert_types=("BF16", "BF16", "BF16")),
    # Jamba-style: blocks 0-2 Mamba (inner 128 = 2 x n_embd, state 16, dt rank 4), block 3 attention; blocks
    # 1 and 3 MoE (8 experts top-2), 0 and 2 dense; F16 experts
    "jamba": dict(n_layer=4, moe_layer_step=2, ssm_d_inner=128, n_ff_exp=64, expert_types=("F16", "F16", "F16")),
    # Mistral-3-MoE-style: 8 experts top-2; BF16 experts
    "mistral3": dict(n_layer=3, weights_norm=True, n_ff_exp=64, expert_types=("BF16", "BF16", "BF16")),
    # MiniMax-Text-01-style: blocks 0-2 lightning attention, block 3 softmax attention; 8 experts top-2;
    # F16 experts
    "minimax-01": dict(n_layer=4, weights_norm=True, n_ff_exp=64, expert_types=("F16", "F16", "F16")),
    # Hunyuan-v3-style: sigmoid + bias top-3 normalised, a shared expert; Q8_0 experts
    "hy_v3": dict(n_layer=3, n_expert=16, n_expert_used=3, gating="sigmoid", weights_norm=True),
    # Maple-style: sliding window 8 on 3 of 4 blocks; BF16 experts
    "maple": dict(n_layer=4, sliding_window=8, weights_norm=True, n_ff_exp=64, expert_types=("BF16", "BF16", "BF16")),
    # Mellum-style: sliding window 8 on 3 of 4 blocks; F16 experts
    "mellum": dict(n_layer=4, sliding_window=8, weights_norm=True, n_ff_exp=64, expert_types=("F16", "F16", "F16")),
    # Step-3.5-Flash-style: block 0 dense, sliding window 8 on 3 of 4 blocks, sigmoid + bias top-3
    # normalised, a shared expert; F16 experts
    "step35": dict(n_layer=4, n_dense_lead=1, n_expert=16, n_expert_used=3, gating="sigmoid", weights_norm=True,
                   sliding_window=8, n_ff_exp=64, expert_types=("F16", "F16", "F16")),
    # Kimi-Linear-style: block 0 dense, blocks 0-2 KDA, block 3 MLA attention, sigmoid + bias top-3
    # normalised and scaled, a shared expert; F16 experts
    "kimi-linear": dict(n_layer=4, n_dense_lead=1, n_shared=1, n_expert=16, n_expert_used=3, gating="sigmoid",
                        weights_norm=True, weights_scale=2.5, ssm_d_conv=4, n_ff_exp=64,
                        expert_types=("F16", "F16", "F16")),
    # LLaDA-MoE / RND1-style diffusion LMs: 8 experts top-2; F16 experts (epqlab.inspect refuses them)
    "llada-moe": dict(n_layer=3, n_head_kv=4, weights_norm=True, n_ff_exp=64, expert_types=("F16", "F16", "F16")),
    "rnd1": dict(n_layer=3, weights_norm=True, n_ff_exp=64, expert_types=("F16", "F16", "F16")),
    # DeepSeek-V3.2-style: MLA + indexer (4 heads of 64, top-16 keys), block 0 dense, 1 shared expert,
    # sigmoid + bias top-3 normalised and scaled; Q8_0 experts
    "deepseek32": dict(n_layer=3, n_dense_lead=1, n_shared=1, n_expert=16, n_expert_used=3, gating="sigmoid",
                       probs_bias=True, weights_norm=True, weights_scale=2.5),
    # GLM-5-style: as deepseek32's; BF16 experts
    "glm-dsa": dict(n_layer=3, n_dense_lead=1, n_shared=1, n_expert=16, n_expert_used=3, gating="sigmoid",
                    probs_bias=True, weights_norm=True, weights_scale=2.5, n_ff_exp=64,
                    expert_types=("BF16", "BF16", "BF16")),
    # Granite-SWA-style: sliding window 8 on 3 of 4 blocks, attention sinks, 8 experts top-2 + a shared
    # expert; F16 experts
    "granite_swa": dict(n_layer=4, n_shared=1, sliding_window=8, n_ff_exp=64, expert_types=("F16", "F16", "F16")),
    # Ling-3-style: block 0 dense, blocks 0-2 KDA, block 3 MLA attention, sigmoid + bias top-3 normalised
    # and scaled, a shared expert; BF16 experts
    "bailingmoe3": dict(n_layer=4, n_dense_lead=1, n_shared=1, n_expert=16, n_expert_used=3, gating="sigmoid",
                        weights_norm=True, weights_scale=2.5, n_ff_exp=64, expert_types=("BF16", "BF16", "BF16")),
    # MiniMax-M3-style: block 0 dense, sigmoid + bias top-3 normalised, a shared expert, indexer 2 x 64 (one
    # head per KV head: loader_checks);
    # F16 experts
    "minimax-m3": dict(n_layer=3, n_dense_lead=1, n_shared=1, n_expert=16, n_expert_used=3, gating="sigmoid",
                       indexer_n_head=2, weights_norm=True, n_ff_exp=64, expert_types=("F16", "F16", "F16")),
    # Laguna-style: block 0 dense, sigmoid + selection bias, top-3 normalised and scaled by 2.5,
    # blocks 0 and 4 full attention, 1-3 sliding-window (8 tokens); F16 experts, the last block's BF16
    # (two types of one slice size, 8 KiB: slot addressing applies)
    "laguna": dict(n_layer=5, n_dense_lead=1, n_expert=16, n_expert_used=3, gating="sigmoid", weights_norm=True,
                   weights_scale=2.5, sliding_window=8, n_ff_exp=64, expert_types=("F16", "F16", "F16"),
                   late_expert_types=("BF16", "BF16", "BF16"), n_late_layers=1),
    # OLMoE: 8 experts top-2, q/k norms; BF16 experts
    "olmoe": dict(n_layer=3, n_head_kv=4, n_ff_exp=64, expert_types=("BF16", "BF16", "BF16")),
    # Granite-MoE with a shared expert: mu-P scales; F16 experts
    "granitemoe": dict(n_layer=3, n_shared=1, n_ff_exp=64, expert_types=("F16", "F16", "F16")),
    # ERNIE-4.5-MoE: block 0 dense, selection bias, one shared expert; Q8_0 experts
    "ernie4_5-moe": dict(n_layer=3, n_dense_lead=1, probs_bias=True, weights_norm=True),
    # Hunyuan-A13B-style: q/k norms, one shared expert; F16 gate/up, Q8_0 down
    "hunyuan-moe": dict(n_layer=3, weights_norm=True, expert_types=("F16", "F16", "Q8_0")),
    # GLM-4.5-style: block 0 dense, q/k/v biases, sigmoid + bias, 1 shared expert, top-3 normalised and
    # scaled, one MTP block; F32 experts
    "glm4moe": dict(n_layer=3, n_dense_lead=1, n_shared=1, n_expert=16, n_expert_used=3, attn_bias=True,
                    gating="sigmoid", weights_norm=True, weights_scale=2.5, n_nextn=1, n_ff_exp=32,
                    expert_types=("F32", "F32", "F32")),
    # MiniMax-M2-style: sigmoid + bias, top-3 normalised; F16 experts
    "minimax-m2": dict(n_layer=3, n_expert=16, n_expert_used=3, gating="sigmoid", weights_norm=True, n_ff_exp=64,
                       expert_types=("F16", "F16", "F16")),
    # Llama-4-style: blocks 1 and 3 MoE (step 2, top-1 + shared expert), 0 and 2 dense; BF16 experts
    "llama4": dict(n_layer=4, moe_layer_step=2, n_expert_used=1, n_ff_exp=64, expert_types=("BF16", "BF16", "BF16")),
    # Ling-2.0-style: block 0 dense, sigmoid + bias, 1 shared expert, top-3 normalised and scaled, one MTP block;
    # F16 experts
    "bailingmoe2": dict(n_layer=3, n_dense_lead=1, n_shared=1, n_expert=16, n_expert_used=3, gating="sigmoid",
                        probs_bias=True, weights_norm=True, weights_scale=2.5, n_nextn=1, n_ff_exp=64,
                        expert_types=("F16", "F16", "F16")),
}
