"""An OpenAI-compatible HTTP server on one :class:`epqlab.Session` (``epqlab serve MODEL``), built on
FastAPI + uvicorn + sse-starlette (install with ``pip install 'epqlab[serve]'``).

Endpoints, as llama-cpp-python's server and the OpenAI API define them:

- ``GET  /v1/models``: the one model (its file name).
- ``POST /v1/completions``: :meth:`epqlab.Session.create_completion`.
- ``POST /v1/chat/completions``: :meth:`epqlab.Session.create_chat_completion`.
  Both stream Server-Sent Events with ``"stream": true`` (``data: {chunk}`` lines, then ``data: [DONE]``).
- ``GET  /v1/epqlab/stats``: the session's cumulative pager stats (:attr:`epqlab.Session.stats`) and,
  with a pager, ``time_split``: the mean milliseconds per part of its decode calls
  (:func:`epqlab.engine.time_split.decode_summary`).

Scheduling: one request decodes at a time (a single worker thread owns the Session); others wait in
arrival order. The KV cache is kept across requests, so a request whose prompt extends the previous
one (a chat's next turn) decodes only the new tokens. A bad request (malformed JSON, a field of the
wrong type, a value out of range, messages that are not ``[{"role", "content": str}]``, a prompt
longer than the context, an unsupported option such as ``n > 1``) gets HTTP 400 (422 for JSON that
does not match the schema) with an OpenAI-style ``{"error": {"message", "type"}}`` body; the server
keeps serving. A client that disconnects mid-stream stops its generation at the next token.
"""
# no `from __future__ import annotations`: FastAPI reads the endpoint annotations at runtime

import asyncio
import json
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional, Union

from .results import clean_json
from .engine.time_split import decode_summary


def _require():
    try:
        import fastapi  # noqa: F401
        import sse_starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise ImportError(f"the server needs FastAPI, uvicorn and sse-starlette ({e}); "
                          "install them with: pip install 'epqlab[serve]'") from None


def create_app(session, *, model_name: str | None = None):
    """A FastAPI app serving ``session`` (see the module docstring). The app owns one worker thread;
    it is shut down with the app (lifespan)."""
    _require()
    from contextlib import asynccontextmanager

    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse
    from pydantic import BaseModel, ConfigDict
    from sse_starlette.sse import EventSourceResponse

    name = model_name or session.model_name
    worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="epqlab-decode")
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app):
        yield
        worker.shutdown(wait=False, cancel_futures=True)

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
        prompt: Union[str, list[int]]
        max_tokens: Optional[int] = 16

    class ChatRequest(_Sampling):
        messages: list[dict[str, Any]]
        temperature: float = 0.2
        max_completion_tokens: Optional[int] = None

    def error(status: int, msg: str, typ: str = "invalid_request_error"):
        return JSONResponse({"error": {"message": msg, "type": typ, "param": None, "code": None}}, status_code=status)

    @app.exception_handler(RequestValidationError)
    async def _validation(request, exc):
        parts = [f"{'.'.join(str(x) for x in e.get('loc', ()))}: {e.get('msg')}" for e in exc.errors()]
        return error(422, "invalid request: " + "; ".join(parts))

    def kwargs_of(req: _Sampling) -> dict:
        if req.n != 1:
            raise ValueError(f"n={req.n}: epqlab returns one choice per request; drop n or set it to 1")
        kw = dict(max_tokens=req.max_tokens, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                  min_p=req.min_p, repeat_penalty=req.repeat_penalty, stop=req.stop, seed=req.seed, model=name)
        if req.seed is not None and not 0 <= req.seed < 2**32:
            raise ValueError(f"seed must be in 0..2**32-1, got {req.seed}")
        return kw

    async def run(make, stream: bool, request: Request):
        """Run ``make()`` (a completion call) on the worker. Non-streaming: its dict as JSON.
        Streaming: validate first (errors -> 400 before any byte is sent), then SSE."""
        loop = asyncio.get_running_loop()
        if not stream:
            try:
                return JSONResponse(await loop.run_in_executor(worker, make))
            except (ValueError, TypeError) as e:
                return error(400, str(e))
        q: queue.Queue = queue.Queue()
        cancel = threading.Event()
        started = loop.create_future()

        def job():
            try:
                it = make()
            except Exception as e:  # noqa: BLE001 - reported to the request, the worker lives on
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
                it.close()  # a closed stream stops decoding and records its stats
                q.put(None)

        worker.submit(job)
        e = await started
        if isinstance(e, (ValueError, TypeError)):
            return error(400, str(e))
        if isinstance(e, Exception):
            return error(500, f"{type(e).__name__}: {e}", "server_error")

        async def events():
            try:
                while True:
                    item = await loop.run_in_executor(None, q.get)
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
        return await run(lambda: session.create_completion(req.prompt, stream=req.stream, **kw), req.stream, request)

    @app.post("/v1/chat/completions")
    async def chat(req: ChatRequest, request: Request):
        try:
            kw = kwargs_of(req)
        except ValueError as e:
            return error(400, str(e))
        if req.max_completion_tokens is not None:
            kw["max_tokens"] = req.max_completion_tokens
        return await run(lambda: session.create_chat_completion(req.messages, stream=req.stream, **kw), req.stream,
                         request)

    @app.get("/v1/epqlab/stats")
    async def stats():
        def read():
            with session.decoder.lock:  # between two decode calls: the pager's history is not growing
                out = {"model": name, "stats": clean_json(session.stats)}
                if session.paged:  # mean ms per part of every decode call since the last reset_stats

                    out["time_split"] = clean_json(decode_summary(session.time_split("token")))
                return out

        return JSONResponse(await asyncio.get_running_loop().run_in_executor(None, read))

    return app


def serve(session, host: str = "127.0.0.1", port: int = 8000, *, model_name: str | None = None,
          log_level: str = "info") -> None:
    """Serve ``session`` with uvicorn until interrupted (Ctrl-C)."""
    _require()
    import uvicorn

    uvicorn.run(create_app(session, model_name=model_name), host=host, port=int(port), log_level=log_level)


__all__ = ["create_app", "serve"]
