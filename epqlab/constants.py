"""Names and numbers epqlab defines once (as gguf-py's ``constants.py`` does for GGUF): eviction policy
names, the GGUF keys and magic we read and write, ggml block sizes, the page size.

ggml block sizes are gguf-py's own table (``gguf.GGML_QUANT_SIZES``, imported when first needed). The GGUF
keys and magic are spelled here as gguf-py spells them (``gguf.Keys``, ``gguf.GGUF_MAGIC``) without importing
gguf-py (~0.3 s) with ``import epqlab``; tests/test_constants.py checks every one against gguf-py.
"""
from __future__ import annotations

import os
from enum import IntEnum

# ------------------------------------------------------------------------------------- eviction policies
ONLINE_POLICIES: tuple[str, ...] = ("lru", "ls", "ls_pos", "lfu", "static", "fnu",
                                    "lfuda", "heat", "arc", "2q", "sieve", "s3fifo", "wtinylfu", "coact",
                                    "lirs", "gate_rank")
"""Policies a live :class:`epqlab.Session` (and :class:`epqlab.Pager`) can run; rules in ``help(epqlab.Pager)``
and, with their sources, in :mod:`epqlab.routes.online` (whose :func:`~epqlab.routes.online.simulate_online`
replays each exactly as the pager runs it)."""
OFFLINE_POLICIES: tuple[str, ...] = ("belady",)
"""Policies that need the future: :meth:`epqlab.Pager.replay` of a route log only."""
PAGER_POLICIES: tuple[str, ...] = ONLINE_POLICIES + OFFLINE_POLICIES
"""Every policy the native pager accepts (``epqlab._pager_core.POLICIES``; a test checks they agree)."""
SIMULATOR_POLICIES: tuple[str, ...] = ("lru", "ls", "ls_pos", "belady")
"""Policies of the fast route-log cache simulators (:func:`epqlab.routes.simulate`'s stack and next-use
methods, ``simulate_reference``). :func:`epqlab.routes.simulate` also takes every other pager policy, run
request by request through :func:`epqlab.routes.online.simulate_online`, which replays every online policy
exactly as the pager runs it."""
EVICTION_GROUPS: tuple[str, ...] = ("stale_left", "current_left", "stale_right", "current_right")
"""Victim groups relative to the layer being loaded (stale = not requested in this forward pass; left =
an earlier layer); the pager counts ``evictions_<group>``."""
STUDY_POLICIES: tuple[str, ...] = ("lru", "ls", "ls_pos", "lfu", "static", "fnu")
"""The eviction study's live sweep (``epqlab ablate eviction``, notebook 03); the tournament ranks every online policy."""
DEFAULT_POLICY = "lru"

# ------------------------------------------------------------------------------- codes shared with C++
class PrefetchMode(IntEnum):
    """Next-layer expert predictors of the hook (native ``enum prefetch_mode``, exported by the
    engine module as ``PREFETCH_MODES``; tests/test_native_codes.py checks they agree).
    Rules: :mod:`epqlab.engine.prefetch`."""

    OFF = 0
    LOOKAHEAD = 1
    PREVIOUS = 2
    UNION = 3
    TRAINED = 4
    ORACLE = 5


class DenseMode(IntEnum):
    """Where the non-expert weights live (native ``engine_config::dense_mode``, exported as
    ``DENSE_MODES``): llama.cpp's file mapping, anonymous copies, or anonymous copies mlock'ed
    (docs/DESIGN.md §3b)."""

    MMAP = 0
    ANON = 1
    MLOCK = 2


MAX_PREFETCH_DEPTH = 8
"""Layers ahead the hook prefetches at most (native ``expert_hook::kMaxDepth``, exported as
``MAX_PREFETCH_DEPTH``)."""
MAX_FIT_DEPTH = 4
"""Layers ahead a trained predictor is fitted for at most (its weights ``W [depth, L, E, D]`` float32 grow
with depth; the hook accepts up to :data:`MAX_PREFETCH_DEPTH`, exported as ``MAX_FIT_DEPTH``)."""


# ------------------------------------------------------------------------------------------------ context
MIN_N_CTX = 256
"""The smallest context of a sequence, tokens: llama.cpp pads each sequence's context up to a multiple of 256
(``GGML_PAD(n_ctx_seq, 256)`` in src/llama-context.cpp), so a smaller ``n_ctx`` would silently become 256. A
:class:`epqlab.Session` refuses ``n_ctx`` below it (ValueError), the command line's ``--n-ctx`` too (exit 2); a
value at or above it is padded up to the next multiple of 256 (``session.n_ctx`` reports the context the prompts
are checked against: :func:`padded_n_ctx`)."""


def padded_n_ctx(n_ctx: int) -> int:
    """The context llama.cpp gives a sequence asked for ``n_ctx`` (>= :data:`MIN_N_CTX`) tokens: the next
    multiple of 256."""
    return -(-int(n_ctx) // MIN_N_CTX) * MIN_N_CTX


# --------------------------------------------------------------------------------------------------- GGUF
GGUF_MAGIC = b"GGUF"
"""The first 4 bytes of every GGUF file (``gguf.GGUF_MAGIC`` = 0x46554747, little-endian)."""
KEY_ARCHITECTURE = "general.architecture"  # gguf.Keys.General.ARCHITECTURE
KEY_BLOCK_COUNT = "{arch}.block_count"  # gguf.Keys.LLM.BLOCK_COUNT
KEY_CONTEXT_LENGTH = "{arch}.context_length"  # gguf.Keys.LLM.CONTEXT_LENGTH
KEY_FEED_FORWARD_LENGTH = "{arch}.feed_forward_length"  # gguf.Keys.LLM.FEED_FORWARD_LENGTH
KEY_EXPERT_COUNT = "{arch}.expert_count"  # gguf.Keys.LLM.EXPERT_COUNT
KEY_EXPERT_USED_COUNT = "{arch}.expert_used_count"  # gguf.Keys.LLM.EXPERT_USED_COUNT
KEY_EXPERT_FEED_FORWARD_LENGTH = "{arch}.expert_feed_forward_length"  # gguf.Keys.LLM.EXPERT_FEED_FORWARD_LENGTH
KEY_EXPERT_SHARED_COUNT = "{arch}.expert_shared_count"  # gguf.Keys.LLM.EXPERT_SHARED_COUNT
KEY_EXPERT_WEIGHTS_SCALE = "{arch}.expert_weights_scale"  # gguf.Keys.LLM.EXPERT_WEIGHTS_SCALE
KEY_LEADING_DENSE_BLOCK_COUNT = "{arch}.leading_dense_block_count"  # gguf.Keys.LLM.LEADING_DENSE_BLOCK_COUNT


def arch_key(template: str, arch: str) -> str:
    """A GGUF key for architecture ``arch``: ``arch_key(KEY_EXPERT_COUNT, "qwen3moe")`` ->
    ``"qwen3moe.expert_count"``."""
    return template.format(arch=arch)


# ---------------------------------------------------------------------------------------------------- ggml
def ggml_block(type_name: str) -> tuple[int, int]:
    """(values per block, bytes per block) of ggml type ``type_name`` (e.g. ``"Q8_0"`` -> (32, 34)), from
    ``gguf.GGML_QUANT_SIZES``. Raises KeyError for an unknown type."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    return GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]


def ggml_row_bytes(type_name: str, n: int) -> int:
    """Bytes of a row of ``n`` values of ggml type ``type_name``.

    Raises:
        ValueError: ``n`` is not a whole number of the type's blocks.
    """
    blk, size = ggml_block(type_name)
    if n % blk:
        raise ValueError(f"{type_name} rows need a multiple of {blk} values, got {n}")
    return n // blk * size


# ------------------------------------------------------------------------------------------------ memory
PAGE_SIZE: int = os.sysconf("SC_PAGE_SIZE")
"""Bytes of a memory page on this machine (the pager's mapping unit; native code reads the same sysconf)."""

__all__ = [
    "ONLINE_POLICIES", "OFFLINE_POLICIES", "PAGER_POLICIES", "SIMULATOR_POLICIES", "EVICTION_GROUPS",
    "DEFAULT_POLICY", "STUDY_POLICIES", "PrefetchMode", "DenseMode", "MAX_PREFETCH_DEPTH", "MAX_FIT_DEPTH", "GGUF_MAGIC", "arch_key", "ggml_block", "ggml_row_bytes", "PAGE_SIZE",
    "KEY_ARCHITECTURE", "KEY_BLOCK_COUNT", "KEY_CONTEXT_LENGTH", "KEY_FEED_FORWARD_LENGTH", "KEY_EXPERT_COUNT",
    "KEY_EXPERT_USED_COUNT", "KEY_EXPERT_FEED_FORWARD_LENGTH", "KEY_EXPERT_SHARED_COUNT",
    "KEY_EXPERT_WEIGHTS_SCALE", "KEY_LEADING_DENSE_BLOCK_COUNT",
]
