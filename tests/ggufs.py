"""Small MoE GGUF files for layout and pager tests, written with gguf-py's GGUFWriter.

The files are not runnable models: they hold routed-expert tensors with known random bytes
(plus a couple of non-expert tensors), so tests can compare any byte range with what was
written. Sizes are computed here from the ggml block table, independently of epqlab.layout.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import gguf

from epqlab.models.gguf_rewrite import DROP, rewrite_gguf

# ggml block size (elements) and bytes per block, from ggml's type table.
# The tests' own table (not gguf-py's, which epqlab uses), shared by every test that computes tensor bytes.
BLOCK = {"F32": (1, 4), "F16": (1, 2), "BF16": (1, 2), "Q8_0": (32, 34), "Q4_0": (32, 18), "Q4_K": (256, 144),
         "MXFP4": (32, 17)}


@dataclass
class LayerSpec:
    layer: int
    ggml_type: str
    n_embd: int
    n_ff: int
    fused: bool = False


@dataclass
class Written:
    path: Path
    n_expert: int
    n_expert_used: int
    n_layer: int
    # name -> (ggml type, ggml shape (ne0, ne1, ne2), bytes as np.uint8 [n_bytes])
    tensors: dict = field(default_factory=dict)

    def expert_bytes(self, name: str) -> int:
        t, (ne0, ne1, _), _ = self.tensors[name]
        blk, size = BLOCK[t]
        return ne0 // blk * size * ne1

    def expert_slice(self, name: str, e: int) -> bytes:
        nb = self.expert_bytes(name)
        return self.tensors[name][2][e * nb:(e + 1) * nb].tobytes()


def _raw(rng, ggml_type: str, ne0: int, ne1: int, ne2: int) -> np.ndarray:
    blk, size = BLOCK[ggml_type]
    assert ne0 % blk == 0, (ggml_type, ne0)
    row = ne0 // blk * size
    return rng.integers(0, 256, size=(ne2, ne1, row), dtype=np.uint8)


def write_moe(path, layers: list[LayerSpec], n_expert=8, n_expert_used=2, n_layer=None, alignment=None,
              arch="llama", seed=0, dense_first=True) -> Written:
    """Write a MoE GGUF whose routed-expert tensors hold random bytes. Returns what was written."""
    rng = np.random.default_rng(seed)
    path = Path(path)
    n_layer = n_layer or (max(l.layer for l in layers) + 1)
    w = gguf.GGUFWriter(str(path), arch)
    if alignment:
        w.add_custom_alignment(alignment)
    w.add_block_count(n_layer)
    w.add_expert_count(n_expert)
    if isinstance(n_expert_used, (list, tuple)):  # a per-layer array, as llama.cpp's loader also reads
        w.add_array(f"{arch}.expert_used_count", [int(x) for x in n_expert_used])
        n_expert_used = max(n_expert_used)
    else:
        w.add_expert_used_count(n_expert_used)
    w.add_embedding_length(layers[0].n_embd)
    out = Written(path, n_expert, n_expert_used, n_layer)
    emb = rng.standard_normal((16, layers[0].n_embd)).astype(np.float32)
    w.add_tensor("token_embd.weight", emb)
    out.tensors["token_embd.weight"] = ("F32", (layers[0].n_embd, 16, 1), emb.view(np.uint8).ravel())
    for l in layers:
        norm = rng.standard_normal(l.n_embd).astype(np.float32)
        w.add_tensor(f"blk.{l.layer}.ffn_norm.weight", norm)
        router = rng.standard_normal((n_expert, l.n_embd)).astype(np.float32)
        w.add_tensor(f"blk.{l.layer}.ffn_gate_inp.weight", router)
        kinds = [("gate_up", l.n_embd, 2 * l.n_ff)] if l.fused else [("gate", l.n_embd, l.n_ff), ("up", l.n_embd, l.n_ff)]
        kinds.append(("down", l.n_ff, l.n_embd))
        for kind, ne0, ne1 in kinds:
            name = f"blk.{l.layer}.ffn_{kind}_exps.weight"
            raw = _raw(rng, l.ggml_type, ne0, ne1, n_expert)
            w.add_tensor(name, raw, raw_dtype=gguf.GGMLQuantizationType[l.ggml_type])
            out.tensors[name] = (l.ggml_type, (ne0, ne1, n_expert), raw.ravel())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def two_class_model(path, seed=0) -> Written:
    """Q8_0 experts in blocks 1-3 (58752 B per matrix: not a page multiple, 32-byte aligned) and
    F16 experts in blocks 4-5; block 0 dense (no experts)."""
    layers = [LayerSpec(i, "Q8_0", 576, 96) for i in (1, 2, 3)] + [LayerSpec(i, "F16", 576, 96) for i in (4, 5)]
    return write_moe(path, layers, n_expert=8, n_expert_used=2, n_layer=6, seed=seed)


def aligned_model(path, seed=0) -> Written:
    """F32 experts of exactly 2 pages per matrix at 4096-byte alignment: every slice page-aligned."""
    layers = [LayerSpec(i, "F32", 128, 16) for i in range(3)]
    return write_moe(path, layers, n_expert=8, n_expert_used=2, alignment=4096, seed=seed)


def tiny_slices_model(path, seed=0) -> Written:
    """Experts smaller than a page (Q8_0 64x32 -> 2176 B): many experts share each page."""
    layers = [LayerSpec(i, "Q8_0", 64, 32) for i in range(2)]
    return write_moe(path, layers, n_expert=16, n_expert_used=3, seed=seed)


def fused_model(path, seed=0) -> Written:
    """Fused gate_up + down experts."""
    layers = [LayerSpec(i, "Q8_0", 128, 32, fused=True) for i in range(2)]
    return write_moe(path, layers, n_expert=4, n_expert_used=2, seed=seed)


def split_gguf(src, out_prefix, n_shards: int, shard_of=None) -> list[Path]:
    """Write ``src`` as ``n_shards`` split GGUFs named like llama.cpp's gguf-split does
    (``{out_prefix}-0000i-of-0000n.gguf``): every shard has ``split.no`` (u16), ``split.count``
    (u16) and ``split.tensors.count`` (i32); the first shard also carries all of ``src``'s
    metadata. ``shard_of(i, name)`` picks the shard of the i-th tensor (default: GGUF block
    number modulo n_shards, non-block tensors in shard 0), so the routed experts of different
    layers sit in different files. Returns the shard paths in order."""
    import re

    r = gguf.GGUFReader(src)
    if shard_of is None:
        def shard_of(i, name):
            m = re.match(r"blk\.(\d+)\.", name)
            return int(m.group(1)) % n_shards if m else 0
    groups: list[list] = [[] for _ in range(n_shards)]
    for i, t in enumerate(r.tensors):
        groups[shard_of(i, t.name)].append(t)
    arch = str(r.fields["general.architecture"].contents())
    paths = []
    for s in range(n_shards):
        p = Path(f"{out_prefix}-{s + 1:05d}-of-{n_shards:05d}.gguf")
        w = gguf.GGUFWriter(str(p), arch)
        if s == 0:
            for k, f in r.fields.items():
                if k.startswith("GGUF.") or k == "general.architecture":
                    continue
                vt = gguf.GGUFValueType(f.types[0])
                sub = gguf.GGUFValueType(f.types[-1]) if vt == gguf.GGUFValueType.ARRAY else None
                w.add_key_value(k, f.contents(), vt, sub_type=sub)
        w.add_uint16("split.no", s)
        w.add_uint16("split.count", n_shards)
        w.add_int32("split.tensors.count", len(r.tensors))
        for t in groups[s]:
            w.add_tensor_info(t.name, t.data.shape, t.data.dtype, int(t.data.nbytes), raw_dtype=t.tensor_type)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for t in groups[s]:
            w.write_tensor_data(np.asarray(t.data))
        w.close()
        paths.append(p)
    return paths


def shrink_vocab(src, dst, n_vocab: int = 512) -> Path:
    """Copy the runnable GGUF ``src`` keeping only its first ``n_vocab`` tokens: the tokenizer's
    token and type arrays cut, merges kept where both halves and the result survive, the
    token_embd/output rows cut. A header of a few KiB that llama.cpp still loads and runs (for
    tests that rewrite or parse headers many times)."""
    toks = gguf.GGUFReader(src).fields["tokenizer.ggml.tokens"].contents()[:n_vocab]
    keep = set(toks)

    def edit_value(k, v):
        if k == "tokenizer.ggml.tokens":
            return toks
        if k in ("tokenizer.ggml.token_type", "tokenizer.ggml.scores"):
            return v[:n_vocab]
        if k == "tokenizer.ggml.merges":
            return [m for m in v if all(p in keep for p in m.split(" ")) and m.replace(" ", "") in keep] or v[:1]
        if k.startswith("tokenizer.ggml.") and k.endswith("_token_id") and int(v) >= n_vocab:
            return DROP
        return v

    rewrite_gguf(src, dst, edit_value=edit_value,
                 tensor_data=lambda name, d: d[:n_vocab] if name in ("token_embd.weight", "output.weight") else d)
    return Path(dst)
