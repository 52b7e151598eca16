"""epqlab: run MoE GGUF models larger than RAM by paging routed experts from SSD into a fixed
RAM arena during llama.cpp generation, and measure everything about doing so.

Public API: :func:`inspect` (GGUF expert layout), :class:`Pager` (native expert pager),
:class:`Session` (generation with paged experts), :mod:`epqlab.models`, :mod:`epqlab.routes`.

Importing epqlab is light: llama.cpp (``llama_cpp``) and epqlab's native extension load on first use
(a :class:`Session`, a :class:`Pager`, :func:`probe_io`), so route analysis (:mod:`epqlab.routes`)
runs in a process that never loads the engine. :class:`Session`, :class:`Generation` and
:func:`sweep` are resolved by the module ``__getattr__`` below (PEP 562).
"""
from __future__ import annotations

# No llama_cpp here: `import epqlab` loads neither libllama nor the engine extension; they load with the first
# Session (epqlab._native imports llama_cpp before the engine module: one copy of libllama). The pager and the
# I/O probe (epqlab._pager_core) never need them (docs/DESIGN.md, "Native modules").
from .errors import (
    ArenaTooSmall,
    EpqlabError,
    LlamaCppError,
    ModelChangedError,
    ModelNotFoundError,
    NotGGUFError,
    NotMoEError,
    PagerIOError,
    SplitModelError,
    TruncatedModelError,
)
from .layout import ExpertLayer, ExpertTensor, ModelLayout, SlotClass, inspect
from .pager import Pager
from .probe import probe_io
from .units import fmt_bytes, parse_bytes

from importlib.metadata import version as _version

__version__ = _version("epqlab")  # pyproject.toml's, the one place it is written (the C++ module gets it too)
del _version

# name -> module that defines it, imported on first access (PEP 562)
_LAZY = {"Session": ".session", "Generation": ".generation", "Stream": ".generation", "sweep": ".sweeps"}


def __getattr__(name: str):
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'epqlab' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(mod, __name__), name)
    globals()[name] = value
    return value


__all__ = [
    "ArenaTooSmall", "EpqlabError", "LlamaCppError", "ModelChangedError", "ModelNotFoundError", "NotGGUFError", "NotMoEError", "PagerIOError",
    "SplitModelError", "TruncatedModelError", "ExpertLayer", "ExpertTensor", "ModelLayout", "SlotClass",
    "inspect", "probe_io", "Pager", "Session", "Generation", "Stream", "sweep", "fmt_bytes", "parse_bytes", "__version__",
]
