"""Running a request on the batcher from the event loop: the answer as JSON (the request cancelled when its
client goes away first), or Server-Sent Events (an error after the first byte is an error event; a server that
stops ends open streams with one). What differs between the APIs is a :class:`Shape`: OpenAI's chat streams
``data: {chunk}`` lines then ``data: [DONE]`` (:data:`OPENAI`); the Anthropic Messages API and OpenAI's Responses
API name each event (``event: <type>``) and end with their own last event (:data:`NAMED`, :data:`ANTHROPIC`)."""
# no `from __future__ import annotations`: FastAPI reads the endpoint annotations at runtime

import asyncio
import json
import queue
import threading
from dataclasses import dataclass
from typing import Any, Callable, Optional

import anyio
from fastapi import Request
from fastapi.responses import JSONResponse
from sse_starlette.sse import EventSourceResponse

from ..errors import EpqlabError, ModelChangedError
from .context import Served
from .http_errors import anthropic, error
from .wording import said

POLL_S = 0.25  # how often a waiting request checks whether its client is still there (a stream: the server stopping)
_EMPTY = object()  # no chunk within POLL_S
SHUTDOWN_GRACE_S = 2.0  # an open stream's time to send its error event and [DONE] once the server stops (> POLL_S)


@dataclass(frozen=True)
class Shape:
    """How one API answers: ``error(status, message, type)`` an error response; ``sse(item)`` the SSE event of a
    streamed item; ``failed(message)`` the event that ends a stream cut by an error; ``done`` the last event
    (None: the API has none of its own)."""
    error: Callable
    sse: Callable[[Any], dict]
    failed: Callable[[str], dict]
    done: Optional[dict] = None


# OpenAI's chat and completions (https://platform.openai.com/docs/api-reference/chat-streaming)
OPENAI = Shape(error, lambda item: {"data": json.dumps(item)},
               lambda msg: {"data": json.dumps({"error": {"message": msg, "type": "server_error"}})},
               {"data": "[DONE]"})
# OpenAI's Responses API: each event named by its type, an `error` event for a failure
# (https://platform.openai.com/docs/api-reference/responses-streaming/error)
NAMED = Shape(error, lambda item: {"event": item["type"], "data": json.dumps(item)},
              lambda msg: {"event": "error", "data": json.dumps({"type": "error", "code": "server_error",
                                                                 "message": msg, "param": None})})
# Anthropic's Messages API (https://docs.anthropic.com/en/docs/build-with-claude/streaming#error-events)
ANTHROPIC = Shape(lambda status, msg, typ=None: anthropic(status, msg), NAMED.sse,
                  lambda msg: {"event": "error", "data": json.dumps({"type": "error", "error": {
                      "type": "api_error", "message": msg}})})


async def run(served: Served, make, stream: bool, request: Request, shape: Shape = OPENAI):
    """Run ``make(cancel)`` (a completion call on the batcher) on a waiting thread. Non-streaming: its
    dict as JSON, the requests cancelled if the client goes away first. Streaming: validate first
    (errors -> 400 before any byte is sent), then SSE, each item as ``shape.sse`` makes it. Errors in ``shape``'s
    API's shape: 400 for a ValueError / TypeError, 503 once the model file changed, 500 for anything else."""
    error = shape.error
    waiters = served.waiters
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
            return error(400, said(e))
        except ModelChangedError as e:
            return error(503, said(e), "server_error")
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
        return error(400, said(e))
    if isinstance(e, ModelChangedError):
        return error(503, said(e), "server_error")
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
                    yield shape.failed(said(item))
                    break
                yield shape.sse(item)
            if shape.done is not None:
                yield shape.done
        finally:
            cancel.set()  # client gone (or done): the worker stops at the next token

    return EventSourceResponse(events(), ping=15, shutdown_event=stopping, shutdown_grace_period=SHUTDOWN_GRACE_S)
