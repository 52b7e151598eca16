"""Loads the compiled extensions: ``epqlab._pager_core`` (pager, I/O probe; see :mod:`epqlab.paging.native`)
and ``epqlab._core`` (the llama.cpp engine and its expert hook), and exposes both as ``core``.

``llama_cpp`` is imported first on purpose: it opens libllama by path (ctypes); our engine extension
links it by SONAME. Importing llama_cpp first leaves one copy of libllama in the process
(two copies would each hold their own backend registry). The pager module is imported before the
engine module because the engine's functions take its ``Pager`` objects.
"""
from __future__ import annotations

import types

import llama_cpp  # noqa: F401  (must precede _core; see module docstring)

from ..paging.native import import_extension, pager_core

engine_core = import_extension("_core")

# One namespace with both modules' names (Pager, IoProbe, POLICIES, PAGER_COUNTERS from the pager module;
# Engine, HOOK_COUNTERS, malloc_bytes, set_verbose, lazy_load_check from the engine module).
core = types.SimpleNamespace(**{k: getattr(m, k) for m in (pager_core, engine_core)
                                for k in dir(m) if not k.startswith("_")},
                             __version__=engine_core.__version__)

# EPQLAB_VERBOSE=1 shows llama.cpp's own log on stderr (otherwise only its errors, folded into
# the exceptions epqlab raises).
import os as _os  # noqa: E402

if _os.environ.get("EPQLAB_VERBOSE", "") not in ("", "0"):
    core.set_verbose(True)
