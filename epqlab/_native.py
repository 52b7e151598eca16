"""Loads the compiled extension ``epqlab._core``.

``llama_cpp`` is imported first on purpose: it opens libllama by path (ctypes); our extension
links it by SONAME. Importing llama_cpp first leaves one copy of libllama in the process
(two copies would each hold their own backend registry).
"""
from __future__ import annotations

import llama_cpp  # noqa: F401  (must precede _core; see module docstring)

try:
    from . import _core  # type: ignore[attr-defined]
except ImportError as e:  # pragma: no cover - only when the build is missing
    raise ImportError(
        f"epqlab's C++ extension is not built ({e}). Run `bash scripts/setup` from the repository root "
        "(or `pip install --no-build-isolation -e .` in an environment that has llama-cpp-python==0.3.36)."
    ) from e

core = _core

# EPQLAB_VERBOSE=1 shows llama.cpp's own log on stderr (otherwise only its errors, folded into
# the exceptions epqlab raises).
import os as _os  # noqa: E402

if _os.environ.get("EPQLAB_VERBOSE", "") not in ("", "0"):
    core.set_verbose(True)
