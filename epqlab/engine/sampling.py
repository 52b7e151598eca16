"""Token sampling through llama.cpp's own sampler chain (``llama_sampler_chain_*``), reached through
llama-cpp-python's low-level ctypes API and loaded only when a sampler is first built.

The chain is the one llama-cpp-python's ``Llama`` builds (``Llama._init_sampler``), stage by stage in
:class:`Sampler`'s docstring: logit bias, penalties, grammar, then greedy / mirostat / the filters and the
seeded draw. llama.cpp reads ``top_k <= 0``, ``top_p >= 1`` and ``min_p <= 0`` as "off". The logits are the
float32 rows :meth:`epqlab.Session.logits` returns; they are copied into a ``llama_token_data_array`` and the
stages pick the token (``llama_sampler_apply``, then ``selected``). Log-probabilities, when asked for, are
the log-softmax of that raw row (llama-cpp-python's ``logits_to_logprobs``), not of the filtered one.
"""
from __future__ import annotations

import ctypes
import math
import random

import numpy as np

DEFAULT_SEED = 0xFFFFFFFF  # llama.cpp's LLAMA_DEFAULT_SEED: a random seed per sampler
PENALTY_LAST_N = 64  # tokens the repeat penalty looks back over (llama-cpp-python's last_n_tokens_size)
MAX_LOGPROBS = 20  # most alternatives per token (OpenAI's top_logprobs limit)


def _check(name: str, v, lo=None, hi=None, integer=False):
    if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)):
        raise ValueError(f"{name} must be a number, got {v!r}")
    if integer and int(v) != v:
        raise ValueError(f"{name} must be an integer, got {v!r}")
    if not math.isfinite(float(v)):
        raise ValueError(f"{name} must be finite, got {v!r}")
    if lo is not None and v < lo:
        raise ValueError(f"{name} must be >= {lo}, got {v!r}")
    if hi is not None and v > hi:
        raise ValueError(f"{name} must be <= {hi}, got {v!r}")


class Sampler:
    """A llama.cpp sampler chain for one generation; call :meth:`sample` with each step's logits.

    The stages, in llama-cpp-python's order (``Llama._init_sampler``; logit bias first, as llama.cpp's
    ``common_sampler`` puts it): logit bias (``llama_sampler_init_logit_bias``), penalties
    (``llama_sampler_init_penalties``: repeat / frequency / presence over the last :data:`PENALTY_LAST_N`
    accepted tokens), the grammar (``llama_sampler_init_grammar``: tokens that cannot continue the GBNF
    grammar get -inf; end-of-generation only once it is complete), then greedy (``temperature <= 0``),
    mirostat (v1 / v2, which replace the filters and the temperature, as in llama-cpp-python), or top-k,
    typical, top-p, min-p, temperature and the seeded ``dist`` draw (std::mt19937 seeded with ``seed``).
    The grammar is its own sampler outside the chain: it is told only the generated tokens, never the
    prompt (:meth:`accept` feeds the penalties alone).

    Args:
        n_vocab: vocabulary size (length of each logits row).
        temperature: <= 0 picks the argmax (``llama_sampler_init_greedy``).
        top_k, top_p, min_p, typical_p: llama.cpp's top-k / nucleus / min-p / locally-typical filters
            (off at 0, 1.0, 0.0, 1.0).
        repeat_penalty: > 0; 1.0 is off. Divides positive (multiplies negative) logits of tokens
            among the last :data:`PENALTY_LAST_N` accepted ones (prompt tokens included).
        frequency_penalty, presence_penalty: OpenAI's penalties (logit -= count * frequency +
            (count > 0) * presence over the same window); 0.0 is off.
        logit_bias: ``{token_id: bias}`` added to the raw logits (-100 bans a token in practice).
        mirostat_mode: 0 off, 1 (``llama_sampler_init_mirostat``, m = 100) or 2 (``_v2``), with
            ``mirostat_tau`` (target surprise) and ``mirostat_eta`` (learning rate); arXiv:2007.14966.
        grammar: a GBNF grammar (root rule ``root``) or None; needs ``vocab``.
        vocab: a ``llama_vocab *`` of llama-cpp-python's library for the grammar (see
            :func:`epqlab.requests.structured.vocab_of`).
        n_logprobs: None: no log-probabilities; k >= 0: record, at each :meth:`sample`, the chosen token's
            log-probability and the k most likely tokens' (in :attr:`logprobs`).
        seed: int in 0..2**32-1, or None for a random one.

    Attributes:
        logprobs: with ``n_logprobs``, one ``(token, logprob, [(id, logprob), ...])`` per sampled token:
            log-softmax of the raw logits row given to :meth:`sample` (before bias, penalties, grammar
            and temperature), which is what llama-cpp-python reports (``Llama.logits_to_logprobs``).

    Raises:
        ValueError: a parameter that is not a finite number in its range, a logit_bias key that is not a
            token id, a grammar llama.cpp cannot parse (the message names it).
    """

    def __init__(self, n_vocab: int, *, temperature: float = 0.8, top_k: int = 40, top_p: float = 0.95,
                 min_p: float = 0.05, repeat_penalty: float = 1.0, seed: int | None = None,
                 frequency_penalty: float = 0.0, presence_penalty: float = 0.0, typical_p: float = 1.0,
                 logit_bias: dict | None = None, mirostat_mode: int = 0, mirostat_tau: float = 5.0,
                 mirostat_eta: float = 0.1, grammar: str | None = None, vocab=None, n_logprobs: int | None = None):
        import llama_cpp as L  # the ctypes API; loaded here, not at import time of epqlab

        _check("temperature", temperature)
        _check("top_k", top_k, integer=True)
        _check("top_p", top_p, 0.0, 1.0)
        _check("min_p", min_p, 0.0, 1.0)
        _check("typical_p", typical_p, 0.0, 1.0)
        _check("repeat_penalty", repeat_penalty)
        _check("frequency_penalty", frequency_penalty, -2.0, 2.0)
        _check("presence_penalty", presence_penalty, -2.0, 2.0)
        _check("mirostat_mode", mirostat_mode, 0, 2, integer=True)
        _check("mirostat_tau", mirostat_tau, 0.0)
        _check("mirostat_eta", mirostat_eta, 0.0)
        if repeat_penalty <= 0:
            raise ValueError(f"repeat_penalty must be > 0 (1.0 = off), got {repeat_penalty!r}")
        if n_logprobs is not None:
            _check("logprobs", n_logprobs, 0, MAX_LOGPROBS, integer=True)
        bias = _bias_list(logit_bias, int(n_vocab))
        if seed is None:
            seed = random.randrange(2**32 - 1)
        _check("seed", seed, 0, 2**32 - 1, integer=True)
        self._L = L
        self.n_vocab = int(n_vocab)
        self.temperature = float(temperature)
        self.seed = int(seed)
        self.n_logprobs = None if n_logprobs is None else int(n_logprobs)
        self.logprobs: list[tuple] = []
        self.n_sampled = 0
        self._grammar = None
        if grammar:
            if vocab is None:
                raise ValueError("a grammar needs the model's vocabulary (vocab=)")
            g = L.llama_sampler_init_grammar(vocab, grammar.encode("utf-8"), b"root")
            if not g:
                raise ValueError("llama.cpp could not parse the grammar (GBNF with a `root` rule; its parser's "
                                 "message is on stderr): fix the grammar")
            self._grammar = g
        pre = L.llama_sampler_chain_init(L.llama_sampler_chain_default_params())
        post = L.llama_sampler_chain_init(L.llama_sampler_chain_default_params())
        self._pre, self._post = pre, post
        self._chain = pre  # kept for callers that test whether the sampler was freed
        if bias:
            arr = (L.llama_logit_bias * len(bias))()
            for i, (t, b) in enumerate(bias):
                arr[i].token, arr[i].bias = t, b
            L.llama_sampler_chain_add(pre, L.llama_sampler_init_logit_bias(self.n_vocab, len(bias), arr))
        if repeat_penalty != 1.0 or frequency_penalty != 0.0 or presence_penalty != 0.0:
            L.llama_sampler_chain_add(pre, L.llama_sampler_init_penalties(
                self.n_vocab, PENALTY_LAST_N, float(repeat_penalty), float(frequency_penalty), float(presence_penalty)))
        add = lambda s: L.llama_sampler_chain_add(post, s)  # the chain owns what is added
        if self.temperature <= 0:
            add(L.llama_sampler_init_greedy())
        elif mirostat_mode == 1:
            add(L.llama_sampler_init_mirostat(self.n_vocab, self.seed, float(mirostat_tau), float(mirostat_eta), 100))
        elif mirostat_mode == 2:
            add(L.llama_sampler_init_mirostat_v2(self.seed, float(mirostat_tau), float(mirostat_eta)))
        else:
            add(L.llama_sampler_init_top_k(int(top_k)))
            if typical_p < 1.0:
                add(L.llama_sampler_init_typical(float(typical_p), 1))
            add(L.llama_sampler_init_top_p(float(top_p), 1))
            add(L.llama_sampler_init_min_p(float(min_p), 1))
            add(L.llama_sampler_init_temp(self.temperature))
            add(L.llama_sampler_init_dist(self.seed))
        self._data = (L.llama_token_data * self.n_vocab)()
        rec = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)])
        self._view = np.frombuffer(self._data, dtype=rec)
        self._ids = np.arange(self.n_vocab, dtype=np.int32)

    def accept(self, tokens) -> None:
        """Tell the penalties about tokens of the context (the prompt); :meth:`sample` accepts each sampled
        token into every stage itself."""
        for t in tokens:
            self._L.llama_sampler_accept(self._pre, int(t))

    def sample(self, logits: np.ndarray) -> int:
        """The next token id from float32 logits ``[n_vocab]`` (accepted into every stage). Raises ValueError
        when the grammar admits no token (the request's fault: llama.cpp would abort on accepting one)."""
        L = self._L
        if self._pre is None:
            raise RuntimeError("this Sampler was freed")
        v = self._view
        v["id"] = self._ids
        v["logit"] = logits
        v["p"] = 0.0
        arr = L.llama_token_data_array(data=ctypes.cast(self._data, L.llama_token_data_p), size=self.n_vocab,
                                       selected=-1, sorted=False)
        ref = ctypes.byref(arr)
        L.llama_sampler_apply(self._pre, ref)
        tok = self._greedy_in_grammar() if self._grammar is not None and self.temperature <= 0 else None
        if tok is None:
            if self._grammar is not None:
                L.llama_sampler_apply(self._grammar, ref)
                if not np.isfinite(v["logit"]).any():  # accepting any token now would abort in llama.cpp
                    raise ValueError("the grammar admits no token of this vocabulary here (after "
                                     f"{self.n_sampled} generated tokens): fix the grammar")
            L.llama_sampler_apply(self._post, ref)
            if not 0 <= arr.selected < arr.size:
                raise RuntimeError(f"llama.cpp's sampler chain selected no token (selected={arr.selected})")
            tok = int(arr.data[arr.selected].id)
        if self.n_logprobs is not None:
            self.logprobs.append(_logprobs(np.asarray(logits), tok, self.n_logprobs))
        self.n_sampled += 1
        L.llama_sampler_accept(self._pre, tok)
        if self._grammar is not None:
            L.llama_sampler_accept(self._grammar, tok)
        L.llama_sampler_accept(self._post, tok)
        return tok

    def _greedy_in_grammar(self) -> int | None:
        """Greedy with a grammar, the way llama.cpp's ``common_sampler_sample`` saves the grammar's pass over
        the whole vocabulary: the argmax of the (biased, penalized) row, if the grammar admits it, is the
        argmax of the grammar-masked row too (exact for greedy); else None (mask the whole row)."""
        L, v = self._L, self._view
        i = int(np.argmax(v["logit"]))  # llama.cpp's greedy keeps the first of equal maxima, as argmax does
        one = (L.llama_token_data * 1)()
        one[0].id, one[0].logit, one[0].p = int(v["id"][i]), float(v["logit"][i]), 0.0
        a1 = L.llama_token_data_array(data=ctypes.cast(one, L.llama_token_data_p), size=1, selected=-1, sorted=False)
        L.llama_sampler_apply(self._grammar, ctypes.byref(a1))
        return int(one[0].id) if math.isfinite(one[0].logit) else None

    def free(self) -> None:
        for name in ("_pre", "_post", "_grammar"):
            s = getattr(self, name, None)
            if s is not None:
                self._L.llama_sampler_free(s)
                setattr(self, name, None)
        self._chain = None

    def __del__(self):
        try:
            self.free()
        except Exception:
            pass


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """``logits - logsumexp(logits)`` in float64 (``[n_vocab]``): the log-probabilities llama-cpp-python
    reports (``Llama.logits_to_logprobs``)."""
    x = np.asarray(logits, np.float64)
    m = float(np.max(x))
    return x - (m + math.log(float(np.sum(np.exp(x - m)))))


def _logprobs(logits: np.ndarray, tok: int, k: int) -> tuple:
    lp = log_softmax(logits)
    top: list = []
    if k:
        ids = np.argpartition(-lp, k - 1)[:k]
        ids = ids[np.argsort(-lp[ids], kind="stable")]
        top = [(int(i), float(lp[i])) for i in ids]
    return tok, float(lp[tok]), top


def _bias_list(logit_bias, n_vocab: int) -> list[tuple[int, float]]:
    """``logit_bias`` (``{id: bias}``; ids may be JSON's string keys, as OpenAI sends them) as a list."""
    if not logit_bias:
        return []
    if not isinstance(logit_bias, dict):
        raise ValueError(f"logit_bias must be a {{token_id: bias}} object, got {type(logit_bias).__name__}")
    out = []
    for k, b in logit_bias.items():
        try:
            t = int(k)
        except (TypeError, ValueError):
            raise ValueError(f"logit_bias key {k!r} is not a token id (an integer)") from None
        if isinstance(k, bool) or not 0 <= t < n_vocab:
            raise ValueError(f"logit_bias key {k!r} is not a token id in [0, {n_vocab})")
        _check(f"logit_bias[{k!r}]", b, -100.0, 100.0)
        out.append((t, float(b)))
    return out


__all__ = ["Sampler", "DEFAULT_SEED", "PENALTY_LAST_N", "MAX_LOGPROBS", "log_softmax"]
