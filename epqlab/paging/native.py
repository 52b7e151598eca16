"""Loads the pager extension ``epqlab._pager_core``: the expert pager and the device I/O probe, with no
llama.cpp dependency (it links only ``libepqlab_pager.so``, installed beside it). Importing this module
neither imports ``llama_cpp`` nor maps libllama, so the pager and the probe load and test alone;
:mod:`epqlab.engine.native` adds the engine (``epqlab._core``) when a Session needs it.
"""
from __future__ import annotations

import importlib


def import_extension(name: str):
    """``epqlab.<name>``, one of the compiled modules, or an ImportError that says how to build it."""
    try:
        return importlib.import_module(f"epqlab.{name}")
    except ImportError as e:  # pragma: no cover - only when the build is missing
        raise ImportError(
            f"epqlab's C++ extension {name} is not built ({e}). Run `bash scripts/setup` from the repository root "
            "(or `pip install --no-build-isolation -e .` in an environment that has llama-cpp-python==0.3.36)."
        ) from e


pager_core = import_extension("_pager_core")

__all__ = ["pager_core", "import_extension"]
