"""The codes Python shares with the native engine module agree with the C++ that defines them: the hook's
prefetch modes (``enum prefetch_mode``, native/engine/hook.h), the engine's dense-weight modes
(``engine_config::dense_mode``, native/engine/engine.h), and the hook's depth bounds (``expert_hook::kMaxDepth``,
``kMaxFitDepth``). The native side exports each from its own enum or constant, so a change on either side
fails here. (The eviction policies, ``POLICIES`` of ``_pager_core``, are checked in tests/test_constants.py.)"""
from __future__ import annotations

from epqlab import constants as C
from epqlab.engine.native import core


def test_prefetch_modes_agree():
    assert {m.name.lower(): int(m) for m in C.PrefetchMode} == dict(core.PREFETCH_MODES)


def test_dense_modes_agree():
    assert {m.name.lower(): int(m) for m in C.DenseMode} == dict(core.DENSE_MODES)


def test_depth_bounds_agree():
    assert C.MAX_PREFETCH_DEPTH == core.MAX_PREFETCH_DEPTH
    assert C.MAX_FIT_DEPTH == core.MAX_FIT_DEPTH
    assert 1 <= core.MAX_FIT_DEPTH <= core.MAX_PREFETCH_DEPTH
