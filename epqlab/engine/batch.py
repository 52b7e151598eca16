"""Batched decode: several sequences per forward pass on one :class:`epqlab.Session`, scheduled by
continuous batching.

A decode *step* advances every active sequence by one token in one llama.cpp ubatch: token i at its own
position in its own KV stream (``Session(n_seq_max=N)``; the streams are separate, so each sequence attends
only to its own cells). The hook pages a multi-token ubatch by the union of its experts per layer
(docs/DESIGN.md §3d), so an expert two sequences both select is read and mapped once per step. Each step
records that union per layer and the bytes it read, so the saving is measured, not assumed.

Scheduling is continuous batching (Orca, OSDI '22; as llama.cpp's server and vLLM do): a request waits
for a free sequence, is prefilled alone (its prompt in ``n_batch`` chunks, one sequence per forward pass),
joins the next step, and leaves when it stops (an end-of-generation token, a stop string, ``n_predict``
tokens, its context full) or is cancelled; the sequence goes to the next waiting request. With
``prompt_cache`` (the server's default, as llama.cpp's server caches a slot's prompt) a finished sequence
keeps its KV cells, and a request whose prompt shares a prefix with them (a chat's next turn) is given that
sequence and decodes only the rest; otherwise its cells are freed at once. How much is reused is
:func:`reusable_prefix`'s rule: ``"exact"`` (whole ubatches of the cached prompt's evaluation: the answer
is the uncached one bit for bit), ``"fast"`` (the whole common prefix, as llama.cpp's server) or ``"off"``. The math is llama.cpp's: each sequence samples from its own logits row with its own
sampler chain (:class:`~epqlab.engine.sampling.Sampler`, its own seed).

Prefetch and skip-cold act on single-token ubatches only (native/engine/hook.h); a step of two or more
sequences pages its union at each layer's router, as a prefill ubatch does, with pipelined reads when the union
fits the layer's slots.
"""
from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence

import numpy as np

from ..errors import EpqlabError
from .generation import Generation
from .stop_text import StopText

STEP_HISTORY = 4096  # per-step records kept by a Batcher (the oldest are dropped first)
PROMPT_CACHE_MODES = ("exact", "fast", "off")  # reusable_prefix's rules


class Request:
    """One sequence of a batch: what to generate, and what it produced.

    Args:
        tokens: prompt ids (at least one).
        n_predict: most tokens to generate (>= 0).
        sampler: its own :class:`~epqlab.engine.sampling.Sampler` (freed when the request ends).
        stops: stop strings (the text stops before the first one; it is not emitted).
        index: the caller's number for it (the choice index of a completion).
        keep_logits: keep every logits row it sampled from (float32 ``[n_vocab]`` each, in :attr:`logits`;
            for exactness tests and A/B comparisons: n_vocab x 4 bytes per token).
        events: the queue its events go to (default: its own); several requests may share one.
        forced: teacher forcing: the tokens to feed, one per step, instead of sampling (the logits are still
            computed and kept with ``keep_logits``; the sampler is not consulted); it generates
            ``min(n_predict, len(forced))`` tokens. For timing and routing on real text (a random-weight
            model's own output repeats itself).
        score: with ``forced``, record the negative log-likelihood (nats) of each forced token under the logits
            row it is fed from, in :attr:`nll` (float per token: log-sum-exp of the row minus the token's logit;
            a teacher-forced perplexity of the batch, without keeping the rows).

    Attributes:
        events: ``queue.SimpleQueue`` of ``("piece", index, str)`` as text is produced, then one
            ``("done", index, None)``; ``piece_ends[k]``: how many tokens had been generated when the k-th
            piece was queued (it is set before the event, so a consumer of the event may read it).
        result: the :class:`~epqlab.engine.generation.Generation` once it ended (``finish_reason``
            ``"stop"`` | ``"length"`` | ``"cancelled"`` | ``"error"``), else None; ``error``: the exception that
            ended it, if any.
    """

    def __init__(self, tokens: Sequence[int], n_predict: int, sampler, stops: Sequence[str] = (), *, index: int = 0,
                 keep_logits: bool = False, events: queue.SimpleQueue | None = None,
                 forced: Sequence[int] | None = None, score: bool = False):
        self.tokens = [int(t) for t in tokens]
        self.forced = None if forced is None else [int(t) for t in forced]
        self.n_predict = int(n_predict) if forced is None else min(int(n_predict), len(self.forced))
        self.sampler = sampler
        self.stops = [s for s in stops if s]
        self.index = int(index)
        self.events: queue.SimpleQueue = events if events is not None else queue.SimpleQueue()
        self.done = threading.Event()
        self.result: Generation | None = None
        self.error: BaseException | None = None
        self._cancel = threading.Event()
        self.out: list[int] = []
        self._text = StopText(self.stops)  # the text, cut at a stop, and what may be streamed (stop_text.py)
        self._reason = "length"
        self.seq: int | None = None
        self.pos = 0  # next KV position of its sequence
        self.next_token: int | None = None  # sampled, to be decoded in the next step
        self.steps = 0  # decode steps it took part in
        self.step_tokens = 0  # tokens of those steps (all sequences): its mean batch = step_tokens / steps
        self.step_s = 0.0  # wall time of those steps
        self.t_submit = time.perf_counter()
        self.t_prefill0 = self.t_prefill1 = self.t_end = None
        self.prefill_bytes = 0
        self.reused = 0  # prompt tokens whose KV cells a cached sequence already held
        self.kv_tokens: list[int] = []  # the tokens its sequence's KV cells hold
        self.ubatch_ends: list[int] = []  # where its prompt's ubatches ended, as a fresh run splits it
        self.logits: list[np.ndarray] | None = [] if keep_logits else None
        if score and forced is None:
            raise ValueError("score needs forced tokens: it is the likelihood of the forced text")
        self.nll: list[float] | None = [] if score else None
        self.piece_ends: list[int] = []  # len(out) when each "piece" event was queued (appended before it)

    def _put_piece(self, text: str) -> None:
        if text:
            self.piece_ends.append(len(self.out))
            self.events.put(("piece", self.index, text))

    def cancel(self) -> None:
        """Stop this request at the next step (its sequence is freed; the others go on)."""
        self._cancel.set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def wait(self, timeout: float | None = None) -> Generation:
        """Block until the request ends; returns its Generation or raises the error that ended it."""
        if not self.done.wait(timeout):
            raise TimeoutError("the request has not finished")
        if self.error is not None:
            raise self.error
        return self.result

    def pieces(self) -> Iterator[str]:
        """The text pieces as a background :class:`Batcher` produces them (blocks between pieces)."""
        while True:
            kind, _, value = self.events.get()
            if kind == "done":
                if self.error is not None:
                    raise self.error
                return
            yield value


class Batcher:
    """Continuous batching on one Session (module docstring): at most ``max_batch`` sequences decode
    together (default and cap: the Session's ``n_seq_max``).

    Use it synchronously (:meth:`run`: every request to its end in the calling thread, as
    :meth:`epqlab.Session.generate_batch` does) or in the background (:meth:`start`, then :meth:`submit`
    from any thread, as ``epqlab serve`` does). ``prompt_cache``: keep a finished sequence's KV cells for a
    later prompt that extends them, ``"exact"`` | ``"fast"`` | ``"off"`` (:func:`reusable_prefix`; True is
    ``"exact"``, False ``"off"``). ``window_s``: in the background, when a batch starts
    from idle, wait up to this long for more requests (until ``max_batch`` wait) before its first step, so
    requests that arrive together decode together from their first token.

    Attributes:
        step_log: ``deque`` of per-step records (at most :data:`STEP_HISTORY`): ``n_tokens`` (sequences in the
            step), ``wall_s``, ``bytes_read`` (the pager's reads), ``union`` (distinct experts per MoE layer,
            int list), ``union_mean`` (their mean), ``requests``, ``hits``, ``misses``, ``staged_layers``.

    Raises:
        ValueError: ``max_batch`` < 1, an unknown ``prompt_cache``.
    """

    def __init__(self, session, max_batch: int | None = None, *, prompt_cache: bool | str = False,
                 window_s: float = 0.0, disk_cache=None):
        n = session.n_seq_max
        if max_batch is not None and (isinstance(max_batch, bool) or int(max_batch) < 1):
            raise ValueError(f"max_batch must be >= 1, got {max_batch!r}")
        mode = {True: "exact", False: "off"}.get(prompt_cache, prompt_cache) if isinstance(prompt_cache, bool) \
            else prompt_cache
        if mode not in PROMPT_CACHE_MODES:
            raise ValueError(f"prompt_cache must be one of {', '.join(PROMPT_CACHE_MODES)} (or a bool: True is "
                             f"'exact'), got {prompt_cache!r}")
        if not window_s >= 0:
            raise ValueError(f"window_s must be >= 0 seconds, got {window_s!r}")
        self.session = session
        # the prompt cache on disk (epqlab.engine.prompt_disk_cache.PromptDiskCache): finished sequences' states
        # are saved there, and a prompt that extends one starts from it (only with a prompt cache mode on)
        self.disk_cache = disk_cache if mode != "off" else None
        self.max_batch = min(int(max_batch or n), n)
        self.prompt_cache = mode
        self.window_s = float(window_s)
        self._cached: dict[int, list[int]] = {}  # free sequence -> the tokens its KV cells still hold
        self._dirty: set[int] = set()  # free sequences whose cells are unknown (a failed free): cleared at pick
        self._cached_ends: dict[int, list[int]] = {}  # free sequence -> its prompt's fresh ubatch ends
        self.prompt_tokens_total = 0  # prompt tokens admitted
        self.reused_cells_total = 0  # of which a cached sequence's KV cells already held
        self.step_log: deque = deque(maxlen=STEP_HISTORY)
        self.steps_total = 0
        # since the batcher started (the server's /metrics): prefill of the tokens not reused, decode steps'
        # tokens and wall time, and finished requests by finish reason
        self.prefill_tokens_total = 0
        self.prefill_s_total = 0.0
        self.decode_tokens_total = 0
        self.decode_s_total = 0.0
        self.finished_total: dict[str, int] = {}
        self.generated_tokens_total = 0
        self._waiting: deque[Request] = deque()
        self._active: dict[int, Request] = {}
        self._free = list(range(n))
        self._epoch: int | None = None
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closing = False

    # -- submitting ------------------------------------------------------------------------------
    def submit(self, req: Request) -> Request:
        """Queue ``req``; it joins a step once a sequence is free. Returns it."""
        with self._cv:
            if self._closing:
                raise EpqlabError("this batcher is closed")
            self._waiting.append(req)
            self._cv.notify_all()
        return req

    def run(self, requests: Sequence[Request]) -> list[Generation]:
        """Decode ``requests`` to their ends in this thread, holding the Session's lock; returns their
        Generations in order (raises the first request's error, after every request has ended)."""
        for r in requests:
            self.submit(r)
        with self.session.decoder.lock:
            try:
                while self.step():
                    pass
            except BaseException as e:
                self.fail_all(e)
                raise
        for r in requests:
            if r.error is not None:
                raise r.error
        return [r.result for r in requests]

    def drive(self) -> bool:
        """One scheduling step in the calling thread (for iterators that pull); False when idle."""
        with self.session.decoder.lock:
            return self.step()

    # -- background ------------------------------------------------------------------------------
    def start(self) -> "Batcher":
        """Run the scheduling loop on a daemon thread until :meth:`close`."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="epqlab-batcher", daemon=True)
            self._thread.start()
        return self

    def close(self) -> None:
        """Stop the loop (requests still queued or running end with an error) and wait for it."""
        with self._cv:
            self._closing = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self.fail_all(EpqlabError("the batcher was closed"))

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._closing and not self._waiting and not self._active:
                    self._cv.wait()
                if self._closing:
                    return
                if not self._active and self.window_s > 0:  # a batch starts: let its company arrive
                    deadline = time.monotonic() + self.window_s
                    while (not self._closing and len(self._waiting) < self.max_batch
                           and time.monotonic() < deadline):
                        self._cv.wait(deadline - time.monotonic())
            try:
                self.drive()
            except BaseException as e:  # noqa: BLE001 - a failed step fails its requests, the loop lives on
                self.fail_all(e)

    # -- the scheduler -------------------------------------------------------------------------------
    @property
    def active(self) -> int:
        """Sequences decoding now."""
        return len(self._active)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def step(self) -> bool:
        """Admit waiting requests into free sequences (each prefilled alone), then advance every active
        sequence by one token in one forward pass. Call with the Session's lock held. Returns False when
        nothing is waiting or active."""
        s, d = self.session, self.session.decoder
        with self._cv:
            if not self._waiting and not self._active:
                return False
        d.check_open()
        if self._epoch is None or self._epoch != d.epoch:
            if self._active:  # another operation cleared the context under the running sequences
                self.fail_all(EpqlabError("the batch's context was reset by another call on the same Session"),
                               waiting=False)
            self._epoch = d.begin_batch()
            self._free = list(range(s.n_seq_max))
            self._cached, self._cached_ends = {}, {}
            self._dirty = set()
        for r in [r for r in self._active.values() if r.cancelled]:
            self._finish(r, "cancelled")
        while len(self._active) < self.max_batch and self._free:
            with self._cv:
                if not self._waiting:
                    break
                r = self._waiting.popleft()
            if r.cancelled:
                self._finish(r, "cancelled")
                continue
            self._admit(r)
        if self._active:
            self._decode_step()
        return True

    def _pick_sequence(self, r: Request) -> tuple[int, int]:
        """A free sequence for ``r`` and how many of its prompt tokens that sequence's cells already hold:
        the free cached sequence with the longest :func:`reusable_prefix` (leaving at least one token to
        decode for its logits) whenever that saves work, i.e. reuses at least one cell, however short it is
        beside the prompt (a growing chat's next turn: 16 of 73 tokens), and even when an empty sequence is
        free; else an empty sequence, else the oldest cached one. (llama.cpp's server asks for half of the prompt,
        ``--slot-prompt-similarity`` 0.5, to keep a cached slot for a request that continues it; here a request
        that shares whole ubatches with a cached sequence is taken to be that continuation.) Where the context's memory cannot keep that prefix
        (recurrent state, a pruned sliding window: :meth:`~epqlab.engine.decoder.Decoder.trim_seq`) the
        sequence is cleared whole and nothing is reused. The sequence is taken from the free list only once
        its cells are in that state; an error leaves it free (and uncached, so the next pick clears it)."""
        best, keep = None, 0
        for q in self._free:
            held = self._cached.get(q)
            if held:
                n = reusable_prefix(held, self._cached_ends.get(q, []), r.tokens, self.prompt_cache)
                if n > keep:
                    best, keep = q, n
        disk = self._from_disk(r, keep)
        if disk is not None:
            return disk
        if best is None:
            empty = [q for q in self._free if q not in self._cached and q not in self._dirty]
            best = empty[0] if empty else self._free[0]
        held = self._cached.pop(best, None)
        self._cached_ends.pop(best, None)
        if best in self._dirty or (held is not None and len(held) > keep):  # cached tokens are never empty
            self._dirty.add(best)  # until its cells are known again
            keep = self.session.decoder.trim_seq(best, len(held or ()), keep)  # keep is 0 unless held
            self._dirty.discard(best)
        self._free.remove(best)
        return best, keep

    def _from_disk(self, r: Request, keep: int) -> tuple[int, int] | None:
        """The prompt cache on disk's pick for ``r`` when a saved sequence reuses more than ``keep`` cells (the best
        in memory): its state is restored into a free sequence (an empty one first) and trimmed to the reuse as a
        cached sequence in memory is. None (nothing restored) when no entry does better, or the state is refused
        (the entry is then removed: prompt_disk_cache's failure rule)."""
        dc = self.disk_cache
        if dc is None:
            return None
        e, n = dc.best(r.tokens, lambda held, ends, toks: reusable_prefix(held, ends, toks, self.prompt_cache))
        d = self.session.decoder
        if e is None or n <= keep or (d.engine.memory_is_recurrent and n != len(e.tokens)):
            return None  # recurrent state: only the whole saved sequence (trim_seq's rule), so skip the read
        blob = dc.load(e)
        if blob is None:
            return None
        empty = [q for q in self._free if q not in self._cached and q not in self._dirty]
        q = empty[0] if empty else self._free[0]
        self._cached.pop(q, None)
        self._cached_ends.pop(q, None)
        self._dirty.add(q)  # until its cells are known again
        with d.lock:
            ok = d.engine.set_seq_state(q, blob)
        if not ok:
            dc.refuse(e, "llama.cpp refused the state (llama_state_seq_set_data returned 0)")
            return None
        n = d.trim_seq(q, len(e.tokens), n)
        self._dirty.discard(q)
        self._free.remove(q)
        dc.hits += 1
        dc.hit_tokens += n
        return q, n

    def _admit(self, r: Request) -> None:
        """Give ``r`` a sequence and prefill its prompt. Any error here ends ``r`` alone, with that error, and
        returns its sequence (cleared) to the free list: no request is left without an answer and no sequence
        is lost, whatever failed (docs/DESIGN.md §3d)."""
        s, d = self.session, self.session.decoder
        r.t_prefill0 = time.perf_counter()
        b0 = _bytes_read(s)
        try:
            r.seq, r.reused = self._pick_sequence(r)
            r.sampler.accept(r.tokens)
            r.kv_tokens = list(r.tokens[:r.reused])
            logits = d.decode_seq(r.seq, r.tokens[r.reused:], r.reused, self._epoch)
        except BaseException as e:
            r.error = e
            r.kv_tokens = []
            self._finish(r, "error")
            if not isinstance(e, Exception):
                raise  # KeyboardInterrupt, SystemExit: the caller's to handle, after r has its answer
            self._resync(e)
            return
        r.prefill_bytes = _bytes_read(s) - b0
        r.t_prefill1 = time.perf_counter()
        self.prompt_tokens_total += len(r.tokens)
        self.reused_cells_total += r.reused
        self.prefill_tokens_total += len(r.tokens) - r.reused
        self.prefill_s_total += r.t_prefill1 - r.t_prefill0
        r.ubatch_ends = fresh_ubatch_ends(len(r.tokens), d.chunk_tokens(d.record_routes), self._n_ubatch())
        r.pos = len(r.tokens)
        r.kv_tokens = list(r.tokens)
        self._active[r.seq] = r
        if r.n_predict <= 0:  # nothing to generate (as Session.generate with n_predict=0)
            return self._finish(r, "length")
        try:
            tok = self._sample(r, logits)
            self._accept(r, tok)
        except BaseException as e:  # its grammar admits nothing, or its piece failed: it ends, the others go on
            r.error = e
            self._finish(r, "error")
            if not isinstance(e, Exception):
                raise

    def _n_ubatch(self) -> int:
        """llama.cpp's ubatch size: n_ubatch, at most n_batch (llama_init_from_model caps it)."""
        o = getattr(self.session, "options", None)
        return min(int(getattr(o, "n_ubatch", self.session.n_batch)), int(self.session.n_batch))

    def _decode_step(self) -> None:
        s, d = self.session, self.session.decoder
        rs = list(self._active.values())
        toks = np.array([r.next_token for r in rs], np.int32)
        pos = np.array([r.pos for r in rs], np.int32)
        seqs = np.array([r.seq for r in rs], np.int32)
        c0 = _step_counters(s)
        t0 = time.perf_counter()
        logits = d.decode_step(toks, pos, seqs, self._epoch)
        picked, failed = [], []
        for r, row in zip(rs, logits):
            try:
                picked.append(self._sample(r, row))
            except ValueError as e:  # this request's own fault (its grammar): it ends, the others go on
                r.error = e
                failed.append(r)
                picked.append(None)
        wall = time.perf_counter() - t0  # the forward pass and every sequence's sampling
        for r in rs:
            r.pos += 1
            r.kv_tokens.append(r.next_token)
            r.steps += 1
            r.step_tokens += len(rs)
            r.step_s += wall
        for r, tok in zip(rs, picked):
            if r in failed:
                self._finish(r, "error")
            else:
                self._accept(r, tok)
        c1 = _step_counters(s)
        union = (c1["union"] - c0["union"]).tolist() if c1["union"] is not None else []
        self.steps_total += 1
        self.decode_tokens_total += len(rs)
        self.decode_s_total += wall
        self.step_log.append({
            "step": self.steps_total, "n_tokens": len(rs), "wall_s": wall,
            "bytes_read": c1["bytes_read"] - c0["bytes_read"], "union": union,
            "union_mean": float(np.mean(union)) if union else 0.0,
            **{k: c1[k] - c0[k] for k in ("requests", "hits", "misses", "staged_layers")}})

    def _sample(self, r: Request, logits) -> int | None:
        """``r``'s next token from its logits row (its sampler, or the forced text); None when it ends here
        (the forced text is used up)."""
        if r.logits is not None:
            r.logits.append(np.array(logits, np.float32, copy=True))
        if r.forced is not None:
            if len(r.out) >= r.n_predict:
                return None
            tok = r.forced[len(r.out)]
            if r.nll is not None:
                x = np.asarray(logits, np.float64)
                m = float(x.max())
                r.nll.append(m + float(np.log(np.exp(x - m).sum())) - float(x[tok]))
            return tok
        return r.sampler.sample(logits)

    def _accept(self, r: Request, tok: int | None) -> None:
        """Emit ``tok``'s text; finish ``r`` (end of generation, a stop string, its limit, a full context) or
        queue the token for the next step."""
        d = self.session.decoder
        if tok is None:
            return self._finish(r, "length")
        if r.forced is None and d.is_eog(tok):
            return self._finish(r, "stop")
        r.out.append(tok)
        r._put_piece(r._text.add(d.piece(tok)))
        if r._text.stopped:
            return self._finish(r, "stop")
        if len(r.out) >= r.n_predict or r.pos >= self.session.n_ctx:
            return self._finish(r, "length")  # n_predict reached, or no KV cell left for the next token
        r.next_token = tok

    def _finish(self, r: Request, reason: str) -> None:
        """End ``r``: its sequence goes back to the free list (its cells cached for a later prompt, or freed;
        if freeing fails the sequence is marked to be cleared at its next pick), then its Generation and
        ``done`` event. Never raises before ``r`` has its answer."""
        if r.done.is_set():
            return
        if r.seq is not None and (self._active.get(r.seq) is r or r.seq not in self._free):
            self._active.pop(r.seq, None)
            d = self.session.decoder
            if not d.closed and self._epoch == d.epoch:
                if self.prompt_cache != "off" and reason != "error" and r.kv_tokens:
                    self._cached[r.seq] = r.kv_tokens  # kept for a prompt that extends them
                    self._cached_ends[r.seq] = r.ubatch_ends
                    if self.disk_cache is not None and not self.disk_cache.has(r.kv_tokens):
                        with d.lock:  # the cells as they are now; written by the cache's own thread
                            self.disk_cache.save(r.kv_tokens, r.ubatch_ends, d.engine.seq_state(r.seq))
                else:
                    self._cached.pop(r.seq, None)
                    try:
                        d.free_seq(r.seq)
                    except Exception:  # noqa: BLE001 - cleared at its next pick instead (_pick_sequence)
                        self._dirty.add(r.seq)
            if r.seq not in self._free:
                self._free.append(r.seq)
                self._free.sort()
        r.t_end = time.perf_counter()
        self.finished_total[reason] = self.finished_total.get(reason, 0) + 1
        self.generated_tokens_total += len(r.out)
        try:
            r._put_piece(r._text.flush())  # held back in case it began a stop string; it ends here
            # a character cut by the last token is dropped, as llama-cpp-python does
            r.result = Generation(r._text.text, list(r.out), list(r.tokens), self._seq_stats(r), reason)
            r.sampler.free()
        except Exception as e:  # noqa: BLE001 - the request still gets its answer: this error
            if r.error is None:
                r.error = e
        finally:
            r.events.put(("done", r.index, None))
            r.done.set()

    def _seq_stats(self, r: Request) -> dict:
        pf = (r.t_prefill1 - r.t_prefill0) if r.t_prefill1 is not None else 0.0
        dec = (r.t_end - r.t_prefill1) if r.t_prefill1 is not None else 0.0
        return {"index": r.index, "seq": r.seq, "n_prompt": len(r.tokens), "n_prompt_reused": r.reused,
                "n_gen": len(r.out),
                "prefill_s": pf, "prefill_tok_s": (len(r.tokens) - r.reused) / pf if pf > 0 else 0.0,
                "prefill_ssd_bytes": r.prefill_bytes, "decode_s": dec, "step_s": r.step_s,
                # its own speed: the tokens its steps produced for it over those steps' wall time (others'
                # prefills, which run between steps, are not its decode)
                "decode_tok_s": r.steps / r.step_s if r.step_s > 0 else 0.0, "decode_steps": r.steps,
                "mean_batch": r.step_tokens / r.steps if r.steps else 0.0,
                "queue_s": (r.t_prefill0 or r.t_end) - r.t_submit}

    def _resync(self, e: BaseException) -> None:
        """After a failed forward pass: llama.cpp's memory may have been cleared under every sequence (a failed
        decode clears the context, native/engine/engine.cpp), so each running request whose sequence no longer
        holds its cells ends with an error naming the cause, and cached prompts no longer held are forgotten
        (their sequences are cleared at their next pick). Never lets a sequence decode on cells it lost."""
        d = self.session.decoder
        for r in list(self._active.values()):
            if d.seq_pos_max(r.seq) != r.pos - 1:
                r.error = EpqlabError(f"sequence {r.seq} lost its KV cells when a forward pass for another request "
                                      f"failed ({type(e).__name__}: {e}); retry the request")
                self._finish(r, "error")
        for q, held in list(self._cached.items()):
            if d.seq_pos_max(q) != len(held) - 1:
                del self._cached[q]
                self._cached_ends.pop(q, None)
                self._dirty.add(q)

    def fail_all(self, e: BaseException, waiting: bool = True) -> None:
        """End every active request (and, with ``waiting``, every queued one) with error ``e``: their
        sequences are freed and their waiters wake. For a caller driving the batcher whose own loop
        failed (a step raised), so no request is left waiting for steps that will not come."""
        for r in list(self._active.values()):
            r.error = e
            self._finish(r, "error")
        # what the failed step left in the cache is unknown: every free sequence is cleared at its next pick
        self._dirty.update(self._cached)
        self._cached.clear()
        self._cached_ends.clear()
        if waiting:
            with self._cv:
                pending, self._waiting = list(self._waiting), deque()
            for r in pending:
                r.error = e
                self._finish(r, "error")

    # -- what it measured ------------------------------------------------------------------------
    def summary(self, steps: Sequence[dict] | None = None) -> dict:
        """Aggregates of ``steps`` (default: the whole :attr:`step_log`): ``steps``, ``tokens`` (decoded in
        them), ``decode_s``, ``decode_tok_s`` (aggregate, all sequences), ``mean_batch`` (tokens per step),
        ``batch_sizes`` ({size: steps}), ``union_per_layer`` (mean distinct experts per layer per step),
        ``ssd_bytes`` and ``ssd_bytes_per_token`` (pager reads in the steps), ``hit_rate``; and since the
        batcher started: ``prompt_cache`` (its mode), ``prompt_tokens`` (admitted) and ``reused_cells`` (of
        those, the ones a cached sequence's KV cells already held)."""
        steps = list(self.step_log if steps is None else steps)
        tok = sum(x["n_tokens"] for x in steps)
        wall = sum(x["wall_s"] for x in steps)
        req = sum(x["requests"] for x in steps)
        sizes: dict[int, int] = {}
        for x in steps:
            sizes[x["n_tokens"]] = sizes.get(x["n_tokens"], 0) + 1
        byts = sum(x["bytes_read"] for x in steps)
        return {"prompt_cache": self.prompt_cache, "prompt_tokens": self.prompt_tokens_total,
                "reused_cells": self.reused_cells_total, "steps": len(steps), "tokens": tok, "decode_s": wall, "decode_tok_s": tok / wall if wall > 0 else 0.0,
                "mean_batch": tok / len(steps) if steps else 0.0, "batch_sizes": dict(sorted(sizes.items())),
                "union_per_layer": float(np.mean([x["union_mean"] for x in steps])) if steps else 0.0,
                "ssd_bytes": byts, "ssd_bytes_per_token": byts / tok if tok else 0.0,
                "hit_rate": sum(x["hits"] for x in steps) / req if req else 0.0,
                "active": self.active, "waiting": self.waiting, "max_batch": self.max_batch}


class BatchStream:
    """Iterator over ``(index, piece)`` of a batch's sequences as they are produced, driving the
    :class:`Batcher` step by step in the consuming thread (built by :meth:`epqlab.Session.stream_batch`).
    Once exhausted, :attr:`results` holds every request's Generation in order (None before). The batch is one
    operation on the Session's one context: another call on the Session while the stream is open (a
    ``generate``, another batch) restarts the context, and the stream's next step raises EpqlabError."""

    def __init__(self, batcher: Batcher, requests: Sequence[Request], on_end=None):
        self.batcher = batcher
        self.requests = list(requests)
        self.results: list[Generation] | None = None
        self._on_end = on_end
        self._gen = self._run()

    def __iter__(self):
        return self

    def __next__(self) -> tuple[int, str]:
        return next(self._gen)

    def close(self) -> None:
        """Cancel what is still running and finish the batch."""
        for r in self.requests:
            r.cancel()
        self._gen.close()

    def _run(self):
        for r in self.requests:
            self.batcher.submit(r)
        try:
            while True:
                for r in self.requests:
                    while True:
                        try:
                            kind, index, value = r.events.get_nowait()
                        except queue.Empty:
                            break
                        if kind == "piece":
                            yield index, value
                if all(r.done.is_set() for r in self.requests):
                    break
                try:
                    if not self.batcher.drive():
                        break
                except BaseException as e:
                    self.batcher.fail_all(e)
                    raise
        finally:
            for r in self.requests:
                r.cancel()
            try:
                while self.batcher.drive():  # let cancelled sequences leave (frees their KV cells)
                    pass
            except EpqlabError:  # the Session was closed (or reset) meanwhile: nothing left to free
                self.batcher.fail_all(EpqlabError("the batch ended with its Session"))
            self.results = [r.result for r in self.requests]
            if self._on_end is not None:
                self._on_end(self)
        for r in self.requests:
            if r.error is not None:
                raise r.error


def fresh_ubatch_ends(n: int, n_batch: int, n_ubatch: int) -> list[int]:
    """The ubatch ends, within the first ``n`` tokens, that a fresh evaluation of *any* prompt starting with
    those ``n`` tokens has: a prompt goes to llama_decode in chunks of ``n_batch`` tokens
    (:meth:`~epqlab.engine.decoder.Decoder.decode_seq`), each split by llama.cpp into ubatches of ``n_ubatch``
    (llama_context::decode), so the ends are c + k * n_ubatch inside each chunk [c, c + n_batch) and the
    chunk's end. A last, shorter ubatch that ends at ``n`` only because the prompt ends there is not listed
    (a longer prompt fills it). Only ends from which the rest, sent in chunks of ``n_batch`` again, splits
    as the fresh run does are listed: every one when ``n_ubatch`` divides ``n_batch``, else the chunk ends.
    Increasing, all <= n."""
    if n_batch < 1 or n_ubatch < 1:
        raise ValueError(f"n_batch and n_ubatch must be >= 1, got {n_batch}, {n_ubatch}")
    inner = n_batch % n_ubatch == 0
    ends = []
    for c in range(0, n, n_batch):
        if inner:
            ends += [e for e in range(c + n_ubatch, c + n_batch, n_ubatch) if e <= n]
        if c + n_batch <= n:
            ends.append(c + n_batch)
    return ends


def reusable_prefix(cached_tokens: Sequence[int], cached_ubatch_ends: Sequence[int], prompt: Sequence[int],
                    mode: str) -> int:
    """How many leading KV cells of a cached sequence a new ``prompt`` may reuse (docs/DESIGN.md §3d);
    ``cached_tokens``: what the sequence's cells hold (its prompt, then what it generated);
    ``cached_ubatch_ends``: :func:`fresh_ubatch_ends` of its prompt.

    - ``"fast"`` (llama.cpp's server with ``cache_prompt``): the whole common prefix, generated tokens too. The
      rest of the prompt is then evaluated in other ubatch shapes than a fresh run would use, and llama.cpp's
      matmuls round differently per shape, so the answer may differ from the uncached one.
    - ``"exact"``: only up to one of ``cached_ubatch_ends`` inside the common prefix. A fresh run of ``prompt``
      evaluates those same ubatches (same tokens, same positions) and resumes from that end in the same
      ubatches the reuse does, so every cell and every logit is the uncached one bit for bit. That holds for
      the cached cells because exact reuse itself only resumes at such ends. Generated tokens are never
      reused (they were decoded one per step, beside other sequences).
    - ``"off"``: nothing.

    At least one prompt token is always left to decode (its logits start the generation). Raises ValueError
    for another mode.
    """
    if mode not in PROMPT_CACHE_MODES:
        raise ValueError(f"prompt cache mode must be one of {', '.join(PROMPT_CACHE_MODES)}, got {mode!r}")
    if mode == "off":
        return 0
    n = max(min(_common_prefix(cached_tokens, prompt), len(prompt) - 1), 0)
    if mode == "fast":
        return n
    return max((e for e in cached_ubatch_ends if e <= n), default=0)


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _bytes_read(session) -> int:
    p = session.pager
    return int(p.native.stats()["bytes_read"]) if p else 0


def _step_counters(session) -> dict:
    p = session.pager
    st = p.native.stats() if p else {}
    hs = session.decoder.hook_stats()
    u = session.decoder.layer_unions()
    return {"bytes_read": int(st.get("bytes_read", 0)), "requests": int(st.get("requests", 0)),
            "hits": int(st.get("hits", 0)), "misses": int(st.get("misses", 0)),
            "staged_layers": int(hs.get("staged_layers", 0)), "union": u}


__all__ = ["Batcher", "BatchStream", "Request", "STEP_HISTORY", "PROMPT_CACHE_MODES", "fresh_ubatch_ends",
           "reusable_prefix"]
