"""Which error body a path answers in (no FastAPI needed, so the guard uses it before the app): Anthropic's for the
Messages API's paths, OpenAI's for every other one.

- OpenAI: ``{"error": {"message", "type", "param", "code"}}``
  (https://platform.openai.com/docs/guides/error-codes).
- Anthropic: ``{"type": "error", "error": {"type", "message"}}``, the type named by the status
  (https://docs.anthropic.com/en/api/errors): 400 ``invalid_request_error``, 401 ``authentication_error``,
  403 ``permission_error``, 404 ``not_found_error``, 413 ``request_too_large``, 429 ``rate_limit_error``,
  500 ``api_error``, 529 ``overloaded_error``; another 4xx is ``invalid_request_error``, another 5xx ``api_error``.
"""
from __future__ import annotations

ANTHROPIC_PREFIX = "/v1/messages"
ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                   404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
                   529: "overloaded_error"}


def is_anthropic(path: str | None) -> bool:
    """True for ``/v1/messages`` and the paths under it (``/v1/messages/count_tokens``)."""
    return bool(path) and (path == ANTHROPIC_PREFIX or path.startswith(ANTHROPIC_PREFIX + "/"))


def anthropic_error(status: int, msg: str) -> dict:
    """Anthropic's error body for ``status`` (module docstring)."""
    typ = ANTHROPIC_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": typ, "message": msg}}


def openai_error(msg: str, typ: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None) -> dict:
    """OpenAI's error body (module docstring)."""
    return {"error": {"message": msg, "type": typ, "param": param, "code": code}}


def error_body(path: str | None, status: int, msg: str, typ: str = "invalid_request_error") -> dict:
    """The error body ``path``'s API answers with: Anthropic's (the type from ``status``) or OpenAI's (``typ``)."""
    return anthropic_error(status, msg) if is_anthropic(path) else openai_error(msg, typ)
