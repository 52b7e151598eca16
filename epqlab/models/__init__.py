"""Models to run and page: the embedded default MoE model and synthetic large models.

- :func:`default_model` builds (once, cached) an 8-expert (top-3) MoE GGUF from SmolLM2-135M-Instruct.
- :func:`synthesize` writes a random-weight MoE GGUF with real shapes (:data:`PRESETS`).
- :func:`eval_text` is the evaluation passage (Python Language Reference, PSF License).
"""
from __future__ import annotations

from .default import DEFAULT_CONFIG, default_model, eval_text
from .synth import PRESETS, SynthSpec, planned_sizes, synthesize

__all__ = ["DEFAULT_CONFIG", "PRESETS", "SynthSpec", "default_model", "eval_text", "planned_sizes", "synthesize"]
