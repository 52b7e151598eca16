"""Token sampling through llama.cpp's own sampler chain (``llama_sampler_chain_*``), reached through
llama-cpp-python's low-level ctypes API and loaded only when a sampler is first built.

The chain is the one llama-cpp-python's ``Llama`` builds (``Llama._init_sampler``): penalties
(repeat penalty over the last ``penalty_last_n`` tokens), then greedy when ``temperature <= 0``, else
top-k, top-p, min-p, temperature and the seeded ``dist`` draw (std::mt19937 seeded with ``seed``).
llama.cpp reads ``top_k <= 0``, ``top_p >= 1`` and ``min_p <= 0`` as "off". The logits are the float32
rows :meth:`epqlab.Session.logits` returns; they are copied into a ``llama_token_data_array`` and the
chain picks the token (``llama_sampler_apply``, then ``selected``).
"""
from __future__ import annotations

import ctypes
import math
import random

import numpy as np

DEFAULT_SEED = 0xFFFFFFFF  # llama.cpp's LLAMA_DEFAULT_SEED: a random seed per sampler
PENALTY_LAST_N = 64  # tokens the repeat penalty looks back over (llama-cpp-python's last_n_tokens_size)


def _check(name: str, v, lo=None, hi=None, integer=False):
    if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)):
        raise ValueError(f"{name} must be a number, got {v!r}")
    if integer and int(v) != v:
        raise ValueError(f"{name} must be an integer, got {v!r}")
    if not math.isfinite(float(v)):
        raise ValueError(f"{name} must be finite, got {v!r}")
    if lo is not None and v < lo:
        raise ValueError(f"{name} must be >= {lo}, got {v!r}")
    if hi is not None and v > hi:
        raise ValueError(f"{name} must be <= {hi}, got {v!r}")


class Sampler:
    """A llama.cpp sampler chain for one generation; call :meth:`sample` with each step's logits.

    Args:
        n_vocab: vocabulary size (length of each logits row).
        temperature: <= 0 picks the argmax (``llama_sampler_init_greedy``).
        top_k, top_p, min_p: llama.cpp's top-k / nucleus / min-p filters (off at 0, 1.0, 0.0).
        repeat_penalty: > 0; 1.0 is off. Divides positive (multiplies negative) logits of tokens
            among the last :data:`PENALTY_LAST_N` accepted ones (prompt tokens included, as
            llama-cpp-python does).
        seed: int in 0..2**32-1, or None for a random one.

    Raises:
        ValueError: a parameter that is not a finite number in its range (the message names it).
    """

    def __init__(self, n_vocab: int, *, temperature: float = 0.8, top_k: int = 40, top_p: float = 0.95,
                 min_p: float = 0.05, repeat_penalty: float = 1.0, seed: int | None = None):
        import llama_cpp as L  # the ctypes API; loaded here, not at import time of epqlab

        _check("temperature", temperature)
        _check("top_k", top_k, integer=True)
        _check("top_p", top_p, 0.0, 1.0)
        _check("min_p", min_p, 0.0, 1.0)
        _check("repeat_penalty", repeat_penalty)
        if repeat_penalty <= 0:
            raise ValueError(f"repeat_penalty must be > 0 (1.0 = off), got {repeat_penalty!r}")
        if seed is None:
            seed = random.randrange(2**32 - 1)
        _check("seed", seed, 0, 2**32 - 1, integer=True)
        self._L = L
        self.n_vocab = int(n_vocab)
        self.temperature = float(temperature)
        self.seed = int(seed)
        chain = L.llama_sampler_chain_init(L.llama_sampler_chain_default_params())
        self._chain = chain
        add = lambda s: L.llama_sampler_chain_add(chain, s)  # the chain owns what is added
        if repeat_penalty != 1.0:
            add(L.llama_sampler_init_penalties(self.n_vocab, PENALTY_LAST_N, float(repeat_penalty), 0.0, 0.0))
        if self.temperature <= 0:
            add(L.llama_sampler_init_greedy())
        else:
            add(L.llama_sampler_init_top_k(int(top_k)))
            add(L.llama_sampler_init_top_p(float(top_p), 1))
            add(L.llama_sampler_init_min_p(float(min_p), 1))
            add(L.llama_sampler_init_temp(self.temperature))
            add(L.llama_sampler_init_dist(self.seed))
        self._data = (L.llama_token_data * self.n_vocab)()
        rec = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)])
        self._view = np.frombuffer(self._data, dtype=rec)
        self._ids = np.arange(self.n_vocab, dtype=np.int32)

    def accept(self, tokens) -> None:
        """Tell the chain about tokens of the context (the prompt, then each sampled token): the
        repeat penalty looks at them."""
        for t in tokens:
            self._L.llama_sampler_accept(self._chain, int(t))

    def sample(self, logits: np.ndarray) -> int:
        """The next token id from float32 logits ``[n_vocab]`` (accepted into the chain)."""
        L = self._L
        if self._chain is None:
            raise RuntimeError("this Sampler was freed")
        v = self._view
        v["id"] = self._ids
        v["logit"] = logits
        v["p"] = 0.0
        arr = L.llama_token_data_array(data=ctypes.cast(self._data, L.llama_token_data_p), size=self.n_vocab,
                                       selected=-1, sorted=False)
        L.llama_sampler_apply(self._chain, ctypes.byref(arr))
        if not 0 <= arr.selected < arr.size:
            raise RuntimeError(f"llama.cpp's sampler chain selected no token (selected={arr.selected})")
        tok = int(arr.data[arr.selected].id)
        L.llama_sampler_accept(self._chain, tok)
        return tok

    def free(self) -> None:
        if self._chain is not None:
            self._L.llama_sampler_free(self._chain)
            self._chain = None

    def __del__(self):
        try:
            self.free()
        except Exception:
            pass


__all__ = ["Sampler", "DEFAULT_SEED", "PENALTY_LAST_N"]
