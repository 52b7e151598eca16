"""epqlab/constants.py: every name agrees with its source (gguf-py, the native pager, pyproject.toml) and the
public names elsewhere are the same objects."""
from __future__ import annotations

import os
import struct
import tomllib
from pathlib import Path

import gguf
import pytest

import epqlab
from epqlab import constants as C


def test_gguf_keys_and_magic_are_gguf_pys():
    assert C.GGUF_MAGIC == struct.pack("<I", gguf.GGUF_MAGIC) == b"GGUF"
    K = gguf.Keys.LLM
    assert C.KEY_ARCHITECTURE == gguf.Keys.General.ARCHITECTURE
    pairs = {"BLOCK_COUNT": K.BLOCK_COUNT, "CONTEXT_LENGTH": K.CONTEXT_LENGTH,
             "FEED_FORWARD_LENGTH": K.FEED_FORWARD_LENGTH, "EXPERT_COUNT": K.EXPERT_COUNT,
             "EXPERT_USED_COUNT": K.EXPERT_USED_COUNT, "EXPERT_FEED_FORWARD_LENGTH": K.EXPERT_FEED_FORWARD_LENGTH,
             "EXPERT_SHARED_COUNT": K.EXPERT_SHARED_COUNT, "EXPERT_WEIGHTS_SCALE": K.EXPERT_WEIGHTS_SCALE,
             "LEADING_DENSE_BLOCK_COUNT": K.LEADING_DENSE_BLOCK_COUNT}
    assert {n for n in C.__all__ if n.startswith("KEY_")} == {"KEY_ARCHITECTURE"} | {f"KEY_{n}" for n in pairs}
    for n, v in pairs.items():
        assert getattr(C, f"KEY_{n}") == v, n
    assert C.arch_key(C.KEY_EXPERT_USED_COUNT, "qwen3moe") == "qwen3moe.expert_used_count"


def test_ggml_blocks_by_hand():
    # ggml's type table: Q8_0 = 32 values in 2 (f16 scale) + 32 bytes; Q4_K = 256 values in 2+2+12+128 bytes
    assert C.ggml_block("Q8_0") == (32, 34) and C.ggml_block("Q4_K") == (256, 144) and C.ggml_block("F16") == (1, 2)
    assert C.ggml_row_bytes("Q4_K", 2048) == 8 * 144 and C.ggml_row_bytes("BF16", 3) == 6
    with pytest.raises(ValueError, match="multiple of 32"):
        C.ggml_row_bytes("Q8_0", 100)


def test_page_size_is_the_machines():
    assert C.PAGE_SIZE == os.sysconf("SC_PAGESIZE")


def test_policies_one_definition():
    from epqlab import routes
    from epqlab.paging import pager
    from epqlab.engine.native import core
    from epqlab.studies.ablation import DEFAULT_POLICIES

    assert set(core.POLICIES) == set(C.PAGER_POLICIES) and len(core.POLICIES) == len(C.PAGER_POLICIES)
    assert pager.POLICIES is C.ONLINE_POLICIES and pager.OFFLINE_POLICIES is C.OFFLINE_POLICIES
    assert routes.POLICIES is C.SIMULATOR_POLICIES and routes.GROUPS is C.EVICTION_GROUPS
    assert DEFAULT_POLICIES is C.STUDY_POLICIES and set(C.STUDY_POLICIES) <= set(C.ONLINE_POLICIES)
    assert set(C.SIMULATOR_POLICIES) <= set(C.PAGER_POLICIES)


def test_version_written_once():
    from epqlab.engine.native import core

    pyproject = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())
    assert epqlab.__version__ == pyproject["project"]["version"] == core.__version__
