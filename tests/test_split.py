"""Split GGUFs (``NAME-0000i-of-0000N.gguf`` shards with ``split.*`` keys, llama.cpp's gguf-split
layout): epqlab reads every shard, pages each expert from the shard that holds it, and the
logits stay bit-identical to the unsplit file run by plain llama.cpp. Expected values: the
unsplit file's bytes and plain llama.cpp's logits on it (pager=False)."""
from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

import epqlab
from ggufs import split_gguf

PROMPT = [1, 5, 9, 13, 17, 21, 25, 29, 3, 7, 11]


@pytest.fixture(scope="module")
def models(tmp_path_factory, tiny_gguf):
    d = tmp_path_factory.mktemp("split")
    whole = tiny_gguf
    # block b's tensors go to shard b % n: the experts of neighbouring layers sit in different files
    return {1: [whole], 2: split_gguf(whole, d / "tiny2", 2), 3: split_gguf(whole, d / "tiny3", 3)}


@pytest.fixture(scope="module")
def reference(models):
    """Plain llama.cpp (mmap, no pager) on the unsplit file: logits of PROMPT and 6 greedy tokens."""
    with epqlab.Session(models[1][0], pager=False, n_threads=1) as s:
        return s.logits(PROMPT), s.generate(PROMPT, 6).tokens


@pytest.mark.parametrize("n", [2, 3])
def test_layout_of_shards(models, n):
    whole, shards = epqlab.inspect(models[1][0]), models[n]
    for given in shards:  # any shard names the model; its path is the first shard (what llama.cpp loads)
        lay = epqlab.inspect(given)
        assert lay.path == shards[0] and lay.files == shards and lay.n_files == n
    assert lay.file_sizes == [p.stat().st_size for p in shards] and lay.file_size == sum(lay.file_sizes)
    assert (lay.n_tensors, lay.routed_expert_bytes, lay.non_expert_bytes) == \
        (whole.n_tensors, whole.routed_expert_bytes, whole.non_expert_bytes)
    assert sorted(lay.dense_tensors, key=str) != [] and len(lay.dense_files) == len(lay.dense_tensors)
    # experts of different layers live in different shards: block b in shard b % n (how split_gguf wrote them)
    assert [l.tensors[0].file for l in lay.layers] == [l.layer % n for l in lay.layers]
    data = models[1][0].read_bytes()
    for lw, ls in zip(whole.layers, lay.layers):
        for tw, ts in zip(lw.tensors, ls.tensors):
            assert (tw.name, tw.ggml_type, tw.shape, tw.expert_bytes) == (ts.name, ts.ggml_type, ts.shape, ts.expert_bytes)
            with open(lay.files[ts.file], "rb") as f:
                f.seek(ts.offset)
                assert f.read(ts.n_bytes) == data[tw.offset:tw.offset + tw.n_bytes], ts.name
    for (name, off, nb), fi in zip(lay.dense_tensors, lay.dense_files):
        w = next((o, b) for nm, o, b in whole.dense_tensors if nm == name)
        with open(lay.files[fi], "rb") as f:
            f.seek(off)
            assert f.read(nb) == data[w[0]:w[0] + w[1]], name


@pytest.mark.parametrize("n", [2, 3])
def test_pager_reads_each_expert_from_its_shard(models, n):
    lay = epqlab.inspect(models[n][0])
    whole = epqlab.inspect(models[1][0])
    data = models[1][0].read_bytes()
    pg = epqlab.Pager(lay, epqlab.Pager.min_arena_bytes(lay), io_threads=3)
    for l, lw in zip(lay.layers, whole.layers):
        for e in range(lay.n_expert):
            pg.load_layer(l.layer, [e])
            for ti, tw in enumerate(lw.tensors):
                want = data[tw.expert_offset(e):tw.expert_offset(e) + tw.expert_bytes]
                assert pg.read_expert(l.layer, ti, e) == want, (l.layer, ti, e)
            pg.release_layer(l.layer)
    assert pg.stats["misses"] == lay.n_expert * len(lay.layers)


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("dense_weights", ["anon", "mmap"])
def test_paged_split_is_bit_identical(models, reference, n, dense_weights):
    p = models[n][0]
    lay = epqlab.inspect(p)
    with epqlab.Session(p, pager=False, n_threads=1) as s:
        plain = s.logits(PROMPT)
    with epqlab.Session(p, arena_bytes=epqlab.Pager.min_arena_bytes(lay), n_threads=1, io_threads=2,
                        dense_weights=dense_weights) as s:
        paged = s.logits(PROMPT)
        g = s.generate(PROMPT, 6)
        assert s.stats["evictions"] > 0  # the small arena really paged
        if dense_weights == "anon":
            dense = sum(n for _, _, n in lay.dense_tensors)
            assert dense <= s.load_report["dense_bytes"] <= dense + 2 * 4096 * len(lay.dense_tensors)
    assert np.array_equal(plain, reference[0])
    assert np.array_equal(paged, reference[0])
    assert g.tokens == reference[1]


def test_changed_shard_is_refused(models, tmp_path):
    shards = [shutil.copy(p, tmp_path / p.name) for p in models[3]]
    lay = epqlab.inspect(shards[0])
    last = lay.layers[-1]
    assert last.tensors[0].file == 0 and lay.layers[1].tensors[0].file == 1
    pg = epqlab.Pager(lay, epqlab.Pager.min_arena_bytes(lay), io_threads=1)
    with epqlab.Session(shards[0], arena_bytes=epqlab.Pager.min_arena_bytes(lay), n_threads=1) as s:
        s.generate(PROMPT[:4], 2)
        st = os.stat(shards[2])
        os.utime(shards[2], ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # only the third shard changes
        with pytest.raises(epqlab.PagerIOError, match="changed") as ei:
            pg.load_layer(last.layer, [0])  # an expert of shard 1: the check covers every shard
        assert str(shards[2]) in str(ei.value)
        with pytest.raises(epqlab.ModelChangedError, match="changed on disk"):
            s.generate(PROMPT[:4], 2)
