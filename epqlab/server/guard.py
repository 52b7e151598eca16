"""What every request meets before the app parses it (an ASGI wrapper, no FastAPI needed): the API key, the
model file's check and the request-body limit, each refused in the error shape of the path's API
(:mod:`.error_shapes`: Anthropic's for ``/v1/messages``, OpenAI's elsewhere)."""
from __future__ import annotations

import asyncio
import hmac
import json

from ..errors import ModelChangedError
from .error_shapes import error_body
from .wording import said


def _bearer(header: bytes) -> bytes | None:
    """The token of an ``Authorization: Bearer <token>`` header, or None. The scheme is matched without regard to
    case (RFC 7235 section 2.1: "case-insensitive token"; RFC 6750 section 2.1), spaces after it are skipped."""
    scheme, _, token = header.partition(b" ")
    return token.lstrip(b" ") if scheme.lower() == b"bearer" else None


RETRY_AFTER_S = 5  # seconds a client is told to wait when memory is short (Retry-After, RFC 9110 section 10.2.3)
_CHEAP = ("tokenize", "detokenize", "/count", "count_tokens")  # POST routes that generate nothing: served under memory pressure


def presented_key(headers: dict) -> bytes | None:
    """The API key a request presents: ``Authorization: Bearer <key>`` (OpenAI's clients; :func:`_bearer`), else
    ``x-api-key: <key>`` (Anthropic's clients: https://docs.anthropic.com/en/api/overview#authentication), else
    None. ``headers``: the ASGI scope's, lower-case names as bytes."""
    got = _bearer(headers.get(b"authorization", b""))
    return got if got is not None else headers.get(b"x-api-key")


class _Guard:
    """ASGI wrapper in front of the app: the API key (every path but ``/health``; :func:`presented_key`), the model
    file's check (every path: once the file changed, 503 with the reason, ``/health`` included) and the body-size
    limit, all answered before the app parses anything, in the path's API's error shape; ``busy`` (while it returns
    True, new generation requests get 503 with ``Retry-After``: the memory follower at its floor)."""

    def __init__(self, app, api_key: str | None, max_body_bytes: int, check_model=None, busy=None):
        self.app = app
        self._want = None if not api_key else api_key.encode()
        self.max_body_bytes = max_body_bytes
        self._check_model = check_model or (lambda: None)
        self._busy = busy or (lambda: False)

    def __getattr__(self, name):  # the wrapped app's attributes (routes, state) for callers that look
        return getattr(self.app, name)

    async def _send_error(self, send, code: int, msg: str, typ: str, extra_headers=(), fields=None, path=None):
        body = json.dumps({**(fields or {}), **error_body(path, code, msg, typ)}).encode()
        await send({"type": "http.response.start", "status": code,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                *extra_headers]})
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path")
        health = path == "/health"
        if self._want is not None and not health:
            got = presented_key(dict(scope.get("headers") or []))
            if got is None or not hmac.compare_digest(got, self._want):
                return await self._send_error(send, 401, "missing or wrong API key: send the header "
                                              "'Authorization: Bearer <key>' (or 'x-api-key: <key>') with the key "
                                              "the server was started with",
                                              "authentication_error", [(b"www-authenticate", b"Bearer")], path=path)
        try:  # stats of the model's files (a replaced file is compared once): off the event loop
            await asyncio.get_running_loop().run_in_executor(None, self._check_model)
        except ModelChangedError as e:
            # /health needs no key, so it names no path
            msg = "the model file changed on disk since the server loaded it; restart the server" if health else said(e)
            return await self._send_error(send, 503, msg, "server_error", (), {"status": "error"} if health else None,
                                          path=path)
        if scope.get("method") not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        if self._busy() and not scope.get("path", "").endswith(_CHEAP):
            # follow_memory is at its smallest arena and memory is still short: no new generation (those running
            # finish); docs/DESIGN.md §5 "Following memory"
            return await self._send_error(send, 503, "the server is short of memory: its arena is at the smallest "
                                          "size that works and memory pressure is still rising; retry later",
                                          "server_error", [(b"retry-after", str(RETRY_AFTER_S).encode())], path=path)
        limit = self.max_body_bytes
        cl = dict(scope.get("headers") or []).get(b"content-length")
        too_big = f"the request body is larger than the server's limit of {limit} bytes (--max-body-bytes)"
        if cl is not None and cl.isdigit() and int(cl) > limit:
            return await self._send_error(send, 413, too_big, "invalid_request_error", path=path)
        chunks, size = [], 0
        while True:  # the whole body, counted, before the app sees any of it
            msg = await receive()
            if msg["type"] != "http.request":
                return  # the client went away
            chunks.append(msg.get("body", b""))
            size += len(chunks[-1])
            if size > limit:
                return await self._send_error(send, 413, too_big, "invalid_request_error", path=path)
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
