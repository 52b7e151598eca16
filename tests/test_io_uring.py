"""Expert reads through io_uring into registered arena buffers (native/pager/uring.h, io_pool::use_fixed_buffers;
docs/DESIGN.md §3e): the same logits as plain llama.cpp with the pages pinned once (every read a READ_FIXED) and
with pread (io_uring=False), the reads counted on the path they took, and the fallbacks named."""
from __future__ import annotations

import numpy as np
import pytest

import epqlab
from epqlab.data import heldout_texts


@pytest.fixture(scope="module")
def ref(default_path):
    with epqlab.Session(default_path, pager=False) as p:
        toks = p.tokenize(heldout_texts()["code"])[:160]
        return toks, p.logits(toks)


@pytest.mark.parametrize("io_uring", [True, False])
def test_reads_through_registered_buffers_keep_plain_logits(default_path, ref, io_uring):
    toks, want = ref
    with epqlab.Session(default_path, arena_bytes="6MiB", io_uring=io_uring) as s:
        got = s.logits(toks)
        g = s.generate(toks[:24], 12, forced=toks[24:37])
        st = s.stats
    assert np.array_equal(got, want)
    assert g.tokens == toks[24:36]
    reads = st["fixed_reads"] + st["plain_reads"]
    assert st["misses"] > 100 and reads >= st["misses"]  # a miss is at least one read
    if io_uring:
        assert st["io_uring"] == "registered buffers"
        assert st["fixed_reads"] == reads  # every expert read went into the registered arena
    else:
        assert st["io_uring"] == "off: io_uring=False" and st["fixed_reads"] == 0


def test_off_by_default(default_path):
    with epqlab.Session(default_path, arena_bytes="6MiB") as s:
        s.generate("The cache", 2)
        assert s.io_uring == "off: io_uring=False" and s.stats["fixed_reads"] == 0 and s.stats["plain_reads"] > 0


def test_fallbacks_are_named(default_path):
    lay = epqlab.inspect(default_path)
    pg = epqlab.Pager(lay, "6MiB", prefault=False)
    assert "no fill mapping" in pg.native.use_io_uring()
    pg = epqlab.Pager(lay, "6MiB", direct_io=False)
    assert "buffered reads" in pg.native.use_io_uring()
    pg.load_layer(lay.layers[0].layer, [0, 1])  # and reads still work, with pread
    assert pg.native.fixed_reads == 0 and pg.native.plain_reads > 0
    with pytest.raises(ValueError, match="io_uring must be True or False"):
        epqlab.Session(default_path, arena_bytes="6MiB", io_uring="yes")


def test_pager_reads_each_expert_through_the_ring(default_path):
    """Bytes read with READ_FIXED land where pread would put them: every loaded expert's slice in the arena
    equals the file's bytes at its offset (GGUF tensor data read with NumPy)."""
    lay = epqlab.inspect(default_path)
    pg = epqlab.Pager(lay, "6MiB")
    assert pg.native.use_io_uring() == ""
    pg.native.set_slot_addressing(True)
    L = lay.layers[1]
    pg.load_layer(L.layer, [0, 3, 5])
    assert pg.native.fixed_reads > 0 and pg.native.plain_reads == 0
    raw = np.memmap(default_path, np.uint8, mode="r")
    li = pg._li(L.layer)
    for ti, t in enumerate(L.tensors):
        for e in (0, 3, 5):
            got = np.frombuffer(pg.native.read_expert(li, ti, e, t.expert_bytes), np.uint8)
            off = t.expert_offset(e)
            assert np.array_equal(got, raw[off:off + t.expert_bytes]), (ti, e)
