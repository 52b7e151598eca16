"""epqlab.models.gguf_rewrite: a copy with metadata set, dropped or edited and tensors unchanged (or
changed by the callback), written whole or not at all."""
from __future__ import annotations

import gguf
import numpy as np
import pytest

from epqlab.models.gguf_rewrite import DROP, rewrite_gguf

VT = gguf.GGUFValueType


def test_rewrite_sets_drops_and_keeps_tensors(mini_gguf, tmp_path):
    drop = "tokenizer.ggml.model"
    out = rewrite_gguf(mini_gguf, tmp_path / "out.gguf",
                       set_kv={"general.name": ("renamed", VT.STRING), "epqlab.test": (7, VT.UINT32)},
                       drop=(drop,),
                       edit_value=lambda k, v: DROP if k == "tokenizer.ggml.bos_token_id" else v)
    a, b = gguf.GGUFReader(mini_gguf), gguf.GGUFReader(out)
    assert b.fields["general.name"].contents() == "renamed" and b.fields["epqlab.test"].contents() == 7
    assert drop in a.fields and drop not in b.fields
    assert "tokenizer.ggml.bos_token_id" in a.fields and "tokenizer.ggml.bos_token_id" not in b.fields
    assert b.fields["tokenizer.ggml.tokens"].contents() == a.fields["tokenizer.ggml.tokens"].contents()
    assert [t.name for t in a.tensors] == [t.name for t in b.tensors]
    for ta, tb in zip(a.tensors, b.tensors):
        assert ta.tensor_type == tb.tensor_type and np.array_equal(np.asarray(ta.data), np.asarray(tb.data))


def test_rewrite_tensor_callback_and_failure_leaves_nothing(mini_gguf, tmp_path):
    out = rewrite_gguf(mini_gguf, tmp_path / "z.gguf",
                       tensor_data=lambda name, d: np.zeros_like(d) if name == "output_norm.weight" else d)
    (t,) = [t for t in gguf.GGUFReader(out).tensors if t.name == "output_norm.weight"]
    assert not np.asarray(t.data).any()
    dst = tmp_path / "keep.gguf"
    dst.write_bytes(b"the user's file")

    def boom(name, d):
        raise RuntimeError("no")

    with pytest.raises(RuntimeError):
        rewrite_gguf(mini_gguf, dst, tensor_data=boom)
    assert dst.read_bytes() == b"the user's file" and sorted(p.name for p in tmp_path.iterdir()) == ["keep.gguf",
                                                                                                     "z.gguf"]
