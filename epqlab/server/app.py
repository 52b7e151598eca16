"""The app and its lifecycle: :func:`create_app` opens the batcher and the thread pools, adds each API's routes
and the shared error handlers, and puts the guard (:mod:`.guard`) in front; :func:`serve` runs it with uvicorn
on a socket from :func:`bind_socket`.

FastAPI, uvicorn and sse-starlette are imported when an app is made (``pip install 'epqlab[serve]'``), so
``epqlab serve --help`` and this module import without them.
"""
from __future__ import annotations

import errno
import socket
import time
from concurrent.futures import ThreadPoolExecutor

from ..engine import state_file
from ..engine.batch import Batcher
from ..engine.prompt_disk_cache import PromptDiskCache
from .context import Served
from .guard import _Guard
from .response_store import ResponseStore
from .response_store import ResponseStore

WAITERS = 64  # threads that may wait on running requests at once (each holds one open request)
PROMPT_CACHE_SIZE = 4 << 30  # default --prompt-cache-size, bytes
MAX_BODY_BYTES = 8 << 20  # default request body limit (--max-body-bytes): a full context of token ids fits many times


def _require():
    try:
        import fastapi  # noqa: F401
        import sse_starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise ImportError(f"the server needs FastAPI, uvicorn and sse-starlette ({e}); "
                          "install them with: pip install 'epqlab[serve]'") from None


def create_app(session, *, model_name: str | None = None, max_batch: int | None = None, batch_window_s: float = 0.0,
               api_key: str | None = None, max_body_bytes: int = MAX_BODY_BYTES, prompt_cache: str = "exact",
               prompt_cache_dir=None, prompt_cache_size: int = PROMPT_CACHE_SIZE):
    """A FastAPI app serving ``session`` (see :mod:`epqlab.server`) with continuous batching of up to
    ``max_batch`` sequences (default and cap: ``session.n_seq_max``); ``batch_window_s``: how long a batch
    that starts from idle waits for company (:class:`~epqlab.engine.batch.Batcher`). The app owns the
    batcher's thread; it is stopped with the app (lifespan). ``api_key``: every endpoint but ``GET /health``
    answers 401 without ``Authorization: Bearer <api_key>`` or ``x-api-key: <api_key>`` (compared in constant
    time, never logged);
    ``max_body_bytes``: larger request bodies get 413 before they are parsed; ``prompt_cache``: ``"exact"``
    (default: a cached prefix is reused only where the answer stays the uncached one bit for bit),
    ``"fast"`` (llama.cpp's server's ``cache_prompt``: the whole common prefix) or ``"off"``
    (:func:`epqlab.engine.batch.reusable_prefix`). ``prompt_cache_dir``: keep finished sequences' states there
    too, at most ``prompt_cache_size`` bytes, and start a prompt that extends one from it after a restart
    (:mod:`epqlab.engine.prompt_disk_cache`; needs a prompt cache mode other than ``"off"``). Raises ValueError for
    another value, or a directory that cannot be written."""
    if max_body_bytes < 1:
        raise ValueError(f"max_body_bytes must be >= 1, got {max_body_bytes!r}")
    _require()
    from contextlib import asynccontextmanager

    from fastapi import FastAPI

    # one module per API surface; each adds its routes on the shared state (docs/DESIGN.md §1)
    from . import anthropic_messages, epqlab_routes, metrics, openai_chat, openai_responses
    from .http_errors import add_error_handlers

    disk = None
    if prompt_cache_dir is not None:
        if prompt_cache == "off":
            raise ValueError("--prompt-cache-dir needs a prompt cache: drop --prompt-cache off (or the directory)")
        if session.speculative:
            raise ValueError("--prompt-cache-dir is not available with --spec-type draft-mtp (the draft context's "
                             "state is not saved)")
        disk = PromptDiskCache(prompt_cache_dir, prompt_cache_size, state_file.identity(session))
    batcher = Batcher(session, max_batch, prompt_cache=prompt_cache, window_s=batch_window_s, disk_cache=disk).start()
    served = Served(session=session, name=model_name or session.model_name, batcher=batcher,
                    waiters=ThreadPoolExecutor(max_workers=WAITERS, thread_name_prefix="epqlab-request"),
                    stats_pool=ThreadPoolExecutor(max_workers=1, thread_name_prefix="epqlab-stats"),
                    created=int(time.time()))

    @asynccontextmanager
    async def lifespan(app):
        yield
        batcher.close()
        if disk is not None:
            disk.flush()  # states of the last requests reach the disk before the process ends
        served.waiters.shutdown(wait=False, cancel_futures=True)
        served.stats_pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="epqlab", lifespan=lifespan)
    add_error_handlers(app)
    epqlab_routes.add_routes(app, served)
    openai_chat.add_routes(app, served)
    anthropic_messages.add_routes(app, served)
    openai_responses.add_routes(app, served, ResponseStore())
    counter = metrics.RequestCounter(None, ())
    metrics.add_routes(app, served, counter)
    counter.routes = {r.path for r in app.routes}
    follower = session.memory_follower
    counter.app = _Guard(app, api_key, int(max_body_bytes), session.decoder.files.check,
                         busy=follower.short_of_memory if follower is not None else None)
    return counter


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
          prompt_cache: str = "exact", prompt_cache_dir=None, prompt_cache_size: int = PROMPT_CACHE_SIZE) -> None:
    """Serve ``session`` with uvicorn until interrupted (Ctrl-C: open streams end with an error event and
    ``[DONE]``, then the server stops); batching, ``api_key``, ``max_body_bytes`` and ``prompt_cache`` as :func:`create_app`.
    ``sock``: a socket from :func:`bind_socket` (default: bound here to ``host``:``port``). Raises ValueError
    for an address that cannot be bound (:func:`bind_socket`)."""
    _require()
    import uvicorn

    sock = sock or bind_socket(host, int(port))
    app = create_app(session, model_name=model_name, max_batch=max_batch, batch_window_s=batch_window_s,
                     api_key=api_key, max_body_bytes=max_body_bytes, prompt_cache=prompt_cache,
                     prompt_cache_dir=prompt_cache_dir, prompt_cache_size=prompt_cache_size)
    uvicorn.Server(uvicorn.Config(app, host=host, port=int(port), log_level=log_level)).run(sockets=[sock])
