"""Loads the compiled extensions: ``epqlab._pager_core`` (pager, I/O probe; see :mod:`epqlab._pager_native`)
and ``epqlab._core`` (the llama.cpp engine and its expert hook), and exposes both as ``core``.

``llama_cpp`` is imported first on purpose: it opens libllama by path (ctypes); our engine extension
links it by SONAME. Importing llama_cpp first leaves one copy of libllama in the process
(two copies would each hold their own backend registry). The pager module is imported before the
engine module because the engine's functions take its ``Pager`` objects.
"""
from __future__ import annotations

import types

import llama_cpp  # noqa: F401  (must precede _core; see module docstring)

from ._pager_native import pager_core

try:
    from . import _core  # type: ignore[attr-defined]
except ImportError as e:  # pragma: no cover - only when the build is missing
    raise ImportError(
        f"epqlab's C++ extension is not built ({e}). Run `bash scripts/setup` from the repository root "
        "(or `pip install --no-build-isolation -e .` in an environment that has llama-cpp-python==0.3.36)."
    ) from e

engine_core = _core

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
