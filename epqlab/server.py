"""An OpenAI-compatible HTTP server on one :class:`epqlab.Session` (``epqlab serve MODEL``), built on
FastAPI + uvicorn + sse-starlette (install with ``pip install 'epqlab[serve]'``).

Endpoints, as llama-cpp-python's server and the OpenAI API define them:

- ``GET  /health``: ``{"status": "ok"}``, the one endpoint that needs no API key; 503 ``{"status": "error",
  "error": {...}}`` once the model file changed on disk (:mod:`epqlab.engine.file_watch`), when every other
  request gets 503 with the reason too.
- ``GET  /v1/models``: the one model (its file name).
- ``POST /v1/completions``: :meth:`epqlab.Session.create_completion`.
- ``POST /v1/chat/completions``: :meth:`epqlab.Session.create_chat_completion` (tools, ``response_format``,
  ``logprobs`` included: :mod:`epqlab.requests.completion`).
  Both stream Server-Sent Events with ``"stream": true`` (``data: {chunk}`` lines, then ``data: [DONE]``);
  ``"stream_options": {"include_usage": true}`` adds OpenAI's last chunk with ``usage`` and ``"choices": []``.
- ``POST /tokenize`` and ``/extras/tokenize`` (``{"input": str}`` -> ``{"tokens": [int]}``),
  ``/extras/tokenize/count`` (-> ``{"count": int}``), ``POST /detokenize`` and ``/extras/detokenize``
  (``{"tokens": [int]}`` -> ``{"text": str}``): llama-cpp-python's server's shapes.
- ``POST /v1/embeddings``: 400, naming why (a causal MoE language model's hidden states are not embeddings).
- ``GET  /v1/epqlab/stats``: the session's cumulative pager stats (:attr:`epqlab.Session.stats`),
  ``batch``: the continuous batcher's figures (:meth:`epqlab.engine.batch.Batcher.summary`: prompt tokens
  and the prompt-cache cells reused for them, steps, batch
  sizes, mean union of experts per layer per step, SSD bytes per token) and its last steps; with a pager,
  ``time_split``: the mean milliseconds per part of its decode calls
  (:func:`epqlab.engine.time_split.decode_summary`).

Keys and limits: with an API key (``--api-key`` / ``EPQLAB_API_KEY``) every endpoint but ``/health`` answers
401 (OpenAI's error body, ``authentication_error``) without ``Authorization: Bearer <key>`` (the scheme in
any case, RFC 7235); an unknown request field gets 400 naming it (:data:`IGNORED` lists the OpenAI fields
accepted without effect); a body over
``--max-body-bytes`` gets 413 before it is parsed; a prompt that does not fit the context, or a ``max_tokens``
that does not fit after the prompt, gets 400 before any decoding (the server does not clamp ``max_tokens``,
as OpenAI's API does not).

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
"""
# no `from __future__ import annotations`: FastAPI reads the endpoint annotations at runtime

import asyncio
import errno
import hmac
import json
import queue
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional, Union

from .engine.batch import Batcher
from .errors import EpqlabError, ModelChangedError
from .requests.completion import create_chat_completion, create_completion
from .engine.time_split import decode_summary
from .results import clean_json

WAITERS = 64  # threads that may wait on running requests at once (each holds one open request)
# OpenAI / llama-cpp-python fields epqlab does not do: refused (400) unless sent at their "off" value, never ignored
# (suffix and best_of are refused by epqlab.engine.completion with their reasons)
UNSUPPORTED = {"audio": ((None,), "audio output is not offered (a text model)"),
               "modalities": ((None, ["text"]), "only text output is offered"),
               "prediction": ((None,), "predicted outputs (speculative decoding) are not offered"),
               "tfs_z": ((None, 1, 1.0), "tail-free sampling is gone from llama.cpp's sampler chain "
                                        "(llama-cpp-python accepts and ignores it)")}
# OpenAI fields accepted and ignored, each for a stated reason; any other unknown field is a 400 naming it
IGNORED = {"user": "an end-user id for OpenAI's abuse monitoring: nothing here uses it",
           "store": "OpenAI's stored completions: nothing is stored here",
           "metadata": "tags for OpenAI's stored completions: nothing is stored here",
           "service_tier": "OpenAI's processing tiers: there is one here"}
MAX_BODY_BYTES = 8 << 20  # default request body limit (--max-body-bytes): a full context of token ids fits many times
POLL_S = 0.25  # how often a waiting request checks whether its client is still there (a stream: the server stopping)
_EMPTY = object()  # no chunk within POLL_S
SHUTDOWN_GRACE_S = 2.0  # an open stream's time to send its error event and [DONE] once the server stops (> POLL_S)


def _require():
    try:
        import fastapi  # noqa: F401
        import sse_starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise ImportError(f"the server needs FastAPI, uvicorn and sse-starlette ({e}); "
                          "install them with: pip install 'epqlab[serve]'") from None


def create_app(session, *, model_name: str | None = None, max_batch: int | None = None, batch_window_s: float = 0.0,
               api_key: str | None = None, max_body_bytes: int = MAX_BODY_BYTES, prompt_cache: str = "exact"):
    """A FastAPI app serving ``session`` (see the module docstring) with continuous batching of up to
    ``max_batch`` sequences (default and cap: ``session.n_seq_max``); ``batch_window_s``: how long a batch
    that starts from idle waits for company (:class:`~epqlab.engine.batch.Batcher`). The app owns the
    batcher's thread; it is stopped with the app (lifespan). ``api_key``: every endpoint but ``GET /health``
    answers 401 without ``Authorization: Bearer <api_key>`` (compared in constant time, never logged);
    ``max_body_bytes``: larger request bodies get 413 before they are parsed; ``prompt_cache``: ``"exact"``
    (default: a cached prefix is reused only where the answer stays the uncached one bit for bit),
    ``"fast"`` (llama.cpp's server's ``cache_prompt``: the whole common prefix) or ``"off"``
    (:func:`epqlab.engine.batch.reusable_prefix`). Raises ValueError for another value."""
    if max_body_bytes < 1:
        raise ValueError(f"max_body_bytes must be >= 1, got {max_body_bytes!r}")
    _require()
    from contextlib import asynccontextmanager

    import anyio

    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from starlette.exceptions import HTTPException as StarletteHTTPException
    from fastapi.responses import JSONResponse
    from pydantic import BaseModel, ConfigDict
    from sse_starlette.sse import EventSourceResponse

    name = model_name or session.model_name
    batcher = Batcher(session, max_batch, prompt_cache=prompt_cache, window_s=batch_window_s).start()
    # requests wait (and streams read their queues) on their own pool; the stats endpoint has its own thread,
    # so neither a crowd of queued streams nor a busy one delays it
    waiters = ThreadPoolExecutor(max_workers=WAITERS, thread_name_prefix="epqlab-request")
    stats_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="epqlab-stats")
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app):
        yield
        batcher.close()
        waiters.shutdown(wait=False, cancel_futures=True)
        stats_pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="epqlab", lifespan=lifespan)

    class _Sampling(BaseModel):
        model_config = ConfigDict(extra="allow")
        model: Optional[str] = None
        max_tokens: Optional[int] = None
        temperature: float = 0.8
        top_p: float = 0.95
        top_k: int = 40
        min_p: float = 0.05
        repeat_penalty: float = 1.0
        stop: Union[str, list[str], None] = None
        seed: Optional[int] = None
        stream: bool = False
        stream_options: Any = None  # {"include_usage": true}: usage in a last chunk of its own (OpenAI's)
        n: int = 1
        # checked by epqlab.engine (a bad value is a 400 naming it, not a 422)
        frequency_penalty: Any = 0.0
        presence_penalty: Any = 0.0
        typical_p: Any = 1.0
        logit_bias: Any = None
        logit_bias_type: Optional[str] = None
        mirostat_mode: Any = 0
        mirostat_tau: Any = 5.0
        mirostat_eta: Any = 0.1
        grammar: Any = None
        response_format: Any = None

    class CompletionRequest(_Sampling):
        prompt: Union[str, list[str], list[int], list[list[int]]]
        max_tokens: Optional[int] = 16
        logprobs: Any = None
        echo: Any = False
        suffix: Any = None
        best_of: Any = None

    class ChatRequest(_Sampling):
        messages: list[dict[str, Any]]
        temperature: float = 0.2
        max_completion_tokens: Optional[int] = None
        logprobs: Any = None
        top_logprobs: Any = None
        tools: Any = None
        tool_choice: Any = None
        functions: Any = None
        function_call: Any = None

    class TokenizeRequest(BaseModel):
        model_config = ConfigDict(extra="allow")  # unknown fields: 400 naming them (check_fields)
        model: Optional[str] = None
        input: str

    class DetokenizeRequest(BaseModel):
        model_config = ConfigDict(extra="allow")  # unknown fields: 400 naming them (check_fields)
        model: Optional[str] = None
        tokens: list[int]

    def error(status: int, msg: str, typ: str = "invalid_request_error"):
        return JSONResponse({"error": {"message": msg, "type": typ, "param": None, "code": None}}, status_code=status)

    class _BadInput(Exception):
        pass

    @app.exception_handler(_BadInput)
    async def _bad(request, exc):
        return error(400, str(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request, exc):  # a body that is not JSON or not UTF-8, an unknown route: the OpenAI error shape
        return error(exc.status_code, str(exc.detail))

    @app.exception_handler(RequestValidationError)
    async def _validation(request, exc):
        parts = [f"{'.'.join(str(x) for x in e.get('loc', ()))}: {e.get('msg')}" for e in exc.errors()]
        return error(422, "invalid request: " + "; ".join(parts))

    def kwargs_of(req: _Sampling, fields: tuple) -> dict:
        check_fields(req)
        for k, v in (req.model_extra or {}).items():
            if k in UNSUPPORTED and v not in UNSUPPORTED[k][0]:
                raise ValueError(f"{k}={v!r}: {UNSUPPORTED[k][1]}; drop it")
        if req.seed is not None and not 0 <= req.seed < 2**32:
            raise ValueError(f"seed must be in 0..2**32-1, got {req.seed}")
        kw = dict(max_tokens=req.max_tokens, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                  min_p=req.min_p, repeat_penalty=req.repeat_penalty, stop=req.stop, seed=req.seed, model=name,
                  n=req.n, batcher=batcher, strict_context=True, frequency_penalty=req.frequency_penalty,
                  presence_penalty=req.presence_penalty, typical_p=req.typical_p,
                  logit_bias=bias_of(req.logit_bias, req.logit_bias_type), mirostat_mode=req.mirostat_mode,
                  mirostat_tau=req.mirostat_tau, mirostat_eta=req.mirostat_eta, grammar=req.grammar,
                  response_format=req.response_format, stream_options=req.stream_options)
        kw.update({k: getattr(req, k) for k in fields})
        return kw

    def check_fields(req) -> None:
        """ValueError naming every field of ``req`` that is neither one of its own, nor refused with a reason
        (UNSUPPORTED), nor ignored with one (IGNORED): a typo such as ``max_token`` is not silently dropped."""
        unknown = sorted(k for k in (req.model_extra or {}) if k not in UNSUPPORTED and k not in IGNORED)
        if unknown:
            known = sorted(set(type(req).model_fields) | set(UNSUPPORTED) | set(IGNORED))
            raise ValueError(f"unknown field{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}: not a "
                             f"field of this endpoint (check the spelling; it takes: {', '.join(known)})")

    def bias_of(bias, typ):
        """OpenAI's logit_bias ({"token id": bias}); llama-cpp-python's logit_bias_type "tokens": keys are text,
        each of its tokens gets the bias (as llama-cpp-python's server does)."""
        if typ in (None, "input_ids") or not bias:
            return bias
        if typ != "tokens":
            raise ValueError(f'logit_bias_type must be "input_ids" or "tokens", got {typ!r}')
        if not isinstance(bias, dict):
            raise ValueError("logit_bias must be an object")
        return {t: b for k, b in bias.items() for t in session.tokenize(str(k), add_special=False, parse_special=True)}

    async def run(make, stream: bool, request: Request):
        """Run ``make(cancel)`` (a completion call on the batcher) on a waiting thread. Non-streaming: its
        dict as JSON, the requests cancelled if the client goes away first. Streaming: validate first
        (errors -> 400 before any byte is sent), then SSE."""
        loop = asyncio.get_running_loop()
        cancel = threading.Event()
        if not stream:
            fut = loop.run_in_executor(waiters, make, cancel)
            while True:
                done, _ = await asyncio.wait({fut}, timeout=POLL_S)
                if done:
                    break
                if await request.is_disconnected():
                    cancel.set()  # its sequences leave at the next step; nobody reads the answer
            try:
                return JSONResponse(fut.result())
            except (ValueError, TypeError) as e:
                return error(400, str(e))
            except ModelChangedError as e:
                return error(503, str(e), "server_error")
            except Exception as e:  # noqa: BLE001 - OpenAI's error shape, not a plain-text 500; the server lives on
                return error(500, f"{type(e).__name__}: {e}", "server_error")
        q: queue.Queue = queue.Queue()
        started = loop.create_future()

        def job(_cancel):
            try:
                it = make(cancel)
            except Exception as e:  # noqa: BLE001 - reported to the request, the server lives on
                loop.call_soon_threadsafe(started.set_result, e)
                return
            loop.call_soon_threadsafe(started.set_result, None)
            try:
                for chunk in it:
                    if cancel.is_set():
                        break
                    q.put(chunk)
            except Exception as e:  # noqa: BLE001
                q.put(e)
            finally:
                it.close()  # cancels what is still running: its sequence is freed at the next step
                q.put(None)

        waiters.submit(job, cancel)
        e = await started
        if isinstance(e, (ValueError, TypeError)):
            return error(400, str(e))
        if isinstance(e, ModelChangedError):
            return error(503, str(e), "server_error")
        if isinstance(e, Exception):
            return error(500, f"{type(e).__name__}: {e}", "server_error")

        def next_item():
            try:
                return q.get(timeout=POLL_S)
            except queue.Empty:
                return _EMPTY

        # set by sse-starlette when the server shuts down (Ctrl-C / SIGTERM); the stream then has
        # SHUTDOWN_GRACE_S to send its farewell before it is cancelled (sse-starlette's cooperative shutdown)
        stopping = anyio.Event()

        async def events():
            try:
                while True:
                    item = await loop.run_in_executor(waiters, next_item)
                    if stopping.is_set():  # the server stops: no more chunks, the client must know it was cut
                        item = EpqlabError("the server is shutting down (interrupted): this answer is incomplete")
                    if item is _EMPTY:
                        continue
                    if item is None:
                        break
                    if isinstance(item, Exception):
                        yield {"data": json.dumps({"error": {"message": str(item), "type": "server_error"}})}
                        break
                    yield {"data": json.dumps(item)}
                yield {"data": "[DONE]"}
            finally:
                cancel.set()  # client gone (or done): the worker stops at the next token

        return EventSourceResponse(events(), ping=15, shutdown_event=stopping, shutdown_grace_period=SHUTDOWN_GRACE_S)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model", "created": created, "owned_by": "epqlab"}]}

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        try:
            kw = kwargs_of(req, ("logprobs", "echo", "suffix", "best_of"))
        except ValueError as e:
            return error(400, str(e))
        return await run(lambda c: create_completion(session, req.prompt, stream=req.stream, cancel=c, **kw),
                         req.stream, request)

    @app.post("/v1/chat/completions")
    async def chat(req: ChatRequest, request: Request):
        try:
            kw = kwargs_of(req, ("logprobs", "top_logprobs", "tools", "tool_choice", "functions", "function_call"))
        except ValueError as e:
            return error(400, str(e))
        if req.max_completion_tokens is not None:
            kw["max_tokens"] = req.max_completion_tokens
        return await run(lambda c: create_chat_completion(session, req.messages, stream=req.stream, cancel=c, **kw),
                         req.stream, request)

    @app.post("/v1/embeddings")
    async def embeddings():
        return error(400, "embeddings are not offered: this engine runs a causal MoE language model for generation; "
                          "its last hidden state is not a trained sentence embedding (use an embedding model)")

    async def _tokenize(body: TokenizeRequest):
        try:
            check_fields(body)
        except ValueError as e:
            raise _BadInput(str(e)) from None

        def go():
            return session.tokenize(body.input.encode("utf-8"), special=True)  # llama-cpp-python's server's call
        try:
            return await asyncio.get_running_loop().run_in_executor(stats_pool, go)
        except (ValueError, UnicodeError) as e:
            raise _BadInput(str(e)) from None

    @app.post("/tokenize")
    @app.post("/extras/tokenize")
    async def tokenize(body: TokenizeRequest):
        return {"tokens": await _tokenize(body)}

    @app.post("/extras/tokenize/count")
    async def tokenize_count(body: TokenizeRequest):
        return {"count": len(await _tokenize(body))}

    @app.post("/detokenize")
    @app.post("/extras/detokenize")
    async def detokenize(body: DetokenizeRequest):
        try:
            check_fields(body)
        except ValueError as e:
            return error(400, str(e))
        bad = [t for t in body.tokens if not 0 <= t < session.n_vocab]
        if bad:
            return error(400, f"token ids must be in [0, {session.n_vocab}); got {bad[0]}")
        return {"text": session.detokenize(body.tokens)}

    @app.get("/v1/epqlab/stats")
    async def stats():
        def read():
            with session.decoder.lock:  # between two steps: the pager's history is not growing
                out = {"model": name, "stats": clean_json(session.stats),
                       "batch": clean_json({**batcher.summary(), "last_steps": list(batcher.step_log)[-16:]})}
                if session.paged:  # mean ms per part of every decode call since the last reset_stats
                    out["time_split"] = clean_json(decode_summary(session.time_split("token")))
                return out

        return JSONResponse(await asyncio.get_running_loop().run_in_executor(stats_pool, read))

    return _Guard(app, api_key, int(max_body_bytes), session.decoder.files.check)


def _bearer(header: bytes) -> bytes | None:
    """The token of an ``Authorization: Bearer <token>`` header, or None. The scheme is matched without regard to
    case (RFC 7235 section 2.1: "case-insensitive token"; RFC 6750 section 2.1), spaces after it are skipped."""
    scheme, _, token = header.partition(b" ")
    return token.lstrip(b" ") if scheme.lower() == b"bearer" else None


class _Guard:
    """ASGI wrapper in front of the app: the API key (every path but ``/health``), the model file's check (every
    path: once the file changed, 503 with the reason, ``/health`` included) and the body-size limit, all
    answered before the app parses anything, in OpenAI's error shape."""

    def __init__(self, app, api_key: str | None, max_body_bytes: int, check_model=None):
        self.app = app
        self._want = None if not api_key else api_key.encode()
        self.max_body_bytes = max_body_bytes
        self._check_model = check_model or (lambda: None)

    def __getattr__(self, name):  # the wrapped app's attributes (routes, state) for callers that look
        return getattr(self.app, name)

    async def _send_error(self, send, code: int, msg: str, typ: str, extra_headers=(), fields=None):
        body = json.dumps({**(fields or {}), "error": {"message": msg, "type": typ, "param": None, "code": None}}).encode()
        await send({"type": "http.response.start", "status": code,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                *extra_headers]})
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        health = scope.get("path") == "/health"
        if self._want is not None and not health:
            got = _bearer(dict(scope.get("headers") or []).get(b"authorization", b""))
            if got is None or not hmac.compare_digest(got, self._want):
                return await self._send_error(send, 401, "missing or wrong API key: send the header "
                                              "'Authorization: Bearer <key>' with the key the server was started with",
                                              "authentication_error", [(b"www-authenticate", b"Bearer")])
        try:  # stats of the model's files (a replaced file is compared once): off the event loop
            await asyncio.get_running_loop().run_in_executor(None, self._check_model)
        except ModelChangedError as e:
            # /health needs no key, so it names no path
            msg = ("the model file changed on disk since the server loaded it; restart the server" if health
                   else f"{e} (every request is refused until the server is restarted)")
            return await self._send_error(send, 503, msg, "server_error", (), {"status": "error"} if health else None)
        if scope.get("method") not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        limit = self.max_body_bytes
        cl = dict(scope.get("headers") or []).get(b"content-length")
        too_big = f"the request body is larger than the server's limit of {limit} bytes (--max-body-bytes)"
        if cl is not None and cl.isdigit() and int(cl) > limit:
            return await self._send_error(send, 413, too_big, "invalid_request_error")
        chunks, size = [], 0
        while True:  # the whole body, counted, before the app sees any of it
            msg = await receive()
            if msg["type"] != "http.request":
                return  # the client went away
            chunks.append(msg.get("body", b""))
            size += len(chunks[-1])
            if size > limit:
                return await self._send_error(send, 413, too_big, "invalid_request_error")
            if not msg.get("more_body"):
                break
        body, sent = b"".join(chunks), False

        async def replay():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # then the disconnect, when it comes

        return await self.app(scope, replay, send)


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host``:``port`` (``SO_REUSEADDR``, as uvicorn binds), for :func:`serve`; bind it before
    loading the model, so a bad address costs no load and no other process can take the port in between.

    Raises:
        ValueError: ``port`` is not an integer in 1..65535, ``host`` is not an address or a name that resolves,
            or the address cannot be bound (in use, not this machine's, a privileged port); the message names
            the address and what to change.
    """
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise ValueError(f"--port must be a TCP port in 1..65535, got {port!r}")
    try:
        # the family as uvicorn picks it (IPv6 only for an address with a colon), so "localhost" means 127.0.0.1
        family, typ, proto, _, addr = socket.getaddrinfo(host, port, socket.AF_INET6 if ":" in host else socket.AF_INET,
                                                         socket.SOCK_STREAM)[0]
    except (socket.gaierror, UnicodeError) as e:
        raise ValueError(f"--host {host!r} is not an address or a name this machine can resolve ({e}); use e.g. "
                         "127.0.0.1 (this machine only) or 0.0.0.0 (every network)") from None
    sock = socket.socket(family, typ, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
    except OSError as e:
        sock.close()
        why = {errno.EADDRINUSE: "the port is in use by another process; choose another --port",
               errno.EADDRNOTAVAIL: "the address is not one of this machine's; choose another --host",
               errno.EACCES: "ports below 1024 need privileges; choose a port >= 1024"}.get(e.errno, e.strerror)
        raise ValueError(f"cannot listen on {host}:{port}: {why}") from None
    return sock


def serve(session, host: str = "127.0.0.1", port: int = 8000, *, model_name: str | None = None,
          log_level: str = "info", max_batch: int | None = None, batch_window_s: float = 0.0,
          api_key: str | None = None, max_body_bytes: int = MAX_BODY_BYTES, sock: socket.socket | None = None,
          prompt_cache: str = "exact") -> None:
    """Serve ``session`` with uvicorn until interrupted (Ctrl-C: open streams end with an error event and
    ``[DONE]``, then the server stops); batching, ``api_key``, ``max_body_bytes`` and ``prompt_cache`` as :func:`create_app`.
    ``sock``: a socket from :func:`bind_socket` (default: bound here to ``host``:``port``). Raises ValueError
    for an address that cannot be bound (:func:`bind_socket`)."""
    _require()
    import uvicorn

    sock = sock or bind_socket(host, int(port))
    app = create_app(session, model_name=model_name, max_batch=max_batch, batch_window_s=batch_window_s,
                     api_key=api_key, max_body_bytes=max_body_bytes, prompt_cache=prompt_cache)
    uvicorn.Server(uvicorn.Config(app, host=host, port=int(port), log_level=log_level)).run(sockets=[sock])


__all__ = ["create_app", "serve", "bind_socket"]
