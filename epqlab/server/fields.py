"""A request body's fields: which unknown ones are refused or ignored (each with its reason), and the OpenAI
sampling fields as the request surface's keyword arguments (:mod:`epqlab.requests.completion`)."""
from __future__ import annotations

from .context import Served

# OpenAI / llama-cpp-python fields epqlab does not do: refused (400) unless sent at their "off" value, never ignored
# (suffix and best_of are refused by epqlab.requests.completion with their reasons)
UNSUPPORTED = {"audio": ((None,), "audio output is not offered (a text model)"),
               "modalities": ((None, ["text"]), "only text output is offered"),
               "prediction": ((None,), "predicted outputs (speculative decoding) are not offered"),
               "web_search_options": ((None,), "web search is not offered (nothing here reaches the web)"),
               "tfs_z": ((None, 1, 1.0), "tail-free sampling is gone from llama.cpp's sampler chain "
                                        "(llama-cpp-python accepts and ignores it)")}
# OpenAI fields accepted and ignored, each for a stated reason; any other unknown field is a 400 naming it. The
# rule: a field is ignored only when OpenAI's API defines it and honouring it could not change the tokens of an
# answer here (bookkeeping, routing, monitoring), or when it asks a model for something this server cannot steer
# and clients send by default (reasoning_effort, verbosity: the reply is the model's own either way); a field that
# asks for an output this server cannot give is refused (UNSUPPORTED).
IGNORED = {"user": "an end-user id for OpenAI's abuse monitoring: nothing here uses it",
           "safety_identifier": "an end-user id for OpenAI's abuse monitoring: nothing here uses it",
           "store": "OpenAI's stored completions: nothing is stored here",
           "metadata": "tags for OpenAI's stored completions: nothing is stored here",
           "service_tier": "OpenAI's processing tiers: there is one here",
           "prompt_cache_key": "OpenAI's prompt-cache routing: this server's cache is --prompt-cache, per sequence",
           "prompt_cache_retention": "OpenAI's prompt-cache lifetime: this server's cache is --prompt-cache",
           "reasoning_effort": "a reasoning model's effort on OpenAI: nothing here sets a reasoning budget (the "
                               "GGUF's chat template and max_tokens decide)",
           "verbosity": "OpenAI's answer-length hint: not applied (use max_tokens)"}


def check_names(given, own, ignored: dict = IGNORED, unsupported: dict = UNSUPPORTED) -> None:
    """ValueError naming every field in ``given`` (names, or a dict's keys) that is neither one of the endpoint's
    ``own``, nor refused with a reason (``unsupported``: name -> (accepted "off" values, reason)), nor ignored with
    one (``ignored``: name -> reason), so a typo such as ``max_token`` is not silently dropped; then, for a dict,
    ValueError for a refused field set to something other than its "off" values, with the reason."""
    unknown = sorted(k for k in given if k not in own and k not in unsupported and k not in ignored)
    if unknown:
        known = sorted(set(own) | set(unsupported) | set(ignored))
        raise ValueError(f"unknown field{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}: not a "
                         f"field of this endpoint (check the spelling; it takes: {', '.join(known)})")
    for k in given:
        if isinstance(given, dict) and k in unsupported and given[k] not in unsupported[k][0]:
            raise ValueError(f"{k}={given[k]!r}: {unsupported[k][1]}; drop it")


def check_fields(req) -> None:
    """:func:`check_names` for ``req``, a pydantic model of OpenAI's fields that allows extra ones (unknown names
    only: :func:`sampling_kwargs` checks the refused fields' values)."""
    check_names(list(req.model_extra or {}), type(req).model_fields)


def check_openai_ranges(req) -> None:
    """OpenAI's ranges where llama-cpp-python's differ (the in-process API keeps llama-cpp-python's): ``max_tokens``
    and ``max_completion_tokens`` >= 1, or null for "until the context is full" (llama-cpp-python reads <= 0 so);
    ``temperature`` in 0..2 (llama.cpp samples greedily below 0). ValueError naming the field."""
    for k in ("max_tokens", "max_completion_tokens"):
        v = getattr(req, k, None)
        if v is not None and v < 1:
            raise ValueError(f"{k} must be >= 1 (OpenAI's range; or null: until the context is full), got {v}")
    if not 0 <= req.temperature <= 2:
        raise ValueError(f"temperature must be in 0..2 (OpenAI's range; 0: greedy), got {req.temperature}")


def bias_of(session, bias, typ):
    """OpenAI's logit_bias ({"token id": bias}); llama-cpp-python's logit_bias_type "tokens": keys are text,
    each of its tokens gets the bias (as llama-cpp-python's server does)."""
    if typ in (None, "input_ids") or not bias:
        return bias
    if typ != "tokens":
        raise ValueError(f'logit_bias_type must be "input_ids" or "tokens", got {typ!r}')
    if not isinstance(bias, dict):
        raise ValueError("logit_bias must be an object")
    return {t: b for k, b in bias.items() for t in session.tokenize(str(k), add_special=False, parse_special=True)}


def sampling_kwargs(served: Served, req, fields: tuple) -> dict:
    """The keyword arguments of :func:`epqlab.requests.completion.create_completion` /
    ``create_chat_completion`` for a request of OpenAI's sampling fields (``req``), on the served batcher, plus
    the endpoint's own ``fields``. ValueError for an unknown or refused field, a value out of OpenAI's range
    (:func:`check_openai_ranges`), or a seed out of range."""
    check_fields(req)
    check_openai_ranges(req)
    check_names(req.model_extra or {}, type(req).model_fields)
    if req.seed is not None and not 0 <= req.seed < 2**32:
        raise ValueError(f"seed must be in 0..2**32-1, got {req.seed}")
    kw = dict(max_tokens=req.max_tokens, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
              min_p=req.min_p, repeat_penalty=req.repeat_penalty, stop=req.stop, seed=req.seed, model=served.name,
              n=req.n, batcher=served.batcher, strict_context=True, frequency_penalty=req.frequency_penalty,
              presence_penalty=req.presence_penalty, typical_p=req.typical_p,
              logit_bias=bias_of(served.session, req.logit_bias, req.logit_bias_type), mirostat_mode=req.mirostat_mode,
              mirostat_tau=req.mirostat_tau, mirostat_eta=req.mirostat_eta, grammar=req.grammar,
              response_format=req.response_format, stream_options=req.stream_options, usage_details=True)
    kw.update({k: getattr(req, k) for k in fields})
    return kw
