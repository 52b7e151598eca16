"""Structured output: the GBNF grammar a request asks for (OpenAI's ``response_format``, llama-cpp-python's
``grammar=``) and the vocabulary llama.cpp's grammar sampler needs.

- ``{"type": "json_object"}``: llama-cpp-python's ``JSON_GBNF`` (any JSON value; llama-cpp-python's
  server uses the same grammar for JSON mode).
- ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}`` (OpenAI's shape; a bare
  ``{"schema": ...}`` or llama-cpp-python's ``{"type": "json_object", "schema": {...}}`` too): the schema
  through llama-cpp-python's JSON-schema -> GBNF converter (``llama_cpp.llama_grammar.json_schema_to_gbnf``,
  a port of llama.cpp's ``json_schema_to_grammar``). The converter covers what it covers (types, enums,
  const, required, ``additionalProperties``, string lengths, integer bounds, ``$ref``, ``anyOf``...); a
  schema it cannot convert is refused with its error.
- ``grammar``: a GBNF string (root rule ``root``), or a ``llama_cpp.LlamaGrammar``.

The grammar sampler (``llama_sampler_init_grammar``) needs a ``llama_vocab *`` of llama-cpp-python's
library: :func:`vocab_of` loads the GGUF once more with ``vocab_only`` (the tokenizer only, no tensors:
a few MB, once per model file per process) and keeps it for the life of the process.
"""
from __future__ import annotations

import json
import threading

_VOCABS: dict[str, tuple] = {}  # model path -> (llama_model *, llama_vocab *), vocab-only loads
_LOCK = threading.Lock()
_LOOSE_CHAR = 'char ::= [^"\\\\] |'
_JSON_CHAR = 'char ::= [^"\\\\\\x7F\\x00-\\x1F] |'


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

    if isinstance(schema, (dict, bool)):
        schema = json.dumps(schema)
    if not isinstance(schema, str):
        raise ValueError(f"a JSON schema must be an object, got {type(schema).__name__}")
    try:
        g = json_schema_to_gbnf(schema)
    except Exception as e:  # noqa: BLE001 - the converter raises whatever it meets; the request is at fault
        raise ValueError(f"the JSON schema could not be converted to a grammar ({type(e).__name__}: {e})") from None
    # llama-cpp-python 0.3.36's string character rule admits raw control characters (a newline inside a
    # string: invalid JSON); llama.cpp's own converter (common/json-schema-to-grammar.cpp, PRIMITIVE_RULES
    # "char") excludes them, as JSON (RFC 8259 section 7) does: use its rule
    return g.replace(_LOOSE_CHAR, _JSON_CHAR)


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
