"""The public :class:`Session`: the runtime's :class:`epqlab.engine.session.Session` (load, page, decode,
batch, perplexity, stats) with llama-cpp-python's ``Llama`` API on top (``create_completion``,
``create_chat_completion``, ``__call__``), the OpenAI-shaped request surface of :mod:`epqlab.requests.completion`.

This is the class ``epqlab.Session`` names. The runtime's class has everything but these methods, so the runtime
never imports the request surface (docs/DESIGN.md §1): a request goes server -> request surface -> runtime.
"""
from __future__ import annotations

from collections.abc import Sequence

from ..engine.session import Session as _RuntimeSession
from .completion import create_chat_completion, create_completion


class Session(_RuntimeSession):
    __doc__ = _RuntimeSession.__doc__

    # -- llama-cpp-python's API (epqlab.requests.completion) -------------------------------------------
    def create_completion(self, prompt, max_tokens: int | None = 16, temperature: float = 0.8,
                          top_p: float = 0.95, top_k: int = 40, min_p: float = 0.05, repeat_penalty: float = 1.0,
                          stop: str | Sequence[str] | None = None, seed: int | None = None, stream: bool = False,
                          model: str | None = None, n: int = 1, **options):
        """Complete ``prompt`` as ``llama_cpp.Llama.create_completion`` does (same arguments and
        defaults, same OpenAI-schema dict: ``choices[0]["text"]``, ``finish_reason`` ``"stop"`` |
        ``"length"``, ``usage`` token counts), with epqlab's run stats under ``"epqlab"``.
        ``max_tokens`` None or <= 0: until the context is full. ``stream=True`` returns an
        iterator of ``text_completion`` chunks, the last with ``finish_reason`` and ``"epqlab"``
        (``stream_options={"include_usage": True}``: then one more chunk, OpenAI's, with ``"choices": []``
        and ``usage``); the pieces join to the non-streamed text (a suffix that could begin a ``stop``
        string is held back until it cannot). KV entries of the previous call are reused when its tokens prefix this prompt.
        ``prompt`` may also be a list (of strings, or of token-id lists: several prompts) and ``n`` > 1 asks
        for several choices per prompt, as the OpenAI completions API reads them; those decode as one batch
        (:meth:`generate_batch`, :mod:`epqlab.requests.completion`), their chunks carry each choice's ``index``.

        ``options``, as llama-cpp-python / OpenAI name them: ``frequency_penalty``, ``presence_penalty``
        (-2..2), ``logit_bias`` ({token id: bias}), ``typical_p``, ``mirostat_mode`` (0/1/2), ``mirostat_tau``,
        ``mirostat_eta``, ``grammar`` (GBNF str or ``llama_cpp.LlamaGrammar``), ``response_format``
        (``{"type": "json_object"}`` / ``{"type": "json_schema", "json_schema": {"schema": ...}}``),
        ``logprobs`` (int: the chosen token's log-probability and that many alternatives per token, in
        ``choices[i]["logprobs"]``: log-softmax of the raw logits), ``echo`` (prepend the prompt's text).
        ``suffix`` and ``best_of`` > 1 are refused.

        Raises:
            ValueError: a sampling parameter out of range, an empty prompt, a prompt that fills the
                context, a bad ``stop``, ``n`` < 1, a grammar or schema llama.cpp cannot use, an option
                epqlab refuses (named). TypeError: a prompt that is neither text nor token ids, an unknown option.
        """
        return create_completion(self, prompt, max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                                 top_k=top_k, min_p=min_p, repeat_penalty=repeat_penalty, stop=stop, seed=seed,
                                 stream=stream, model=model, n=n, **options)

    __call__ = create_completion

    def create_chat_completion(self, messages: Sequence[dict], max_tokens: int | None = None,
                               temperature: float = 0.2, top_p: float = 0.95, top_k: int = 40, min_p: float = 0.05,
                               repeat_penalty: float = 1.0, stop: str | Sequence[str] | None = None,
                               seed: int | None = None, stream: bool = False, model: str | None = None,
                               n: int = 1, **options):
        """The assistant's reply to ``messages`` (``[{"role": ..., "content": str}]``, formatted with the
        GGUF's chat template) as ``llama_cpp.Llama.create_chat_completion`` returns it: an OpenAI
        ``chat.completion`` dict (``choices[0]["message"]["content"]``, ``finish_reason``, ``usage``)
        plus ``"epqlab"`` run stats, or with ``stream=True`` ``chat.completion.chunk`` dicts (a first
        ``{"role": "assistant"}`` delta, ``{"content": ...}`` deltas, a last empty delta with
        ``finish_reason``). Defaults are llama-cpp-python's; a next turn reuses the KV cache of the
        previous one. ``n`` > 1: that many choices, decoded as one batch (see :meth:`create_completion`).

        ``options``: the sampling and output options of :meth:`create_completion` (``echo`` aside), with
        chat's ``logprobs=True`` / ``top_logprobs`` (0..20) in OpenAI's chat shape, and ``tools`` /
        ``tool_choice`` (``"auto"`` | ``"none"`` | ``"required"`` | ``{"type": "function", "function":
        {"name": ...}}``; legacy ``functions`` / ``function_call``): the reply's ``<tool_call>`` blocks become
        ``message["tool_calls"]`` with ``finish_reason`` ``"tool_calls"``, a forced call is grammar-constrained,
        and ``role: "tool"`` results are accepted in the next turn (:mod:`epqlab.requests.tools`);
        ``parallel_tool_calls=False``: at most one call per choice (the first; later ones are dropped).

        Raises:
            ValueError: malformed messages (the message names the first bad one), no chat template
                in the GGUF, or the arguments :meth:`create_completion` refuses.
        """
        return create_chat_completion(self, messages, max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                                      top_k=top_k, min_p=min_p, repeat_penalty=repeat_penalty, stop=stop,
                                      seed=seed, stream=stream, model=model, n=n, **options)


__all__ = ["Session"]
