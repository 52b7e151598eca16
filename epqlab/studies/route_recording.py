"""Recording route logs with an :class:`epqlab.Session`: the engine side of :mod:`epqlab.routes`, which
itself only reads and analyses logs (it never imports the engine)."""
from __future__ import annotations

import hashlib
import os

from ..routes.log import RouteLog
from ..engine.session import Session
from ..models import default_model


def record_route_log(model, prompt: str, n_tokens: int, path: str) -> RouteLog:
    """Generate ``n_tokens`` with an :class:`epqlab.Session` (plain llama.cpp, routes recorded;
    ``model=None`` means the default model) and save its route log to ``path``."""
    with Session(model or default_model(), pager=False, route_log=path) as s:
        s.generate(prompt, n_tokens)
    return RouteLog.load(path)


def obtain_log(route_log=None, *, model=None, prompt: str = "", n_tokens: int = 64, synthetic: bool = False,
               workdir: str = ".", seed: int = 0):
    """The log a notebook analyses: ``route_log`` (an NPZ path) if given; else, when ``synthetic``, a synthetic
    log (8 layers, 64 experts, top-4, locality 0.6); else one recorded with a Session from ``prompt`` into
    ``workdir``. Returns (RouteLog, a line saying where it came from).

    Raises:
        RouteLogError: ``route_log`` is not a valid route log.
    """
    if route_log is not None:
        return RouteLog.load(route_log), f"route log {os.fspath(route_log)}"
    if synthetic:
        log = RouteLog.synthetic(n_tokens=max(n_tokens, 2), n_layers=8, n_expert=64, k=4, locality=0.6,
                                 n_prefill=min(8, n_tokens), seed=seed)
        return log, f"synthetic log ({log!r})"
    h = hashlib.sha1(f"{model}|{prompt}|{n_tokens}".encode()).hexdigest()[:10]
    path = os.path.join(workdir, f"routes-{h}.npz")
    return record_route_log(model, prompt, n_tokens, path), f"recorded with a Session to {path}"


def recording_model(model=None, route_log=None, synthetic: bool = False) -> str | None:
    """The model file :func:`obtain_log` with these arguments records from (``model``, or the default model's
    path when ``model`` is None), or None when it records nothing (a given ``route_log`` or a synthetic log)."""
    if route_log is not None or synthetic:
        return None
    if model is not None:
        return os.fspath(model)

    return str(default_model())


__all__ = ["record_route_log", "obtain_log", "recording_model"]
