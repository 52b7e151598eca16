"""Structured output: the GBNF grammar a request asks for (OpenAI's ``response_format``, llama-cpp-python's
``grammar=``) and the vocabulary llama.cpp's grammar sampler needs.

- ``{"type": "json_object"}``: llama-cpp-python's ``JSON_GBNF`` (any JSON value; llama-cpp-python's
  server uses the same grammar for JSON mode).
- ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}`` (OpenAI's shape; a bare
  ``{"schema": ...}`` or llama-cpp-python's ``{"type": "json_object", "schema": {...}}`` too): the schema
  through llama-cpp-python's JSON-schema -> GBNF converter (``llama_cpp.llama_grammar.json_schema_to_gbnf``,
  a port of llama.cpp's ``json_schema_to_grammar``). The converter covers what it covers (types, enums,
  const, required, ``additionalProperties``, string lengths, ``$ref``, ``anyOf``...); a schema it cannot convert
  is refused with its error. Integer bounds (``minimum``, ``maximum``, ``exclusiveMinimum``,
  ``exclusiveMaximum``), which that converter ignores, get llama.cpp's own rule
  (:mod:`epqlab.requests.schema_ints`); an integer without bounds has at most 16 digits (the converter's rule).
- ``grammar``: a GBNF string (root rule ``root``), or a ``llama_cpp.LlamaGrammar``.

The grammar sampler (``llama_sampler_init_grammar``) needs a ``llama_vocab *`` of llama-cpp-python's
library: :func:`vocab_of` loads the GGUF once more with ``vocab_only`` (the tokenizer only, no tensors:
a few MB, once per model file per process) and keeps it for the life of the process.
"""
from __future__ import annotations

import json
import threading

from .schema_ints import bounded_int_schema, int_range_gbnf

_VOCABS: dict[str, tuple] = {}  # model path -> (llama_model *, llama_vocab *), vocab-only loads
_LOCK = threading.Lock()
_LOOSE_CHAR = 'char ::= [^"\\\\] |'
_JSON_CHAR = 'char ::= [^"\\\\\\x7F\\x00-\\x1F] |'
_INT_MARK = "__epqlab_bounded_int_"  # stands for a bounded integer while the converter runs (schema_grammar)


def vocab_of(session):
    """``llama_vocab *`` of ``session``'s model in llama-cpp-python's library (vocab-only load, cached per
    path). Raises ValueError when llama.cpp cannot load it."""
    import llama_cpp as L

    path = str(session.layout.path)
    with _LOCK:
        hit = _VOCABS.get(path)
        if hit is None:
            p = L.llama_model_default_params()
            p.vocab_only = True
            m = L.llama_model_load_from_file(path.encode(), p)
            if not m:
                raise ValueError(f"llama.cpp could not load the vocabulary of {path}")
            hit = _VOCABS[path] = (m, L.llama_model_get_vocab(m))
        return hit[1]


def chat_template(session) -> str | None:
    """The GGUF's ``tokenizer.chat_template`` (jinja2 source), or None."""
    import llama_cpp as L

    vocab_of(session)
    t = L.llama_model_chat_template(_VOCABS[str(session.layout.path)][0], None)
    return t.decode("utf-8", "replace") if t else None


def schema_grammar(schema) -> str:
    """GBNF for a JSON schema (dict or JSON text) through llama-cpp-python's converter. Raises ValueError
    naming what the converter refused."""
    from llama_cpp.llama_grammar import json_schema_to_gbnf

    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise ValueError(f"the JSON schema is not JSON ({e})") from None
    if not isinstance(schema, (dict, bool)):
        raise ValueError(f"a JSON schema must be an object, got {type(schema).__name__}")
    ints: list[str] = []
    schema = _mark_bounded_ints(schema, ints)
    try:
        g = json_schema_to_gbnf(json.dumps(schema))
    except Exception as e:  # noqa: BLE001 - the converter raises whatever it meets; the request is at fault
        raise ValueError(f"the JSON schema could not be converted to a grammar ({type(e).__name__}: {e})") from None
    # llama-cpp-python 0.3.36's string character rule admits raw control characters (a newline inside a
    # string: invalid JSON); llama.cpp's own converter (common/json-schema-to-grammar.cpp, PRIMITIVE_RULES
    # "char") excludes them, as JSON (RFC 8259 section 7) does: use its rule
    g = g.replace(_LOOSE_CHAR, _JSON_CHAR)
    # bounded integers: the converter wrote each as a constant string, here replaced by llama.cpp's range rule
    for i, expr in enumerate(ints):
        g = g.replace(f'"\\"{_INT_MARK}{i}__\\""', f"({expr}) space")
    return g


def _mark_bounded_ints(schema, ints: list):
    """``schema`` with each integer subschema that has bounds replaced by a constant string naming its index in
    ``ints``, to which the bounds' GBNF (:func:`epqlab.requests.schema_ints.int_range_gbnf`) is appended. Values of
    ``const``, ``enum``, ``default`` and ``examples`` are data, not schemas: left as they are."""
    if isinstance(schema, list):
        return [_mark_bounded_ints(x, ints) for x in schema]
    if not isinstance(schema, dict):
        return schema
    b = bounded_int_schema(schema)
    if b is not None:
        ints.append(int_range_gbnf(*b))
        return {"const": f"{_INT_MARK}{len(ints) - 1}__"}
    return {k: v if k in ("const", "enum", "default", "examples") else _mark_bounded_ints(v, ints)
            for k, v in schema.items()}


def request_grammar(response_format=None, grammar=None) -> str | None:
    """The GBNF a request's ``response_format`` / ``grammar`` ask for (module docstring), or None for plain
    text. Raises ValueError for an unknown type, a malformed format, both given at once."""
    from llama_cpp.llama_grammar import JSON_GBNF

    g = None
    if grammar is not None and grammar != "":
        g = getattr(grammar, "_grammar", grammar)  # a llama_cpp.LlamaGrammar
        if not isinstance(g, str):
            raise ValueError(f"grammar must be a GBNF string, got {type(grammar).__name__}")
    if response_format is None:
        return g
    if hasattr(response_format, "model_dump"):
        response_format = response_format.model_dump()
    if not isinstance(response_format, dict) or "type" not in response_format:
        raise ValueError('response_format must be {"type": "text" | "json_object" | "json_schema", ...}')
    typ = response_format["type"]
    if typ == "text":
        return g
    if g is not None:
        raise ValueError("pass either grammar or a JSON response_format, not both")
    if typ == "json_object":
        schema = response_format.get("schema")
        return JSON_GBNF if schema is None else schema_grammar(schema)
    if typ == "json_schema":
        js = response_format.get("json_schema")
        if not isinstance(js, dict):
            raise ValueError('response_format json_schema needs "json_schema": {"name": ..., "schema": {...}}')
        schema = js.get("schema", js if "type" in js or "properties" in js else None)
        if schema is None:
            raise ValueError('response_format json_schema needs "json_schema": {"name": ..., "schema": {...}}')
        return schema_grammar(schema)
    raise ValueError(f"response_format type {typ!r} is not one of text, json_object, json_schema")


__all__ = ["vocab_of", "chat_template", "schema_grammar", "request_grammar"]
