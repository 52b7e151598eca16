"""MTP speculative decoding with paged experts (docs/DESIGN.md §3g): ``Session(speculative="mtp")``.

A model with a multi-token-prediction block (``<arch>.nextn_predict_layers``: Qwen3.5/3.6's one MTP block) drafts
with it: llama.cpp's MTP context (``LLAMA_CONTEXT_TYPE_MTP``) runs the block on a token and the target's hidden
state at the position before it and predicts the token after. The driver follows llama.cpp's ``draft-mtp``
(common/speculative.cpp, ``common_speculative_impl_draft_mtp``; tools/server/server-context.cpp for the verify and
rollback):

- every target decode is followed by the MTP context's catch-up over the same tokens, token at position q paired
  with the target's hidden row of q-1 (:class:`MtpFollower`); both contexts then hold the same positions;
- a draft of up to ``draft_max`` tokens: MTP passes of one token each, the first on the last sampled token and the
  target's last hidden row, each next one on the drafted token and the MTP pass's own hidden row; a draft stops early
  when its top candidate's probability (softmax over the 10 best logits, llama.cpp's draft sampler is top-k 10) is
  below ``draft_p_min``. The draft's KV entries in the MTP context are removed before the verify (the catch-up
  evaluates those positions again, as llama.cpp's server does);
- one verify pass of the target over ``[last sampled, drafts...]``; its rows are sampled in order with the
  request's own sampler, each draft accepted while the sampled token equals it (llama.cpp's
  ``common_sampler_sample_and_accept_n``): every emitted token is the target's own sample given the accepted
  prefix. Greedy output equals non-speculative greedy output up to the floating-point differences of a multi-row pass
  (its rows take other kernels than a one-token pass: ~1e-3 in the logits on qwen35moe), so a near-tie between the
  top two tokens can resolve differently, as in llama.cpp's own speculative decoding;
- the rejected tail is removed from both contexts; a hybrid model's recurrent state rolls back through
  llama.cpp's per-token snapshots (``n_rs_seq`` = ``draft_max``, src/llama-memory-recurrent.cpp).

The MTP block's routed experts are paged in the same arena as the trunk's (the layout then includes the block:
:meth:`epqlab.layout.ModelLayout.with_mtp`), so the budget covers them. One sequence at a time
(``n_seq_max=1``).

Study mode (:meth:`epqlab.Session.stream` with ``forced`` and ``draft_accept``): random weights draft nonsense, so acceptance is *set*:
the drafts are the teacher text's next tokens, each replaced by a wrong one with probability 1 - a, and accepted
while they equal the text; the MTP passes still run, so the cost is measured, not the quality.
"""
from __future__ import annotations

import numbers
import time
from dataclasses import dataclass, field

import numpy as np

SPECULATIVE_TYPES = ("mtp",)
"""``speculative`` values: ``"mtp"`` drafts with the model's own MTP block (llama.cpp ``--spec-type draft-mtp``)."""
DRAFT_MAX_DEFAULT = 3
"""llama.cpp's default ``--spec-draft-n-max`` (common/common.h ``n_max = 3``)."""
DRAFT_MAX_LIMIT = 8
DRAFT_TOP_K = 10
"""Candidates llama.cpp's MTP draft sampler keeps (top-k 10, common/speculative.cpp); ``draft_p_min`` is compared
with the best one's probability among them."""


def check_speculative(lay, speculative, draft_max, draft_p_min, *, n_seq_max: int = 1, prefetch=None,
                      route_log=None, lossy: bool = False, n_batch: int = 512, n_ubatch: int = 512) -> tuple:
    """Check the speculative-decoding options; returns ``(speculative, draft_max, draft_p_min)`` resolved
    (``(None, 0, 0.0)`` when off).

    Raises:
        ValueError: an unknown ``speculative``; ``draft_max`` not an integer in 1..8 or ``draft_p_min`` outside
            0..1; a model without an MTP block (``<arch>.nextn_predict_layers`` 0); ``n_seq_max > 1`` (one sequence at
            a time); with ``prefetch`` (a trained predictor is fitted on the trunk's layers, and the MTP passes would
            interleave with its layer-to-layer predictions), ``route_log`` (a route row is one token through every
            layer; the MTP passes route one layer) or a lossy knob (measure one thing at a time).
    """
    if speculative is None:
        if draft_max is not None or draft_p_min is not None:
            raise ValueError("draft_max and draft_p_min go with speculative='mtp'")
        return None, 0, 0.0
    if speculative not in SPECULATIVE_TYPES:
        raise ValueError(f"unknown speculative {speculative!r}; choose one of {', '.join(map(repr, SPECULATIVE_TYPES))} or None")
    d = DRAFT_MAX_DEFAULT if draft_max is None else draft_max
    if isinstance(d, bool) or not isinstance(d, numbers.Integral) or not 1 <= d <= DRAFT_MAX_LIMIT:
        raise ValueError(f"draft_max is the most tokens drafted per verify pass, an integer in 1..{DRAFT_MAX_LIMIT} "
                         f"(llama.cpp's --spec-draft-n-max, default {DRAFT_MAX_DEFAULT}); got {draft_max!r}")
    p = 0.0 if draft_p_min is None else draft_p_min
    if isinstance(p, bool) or not isinstance(p, numbers.Real) or not np.isfinite(p) or not 0 <= p <= 1:
        raise ValueError(f"draft_p_min is a probability in 0..1 (llama.cpp's --draft-p-min, default 0); got {draft_p_min!r}")
    n_nextn = int((lay.metadata or {}).get(f"{lay.architecture}.nextn_predict_layers") or 0)
    if n_nextn <= 0:
        raise ValueError(f"speculative='mtp' drafts with the model's MTP block, and {lay.path.name} has none "
                         f"({lay.architecture}.nextn_predict_layers is 0): use a GGUF with its MTP block (e.g. a "
                         "Qwen3.5/3.6 '-MTP' GGUF, or epqlab model synth qwen35-a3b), or drop speculative")
    if n_seq_max != 1:
        raise ValueError(f"speculative='mtp' decodes one sequence at a time; use n_seq_max=1 (got {n_seq_max})")
    if n_ubatch < d + 2 or n_batch < d + 1:
        raise ValueError(f"speculative='mtp' with draft_max={d} needs n_ubatch >= {d + 2} and n_batch >= {d + 1} (a verify "
                         f"pass of {d + 1} tokens in one ubatch, with llama.cpp's rollback snapshots); got n_ubatch="
                         f"{n_ubatch}, n_batch={n_batch}: raise them or lower draft_max")
    if prefetch is not None:
        raise ValueError("speculative='mtp' and prefetch are exclusive here: the MTP passes would interleave with the "
                         "predictor's layer-to-layer predictions (a trained predictor knows only the trunk's layers); drop one")
    if route_log is not None:
        raise ValueError("speculative='mtp' cannot record a route log: a route row is one token through every layer, "
                         "and the MTP passes route one layer; drop route_log or speculative")
    if lossy:
        raise ValueError("speculative='mtp' with a lossy knob (skip_cold, route_bias, adaptive_k, expert_budget) would "
                         "rewrite the draft passes' routes; measure one at a time")
    return speculative, int(d), float(p)


class MtpFollower:
    """Keeps the MTP context in step with the target: after each target decode of tokens at positions
    ``pos0..``, the MTP context decodes the same tokens, token at q paired with the target's hidden row of q-1
    (the first with :attr:`pending_h`, the row of the position before the chunk), and :attr:`pending_h` becomes
    the chunk's last row (common/speculative.cpp ``process``). Called by the Decoder with its lock held."""

    def __init__(self, engine):
        self.engine = engine
        self.n_embd = int(engine.n_embd)
        self.pending_h = np.zeros(self.n_embd, np.float32)
        self.last_rows: np.ndarray | None = None  # the last target decode's hidden rows [n, n_embd]
        self.last_pos0 = 0  # and the position of its first token
        self.seconds = 0.0  # wall time of every catch-up pass so far

    def reset(self) -> None:
        self.pending_h = np.zeros(self.n_embd, np.float32)
        self.last_rows = None

    def keep(self, p_keep: int) -> None:
        """Both contexts now hold positions < ``p_keep``, inside the last decode: the pending row is that of
        position p_keep - 1."""
        self.pending_h = self.last_rows[p_keep - 1 - self.last_pos0].copy()

    def follow(self, tokens: np.ndarray, pos0: int) -> None:
        t0 = time.perf_counter()
        try:
            self._follow(tokens, pos0)
        finally:
            self.seconds += time.perf_counter() - t0

    def _follow(self, tokens: np.ndarray, pos0: int) -> None:
        n = len(tokens)
        h = self.engine.nextn_rows(n)
        hin = np.empty_like(h)
        hin[0] = self.pending_h
        hin[1:] = h[:-1]
        self.engine.mtp_decode(np.asarray(tokens, np.int32), np.arange(pos0, pos0 + n, dtype=np.int32), hin,
                               np.zeros(n, np.uint8))
        self.pending_h = h[-1].copy()
        self.last_rows, self.last_pos0 = h, int(pos0)


@dataclass
class SpecStats:
    """Counters of one speculative generation (llama.cpp's server reports the same: ``n_draft_tokens``,
    ``n_draft_accepted``, ``n_draft_verif_steps``)."""

    drafted: int = 0          # draft tokens proposed
    accepted: int = 0         # draft tokens accepted
    verify_steps: int = 0     # target passes that verified a draft (1 + draft tokens each)
    plain_steps: int = 0      # target passes of one token (an empty draft)
    draft_passes: int = 0     # MTP passes that drafted (one token each)
    draft_s: float = 0.0      # wall time of the draft passes, s
    verify_s: float = 0.0     # wall time of the target passes of the decode phase (verify and plain), s
    catchup_s: float = 0.0    # wall time of the MTP catch-up passes that follow them, s
    accepted_per_pos: list = field(default_factory=list)  # accepted drafts at draft position i (llama.cpp's n_accepted_per_pos)

    def fields(self) -> dict:
        return {"spec_drafted": self.drafted, "spec_accepted": self.accepted, "spec_verify_steps": self.verify_steps,
                "spec_plain_steps": self.plain_steps, "spec_draft_passes": self.draft_passes,
                "spec_acceptance": self.accepted / self.drafted if self.drafted else 0.0,
                "spec_mean_accepted": self.accepted / self.verify_steps if self.verify_steps else 0.0,
                "spec_accepted_per_pos": list(self.accepted_per_pos),
                "spec_draft_s": self.draft_s, "spec_verify_s": self.verify_s, "spec_catchup_s": self.catchup_s}


def _top_p(logits: np.ndarray) -> tuple[int, float]:
    """The best token and its probability among the :data:`DRAFT_TOP_K` best logits."""
    k = min(DRAFT_TOP_K, len(logits))
    z = logits[np.argpartition(logits, -k)[-k:]].astype(np.float64)
    return int(np.argmax(logits)), float(1.0 / np.exp(z - z.max()).sum())  # the best one's exp(0) = 1 over the sum


class MtpSpeculator:
    """The draft-verify loop of one generation on sequence 0 (module docstring). ``tokens`` yields the emitted
    token ids in order; the Decoder's KV bookkeeping (``kv``) stays exact at every yield."""

    def __init__(self, decoder, epoch: int, draft_max: int, draft_p_min: float, *, forced=None,
                 accept_rate: float = 1.0, seed: int = 0):
        self.d = decoder
        self.epoch = epoch
        self.draft_max = int(draft_max)
        self.p_min = float(draft_p_min)
        self.forced = None if forced is None else [int(t) for t in forced]
        self.accept_rate = float(accept_rate)
        self.rng = np.random.default_rng(seed)
        self.stats = SpecStats(accepted_per_pos=[0] * self.draft_max)

    def _draft(self, last: int, pos: int, n_left: int) -> list[int]:
        """Up to draft_max tokens after ``last`` (at ``pos``, not yet decoded by the target)."""
        d = self.d
        n = min(self.draft_max, n_left)
        out: list[int] = []
        if n <= 0:
            return out
        h = d.mtp.pending_h[None, :]
        tok = last
        t0 = time.perf_counter()
        with d.lock:
            d.check_epoch(self.epoch)
            try:
                for i in range(n):
                    lg, hr = d.engine.mtp_decode(np.array([tok], np.int32), np.array([pos + i], np.int32), h,
                                                 np.ones(1, np.uint8))
                    self.stats.draft_passes += 1
                    best, p = _top_p(lg[0])
                    if self.forced is not None:  # study mode: the text's token, or a wrong one with prob 1 - a
                        want = self.forced[pos + i + 1 - self.forced_base]
                        best = want if self.rng.random() < self.accept_rate else (want + 1) % d.n_vocab
                    elif p < self.p_min:
                        break
                    out.append(best)
                    tok, h = best, hr
                d.engine.mtp_seq_rm(0, pos)  # the verify's catch-up evaluates these positions again
            except BaseException:
                d.lost()
                raise
        self.stats.draft_s += time.perf_counter() - t0
        return out

    def tokens(self, logits: np.ndarray, pos: int, sampler, n_predict: int, forced_base: int = 0):
        """Yield up to ``n_predict`` token ids: the first sampled from ``logits`` (the prompt's last row; the KV
        holds positions < ``pos``), then draft-verify steps. ``forced_base``: the position of ``forced[0]``
        (study mode)."""
        d = self.d
        self.forced_base = forced_base
        n_out = 0
        if self.forced is not None:
            last = self.forced[pos - forced_base]
        else:
            last = sampler.sample(logits)
        yield last
        n_out += 1
        while n_out < n_predict:
            # a draft never takes the verify past the context: the pass of the last token alone hits the limit
            # where non-speculative decoding would
            drafts = self._draft(last, pos, min(n_predict - n_out - 1, d.n_ctx - pos - 1))
            seq = [last] + drafts
            t0, c0 = time.perf_counter(), d.mtp.seconds
            rows = d.decode(seq, pos, True, 1, self.epoch)  # PHASE_DECODE; the follower catches the MTP context up
            dc = d.mtp.seconds - c0
            self.stats.catchup_s += dc
            self.stats.verify_s += time.perf_counter() - t0 - dc
            k = len(drafts)
            if k:
                self.stats.verify_steps += 1
                self.stats.drafted += k
            else:
                self.stats.plain_steps += 1
            m = 0
            emitted = []
            for i in range(k + 1):
                if self.forced is not None:
                    t = self.forced[pos + i + 1 - forced_base]
                else:
                    t = sampler.sample(rows[i])
                emitted.append(t)
                if i < k and t == drafts[i]:
                    m += 1
                    self.stats.accepted_per_pos[i] += 1
                    continue
                break
            self.stats.accepted += m
            if m < k:  # drop the rejected tail from both contexts (a hybrid's state rolls back k - m tokens)
                d.rollback(pos + m + 1, self.epoch)
            pos += m + 1
            last = emitted[-1]
            for t in emitted:
                yield t
                n_out += 1
                if n_out >= n_predict:
                    return


__all__ = ["SPECULATIVE_TYPES", "DRAFT_MAX_DEFAULT", "check_speculative", "MtpFollower", "MtpSpeculator", "SpecStats"]
