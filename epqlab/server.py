"""An OpenAI-compatible HTTP server on one :class:`epqlab.Session` (``epqlab serve MODEL``), built on
FastAPI + uvicorn + sse-starlette (install with ``pip install 'epqlab[serve]'``).

Endpoints, as llama-cpp-python's server and the OpenAI API define them:

- ``GET  /v1/models``: the one model (its file name).
- ``POST /v1/completions``: :meth:`epqlab.Session.create_completion`.
- ``POST /v1/chat/completions``: :meth:`epqlab.Session.create_chat_completion`.
  Both stream Server-Sent Events with ``"stream": true`` (``data: {chunk}`` lines, then ``data: [DONE]``).
- ``GET  /v1/epqlab/stats``: the session's cumulative pager stats (:attr:`epqlab.Session.stats`),
  ``batch``: the continuous batcher's figures (:meth:`epqlab.engine.batch.Batcher.summary`: steps, batch
  sizes, mean union of experts per layer per step, SSD bytes per token) and its last steps; with a pager,
  ``time_split``: the mean milliseconds per part of its decode calls
  (:func:`epqlab.engine.time_split.decode_summary`).

Scheduling: continuous batching (:mod:`epqlab.engine.batch`) on one Session opened with
``n_seq_max = max_batch``: a request joins the running batch at its next step (prefilled alone first),
advances one token per step with every other active request in one forward pass, and leaves when it
ends; ``n`` > 1 and several prompts are several sequences. A finished sequence keeps its KV cells, so a
request whose prompt extends one (a chat's next turn) decodes only the new tokens. A bad request
(malformed JSON, a field of the wrong type, a value out of range, messages that are not
``[{"role", "content": str}]``, a prompt longer than the context) gets HTTP 400 (422 for JSON that
does not match the schema) with an OpenAI-style ``{"error": {"message", "type"}}`` body; the server
keeps serving. A client that disconnects, streaming or not, frees its sequence at the next step without
disturbing the others.
"""
# no `from __future__ import annotations`: FastAPI reads the endpoint annotations at runtime

import asyncio
import json
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional, Union

from .engine.batch import Batcher
from .engine.completion import create_chat_completion, create_completion
from .engine.time_split import decode_summary
from .results import clean_json

WAITERS = 64  # threads that may wait on running requests at once (each holds one open request)
# OpenAI / llama-cpp-python fields not supported yet: refused (400) unless sent at their "off" value, never ignored
UNSUPPORTED = {"echo": (False,), "logprobs": (None, False), "top_logprobs": (None, 0), "suffix": (None, ""),
               "tools": (None, []), "tool_choice": (None, "none"), "functions": (None, []), "function_call": (None, "none"),
               "response_format": (None, {"type": "text"}), "grammar": (None, ""), "logit_bias": (None, {}),
               "frequency_penalty": (None, 0, 0.0), "presence_penalty": (None, 0, 0.0), "best_of": (None, 1),
               "mirostat_mode": (None, 0), "typical_p": (None, 1, 1.0)}
POLL_S = 0.25  # how often a waiting request checks whether its client is still there


def _require():
    try:
        import fastapi  # noqa: F401
        import sse_starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise ImportError(f"the server needs FastAPI, uvicorn and sse-starlette ({e}); "
                          "install them with: pip install 'epqlab[serve]'") from None


def create_app(session, *, model_name: str | None = None, max_batch: int | None = None, batch_window_s: float = 0.0):
    """A FastAPI app serving ``session`` (see the module docstring) with continuous batching of up to
    ``max_batch`` sequences (default and cap: ``session.n_seq_max``); ``batch_window_s``: how long a batch
    that starts from idle waits for company (:class:`~epqlab.engine.batch.Batcher`). The app owns the
    batcher's thread; it is stopped with the app (lifespan)."""
    _require()
    from contextlib import asynccontextmanager

    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from starlette.exceptions import HTTPException as StarletteHTTPException
    from fastapi.responses import JSONResponse
    from pydantic import BaseModel, ConfigDict
    from sse_starlette.sse import EventSourceResponse

    name = model_name or session.model_name
    batcher = Batcher(session, max_batch, prompt_cache=True, window_s=batch_window_s).start()
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
        n: int = 1

    class CompletionRequest(_Sampling):
        prompt: Union[str, list[str], list[int], list[list[int]]]
        max_tokens: Optional[int] = 16

    class ChatRequest(_Sampling):
        messages: list[dict[str, Any]]
        temperature: float = 0.2
        max_completion_tokens: Optional[int] = None

    def error(status: int, msg: str, typ: str = "invalid_request_error"):
        return JSONResponse({"error": {"message": msg, "type": typ, "param": None, "code": None}}, status_code=status)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request, exc):  # a body that is not JSON or not UTF-8, an unknown route: the OpenAI error shape
        return error(exc.status_code, str(exc.detail))

    @app.exception_handler(RequestValidationError)
    async def _validation(request, exc):
        parts = [f"{'.'.join(str(x) for x in e.get('loc', ()))}: {e.get('msg')}" for e in exc.errors()]
        return error(422, "invalid request: " + "; ".join(parts))

    def kwargs_of(req: _Sampling) -> dict:
        for k, v in (req.model_extra or {}).items():
            if k in UNSUPPORTED and v not in UNSUPPORTED[k]:
                raise ValueError(f"{k}={v!r} is not supported by epqlab yet (see the README's list); drop it")
        kw = dict(max_tokens=req.max_tokens, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                  min_p=req.min_p, repeat_penalty=req.repeat_penalty, stop=req.stop, seed=req.seed, model=name,
                  n=req.n, batcher=batcher)
        if req.seed is not None and not 0 <= req.seed < 2**32:
            raise ValueError(f"seed must be in 0..2**32-1, got {req.seed}")
        return kw

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
        if isinstance(e, Exception):
            return error(500, f"{type(e).__name__}: {e}", "server_error")

        async def events():
            try:
                while True:
                    item = await loop.run_in_executor(waiters, q.get)
                    if item is None:
                        break
                    if isinstance(item, Exception):
                        yield {"data": json.dumps({"error": {"message": str(item), "type": "server_error"}})}
                        break
                    yield {"data": json.dumps(item)}
                yield {"data": "[DONE]"}
            finally:
                cancel.set()  # client gone (or done): the worker stops at the next token

        return EventSourceResponse(events(), ping=15)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model", "created": created, "owned_by": "epqlab"}]}

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        try:
            kw = kwargs_of(req)
        except ValueError as e:
            return error(400, str(e))
        return await run(lambda c: create_completion(session, req.prompt, stream=req.stream, cancel=c, **kw),
                         req.stream, request)

    @app.post("/v1/chat/completions")
    async def chat(req: ChatRequest, request: Request):
        try:
            kw = kwargs_of(req)
        except ValueError as e:
            return error(400, str(e))
        if req.max_completion_tokens is not None:
            kw["max_tokens"] = req.max_completion_tokens
        return await run(lambda c: create_chat_completion(session, req.messages, stream=req.stream, cancel=c, **kw),
                         req.stream, request)

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

    return app


def serve(session, host: str = "127.0.0.1", port: int = 8000, *, model_name: str | None = None,
          log_level: str = "info", max_batch: int | None = None, batch_window_s: float = 0.0) -> None:
    """Serve ``session`` with uvicorn until interrupted (Ctrl-C); batching as :func:`create_app`."""
    _require()
    import uvicorn

    uvicorn.run(create_app(session, model_name=model_name, max_batch=max_batch, batch_window_s=batch_window_s),
                host=host, port=int(port), log_level=log_level)


__all__ = ["create_app", "serve"]
