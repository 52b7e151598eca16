"""Where every routed expert lives in a GGUF file (read with gguf-py, never a hand parser).

A routed-expert tensor is ``blk.N.ffn_{gate,up,down,gate_up}_exps.weight`` with ggml shape
``[ne0, ne1, n_expert]`` (ne0 = row length, the fastest dimension). Expert ``e`` of it is the
contiguous byte range ``[data_offset + e*nb2, data_offset + (e+1)*nb2)`` where
``nb2 = ne1 * row_bytes(ne0)`` is the per-expert byte size of that matrix. The unit of residency
in the pager is one (layer, expert): all its matrices together, ``expert_bytes`` = the sum of
their ``nb2``. Layers whose ``expert_bytes`` are equal share a *slot class*.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field, replace
from pathlib import Path


from .constants import GGUF_MAGIC
from .errors import ModelNotFoundError, NotGGUFError, NotMoEError, SplitModelError, TruncatedModelError
from .loader_checks import (check_attention_shapes, check_graph_keys, check_hparams, check_norm_eps, check_pageable,
                            check_required_tensors, check_rope, check_tensor_types, check_vocab)
from .units import fmt_bytes

EXPERT_TENSOR_RE = re.compile(r"^blk\.(\d+)\.ffn_(gate_up|gate|up|down)_exps\.weight$")
SPLIT_NAME_RE = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")  # llama_split_path's
PER_EXPERT_RE = re.compile(r"^blk\.\d+\.ffn_(gate|up|down)\.\d+\.weight$")


@dataclass(frozen=True)
class ExpertTensor:
    """One routed-expert weight tensor of one layer.

    Attributes:
        name: GGUF tensor name, e.g. ``blk.3.ffn_up_exps.weight``.
        kind: ``"gate"``, ``"up"``, ``"down"`` or ``"gate_up"`` (fused).
        ggml_type: ggml type name, e.g. ``"Q8_0"``, ``"F16"``, ``"BF16"``.
        shape: ggml order ``(ne0, ne1, n_expert)``; ne0 is the row length.
        offset: absolute offset of the tensor data in its file (``ModelLayout.files[file]``), bytes.
        expert_bytes: bytes per expert = nb[2].
        n_bytes: bytes of the whole tensor = ``expert_bytes * n_expert``.
        file: index of the file holding it in ``ModelLayout.files`` (0 unless the model is split).
    """

    name: str
    kind: str
    ggml_type: str
    shape: tuple[int, int, int]
    offset: int
    expert_bytes: int
    n_bytes: int
    file: int = 0

    def expert_offset(self, expert: int) -> int:
        """Absolute file offset (bytes) of expert ``expert``'s slice of this tensor."""
        return self.offset + expert * self.expert_bytes


@dataclass(frozen=True)
class ExpertLayer:
    """The routed experts of one MoE layer (GGUF block ``layer``).

    ``tensors`` are in a fixed order: gate, up, down (or gate_up, down).
    ``expert_bytes`` is the size of one (layer, expert) unit: the sum of its matrices' nb[2].
    """

    layer: int
    tensors: tuple[ExpertTensor, ...]

    @property
    def expert_bytes(self) -> int:
        return sum(t.expert_bytes for t in self.tensors)

    @property
    def types(self) -> tuple[str, ...]:
        return tuple(t.ggml_type for t in self.tensors)


@dataclass(frozen=True)
class SlotClass:
    """A distinct per-(layer, expert) byte size, the layers that have it and their tensor types."""

    expert_bytes: int
    layers: tuple[int, ...]
    types: tuple[str, ...]
    n_experts: int  # (layer, expert) units of this class = len(layers) * n_expert

    @property
    def total_bytes(self) -> int:
        return self.expert_bytes * self.n_experts


@dataclass
class ModelLayout:
    """Routed-expert layout of a MoE GGUF. Built by :func:`inspect`.

    Attributes:
        path: the GGUF file; of a split model, its first shard (what llama.cpp loads).
        file_size: bytes, all shards together.
        architecture: ``general.architecture`` (e.g. ``llama``, ``qwen3moe``).
        name: ``general.name`` or the file stem.
        n_layer: ``<arch>.block_count``.
        n_expert: ``<arch>.expert_count``.
        n_expert_used: ``<arch>.expert_used_count`` (top-k).
        layers: MoE layers in block order that an ordinary context routes (the trunk: MTP blocks excluded).
        routed_expert_bytes: bytes of the routed-expert tensors of :attr:`layers`.
        non_expert_bytes: bytes of every other tensor (attention, norms, router, shared experts, embeddings),
            MTP experts excluded.
        mtp_layers: the routed experts of the trailing multi-token-prediction blocks
            (``<arch>.nextn_predict_layers``: qwen35moe, glm4moe, deepseek2 GLM-style, bailingmoe2): llama.cpp
            loads these blocks only for an MTP draft context, so they are outside every arena figure here
            (slot classes, coverage, "all experts"), ready for an MTP context to page them.
        mtp_expert_bytes: bytes of the routed-expert tensors of :attr:`mtp_layers`.
        alignment: ``general.alignment`` (tensor data alignment, bytes; 32 by default).
        dense_tensors: ``(name, offset, n_bytes)`` of every non-expert tensor, in (file, offset)
            order (absolute offsets in file ``dense_files[i]``, bytes): what stays resident outside
            the arena.
        data_offset: absolute offset of the first tensor's data (end of the header) in ``path``, bytes.
        files: every file of the model: ``[path]``, or the shards of a split GGUF in ``split.no``
            order (``NAME-00001-of-0000N.gguf`` ...). Tensor offsets are relative to their own file.
        file_sizes: bytes of each of ``files``.
        data_offsets: end of each file's header (first tensor data), bytes.
        dense_files: index in ``files`` of each entry of ``dense_tensors``.
        file_mtimes_ns: mtime of each of ``files`` when read (the cache key), ns.
    """

    path: Path
    file_size: int
    architecture: str
    name: str
    n_layer: int
    n_expert: int
    n_expert_used: int
    layers: list[ExpertLayer]
    routed_expert_bytes: int
    non_expert_bytes: int
    alignment: int
    n_tensors: int
    metadata: dict = field(default_factory=dict, repr=False)
    dense_tensors: list = field(default_factory=list, repr=False)
    data_offset: int = 0
    files: list = field(default_factory=list)
    file_sizes: list = field(default_factory=list, repr=False)
    data_offsets: list = field(default_factory=list, repr=False)
    dense_files: list = field(default_factory=list, repr=False)
    file_mtimes_ns: list = field(default_factory=list, repr=False)
    mtp_layers: list = field(default_factory=list, repr=False)
    mtp_expert_bytes: int = 0

    def __post_init__(self):
        if not self.files:
            self.files = [self.path]
            self.file_sizes = [self.file_size]
            self.data_offsets = [self.data_offset]
        if not self.dense_files:
            self.dense_files = [0] * len(self.dense_tensors)

    @property
    def n_files(self) -> int:
        """1 for a single-file GGUF, else the number of shards."""
        return len(self.files)

    def dense_ranges(self, file: int | None = None) -> list[tuple[int, int]]:
        """``(offset, n_bytes)`` of the non-expert tensors, bytes: of file ``file`` (an index in
        :attr:`files`), or of every file when None (then offsets of different files mix: use it
        for totals only)."""
        return [(off, n) for (_, off, n), f in zip(self.dense_tensors, self.dense_files) if file is None or f == file]
    @property
    def is_moe(self) -> bool:
        """True when the file has routed-expert tensors."""
        return bool(self.layers)

    @property
    def moe_layers(self) -> list[int]:
        """GGUF block ids of the layers that have routed experts, ascending."""
        return [l.layer for l in self.layers]

    def with_mtp(self) -> "ModelLayout":
        """This layout with the MTP blocks' routed experts as ordinary MoE layers (appended to :attr:`layers`,
        counted in :attr:`routed_expert_bytes`): what a Session with an MTP draft context pages, so its arena
        figures and coverage include them (epqlab/engine/speculative.py). Itself when there are none."""
        if not self.mtp_layers:
            return self
        return replace(self, layers=list(self.layers) + list(self.mtp_layers),
                       routed_expert_bytes=self.routed_expert_bytes + self.mtp_expert_bytes,
                       mtp_layers=[], mtp_expert_bytes=0)

    @property
    def mtp_moe_layers(self) -> list[int]:
        """GGUF block ids of the MTP blocks that have routed experts (:attr:`mtp_layers`), ascending."""
        return [l.layer for l in self.mtp_layers]

    def layer(self, il: int) -> ExpertLayer:
        """The :class:`ExpertLayer` of GGUF block ``il``. Raises KeyError if it has no routed experts."""
        for l in self.layers:
            if l.layer == il:
                return l
        raise KeyError(f"block {il} has no routed experts; MoE layers are {self.moe_layers}")

    @property
    def slot_classes(self) -> list[SlotClass]:
        """Distinct per-expert unit sizes, largest first (the pager's slot classes)."""
        by_size: dict[int, list[ExpertLayer]] = {}
        for l in self.layers:
            by_size.setdefault(l.expert_bytes, []).append(l)
        out = []
        for size in sorted(by_size, reverse=True):
            ls = by_size[size]
            types = tuple(sorted({t for l in ls for t in l.types}))
            out.append(SlotClass(size, tuple(l.layer for l in ls), types, len(ls) * self.n_expert))
        return out

    @property
    def max_expert_bytes(self) -> int:
        return max((l.expert_bytes for l in self.layers), default=0)

    def budget_coverage(self, budget_bytes: int) -> float:
        """Fraction (0..1) of all (layer, expert) units that fit in ``budget_bytes`` when the
        budget is shared across slot classes in proportion to their total bytes (the pager's split)."""
        return min(1.0, budget_bytes / self.routed_expert_bytes) if self.routed_expert_bytes else 1.0

    def summary(self) -> str:
        """Human-readable table: layers grouped by expert type, bytes/expert and totals."""
        lines = [
            f"model        {self.path}",
            f"arch         {self.architecture}  ({self.name})",
            f"layers       {self.n_layer} blocks, {len(self.layers)} MoE",
            f"experts      {self.n_expert} per layer, top-k {self.n_expert_used}",
            f"file         {fmt_bytes(self.file_size)}" + (f" in {self.n_files} shards" if self.n_files > 1 else ""),
            f"routed       {fmt_bytes(self.routed_expert_bytes)} ({self.routed_expert_bytes / max(1, self.file_size):.1%} of file)",
            f"non-expert   {fmt_bytes(self.non_expert_bytes)}",
        ]
        if self.mtp_layers:
            lines.append(f"MTP experts  {fmt_bytes(self.mtp_expert_bytes)} in block(s) {_ranges(self.mtp_moe_layers)} "
                         "(multi-token prediction: not routed by an ordinary context, outside the arena figures)")
        lines += [
            "",
            f"{'layers':<16} {'types':<22} {'bytes/expert':>14} {'experts':>8} {'total':>12}",
        ]
        for c in self.slot_classes:
            lines.append(
                f"{_ranges(c.layers):<16} {'/'.join(c.types):<22} {fmt_bytes(c.expert_bytes):>14} "
                f"{c.n_experts:>8} {fmt_bytes(c.total_bytes):>12}"
            )
        return "\n".join(lines)


def _ranges(xs) -> str:
    xs = sorted(xs)
    out, start, prev = [], None, None
    for x in xs:
        if start is None:
            start = prev = x
        elif x == prev + 1:
            prev = x
        else:
            out.append(f"{start}" if start == prev else f"{start}-{prev}")
            start = prev = x
    if start is not None:
        out.append(f"{start}" if start == prev else f"{start}-{prev}")
    return ",".join(out)


def _field_value(reader, key: str):
    f = reader.fields.get(key)
    if f is None:
        return None
    try:
        return f.contents()
    except Exception:  # older gguf-py without contents()
        v = f.parts[f.data[0]]
        return v.tolist()[0] if len(v) == 1 else bytes(v).decode("utf-8", "replace")


def _light_reader_class():
    """gguf-py's GGUFReader, reading metadata arrays the light way: a numeric array becomes one
    NumPy view (not one per element), and a long string array (the tokenizer's vocabulary and
    merges) is skipped over, since a layout never needs it. gguf-py's eager per-element parse of
    a 49K-token vocabulary takes seconds and ~160 MiB -- more than a small RAM budget -- before any
    Session exists. Everything else is gguf-py's own parsing."""
    import numpy as np
    from gguf import GGUFReader, GGUFValueType

    class LightReader(GGUFReader):
        def _get_field_parts(self, orig_offs, raw_type):
            if GGUFValueType(raw_type) != GGUFValueType.ARRAY:
                return super()._get_field_parts(orig_offs, raw_type)
            offs = orig_offs
            raw_itype = self._get(offs, np.uint32)
            offs += int(raw_itype.nbytes)
            alen = self._get(offs, np.uint64)
            offs += int(alen.nbytes)
            itype, n = GGUFValueType(int(raw_itype[0])), int(alen[0])
            nptype = self.gguf_scalar_to_np.get(itype)
            if nptype is not None:
                vals = self._get(offs, nptype, n)
                return offs + int(vals.nbytes) - orig_offs, [raw_itype, alen, vals], [2], [GGUFValueType.ARRAY, itype]
            if itype == GGUFValueType.STRING and n > 256:
                for _ in range(n):
                    offs += 8 + int(self._get(offs, np.uint64)[0])
                return offs - orig_offs, [raw_itype, alen], [], [GGUFValueType.ARRAY, itype]
            return super()._get_field_parts(orig_offs, raw_type)

    return LightReader


def _open_reader(path: Path):
    GGUFReader = _light_reader_class()

    with open(path, "rb") as fh:
        magic = fh.read(4)
    if not magic:
        raise NotGGUFError(f"{path} is empty (0 bytes), not a GGUF model: the download or copy failed; fetch it again.")
    if magic != GGUF_MAGIC:
        raise NotGGUFError(
            f"{path} is not a GGUF file (starts with {magic!r}, expected b'GGUF'). "
            "Pass a .gguf model file; convert other formats with llama.cpp's convert_hf_to_gguf.py."
        )
    try:
        return GGUFReader(path, "r")
    except (ValueError, IndexError, OverflowError, KeyError) as e:
        msg = str(e)
        if "version" in msg and "handle" in msg:
            raise NotGGUFError(f"{path}: unsupported GGUF version ({msg}). Re-convert with a current llama.cpp.") from e
        if isinstance(e, UnicodeDecodeError) or "is not a valid" in msg or "alignment" in msg:
            # a key, string or tensor name that is not UTF-8, a value/tensor type id no GGUF defines, or a
            # general.alignment that is not a power-of-2 UINT32 (gguf-py checks it as gguf.cpp does)
            raise NotGGUFError(
                f"{path}: the GGUF header is corrupt ({msg[:200]}). Download or copy the file again, or re-convert it."
            ) from e
        raise TruncatedModelError(
            f"{path} ({os.path.getsize(path)} bytes) ends before its header or tensor data does ({msg}). "
            "The file is truncated or corrupt: download or copy it again."
        ) from e


def _type_name(t) -> str:
    from gguf import GGMLQuantizationType

    return GGMLQuantizationType(int(t.tensor_type)).name


_KIND_ORDER = {"gate": 0, "gate_up": 0, "up": 1, "down": 2}


_CACHE: dict[tuple, ModelLayout] = {}


def inspect(path: str | os.PathLike, require_moe: bool = True) -> ModelLayout:
    """Read the routed-expert layout of a MoE GGUF file (single file or split shards).

    gguf-py parses every metadata array (a 49K-token vocabulary takes seconds), so layouts are
    cached per process by (real path, size, mtime) of every file; treat the returned object as
    read-only.

    Args:
        path: a GGUF file, or any shard of a split GGUF (``NAME-0000i-of-0000N.gguf`` with
            ``split.count`` = N, as written by llama.cpp's gguf-split or gguf-py's GGUFWriter): all
            N shards are read and the layout's ``path`` is the first one, which is what llama.cpp loads.
        require_moe: raise :class:`NotMoEError` for a dense model (default). With False a dense
            model yields a layout with no expert layers (for plain runs and perplexity).

    Returns:
        :class:`ModelLayout` with per-layer expert tensors (type, shape, file and offset in it,
        bytes per expert = nb[2]), totals and slot classes.

    Raises:
        ModelNotFoundError: the path does not exist or is not a file.
        NotGGUFError: bad magic, unsupported GGUF version, misplaced or duplicated tensors, or metadata,
            tokenizer or tensor types llama.cpp would abort the process on (:mod:`epqlab.loader_checks`).
        TruncatedModelError: header or tensor data past end of file.
        SplitModelError: a broken split set: a shard missing, a shard name that does not follow
            llama.cpp's ``-0000i-of-0000N.gguf`` pattern, ``split.no``/``split.count`` that disagree
            with the names, or a tensor count other than ``split.tensors.count``.
        NotMoEError: no ``blk.N.ffn_*_exps.weight`` tensors (a dense model).
        UnsupportedArchError: a MoE architecture epqlab cannot page (:data:`epqlab.loader_checks.UNPAGEABLE_ARCHS`).
    """
    path = Path(path)
    if not path.exists():
        raise ModelNotFoundError(f"model file not found: {path}. Check the path, or run `epqlab model default` for the embedded model.")
    if not path.is_file():
        raise ModelNotFoundError(f"{path} is not a regular file; pass the .gguf file itself.")
    st = path.stat()
    key = (os.path.realpath(path), st.st_size, st.st_mtime_ns)
    layout = _CACHE.get(key)
    if layout is None or not _unchanged(layout):
        layout = _CACHE[key] = _inspect(path)
    if require_moe and not layout.is_moe:
        raise NotMoEError(
            f"{path} ({layout.architecture}) has no routed-expert tensors (blk.N.ffn_*_exps.weight): it is a dense model. "
            "epqlab pages routed experts; run dense models with pager=False or plain llama.cpp."
        )
    return layout


def _unchanged(layout: ModelLayout) -> bool:
    """True when every file of a cached layout still has the size and mtime it was read with."""
    for f, size, mtime in zip(layout.files, layout.file_sizes, layout.file_mtimes_ns):
        try:
            st = os.stat(f)
        except OSError:
            return False
        if (st.st_size, st.st_mtime_ns) != (size, mtime):
            return False
    return True


def _check_placement(path: Path, reader, alignment: int, file_size: int) -> None:
    """Raise NotGGUFError naming the tensor whose data is misaligned, overlaps another or ends
    past the file (llama.cpp would refuse to load it later, with a vaguer message)."""
    ts = sorted(reader.tensors, key=lambda t: int(t.data_offset))
    if not ts:
        return
    base = int(ts[0].data_offset)
    prev = None
    for t in ts:
        off, n = int(t.data_offset), int(t.n_bytes)
        if (off - base) % alignment:
            raise NotGGUFError(
                f"{path}: tensor {t.name} starts at byte {off}, not a multiple of general.alignment={alignment} from "
                f"the data section at {base}: the file is corrupt or was edited by hand; re-convert it.")
        if prev is not None and off < int(prev.data_offset) + int(prev.n_bytes):
            raise NotGGUFError(
                f"{path}: tensor {t.name} (bytes {off}..{off + n}) overlaps {prev.name} (ends at "
                f"{int(prev.data_offset) + int(prev.n_bytes)}): the file is corrupt; re-convert it.")
        prev = t
    # gguf.cpp (gguf_init_from_reader) wants the tensors packed in header order, each at the
    # aligned end of the one before: a tensor whose dims or offset changed breaks that.
    start = int(getattr(reader, "data_offset", base))
    expect = 0
    for t in reader.tensors:
        rel = int(t.data_offset) - start
        if rel != expect:
            raise NotGGUFError(
                f"{path}: tensor {t.name} has data offset {rel}, but the tensors before it in the header end at {expect} "
                "(GGUF packs tensor data in header order; llama.cpp refuses anything else): the file is corrupt; "
                "re-convert it.")
        expect += -(-int(t.n_bytes) // alignment) * alignment
    for t in ts:
        end = int(t.data_offset) + int(t.n_bytes)
        if end > file_size:
            raise TruncatedModelError(
                f"{path}: tensor {t.name} data ends at byte {end} but the file has {file_size} bytes. "
                "The file is truncated: download or copy it again."
            )


def _int_key(path: Path, reader, key: str):
    v = _field_value(reader, key)
    if v is None:
        return None
    try:
        return int(v)
    except (TypeError, ValueError):
        raise SplitModelError(f"{path}: {key} is {v!r}, not an integer: the shard is corrupt; re-split the model.") from None


def _shard_readers(path: Path, reader) -> list[tuple[Path, object]]:
    """``[(path, reader)]`` of every file of the model, in ``split.no`` order: ``[(path, reader)]``
    for a single file, else each shard found by llama.cpp's naming rule
    (``llama_split_path``: ``PREFIX-%05d-of-%05d.gguf``), its ``split.no``/``split.count`` checked."""
    count = _int_key(path, reader, "split.count")
    if count is None or count <= 1:
        return [(path, reader)]
    no = _int_key(path, reader, "split.no")
    m = SPLIT_NAME_RE.match(path.name)
    if m is None or int(m["count"]) != count:
        raise SplitModelError(
            f"{path.name} says it is one of {count} split shards (split.count) but its name does not end in "
            f"-0000i-of-{count:05d}.gguf, so its other shards cannot be found (llama.cpp finds them by name). "
            f"Rename the shards NAME-00001-of-{count:05d}.gguf ... NAME-{count:05d}-of-{count:05d}.gguf.")
    if no is None or int(m["no"]) != no + 1:
        raise SplitModelError(
            f"{path.name}: its name says shard {int(m['no'])} but split.no says {'nothing' if no is None else no + 1}: "
            "the shards were renamed or are corrupt; re-split the model (llama-gguf-split --split).")
    out = []
    for i in range(count):
        p = path.with_name(f"{m['prefix']}-{i + 1:05d}-of-{count:05d}.gguf")
        if i == no:
            out.append((path, reader))
            continue
        if not p.is_file():
            raise SplitModelError(
                f"shard {i + 1} of {count} of {m['prefix']} is missing: {p} does not exist. A split model needs all "
                f"its shards side by side in one directory; download or copy the missing one.")
        r = _open_reader(p)
        c2, n2 = _int_key(p, r, "split.count"), _int_key(p, r, "split.no")
        if c2 != count or n2 != i:
            raise SplitModelError(
                f"{p.name} has split.no={n2} and split.count={c2}, expected {i} and {count} (from its name and "
                f"{path.name}): the shards come from different split runs; re-split the model.")
        out.append((p, r))
    return out


def _inspect(path: Path) -> ModelLayout:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    shards = _shard_readers(path, _open_reader(path))
    path, reader = shards[0]  # metadata lives in the first shard
    arch = str(_field_value(reader, "general.architecture") or "unknown")
    name = str(_field_value(reader, "general.name") or (SPLIT_NAME_RE.match(path.name)["prefix"] if len(shards) > 1 else path.stem))
    alignment = int(_field_value(reader, "general.alignment") or 32)

    def hp(key, default=0, low=False):
        # llama.cpp accepts per-layer arrays for several hyperparameters; the arena must hold the
        # largest value any layer uses (low=True: the smallest, for the range checks)
        v = _field_value(reader, f"{arch}.{key}")
        try:
            if isinstance(v, (list, tuple)):
                return (min if low else max)((int(x) for x in v), default=default)
            return int(v) if v is not None else default
        except (TypeError, ValueError, OverflowError):
            raise NotGGUFError(f"{path}: {arch}.{key} is {str(v)[:80]!r}, not an integer: the file is corrupt or "
                               "mis-converted; re-convert it.") from None

    n_layer = hp("block_count")
    file_sizes = [p.stat().st_size for p, _ in shards]
    by_layer: dict[int, list[ExpertTensor]] = {}
    routed = 0
    total = 0
    n_tensors = 0
    seen: dict[str, Path] = {}
    dense: list[tuple[int, str, int, int]] = []
    per_expert: list[str] = []
    for fi, (p, r) in enumerate(shards):
        _check_placement(p, r, int(_field_value(r, "general.alignment") or alignment), file_sizes[fi])
        for t in r.tensors:
            if t.name in seen:
                raise NotGGUFError(f"{p}: tensor {t.name} is also in {seen[t.name]}: a tensor may appear once "
                                   "(llama.cpp refuses duplicated tensors); re-convert or re-split the model.")
            seen[t.name] = p
            n_tensors += 1
            total += int(t.n_bytes)
            if PER_EXPERT_RE.match(t.name):
                per_expert.append(t.name)
            m = EXPERT_TENSOR_RE.match(t.name)
            if not m:
                dense.append((fi, t.name, int(t.data_offset), int(t.n_bytes)))
                continue
            dims = [int(d) for d in t.shape]
            if len(dims) != 3:
                raise NotGGUFError(f"{p}: expert tensor {t.name} has shape {dims}, expected 3 dims [ne0, ne1, n_expert].")
            qtype = GGMLQuantizationType(int(t.tensor_type))
            block, type_size = GGML_QUANT_SIZES[qtype]
            row_bytes = dims[0] // block * type_size
            nb2 = row_bytes * dims[1]
            if nb2 * dims[2] != int(t.n_bytes):
                raise NotGGUFError(f"{p}: expert tensor {t.name} holds {int(t.n_bytes)} bytes, but its shape {dims} "
                                   f"and type {qtype.name} need {nb2 * dims[2]}: the file is corrupt; re-convert it.")
            routed += int(t.n_bytes)
            il = int(m.group(1))
            by_layer.setdefault(il, []).append(
                ExpertTensor(t.name, m.group(2), qtype.name, (dims[0], dims[1], dims[2]), int(t.data_offset), nb2,
                             int(t.n_bytes), fi))
    if len(shards) > 1:
        want = _int_key(path, reader, "split.tensors.count")
        if want is not None and want != n_tensors:
            raise SplitModelError(
                f"{path.name}: split.tensors.count says {want} tensors but its {len(shards)} shards hold {n_tensors}: "
                "a shard is from another split run or corrupt; re-split the model.")
    n_expert_kv = hp("expert_count")
    n_expert_used = hp("expert_used_count")
    metadata = {k: _field_value(reader, k) for k in reader.fields if not k.startswith("tokenizer.ggml.") and not k.startswith("GGUF.")}
    file_mtimes = [p.stat().st_mtime_ns for p, _ in shards]
    data_offsets = [min((int(t.data_offset) for t in r.tensors), default=file_sizes[i]) for i, (_, r) in enumerate(shards)]
    files = [p for p, _ in shards]
    if not by_layer and per_expert:
        raise NotMoEError(
            f"{path} ({arch}) stores its routed experts one tensor per expert ({per_expert[0]}, ...): the legacy "
            "per-expert layout. llama.cpp and epqlab need merged blk.N.ffn_{gate,up,down}_exps tensors; re-convert "
            "the model with a current llama.cpp convert_hf_to_gguf.py (or merge the tensors with gguf-py)."
        )
    all_layers = [
        ExpertLayer(il, tuple(sorted(ts, key=lambda t: _KIND_ORDER[t.kind])))
        for il, ts in sorted(by_layer.items())
    ]
    # The last nextn_predict_layers blocks are multi-token-prediction (MTP) blocks: llama.cpp loads them only
    # for an MTP context (TENSOR_SKIP otherwise, src/models/qwen35moe.cpp, glm4-moe.cpp, deepseek2.cpp), so an
    # ordinary context never routes their experts: they are kept out of the routed-expert accounting.
    mtp_first = n_layer - max(0, hp("nextn_predict_layers"))
    layers = [l for l in all_layers if l.layer < mtp_first]
    mtp_layers = [l for l in all_layers if l.layer >= mtp_first]
    mtp_bytes = sum(t.n_bytes for l in mtp_layers for t in l.tensors)
    routed -= mtp_bytes
    n_expert = n_expert_kv or (layers[0].tensors[0].shape[2] if layers else 0)
    for l in all_layers:
        for t in l.tensors:
            if t.shape[2] != n_expert:
                raise NotGGUFError(f"{path}: {t.name} has {t.shape[2]} experts but {arch}.expert_count is {n_expert}.")
    # what llama.cpp would abort the process on (epqlab/loader_checks.py), refused before it loads
    check_hparams(path, arch, hp, n_expert_kv, n_expert_used, n_expert if layers else 0)
    check_norm_eps(path, arch, lambda key: _field_value(reader, f"{arch}.{key}"))
    check_graph_keys(path, arch, lambda key: _field_value(reader, f"{arch}.{key}"))
    check_rope(path, arch, lambda key: _field_value(reader, f"{arch}.{key}"), hp)
    check_attention_shapes(path, arch, lambda key: _field_value(reader, f"{arch}.{key}"), hp,
                           {t.name: [int(x) for x in t.shape] for _, r in shards for t in r.tensors if ".attn_" in t.name})
    check_tensor_types(path, [(t.name, _type_name(t)) for _, r in shards for t in r.tensors])
    check_required_tensors(path, arch, [t.name for _, r in shards for t in r.tensors])
    if layers:
        check_pageable(path, arch)
    check_vocab(path, reader, lambda key: _field_value(reader, key))
    dense.sort(key=lambda d: (d[0], d[2]))
    return ModelLayout(
        path=path,
        file_size=sum(file_sizes),
        architecture=arch,
        name=name,
        n_layer=n_layer,
        n_expert=n_expert,
        n_expert_used=n_expert_used,
        layers=layers,
        routed_expert_bytes=routed,
        non_expert_bytes=total - routed - mtp_bytes,
        mtp_layers=mtp_layers,
        mtp_expert_bytes=mtp_bytes,
        alignment=alignment,
        n_tensors=n_tensors,
        metadata=metadata,
        dense_tensors=[(n, off, nb) for _, n, off, nb in dense],
        data_offset=data_offsets[0],
        files=files,
        file_sizes=file_sizes,
        data_offsets=data_offsets,
        dense_files=[fi for fi, _, _, _ in dense],
        file_mtimes_ns=file_mtimes,
    )


__all__ = ["ExpertTensor", "ExpertLayer", "SlotClass", "ModelLayout", "inspect"]
