"""Errors as JSON responses, in the error shape of the path's API (:mod:`.error_shapes`: Anthropic's for
``/v1/messages``, OpenAI's ``{"error": {"message", "type", "param", "code"}}`` elsewhere), and the app-wide handlers
of a body that is not JSON, one that does not match the schema, an unknown route."""
# no `from __future__ import annotations`: FastAPI reads the handler annotations at runtime

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .error_shapes import anthropic_error, error_body, openai_error


def error(status: int, msg: str, typ: str = "invalid_request_error", param: str | None = None,
          code: str | None = None):
    """An error in OpenAI's shape."""
    return JSONResponse(openai_error(msg, typ, param, code), status_code=status)


def anthropic(status: int, msg: str):
    """An error in Anthropic's shape (the type named by ``status``)."""
    return JSONResponse(anthropic_error(status, msg), status_code=status)


class BadInput(Exception):
    """A bad request found inside a route that returns data (not a response): a 400 with its message."""


def add_error_handlers(app) -> None:
    def shaped(request, status: int, msg: str):
        return JSONResponse(error_body(request.url.path, status, msg), status_code=status)

    @app.exception_handler(BadInput)
    async def _bad(request, exc):
        return shaped(request, 400, str(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request, exc):  # a body that is not JSON or not UTF-8, an unknown route: the path's API's shape
        return shaped(request, exc.status_code, str(exc.detail))

    @app.exception_handler(RequestValidationError)
    async def _validation(request, exc):
        parts = [f"{'.'.join(str(x) for x in e.get('loc', ()))}: {e.get('msg')}" for e in exc.errors()]
        return shaped(request, 422, "invalid request: " + "; ".join(parts))
