"""Perplexity: the one definition every part of epqlab uses (Session, CLI, benches, notebooks).

Definition (teacher forcing, natural log): the text is tokenized once (BOS added when the model
asks for it); windows of ``n_ctx`` tokens start every ``stride`` tokens (default ``stride =
n_ctx``: non-overlapping); each window is decoded from an empty context; a window scores the
prediction of its token ``j+1`` from position ``j`` for ``j >= n_ctx - stride - 1`` (all ``j`` in the
first window), so with overlapping windows the overlap serves only as context and every token
after the first is scored exactly once; with non-overlapping windows (the default) each window's
first token is context only. PPL = exp(sum NLL / n_scored), accumulated in float64 from the float32 logits
llama.cpp returns. This is the sliding-window evaluation of Hugging Face's "Perplexity of
fixed-length models" guide; llama.cpp's ``llama-perplexity`` instead scores only each window's
second half, so its numbers are not comparable one to one.

Memory is bounded: logits arrive in blocks of at most 16 MiB (:meth:`Session.iter_logits`) and
the log-softmax runs on a few rows at a time.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np

_ROWS_F64_BYTES = 4 * 2**20  # float64 scratch per log-softmax step


@dataclass(frozen=True)
class PerplexityResult:
    """``ppl`` = exp(``nll``); ``nll``: mean negative log-likelihood in nats per scored token;
    ``n_scored``: tokens scored; ``n_windows``: windows decoded; ``n_ctx``, ``stride``: tokens; ``token_nll``: each
    scored token's NLL in order (float64 ``[n_scored]``) when asked for (``per_token=True``), else None."""

    ppl: float
    nll: float
    n_scored: int
    n_windows: int
    n_ctx: int
    stride: int
    token_nll: np.ndarray | None = field(default=None, repr=False, compare=False)


def _row_nll(logits: np.ndarray, targets: np.ndarray):
    """-log softmax(logits[i])[targets[i]] per row, float64, a few rows at a time (one array per step)."""
    m, v = logits.shape
    step = max(1, _ROWS_F64_BYTES // (8 * v))
    for a in range(0, m, step):
        lg = logits[a:a + step].astype(np.float64)
        mx = lg.max(axis=1, keepdims=True)
        lse = np.log(np.exp(lg - mx).sum(axis=1)) + mx[:, 0]
        yield lse - lg[np.arange(len(lg)), targets[a:a + step]]


def block_nll(logits: np.ndarray, targets: np.ndarray, rows: list | None = None) -> float:
    """Sum of -log softmax(logits[i])[targets[i]] over rows, in float64 (nats); ``rows``: a list that receives each
    row's value too (arrays, in order).

    Args:
        logits: float32 ``[m, n_vocab]``.
        targets: int ``[m]`` token ids.
    """
    total = 0.0
    for part in _row_nll(logits, targets):
        total += float(part.sum())
        if rows is not None:
            rows.append(part)
    return total


def perplexity(session, text: str, *, n_ctx: int = 512, stride: int | None = None,
               per_token: bool = False) -> PerplexityResult:
    """Perplexity of ``text`` under an open :class:`epqlab.Session` (see the module docstring for the
    windowing). From a GGUF path: :func:`epqlab.studies.model_quality.perplexity_of` opens a Session.

    Args:
        session: an open :class:`epqlab.Session` (its logits, its top-k, its paging).
        text: the evaluation text.
        n_ctx: window length, tokens (>= 2; at most the session's n_ctx).
        stride: tokens between window starts, 1..n_ctx (default n_ctx).
        per_token: also keep each scored token's NLL (``token_nll``: what a paired comparison of two settings on
            the same text needs, :mod:`epqlab.studies.paired`).

    Returns:
        :class:`PerplexityResult`.

    Raises:
        ValueError: fewer than 2 tokens, n_ctx < 2, stride outside 1..n_ctx, or n_ctx larger
            than the session's context.
        TypeError: ``session`` is a path (open a Session, or use ``perplexity_of``).
    """
    n_ctx = int(n_ctx)
    stride = n_ctx if stride is None else int(stride)
    if n_ctx < 2:
        raise ValueError(f"n_ctx must be >= 2 tokens, got {n_ctx}")
    if not 1 <= stride <= n_ctx:
        raise ValueError(f"stride must be in 1..n_ctx ({n_ctx}), got {stride}")
    if isinstance(session, (str, os.PathLike)):
        raise TypeError("perplexity() takes an open Session; for a model path use "
                        "epqlab.studies.model_quality.perplexity_of(path, text, ...), which opens one")
    s = session
    if n_ctx > s.n_ctx:
        raise ValueError(f"n_ctx={n_ctx} exceeds the session's context of {s.n_ctx}; open it with a larger n_ctx")
    return windowed_perplexity(s.tokenize(text), s.iter_logits, n_ctx=n_ctx, stride=stride, per_token=per_token)


def windowed_perplexity(tokens, window_logits, *, n_ctx: int, stride: int, per_token: bool = False) -> PerplexityResult:
    """The windowing and scoring of the module docstring, for any model.

    Args:
        tokens: int token ids ``[n]`` of the whole text (BOS included if wanted).
        window_logits: ``f(window) -> iterable of float32 blocks [m, n_vocab]``: the logits of every
            position of ``window`` (int32 ``[<= n_ctx]``) decoded from an empty context, in order, in
            blocks of any size (:meth:`epqlab.Session.iter_logits`, or llama-cpp-python's scores).
        n_ctx, stride: tokens, as in :func:`perplexity` (not checked here).
        per_token: keep each scored token's NLL (:attr:`PerplexityResult.token_nll`).

    Raises:
        ValueError: fewer than 2 tokens.
    """
    toks = np.asarray(tokens, dtype=np.int32)
    if len(toks) < 2:
        raise ValueError(f"perplexity needs at least 2 tokens; the text has {len(toks)}")
    nll, count, windows = 0.0, 0, 0
    rows: list | None = [] if per_token else None
    for start in range(0, len(toks) - 1, stride):
        win = toks[start:start + n_ctx]
        if len(win) < 2:
            break
        lo = 0 if start == 0 else max(0, n_ctx - stride - 1)  # first position whose prediction is scored
        pos = 0
        for blk in window_logits(win):
            m = len(blk)
            a, b = max(lo, pos), min(pos + m, len(win) - 1)  # positions j scored in this block
            if b > a:
                nll += block_nll(blk[a - pos:b - pos], win[a + 1:b + 1], rows)
                count += b - a
            pos += m
        windows += 1
        if start + n_ctx >= len(toks):
            break
    per = np.concatenate(rows) if rows else (np.zeros(0) if per_token else None)
    return PerplexityResult(float(np.exp(nll / count)), nll / count, count, windows, n_ctx, stride, per)


__all__ = ["PerplexityResult", "perplexity", "windowed_perplexity", "block_nll"]
