"""Plain llama-cpp-python ``Llama`` as a reference model, safe on CPUs with Intel AMX.

llama-cpp-python's ``Llama()`` loads with ``use_extra_bufts`` on (CPU weight repacking). A wheel built with
``GGML_NATIVE`` on a CPU with AMX also registers ggml's AMX buffer type among those extra buffers, and with it the
first ``eval`` of a Q4_1 model (the default model) segfaults inside ggml's AMX matmul — a known upstream bug,
ggml-org/llama.cpp#20824 (open). Our own engine loads with ``use_extra_bufts = false`` (docs/DESIGN.md §3, the
loader) and is not affected; the plain references (``tests``, :func:`epqlab.studies.model_quality.llama_cpp_perplexity`)
go through :func:`plain_llama`, which turns the extra buffers off on an AMX build only, so everywhere else the
reference keeps llama-cpp-python's default kernels.
"""
from __future__ import annotations

import functools
import os
import threading

_PATCH_LOCK = threading.Lock()


@functools.lru_cache(maxsize=None)
def build_has_amx() -> bool:
    """True when the loaded llama.cpp build has ggml's AMX kernels in use (``llama_print_system_info`` lists
    ``AMX_INT8 = 1``): then its extra CPU buffer types include AMX, see the module docstring."""
    import llama_cpp

    info = llama_cpp.llama_print_system_info()
    info = info.decode(errors="replace") if isinstance(info, bytes) else str(info)
    return "AMX_INT8 = 1" in info


def plain_llama(path: str | os.PathLike, **kw):
    """``llama_cpp.Llama(str(path), **kw)``, with ``use_extra_bufts`` off where :func:`build_has_amx`.

    ``Llama`` takes no ``use_extra_bufts`` argument; it fills its model params from
    ``llama_cpp.llama_model_default_params()``, so for the duration of the constructor (under a lock) that
    function is wrapped to return params with the flag cleared, and restored afterwards.

    Raises:
        ValueError: from ``Llama`` when the file cannot be loaded.
    """
    import llama_cpp
    from llama_cpp import llama as llama_mod

    if not build_has_amx():
        return llama_cpp.Llama(str(path), **kw)
    lib = llama_mod.llama_cpp  # the module whose llama_model_default_params Llama() calls
    with _PATCH_LOCK:
        orig = lib.llama_model_default_params

        def defaults():
            mp = orig()
            mp.use_extra_bufts = False
            return mp

        lib.llama_model_default_params = defaults
        try:
            return llama_cpp.Llama(str(path), **kw)
        finally:
            lib.llama_model_default_params = orig
