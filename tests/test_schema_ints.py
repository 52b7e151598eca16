"""JSON-schema integer bounds in structured output (epqlab.requests.schema_ints, epqlab.requests.structured):
llama.cpp's range rule admits exactly the integers within ``minimum`` / ``maximum`` / the exclusive bounds (checked
against integer arithmetic for every value in a window, through Python's regex engine), and a bounded field of a
generated JSON object stays in its range."""
from __future__ import annotations

import json
import re

import pytest

import epqlab
from epqlab.requests.schema_ints import INT64_MAX, INT64_MIN, bounded_int_schema, int_range_gbnf
from epqlab.requests.structured import schema_grammar

CASES = [(0, 120), (-5, 5), (-120, -3), (7, 7), (10, 99), (1, 1000), (-1000, -1), (99, 2001), (INT64_MIN, 0),
         (INT64_MIN, 15), (INT64_MIN, -7), (0, INT64_MAX), (3, INT64_MAX), (-12, INT64_MAX), (250, INT64_MAX),
         (INT64_MIN, 250), (-250, INT64_MAX)]


def _regex(gbnf: str) -> re.Pattern:
    """The GBNF expression (literals, character classes, {m,n}, groups, alternatives) as a Python regex."""
    return re.compile(re.sub(r'"([^"]*)"|\s+', lambda m: re.escape(m.group(1)) if m.group(1) is not None else "", gbnf))


@pytest.mark.parametrize("lo, hi", CASES)
def test_range_rule_admits_exactly_the_range(lo, hi):
    r = _regex(int_range_gbnf(lo, hi))
    for v in range(-2100, 2101):
        assert bool(r.fullmatch(str(v))) == (lo <= v <= hi), v
    for s in ("00", "01", "-007", "1.0", "+1"):
        assert not r.fullmatch(s)
    if r.fullmatch("-0"):  # llama.cpp's rule admits "-0" where 0 is in range: valid JSON for the value 0
        assert lo <= 0 <= hi
    if hi == INT64_MAX:
        assert r.fullmatch("9" * 16) and not r.fullmatch("9" * 17)  # one-sided: at most 16 digits, as unbounded


def test_bounds_from_the_schema():
    assert bounded_int_schema({"type": "integer"}) is None and bounded_int_schema({"type": "number", "minimum": 1}) is None
    assert bounded_int_schema({"type": "integer", "minimum": 0.5, "maximum": 9.5}) == (1, 9)
    assert bounded_int_schema({"type": "integer", "exclusiveMinimum": -3, "exclusiveMaximum": 3}) == (-2, 2)
    assert bounded_int_schema({"type": "integer", "maximum": 4}) == (INT64_MIN, 4)
    with pytest.raises(ValueError, match="admit no integer"):
        bounded_int_schema({"type": "integer", "minimum": 5, "maximum": 4})
    with pytest.raises(ValueError, match="minimum must be a finite number"):
        schema_grammar({"type": "integer", "minimum": "3"})
    g = schema_grammar({"type": "object", "properties": {"a": {"type": "integer", "minimum": 3, "maximum": 7},
                                                         "c": {"const": {"type": "integer", "minimum": 1}}}})
    assert "a ::= ([3-7]) space" in g.splitlines() and "__epqlab" not in g
    assert "minimum" in g  # a const's value is data: not rewritten


def test_generated_bounded_integers_stay_in_range(default_model_path):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 3, "maximum": 7},
                                               "m": {"type": "integer", "exclusiveMinimum": -2, "exclusiveMaximum": 2}},
              "required": ["n", "m"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    seen = set()
    with epqlab.Session(default_model_path, pager=False, n_threads=1, n_ctx=256, n_seq_max=4) as s:
        r = s.create_completion("Numbers as JSON:", max_tokens=40, temperature=1.5, top_k=0, top_p=1.0, min_p=0.0,
                                seed=3, n=4, response_format=fmt)
    for c in r["choices"]:
        obj = json.loads(c["text"])
        assert 3 <= obj["n"] <= 7 and -1 <= obj["m"] <= 1, obj
        seen.add((obj["n"], obj["m"]))
    assert len(seen) > 1  # sampled, not one forced answer
