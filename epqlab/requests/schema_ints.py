"""Integer bounds of a JSON schema (``minimum``, ``maximum``, ``exclusiveMinimum``, ``exclusiveMaximum``) as GBNF.

llama-cpp-python 0.3.36's JSON-schema converter (``llama_cpp.llama_grammar``) ignores them (its ``integer`` rule
admits any integer of up to 16 digits: "TODO: support minimum, maximum, ..."), so an ``"age": {"type": "integer",
"minimum": 0, "maximum": 120}`` could come back as 16 digits. llama.cpp's own converter supports them
(common/json-schema-to-grammar.cpp, ``build_min_max_int``); :func:`int_range_gbnf` is a line-by-line port of it
(MIT licence, ggml-org/llama.cpp, as vendored in llama-cpp-python 0.3.36; one fix: no leading zeros after the
minus sign of an upper bound below zero), and :func:`bounded_int_schema` finds the
bounds of a subschema so :mod:`epqlab.requests.structured` can put the rule where the converter's would be.
"""
from __future__ import annotations

import math
import numbers

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")


def _number(v, key: str):
    if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v):
        raise ValueError(f"integer {key} must be a finite number, got {v!r}")
    return v


def bounded_int_schema(schema) -> tuple[int, int] | None:
    """``(lo, hi)`` (inclusive; :data:`INT64_MIN` / :data:`INT64_MAX` where unbounded) of an integer subschema
    with at least one bound, else None. Fractional bounds round inward (``minimum: 0.5`` admits 1 and up).

    Raises:
        ValueError: a bound that is not a finite number, or bounds that admit no integer (the message names them).
    """
    if not isinstance(schema, dict) or schema.get("type") != "integer" or not any(k in schema for k in _BOUNDS):
        return None
    lo, hi = INT64_MIN, INT64_MAX
    if "minimum" in schema:
        lo = max(lo, math.ceil(_number(schema["minimum"], "minimum")))
    if "exclusiveMinimum" in schema:
        lo = max(lo, math.floor(_number(schema["exclusiveMinimum"], "exclusiveMinimum")) + 1)
    if "maximum" in schema:
        hi = min(hi, math.floor(_number(schema["maximum"], "maximum")))
    if "exclusiveMaximum" in schema:
        hi = min(hi, math.ceil(_number(schema["exclusiveMaximum"], "exclusiveMaximum")) - 1)
    if lo > hi:
        raise ValueError(f"the integer bounds {', '.join(f'{k}={schema[k]!r}' for k in _BOUNDS if k in schema)} "
                         "admit no integer")
    return lo, hi


def int_range_gbnf(lo: int = INT64_MIN, hi: int = INT64_MAX) -> str:
    """A GBNF expression (no rule name, no trailing space) admitting exactly the integers in ``[lo, hi]`` written as
    JSON writes them (no leading zeros; ``-0``, valid JSON for 0, where 0 is in range, as llama.cpp's rule); :data:`INT64_MIN` / :data:`INT64_MAX` mean unbounded on that
    side (then at most 16 digits, as llama.cpp's converter). Raises ValueError when neither side is bounded."""
    out: list[str] = []
    _build(int(lo), int(hi), out, 16, True)
    return "".join(out)


def _build(min_value: int, max_value: int, out: list, decimals_left: int = 16, top_level: bool = True) -> None:
    # port of build_min_max_int, common/json-schema-to-grammar.cpp (llama.cpp as vendored in llama-cpp-python 0.3.36)
    has_min, has_max = min_value != INT64_MIN, max_value != INT64_MAX

    def digit_range(a: str, b: str) -> None:
        out.append(f"[{a}]" if a == b else f"[{a}-{b}]")

    def more_digits(min_digits: int, max_digits: int) -> None:
        out.append("[0-9]")
        if min_digits == max_digits == 1:
            return
        out.append("{" + str(min_digits))
        if max_digits != min_digits:
            out.append(",")
            if max_digits != INT64_MAX:
                out.append(str(max_digits))
        out.append("}")

    def uniform_range(frm: str, to: str) -> None:
        i = 0
        while i < len(frm) and i < len(to) and frm[i] == to[i]:
            i += 1
        if i > 0:
            out.append(f'"{frm[:i]}"')
        if i < len(frm) and i < len(to):
            if i > 0:
                out.append(" ")
            sub_len = len(frm) - i - 1
            if sub_len > 0:
                from_sub, to_sub = frm[i + 1:], to[i + 1:]
                sub_zeros, sub_nines = "0" * sub_len, "9" * sub_len
                to_reached = False
                out.append("(")
                if from_sub == sub_zeros:
                    digit_range(frm[i], chr(ord(to[i]) - 1))
                    out.append(" ")
                    more_digits(sub_len, sub_len)
                else:
                    out.append(f"[{frm[i]}] ")
                    out.append("(")
                    uniform_range(from_sub, sub_nines)
                    out.append(")")
                    if ord(frm[i]) < ord(to[i]) - 1:
                        out.append(" | ")
                        if to_sub == sub_nines:
                            digit_range(chr(ord(frm[i]) + 1), to[i])
                            to_reached = True
                        else:
                            digit_range(chr(ord(frm[i]) + 1), chr(ord(to[i]) - 1))
                        out.append(" ")
                        more_digits(sub_len, sub_len)
                if not to_reached:
                    out.append(" | ")
                    digit_range(to[i], to[i])
                    out.append(" ")
                    uniform_range(sub_zeros, to_sub)
                out.append(")")
            else:
                out.append(f"[{frm[i]}-{to[i]}]")

    if has_min and has_max:
        if min_value < 0 and max_value < 0:
            out.append('"-" (')
            _build(-max_value, -min_value, out, decimals_left, True)
            out.append(")")
            return
        if min_value < 0:
            out.append('"-" (')
            _build(0, -min_value, out, decimals_left, True)
            out.append(") | ")
            min_value = 0
        min_s, max_s = str(min_value), str(max_value)
        for digits in range(len(min_s), len(max_s)):
            uniform_range(min_s, "9" * digits)
            min_s = "1" + "0" * digits
            out.append(" | ")
        uniform_range(min_s, max_s)
        return

    less_decimals = max(decimals_left - 1, 1)
    if has_min:
        if min_value < 0:
            out.append('"-" (')
            _build(INT64_MIN, -min_value, out, decimals_left, False)
            out.append(") | [0] | [1-9] ")
            more_digits(0, decimals_left - 1)
        elif min_value == 0:
            if top_level:
                out.append("[0] | [1-9] ")
                more_digits(0, less_decimals)
            else:
                more_digits(1, decimals_left)
        elif min_value <= 9:
            c = str(min_value)
            range_start = "1" if top_level else "0"
            if c > range_start:
                digit_range(range_start, chr(ord(c) - 1))
                out.append(" ")
                more_digits(1, less_decimals)
                out.append(" | ")
            digit_range(c, "9")
            out.append(" ")
            more_digits(0, less_decimals)
        else:
            min_s = str(min_value)
            n, c = len(min_s), min_s[0]
            if c > "1":
                digit_range("1" if top_level else "0", chr(ord(c) - 1))
                out.append(" ")
                more_digits(n, less_decimals)
                out.append(" | ")
            digit_range(c, c)
            out.append(" (")
            _build(int(min_s[1:]), INT64_MAX, out, less_decimals, False)
            out.append(")")
            if c < "9":
                out.append(" | ")
                digit_range(chr(ord(c) + 1), "9")
                out.append(" ")
                more_digits(n - 1, less_decimals)
        return
    if has_max:
        if max_value >= 0:
            if top_level:
                out.append('"-" [1-9] ')
                more_digits(0, less_decimals)
                out.append(" | ")
            _build(0, max_value, out, decimals_left, True)
        else:
            # llama.cpp passes top_level=false here, which lets "-007" through (leading zeros: not JSON); the
            # digits after "-" are a top-level number
            out.append('"-" (')
            _build(-max_value, INT64_MAX, out, decimals_left, True)
            out.append(")")
        return
    raise ValueError("At least one of min_value or max_value must be set")


__all__ = ["bounded_int_schema", "int_range_gbnf", "INT64_MIN", "INT64_MAX"]
