"""The llama.cpp runtime: a :class:`Session` decodes with stock llama.cpp while the pager serves
the routed experts.

- :mod:`.session` (the Session's lifecycle), :mod:`.decoder` (the decode protocol: one llama.cpp
  context, its epoch and KV positions, recorded routes), :mod:`.options` (checks of the paging and
  prefetch options), :mod:`.arena_sizing` (budget -> arena);
- :mod:`.generation` (streams and their results), :mod:`.sampling` (llama.cpp's sampler chain),
  :mod:`.stop_text` (text held back at stop strings), :mod:`.tokens` (the token-id check), :mod:`.batch`
  (batched decode and the continuous batcher);
- :mod:`.perplexity` (the one definition), :mod:`.run_stats` (counters, rates, JSONL),
  :mod:`.time_split`;
- :mod:`.prefetch` (next-layer predictors), :mod:`.predictor` (the trained predictor at run time;
  fitting it is a study: :mod:`epqlab.studies.predictor_fit`);
- :mod:`.native`: loads ``llama_cpp`` then ``epqlab._core`` (the hook and the engine).

The request surface (OpenAI's shapes, tools, structured output, llama-cpp-python's ``create_completion``) is
its own room above this one, :mod:`epqlab.requests`; nothing here imports it. Nothing here is imported by
``import epqlab``: the engine loads with the first Session.
"""
