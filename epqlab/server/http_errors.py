"""Errors in OpenAI's shape (``{"error": {"message", "type", "param", "code"}}``) for every route of the app:
the app-wide handlers of a body that is not JSON, one that does not match the schema, an unknown route.
(An API with its own error shape, e.g. Anthropic's Messages, answers its routes' errors in that shape.)"""
# no `from __future__ import annotations`: FastAPI reads the handler annotations at runtime

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException


def error(status: int, msg: str, typ: str = "invalid_request_error"):
    return JSONResponse({"error": {"message": msg, "type": typ, "param": None, "code": None}}, status_code=status)


class BadInput(Exception):
    """A bad request found inside a route that returns data (not a response): a 400 with its message."""


def add_error_handlers(app) -> None:
    @app.exception_handler(BadInput)
    async def _bad(request, exc):
        return error(400, str(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request, exc):  # a body that is not JSON or not UTF-8, an unknown route: the OpenAI error shape
        return error(exc.status_code, str(exc.detail))

    @app.exception_handler(RequestValidationError)
    async def _validation(request, exc):
        parts = [f"{'.'.join(str(x) for x in e.get('loc', ()))}: {e.get('msg')}" for e in exc.errors()]
        return error(422, "invalid request: " + "; ".join(parts))
