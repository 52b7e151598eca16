"""One generation on a :class:`epqlab.Session`: prefill, then sample and decode token by token, with
stop strings; :class:`Stream` yields the text as it comes and keeps the result and run stats when it
ends (``Stream.result``, ``Stream.stats``, ``Stream.finish_reason``)."""
from __future__ import annotations

import hashlib
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from .run_stats import append_jsonl, counters, run_stats
from .speculative import MtpSpeculator, SpecStats
from .stop_text import StopText


@dataclass
class Generation:
    """Result of :meth:`Session.generate`: ``text`` (str), ``tokens`` (generated ids),
    ``prompt_tokens`` (ids), ``stats`` (dict of this run, docs/DESIGN.md run-stats fields),
    ``finish_reason``: ``"stop"`` (end-of-generation token or stop string) or ``"length"``
    (``n_predict`` reached)."""

    text: str
    tokens: list[int]
    prompt_tokens: list[int]
    stats: dict = field(default_factory=dict)
    finish_reason: str = "length"

    def __str__(self) -> str:
        return self.text


class Stream:
    """Iterator over the text pieces of one generation (a generator: ``send``, ``throw`` and
    ``close`` work as on one). When it ends — exhausted, closed, or stopped by an exception — the
    run's :class:`Generation` is in :attr:`result` and its stats in :attr:`stats` (None before).

    Args (built by :meth:`epqlab.Session.stream`):
        session: the Session; toks: prompt token ids; n_predict: most tokens to generate;
        sampler: an :class:`epqlab.engine.sampling.Sampler`; stop: stop strings (not yielded);
        reuse_kv: keep the KV entries of the previous call when its tokens are a prefix of ``toks``;
        forced: teacher forcing: token ids fed one per decode step instead of sampled ones (no
        end-of-generation or stop check), ``min(n_predict, len(forced))`` of them.
    """

    def __init__(self, session, toks: list[int], n_predict: int, sampler, stop: Sequence[str] | None,
                 reuse_kv: bool = False, forced: list[int] | None = None, draft_accept: tuple | None = None):
        self.result: Generation | None = None
        self.tokens: list[int] = []  # generated ids so far (grows while the stream runs)
        if forced is not None:
            n_predict = min(n_predict, len(forced))
        self._gen = _run(session, toks, n_predict, sampler, list(stop or []), reuse_kv, self, forced, draft_accept)

    def __iter__(self):
        return self

    def __next__(self) -> str:
        return next(self._gen)

    def send(self, value):
        return self._gen.send(value)

    def throw(self, *args):
        return self._gen.throw(*args)

    def close(self) -> None:
        self._gen.close()

    def finish(self) -> Generation:
        """Run the generation to its end here, without handing out its pieces, and return :attr:`result`."""
        for _ in self._gen:
            pass
        return self.result

    @property
    def stats(self) -> dict | None:
        """Run stats (see :meth:`epqlab.Session.generate`) once the stream has ended, else None."""
        return self.result.stats if self.result is not None else None

    @property
    def finish_reason(self) -> str | None:
        return self.result.finish_reason if self.result is not None else None

    def __repr__(self) -> str:
        return f"Stream({'running' if self.result is None else self.result.finish_reason})"


def _run(s, toks: list[int], n_predict: int, sampler, stops: list[str], reuse_kv: bool, holder: Stream,
         forced: list[int] | None = None, draft_accept: tuple | None = None):
    d = s.decoder
    d.prompt_hash = hashlib.sha256(np.asarray(toks, np.int32).tobytes()).hexdigest()[:16]
    with d.lock:
        c0 = counters(s)
        epoch, reused = d.begin(toks if reuse_kv else None)
    sampler.accept(toks)
    t0 = time.perf_counter()
    logits = d.prefill(toks, epoch, pos0=reused)
    t_prefill = time.perf_counter() - t0
    c1 = counters(s)
    out: list[int] = holder.tokens
    # the text and what may be streamed of it: one rule for streams and results (epqlab/engine/stop_text.py)
    text = StopText(stops if forced is None else ())
    reason = "length"
    t1 = time.perf_counter()
    pos = len(toks)
    interrupted = True  # until the loop ends by itself: Ctrl-C, an error, or a caller that stopped reading
    spec = None
    if getattr(s, "speculative", None) == "mtp" and n_predict > 0:
        a, seed = draft_accept if draft_accept is not None else (1.0, 0)
        spec = MtpSpeculator(d, epoch, s.draft_max, s.draft_p_min, forced=forced, accept_rate=a, seed=seed)
        u0 = d.layer_unions()
        source = spec.tokens(logits, pos, sampler, n_predict, forced_base=pos)
    else:
        source = _step_tokens(d, epoch, logits, pos, sampler, n_predict, forced)
    yielded = 0  # token ids the source gave: every one but the first came from a decode
    try:
        for tok in source:
            yielded += 1
            if forced is None and d.is_eog(tok):
                reason = "stop"
                break
            out.append(tok)
            piece = text.add(d.piece(tok))
            # teacher forcing: one piece per token (may be "": a character cut between tokens); no stop strings
            if piece or forced is not None:
                yield piece
            if text.stopped:
                reason = "stop"
                break
        rest = text.flush()  # held back in case it began a stop string; the generation is over
        if rest:
            yield rest
        interrupted = False
    finally:
        t_decode = time.perf_counter() - t1
        if d.closed:  # closed from another thread between two steps: no counters left to read
            holder.result = Generation(text.text, out, toks, {}, "closed")
            sampler.free()
            return
        if s.prefetch == "oracle" and s.pager:
            # the oracle's carried batch for a next token (a log longer than this run): its reads
            # belong to this run's bytes (in vain), not the next run's
            s.pager.native.prefetch_finish()
        passes = max(0, yielded - 1)  # tokens that came from a decode (decode_tok_s)
        st = run_stats(s, len(toks), len(out), passes, t_prefill, t_decode, c0, c1, counters(s),
                       n_prompt_reused=reused)
        if spec is not None:
            st.update(spec.stats.fields())
            st.update(_spec_unions(s, u0, d.layer_unions(), spec.stats))
        elif getattr(s, "speculative", None):  # nothing decoded (n_predict 0): the counters are there, zero
            st.update(SpecStats().fields())
        st["speculative"] = getattr(s, "speculative", None)
        st["teacher_forced"] = forced is not None
        st["interrupted"] = interrupted  # the stats line of a cut-short run says so (--stats-file JSONL)
        s.runs.append(st)
        if s.stats_file:
            append_jsonl(s.stats_file, st)
        # a character cut by the last token is dropped, as llama-cpp-python does
        holder.result = Generation(text.text, out, toks, st, reason)
        sampler.free()


def _step_tokens(d, epoch: int, logits, pos: int, sampler, n_predict: int, forced: list[int] | None):
    """Up to ``n_predict`` token ids, one single-token decode step each: the forced text's (teacher forcing: same
    graph, hook and stats), or sampled from the last logits. A token's own step runs only when the next one is asked
    for, so an end-of-generation token, a stop string's last token or the last token is never decoded."""
    for i in range(n_predict):
        tok = forced[i] if forced is not None else sampler.sample(logits)
        yield tok
        if i + 1 < n_predict:
            logits = d.step(tok, pos + i, epoch)


def _spec_unions(s, u0, u1, stats) -> dict:
    """``spec_verify_union``: distinct experts per trunk layer and target pass of the decode phase (a verify pass of
    1 + d tokens reads each expert of its union once); ``spec_mtp_union``: per MTP pass (draft and catch-up)."""
    if u0 is None or u1 is None:
        return {}
    du = np.asarray(u1, np.int64) - np.asarray(u0, np.int64)
    mtp = np.isin(np.asarray(s.layout.moe_layers), s.mtp_blocks)
    target = stats.verify_steps + stats.plain_steps
    mtp_passes = stats.draft_passes + target  # each target pass is followed by one catch-up pass
    return {"spec_verify_union": float(du[~mtp].mean()) / target if target and (~mtp).any() else 0.0,
            "spec_mtp_union": float(du[mtp].sum()) / mtp_passes if mtp_passes and mtp.any() else 0.0}


__all__ = ["Generation", "Stream"]
