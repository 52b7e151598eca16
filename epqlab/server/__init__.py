"""An OpenAI-compatible HTTP server on one :class:`epqlab.Session` (``epqlab serve MODEL``), built on
FastAPI + uvicorn + sse-starlette (install with ``pip install 'epqlab[serve]'``).

Endpoints, as llama-cpp-python's server and the OpenAI API define them:

- ``GET  /health``: ``{"status": "ok"}``, the one endpoint that needs no API key; 503 ``{"status": "error",
  "error": {...}}`` once the model file changed on disk (:mod:`epqlab.engine.file_watch`), when every other
  request gets 503 with the reason too.
- ``GET  /v1/models``: the one model (its file name).
- ``POST /v1/completions``: :meth:`epqlab.Session.create_completion` (its ``usage`` with OpenAI's
  ``prompt_tokens_details.cached_tokens``: the prompt tokens the prompt cache held; so chat's).
- ``POST /v1/chat/completions``: :meth:`epqlab.Session.create_chat_completion` (tools, ``response_format``,
  ``logprobs`` included: :mod:`epqlab.requests.completion`).
  Both stream Server-Sent Events with ``"stream": true`` (``data: {chunk}`` lines, then ``data: [DONE]``);
  ``"stream_options": {"include_usage": true}`` adds OpenAI's last chunk with ``usage`` and ``"choices": []``.
- ``POST /tokenize`` and ``/extras/tokenize`` (``{"input": str}`` -> ``{"tokens": [int]}``),
  ``/extras/tokenize/count`` (-> ``{"count": int}``), ``POST /detokenize`` and ``/extras/detokenize``
  (``{"tokens": [int]}`` -> ``{"text": str}``): llama-cpp-python's server's shapes.
- ``POST /v1/messages`` and ``/v1/messages/count_tokens``: Anthropic's Messages API (:mod:`.anthropic_messages`;
  errors in Anthropic's shape, the key also as ``x-api-key``); ``POST /v1/responses``: OpenAI's Responses API
  (:mod:`.openai_responses`, ``previous_response_id`` over :mod:`.response_store`; ``GET`` / ``DELETE
  /v1/responses/{id}``: a stored response, and its deletion). Both run as one chat request
  (:mod:`.translate`): the same batcher, prompt cache, limits and refusals as chat.
- ``POST /v1/embeddings``: 400, naming why (a causal MoE language model's hidden states are not embeddings).
- ``GET  /v1/epqlab/stats``: the session's cumulative pager stats (:attr:`epqlab.Session.stats`),
  ``batch``: the continuous batcher's figures (:meth:`epqlab.engine.batch.Batcher.summary`: prompt tokens
  and the prompt-cache cells reused for them, steps, batch
  sizes, mean union of experts per layer per step, SSD bytes per token) and its last steps; with a pager,
  ``time_split``: the mean milliseconds per part of its decode calls
  (:func:`epqlab.engine.time_split.decode_summary`).

Keys and limits: with an API key (``--api-key`` / ``EPQLAB_API_KEY``) every endpoint but ``/health`` answers
401 (the path's API's error body, ``authentication_error``) without ``Authorization: Bearer <key>`` (the scheme in
any case, RFC 7235) or ``x-api-key: <key>``; an unknown request field gets 400 naming it (:data:`~epqlab.server.fields.IGNORED` lists the
OpenAI fields accepted without effect); a body over
``--max-body-bytes`` gets 413 before it is parsed; a prompt that does not fit the context, or a ``max_tokens``
that does not fit after the prompt, gets 400 before any decoding (the server does not clamp ``max_tokens``,
as OpenAI's API does not), naming ``--n-ctx``; OpenAI's ranges hold where llama-cpp-python's differ:
``max_tokens`` / ``max_completion_tokens`` >= 1 or null (until the context is full), ``temperature`` in 0..2
(:func:`~epqlab.server.fields.check_openai_ranges`); errors name the server's fixes, never a Session's
(:mod:`epqlab.server.wording`).

Scheduling: continuous batching (:mod:`epqlab.engine.batch`) on one Session opened with
``n_seq_max = max_batch``: a request joins the running batch at its next step (prefilled alone first),
advances one token per step with every other active request in one forward pass, and leaves when it
ends; ``n`` > 1 and several prompts are several sequences. A finished sequence keeps its KV cells, so a
request whose prompt extends one (a chat's next turn) decodes only the rest: by default (``--prompt-cache
exact``) only whole ubatches of the earlier prompt's evaluation are reused, so an answer never depends on
what was cached; ``--prompt-cache fast`` reuses the whole common prefix (llama.cpp's server's
``cache_prompt``: answers may differ from uncached ones by llama.cpp's rounding), ``off`` nothing; the
``batch`` figures of ``/v1/epqlab/stats`` count the reused cells. A bad request
(malformed JSON, a field of the wrong type, a value out of range, messages that are not
``[{"role", "content": str}]``, a prompt longer than the context) gets HTTP 400 (422 for JSON that
does not match the schema) with an OpenAI-style ``{"error": {"message", "type"}}`` body; the server
keeps serving. A client that disconnects, streaming or not, frees its sequence at the next step without
disturbing the others.

The package, one room (the entry points': it imports the request surface, :mod:`epqlab.requests`, which imports
the runtime, :mod:`epqlab.engine`):

- :mod:`.app`: the app and its lifecycle (:func:`create_app`, :func:`serve`, :func:`bind_socket`);
- shared by every API: :mod:`.guard` (API key, model-file check, body limit: ASGI, before parsing),
  :mod:`.fields` (unknown fields refused or ignored by name; the sampling fields as keyword arguments),
  :mod:`.streaming` (wait for an answer or stream it as SSE; disconnects and shutdown), :mod:`.http_errors`
  (OpenAI's error shape and the app-wide handlers), :mod:`.wording` (errors in the server's terms),
  :mod:`.context` (what the API modules share);
- one module per API surface: :mod:`.openai_chat` (OpenAI's completions, chat completions, models,
  embeddings), :mod:`.anthropic_messages` (Anthropic's Messages API), :mod:`.openai_responses` (OpenAI's Responses
  API, with :mod:`.response_store`), :mod:`.epqlab_routes` (health, tokenize/detokenize, ``/v1/epqlab/stats``);
  :mod:`.translate` and :mod:`.error_shapes` are what the two newer ones share.
"""
from __future__ import annotations

from .app import MAX_BODY_BYTES, WAITERS, _require, bind_socket, create_app, serve
from .fields import IGNORED, UNSUPPORTED
from .guard import _bearer, _Guard

__all__ = ["create_app", "serve", "bind_socket"]
