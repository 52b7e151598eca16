"""Byte-size parsing and formatting ("4GiB" <-> 4294967296)."""
from __future__ import annotations

import math
import re

MAX_BYTES = 2**62

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
}


def parse_bytes(value: int | float | str) -> int:
    """Parse a byte count: an int, or a string like ``"4GiB"``, ``"512 MiB"``, ``"8GB"``, ``"1.5G"``.

    Binary suffixes (KiB, MiB, GiB, TiB) are powers of 1024; decimal ones (KB, MB, GB, TB, or
    bare K/M/G/T) are powers of 1000. Case-insensitive.

    Raises:
        ValueError: unparseable string, a float or a string without a suffix that is not a whole number
            (``0.5`` and ``"0.5"`` are no byte counts), a negative, infinite or NaN value, or more than
            :data:`MAX_BYTES` (2**62: what a signed 64-bit offset can address with room to add).
    """
    if isinstance(value, bool):
        raise ValueError(f"not a byte count: {value!r}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"not a byte count: {value!r}")
    if isinstance(value, float) and not value.is_integer():
        raise ValueError(f"not a byte count: {value!r} is not a whole number of bytes (a fraction of the "
                         "experts? pass arena sizes as fractions to the sweeps, budgets as bytes or '4GiB')")
    if isinstance(value, (int, float)):
        n = int(value)
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
        if not m or m.group(2).lower() not in _UNITS:
            raise ValueError(f"not a byte count: {value!r} (use e.g. 4GiB, 512MiB, 8GB or a plain integer)")
        if not m.group(2) and not float(m.group(1)).is_integer():  # "0.5" is no byte count either
            raise ValueError(f"not a byte count: {value!r} is not a whole number of bytes (a fraction of the "
                             "experts? pass arena sizes as fractions to the sweeps, budgets as bytes or '4GiB')")
        n = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if n < 0:
        raise ValueError(f"byte count must be >= 0, got {value!r}")
    if n > MAX_BYTES:
        raise ValueError(f"byte count {value!r} is too large (at most {MAX_BYTES} bytes = 4 EiB)")
    return n


def fmt_bytes(n: int | float) -> str:
    """Format a byte count with binary units: 5308416 -> '5.06 MiB'."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
