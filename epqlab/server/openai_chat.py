"""OpenAI's API as llama-cpp-python's server speaks it: ``GET /v1/models``, ``POST /v1/completions``,
``POST /v1/chat/completions`` (both streamed with ``"stream": true``) and ``POST /v1/embeddings`` (a 400 naming
why), on the request surface (:mod:`epqlab.requests.completion`)."""
# no `from __future__ import annotations`: FastAPI reads the endpoint annotations at runtime

from typing import Any, Optional, Union

from fastapi import Request
from pydantic import BaseModel, ConfigDict

from ..requests.completion import create_chat_completion, create_completion
from .context import Served
from .fields import sampling_kwargs
from .http_errors import error
from .streaming import run


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
    stream_options: Any = None  # {"include_usage": true}: usage in a last chunk of its own (OpenAI's)
    n: int = 1
    # checked by the request surface and llama.cpp's sampler chain (a bad value is a 400 naming it, not a 422)
    frequency_penalty: Any = 0.0
    presence_penalty: Any = 0.0
    typical_p: Any = 1.0
    logit_bias: Any = None
    logit_bias_type: Optional[str] = None
    mirostat_mode: Any = 0
    mirostat_tau: Any = 5.0
    mirostat_eta: Any = 0.1
    grammar: Any = None
    response_format: Any = None


class CompletionRequest(_Sampling):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: Optional[int] = 16
    logprobs: Any = None
    echo: Any = False
    suffix: Any = None
    best_of: Any = None


class ChatRequest(_Sampling):
    messages: list[dict[str, Any]]
    temperature: float = 0.2
    max_completion_tokens: Optional[int] = None
    logprobs: Any = None
    top_logprobs: Any = None
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    parallel_tool_calls: Any = None  # false: at most one call (epqlab.requests.completion)


EMBEDDINGS_REFUSED = ("embeddings are not offered: this engine runs a causal MoE language model for generation; "
                      "its last hidden state is not a trained sentence embedding (use an embedding model)")


def add_routes(app, served: Served) -> None:
    session = served.session

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": served.name, "object": "model", "created": served.created,
                                            "owned_by": "epqlab"}]}

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        try:
            kw = sampling_kwargs(served, req, ("logprobs", "echo", "suffix", "best_of"))
        except ValueError as e:
            return error(400, str(e))
        return await run(served, lambda c: create_completion(session, req.prompt, stream=req.stream, cancel=c, **kw),
                         req.stream, request)

    @app.post("/v1/chat/completions")
    async def chat(req: ChatRequest, request: Request):
        try:
            kw = sampling_kwargs(served, req, ("logprobs", "top_logprobs", "tools", "tool_choice", "functions",
                                               "function_call", "parallel_tool_calls"))
        except ValueError as e:
            return error(400, str(e))
        if req.max_completion_tokens is not None:
            kw["max_tokens"] = req.max_completion_tokens
        return await run(served, lambda c: create_chat_completion(session, req.messages, stream=req.stream, cancel=c,
                                                                  **kw),
                         req.stream, request)

    @app.post("/v1/embeddings")
    async def embeddings():
        return error(400, EMBEDDINGS_REFUSED)
