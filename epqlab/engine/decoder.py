"""The decode protocol of one llama.cpp context: what every operation on a :class:`epqlab.Session`
(a generation, a perplexity, a logits call, a route recording) goes through.

A :class:`Decoder` owns the native engine handle (``epqlab._core.Engine``: the model, its context and
the expert hook) and the state that makes decoding on it safe:

- one lock, handed over in arrival order (:class:`FairRLock`): operations are serialized (one KV cache
  per Session) and a caller waiting between two batched steps gets the next turn;
- an *epoch*: each operation that restarts the context bumps it, so a generator (a stream, an
  ``iter_logits``) resumed after another operation raises instead of decoding on a foreign cache;
- the KV positions: the token ids whose KV entries the context holds at positions 0..; a prompt that
  extends the previous operation's tokens decodes only the rest (as llama-cpp-python does);
- the file identity: decoding is refused once the model file changed on disk (llama's mapping and the
  pager's reads would mix old and new bytes; :class:`~epqlab.engine.file_watch.FileWatch` says what counts);
- the recorded routes (``record_routes``): per decode call, experts int32 ``[n, L, k]``, phase uint8
  ``[n]`` and ubatch id int32 ``[n]``, appended as one tuple so an interrupt never leaves them out of step.

Logits come in blocks of at most :data:`LOGITS_BLOCK_BYTES` (llama.cpp's output buffer grows to the
largest number of outputs asked for and never shrinks), so memory stays bounded however long the input.
docs/DESIGN.md §5 describes the Session's decoding; native/engine/engine.h the engine's own invariant.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import numpy as np

from ..errors import EpqlabError
from .file_watch import FileWatch
from .fair_lock import FairRLock
from .speculative import MtpFollower
from .tokens import token_array

LOGITS_BLOCK_BYTES = 16 * 2**20
"""Largest block of all-token logits one llama_decode call produces, bytes."""

PHASE_PREFILL, PHASE_DECODE = 0, 1
"""Route-log phases (docs/DESIGN.md §6): a prompt's tokens, and tokens decoded one per forward pass."""


class Decoder:
    """One llama.cpp context and its decode protocol (module docstring).

    Args:
        engine: the native ``Engine`` (model + context + hook).
        files: the model's files (every shard), whose identity is checked before each decode: a
            :class:`~epqlab.engine.file_watch.FileWatch` (made before the load), or paths to watch from now.
        n_layers: routed-expert layers (route rows are ``[n_layers, k]``).
        record_routes: keep the routes of every decoded token.
        on_step: called after each llama_decode (the Session samples its memory peak there).
    """

    def __init__(self, engine, files: Sequence, n_layers: int, *, record_routes: bool = False,
                 on_step: Callable[[], None] | None = None):
        self.engine = engine
        self.lock = FairRLock()  # FIFO: a caller waiting between two batched steps gets the next turn
        self.epoch = 0
        self.kv: list[int] = []  # token ids whose KV entries the context holds at positions 0..
        self.route_parts: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []
        self.record_routes = bool(record_routes)
        self.prompt_hash = ""  # of the last generation's prompt ids (route-log metadata)
        self.closed = False
        self.files = files if isinstance(files, FileWatch) else FileWatch(files)
        self._n_layers = int(n_layers)
        self._on_step = on_step or (lambda: None)
        self.n_vocab = int(engine.n_vocab)
        self.n_ctx = int(engine.n_ctx)
        self.n_batch = int(engine.n_batch)  # llama.cpp caps n_batch at the requested n_ctx
        # speculative="mtp": every target decode is followed by the MTP context's catch-up (epqlab/engine/speculative.py)
        self.mtp = MtpFollower(engine) if getattr(engine, "has_mtp", False) else None

    # -- lifecycle -------------------------------------------------------------------------------
    def check_open(self) -> None:
        """Raises EpqlabError once the Session is closed."""
        if self.closed:
            raise EpqlabError("this Session is closed; create a new one")

    def close(self) -> None:
        """Drop the engine (frees the model and the context once nothing else holds it)."""
        with self.lock:
            self.closed = True
            self.engine = None
            self.files.close()

    # -- operations ------------------------------------------------------------------------------
    def begin(self, reuse: Sequence[int] | None = None) -> tuple[int, int]:
        """Start an operation (call with :attr:`lock` held); returns ``(epoch, tokens kept)``. The
        context is cleared, unless ``reuse`` (the operation's prompt ids) is given: then the KV
        entries of the previous operation are kept when the tokens they hold are a proper prefix of
        ``reuse`` (a chat's next turn, a longer prompt). Never while routes are recorded (a log
        must see every token)."""
        self.check_open()
        self.epoch += 1
        kept = 0
        if reuse is not None and not self.record_routes:
            kv = self.kv
            if 0 < len(kv) < len(reuse) and list(reuse[:len(kv)]) == kv:
                kept = len(kv)
        if not kept:
            self.engine.clear()
            self.kv = []
            if self.mtp is not None:
                self.mtp.reset()
        if self.record_routes:
            # routes of a decode whose caller was interrupted before taking them (KeyboardInterrupt
            # as llama_decode returned): they belong to no recorded operation
            self.engine.take_route()
            self.engine.take_route_probs()
            self.engine.take_route_ubatch()
        return self.epoch, kept

    def check_file(self) -> None:
        """Raises ModelChangedError if a file of the model no longer holds the bytes the Session reads
        (:meth:`epqlab.engine.file_watch.FileWatch.check`: size + mtime, a replaced file compared byte for byte)."""
        self.files.check()

    def chunk_tokens(self, all_logits: bool) -> int:
        """Tokens per llama_decode call: n_batch, or for all-logits decodes as many as keep one block
        of logits within :data:`LOGITS_BLOCK_BYTES`."""
        if not all_logits:
            return self.n_batch
        return max(1, min(self.n_batch, LOGITS_BLOCK_BYTES // (4 * self.n_vocab)))

    def check_tokens(self, tokens, pos0: int) -> np.ndarray:
        """``tokens`` as int32 ``[n]``. Raises ValueError for no tokens, ids outside the vocabulary, or
        positions past the context."""
        tokens = token_array(tokens)
        if len(tokens) == 0:
            raise ValueError("no tokens to decode: pass at least one token id")
        if tokens.min() < 0 or tokens.max() >= self.n_vocab:
            raise ValueError(f"token ids must be in [0, {self.n_vocab}); got {tokens.min()}..{tokens.max()}")
        tokens = tokens.astype(np.int32)
        if pos0 + len(tokens) > self.n_ctx:
            raise ValueError(f"{pos0 + len(tokens)} tokens exceed the context of {self.n_ctx}; pass a larger n_ctx")
        return tokens

    def decode_blocks(self, tokens, pos0: int, all_logits: bool, phase: int, epoch: int) -> Iterator[np.ndarray]:
        """Decode ``tokens`` in chunks (:meth:`chunk_tokens`) from position ``pos0`` in operation
        ``epoch``; yields float32 logits: ``[m, n_vocab]`` per chunk (``all_logits``) or one
        ``[1, n_vocab]`` (the last token).

        Raises:
            EpqlabError: the operation was superseded by another, or its context was lost (a failed
                or interrupted decode clears the KV cache).
            ModelChangedError: the model file changed on disk.
        """
        tokens = self.check_tokens(tokens, pos0)
        step = self.chunk_tokens(all_logits)
        for s in range(0, len(tokens), step):
            chunk = tokens[s:s + step]
            last = s + step >= len(tokens)
            with self.lock:
                self.check_epoch(epoch)
                if pos0 + s != len(self.kv):  # the engine clears the KV on a failed decode
                    raise EpqlabError("this generator's context was lost (a decode failed or was interrupted); "
                                      "start a new operation")
                try:
                    out = self.engine.decode(chunk, pos0 + s, bool(all_logits))
                    if self.mtp is not None:
                        self.mtp.follow(chunk, pos0 + s)
                except BaseException:
                    self.lost()
                    raise
                self.kv.extend(int(t) for t in chunk)
                if self.record_routes:
                    self.take_route(phase)
                self._on_step()
            if all_logits or last:
                yield out

    def decode(self, tokens, pos0: int, all_logits: bool, phase: int, epoch: int) -> np.ndarray:
        """:meth:`decode_blocks`, returning the last block (``all_logits`` False) or every block
        concatenated (float32 ``[n, n_vocab]``: the caller asked for all of it)."""
        blocks = self.decode_blocks(tokens, pos0, all_logits, phase, epoch)
        if not all_logits:
            last = None
            for last in blocks:
                pass
            return last
        outs = list(blocks)
        return np.concatenate(outs) if len(outs) > 1 else outs[0]

    def prefill(self, tokens, epoch: int, phase: int = PHASE_PREFILL, pos0: int = 0) -> np.ndarray:
        """Prefill ``tokens[pos0:]`` at positions pos0.. (the KV holds the first pos0); returns the last
        token's logits, float32 ``[n_vocab]``. While routes are recorded every token outputs logits
        (llama.cpp routes only output tokens through the last layer); those blocks are dropped as
        they come, so memory stays bounded."""
        last = None
        for last in self.decode_blocks(list(tokens)[pos0:], pos0, self.record_routes, phase, epoch):
            pass
        return last[-1]

    def lost(self) -> None:
        """A decode failed or was interrupted: the engine cleared its contexts (engine.h), so nothing is held."""
        self.kv = []
        if self.mtp is not None:
            self.mtp.reset()

    def check_epoch(self, epoch: int) -> None:
        """Raises EpqlabError when ``epoch`` is no longer the current operation, or the context was closed."""
        self.check_open()
        if epoch != self.epoch:
            raise EpqlabError("this generator's context was reset by another call on the same Session (one KV cache per "
                              "Session); finish or discard a stream before starting another operation")
        self.check_file()

    def rollback(self, p_keep: int, epoch: int) -> None:
        """Keep positions < ``p_keep`` of sequence 0 in the target and the MTP context (a rejected draft's tail,
        inside the last decode; a hybrid model's recurrent state rolls back through llama.cpp's snapshots,
        ``n_rs_seq``). Raises RuntimeError where llama.cpp cannot (more rejected tokens than snapshots)."""
        with self.lock:
            self.check_epoch(epoch)
            try:
                self.engine.seq_rm(0, int(p_keep))
                self.engine.mtp_seq_rm(0, int(p_keep))
            except BaseException:
                self.engine.clear()
                self.lost()
                raise
            del self.kv[int(p_keep):]
            self.mtp.keep(int(p_keep))

    def step(self, token: int, pos: int, epoch: int) -> np.ndarray:
        """Decode one generated token at ``pos`` (a single-token forward pass, phase decode); returns
        its logits, float32 ``[n_vocab]``."""
        return self.decode([int(token)], pos, False, PHASE_DECODE, epoch)[-1]

    def iter_logits(self, tokens: Sequence[int]) -> Iterator[np.ndarray]:
        """Decode ``tokens`` from an empty context; yields their logits in order as float32 blocks
        ``[m, n_vocab]`` of consecutive positions, each within :data:`LOGITS_BLOCK_BYTES`."""
        with self.lock:
            epoch, _ = self.begin()
        yield from self.decode_blocks(tokens, 0, True, PHASE_PREFILL, epoch)

    # -- several sequences (epqlab.engine.batch) ------------------------------------------------
    def begin_batch(self) -> int:
        """Start a batch operation (call with :attr:`lock` held): the context is cleared, every
        sequence is empty; returns its epoch."""
        epoch, _ = self.begin()
        return epoch

    def _check_epoch(self, epoch: int) -> None:
        self.check_open()
        if epoch != self.epoch:
            raise EpqlabError("this batch's context was reset by another call on the same Session (one KV cache per "
                              "Session); finish a batch before starting another operation")
        self.check_file()

    def decode_seq(self, seq: int, tokens, pos0: int, epoch: int, phase: int = PHASE_PREFILL) -> np.ndarray:
        """Decode ``tokens`` into sequence ``seq`` from position ``pos0`` (a prompt: n_batch chunks, one
        sequence per forward pass); returns the last token's logits, float32 ``[n_vocab]``. While routes
        are recorded every token outputs logits (as :meth:`prefill`). Raises ValueError for bad tokens or
        a prompt past the sequence's context, EpqlabError when ``epoch`` is not the current operation."""
        tokens = self.check_tokens(tokens, pos0)
        step = self.chunk_tokens(self.record_routes)
        out = None
        for s in range(0, len(tokens), step):
            chunk = tokens[s:s + step]
            with self.lock:
                self._check_epoch(epoch)
                try:
                    out = self.engine.decode(chunk, pos0 + s, self.record_routes, int(seq))
                except BaseException:
                    self.kv = []
                    raise
                if self.record_routes:
                    self.take_route(phase)
                self._on_step()
        return out[-1]

    def decode_step(self, tokens, pos, seqs, epoch: int) -> np.ndarray:
        """One forward pass over one token of each of several sequences (token i at position ``pos[i]`` of
        sequence ``seqs[i]``); returns their logits, float32 ``[n, n_vocab]`` in the same order."""
        with self.lock:
            self._check_epoch(epoch)
            toks = np.asarray(tokens, np.int32)
            out = self.engine.decode_seqs(toks, np.asarray(pos, np.int32), np.asarray(seqs, np.int32),
                                          np.ones(len(toks), np.uint8))
            if self.record_routes:
                self.take_route(PHASE_DECODE)
            self._on_step()
            return out

    def free_seq(self, seq: int, p0: int = 0) -> None:
        """Free the KV cells of sequence ``seq`` from position ``p0`` on (0: all; the other sequences keep
        theirs). Raises RuntimeError where the memory cannot drop a tail (recurrent state: use :meth:`trim_seq`)."""
        with self.lock:
            self.engine.seq_rm(int(seq), int(p0))

    def seq_pos_max(self, seq: int) -> int:
        """The last position sequence ``seq`` holds, -1 when it holds none."""
        with self.lock:
            return int(self.engine.seq_pos_max(int(seq)))

    def trim_seq(self, seq: int, held: int, keep: int) -> int:
        """Keep the first ``keep`` of the ``held`` positions sequence ``seq`` holds, for a prompt that shares
        them, and drop the rest; returns how many positions it kept: ``keep``, or 0 where the context's memory
        cannot keep exactly those (the sequence is then cleared whole and the prompt is evaluated from its
        start, as llama.cpp's server does, tools/server/server-context.cpp):

        - recurrent and hybrid memory (Mamba, Gated-DeltaNet: qwen35moe, qwen3next, lfm2moe, nemotron_h_moe)
          hold one state per sequence, the state after its last token, not one per position: a prefix is
          kept only when it is all the sequence holds (``keep == held``);
        - a sliding-window cache (gpt-oss, gemma4, laguna's SWA layers) prunes cells older than the window as
          it decodes: a prefix is kept only while the cells the next token attends to, the last ``n_swa``
          before ``keep``, are still there (llama-server's ``pos_min > n_past - n_swa`` test).

        Raises:
            EpqlabError: the context is closed.
        """
        keep, held = int(keep), int(held)
        with self.lock:
            self.check_open()
            e = self.engine
            if keep <= 0 or (e.memory_is_recurrent and keep != held):
                e.seq_rm(int(seq), -1)
                return 0
            if keep < held:
                e.seq_rm(int(seq), keep)
            if e.n_swa > 0 and e.seq_pos_min(int(seq)) > max(0, keep - e.n_swa):
                e.seq_rm(int(seq), -1)
                return 0
            return keep

    def layer_unions(self):
        """int64 ``[n_moe_layers]``: distinct experts routed per MoE layer, summed over forward passes since
        the last reset (the hook's count; None without the hook)."""
        u = self.engine.layer_unions()
        return np.asarray(u, np.int64) if len(u) else None

    # -- routes and router inputs ----------------------------------------------------------------
    def take_route(self, phase: int) -> None:
        """Move the routes the hook recorded in the last decode into :attr:`route_parts`."""
        flat = self.engine.take_route()
        probs = self.engine.take_route_probs()
        ubs = self.engine.take_route_ubatch()
        k = self.engine.route_k()
        if flat.size:
            e = flat.reshape(-1, self._n_layers, k)
            self.route_parts.append((e, np.full(e.shape[0], phase, np.uint8), ubs.astype(np.int32),
                                     probs.astype(np.float32).reshape(e.shape)))

    def routes(self, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Every recorded route: experts int32 ``[T, L, k]``, phase uint8 ``[T]``, ubatch int32 ``[T]``, and
        each selected expert's router probability float32 ``[T, L, k]`` (NaN where the graph gave none)."""
        parts = list(self.route_parts)
        if not parts:
            return (np.zeros((0, self._n_layers, k), np.int32), np.zeros(0, np.uint8), np.zeros(0, np.int32),
                    np.zeros((0, self._n_layers, k), np.float32))
        return (np.concatenate([p[0] for p in parts]).astype(np.int32), np.concatenate([p[1] for p in parts]),
                np.concatenate([p[2] for p in parts]).astype(np.int32), np.concatenate([p[3] for p in parts]))

    def capture_router_inputs(self, on: bool) -> None:
        """Record every MoE layer's router input (the hook's ``ffn_moe_*`` input rows) while decoding."""
        self.engine.set_capture_inputs(bool(on))

    def take_router_inputs(self) -> tuple[np.ndarray, int]:
        """The router inputs captured so far: (float32 flat ``[T * L * n_embd]``, n_embd)."""
        return self.engine.take_router_inputs()

    # -- what the engine reports -----------------------------------------------------------------
    def is_eog(self, token: int) -> bool:
        return bool(self.engine.is_eog(int(token)))

    def piece(self, token: int) -> bytes:
        """The bytes of one token (a piece may end inside a UTF-8 character)."""
        return self.engine.piece(int(token))

    def hook_stats(self) -> dict:
        """The hook's counters (native/engine/hook.h), cumulative since the last reset."""
        return dict(self.engine.hook_stats())

    @property
    def n_threads(self) -> int:
        return int(self.engine.n_threads)


__all__ = ["Decoder", "LOGITS_BLOCK_BYTES", "PHASE_PREFILL", "PHASE_DECODE"]
