"""epqlab/loader_checks.py: each file content that aborts or crashes the process inside llama.cpp
(found by bench/fuzz_loader.py or read off llama.cpp's loader) is refused by ``epqlab.inspect`` with
NotGGUFError naming the key or tensor. Each file is a good small model with one thing changed, written
with gguf-py; the good models themselves pass (so the checks refuse the change, not the model).

Each row was run once with its check removed: the Session child then died (SIGABRT at the assert
quoted in the row, or SIGSEGV), except where the row says llama.cpp refuses that file itself first."""
from __future__ import annotations

import shutil

import gguf
import numpy as np
import pytest

import epqlab
from epqlab.errors import NotGGUFError
from epqlab.models.archs import write_tiny
from epqlab.models.gguf_rewrite import rewrite_gguf

VT = gguf.GGUFValueType


def rewrite(src, dst, set_kv: dict | None = None, drop: tuple = ()) -> None:
    """Copy GGUF ``src`` to ``dst`` with metadata ``set_kv`` {key: (value, GGUFValueType)} set (added
    or replaced) and the keys in ``drop`` left out; tensors unchanged."""
    rewrite_gguf(src, dst, set_kv=set_kv, drop=drop)


def edit(src, dst, fn) -> None:
    """Copy ``src`` to ``dst`` and apply ``fn(reader)`` to its bytes in place (gguf-py's r+ memmap)."""
    shutil.copy(src, dst)
    r = gguf.GGUFReader(dst, "r+")
    fn(r)
    r.data.flush()


def _dup_token(r):
    """Token 300's bytes := those of another token of its length (same header layout)."""
    f = r.fields["tokenizer.ggml.tokens"]
    parts = [f.parts[i] for i in f.data]
    j = next(j for j in range(len(parts)) if j != 300 and len(parts[j]) == len(parts[300]))
    parts[300][:] = parts[j]


def _set_type(name, ggml_type):
    def go(r):
        t = next(t for t in r.tensors if t.name == name)
        t.field.parts[4][0] = ggml_type
    return go


def _set_scalar(key, v):
    return lambda r: r.fields[key].parts[-1].__setitem__(0, v)


@pytest.fixture(scope="module")
def spm(tmp_path_factory):
    """archs.write_tiny's Mixtral-style llama: a 355-token SentencePiece vocabulary (BOS 1, EOS 2)."""
    return write_tiny(tmp_path_factory.mktemp("spm") / "spm.gguf", "llama", n_layer=2)


@pytest.fixture(scope="module")
def files(mini_gguf, spm, tmp_path_factory):
    d = tmp_path_factory.mktemp("loader_checks")
    bpe = mini_gguf  # qwen3moe, GPT-2 BPE (512 tokens, merges)
    n = len(gguf.GGUFReader(bpe).fields["tokenizer.ggml.tokens"].data)
    out = {"bpe": bpe, "spm": spm}

    def make(tag, how, src=bpe, *args, **kw):
        out[tag] = d / f"{tag}.gguf"
        how(src, out[tag], *args, **kw)

    make("dup_token", edit, bpe, _dup_token)
    make("dup_token_spm", edit, spm, _dup_token)
    # no tokenizer, n tokens (vocab_size): llama.cpp makes n dummy tokens, and tokenizing text aborts
    make("no_vocab", rewrite, bpe, {"tokenizer.ggml.model": ("none", VT.STRING), "qwen3moe.vocab_size": (n, VT.UINT32)})
    # chatglm-bpe leaves BPE without a default BOS; add_bos_token asks for one, the file's id is out of range
    make("bos_none", rewrite, bpe, {"tokenizer.ggml.pre": ("chatglm-bpe", VT.STRING),
                                    "tokenizer.ggml.add_bos_token": (True, VT.BOOL),
                                    "tokenizer.ggml.bos_token_id": (n, VT.UINT32)})
    # gemma4 has no default EOS; add_eos_token asks for one, the file gives none
    make("eos_none", rewrite, bpe, {"tokenizer.ggml.model": ("gemma4", VT.STRING),
                                    "tokenizer.ggml.bos_token_id": (1, VT.UINT32),
                                    "tokenizer.ggml.add_eos_token": (True, VT.BOOL)},
         drop=("tokenizer.ggml.eos_token_id",))
    make("rope_scaling", rewrite, bpe, {"qwen3moe.rope.scaling.type": ("bogus", VT.STRING)})
    make("n_rot", edit, bpe, _set_scalar("qwen3moe.rope.dimension_count", 1))
    make("value_length", edit, bpe, _set_scalar("qwen3moe.attention.value_length", 32))
    make("eps_nan", edit, bpe, _set_scalar("qwen3moe.attention.layer_norm_rms_epsilon", np.float32("nan")))
    make("eps_neg", edit, spm, _set_scalar("llama.attention.layer_norm_rms_epsilon", np.float32(-1e-5)))
    make("router_i32", edit, bpe, _set_type("blk.0.ffn_gate_inp.weight", gguf.GGMLQuantizationType.I32))
    make("norm_i32", edit, spm, _set_type("output_norm.weight", gguf.GGMLQuantizationType.I32))
    make("attn_i16", edit, spm, _set_type("blk.1.attn_q.weight", gguf.GGMLQuantizationType.I16))
    make("expert_count0", edit, spm, _set_scalar("llama.expert_count", 0))
    out["dots1"] = write_tiny(d / "dots1.gguf", "dots1")
    make("gating7", edit, out["dots1"], _set_scalar("dots1.expert_gating_func", 7))
    out["gpt-oss"] = write_tiny(d / "gpt-oss.gguf", "gpt-oss")
    out["qwen2moe"] = write_tiny(d / "qwen2moe.gguf", "qwen2moe")
    make("gptoss_key_length", edit, out["gpt-oss"], _set_scalar("gpt-oss.attention.key_length", 32))
    make("qwen2moe_heads", edit, out["qwen2moe"], _set_scalar("qwen2moe.attention.head_count", 8))
    out["deepseek2"] = write_tiny(d / "deepseek2.gguf", "deepseek2")
    make("mla_rot", edit, out["deepseek2"], _set_scalar("deepseek2.attention.key_length_mla", 16))
    make("mla_key_length", rewrite, out["deepseek2"], drop=("deepseek2.attention.key_length",))
    make("mla_kv_heads", rewrite, out["deepseek2"], drop=("deepseek2.attention.head_count_kv",))
    # the last tensor, so its smaller Q8_K bytes leave the packing intact (a gap only at the file's end)
    make("experts_q8k", edit, bpe, _set_type("blk.3.ffn_down_exps.weight", gguf.GGMLQuantizationType.Q8_K))
    make("align48", rewrite, bpe, {"general.alignment": (48, VT.UINT32)})
    make("align_str", rewrite, bpe, {"general.alignment": ("32", VT.STRING)})
    make("gating0", edit, out["dots1"], _set_scalar("dots1.expert_gating_func", 0))
    make("gating_missing", rewrite, out["dots1"], drop=("dots1.expert_gating_func",))
    make("non_causal", rewrite, bpe, {"qwen3moe.attention.causal": (False, VT.BOOL)})
    out["nemotron_h_moe"] = write_tiny(d / "nemotron_h_moe.gguf", "nemotron_h_moe")
    out["minimax-m2"] = write_tiny(d / "mm2.gguf", "minimax-m2")
    make("mm2_gating_missing", rewrite, out["minimax-m2"], drop=("minimax-m2.expert_gating_func",))
    out["laguna"] = write_tiny(d / "laguna.gguf", "laguna")
    make("laguna_gating0", rewrite, out["laguna"], {"laguna.expert_gating_func": (0, VT.UINT32)})
    out["msa_indexer_heads"] = write_tiny(d / "msa.gguf", "minimax-m3", indexer_n_head=4)
    out["dsa_indexer_96"] = write_tiny(d / "dsa.gguf", "deepseek32", indexer_head_size=96)
    out["afmoe_no_window"] = write_tiny(d / "af.gguf", "afmoe", sliding_window=0)
    out["mamba2_no_conv_bias"] = write_tiny(d / "nb.gguf", "nemotron_h_moe", omit=("blk.3.ssm_conv1d.bias",))
    return out


ROWS = [
    # id, file, message fragment  (what llama.cpp does with the file when the check is removed)
    ("duplicate token (BPE)", "dup_token", "twice, at ids"),  # llama-vocab.cpp GGML_ASSERT(id_to_token.size() == token_to_id.size())
    ("duplicate token (SPM)", "dup_token_spm", "twice, at ids"),  # the same assert
    ("no vocabulary", "no_vocab", "has no vocabulary"),  # tokenize: GGML_ABORT (LLAMA_VOCAB_TYPE_NONE)
    ("BOS to add, none", "bos_none", "tokenizer.ggml.bos_token_id"),  # GGML_ASSERT(vocab.token_bos() != LLAMA_TOKEN_NULL)
    ("EOS to add, none", "eos_none", "tokenizer.ggml.eos_token_id"),  # GGML_ASSERT(vocab.token_eos() != LLAMA_TOKEN_NULL)
    ("rope scaling type", "rope_scaling", "rope.scaling.type is 'bogus'"),  # GGML_ASSERT(rope_scaling_type_train != UNSPECIFIED)
    ("rotary dims", "n_rot", "rope.dimension_count is 1"),  # qwen3moe.cpp GGML_ASSERT(n_embd_head == n_rot)
    ("value head size", "value_length", "attention.value_length is 32"),  # llama.cpp refuses attn_v's shape first here
    ("rms eps NaN", "eps_nan", "layer_norm_rms_epsilon is nan"),  # ggml-cpu ops.cpp GGML_ASSERT(eps >= 0.0f)
    ("rms eps negative", "eps_neg", "layer_norm_rms_epsilon is -"),  # the same assert
    ("router I32", "router_i32", "blk.0.ffn_gate_inp.weight has ggml type I32"),  # SIGSEGV in the router matmul
    ("norm I32", "norm_i32", "output_norm.weight has ggml type I32"),  # SIGABRT in ggml-cpu's binary op
    ("attention I16", "attn_i16", "blk.1.attn_q.weight has ggml type I16"),  # SIGSEGV in the q matmul
    ("expert_count 0 with experts", "expert_count0", "expert_count is missing or 0"),  # GGML_ASSERT(n_expert_used_max <= n_expert)
    ("gating function 7", "gating7", "expert_gating_func is 7"),  # build_moe_ffn: GGML_ABORT("fatal error")
    ("gpt-oss key head size", "gptoss_key_length", "blk.0.attn_q.weight is 64 wide"),  # ggml.c GGML_ASSERT(a->ne[0] == b->ne[0])
    ("qwen2moe head count", "qwen2moe_heads", "blk.0.attn_q.weight is 64 wide"),  # ggml_reshape_3d's element-count assert
    ("MLA rotary dims", "mla_rot", "rope.dimension_count is 16"),  # deepseek2.cpp GGML_ASSERT(n_embd_head_qk_nope >= 1)
    ("MLA key head size", "mla_key_length", "attention.key_length is 16"),  # ggml.c GGML_ASSERT(a->ne[0] == b->ne[0])
    ("MLA KV heads", "mla_kv_heads", "head_count_kv is missing (= head_count)"),  # the same matmul assert
    ("experts Q8_K", "experts_q8k", "blk.3.ffn_down_exps.weight has ggml type Q8_K"),  # SIGSEGV in the expert matmul
    ("alignment 48", "align48", "header is corrupt (Invalid alignment"),  # gguf.cpp refuses it too (no abort)
    ("alignment a string", "align_str", "header is corrupt (Bad type for general.alignment"),  # was TruncatedModelError
    ("dots1 gating function 0", "gating0", "expert_gating_func is 0"),  # the same GGML_ABORT (deepseek2 maps 0)
    ("dots1 gating function missing", "gating_missing", "expert_gating_func is missing (0)"),  # the same GGML_ABORT
    ("non-causal", "non_causal", "attention.causal is false"),
    ("minimax-m2 gating function missing", "mm2_gating_missing", "expert_gating_func is missing (0)"),  # the abort
    ("MSA indexer heads", "msa_indexer_heads", "minimax-m3.attention.indexer.head_count is 4"),  # GGML_ASSERT(HKV == Hd)
    ("DSA indexer head 96", "dsa_indexer_96", "attention.indexer.key_length is 96"),  # ggml_can_mul_mat assert
    ("afmoe without a window", "afmoe_no_window", "afmoe.attention.sliding_window is missing"),  # SIGSEGV: kv iswa input
    ("Mamba-2 conv bias missing", "mamba2_no_conv_bias", "blk.3.ssm_conv1d.bias is missing"),  # mamba-base.cpp: SIGSEGV in ggml_add  # llama_decode: GGML_ASSERT(... n_ubatch >= n_tokens_all)
]


@pytest.mark.parametrize("key,fragment", [r[1:] for r in ROWS], ids=[r[0] for r in ROWS])
def test_refused_before_llama_cpp(files, key, fragment):
    with pytest.raises(NotGGUFError) as ei:
        epqlab.inspect(files[key])
    assert fragment in str(ei.value), str(ei.value)
    with pytest.raises(NotGGUFError):
        epqlab.Session(files[key], n_threads=1, n_ctx=256, io_threads=1)


# laguna_gating0: laguna's load_arch_hparams turns gating 0 into sigmoid, so 0 is a good file there
@pytest.mark.parametrize("key", ["bpe", "spm", "dots1", "gpt-oss", "qwen2moe", "deepseek2", "nemotron_h_moe",
                                 "laguna_gating0"])
def test_good_models_pass(files, key):
    lay = epqlab.inspect(files[key])
    assert lay.is_moe


def test_gating_zero_is_the_architectures_default(files):
    """laguna's load_arch_hparams turns expert_gating_func 0 into sigmoid (its default): the file with 0 is
    accepted and computes the same logits as the one with 2 (sigmoid)."""
    logits = []
    for key in ("laguna", "laguna_gating0"):
        with epqlab.Session(files[key], pager=False, n_threads=1, n_ctx=256) as s:
            logits.append(s.greedy_trace(s.tokenize("Paging experts from disk"), 2)[0])
    assert np.array_equal(logits[0], logits[1])
