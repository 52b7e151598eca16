"""Token-id arrays: the one check every entry point that takes token ids goes through."""
from __future__ import annotations

import numbers

import numpy as np


def token_array(tokens) -> np.ndarray:
    """Token ids as int64 ``[n]``. Raises ValueError for non-integer ids (no silent rounding) and
    TypeError for something that is not a sequence of ids."""
    try:
        a = np.asarray(tokens).ravel()
    except (TypeError, ValueError) as e:
        raise TypeError(f"token ids must be a sequence of ints, got {type(tokens).__name__} ({e})") from None
    if a.size == 0:
        return a.astype(np.int64)
    if a.dtype == object and all(isinstance(x, numbers.Integral) and not isinstance(x, bool) for x in a):
        a = np.array([int(x) for x in a], dtype=object)
        if any(x < -(2**63) or x >= 2**63 for x in a):
            raise ValueError("token ids must be in the vocabulary; got an id beyond 64 bits")
        return a.astype(np.int64)
    if a.dtype == bool or not np.issubdtype(a.dtype, np.integer):
        raise ValueError(f"token ids must be integers, got {a.dtype} values (e.g. {a[0]!r})")
    return a.astype(np.int64)


__all__ = ["token_array"]
