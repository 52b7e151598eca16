"""Session: generation through stock llama.cpp with routed experts paged under a RAM budget.

The math is llama.cpp's own: the hook (native/engine/hook.cpp) only decides where the expert bytes
come from, so logits are bit-identical to ``pager=False`` (plain llama.cpp, mmap) at every
budget, policy and I/O thread count. See docs/DESIGN.md (paging mechanism, memory accounting).
"""
from __future__ import annotations

import dataclasses
import math
import numbers
import os
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from ..errors import EpqlabError, LlamaCppError
from ..layout import ModelLayout, inspect
from ..memory import auto_budget as budget_rule
from ..memory.usage import PeakTracker, cpu_threads, read_bytes, sample
from ..paging.pager import Pager, default_io_threads
from ..routes.log import RouteLog
from ..routes.policy_params import policy_params as policy_params_checked
from ..units import parse_bytes
from . import run_stats, state_file
from .arena_resize import MemoryFollower, resize_session
from .arena_sizing import plan_arena
from .batch import Batcher, BatchStream, Request
from .decoder import LOGITS_BLOCK_BYTES, Decoder
from .file_watch import FileWatch
from .generation import Generation, Stream
from .options import Options, check_options
from .perplexity import perplexity
from .sampling import Sampler
from .time_split import TimeSplitLog
from .tokens import token_array

DEFAULT_RESERVE = 64 * 2**20  # bytes kept free for Python, logits arrays and route logs


def _prefetch_header(lay: ModelLayout) -> None:
    """Read exactly the GGUF header of each file into the page cache (readahead(2) of
    [0, data_offset)), so llama.cpp's buffered header reads hit it instead of triggering the
    kernel's sequential readahead (read_ahead_kb, often MiBs) into tensor data the lazy load
    does not want."""
    for path, data_offset in zip(lay.files, lay.data_offsets):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, data_offset, os.POSIX_FADV_WILLNEED)
        finally:
            os.close(fd)


def _resolve_budget(ram_budget, arena_bytes, lay: ModelLayout, paged: bool):
    """``(AutoBudget or None, budget bytes or None)``: ``"auto"``, and None for a paged model larger than
    what auto allows, take :func:`epqlab.memory.auto_budget.auto_budget`'s rule; a budget given in bytes must
    fit the machine (:func:`~epqlab.memory.auto_budget.check_budget`: BudgetTooLargeError)."""
    if isinstance(ram_budget, str) and ram_budget.strip().lower() == "auto" or (
            ram_budget is None and arena_bytes is None and paged):
        ab = budget_rule.auto_budget()
        if ram_budget is not None or sum(os.path.getsize(f) for f in lay.files) > ab.budget:
            return ab, ab.budget
    if ram_budget is None:
        return None, None
    budget = parse_bytes(ram_budget)
    budget_rule.check_budget(budget)
    return None, budget


def _check_follow(budget, max_ram_budget, follow_memory, paged: bool):
    """The most ``ram_budget`` a live resize may grow to (bytes), or None: ``max_ram_budget``, or the
    opening budget with ``follow_memory``. Raises ValueError for a bool that is not one, either knob
    without a pager or a budget, or ``max_ram_budget`` below ``ram_budget``."""
    if not isinstance(follow_memory, bool):
        raise ValueError(f"follow_memory must be True or False, got {follow_memory!r}")
    if max_ram_budget is None and not follow_memory:
        return None
    what = "follow_memory=True (--follow-memory)" if max_ram_budget is None else "max_ram_budget (--max-ram-budget)"
    if not paged or budget is None:
        raise ValueError(f"{what} needs a paged Session with ram_budget (bytes or 'auto'): the arena follows the budget")
    if max_ram_budget is None:
        return budget
    mx = parse_bytes(max_ram_budget)
    if mx < budget:
        raise ValueError(f"max_ram_budget {mx} bytes is below ram_budget {budget} bytes; give max_ram_budget >= ram_budget")
    budget_rule.check_budget(mx)
    return mx


def _open_engine(lay: ModelLayout, o: Options, record: bool, predictor_owned: bool = False):
    """Load the model and create its context (native ``Engine``); returns ``(engine, load seconds,
    load report, used_before_arena bytes)``: the resident set once the model, its dense weights and the
    context exist, plus what malloc handed out but nobody touched yet. ``predictor_owned``: the trained
    predictor was loaded here from a path, so its NumPy copy, freed once the hook holds its own, is
    not counted. Raises LlamaCppError."""
    from .native import core  # llama.cpp and the engine load with the first Session (docs/DESIGN.md §1)

    names = [(t.name, li, ti) for li, l in enumerate(lay.layers) for ti, t in enumerate(l.tensors)]
    files = [str(f) for f in lay.files] if lay.n_files > 1 else []
    core.malloc_release()  # an earlier load's freed heap must not count as in use, nor be reused unseen
    before, io0, m0 = sample(), read_bytes(), core.malloc_bytes()
    t0 = time.perf_counter()
    if o.dense_weights != "mmap":
        _prefetch_header(lay)
    try:
        # n_ctx is per sequence: one KV stream of n_ctx cells for each of the n_seq_max sequences
        engine = core.Engine(str(lay.path), None, lay.architecture, o.expert_override, o.n_ctx * o.n_seq_max, o.n_batch,
                             o.n_ubatch, int(o.n_threads or cpu_threads()), (o.paged or record) and lay.is_moe,
                             lay.moe_layers, names, record, o.dense_mode, [(off, n) for _, off, n in lay.dense_tensors],
                             files, list(lay.dense_files) if files else [], o.n_seq_max, False, LOGITS_BLOCK_BYTES,
                             o.speculative == "mtp", o.draft_max)
    except RuntimeError as e:
        # llama.cpp's refusals (no memory for the KV cache, a file it cannot load) and the lazy
        # load's (no relocations, mlock limit): one EpqlabError class naming the cause.
        raise LlamaCppError(str(e)) from None
    load_s = time.perf_counter() - t0
    io1 = read_bytes()
    report = dict(engine.load_report())
    report["load_bytes_read"] = io1 - io0 if io0 is not None and io1 is not None else None
    freed = 0
    if o.prefetch == "trained":
        # the hook's own copy (W in its weight_type) is made before the budget's sample, so it is counted; a
        # NumPy copy loaded from a path is freed right after (Session.__init__), so it is not
        engine.set_predictor(o.predictor.W, o.predictor.b, o.predictor.weight_type)
        if predictor_owned:
            freed = o.predictor.W.nbytes + o.predictor.b.nbytes
    after = sample()
    # malloc'd but not yet touched (not in RSS yet, but it will be: llama.cpp's compute buffers are touched by the
    # first large ubatch): what malloc handed out beyond the RSS growth that malloc's blocks account for. The dense
    # weights' anonymous pages are mapped outside malloc (native/engine/dense_weights.cpp), so their RSS is not
    # malloc's; counting it there hid up to the dense bytes of untouched buffers (a 512-token prefill of Laguna-S
    # at 4 GiB then outgrew its budget by ~190 MiB and was OOM-killed).
    dense_anon = int(report.get("dense_bytes") or 0) if o.dense_weights != "mmap" else 0
    malloc_rss = max(0, (after.rss_anon - before.rss_anon) - dense_anon)
    # less what llama.cpp's schedulers malloc for split-input copies that a CPU-only graph never writes
    # (native/engine/engine.cpp sched_idle; ~464 MiB per context on the 35B shape, docs/DESIGN.md §5)
    untouched = max(0, (core.malloc_bytes() - m0) - malloc_rss - int(report.get("sched_idle_bytes") or 0))
    return engine, load_s, report, max(0, after.total - freed) + untouched


class Session:
    """A MoE GGUF loaded in llama.cpp with its routed experts paged from disk.

    Args:
        model: path to a MoE GGUF, or to the first (or any) shard of a split one (``NAME-00001-of-0000N.gguf``:
            every shard is paged from its own file, see :func:`epqlab.inspect`).
        ram_budget: ``None`` (arena holds every routed expert, unless the model file is larger than
            ``"auto"`` allows: then ``"auto"``), bytes, a string like ``"4GiB"``, or ``"auto"``: the
            cgroup limit or MemAvailable minus a margin (:mod:`epqlab.memory.auto_budget` states the
            rule; ``session.auto_budget`` says what it chose, None when not used).
            The budget bounds the whole resident set of the process, RssAnon + RssShmem +
            RssFile (dense weights, arena, KV cache, compute buffers, heap, libraries): what a
            memory cgroup charges. The arena is sized after the model, its dense weights and the
            context exist: budget - measured usage - ``reserve`` - the staging buffer (see
            ``n_ubatch``) when not every expert fits. Everything allocated later is bounded by
            design (logits come in blocks of at most 16 MiB, see :meth:`iter_logits`) and fits
            in the reserve. ``stats["memory"]`` reports each part. :meth:`resize` changes it later.
        policy_params: the eviction policy's parameters by name over their defaults, e.g. ``{"half_life": 64}``
            for ``"heat"`` (:func:`epqlab.routes.policy_params.policy_params` names each one's range and source).
            ``{"admit": "stage"}`` with ``"wtinylfu"``, ``"2q"`` or ``"s3fifo"``: a miss the policy refuses is used from the staging buffer
            without a slot (needs ``arena_bytes``: under ``ram_budget`` staging borrows arena slots; ValueError).
        max_ram_budget: the largest budget :meth:`resize` may grow to (default: the opening budget);
            the arena's slots above the opening budget hold no memory until a resize gives them out.
        follow_memory: re-read what ``"auto"`` reads, and Linux PSI, between decode steps; shrink the arena
            when headroom falls below the margin or memory stalls rise, grow back slowly when headroom
            returns, never above the opening budget (or ``max_ram_budget``) nor below the smallest that
            opens (:mod:`epqlab.engine.arena_resize` states the rule and its constants). Each resize is in
            :attr:`resize_events` and ``stats()["resizes"]``.
        reserve: bytes kept out of the arena for growth (default 64 MiB).
        dense_weights: where the non-expert weights live while paging: ``"anon"`` (default when
            paging: the load reads only the GGUF header and the dense tensors, into anonymous
            memory, so nothing of the model file stays in the page cache), ``"mlock"`` (the same,
            locked in RAM; raises if RLIMIT_MEMLOCK is too small) or ``"mmap"`` (llama.cpp's own
            file mapping; the stock loader reads the whole file; default with ``pager=False``).
        policy: eviction policy, one of :data:`epqlab.constants.ONLINE_POLICIES` (``lru`` | ``ls`` |
            ``ls_pos`` | ``lfu`` | ``static`` | ``fnu`` | ``lfuda`` | ``heat`` | ``arc`` | ``2q`` | ``sieve`` |
            ``s3fifo`` | ``wtinylfu`` | ``coact`` | ``lirs``; each rule and its source: :class:`epqlab.Pager`).
        hot_experts: with ``policy="static"``: int ``[n, 2]`` (GGUF block, expert) pairs kept unless
            nothing else can be evicted (:func:`epqlab.studies.ablation.hot_experts` picks them from a
            calibration route log; ``session.pager.set_hot`` sets them later). Without them
            ``static`` is LRU.
        expert_used: override top-k in the graph (GGUF kv override) and the pager together.
        io_threads: pager reader threads (default 3 x compute threads).
        n_threads: compute threads (default: usable CPUs).
        n_ctx, n_batch, n_ubatch: context size of each sequence and llama.cpp's batch sizes (tokens);
            n_ctx below :data:`~epqlab.constants.MIN_N_CTX` (256) is refused (llama.cpp would silently raise it);
            llama.cpp pads it up to a multiple of 256 (``session.n_ctx`` is the padded context, which prompts are
            checked against) and caps n_batch at n_ctx x n_seq_max.
        n_seq_max: sequences decoded side by side (:meth:`generate_batch`, the server's continuous
            batching; :mod:`epqlab.engine.batch`): each has its own KV stream of ``n_ctx`` cells, so the
            KV cache (inside ``ram_budget``) grows with it. 1 (default): one sequence at a time. A ubatch whose
            union of experts in a layer exceeds that layer's slots is *staged*: each of the
            layer's expert matrices in turn is copied (resident experts) or read (the others)
            into one buffer whose pages, under a ``ram_budget``, the arena lends (free slots
            first, then evicted residents; given back before the next load), same bytes, same
            graph (counted in ``staged_layers``, ``staged_bytes``, ``stage_lent_bytes``; see
            native/engine/hook.h and native/pager/pager.h).
        pager: ``False`` runs plain llama.cpp (mmap) for A/B comparisons.
        route_log: path; the routes of every decoded token are saved there as NPZ (docs/DESIGN.md)
            on :meth:`save_route_log` / :meth:`close`. While recording, prompts are decoded with
            logits for every token, so llama.cpp routes all of them through the last layer.
        stats_file: path; each generate() appends its run stats as one JSON line.
        time_split: measure the per-layer time split of decode (attention, experts, I/O wait, map:
            :meth:`time_split`; default True). It ends a graph piece after each MoE layer's last expert
            matmul in decode, one more thread-pool kick-off and barrier per layer (the router's top-k
            ends one in any case: the hook must see the choice before the matmuls);
            ``stats["decode_graph_pieces_per_pass"]`` counts them. False drops those pieces and the
            split (timing only: logits, hits and bytes are unchanged).
        direct_io: O_DIRECT reads (falls back to buffered where refused).
        skip_cold: ``None`` (default, off: logits bit-identical to plain llama.cpp) or a threshold
            tau >= 0 for the *lossy* skip-cold knob: in single-token decode steps, a selected expert
            that is not resident and whose router weight (the one llama.cpp multiplies its output
            by: the last of ``ffn_moe_weights[_softmax|_norm|_scaled]-<il>``) is below tau is not
            read and computes on zeros (zero pages; boundary pages shared with a resident
            neighbour keep the neighbour's bytes). Its output is then weight x down(act(0)) = 0,
            except that expert biases (gpt-oss) still contribute. ``stats["cold_skipped"]``
            counts skipped experts. Prefill ubatches (more than one token) are never affected, so
            measure perplexity under it with ``n_batch=1``. Residency depends only on the arena's
            history, so results are reproducible (hence not with ``prefetch``). tau = 0 skips nothing.
        route_bias: ``None`` (default, off), ``"cache"`` or ``"batch"``. ``"cache"``: *lossy* cache-aware routing
            (colibri CACHE_ROUTE, colibri issue #258; arXiv 2412.00099). In decode steps (each token of a
            batched step on its own), each selected expert that is not resident is replaced by the resident
            expert of that layer with the highest router probability that the token does not already use,
            when its probability is less than ``route_delta`` below the original's. ``"batch"``: batch-aware
            routing (after Opportunistic Expert Activation, arXiv 2511.02237): the same, but an expert another
            token of the step already uses counts as available too, so a token stops being the only reason an
            expert is read (with one sequence it is ``"cache"``); the combination weights are then the router's own
            probabilities of the experts actually used, normalized as the architecture does
            (llama.cpp's graph computes them from the rewritten ids; native/engine/hook_lossy.h).
            Counters: ``route_substituted``, ``route_changed`` / ``lossy_slots`` (routing agreement
            = 1 - their ratio), ``lossy_bytes_saved``, ``lossy_union_before`` / ``lossy_union_after`` (distinct
            experts per (step, layer), summed). Not with ``skip_cold`` or ``prefetch``.
        route_delta: the margin of ``route_bias`` (router probability, 0..1); 0 substitutes
            nothing (logits bit-identical to off).
        expert_budget: ``None`` (default, off) or N >= 1: *lossy* union budget (colibri EXPERT_BUDGET, colibri
            issue #220; MoE-Spec arXiv 2602.16052): a decode step uses at most N distinct experts per MoE layer
            across its tokens; the experts kept are the resident ones first, then those of highest aggregate router
            probability over the step's tokens; a token's slots outside them are dropped (weight 0, the kept
            weights renormalized as the architecture does), and a token left with none keeps its best one
            (``budget_overflow``). Applied after ``adaptive_k`` and ``route_bias``. N >= the step's union changes
            nothing; N above n_expert is taken as n_expert. With one sequence it caps a token's own top-k. Counters ``budget_dropped``, ``budget_overflow``, ``lossy_union_before/after``. Not with
            ``skip_cold`` or ``prefetch``.
        adaptive_k: ``None`` (default, off), ``True`` or ``(thresholds, ks)``: *lossy* entropy-adaptive
            top-k (DOI 10.5281/zenodo.18282008, TensorRT-LLM PR #10672): in decode steps (each token of a batched step),
            per layer, k = ks[i] for the first threshold with H < thresholds[i] (H: entropy in nats of
            the router's softmax probabilities), else ks[-1]; default 1 if H < 0.6, 2 if H < 1.2, else 4;
            capped by the graph's k (``expert_used``). llama.cpp's graph keeps its fixed k: dropped
            slots repeat the best kept expert with weight 0 (nothing extra read; the kept weights
            renormalized as the architecture does). :meth:`adaptive_k_per_layer` gives the mean k.
            Not with ``skip_cold``.
        speculative: ``None`` (default) or ``"mtp"``: speculative decoding with the model's own MTP block (llama.cpp's
            ``--spec-type draft-mtp``; :mod:`epqlab.engine.speculative` states the loop): an MTP draft context over the
            same model drafts up to ``draft_max`` tokens, one target pass verifies them, and each is accepted while the
            request's sampler, run on the verify rows in order, picks it. Greedy output equals non-speculative greedy
            output up to the floating-point differences of a multi-row pass (~1e-3 in the logits), so a near-tie can
            resolve differently. The MTP block's routed experts are paged in the same arena, inside the same budget.
            :meth:`generate`, :meth:`stream`, ``create_completion`` / chat (:class:`epqlab.Session`) with one prompt
            and ``n=1``, and the server speculate, one sequence at a time (``n_seq_max=1``; the server serves such
            requests in turn and refuses several choices); :meth:`generate_batch` and several choices in-process
            decode without speculation. Needs ``n_ubatch >= draft_max + 2``. Run stats: ``spec_drafted``, ``spec_accepted``,
            ``spec_acceptance`` (accepted / drafted), ``spec_mean_accepted`` (per verify pass),
            ``spec_accepted_per_pos`` (accepted drafts per draft position), ``spec_verify_steps`` (verify passes),
            ``spec_plain_steps`` (target passes without a draft), ``spec_draft_passes`` (MTP draft passes),
            ``spec_draft_s`` / ``spec_verify_s`` / ``spec_catchup_s`` (wall time of the draft passes, the target passes
            and the MTP catch-up passes, s) and, with the pager, ``spec_verify_union`` (distinct experts per trunk
            layer and target pass) and ``spec_mtp_union`` (per MTP pass). Not with ``prefetch``, ``route_log`` or a
            lossy knob.
        draft_max: with ``speculative``: most tokens drafted per verify pass, 1..8 (default 3, llama.cpp's
            ``--spec-draft-n-max``).
        draft_p_min: with ``speculative``: a draft stops at a token whose probability among the MTP head's 10 best
            is below this (default 0, llama.cpp's ``--draft-p-min``).
        arena_bytes: size the arena directly (bytes or "256MiB"), ignoring ``ram_budget``; for
            experiments that fix the arena rather than the process budget.
        prefetch: ``None`` (default) or a next-layer predictor, ``"lookahead"`` | ``"previous"`` |
            ``"union"`` | ``"trained"``, or the study ceiling ``"oracle"`` (:mod:`epqlab.engine.prefetch`); timing only,
            logits unchanged. Not with ``skip_cold``.
        prefetch_predictor: with ``prefetch="trained"``: an :class:`epqlab.engine.predictor.ExpertPredictor`
            fitted on this model, or the path of one saved with ``.save``; with ``"oracle"``: the route
            log (RouteLog or path) of an earlier run with the same prompt and calls.
        prefetch_budget: with a predictor: at most this many bytes (int or "64MiB") prefetched per layer.
        prefetch_depth: with a predictor: layers ahead it prefetches, 1 (default, the next layer) .. 8
            (a trained predictor: up to the depth it was fitted for, at most 4).
        prefetch_min_precision: with a predictor: the gate (:mod:`epqlab.engine.prefetch`), in [0, 1]; default 0.5,
            0 reads every prediction.
        read_rate_limit: bench knob, bytes per second (int or "350MB"): expert reads are served as by a
            device of that speed with no burst credit (:attr:`epqlab.Pager.read_rate_limit`); None = the disk as it is.
        expert_addressing: how the expert matmuls find a resident expert (docs/DESIGN.md §3f). ``"slots"``:
            ggml reads the arena's slots in place and each matmul gets the slot of every selected expert, so a
            load or an eviction changes no mapping (no mmap, no page-table zap, no TLB shootdown); needs expert
            slices that are whole pages, at least top-k slots in every slot class (a layer then uses only its own
            class's slots), the arena prefaulted and no ``skip_cold``.
            ``"region"``: each resident expert is mapped at its own offset of the tensor (an mmap per load, a
            zap per eviction). ``"auto"`` (default): slots where possible, else region; the choice is
            :attr:`expert_addressing` and ``stats()["expert_addressing"]``. Logits are the same either way.
        io_uring: read experts through io_uring into registered arena buffers (default False; docs/DESIGN.md §3e):
            the arena's pages are pinned once instead of by every read. Beside 629 MB/s of reads it left plain
            llama.cpp's decode 5% slower where pread left it 12-18% slower, but paged decode on the 35B-A3B shape
            did not gain from it (8 GiB with the trained prefetch 113 against 116 ms/token, 4 GiB without
            prefetch 211 against 194; bench/README.md), so it is off by default. Falls back to pread, with the
            reason in ``stats()["io_uring"]``, where the kernel refuses (before 5.19, io_uring disabled,
            ``ulimit -l`` too low without CAP_IPC_LOCK) or the arena is not prefaulted. The kernel keeps 16 bytes
            per arena page for the registration (22 MB at a 5.4 GiB arena), outside the budget.
        read_segment_bytes: split each expert slice read on a miss into segments of this many bytes
            spread over the I/O threads (``None``/0: one read per slice).
        pipeline_reads: queue a layer's missing experts' reads matrix by matrix in the order the graph
            computes them, and let each expert matmul wait only for its own matrix, so the later
            matrices' reads overlap the matmuls before them (decode steps, batch steps and prefill
            ubatches whose union fits the layer's slots; ``False``: the router's callback reads all
            of a layer's misses first). Timing only:
            logits, requests, hits and evictions are unchanged. Default ``None``: on unless
            ``skip_cold`` is set (the two are exclusive). bench/bench_overlap.py: 339-379 vs
            427-474 ms/token on an 8.27 GiB synthesized model in a 1.5 GiB cgroup (fast disk);
            on the default model at a 6 MiB arena a wash (46 vs 44 ms/token, medians of 5).

    Raises:
        ModelNotFoundError, NotGGUFError, TruncatedModelError, SplitModelError (broken shard set), NotMoEError: bad
            model file.
        ValueError: ``expert_used`` outside 1..n_expert, unknown policy, an unknown ``expert_addressing``,
            ``expert_addressing="slots"`` where it is not possible (the message says why) or with ``skip_cold``,
            bad sizes, ``n_ctx`` below :data:`~epqlab.constants.MIN_N_CTX`, thread counts
            that are not integers in 1..512 (n_threads, ggml's limit) or 1..1024 (io_threads), an
            unknown ``prefetch`` predictor or ``prefetch`` with ``skip_cold`` (:func:`epqlab.engine.prefetch.check_prefetch`),
            ``pipeline_reads`` with ``skip_cold`` or without the pager, a predictor that does not fit
            (:func:`epqlab.engine.prefetch.resolve_predictor`), ``prefetch="oracle"`` without ``route_log``; lossy
            knobs that conflict or are malformed (:func:`epqlab.engine.options.check_lossy`: ``route_bias`` with
            ``skip_cold`` or ``prefetch``, ``expert_budget`` with ``skip_cold`` or ``prefetch`` or not an integer >= 1,
            ``adaptive_k`` with ``skip_cold``, ``route_delta`` without ``route_bias``
            or outside 0..1, an adaptive k outside 1..n_expert), ``skip_cold`` that is not a router weight (a bool,
            or outside 0..1, or 0..``expert_weights_scale`` where the model scales its weights), and ``skip_cold``
            with ``n_seq_max > 1``: it acts on single-token forward passes only (docs/DESIGN.md §3a), so batched
            decode would silently be exact.
        RouteLogError: ``prefetch="oracle"`` with a file that is not a route log with ubatch ids.
        ArenaTooSmall: the budget cannot hold one layer's top-k experts beside what is already used;
            the message states the smallest budget that works.
        LlamaCppError: llama.cpp could not load the model or create the context (its own error
            lines in the message), or the lazy load could not start (see ``dense_weights``).
    """

    def __init__(self, model, *,
                 # what to load and how much memory it may use
                 ram_budget=None, reserve=None, arena_bytes=None, pager: bool = True, dense_weights: str | None = None,
                 max_ram_budget=None, follow_memory: bool = False,
                 # eviction and top-k
                 policy: str = "lru", policy_params: dict | None = None, hot_experts=None, expert_used: int | None = None,
                 # the llama.cpp context and its threads
                 n_ctx: int = 2048, n_batch: int = 512, n_ubatch: int = 512, n_seq_max: int = 1,
                 n_threads: int | None = None,
                 # expert reads
                 io_threads: int | None = None, direct_io: bool = True, read_segment_bytes=None,
                 pipeline_reads: bool | None = None, read_rate_limit=None, expert_addressing: str = "auto",
                 io_uring: bool = False,
                 # prefetch (timing only) and the lossy skip-cold knob
                 prefetch: str | None = None, prefetch_predictor=None, prefetch_budget=None, prefetch_depth: int = 1,
                 prefetch_min_precision: float | None = None, skip_cold: float | None = None,
                 # the lossy routing knobs (off by default)
                 route_bias: str | None = None, route_delta: float | None = None, adaptive_k=None,
                 expert_budget: int | None = None,
                 # speculative decoding with the model's MTP block
                 speculative: str | None = None, draft_max: int | None = None, draft_p_min: float | None = None,
                 # what is written down
                 route_log=None, stats_file=None, time_split: bool = True):
        # A dense GGUF is accepted with pager=False (plain runs, perplexity baselines).
        self.layout: ModelLayout = inspect(model, require_moe=bool(pager) or route_log is not None)
        lay = self.layout
        o = check_options(lay, policy=policy, expert_used=expert_used, io_threads=io_threads, n_threads=n_threads,
                          n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_ubatch, n_seq_max=n_seq_max, pager=pager,
                          route_log=route_log,
                          dense_weights=dense_weights, hot_experts=hot_experts, skip_cold=skip_cold, prefetch=prefetch,
                          prefetch_budget=prefetch_budget, prefetch_depth=prefetch_depth,
                          prefetch_min_precision=prefetch_min_precision, prefetch_predictor=prefetch_predictor,
                          read_segment_bytes=read_segment_bytes, pipeline_reads=pipeline_reads,
                          read_rate_limit=read_rate_limit, route_bias=route_bias, route_delta=route_delta,
                          adaptive_k=adaptive_k, expert_budget=expert_budget, expert_addressing=expert_addressing, io_uring=io_uring,
                          speculative=speculative, draft_max=draft_max, draft_p_min=draft_p_min)
        self.options = o
        # checked before the model loads: ValueError naming the parameter and its range
        self.policy_params = policy_params_checked(o.policy, policy_params) if o.paged else {}
        self.speculative, self.draft_max, self.draft_p_min = o.speculative, o.draft_max, o.draft_p_min
        self.mtp_blocks = list(lay.mtp_moe_layers) if o.speculative else []
        if o.speculative:  # the MTP block's experts are paged in the same arena (epqlab/engine/speculative.py)
            self.layout = lay = lay.with_mtp()
        self.expert_addressing = "region" if o.paged else None  # resolved when the pager is attached
        self.io_uring = None  # likewise: "registered buffers" or "off: <why>"
        self.route_bias, self.route_delta, self.adaptive_k = o.route_bias, o.route_delta, o.adaptive_k
        self.expert_budget = o.expert_budget
        self.policy, self.n_expert_used, self.paged, self.dense_weights = o.policy, o.n_expert_used, o.paged, o.dense_weights
        self.skip_cold, self.prefetch, self.pipeline_reads = o.skip_cold, o.prefetch, o.pipeline_reads
        self.read_segment_bytes, self.read_rate_limit = o.read_segment_bytes, o.read_rate_limit
        self.route_log_path = Path(route_log) if route_log else None
        self.stats_file = Path(stats_file) if stats_file else None
        for out, atomic in ((self.stats_file, False), (self.route_log_path, True)):  # appended; written whole
            if out is not None:
                run_stats.check_writable(out, atomic=atomic)  # before the model loads, not after a generation
        self.auto_budget, self.budget_bytes = _resolve_budget(ram_budget, arena_bytes, lay, o.paged)
        self.max_budget_bytes = _check_follow(self.budget_bytes, max_ram_budget, follow_memory, o.paged)
        self.reserve_bytes = parse_bytes(reserve) if reserve is not None else DEFAULT_RESERVE
        self._pager: Pager | None = None
        self.resize_events: list = []  # arena_resize.ResizeEvent, in order
        self._follower = None
        self.peak = PeakTracker()
        self.runs: list[dict] = []
        # speculative requests of a server take turns on the one sequence (epqlab/requests/completion_run.py); a plain
        # lock: a streamed request's iterator may end on another thread than the one that started it
        self.serial_turn = threading.Lock()
        self.time_split_log = TimeSplitLog(lay.moe_layers if lay.is_moe else [])
        record = self.route_log_path is not None
        # no local name holds the engine: a refusal's traceback (ArenaTooSmall below) must not keep the model alive
        watch = FileWatch(lay.files)  # the inodes llama.cpp and the pager open next (docs/DESIGN.md §4)
        opened = _open_engine(lay, o, record,
                              predictor_owned=o.prefetch == "trained" and prefetch_predictor is not o.predictor)
        self.load_s, self.load_report, self.used_before_arena = opened[1:]
        self.decoder = Decoder(opened[0], watch, len(lay.layers), record_routes=record, on_step=self._on_step)
        del opened
        if not isinstance(time_split, bool):
            self.decoder.close()
            raise ValueError(f"time_split must be True or False, got {time_split!r}")
        self.decoder.engine.set_timing(time_split)
        if o.prefetch == "trained":  # the hook holds its own copy; ours (loaded from a path) is freed
            o = self.options = dataclasses.replace(o, predictor=None)
        self.stage_reserve = 0
        self.read_buffer_bytes = 0
        if o.paged:
            try:
                self._attach_pager(o, arena_bytes, direct_io, hot_experts)
            except Exception:
                self.decoder.close()
                raise
            if follow_memory:
                self._follower = MemoryFollower(self).start()
        self.n_vocab, self.n_ctx, self.n_batch = self.decoder.n_vocab, self.decoder.n_ctx, self.decoder.n_batch
        self.n_seq_max = int(self.decoder.engine.n_seq_max)
        self.peak.update()

    def _attach_pager(self, o: Options, arena_bytes, direct_io: bool, hot_experts) -> None:
        """Size the arena from the budget (:func:`~epqlab.engine.arena_sizing.plan_arena`), make the
        :class:`Pager` and hand it to the hook with the paging options. Raises ArenaTooSmall."""
        lay = self.layout
        io_threads = o.io_threads or default_io_threads()
        plan = plan_arena(lay, o.n_expert_used, budget=self.budget_bytes, used_before_arena=self.used_before_arena,
                          reserve=self.reserve_bytes, dense_bytes=int(self.load_report.get("dense_bytes", 0)),
                          arena_bytes=arena_bytes, io_threads=io_threads, n_ctx=o.n_ctx, n_seq=o.n_seq_max)
        self.read_buffer_bytes, self.stage_reserve = plan.read_buffers, plan.stage_reserve
        capacity = None
        if self.max_budget_bytes is not None and arena_bytes is None:  # room for resize to grow into
            capacity = max(plan.arena, min(Pager.all_experts_bytes(lay), plan_arena(
                lay, o.n_expert_used, budget=self.max_budget_bytes, used_before_arena=self.used_before_arena,
                reserve=self.reserve_bytes, io_threads=io_threads).arena))
        if self.policy_params.get("admit") == "stage" and plan.stage_lend:
            raise ValueError("policy_params admit='stage' reads a refused expert into the staging buffer beside the arena, "
                             "but under ram_budget a staged matrix borrows arena slots (stage lending), evicting what "
                             "admission kept: give arena_bytes with it")
        self._pager = Pager(lay, plan.arena, policy=o.policy, io_threads=io_threads, direct_io=direct_io,
                            n_expert_used=o.n_expert_used, capacity_bytes=capacity,
                            policy_params=self.policy_params)
        self._pager.native.stage_lending = plan.stage_lend
        why = self._pager.native.set_slot_addressing(o.expert_addressing != "region")
        if why and o.expert_addressing == "slots":
            raise ValueError(f"expert_addressing='slots' is not possible for {lay.path.name}: {why}; "
                             "use expert_addressing='auto' (or 'region')")
        self.expert_addressing = "slots" if self._pager.native.slot_addressed else "region"
        # after slot addressing (the slots' layout is final) and before any read
        why = self._pager.native.use_io_uring() if o.io_uring else "io_uring=False"
        self.io_uring = "registered buffers" if not why else f"off: {why}"
        if hot_experts is not None:
            self._pager.set_hot(hot_experts)
        self.decoder.engine.attach_pager(self._pager.native)
        if o.skip_cold is not None:
            self.decoder.engine.set_skip_cold(o.skip_cold)
        if o.route_bias is not None:
            self.decoder.engine.set_route_bias(o.route_delta, o.route_bias == "batch")
        if o.expert_budget:
            self.decoder.engine.set_expert_budget(o.expert_budget)
        if o.adaptive_k is not None:
            self.decoder.engine.set_adaptive_k(list(o.adaptive_k[0]), list(o.adaptive_k[1]))
        self.decoder.engine.set_prefetch(*o.prefetch_args)
        if o.prefetch == "oracle":
            self.decoder.engine.set_oracle(*o.predictor)  # a few KiB: steps x layers x k int32
        self.decoder.engine.set_pipeline(o.pipeline_reads)
        self._pager.native.read_segment_bytes = o.read_segment_bytes
        self._pager.read_rate_limit = o.read_rate_limit
        self.peak = PeakTracker(lambda: self._pager.arena_resident_bytes if self._pager else 0,
                                lambda: self._pager.fill_bytes if self._pager else 0)

    def _on_step(self) -> None:
        if self._follower is not None:
            self._follower.look()
        self.peak.update()

    def save_state(self, path) -> int:
        """Save what the context holds for the last generation (its tokens' KV cells, or recurrent state) to
        ``path``, atomically (:mod:`epqlab.engine.state_file`: checksummed, tied to this model and context). A Session
        of the same model and settings resumes from it with :meth:`load_state`, then ``generate(prompt, reuse_kv=True)``
        for a prompt that extends the saved tokens. Returns the file's size in bytes.

        Raises:
            EpqlabError: nothing to save (the context is empty), or ``speculative="mtp"`` (the draft context is not
                saved).
            OSError: ``path`` cannot be written (nothing is left behind).
        """
        d = self.decoder
        with d.lock:
            d.check_open()
            if self.speculative:
                raise EpqlabError("save_state is not available with speculative='mtp' (the draft context's state is not saved)")
            if not d.kv:
                raise EpqlabError("nothing to save: the context is empty (generate first)")
            tokens, blob = list(d.kv), d.engine.seq_state(0)
        return state_file.write(Path(path), state_file.identity(self), tokens, [], blob)

    def load_state(self, path) -> list[int]:
        """Restore a :meth:`save_state` file into this Session's context; returns the token ids it holds. The next
        ``generate(prompt, reuse_kv=True)`` whose prompt extends them decodes only the rest.

        Raises:
            StateFileError: the file is not a state file, truncated or corrupt, or was saved for another model or
                context (model file, n_ctx, n_batch, n_ubatch, top-k, a lossy knob); the context is then empty.
            EpqlabError: ``speculative="mtp"``, or llama.cpp refused the state.
            OSError: ``path`` cannot be read.
        """
        d = self.decoder
        e = state_file.read_header(Path(path), state_file.identity(self))
        blob = state_file.read_state(e)
        with d.lock:
            d.check_open()
            if self.speculative:
                raise EpqlabError("load_state is not available with speculative='mtp'")
            d.begin()  # a new operation: the context is cleared
            if not d.engine.set_seq_state(0, blob):
                raise EpqlabError(f"llama.cpp refused the state in {path} (llama_state_seq_set_data returned 0)")
            d.kv = list(e.tokens)
        return list(e.tokens)

    @property
    def memory_follower(self):
        """The :class:`~epqlab.engine.arena_resize.MemoryFollower` of ``follow_memory=True``, else None."""
        return self._follower

    def resize(self, ram_budget):
        """Shrink or grow the arena to what ``ram_budget`` (bytes or "6GiB") buys, between decode steps
        (a batched step or a prefetch in flight finishes first). Shrinking evicts by the Session's
        policy and gives the pages back to the OS at once (a memory cgroup's usage falls); growing adds
        slots. Logits stay bit-identical to ``pager=False`` across any sequence of resizes
        (tests/test_resize.py). The arena is sized by the rule the Session opened with
        (:func:`~epqlab.engine.arena_sizing.plan_arena`); docs/DESIGN.md §5 "Resizing the arena".
        Returns the :class:`~epqlab.engine.arena_resize.ResizeEvent` (also kept in :attr:`resize_events`).

        Raises:
            ArenaTooSmall: the budget cannot hold one layer's top-k experts (the same quote ``Session`` gives).
            ValueError: no pager or no ``ram_budget`` at open; a budget above what the Session made room
                for (open it with ``max_ram_budget``).
            BudgetTooLargeError: a budget larger than the machine (``ram_budget``'s check).
        """
        budget_rule.check_budget(parse_bytes(ram_budget))
        return resize_session(self, ram_budget)

    # -- tokens --------------------------------------------------------------------------------
    def tokenize(self, text: str | bytes, add_special: bool = True, parse_special: bool | None = None, *,
                 add_bos: bool | None = None, special: bool | None = None) -> list[int]:
        """Token ids of ``text`` (BOS added when the model asks for it and ``add_special``).

        Also takes llama-cpp-python's form ``tokenize(text: bytes, add_bos=True, special=False)``:
        positionally the same, ``add_bos`` / ``special`` accepted as names for ``add_special`` /
        ``parse_special``. ``parse_special`` (special-token text such as ``<|im_start|>`` becomes that
        token) defaults to True for str and, as in llama-cpp-python, False for bytes. Raises
        TypeError for anything but str / bytes, UnicodeDecodeError for bytes that are not UTF-8, ValueError for
        a str with a lone surrogate."""
        self.decoder.check_open()
        if add_bos is not None:
            add_special = add_bos
        if special is not None:
            parse_special = special
        if isinstance(text, (bytes, bytearray)):
            text = bytes(text).decode("utf-8")
            if parse_special is None:
                parse_special = False
        elif not isinstance(text, str):
            raise TypeError(f"tokenize takes a str or UTF-8 bytes, got {type(text).__name__}")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:  # a lone surrogate (e.g. "\ud800" from JSON): not text llama.cpp can take
            raise ValueError(f"the text is not valid Unicode at position {e.start} ({text[e.start:e.end]!r}, a lone "
                             "surrogate): remove it or pair it") from None
        if parse_special is None:
            parse_special = True
        return list(self.decoder.engine.tokenize(text, bool(add_special), bool(parse_special)))

    def detokenize(self, tokens: Sequence[int]) -> str:
        """Text of token ids (UTF-8, invalid sequences replaced)."""
        self.decoder.check_open()
        return b"".join(self.decoder.piece(t) for t in tokens).decode("utf-8", "replace")

    # -- decoding (the protocol: epqlab.engine.decoder) ------------------------------------------
    @property
    def closed(self) -> bool:
        return self.decoder.closed

    def iter_logits(self, tokens: Sequence[int]) -> Iterator[np.ndarray]:
        """Decode ``tokens`` from an empty context and yield their logits in order, as float32
        blocks ``[m, n_vocab]`` of consecutive positions with ``m * n_vocab * 4 <=
        LOGITS_BLOCK_BYTES`` (16 MiB; at least one token per block). Memory stays bounded however
        long ``tokens`` is (up to n_ctx); used by :func:`epqlab.engine.perplexity.perplexity`."""
        return self.decoder.iter_logits(tokens)

    def logits(self, tokens: Sequence[int]) -> np.ndarray:
        """Logits of every position of ``tokens`` from an empty context: float32 ``[n_tokens, n_vocab]``
        (the caller's memory: n_tokens x n_vocab x 4 bytes; :meth:`iter_logits` streams instead)."""
        d = self.decoder
        with d.lock:
            return d.decode(tokens, 0, True, 0, d.begin()[0])

    def greedy_trace(self, tokens: Sequence[int], n_predict: int) -> tuple[np.ndarray, np.ndarray, list[int]]:
        """Prefill ``tokens`` (one batch per n_batch) and decode ``n_predict`` greedy tokens one at a
        time, for A/B comparisons of the exact numbers.

        Returns:
            ``(prompt_logits, step_logits, generated)``: float32 ``[n_prompt, n_vocab]`` (every
            prompt position), float32 ``[n_predict, n_vocab]`` (the logits each generated token was
            chosen from), and the generated ids (end-of-generation tokens included).
        """
        d = self.decoder
        with d.lock:
            epoch, _ = d.begin()
            prompt_logits = d.decode(tokens, 0, True, 0, epoch)
            steps, out = [prompt_logits[-1]], []
            pos = len(tokens)
            for i in range(n_predict):
                tok = int(np.argmax(steps[-1]))
                out.append(tok)
                if i + 1 < n_predict:
                    steps.append(d.step(tok, pos, epoch))
                    pos += 1
            return prompt_logits, np.stack(steps), out

    def prompt_tokens(self, prompt, add_special: bool) -> list[int]:
        """Prompt ids of a str (tokenized) or a sequence of ids (checked). Raises TypeError for
        anything else, ValueError when empty."""
        if isinstance(prompt, str):
            toks = self.tokenize(prompt, add_special)
        elif isinstance(prompt, (bytes, bytearray)) or prompt is None or not hasattr(prompt, "__len__"):
            raise TypeError(f"prompt must be a str or a sequence of token ids, got {type(prompt).__name__}")
        else:
            toks = [int(t) for t in token_array(prompt)]
        if not toks:
            raise ValueError("empty prompt: pass some text or at least one token id")
        return toks

    def stream(self, prompt: str | Sequence[int], n_predict: int = 128, temperature: float = 0.0,
               seed: int | None = None, stop: Sequence[str] | None = None, add_special: bool = True, *,
               top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0, repeat_penalty: float = 1.0,
               reuse_kv: bool = False, forced: str | Sequence[int] | None = None,
               draft_accept: float | None = None, draft_seed: int | None = None) -> Stream:
        """Yield the text of each generated token as it is produced (greedy when temperature <= 0).

        Stops after ``n_predict`` tokens, at an end-of-generation token, or when the text contains
        one of ``stop`` (the stop string is not yielded). Tokens are picked by llama.cpp's sampler
        chain (:class:`epqlab.engine.sampling.Sampler`; here top-k/top-p/min-p default to off, so a
        temperature samples the plain softmax). ``reuse_kv`` keeps the previous call's KV entries
        when its tokens are a prefix of this prompt (default off: every run starts from an empty
        context, so its stats are comparable).

        ``forced`` (teacher-forced decode): a text (tokenized without BOS) or token ids fed one per
        decode step instead of the sampled token, ``min(n_predict, len(forced))`` steps, with no
        end-of-generation or stop check. Each step is an ordinary decode pass (same graph, hook, pager
        and stats; ``stats["teacher_forced"]`` is True), so timings and route statistics come from a
        real token sequence. Use it to time decode on a random-weight model, whose own greedy output
        repeats itself and routes alike token after token (hit rates far above a real model's).

        ``draft_accept`` (study mode of ``speculative="mtp"``, with ``forced``): the acceptance a, 0..1. Random
        weights draft nonsense, so acceptance is set: each draft token is the forced text's next token, replaced by
        a wrong one with probability 1 - a (``draft_seed``, an integer >= 0, default 0, seeds the choice), and
        accepted while it equals the text.
        The MTP draft passes, the verify passes and the rollbacks all run, so time and bytes are measured.

        Returns:
            a :class:`~epqlab.engine.generation.Stream`; once it ends, ``.result`` is the
            :class:`Generation` and ``.stats`` its run stats (as :meth:`generate` returns them).
        """
        self.decoder.check_open()
        if draft_accept is not None:
            if self.speculative is None or forced is None:
                raise ValueError("draft_accept is the study mode of speculative='mtp' with forced text: open the Session "
                                 "with speculative='mtp' and pass forced=...")
            if isinstance(draft_accept, bool) or not isinstance(draft_accept, numbers.Real) or not 0 <= draft_accept <= 1:
                raise ValueError(f"draft_accept is a probability in 0..1, got {draft_accept!r}")
        if draft_seed is not None:
            if draft_accept is None:
                raise ValueError("draft_seed seeds draft_accept's draws: give draft_accept too (or drop draft_seed)")
            if isinstance(draft_seed, bool) or not isinstance(draft_seed, numbers.Integral) or draft_seed < 0:
                raise ValueError(f"draft_seed must be an integer >= 0, got {draft_seed!r}")
        if isinstance(n_predict, bool) or not isinstance(n_predict, numbers.Integral):
            raise ValueError(f"n_predict must be an integer, got {n_predict!r}")
        if n_predict < 0:
            raise ValueError(f"n_predict must be >= 0, got {n_predict}")
        try:
            temperature = float(temperature)
        except (TypeError, ValueError):
            raise ValueError(f"temperature must be a number, got {temperature!r}") from None
        if not math.isfinite(temperature):
            raise ValueError(f"temperature must be finite (<= 0 for greedy), got {temperature}")
        toks = self.prompt_tokens(prompt, add_special)
        if forced is not None:
            if hasattr(forced, "__len__") and len(forced) == 0:
                raise ValueError("forced is empty: pass the text (or token ids) to feed, or None to sample")
            forced = self.prompt_tokens(forced, False)
        sampler = Sampler(self.n_vocab, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                          repeat_penalty=repeat_penalty, seed=seed)
        return Stream(self, toks, int(n_predict), sampler, stop, reuse_kv=reuse_kv, forced=forced,
                      draft_accept=None if draft_accept is None else (float(draft_accept), int(draft_seed or 0)))

    def generate(self, prompt: str | Sequence[int], n_predict: int = 128, temperature: float = 0.0,
                 seed: int | None = None, stop: Sequence[str] | None = None, add_special: bool = True,
                 **sampling) -> Generation:
        """Generate up to ``n_predict`` tokens after ``prompt`` (greedy when temperature <= 0;
        ``sampling``: the keyword options of :meth:`stream`).

        Returns:
            :class:`Generation` with the text, generated token ids, prompt ids and run stats
            (prefill_tok_s and decode_tok_s in tokens/s; ssd_bytes and ssd_bytes_per_token in bytes;
            io_wait_s in s; peak memory in bytes). Rates are named by scope, all for this run:
            ``hit_rate`` over every forward pass (prefill included), ``decode_hit_rate`` over the
            single-token decode passes, ``steady_hit_rate`` over the decode passes after the first 8
            (definitions in :mod:`epqlab.studies.ablation.grid`); ``decode_*`` per-token figures divide by
            ``decode_passes`` (n_gen - 1: the first token comes from the prefill).
            ``ssd_bytes`` counts the pager's expert reads; ``storage_read_bytes`` every byte the
            process fetched from storage during the run (``/proc/self/io``: dense-weight page
            faults under ``dense_weights="mmap"`` too), None where unavailable.
        """
        with self.decoder.lock:  # a whole generation at a time: concurrent callers wait their turn
            return self.stream(prompt, n_predict, temperature, seed, stop, add_special, **sampling).finish()

    # -- several sequences per forward pass (epqlab.engine.batch) --------------------------------
    def batch_requests(self, prompts, n_predict: int = 128, temperature: float = 0.0, seed: int | None = None,
                       stop: Sequence[str] | None = None, add_special: bool = True, *, top_k: int = 0,
                       top_p: float = 1.0, min_p: float = 0.0, repeat_penalty: float = 1.0) -> list[Request]:
        """One :class:`~epqlab.engine.batch.Request` per prompt (text or token ids), each with its own
        llama.cpp sampler chain; with ``seed`` s, prompt i samples with seed ``(s + i) mod 2**32`` (so
        copies of one prompt differ at a temperature). Raises ValueError / TypeError as :meth:`stream`."""
        self.decoder.check_open()
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
            raise TypeError("prompts must be a list of prompts (each a str or a list of token ids)")
        if not prompts:
            raise ValueError("no prompts: pass at least one")
        if isinstance(n_predict, bool) or not isinstance(n_predict, numbers.Integral) or n_predict < 0:
            raise ValueError(f"n_predict must be an integer >= 0, got {n_predict!r}")
        stops = list(stop or [])
        out = []
        for i, p in enumerate(prompts):
            toks = self.prompt_tokens(p, add_special)
            if len(toks) >= self.n_ctx:
                raise ValueError(f"prompt {i} has {len(toks)} tokens, which leaves no room in the context of "
                                 f"{self.n_ctx} (per sequence); shorten it or open the Session with a larger n_ctx")
            sd = None if seed is None else (int(seed) + i) % 2**32
            sampler = Sampler(self.n_vocab, temperature=float(temperature), top_k=top_k, top_p=top_p, min_p=min_p,
                              repeat_penalty=repeat_penalty, seed=sd)
            out.append(Request(toks, int(n_predict), sampler, stops, index=i))
        return out

    def batch_trace(self, prompts: Sequence, n_predict: int, *, max_batch: int | None = None) -> list[tuple]:
        """Greedy :meth:`generate_batch` keeping every logits row: per prompt ``(step_logits float32
        [n, n_vocab], generated ids)``, row i the logits token i was chosen from (the first from the
        prefill); for A/B comparisons of the exact numbers, as :meth:`greedy_trace` for one sequence."""
        reqs = self.batch_requests(prompts, n_predict, 0.0)
        for r in reqs:
            r.logits = []
        Batcher(self, max_batch).run(reqs)
        return [(np.stack(r.logits), list(r.out)) for r in reqs]

    def generate_batch(self, prompts: Sequence, n_predict: int = 128, temperature: float = 0.0,
                       seed: int | None = None, stop: Sequence[str] | None = None, add_special: bool = True, *,
                       max_batch: int | None = None, **sampling) -> list[Generation]:
        """Generate for every prompt with several sequences per forward pass (continuous batching,
        :mod:`epqlab.engine.batch`): at most ``max_batch`` (default :attr:`n_seq_max`) decode together; the
        others wait for a free sequence. Greedy at ``temperature`` <= 0; ``sampling``: top_k, top_p, min_p,
        repeat_penalty as :meth:`stream`; ``seed`` as :meth:`batch_requests`.

        Returns:
            one :class:`Generation` per prompt, in order; ``stats`` holds that sequence's figures
            (``n_gen``, ``prefill_s``, ``decode_s``, ``decode_tok_s``, ``decode_steps``, ``mean_batch``: tokens
            per step it shared) and ``batch``: the whole call's (:func:`epqlab.engine.run_stats.batch_stats`:
            aggregate ``decode_tok_s``, ``mean_batch``, ``union_per_layer`` (distinct experts per MoE layer per
            step), ``ssd_bytes_per_token``, ``steps`` with every step's record).
        """
        reqs = self.batch_requests(prompts, n_predict, temperature, seed, stop, add_special, **sampling)
        b = Batcher(self, max_batch)
        with self.decoder.lock:
            c0, t0 = run_stats.counters(self), time.perf_counter()
            gens = b.run(reqs)
            st = run_stats.batch_stats(self, b, reqs, c0, run_stats.counters(self), time.perf_counter() - t0)
        self.runs.append(st)
        if self.stats_file:
            run_stats.append_jsonl(self.stats_file, st)
        for g in gens:
            g.stats = {**g.stats, "batch": st}
        return gens

    def stream_batch(self, prompts: Sequence, n_predict: int = 128, temperature: float = 0.0,
                     seed: int | None = None, stop: Sequence[str] | None = None, add_special: bool = True, *,
                     max_batch: int | None = None, **sampling) -> BatchStream:
        """:meth:`generate_batch` as it happens: a :class:`~epqlab.engine.batch.BatchStream` of
        ``(prompt index, text piece)``; once exhausted ``.results`` holds the Generations (stats as
        :meth:`generate_batch`). Closing it early cancels the sequences still running."""
        reqs = self.batch_requests(prompts, n_predict, temperature, seed, stop, add_special, **sampling)
        b = Batcher(self, max_batch)
        c0, t0 = run_stats.counters(self), time.perf_counter()

        def end(bs):
            st = run_stats.batch_stats(self, b, reqs, c0, run_stats.counters(self), time.perf_counter() - t0)
            self.runs.append(st)
            for g in bs.results:
                if g is not None:
                    g.stats = {**g.stats, "batch": st}

        return BatchStream(b, reqs, on_end=end)

    @property
    def model_name(self) -> str:
        """The model's file name: the ``model`` field of completion responses."""
        return self.layout.path.name

    def chat_prompt(self, messages: Sequence[dict]) -> str:
        """``messages`` (``[{"role": ..., "content": ...}]``) formatted with the GGUF's chat
        template, ending with the assistant's turn. Raises ValueError if the GGUF has none."""
        self.decoder.check_open()
        if isinstance(messages, (str, bytes)) or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in messages):
            raise ValueError('messages must be a list of {"role": str, "content": str} dicts')
        if not messages:
            raise ValueError("messages is empty")
        return self.decoder.engine.apply_chat_template([(m["role"], m["content"]) for m in messages], True)

    def chat(self, messages: Sequence[dict], n_predict: int = 256, **kw) -> Generation:
        """Generate the assistant's reply to ``messages`` with the GGUF's chat template."""
        return self.generate(self.chat_prompt(messages), n_predict, add_special=False, **kw)

    def perplexity(self, text: str, n_ctx: int | None = None, stride: int | None = None) -> float:
        """Perplexity of ``text`` with windows of ``n_ctx`` tokens (default the session's) every
        ``stride`` tokens (default n_ctx): :func:`epqlab.engine.perplexity.perplexity`, which states the
        windowing. Memory stays bounded (logits are consumed block by block)."""
        self.decoder.check_open()
        with self.decoder.lock:
            return perplexity(self, text, n_ctx=int(n_ctx or self.n_ctx), stride=stride).ppl

    # -- stats ---------------------------------------------------------------------------------
    @property
    def stats(self) -> dict:
        """Cumulative counters since the last :meth:`reset_stats` (pager + hook), arena, memory;
        ``hit_rate`` here is over every pass since that reset (a run's own rates: :meth:`generate`).
        Built by :func:`epqlab.engine.run_stats.cumulative_stats`."""
        return run_stats.cumulative_stats(self)

    def adaptive_k_per_layer(self) -> np.ndarray:
        """Adaptive-k's mean k per MoE layer over the decode steps since the last :meth:`reset_stats`,
        float64 ``[n_moe_layers]`` (NaN for a layer without such steps; all NaN with ``adaptive_k`` off)."""
        self.decoder.check_open()
        s, n = (np.asarray(a, np.float64) for a in self.decoder.engine.adaptive_k_layers())
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(n > 0, s / np.maximum(n, 1), np.nan)

    def memory_parts(self) -> dict:
        """How the RAM budget is spent, bytes: ``budget``; ``used_before_arena`` (everything
        measured once the model, dense weights and context existed: RSS + malloc'd-but-untouched
        buffers); ``dense`` (anonymous dense-weight copies, part of it); ``arena``;
        ``stage_reserve`` (staging buffer for oversize ubatches); ``reserve``; ``read_buffers`` (the
        readers' bounce buffers, (io_threads + 1) x ``Pager.bounce_bytes()``); and the current
        reading ``now`` (RssAnon, shmem, RssFile, total). See docs/DESIGN.md "Memory accounting"."""
        return run_stats.memory_parts(self)

    def stats_frame(self):
        """Run stats of every generate() so far as a pandas DataFrame (one row per run)."""
        return run_stats.stats_frame(self.runs)

    def time_split(self, per: str = "token"):
        """Time split of every decode call since the last :meth:`reset_stats` as a pandas DataFrame,
        µs per part: ``per="token"`` one row per call (a decode step is one token), ``per="layer"``
        one row per (call, MoE layer). Parts and their timestamps: :mod:`epqlab.engine.time_split`."""
        self.decoder.check_open()
        self.time_split_log.take(self.decoder.engine)
        return self.time_split_log.frame(per)

    def reset_stats(self) -> None:
        if self._pager:
            self._pager.reset_stats()
        self.decoder.engine.reset_hook_stats()
        self.decoder.engine.take_time_split()
        self.time_split_log.clear()
        self.runs.clear()
        self.peak = PeakTracker()

    @property
    def pager(self) -> Pager | None:
        """The :class:`Pager` (None when ``pager=False``)."""
        return self._pager

    # -- route log -----------------------------------------------------------------------------
    def route_log(self):
        """Routes recorded so far as an :class:`epqlab.routes.RouteLog` (the owner of the route-log
        format, docs/DESIGN.md §6): experts int32 [T, L, k], layers, phase, expert_bytes, n_expert,
        meta, ``ubatch`` int32 [T] (the forward pass each token was computed in) and ``probs`` float32
        [T, L, k] (each selected expert's router probability; None if the graph gave none). Requires
        ``route_log=`` at construction."""
        if self.route_log_path is None:
            raise EpqlabError("routes are recorded only when Session(route_log=PATH) is given")
        lay = self.layout
        k = self.n_expert_used
        experts, phase, ubatch, probs = self.decoder.routes(k)
        meta = {"model": str(lay.path), "arch": lay.architecture, "k": k, "prompt_hash": self.decoder.prompt_hash}
        return RouteLog(experts=experts.astype(np.int32), layers=np.array(lay.moe_layers, np.int32), phase=phase,
                        expert_bytes=np.array([l.expert_bytes for l in lay.layers], np.int64),
                        n_expert=int(lay.n_expert), meta=meta, ubatch=ubatch.astype(np.int32),
                        probs=None if np.isnan(probs).any() else probs)

    def save_route_log(self, path=None) -> Path:
        """Write the recorded routes to ``path`` (default: the route_log path) with
        :meth:`epqlab.routes.RouteLog.save`, the one writer of the route-log NPZ (docs/DESIGN.md §6)."""
        p = Path(path or self.route_log_path)
        self.route_log().save(p)
        return p

    # -- lifecycle -----------------------------------------------------------------------------
    def close(self) -> None:
        """Save the route log (if asked for) and free the model, context and arena. Called from another
        thread while a generation runs, it waits for the generation to end (a stream iterated by hand:
        for its current decode step; the stream's next step raises EpqlabError)."""
        if self._follower is not None:
            self._follower.stop()  # its monitor thread reads the pager
        with self.decoder.lock:
            if self.decoder.closed:
                return
            try:
                if self.route_log_path is not None:
                    self.save_route_log()
            finally:
                self.decoder.close()
                self._pager = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self) -> str:
        mode = repr(self._pager) if self._pager else "pager=False"
        return f"Session({self.layout.path.name}, {mode})"
