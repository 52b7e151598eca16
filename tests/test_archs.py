"""Every MoE architecture we support pages bit-identically.

test_arch_table: every architecture of epqlab.models.archs (ARCH_ROWS), in a child process each
(tests/arch_child.py): prompt logits + 8 greedy steps at three arenas x both expert addressings, batched
decode, prefix reuse, teacher forcing and perplexity equal plain llama.cpp's (``pager=False``) bit for bit,
or slot addressing is refused by name.

test_paged_equals_plain_llama: ``Session(pager=True, dense_weights=d, arena_bytes=A, n_ubatch=u)`` equals
``pager=False`` for the first seven tiny architectures (llama, deepseek, deepseek2 split and fused gate_up,
qwen2moe, qwen3moe, gpt-oss, dots1) and shrunk synth presets; d in anon/mmap (mlock once), A in {minimum
arena, all experts}, u in {1: every token pages its experts, 512: the minimum arena stages the prompt}."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import epqlab
from epqlab.models import synthesize
from epqlab.models.archs import ARCHS, ArchSpec, arch_kv, arch_tensors, tiny_spec, write_tiny
from ggufs import BLOCK  # ggml block size (elements) and bytes per block, from ggml's type table

N_STEPS = 8
N_PROMPT = 40
TEXT = ("Paging experts from disk keeps the arena small, and the logits must not change by a single bit. "
        "The router of every layer picks the experts of each token; a miss reads them with O_DIRECT into "
        "a slot of the arena while the least recently used expert is evicted.")

# name -> (writer, preset/arch, knobs). Synth presets are shrunk to a few MiB.
SHRINK = dict(n_embd=256, n_head=4, head_dim=64, n_expert=16, n_expert_used=4, n_ff_exp=256)
MODELS = {
    "llama": ("tiny", "llama", {}),
    # experts without ffn_gate_exps (down(silu(up x))), tied output, 4096-byte tensor alignment
    "llama-nogate": ("tiny", "llama", dict(gate_exps=False, tied_output=True, alignment=4096)),
    "deepseek": ("tiny", "deepseek", {}),
    "deepseek2": ("tiny", "deepseek2", {}),
    # fused gate_up experts, a plain attn_q (no q LoRA), tied output and a trailing MTP block
    # (GLM-4.7-Flash style) that llama.cpp does not load: its experts are in the layout, never routed
    "deepseek2-fused-mtp": ("tiny", "deepseek2", dict(fused=True, expert_types=("Q8_0", "Q8_0", "F16"),
                                                      late_expert_types=None, n_late_layers=0, q_lora_rank=0,
                                                      tied_output=True, n_nextn=1)),
    "qwen2moe": ("tiny", "qwen2moe", {}),
    "qwen3moe": ("tiny", "qwen3moe", {}),
    "gpt-oss": ("tiny", "gpt-oss", {}),
    "dots1": ("tiny", "dots1", {}),
    "synth-tiny": ("synth", "tiny", {}),
    "synth-tiny-unaligned": ("synth", "tiny", dict(unaligned=True)),
    # n_layer 3 (not 2): block 0 is dense, so blocks 1 (Q4_K) and 2 (BF16) give two slot classes
    "synth-laguna-s": ("synth", "laguna-s", dict(SHRINK, n_layer=3, n_head_kv=4, n_ff_dense=512, n_late_layers=1)),
    "synth-qwen3-30b-a3b": ("synth", "qwen3-30b-a3b", dict(SHRINK, n_layer=2, n_head_kv=2)),
    # the seed presets at their true architectures, shrunk: qwen35moe (3 DeltaNet + 1 attention block, the MTP
    # block, Q4_K/Q5_K experts, Q6_K output) and laguna (Q4_K + BF16 experts, SWA)
    "synth-qwen35-a3b": ("synth", "qwen35-a3b", dict(SHRINK, n_layer=4, n_head_kv=2, n_vocab=0)),
    "synth-laguna-s-true": ("synth", "laguna-s", dict(SHRINK, n_layer=3, n_head_kv=2, n_ff_dense=512,
                                                      n_late_layers=1, n_vocab=0)),
}
XFAIL: dict[str, str] = {}

# The arch table: every architecture of epqlab.models.archs (its DEFAULTS) plus variants, each run by
# tests/arch_child.py in a child process (a llama.cpp abort fails that row only). Columns: prompt logits + 8
# greedy steps at three arenas (half of all experts, the minimum at n_ubatch 1, the minimum at n_ubatch 512:
# the prompt stages) x expert_addressing slots / region; batched decode (n_seq_max 2, batch_trace); prefix
# reuse (reuse_kv); teacher forcing (forced=); perplexity. Each equals pager=False bit for bit or is a named
# refusal from REFUSALS.
ARCH_ROWS = {a: (a, {}) for a in ARCHS}
ARCH_ROWS.update({
    "llama-nogate": ("llama", dict(gate_exps=False, tied_output=True, alignment=4096)),
    "deepseek2-fused-mtp": MODELS["deepseek2-fused-mtp"][1:],
    # fused gate_up experts (BF16) and an F32 MTP block: two slot classes
    "qwen35moe-fused": ("qwen35moe", dict(fused=True, expert_types=("BF16",) * 3, late_expert_types=("F32",) * 3,
                                          n_late_layers=1)),
    # per-expert F32 scales (ffn_*_exps.scale), which build_moe_ffn multiplies into each expert's output
    "qwen35moe-scales": ("qwen35moe", dict(expert_scales=True)),
})
# why slot addressing may be refused (epqlab/paging: slices not whole pages; a class below top-k slots)
REFUSALS = ("expert_addressing='slots' is not possible",)
# architectures epqlab.inspect refuses (UnsupportedArchError), with a fragment of the reason
REFUSED_ARCHS = {"grovemoe": "selects experts twice in every layer", "llada-moe": "a diffusion language model",
                 "rnd1": "a diffusion language model"}


def _param(name):
    marks = [pytest.mark.xfail(strict=True, reason=XFAIL[name])] if name in XFAIL else []
    return pytest.param(name, marks=marks, id=name)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("archs")
    cache: dict[str, object] = {}

    def get(name):
        if name not in cache:
            kind, what, knobs = MODELS[name]
            p = root / f"{name}.gguf"
            if kind == "tiny":
                write_tiny(p, what, **knobs)
            else:
                synthesize(p, what, progress=False, **knobs)
            cache[name] = p
        return cache[name]

    return get


def _dense_page_bytes(lay) -> int:
    """Bytes of the union of whole pages that the non-expert tensors touch, within what llama.cpp keeps mapped.

    llama.cpp skips a trailing MTP block (``<arch>.nextn_predict_layers``) unless asked for it, and after the load
    unmaps the file's pages before its first and after its last loaded tensor (llama_model_loader::load_all_data,
    llama_mmap::unmap_fragment: the first rounded up and the last rounded down to pages, so the file's last partial
    page stays mapped); dense pages there are not copied."""
    import gguf
    page = os.sysconf("SC_PAGE_SIZE")
    end = -(-lay.file_size // page) * page
    r = gguf.GGUFReader(str(lay.path))
    arch = str(r.fields["general.architecture"].contents())
    n_block = int(r.fields[f"{arch}.block_count"].contents())
    f = r.fields.get(f"{arch}.nextn_predict_layers")
    trunk = n_block - (int(f.contents()) if f is not None else 0)

    def loaded(name):
        return not (name.startswith("blk.") and int(name.split(".")[1]) >= trunk)
    used = [(int(t.data_offset), int(t.data_offset) + int(t.n_bytes)) for t in r.tensors if loaded(t.name)]
    lo, hi = min(a for a, _ in used), max(b for _, b in used)
    head = lo // page * page                        # [0, head) unmapped
    tail = (-(-hi // page) * page, lay.file_size // page * page)  # [tail[0], tail[1]) unmapped
    spans = sorted((off // page * page, min(end, -(-(off + n) // page) * page)) for _, off, n in lay.dense_tensors if n)
    pages = set()
    for a, b in spans:
        pages.update(p for p in range(a, b, page) if p >= head and not tail[0] <= p < tail[1])
    return len(pages) * page


def _prompt(path):
    with epqlab.Session(path, pager=False, n_threads=1, n_ctx=256) as s:
        toks = s.tokenize(TEXT)[:N_PROMPT]
    assert len(toks) == N_PROMPT
    return toks


# n_ubatch 1 runs only for the models the arch table does not cover (it pages them at the ubatch-1 minimum arena
# in both addressings); every model runs n_ubatch 512 here, with the dense-weight modes the table does not vary.
@pytest.mark.parametrize("name,n_ubatch", [
    pytest.param(n, u, marks=[pytest.mark.xfail(strict=True, reason=XFAIL[n])] if n in XFAIL else [], id=f"{n}-{u}")
    for n in MODELS for u in (1, 512) if u == 512 or n not in ARCH_ROWS])
def test_paged_equals_plain_llama(models, name, n_ubatch):
    path = models(name)
    lay = epqlab.inspect(path)
    if MODELS[name][0] == "tiny":
        assert lay.architecture == MODELS[name][1]
    toks = _prompt(path)
    with epqlab.Session(path, pager=False, n_threads=1, n_ctx=256, n_ubatch=n_ubatch) as s:
        ref = s.greedy_trace(toks, N_STEPS)
    assert np.isfinite(ref[0]).all() and np.isfinite(ref[1]).all()
    dense_pages = _dense_page_bytes(lay)
    arenas = {"min": epqlab.Pager.min_arena_bytes(lay), "all": epqlab.Pager.all_experts_bytes(lay)}
    # mlock once, on the tiny models only (their dense weights, < 1 MiB, fit the common 8 MiB RLIMIT_MEMLOCK)
    mlock = n_ubatch == 512 and MODELS[name][0] == "tiny"
    runs = [(a, d) for a in arenas for d in ("anon", "mmap")] + ([("min", "mlock")] if mlock else [])
    for arena_name, dense in runs:
        key = (name, arena_name, dense, n_ubatch)
        with epqlab.Session(path, dense_weights=dense, arena_bytes=arenas[arena_name], n_ubatch=n_ubatch,
                            n_threads=1, n_ctx=256, io_threads=2) as s:
            p, st, gen = s.greedy_trace(toks, N_STEPS)
            stats, report = s.stats, s.load_report
        assert np.array_equal(p, ref[0]), key
        assert np.array_equal(st, ref[1]), key
        assert gen == ref[2], key
        assert report["lazy_load"] == (dense != "mmap"), key
        if dense != "mmap":  # exactly the pages of the non-expert tensors were swapped for anonymous copies
            assert report["dense_bytes"] == dense_pages, key
        assert stats["misses"] > 0 and stats["dense_weights"] == dense
        if arena_name == "min":
            assert stats["evictions"] > 0, key
        # staging happens exactly when a ubatch's union of experts outgrows the minimum arena
        if arena_name == "min" and n_ubatch == 512:
            assert stats["staged_layers"] > 0, key
        else:
            assert stats["staged_layers"] == 0, key


@pytest.mark.parametrize("name", list(ARCH_ROWS))
def test_tiny_layout_matches_spec(tmp_path, name):
    arch, knobs = ARCH_ROWS[name]
    s = tiny_spec(arch, **knobs)
    path = write_tiny(tmp_path / "m.gguf", arch, **knobs)
    if arch in REFUSED_ARCHS:
        with pytest.raises(epqlab.UnsupportedArchError, match=REFUSED_ARCHS[arch]):
            epqlab.inspect(path)
        return
    lay = epqlab.inspect(path)
    assert (lay.architecture, lay.n_expert, lay.n_expert_used, lay.alignment) == (arch, s.n_expert, s.n_expert_used, s.alignment)
    # the blocks with routed experts: past the dense lead, except where written out by hand from DEFAULTS: llama4
    # and jamba every 2nd block, nemotron_h_moe every 3rd (Mamba-2, attention, MoE); MTP blocks
    # (nextn_predict_layers) are outside the routed-expert accounting: an ordinary context never routes them
    moe = {"llama4": [1, 3], "jamba": [1, 3], "nemotron_h_moe": [2, 5]}.get(name, list(range(s.n_dense_lead, s.n_layer + s.n_nextn)))
    assert lay.moe_layers == [il for il in moe if il < s.n_layer]
    assert lay.mtp_moe_layers == [il for il in moe if il >= s.n_layer]
    for l in lay.layers + lay.mtp_layers:
        g, u, d = s.expert_types_of(l.layer)
        want = [("gate_up", g, (s.n_embd, 2 * s.n_ff_exp))] if s.fused else \
            [("gate", g, (s.n_embd, s.n_ff_exp))] * s.gate_exps + [("up", u, (s.n_embd, s.n_ff_exp))]
        want.append(("down", d, (s.n_ff_exp, s.n_embd)))
        assert [(t.kind, t.ggml_type, t.shape[:2]) for t in l.tensors] == want
        for t in l.tensors:
            blk, size = BLOCK[t.ggml_type]
            assert t.expert_bytes == t.shape[0] // blk * size * t.shape[1]
            assert t.offset % s.alignment == 0


def test_write_tiny_rejects_bad_knobs(tmp_path):
    with pytest.raises(ValueError, match="unknown architecture"):
        write_tiny(tmp_path / "x.gguf", "mixtral")
    with pytest.raises(ValueError, match="unknown knob"):
        write_tiny(tmp_path / "x.gguf", "llama", n_experts=4)
    with pytest.raises(ValueError, match="ffn_gate_up_exps"):
        write_tiny(tmp_path / "x.gguf", "qwen3moe", fused=True)
    with pytest.raises(ValueError, match="multiple of 32"):
        write_tiny(tmp_path / "x.gguf", "qwen3moe", n_ff_exp=40)
    with pytest.raises(ValueError, match="rope_sections"):
        write_tiny(tmp_path / "x.gguf", "qwen35moe", rope_sections=(4, 4, 4, 0))
    with pytest.raises(ValueError, match="n_vocab"):
        write_tiny(tmp_path / "x.gguf", "laguna", n_vocab=1000)
    with pytest.raises(ValueError, match="ssm_d_inner = 128"):  # granite-hybrid.cpp asserts 2 * n_embd == d_inner
        write_tiny(tmp_path / "x.gguf", "granitehybrid", ssm_d_inner=96)
    with pytest.raises(ValueError, match="no ffn_gate_exps"):
        write_tiny(tmp_path / "x.gguf", "nemotron_h_moe", gate_exps=True)
    with pytest.raises(ValueError, match="n_nextn .MTP blocks. is written for"):
        write_tiny(tmp_path / "x.gguf", "laguna", n_nextn=1)
    with pytest.raises(ValueError, match="omit names tensors"):
        write_tiny(tmp_path / "x.gguf", "llama", omit=("blk.0.ssm_conv1d.bias",))
    assert not list(tmp_path.iterdir())


def test_mtp_experts_are_outside_the_arena_figures(models, tmp_path):
    """The "every expert resident" arena, the routed bytes and the slot classes count the trunk's experts only:
    hand arithmetic from the spec (Q8_0: 34 bytes per 32 elements; F16: 2 bytes per element)."""
    name = "deepseek2-fused-mtp"
    _, arch, knobs = MODELS[name]
    s = tiny_spec(arch, **knobs)
    lay = epqlab.inspect(models(name))
    D, f, E = s.n_embd, s.n_ff_exp, s.n_expert
    per_expert = D // 32 * 34 * 2 * f + f * 2 * D  # fused gate_up Q8_0 [D, 2f] + down F16 [f, D]
    trunk = s.n_layer - s.n_dense_lead
    assert lay.routed_expert_bytes == trunk * E * per_expert
    assert lay.mtp_expert_bytes == s.n_nextn * E * per_expert
    assert sum(c.n_experts for c in lay.slot_classes) == trunk * E
    # the same model without its MTP block sizes every arena figure alike
    bare = epqlab.inspect(write_tiny(tmp_path / "bare.gguf", arch, **dict(knobs, n_nextn=0)))
    for f in (epqlab.Pager.all_experts_bytes, epqlab.Pager.min_arena_bytes):
        assert f(lay) == f(bare), f
    assert [(c.expert_bytes, c.n_experts) for c in lay.slot_classes] == \
        [(c.expert_bytes, c.n_experts) for c in bare.slot_classes]
    assert "MTP experts" in lay.summary()


def test_arch_tables_at_real_size():
    """The tables hold expressions of the spec, not tiny numbers: Qwen3.6-35B-A3B's published shape
    (hidden 2048, 40 layers, 3:1 DeltaNet:attention, 16 q / 2 kv heads of 256, DeltaNet 16 key heads and
    32 value heads of 128, conv 4, 256 experts of 512, shared 512, 248,320 tokens) and Laguna's dims give the
    tensor shapes worked out by hand here."""
    q = ArchSpec("qwen35moe", n_layer=40, n_nextn=1, n_embd=2048, n_head=16, n_head_kv=2, head_dim=256, n_rot=64,
                 rope_sections=(11, 11, 10, 0), n_vocab=248320, n_expert=256, n_expert_used=8, n_ff_exp=512,
                 n_ff_shexp=512, ssm_d_conv=4, ssm_d_state=128, ssm_n_group=16, ssm_dt_rank=32)
    t = {n: (shape, typ) for n, shape, typ, _ in arch_tensors(q)}
    assert t["token_embd.weight"][0] == (2048, 248320) and t["output.weight"][0] == (2048, 248320)
    assert t["blk.0.attn_qkv.weight"][0] == (2048, 2 * 16 * 128 + 32 * 128)   # q, k of 16 heads, v of 32 heads
    assert t["blk.0.ssm_conv1d.weight"][0] == (4, 8192) and t["blk.0.ssm_out.weight"][0] == (4096, 2048)
    assert t["blk.3.attn_q.weight"][0] == (2048, 2 * 16 * 256) and t["blk.3.attn_k.weight"][0] == (2048, 512)
    assert "blk.3.attn_qkv.weight" not in t and "blk.4.attn_q.weight" not in t   # 3 is full attention, 4 not
    assert t["blk.39.attn_q.weight"][0] == (2048, 8192) and t["blk.40.attn_q.weight"][0] == (2048, 8192)  # MTP
    assert t["blk.40.ffn_gate_exps.weight"][0] == (2048, 512, 256) and t["blk.40.nextn.eh_proj.weight"][0] == (4096, 2048)
    assert sum(n.endswith("ffn_down_exps.weight") for n in t) == 41
    assert sum(n.endswith("ssm_a") for n in t) == 30    # 3 of every 4 trunk blocks are recurrent
    kv = {k: v for k, _, v in arch_kv(q)}
    assert kv["qwen35moe.block_count"] == 41 and kv["qwen35moe.nextn_predict_layers"] == 1
    assert kv["qwen35moe.ssm.inner_size"] == 4096 and kv["qwen35moe.rope.dimension_sections"] == [11, 11, 10, 0]
    lg = ArchSpec("laguna", n_layer=48, n_dense_lead=1, n_embd=3072, n_head=24, n_head_kv=8, head_dim=128,
                  n_vocab=100352, n_expert=256, n_expert_used=10, n_ff_exp=1024, n_ff_shexp=1024, n_ff_dense=8192,
                  sliding_window=512, gating="sigmoid", weights_scale=2.5, weights_norm=True,
                  expert_types=("Q4_K",) * 3, late_expert_types=("BF16",) * 3, n_late_layers=8)
    t = {n: (shape, typ) for n, shape, typ, _ in arch_tensors(lg)}
    assert t["blk.0.ffn_up.weight"][0] == (3072, 8192) and "blk.0.ffn_up_exps.weight" not in t
    assert t["blk.1.ffn_up_exps.weight"] == ((3072, 1024, 256), "Q4_K")
    assert t["blk.40.ffn_up_exps.weight"] == ((3072, 1024, 256), "BF16") and t["blk.39.ffn_up_exps.weight"][1] == "Q4_K"
    assert t["blk.5.attn_gate.weight"][0] == (3072, 24) and t["blk.5.exp_probs_b.bias"][0] == (256,)
    kv = {k: v for k, _, v in arch_kv(lg)}
    assert kv["laguna.expert_gating_func"] == 2 and kv["laguna.expert_weights_scale"] == 2.5
    assert kv["laguna.leading_dense_block_count"] == 1 and kv["laguna.feed_forward_length"] == 8192


@pytest.mark.parametrize("name", list(ARCH_ROWS))
def test_arch_table(tmp_path, name):
    arch, knobs = ARCH_ROWS[name]
    child = Path(__file__).with_name("arch_child.py")
    r = subprocess.run([sys.executable, str(child), arch, json.dumps(knobs), str(tmp_path / f"{name}.gguf")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"{name}: child exited {r.returncode}\n{r.stderr[-3000:]}"
    row = json.loads(r.stdout.strip().splitlines()[-1])
    if arch in REFUSED_ARCHS:  # a named refusal, and plain llama.cpp loads the same file (it is well formed)
        assert REFUSED_ARCHS[arch] in row["refused"] and f"'{arch}'" in row["refused"], row
        assert row["plain_llama_cpp_loads"], row
        return
    assert "refused" not in row, f"{name}: {row}"
    cols = [f"{a}/{m}" for a in ("half", "min_ub1", "min_ub512") for m in ("slots", "region")]
    assert list(row) == cols + ["batch", "prefix_reuse", "forced", "perplexity"]
    bad = {c: v for c, v in row.items() if v != "exact" and not (c.endswith("/slots") and v.startswith(
        tuple(f"refused: {x}" for x in REFUSALS)))}
    assert not bad, f"{name}: {bad}"
