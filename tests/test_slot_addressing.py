"""Slot addressing (docs/DESIGN.md §3f): the expert matmuls read the arena's slots in place and get the slot
of each selected expert, so a load or an eviction maps nothing. The logits must be plain llama.cpp's, bit for
bit, with evictions, every policy, prefetch, pipelined reads and staged prefill layers; the arena must be
mapped once (the fill mapping) and never into the region; and the option must refuse what it cannot do."""
from __future__ import annotations

import numpy as np
import pytest

import epqlab
from exact import N_STEPS, PROMPT, THREADS, greedy_ref

ARENA = 2_000_000  # bytes: on the tiny model (8 x 108 KiB Q4_K experts x 3 layers, 8 x 384 KiB BF16 x 1) the
# arena holds a fraction of the experts, every slot class gets >= top-2 slots, and a prompt's union overflows


@pytest.fixture(scope="module")
def tiny_ref(tiny_gguf):
    return greedy_ref(tiny_gguf)


def _arena_mappings() -> int:
    """Mappings of the arena memfd in this process (/proc/self/maps names it ``/memfd:epqlab-arena``)."""
    with open("/proc/self/maps") as f:
        return sum("memfd:epqlab-arena" in line for line in f)


def _run(path, addressing, **kw):
    with epqlab.Session(path, arena_bytes=ARENA, expert_addressing=addressing, n_threads=THREADS, io_threads=2,
                        **kw) as s:
        toks = s.tokenize(PROMPT)
        trace = s.greedy_trace(toks, N_STEPS)
        maps = _arena_mappings()
        return s.expert_addressing, trace, s.stats, maps


@pytest.mark.parametrize("policy", ["lru", "fnu", "ls_pos", "lfu"])
@pytest.mark.parametrize("knobs", [dict(pipeline_reads=False), dict(pipeline_reads=True),
                                   dict(pipeline_reads=True, prefetch="lookahead")])
def test_slots_bit_identical_to_plain(tiny_gguf, tiny_ref, policy, knobs):
    toks, (rp, rs, rg) = tiny_ref
    addr, (p, st, gen), stats, maps = _run(tiny_gguf, "slots", policy=policy, **knobs)
    assert addr == "slots" and stats["expert_addressing"] == "slots"
    assert np.array_equal(p, rp) and np.array_equal(st, rs) and gen == rg
    assert stats["misses"] > 0 and stats["evictions"] > 0  # the pager really paged
    assert stats["staged_layers"] > 0  # the prompt's union overflowed a layer: its staged matmuls ran too
    # nothing but the fill mapping maps the arena: no expert was mapped into the region
    assert maps == 1


def test_region_maps_experts_and_slots_does_not(tiny_gguf, tiny_ref):
    """The same run with region addressing maps experts into the region (so the count above can fail)."""
    addr, (p, st, gen), stats, maps = _run(tiny_gguf, "region")
    assert addr == "region" and maps > 1
    assert np.array_equal(st, tiny_ref[1][1])


def test_auto_picks_slots_where_possible(tiny_gguf, default_path):
    with epqlab.Session(tiny_gguf, arena_bytes=ARENA, n_threads=THREADS) as s:
        assert s.expert_addressing == "slots"
    with epqlab.Session(tiny_gguf, arena_bytes=ARENA, n_threads=THREADS, skip_cold=0.0) as s:
        assert s.expert_addressing == "region"  # skip-cold maps zeros over pages: region only
    # the default model's Q8_0 slices are 19584 bytes, not whole 4 KiB pages
    with epqlab.Session(default_path, arena_bytes="8MiB", n_threads=THREADS) as s:
        assert s.expert_addressing == "region"
    with epqlab.Session(default_path, pager=False, n_threads=THREADS) as s:
        assert s.expert_addressing is None


def test_option_errors(tiny_gguf, default_path):
    with pytest.raises(ValueError, match="unknown expert_addressing"):
        epqlab.Session(tiny_gguf, arena_bytes=ARENA, expert_addressing="pages")
    with pytest.raises(ValueError, match="skip_cold .* needs expert_addressing=.region."):
        epqlab.Session(tiny_gguf, arena_bytes=ARENA, expert_addressing="slots", skip_cold=0.1)
    with pytest.raises(ValueError, match="drop pager=False"):
        epqlab.Session(tiny_gguf, pager=False, expert_addressing="slots")
    with pytest.raises(ValueError, match="not a whole number of 4096-byte pages"):
        epqlab.Session(default_path, arena_bytes="8MiB", expert_addressing="slots")
    # a class with fewer than top-k slots: the arena's smallest workable size gives the BF16 class too few
    lay = epqlab.inspect(tiny_gguf)
    with pytest.raises(ValueError, match="fewer than top-2"):
        epqlab.Session(tiny_gguf, arena_bytes=epqlab.Pager.min_arena_bytes(lay), expert_addressing="slots")


def test_pager_slot_of_is_an_index_within_the_class(tiny_gguf):
    """After a decode, every resident expert's slot index is inside its class and no two share one."""
    with epqlab.Session(tiny_gguf, arena_bytes=ARENA, expert_addressing="slots", n_threads=THREADS) as s:
        s.generate("The cache", 4)
        pg = s.pager.native
        states = pg.slot_states()
        seen = {}
        for cls, li, e, _pinned, _hot in states:
            if li < 0:
                continue
            idx = pg.slot_of(li, e)
            assert idx >= 0
            seen.setdefault(cls, []).append(idx)
        assert seen, "nothing resident"
        for cls, idxs in seen.items():
            n = sum(1 for st in states if st[0] == cls)
            assert len(set(idxs)) == len(idxs) and max(idxs) < n and min(idxs) >= 0, (cls, idxs, n)


@pytest.mark.parametrize("flag, want", [([], "slots"), (["--expert-addressing", "region"], "region")])
def test_cli_run_flag(tiny_gguf, capsys, flag, want):
    from epqlab.cli import main

    assert main(["run", str(tiny_gguf), "-n", "2", "--threads", "1", *flag]) == 0
    line = [x for x in capsys.readouterr().out.splitlines() if x.strip().startswith("expert addressing")]
    assert line and line[0].split()[-1] == want, line


def test_read_expert_reads_the_slot(tiny_gguf):
    """Session.pager.read_expert under slot addressing returns each resident expert's bytes from its slot: equal to
    the file's bytes at offset + e * expert_bytes (read here with plain file I/O), and it raises for a non-resident one."""
    with epqlab.Session(tiny_gguf, arena_bytes=ARENA, expert_addressing="slots", n_threads=THREADS) as s:
        s.generate("The cache", 3)
        pg, lay = s.pager, s.layout
        checked = 0
        with open(tiny_gguf, "rb") as f:
            for l in lay.layers:
                for e in range(lay.n_expert):
                    if not pg.is_resident(l.layer, e):
                        with pytest.raises(ValueError, match="not resident"):
                            pg.read_expert(l.layer, 0, e)
                        continue
                    for ti, t in enumerate(l.tensors):
                        f.seek(t.offset + e * t.expert_bytes)
                        assert pg.read_expert(l.layer, ti, e) == f.read(t.expert_bytes), (l.layer, t.name, e)
                        checked += 1
        assert checked > 0
