"""Copy a GGUF file with some metadata or tensors changed, through gguf-py (reader and writer).

For the tools that derive one model from another: cutting a vocabulary, adding or dropping a key,
writing a deliberately broken header to test a loader. Tensor bytes are copied as they are (quantized
types keep their raw blocks) unless ``tensor_data`` changes them.
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

from ..results import atomic_path

DROP = object()
"""Returned by an ``edit_value`` callback: leave the key out."""


def rewrite_gguf(src, dst, *, set_kv: dict | None = None, drop=(), edit_value: Callable | None = None,
                 after_key: dict | None = None, tensor_data: Callable | None = None) -> Path:
    """Write a copy of GGUF ``src`` to ``dst`` (whole or not at all: :func:`epqlab.results.atomic_path`).

    Args:
        set_kv: ``{key: (value, gguf.GGUFValueType)}`` set in place of the key's value, or added at the end.
        drop: keys left out.
        edit_value: ``f(key, value) -> value`` for every other key (``value`` as gguf-py's
            ``ReaderField.contents()`` gives it; return :data:`DROP` to leave the key out).
        after_key: ``{key: f(writer)}`` called right after ``key`` is written (e.g. to add
            ``tokenizer.ggml.scores`` after the tokens with ``writer.add_token_scores``).
        tensor_data: ``f(name, array) -> array`` for each tensor's data (a view of the file's bytes in
            gguf-py's shape; quantized tensors come as raw uint8 blocks); its result is written.

    Returns: ``dst`` as a Path. Raises what gguf-py raises for a file it cannot read.
    """
    import gguf

    vt_of = gguf.GGUFValueType
    set_kv, after_key, drop = dict(set_kv or {}), dict(after_key or {}), set(drop)
    dst = Path(dst)
    r = gguf.GGUFReader(src)
    arch = str(r.fields["general.architecture"].contents())
    with atomic_path(dst) as tmp:
        w = gguf.GGUFWriter(tmp, arch)
        try:
            for k, f in r.fields.items():
                if k.startswith("GGUF.") or k == "general.architecture" or k in drop:
                    continue
                if k in set_kv:
                    v, vt = set_kv.pop(k)
                    w.add_key_value(k, v, vt)
                else:
                    vt = vt_of(f.types[0])
                    v = f.contents()
                    if edit_value is not None:
                        v = edit_value(k, v)
                        if v is DROP:
                            continue
                    w.add_key_value(k, v, vt, sub_type=vt_of(f.types[-1]) if vt == vt_of.ARRAY else None)
                if k in after_key:
                    after_key[k](w)
            for k, (v, vt) in set_kv.items():
                w.add_key_value(k, v, vt)
            data = [np.asarray(t.data) for t in r.tensors]
            if tensor_data is not None:
                data = [np.ascontiguousarray(tensor_data(t.name, d)) for t, d in zip(r.tensors, data)]
            for t, d in zip(r.tensors, data):
                w.add_tensor_info(t.name, d.shape, d.dtype, int(d.nbytes), raw_dtype=t.tensor_type)
            w.write_header_to_file()
            w.write_kv_data_to_file()
            w.write_ti_data_to_file()
            for d in data:
                w.write_tensor_data(d)
        finally:
            w.close()
    return dst


__all__ = ["rewrite_gguf", "DROP"]
