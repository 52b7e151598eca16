"""epqlab's own routes and llama-cpp-python's server's extras: ``GET /health``, ``POST /tokenize`` /
``/extras/tokenize``, ``/extras/tokenize/count``, ``POST /detokenize`` / ``/extras/detokenize``, and
``GET /v1/epqlab/stats`` (the pager's, the batcher's and the time split's figures)."""
# no `from __future__ import annotations`: FastAPI reads the endpoint annotations at runtime

import asyncio
from typing import Optional

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

from ..engine.time_split import decode_summary
from ..results import clean_json
from .context import Served
from .fields import check_fields
from .http_errors import BadInput, error


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")  # unknown fields: 400 naming them (check_fields)
    model: Optional[str] = None
    input: str


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")  # unknown fields: 400 naming them (check_fields)
    model: Optional[str] = None
    tokens: list[int]


def add_routes(app, served: Served) -> None:
    session, batcher = served.session, served.batcher

    @app.get("/health")
    async def health():  # the one endpoint that needs no API key (epqlab.server.guard)
        return {"status": "ok"}

    async def _tokenize(body: TokenizeRequest):
        try:
            check_fields(body)
        except ValueError as e:
            raise BadInput(str(e)) from None

        def go():
            return session.tokenize(body.input.encode("utf-8"), special=True)  # llama-cpp-python's server's call
        try:
            return await asyncio.get_running_loop().run_in_executor(served.stats_pool, go)
        except (ValueError, UnicodeError) as e:
            raise BadInput(str(e)) from None

    @app.post("/tokenize")
    @app.post("/extras/tokenize")
    async def tokenize(body: TokenizeRequest):
        return {"tokens": await _tokenize(body)}

    @app.post("/extras/tokenize/count")
    async def tokenize_count(body: TokenizeRequest):
        return {"count": len(await _tokenize(body))}

    @app.post("/detokenize")
    @app.post("/extras/detokenize")
    async def detokenize(body: DetokenizeRequest):
        try:
            check_fields(body)
        except ValueError as e:
            return error(400, str(e))
        bad = [t for t in body.tokens if not 0 <= t < session.n_vocab]
        if bad:
            return error(400, f"token ids must be in [0, {session.n_vocab}); got {bad[0]}")
        return {"text": session.detokenize(body.tokens)}

    @app.get("/v1/epqlab/stats")
    async def stats():
        def read():
            with session.decoder.lock:  # between two steps: the pager's history is not growing
                out = {"model": served.name, "stats": clean_json(session.stats),
                       "batch": clean_json({**batcher.summary(), "last_steps": list(batcher.step_log)[-16:]})}
                if session.paged:  # mean ms per part of every decode call since the last reset_stats
                    out["time_split"] = clean_json(decode_summary(session.time_split("token")))
                return out

        return JSONResponse(await asyncio.get_running_loop().run_in_executor(served.stats_pool, read))
