"""The request surface: a request in the shapes clients send (OpenAI's completions and chat today) turned into
calls on the runtime (:mod:`epqlab.engine`), and its results turned back into those shapes.

- :mod:`.session`: the public :class:`~epqlab.requests.session.Session` (``epqlab.Session``): the runtime's
  Session with llama-cpp-python's ``create_completion`` / ``create_chat_completion`` / ``__call__``;
- :mod:`.completion` (the OpenAI-shaped API: prompts, messages, chunks, logprobs, usage),
  :mod:`.completion_run` (how a request's choices run: prompt forms, ``max_tokens``, the sampler arguments,
  one event stream over the runtime's Stream or Batcher);
- :mod:`.tools` (tool calls: prompts, forced-call grammars, parsing replies), :mod:`.structured`
  (``response_format`` / JSON schema -> GBNF, the chat template), :mod:`.schema_ints` (bounded integers in
  GBNF).

Imports run one way: the server (:mod:`epqlab.server`) imports this room, this room imports the runtime
(:mod:`epqlab.engine`), never the reverse (docs/DESIGN.md §1, tests/test_layers.py). What stays in the
runtime though a request uses it: llama.cpp's sampler chain (:mod:`epqlab.engine.sampling`), stop strings
(:mod:`epqlab.engine.stop_text`: the runtime's Stream and Batcher hold text back at them) and the token-id check
(:mod:`epqlab.engine.tokens`: the decoder's).

Nothing here is imported by ``import epqlab``: it loads with ``epqlab.Session``.
"""
