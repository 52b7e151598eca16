"""epqlab: run MoE GGUF models larger than RAM by paging routed experts from SSD into a fixed
RAM arena during llama.cpp generation, and measure everything about doing so.

Public API: :func:`inspect` (GGUF expert layout), :class:`Pager` (native expert pager),
:class:`Session` (generation with paged experts), :mod:`epqlab.models`, :mod:`epqlab.routes`.

Importing epqlab is light: llama.cpp (``llama_cpp``) and epqlab's native extension load on first use
(a :class:`Session`, a :class:`Pager`, :func:`probe_io`), so route analysis (:mod:`epqlab.routes`)
runs in a process that never loads the engine. The package's rooms and the one direction their imports
run are drawn in docs/DESIGN.md §1. :class:`Session`, :class:`Generation` and
:func:`sweep` are resolved by the module ``__getattr__`` below (PEP 562).
"""
from __future__ import annotations

# No llama_cpp here: `import epqlab` loads neither libllama nor the engine extension; they load with the first
# Session (epqlab.engine.native imports llama_cpp before the engine module: one copy of libllama). The pager and the
# I/O probe (epqlab._pager_core) never need them (docs/DESIGN.md, "Native modules").
from .errors import (
    ArenaTooSmall,
    BudgetTooLargeError,
    ContextFullError,
    EpqlabError,
    LlamaCppError,
    ModelChangedError,
    ModelNotFoundError,
    NotGGUFError,
    NotMoEError,
    PagerIOError,
    SplitModelError,
    TruncatedModelError,
    UnsupportedArchError,
)
from . import _aliases
from .layout import ExpertLayer, ExpertTensor, ModelLayout, SlotClass, inspect
from .paging.pager import Pager
from .paging.probe import probe_io
from .units import fmt_bytes, parse_bytes

_aliases.install()  # the module paths before the rooms (epqlab.studies.strict, epqlab.paging.pager, ...) keep importing

from importlib.metadata import version as _version

__version__ = _version("epqlab")  # pyproject.toml's, the one place it is written (the C++ module gets it too)
del _version

# name -> module that defines it, imported on first access (PEP 562)
_LAZY = {"Session": ".requests.session", "Generation": ".engine.generation", "Stream": ".engine.generation",
         "sweep": ".studies.sweeps", "plan": ".studies.plan", "tune": ".studies.tune"}
# subpackages and modules reachable as attributes without an explicit import (``epqlab.models.synthesize``)
_SUBMODULES = ("models", "routes", "data", "memory", "paging", "engine", "requests", "studies", "papers", "constants",
               "errors", "units", "results", "layout", "widgets", "server")


def __getattr__(name: str):
    import importlib

    mod = _LAZY.get(name)
    if mod is not None:
        value = getattr(importlib.import_module(mod, __name__), name)
    elif name in _SUBMODULES or _aliases.target(f"{__name__}.{name}") is not None:
        value = importlib.import_module(f"{__name__}.{name}")
    else:
        raise AttributeError(f"module 'epqlab' has no attribute {name!r}")
    globals()[name] = value
    return value


__all__ = [
    "ArenaTooSmall", "BudgetTooLargeError", "ContextFullError", "EpqlabError", "LlamaCppError", "ModelChangedError", "ModelNotFoundError", "NotGGUFError", "NotMoEError", "PagerIOError", "UnsupportedArchError",
    "SplitModelError", "TruncatedModelError", "ExpertLayer", "ExpertTensor", "ModelLayout", "SlotClass",
    "inspect", "probe_io", "Pager", "Session", "Generation", "Stream", "sweep", "plan", "tune", "fmt_bytes", "parse_bytes", "__version__",
]
