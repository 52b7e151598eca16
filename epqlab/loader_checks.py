"""What a GGUF file may say that aborts the process inside llama.cpp, refused before llama.cpp sees it.

llama.cpp (the copy vendored by llama-cpp-python 0.3.36) checks much of a file with C++ exceptions,
which epqlab turns into :class:`~epqlab.errors.LlamaCppError`; but some values reach a
``GGML_ASSERT`` / ``GGML_ABORT`` (SIGABRT, the whole process dies) or a computation that
segfaults. :func:`epqlab.inspect` calls the checks here, so a file that would kill the process
raises :class:`~epqlab.errors.NotGGUFError` naming the key or tensor first. Each check names the
llama.cpp code it stands in front of; tests/test_loader_checks.py has one file per case, and
bench/fuzz_loader.py fuzzes the header to find the cases not listed yet.
"""
from __future__ import annotations

import re
from pathlib import Path

from .errors import NotGGUFError, UnsupportedArchError

LLAMA_MAX_LAYERS = 512  # llama.cpp's src/llama-hparams.h
LLAMA_MAX_EXPERTS = 1024

# llama_rope_scaling_type_from_string (src/llama-model.cpp): any other name is UNSPECIFIED, which
# load_hparams asserts against
ROPE_SCALING_TYPES = ("none", "linear", "yarn", "longrope")

# architectures whose graph asserts n_embd_head_k == n_embd_head_v == n_rot (src/models/<arch>.cpp:
# GGML_ASSERT(n_embd_head == hparams.n_embd_head_k()); GGML_ASSERT(n_embd_head == n_rot))
ROPE_FULL_HEAD_ARCHS = frozenset({"llama", "deepseek", "dots1", "olmoe", "qwen2moe", "qwen3moe"})

# ggml types that no llama.cpp graph computes with as a weight: integers, F64, and Q8_1 / Q8_K (the
# quantized activations the K-quant and Q4_1/Q5_1 dot products pair with; ggml-cpu has no vec_dot with
# them as the weight): a weight of such a type meets a CPU kernel with no dot product or binary op for
# it (SIGSEGV or GGML_ABORT in ggml-cpu)
NON_WEIGHT_TYPES = frozenset({"I8", "I16", "I32", "I64", "F64", "Q8_1", "Q8_K"})
WEIGHT_NAME_RE = re.compile(r"^(token_embd|output|output_norm|blk\.\d+\.(attn_|ffn_|exp_probs_b|post_|layer_output|nextn\.))")

# llama_vocab::impl::load (src/llama-vocab.cpp): default special token ids per tokenizer.ggml.model, and
# whether tokenize(add_special=true) adds BOS / EOS (SPM adds BOS; BPE adds BOS for the llama3-style
# pre-tokenizers; WPM always adds BOS and SEP)
_VOCAB_DEFAULTS = {  # model: (type, bos, eos, sep)
    "llama": ("SPM", 1, 2, None), "bert": ("WPM", 101, None, 102), "gpt2": ("BPE", 11, 11, None),
    "hybriddna": ("BPE", 11, 11, None), "whitespace": ("BPE", 11, 11, None), "t5": ("UGM", None, 1, None),
    "rwkv": ("RWKV", None, None, None), "plamo2": ("PLAMO2", 1, 2, None), "gemma4": ("BPE", None, None, None),
}
_BOS_PRE = frozenset({"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
                      "jina-v5-nano"})
_NO_BOS_PRE = frozenset({"glm4", "chatglm-bpe"})


def _bad(path: Path, what: str, value, need: str) -> NotGGUFError:
    return NotGGUFError(f"{path}: {what} is {value}, but llama.cpp needs {need} (it would abort the process loading "
                        "or running it): the file is corrupt or mis-converted; re-convert it.")


def check_hparams(path: Path, arch: str, hp, n_expert_kv: int, n_expert_used: int, n_expert: int) -> None:
    """Refuse what llama.cpp's ``llama_model::load_hparams`` asserts on: block_count in
    1..LLAMA_MAX_LAYERS, nextn_predict_layers <= block_count, expert_count <= LLAMA_MAX_EXPERTS,
    top-k in 1..expert_count for a MoE (every entry of a per-layer array) and 0 without experts,
    expert groups that divide the experts with 0 < groups used < groups.
    ``hp(key, default=0, low=False)`` reads ``<arch>.<key>`` as an int (the max of a per-layer array,
    or its min with ``low=True``). Raises NotGGUFError naming the key."""
    def bad(key, value, need):
        raise _bad(path, f"{arch}.{key}", value, need)

    n_layer = hp("block_count")
    if not 1 <= n_layer <= LLAMA_MAX_LAYERS:
        bad("block_count", n_layer if n_layer else "missing or 0", f"1..{LLAMA_MAX_LAYERS}")
    if hp("nextn_predict_layers") > n_layer:
        bad("nextn_predict_layers", hp("nextn_predict_layers"), f"<= block_count ({n_layer})")
    n_exp = n_expert or n_expert_kv
    if n_exp > LLAMA_MAX_EXPERTS:
        bad("expert_count", n_exp, f"at most {LLAMA_MAX_EXPERTS}")
    if n_exp > 0 and not 1 <= n_expert_used <= n_exp:
        bad("expert_used_count", n_expert_used if n_expert_used else "missing or 0", f"1..{n_exp} (expert_count)")
    # a per-layer array is checked element by element: its largest value passing above says nothing of a 0
    # or a negative one (llama.cpp segfaults on 0 and asserts n_expert_used_max <= n_expert on -1)
    for key, lo, hi in (("expert_used_count", 1, n_exp), ("expert_count", 0, LLAMA_MAX_EXPERTS)):
        least = hp(key, 1, low=True)
        if n_exp > 0 and least < lo:
            bad(key, f"{least} in its per-layer array", f"every layer's value in {lo}..{hi}")
    if n_expert_kv == 0 and n_expert_used:
        # llama.cpp reads n_expert from expert_count alone (not from the tensors) and asserts
        # n_expert_used_max <= n_expert
        bad("expert_count", "missing or 0" + (" (its expert tensors have %d experts)" % n_expert if n_expert else ""),
            f">= expert_used_count ({n_expert_used})")
    groups, used = hp("expert_group_count"), hp("expert_group_used_count")
    if groups and (groups >= max(1, n_exp) or (groups > 1 and (n_exp % groups or not 0 < used < groups))):
        bad("expert_group_count", f"{groups} (groups used {used}, experts {n_exp})",
            "fewer groups than experts, dividing them, and 0 < groups used < groups")


GATING_FUNCS = (0, 1, 2, 3)  # llama_expert_gating_func_type: none (the architecture's default), softmax, sigmoid, softmax_weight
# load_arch_hparams turns 0 (none) into the architecture's default (softmax for deepseek2, sigmoid for the others:
# "if (hparams.expert_gating_func == LLAMA_EXPERT_GATING_FUNC_TYPE_NONE)" in src/models/<arch>.cpp)
GATING_NONE_OK_ARCHS = frozenset({"deepseek2", "deepseek2-ocr", "afmoe", "cohere2moe", "glm-dsa", "glm4moe", "glm5-next",
                                  "hy_v3", "laguna", "step35"})
# the key is optional and build_moe_ffn gets hparams.expert_gating_func unchanged: missing is 0, the abort
# (dots1.cpp, minimax-m2.cpp, smallthinker.cpp; SIGABRT in llama-graph.cpp when the key was dropped)
GATING_FROM_FILE_ARCHS = frozenset({"dots1", "minimax-m2", "smallthinker"})


# architectures whose graph always builds the sliding-window KV input (build_attn_inp_kv_iswa) although
# load_arch_hparams makes the window optional (src/models/afmoe.cpp): without attention.sliding_window > 0 the
# context holds a plain KV cache and building the first graph reads it as the SWA one (SIGSEGV in
# llama_kv_cache_context::build_input_k_idxs)
SWA_REQUIRED_ARCHS = frozenset({"afmoe"})


# DeepSeek-sparse-attention archs whose lightning indexer multiplies its q and k by the KV cache's Hadamard
# rotation (deepseek32.cpp, glm-dsa.cpp, dots3note.cpp: ggml_mul_mat(self_k_rot_lid, indexer_q)); that rotation is
# the largest power of two (>= 64) dividing the indexer head (llama_kv_cache::build_input_k_rot), so any other
# attention.indexer.key_length fails ggml.c's GGML_ASSERT(ggml_can_mul_mat(a, b)) on the first graph
DSA_INDEXER_ARCHS = frozenset({"deepseek32", "glm-dsa", "dots3note"})

# block-sparse attention (src/models/minimax-m3.cpp) scores blocks with one indexer head per KV head:
# GGML_ASSERT(HKV == Hd && "MSA: one indexer head per GQA group") aborts on any other attention.indexer.head_count
MSA_ARCHS = frozenset({"minimax-m3"})

# MLA hybrids: recurrent blocks marked by head_count_kv 0, MLA attention blocks by 1
MLA_HYBRID_ARCHS = frozenset({"kimi-linear", "bailingmoe3"})


def check_graph_keys(path: Path, arch: str, value) -> None:
    """Refuse graph switches llama.cpp aborts on: an ``expert_gating_func`` outside
    :data:`GATING_FUNCS`, or 0 outside :data:`GATING_NONE_OK_ARCHS` (build_moe_ffn's ``switch`` ends in
    ``GGML_ABORT("fatal error")`` on the first decode), and ``attention.causal`` false (a non-causal, embedding model: llama_decode asserts
    ``n_ubatch >= n_tokens`` for any batch larger than a ubatch; epqlab runs generative models), and a missing
    or 0 ``attention.sliding_window`` in :data:`SWA_REQUIRED_ARCHS`, an ``attention.indexer.key_length`` other
    than a power of two >= 64 in :data:`DSA_INDEXER_ARCHS`, an ``attention.indexer.head_count`` other than
    ``head_count_kv`` in :data:`MSA_ARCHS`.
    ``value(key)`` reads ``<arch>.<key>`` raw. Raises NotGGUFError."""
    g = value("expert_gating_func")
    # 0 (none) is replaced by the architecture's default only where load_arch_hparams does it
    # (GATING_NONE_OK_ARCHS); elsewhere (dots1) it reaches the same abort
    allowed = GATING_FUNCS if arch in GATING_NONE_OK_ARCHS else GATING_FUNCS[1:]
    if g is None and arch in GATING_FROM_FILE_ARCHS:
        g = "missing (0)"  # dots1's graph takes the file's gating function as is: missing is 0
    if g is not None and (isinstance(g, bool) or not isinstance(g, int) or g not in allowed):
        raise _bad(path, f"{arch}.expert_gating_func", g, ("0 (default), " if 0 in allowed else "")
                   + "1 (softmax), 2 (sigmoid) or 3 (softmax_weight)")
    if arch in DSA_INDEXER_ARCHS:
        h = value("attention.indexer.key_length")
        if isinstance(h, bool) or not isinstance(h, int) or h < 64 or h & (h - 1):
            raise _bad(path, f"{arch}.attention.indexer.key_length", "missing" if h is None else h,
                       "a power of two >= 64 (the indexer's Hadamard rotation is that wide)")
    if arch in MSA_ARCHS:
        hi, kv = value("attention.indexer.head_count"), value("attention.head_count_kv")
        kv = value("attention.head_count") if kv is None else kv
        if isinstance(kv, int) and not isinstance(kv, bool) and hi != kv:
            raise _bad(path, f"{arch}.attention.indexer.head_count", "missing" if hi is None else hi,
                       f"head_count_kv ({kv}): one indexer head per KV head")
    if arch in SWA_REQUIRED_ARCHS:
        w = value("attention.sliding_window")
        if isinstance(w, bool) or not isinstance(w, int) or w <= 0:
            raise _bad(path, f"{arch}.attention.sliding_window", "missing" if w is None else w,
                       "a window of >= 1 token (its graph always builds the sliding-window attention input)")
    if value("attention.causal") is False:
        raise NotGGUFError(f"{path}: {arch}.attention.causal is false: a non-causal (embedding) model, which "
                           "llama.cpp aborts on when a batch spans several ubatches; epqlab runs generative models.")


def check_norm_eps(path: Path, arch: str, value) -> None:
    """Refuse a layer-norm epsilon that is NaN or negative (``attention.layer_norm_rms_epsilon`` /
    ``attention.layer_norm_epsilon``): ggml-cpu's norm kernels ``GGML_ASSERT(eps >= 0.0f)`` on the first
    decode. ``value(key)`` reads ``<arch>.<key>`` raw. Raises NotGGUFError."""
    for key in ("attention.layer_norm_rms_epsilon", "attention.layer_norm_epsilon"):
        v = value(key)
        if isinstance(v, float) and not v >= 0.0:  # NaN fails every comparison
            raise _bad(path, f"{arch}.{key}", v, "a number >= 0")


def check_rope(path: Path, arch: str, value, hp) -> None:
    """Refuse rope and head sizes llama.cpp asserts on: ``rope.scaling.type`` other than
    :data:`ROPE_SCALING_TYPES` (load_hparams), and for :data:`ROPE_FULL_HEAD_ARCHS` a
    ``rope.dimension_count`` or ``attention.value_length`` other than the key head size (the
    graph's ``GGML_ASSERT(n_embd_head == n_rot)``); for other architectures without MLA an odd
    rotary dimension count or one above the key head size (ggml-cpu's rope asserts
    ``n_dims <= ne0`` and ``n_dims % 2 == 0``), below the MLA key head size with MLA. ``value(key)`` reads ``<arch>.<key>`` raw; ``hp`` as
    in :func:`check_hparams` (head counts: llama.cpp sizes heads from layer 0's). Raises NotGGUFError."""
    scaling = value("rope.scaling.type")
    if scaling is not None and str(scaling) not in ROPE_SCALING_TYPES:
        raise _bad(path, f"{arch}.rope.scaling.type", repr(str(scaling)[:40]), f"one of {', '.join(ROPE_SCALING_TYPES)}")
    heads = value("attention.head_count")
    n_head = int(heads[0]) if isinstance(heads, (list, tuple)) and heads else hp("attention.head_count")
    if n_head <= 0:
        return
    n_embd = hp("embedding_length")
    head_k = hp("attention.key_length", n_embd // n_head)
    head_v = hp("attention.value_length", n_embd // n_head)
    n_rot = hp("rope.dimension_count", head_k)
    if arch in ROPE_FULL_HEAD_ARCHS:
        if n_rot != head_k:
            raise _bad(path, f"{arch}.rope.dimension_count", n_rot, f"the key head size {head_k} in {arch}")
        if head_v != head_k:
            raise _bad(path, f"{arch}.attention.value_length", head_v, f"the key head size {head_k} in {arch}")
    elif value("attention.kv_lora_rank") is not None:
        # MLA (deepseek2 and its kin): the rotary part is cut from a key head of key_length_mla, leaving
        # a non-rotary part (deepseek2.cpp: GGML_ASSERT(n_embd_head_qk_nope >= 1))
        head_mla = hp("attention.key_length_mla", head_k)
        if n_rot % 2 or not 0 < n_rot < head_mla:
            raise _bad(path, f"{arch}.rope.dimension_count", n_rot,
                       f"an even count below the MLA key head size {head_mla} (attention.key_length_mla)")
        rank = hp("attention.kv_lora_rank")
        if hp("attention.key_length_mla") and hp("attention.value_length_mla"):
            # MLA stored absorbed (llama.cpp's is_mla()): the cached key is kv_lora_rank + rotary dims
            # wide and the value kv_lora_rank, as attn_kv_a_mqa is; other sizes meet a matmul assert
            # (ggml.c: GGML_ASSERT(a->ne[0] == b->ne[0]))
            if head_k != rank + n_rot:
                raise _bad(path, f"{arch}.attention.key_length", head_k,
                           f"kv_lora_rank + rope.dimension_count = {rank + n_rot} (MLA)")
            if head_v != rank:
                raise _bad(path, f"{arch}.attention.value_length", head_v, f"kv_lora_rank = {rank} (MLA)")
            kv = value("attention.head_count_kv")
            kv = list(kv) if isinstance(kv, (list, tuple)) else [n_head if kv is None else kv]
            # hybrids whose recurrent blocks are the ones with head_count_kv 0 (kimi-linear.cpp,
            # bailingmoe3.cpp: is_recr_impl[i] = n_head_kv(i) == 0) have 0 there and 1 on their MLA blocks
            ok = (0, 1) if arch in MLA_HYBRID_ARCHS else (1,)
            if any(int(x) not in ok for x in kv) or not any(int(x) == 1 for x in kv):
                raise _bad(path, f"{arch}.attention.head_count_kv", "missing (= head_count)" if value(
                    "attention.head_count_kv") is None else kv[0] if len(kv) == 1 else kv, "1 (MLA caches one key head)")
    elif n_rot % 2 or n_rot > head_k:
        raise _bad(path, f"{arch}.rope.dimension_count", n_rot, f"an even count <= the key head size {head_k}")


# architectures whose blk.N.attn_q / attn_k / attn_v are exactly n_head * head_k, n_head_kv * head_k and
# n_head_kv * head_v wide (the graph reshapes them to heads: ggml_reshape_3d asserts the element count)
PLAIN_ATTENTION_ARCHS = frozenset({"llama", "deepseek", "dots1", "olmoe", "qwen2moe", "qwen3moe", "gpt-oss"})


def check_attention_shapes(path: Path, arch: str, value, hp, dims: dict) -> None:
    """Refuse head counts and sizes that disagree with the attention tensors they split into heads, in
    :data:`PLAIN_ATTENTION_ARCHS`: llama.cpp checks those tensors' shapes against the head sizes only
    where its expected shape uses them (qwen2moe's attn_q is n_embd wide whatever the head count; gpt-oss
    sizes its heads from the rotary dims), and the graph then aborts in ``ggml_reshape_3d`` /
    ``ggml_mul_mat`` (``GGML_ASSERT(a->ne[0] == b->ne[0])``). Head counts may be per-layer arrays; head
    sizes default to n_embd / layer 0's head count, as in llama.cpp's load_hparams. ``dims``: tensor
    name -> ggml shape. Raises NotGGUFError naming the key."""
    if arch not in PLAIN_ATTENTION_ARCHS:
        return

    def per_layer(key, il, default):
        v = value(key)
        if isinstance(v, (list, tuple)):
            return int(v[il]) if il < len(v) else default
        return int(v) if isinstance(v, int) and not isinstance(v, bool) else default

    n_head0 = per_layer("attention.head_count", 0, 0)
    if n_head0 <= 0:
        return
    n_embd = hp("embedding_length")
    head_k = hp("attention.key_length", n_embd // n_head0)
    head_v = hp("attention.value_length", n_embd // n_head0)
    for il in range(hp("block_count")):
        n_head = per_layer("attention.head_count", il, n_head0)
        n_kv = per_layer("attention.head_count_kv", il, n_head)
        for t, heads, size, key in (("attn_q", n_head, head_k, "attention.head_count"),
                                    ("attn_k", n_kv, head_k, "attention.head_count_kv"),
                                    ("attn_v", n_kv, head_v, "attention.head_count_kv")):
            d = dims.get(f"blk.{il}.{t}.weight")
            if d is None or len(d) < 2 or n_head == 0:
                continue
            if heads * size != int(d[1]):
                raise NotGGUFError(
                    f"{path}: blk.{il}.{t}.weight is {int(d[1])} wide, but {arch}.{key} ({heads}) x the head size "
                    f"({size}, attention.key_length / value_length or embedding_length / head_count) is "
                    f"{heads * size}: llama.cpp would abort splitting it into heads. The file is corrupt or "
                    "mis-converted; re-convert it.")


# MoE architectures of the bundled llama.cpp that epqlab cannot page, and why: the hook (native/engine/hook.cpp)
# follows one expert selection (ffn_moe_topk) per layer over the layer's ffn_*_exps tensors
_DIFFUSION = ("a diffusion language model (non-causal attention, set in its load_arch_hparams): it is decoded by "
              "iterative unmasking (llama.cpp's diffusion example), not by next-token generation, and llama_decode "
              "aborts the process on a prompt longer than one ubatch")
UNPAGEABLE_ARCHS = {
    "llada-moe": _DIFFUSION,
    "rnd1": _DIFFUSION,
    "grovemoe": "its graph selects experts twice in every layer (the routed experts, then the per-group "
                "'chunk' experts ffn_*_chexps, src/models/grovemoe.cpp), and epqlab follows one top-k per layer",
}


def check_pageable(path: Path, arch: str) -> None:
    """Refuse an architecture in :data:`UNPAGEABLE_ARCHS`. Raises UnsupportedArchError naming the reason."""
    if arch in UNPAGEABLE_ARCHS:
        raise UnsupportedArchError(
            f"{path}: epqlab cannot page architecture {arch!r}: {UNPAGEABLE_ARCHS[arch]}. Run it with plain "
            "llama.cpp (llama-cpp-python) instead.")


# architectures whose load_arch_tensors makes blk.N.ssm_conv1d.bias optional (TENSOR_NOT_REQUIRED: falcon-h1.cpp,
# granite-hybrid.cpp, nemotron-h.cpp) while the graph's build_mamba2_layer adds it unconditionally
# (src/models/mamba-base.cpp: ggml_add(ctx0, xBC, model.layers[il].ssm_conv1d_b)): without it ggml_add reads a
# null tensor (SIGSEGV building the first graph, when the context is created)
MAMBA2_CONV_BIAS_ARCHS = frozenset({"falcon-h1", "granitehybrid", "nemotron_h", "nemotron_h_moe"})


def check_required_tensors(path: Path, arch: str, names) -> None:
    """Refuse a tensor llama.cpp loads as optional but computes with unconditionally: a Mamba-2 block's
    ``blk.N.ssm_conv1d.bias`` (:data:`MAMBA2_CONV_BIAS_ARCHS`). ``names``: every tensor name in the file.
    Raises NotGGUFError naming the missing tensor."""
    if arch not in MAMBA2_CONV_BIAS_ARCHS:
        return
    names = set(names)
    for name in sorted(names):
        if name.endswith(".ssm_conv1d.weight") and name[:-len("weight")] + "bias" not in names:
            raise NotGGUFError(
                f"{path}: {name[:-len('weight')]}bias is missing, but llama.cpp's {arch} graph adds it to every "
                "Mamba-2 block's convolution (it would crash the process creating the context): the file is "
                "corrupt or mis-converted; re-convert it.")


def check_tensor_types(path: Path, tensors) -> None:
    """Refuse a weight (``token_embd``, ``output``, ``blk.N.attn_*`` / ``ffn_*`` ..., see
    :data:`WEIGHT_NAME_RE`) of a type no kernel multiplies with (:data:`NON_WEIGHT_TYPES`): llama.cpp loads it
    (only the shape is checked) and ggml-cpu's matmul / binary op then crashes (SIGSEGV) on the
    first decode. ``tensors``: (name, ggml type name) pairs. Raises NotGGUFError."""
    for name, type_name in tensors:
        if type_name in NON_WEIGHT_TYPES and WEIGHT_NAME_RE.match(name):
            raise NotGGUFError(
                f"{path}: tensor {name} has ggml type {type_name}, which no llama.cpp kernel computes with as a "
                "weight (the process would crash on the first decode): the file is corrupt or mis-converted; "
                "re-convert it.")


def string_array(reader, field) -> list[bytes]:
    """The elements of a GGUF string array ``field`` of gguf-py ``reader``, as bytes, read straight from
    the mapped file (the layout reader skips long string arrays). Raises ValueError past the end."""
    import struct

    o = int(field.parts[4].ctypes.data - reader.data.ctypes.data) + 8  # after the u64 array length
    n = int(field.parts[4][0])
    end = int(getattr(reader, "data_offset", 0) or len(reader.data))
    head = bytes(reader.data[o:max(end, o)])  # one copy of the rest of the header, parsed in Python
    out, at = [], 0
    for _ in range(n):
        if at + 8 > len(head):
            raise ValueError("string array past the end of the header")
        (ln,) = struct.unpack_from("<Q", head, at)
        if at + 8 + ln > len(head):
            raise ValueError("string past the end of the header")
        out.append(head[at + 8:at + 8 + ln])
        at += 8 + ln
    return out


def check_vocab(path: Path, reader, value) -> None:
    """Refuse the tokenizer metadata llama.cpp's vocabulary (src/llama-vocab.cpp) asserts on:

    - two tokens with the same text in ``tokenizer.ggml.tokens`` (an empty one counts as
      ``[EMPTY_<id>]``, as llama.cpp renames it): ``GGML_ASSERT(id_to_token.size() == token_to_id.size())``
      at load;
    - ``tokenizer.ggml.model`` ``none`` / ``no_vocab``: tokenizing any text reaches ``GGML_ABORT``;
    - a prompt's BOS / EOS / SEP that tokenize(add_special) must add but that resolves to no token:
      the model's default id is out of the vocabulary (or has none) and ``tokenizer.ggml.*_token_id``
      is missing or out of range, while ``add_bos_token`` / ``add_eos_token`` (or the tokenizer's
      default) asks for it: ``GGML_ASSERT(special_bos_id != LLAMA_TOKEN_NULL)`` and its EOS / SEP
      twins on the first tokenize.

    ``value(key)`` reads a metadata value (None when absent). Raises NotGGUFError naming the key."""
    model = value("tokenizer.ggml.model")
    if model is None:
        return  # llama.cpp refuses a missing tokenizer with an exception
    model = str(model)
    if model in ("none", "no_vocab"):
        raise NotGGUFError(f"{path}: tokenizer.ggml.model is {model!r}: the file has no vocabulary, and llama.cpp "
                           "aborts the process on the first text it tokenizes; epqlab needs a model with a tokenizer.")
    field = reader.fields.get("tokenizer.ggml.tokens")
    if field is None or len(field.types) < 2 or int(field.types[0]) != 9 or int(field.types[1]) != 8:
        return  # missing or not an array of strings: llama.cpp throws (a LlamaCppError)
    try:
        toks = string_array(reader, field)
    except (ValueError, IndexError):
        return  # the header parse already found the file's end; llama.cpp refuses it too
    seen: dict[bytes, int] = {}
    for i, t in enumerate(toks):
        t = t or f"[EMPTY_{i}]".encode()
        j = seen.setdefault(t, i)
        if j != i:
            raise NotGGUFError(
                f"{path}: tokenizer.ggml.tokens has {t[:40].decode('utf-8', 'replace')!r} twice, at ids {j} and {i}: "
                "llama.cpp asserts every token is unique (it would abort the process loading it); the file is "
                "corrupt or mis-converted; re-convert it.")
    if model not in _VOCAB_DEFAULTS:
        return  # an unknown tokenizer: llama.cpp throws
    kind, bos, eos, sep = _VOCAB_DEFAULTS[model]
    pre = str(value("tokenizer.ggml.pre") or "")
    if kind == "BPE" and pre in _NO_BOS_PRE:
        bos = None
    n = len(toks)

    def resolve(default, key):
        tid = default if default is not None and default < n else None
        v = value(f"tokenizer.ggml.{key}")
        if isinstance(v, int) and not isinstance(v, bool) and 0 <= v < n:
            tid = v
        return tid

    add_bos = kind in ("SPM", "WPM") or (kind == "BPE" and pre in _BOS_PRE)
    add_eos = kind == "UGM"
    flag = value("tokenizer.ggml.add_bos_token")
    if isinstance(flag, bool) and kind != "WPM":
        add_bos = flag
    if model == "gemma4":
        add_bos = True
    flag = value("tokenizer.ggml.add_eos_token")
    if isinstance(flag, bool) and kind in ("SPM", "BPE", "UGM"):
        add_eos = flag
    needs = [("bos_token_id", "add_bos_token", bos, add_bos and kind in ("SPM", "WPM", "BPE", "UGM")),
             ("eos_token_id", "add_eos_token", eos, add_eos and kind in ("SPM", "BPE", "UGM")),
             ("seperator_token_id", "add_sep_token", sep, kind == "WPM")]
    for key, flag_key, default, needed in needs:
        if needed and resolve(default, key) is None:
            raise NotGGUFError(
                f"{path}: the tokenizer ({model}) adds tokenizer.ggml.{key} to every prompt ({flag_key} or its "
                f"default), but the file gives no token id in 0..{n - 1} for it (default "
                f"{'none' if default is None else default}, file {value('tokenizer.ggml.' + key)!r}): llama.cpp "
                "would abort the process on the first prompt. The file is corrupt or mis-converted; re-convert it.")


__all__ = ["LLAMA_MAX_LAYERS", "LLAMA_MAX_EXPERTS", "ROPE_SCALING_TYPES", "check_attention_shapes", "check_graph_keys", "check_hparams", "check_norm_eps", "check_rope",
           "check_tensor_types", "check_vocab", "string_array"]
