"""Errors as an HTTP client reads them: a fix in the server's terms (restart it, its flags), never a Session's
(an HTTP client has none to open or close). The request surface and the runtime word their errors for a Python
caller; the few whose fix differs carry what the server needs to word its own."""
from __future__ import annotations

from ..errors import ContextFullError, ModelChangedError

N_CTX_FIX = "restart the server with a larger --n-ctx"
MODEL_FIX = "Every request is refused until you restart the server (with the new file)."


def said(e: BaseException) -> str:
    """``e``'s message for an HTTP client."""
    if isinstance(e, ContextFullError):
        return e.worded(N_CTX_FIX)
    if isinstance(e, ModelChangedError) and e.change:
        return f"{e.change} {MODEL_FIX}"
    return str(e)
