"""The native pager: resident bytes equal the file, policies equal a reference simulator written
here, faults surface as Python exceptions and leave the pager usable."""
from __future__ import annotations

import errno
import os
import shutil

import numpy as np
import pytest

import epqlab
from epqlab.routes import RouteLog, RouteLogError
from ggufs import aligned_model, fused_model, tiny_slices_model, two_class_model
from refpager import RefPager

PAGE = os.sysconf("SC_PAGESIZE")
BUILDERS = [two_class_model, aligned_model, tiny_slices_model, fused_model]


def pages_spanned(start, n):
    return -(-(start + n) // PAGE) - start // PAGE


def unit_slot_bytes(layout):
    """Independent recomputation of the mirror-layout slot size of each layer."""
    out = []
    for l in layout.layers:
        out.append(sum(PAGE * max(pages_spanned(t.offset + e * t.expert_bytes, t.expert_bytes)
                                   for e in range(layout.n_expert)) for t in l.tensors))
    return out


def check_resident_bytes(pager, w, layout):
    """Every resident expert's slices read through the region equal the written bytes."""
    n = 0
    for l in layout.layers:
        for e in range(layout.n_expert):
            if pager.is_resident(l.layer, e):
                for ti, t in enumerate(l.tensors):
                    assert pager.read_expert(l.layer, ti, e) == w.expert_slice(t.name, e), (t.name, e)
                n += 1
    return n


@pytest.mark.parametrize("build", BUILDERS, ids=lambda b: b.__name__)
@pytest.mark.parametrize("direct", [True, False], ids=["direct", "buffered"])
@pytest.mark.parametrize("threads", [1, 8])
@pytest.mark.parametrize("prefault", [True, False], ids=["fill", "bounce"])
def test_resident_bytes_equal_file(tmp_path, build, direct, threads, prefault):
    w = build(tmp_path / "m.gguf")
    layout = epqlab.inspect(w.path)
    assert epqlab.Pager.unit_slot_bytes(layout) == unit_slot_bytes(layout)
    rng = np.random.default_rng(1)
    k = layout.n_expert_used
    total = epqlab.Pager.all_experts_bytes(layout)
    mn = epqlab.Pager.min_arena_bytes(layout)
    for arena in (mn, max(mn, total // 4), max(mn, total // 2), total):
        p = epqlab.Pager(layout, arena, io_threads=threads, direct_io=direct, prefault=prefault)
        assert p.fill_bytes == (p.arena_bytes if prefault else 0)
        for step in range(60):
            l = layout.moe_layers[step % len(layout.moe_layers)]
            ids = rng.choice(layout.n_expert, size=k, replace=False)
            p.load_layer(l, ids)
            assert all(p.is_resident(l, e) for e in ids)
            # all resident experts (not only this layer's): boundary pages shared with evicted
            # neighbours must still hold the right bytes
            assert check_resident_bytes(p, w, layout) >= k
            p.release_layer(l)
        if arena >= epqlab.Pager.all_experts_bytes(layout):
            assert p.stats["evictions"] == 0
        if not direct:
            assert p.direct_io is False


def _rss_shmem() -> int:
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith("RssShmem:"))


def test_fill_mapping_accounting(tmp_path):
    """The fill mapping is the whole arena, allocated and mapped at creation: RssShmem grows by exactly its
    size (no region page is mapped yet), the memfd holds every page, and
    ``epqlab.memory.sample(fill_mapped=)`` takes that second count out again."""
    from epqlab.memory.usage import sample

    import gc

    w = two_class_model(tmp_path / "m.gguf")
    layout = epqlab.inspect(w.path)
    gc.collect()  # earlier tests' pagers gone
    before = _rss_shmem()
    p = epqlab.Pager(layout, epqlab.Pager.all_experts_bytes(layout))
    assert p.fill_bytes == p.arena_bytes == p.arena_resident_bytes > 0
    assert _rss_shmem() - before == p.fill_bytes
    s = sample(arena_resident=p.arena_resident_bytes, fill_mapped=p.fill_bytes)
    assert s.rss_shmem == before and s.shmem == max(before, p.arena_bytes)
    lazy = epqlab.Pager(layout, epqlab.Pager.all_experts_bytes(layout), prefault=False)
    assert lazy.fill_bytes == 0 and lazy.arena_resident_bytes == 0


def test_tmpfs_reads_correct_bytes(tmp_path):
    """On tmpfs the pager uses O_DIRECT where the kernel allows it (Linux >= 6.6) and buffered
    reads otherwise; either way the bytes are the file's."""
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    src = two_class_model(tmp_path / "m.gguf")
    dst = f"/dev/shm/epqlab-test-{os.getpid()}.gguf"
    shutil.copy(src.path, dst)
    try:
        layout = epqlab.inspect(dst)
        p = epqlab.Pager(layout, epqlab.Pager.min_arena_bytes(layout), direct_io=True)
        try:
            fd = os.open(dst, os.O_RDONLY | os.O_DIRECT)
            os.close(fd)
            kernel_allows = True
        except OSError:
            kernel_allows = False
        assert p.direct_io is kernel_allows
        p.load_layer(1, [0, 5])
        check_resident_bytes(p, src, layout)
    finally:
        os.unlink(dst)


def test_arena_split_and_minimum(tmp_path):
    w = two_class_model(tmp_path / "m.gguf")
    layout = epqlab.inspect(w.path)
    big, small = max(unit_slot_bytes(layout)), min(unit_slot_bytes(layout))
    k = layout.n_expert_used
    assert epqlab.Pager.min_arena_bytes(layout) == k * big
    with pytest.raises(epqlab.ArenaTooSmall, match=str(k * big)):
        epqlab.Pager(layout, k * big - 1)
    p = epqlab.Pager(layout, k * big)
    assert p.stats["slot_classes"] == [{"slot_bytes": big, "slots": k}, {"slot_bytes": small, "slots": 0}]
    # all experts: every unit its own slot
    p = epqlab.Pager(layout, "1GiB")
    assert [c["slots"] for c in p.stats["slot_classes"]] == [2 * 8, 3 * 8]
    assert p.arena_bytes == 16 * big + 24 * small
    # in between: k big slots, the rest shared by total bytes, leftovers largest class first
    arena = k * big + 10 * small + 3 * big + 1000
    p = epqlab.Pager(layout, arena)
    rest = arena - k * big
    tb, ts = (16 - k) * big, 24 * small
    nb = min(16 - k, int(rest * tb / (tb + ts)) // big)
    ns = min(24, int(rest * ts / (tb + ts)) // small)
    used = (k + nb) * big + ns * small
    while nb < 16 - k and used + big <= arena:
        nb += 1; used += big
    while ns < 24 and used + small <= arena:
        ns += 1; used += small
    assert [c["slots"] for c in p.stats["slot_classes"]] == [k + nb, ns]
    assert p.arena_bytes == used <= arena


def test_bad_policy_and_ids(tmp_path):
    w = two_class_model(tmp_path / "m.gguf")
    layout = epqlab.inspect(w.path)
    with pytest.raises(ValueError, match="policy"):
        epqlab.Pager(layout, "1GiB", policy="fifo")
    p = epqlab.Pager(layout, "1GiB")
    with pytest.raises(IndexError):
        p.load_layer(1, [8])
    with pytest.raises(ValueError, match="no routed experts"):
        p.load_layer(0, [1])


@pytest.mark.parametrize("policy", ["lru", "ls", "ls_pos"])
@pytest.mark.parametrize("build", [two_class_model, aligned_model], ids=lambda b: b.__name__)
def test_replay_equals_reference(tmp_path, policy, build):
    w = build(tmp_path / "m.gguf")
    layout = epqlab.inspect(w.path)
    L, E, k = len(layout.layers), layout.n_expert, layout.n_expert_used
    log = RouteLog.synthetic(300, L, E, k, locality=0.6, skew=0.0, seed=7).experts
    ub = unit_slot_bytes(layout)
    total = sum(b * E for b in ub)
    for frac in (0.0, 0.25, 0.5, 1.0):
        arena = max(epqlab.Pager.min_arena_bytes(layout), int(total * frac))
        p = epqlab.Pager(layout, arena, policy=policy, io_threads=4)
        st = p.replay(log)
        ref = RefPager(ub, st["slot_classes"], policy)
        ref.replay(log)
        assert (st["hits"], st["misses"], st["evictions"]) == (ref.hits, ref.misses, ref.evictions), frac
        groups = [st[f"evictions_{g}"] for g in ("stale_left", "current_left", "stale_right", "current_right")]
        assert groups == ref.groups, frac
        assert st["requests"] == log.shape[0] * L * k
        assert sum(st["layer_requests"]) == st["requests"] and sum(st["layer_hits"]) == st["hits"]
        if frac == 1.0:
            assert st["misses"] == len({(l, e) for l in range(L) for e in np.unique(log[:, l])})
        check_resident_bytes(p, w, layout)


def test_replay_accepts_route_log_npz(tmp_path):
    w = two_class_model(tmp_path / "m.gguf")
    layout = epqlab.inspect(w.path)
    log = RouteLog.synthetic(50, len(layout.layers), layout.n_expert, layout.n_expert_used, locality=0.6, skew=0.0,
                             seed=3).experts
    path = tmp_path / "log.npz"
    rl = RouteLog.from_arrays(log, layout.n_expert, layers=layout.moe_layers,
                              expert_bytes=[l.expert_bytes for l in layout.layers], ubatch=np.arange(50) // 2)
    rl.save(path)
    arena = epqlab.Pager.all_experts_bytes(layout) // 2  # room for every 2-token union: nothing staged
    a = epqlab.Pager(layout, arena).replay(path)
    b = epqlab.Pager(layout, arena).replay(rl)
    c = epqlab.Pager(layout, arena).replay(log, ubatch=np.arange(50) // 2)
    d = epqlab.Pager(layout, arena).replay(log)  # one token per pass: other counts
    ref = RefPager(unit_slot_bytes(layout), a["slot_classes"], "lru")
    ref.replay(log, np.arange(50) // 2)
    assert (a["hits"], a["misses"]) == (b["hits"], b["misses"]) == (c["hits"], c["misses"]) == (ref.hits, ref.misses)
    assert (d["hits"], d["misses"]) != (a["hits"], a["misses"])
    np.savez(tmp_path / "bad.npz", experts=log)
    with pytest.raises(RouteLogError, match="lacks"):
        epqlab.Pager(layout, "1MiB").replay(tmp_path / "bad.npz")
    bad = log.copy(); bad[0, 0, 0] = layout.n_expert
    with pytest.raises(ValueError, match="outside"):
        epqlab.Pager(layout, "1MiB").replay(bad)


# ---- faults ----------------------------------------------------------------------------------

def test_over_capacity_request_is_an_error_not_an_overwrite(tmp_path):
    w = two_class_model(tmp_path / "m.gguf")
    layout = epqlab.inspect(w.path)
    p = epqlab.Pager(layout, epqlab.Pager.min_arena_bytes(layout))  # 2 slots
    p.load_layer(4, [0, 1])
    with pytest.raises(epqlab.ArenaTooSmall, match="pinned"):
        p.load_layer(5, [0, 1])  # layer 4 still pinned
    assert p.is_resident(4, 0) and p.is_resident(4, 1)
    assert not p.is_resident(5, 0)
    check_resident_bytes(p, w, layout)
    p.release_layer(4)
    p.load_layer(5, [0, 1])  # usable afterwards
    check_resident_bytes(p, w, layout)
    with pytest.raises(epqlab.ArenaTooSmall):
        p.load_layer(1, [0, 1, 2])


def test_injected_read_error(tmp_path):
    w = two_class_model(tmp_path / "m.gguf")
    layout = epqlab.inspect(w.path)
    p = epqlab.Pager(layout, "1GiB", io_threads=4)
    p.inject_fault(2, errno.EIO)
    with pytest.raises(epqlab.PagerIOError) as ei:
        p.load_layer(2, [3, 6])
    assert ei.value.errno == errno.EIO
    assert str(w.path) in str(ei.value) and "offset" in str(ei.value)
    assert isinstance(ei.value.offset, int)
    # the expert whose read failed is not resident; nothing partial is visible
    assert not (p.is_resident(2, 3) and p.is_resident(2, 6))
    check_resident_bytes(p, w, layout)
    p.load_layer(2, [3, 6])
    assert p.is_resident(2, 3) and p.is_resident(2, 6)
    check_resident_bytes(p, w, layout)


@pytest.mark.parametrize("direct", [True, False])
def test_file_truncated_after_layout(tmp_path, direct):
    w = two_class_model(tmp_path / "m.gguf")
    layout = epqlab.inspect(w.path)
    last = layout.layers[-1]
    # truncated between inspect and the pager's open: the pager's reads come back short (a file
    # changed after the pager opened it is refused before reading: test_reliability)
    os.truncate(w.path, last.tensors[0].offset + 10)
    p = epqlab.Pager(layout, "1GiB", direct_io=direct)
    with pytest.raises(epqlab.PagerIOError, match="short read") as ei:
        p.load_layer(last.layer, [7])
    assert ei.value.offset >= last.tensors[0].offset // PAGE * PAGE
    assert not p.is_resident(last.layer, 7)
    p.load_layer(1, [0, 1])  # earlier bytes still readable: pager usable
    check_resident_bytes(p, w, layout)
