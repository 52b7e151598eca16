"""Python face of the native expert pager (``native/pager/pager.cpp``).

The pager keeps routed experts of one GGUF file in a fixed-size RAM arena (one memfd split into
slots) and exposes each expert tensor through a reserved virtual range laid out like the file
("mirror" layout), so a resident expert's bytes sit at ``tensor_data + e * nb2`` exactly as in
the file and non-resident ones are ``PROT_NONE``. See docs/DESIGN.md (paging mechanism).
"""
from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np

from ..constants import OFFLINE_POLICIES, PAGE_SIZE
from ..constants import ONLINE_POLICIES as POLICIES
from ..errors import ArenaTooSmall
from ..layout import ModelLayout
from ..units import fmt_bytes, parse_bytes
from ..memory.usage import cpu_threads
from ..routes.log import RouteLog
from ..routes.policy_params import native_params
from ..routes.policy_params import policy_params as policy_params_checked

MAX_IO_THREADS = 1024  # reader threads: far more than any device rewards; the bound keeps a typo from spawning millions


def default_io_threads() -> int:
    """3 x compute threads (the seed's I/O critical-path study found 3x best), compute threads =
    usable CPUs."""
    return 3 * cpu_threads()


def _layer_specs(layout: ModelLayout):
    return [(l.layer, [(t.offset, t.expert_bytes, t.file) for t in l.tensors]) for l in layout.layers]


class Pager:
    """A fixed RAM arena of expert slots over one MoE GGUF, with O_DIRECT reads and eviction.

    A split GGUF (shards) is paged from all its files: one descriptor per shard, each expert
    tensor read from the shard that holds it (``ExpertTensor.file``), every shard checked for
    changes (size, mtime) before each read batch.

    Args:
        layout: from :func:`epqlab.inspect`.
        arena_bytes: arena size, bytes (int or ``"512MiB"``). The arena is split into slot classes
            (one per distinct per-expert unit size, pages rounded): first ``n_expert_used`` slots of
            the largest class, the rest shared in proportion to each class's total bytes.
        policy: eviction policy; the victim is the evictable (resident, unpinned) expert with the
            smallest key among slots large enough, ties broken by least recent request, then
            (layer, expert) order. Experts of the layer being computed are pinned (never victims).

            - ``"lru"``: least recently requested.
            - ``"ls"``: Least-Stale, SpecMD (arXiv 2602.03921): an expert is *stale* if it was not
              requested in the current forward pass (token or ubatch), *current* otherwise; evict
              stale before current, and within each, the smallest layer first (the earliest layer
              of the pass). The stored copies of the paper give only its abstract, so the
              queue order follows seed 000's reading of it (docs/DESIGN.md, "Eviction policies");
              SpecMD pairs it with prefetching, which fills the current queue — off here.
            - ``"ls_pos"``: seed 000's Least-Stale + position: stale-left -> current-left ->
              stale-right -> current-right, where left = layers before the one being loaded; the
              larger layer first on each side (the farthest from its next use in layer order).
            - ``"lfu"``: fewest requests so far (counts kept across evictions, "perfect" LFU).
            - ``"static"``: seed 002's hot-pin: the experts given to :meth:`set_hot` (the hottest on
              a calibration text) are evicted only when no other victim exists; the rest is LRU.
              They are read on first use, not preloaded.
            - ``"fnu"``: farthest predicted next use — Belady's rule (evict the expert needed
              farthest in the future) on a prediction: each expert's layer comes round once per
              forward pass and its router picks it with probability p, an exponential moving
              average of "picked in this pass" (weight ``fnu_alpha`` on the newest pass), so its
              next use is predicted at ``pass * L + layer + L / p`` layer steps. Ours (this
              project); alpha chosen on the calibration texts, not the evaluation prompts.
            - ``"lfuda"``, ``"heat"``, ``"arc"``, ``"2q"``, ``"sieve"``, ``"s3fifo"``, ``"wtinylfu"``, ``"coact"``,
              ``"lirs"``: LFU with dynamic aging (Arlitt et al., SIGMETRICS PER 2000), decayed frequency with a
              half-life (ftllm's heat), ARC (Megiddo & Modha, FAST 2003), 2Q (Johnson & Shasha, VLDB 1994),
              SIEVE (Zhang et al., NSDI 2024), S3-FIFO (Yang et al., SOSP 2023), W-TinyLFU (Einziger, Friedman
              & Manes, ACM TOS 2017), co-activation (this project's: an expert whose partners are resident is
              worth more) and LIRS (Jiang & Zhang, SIGMETRICS 2002: the inter-reference recency, with
              ``hir_ratio`` of the slots, 1 %, for resident HIR experts); the rules and how the pager's
              constraints (pinned layer, every miss admitted) shape them are in :mod:`epqlab.routes.online`,
              whose ``simulate_online`` replays each exactly as this pager runs it. A prefetched expert enters
              a policy's structures as a miss does (the same admission and insertion; in LIRS a resident HIR
              expert at Q's tail), with no request counted; its first demand request is a hit.
              ``policy_params={"admit": "stage"}`` (issue 50's admission knob) with ``"wtinylfu"``: a miss that
              finds no free slot and that TinyLFU rates no more frequent than main's victim is refused a slot;
              with ``"2q"`` / ``"s3fifo"``: one that finds no free slot and is not a ghost (A1out / G) is refused
              and becomes one, so its next miss is admitted. A refused miss's layer is staged (:meth:`replay`
              counts it the same way: ``admission_staged``), so it takes no slot and evicts nothing.
            - ``"gate_rank"``: heat weighted by the router: each request adds the expert's router
              probability mass in that forward pass (not 1), decayed with ``half_life`` passes; a live
              Session hands the pager each step's probabilities (``ffn_moe_probs``), :meth:`replay`
              takes them from the log's ``probs``.
            - ``"belady"``: Belady's MIN (farthest next use), only in :meth:`replay`, which knows
              the future from the log: the bound for the online policies under the same
              constraints (slot classes, pinned layer, per-ubatch unions, staged layers).
        io_threads: reader threads; default 3 x compute threads (the seed's best).
        direct_io: read with O_DIRECT (page cache untouched); falls back to buffered ``pread`` +
            ``POSIX_FADV_DONTNEED`` where the file system refuses it (tmpfs). :attr:`direct_io`
            tells which mode runs.
        n_expert_used: top-k the arena must hold for one layer; default the model's.
        fnu_alpha: policy ``"fnu"``'s EMA weight, in (0, 1].
        policy_params: the policy's parameters by name, over the defaults of
            :func:`epqlab.routes.policy_params.policy_params` (which names each one's range and source), e.g.
            ``{"half_life": 64}`` for ``"heat"``, ``{"kin": 0.25, "kout": 0.5}`` for ``"2q"``.
        capacity_bytes: make room for an arena this large (default ``arena_bytes``); only ``arena_bytes``
            of it is in use (and allocated) until :meth:`resize` grows it.
        prefault: allocate every page of the arena at creation (``posix_fallocate`` on its memfd:
            ~0.15 s per GiB here) and map it once more, populated (the fill mapping, :attr:`fill_bytes`),
            so reads go O_DIRECT straight into the slots: no read allocates a page or copies through a
            bounce buffer. The whole arena is charged to memory from the start. On the 35B-A3B shape at
            4 GiB: 3.47 / 4.26 tok/s against 2.29 / 2.51 through the bounce buffer (docs/DESIGN.md §3
            item 7). ``False``: pages are allocated as reads land, through the bounce buffers.

    Raises:
        ArenaTooSmall: ``arena_bytes`` < :meth:`min_arena_bytes`.
        MemoryError: ``prefault`` and the machine (or the memory cgroup) cannot give the arena its
            pages; the message names the size and the fix.
        ValueError: unknown policy, io_threads outside 1..MAX_IO_THREADS (1024).
        PagerIOError: the file cannot be opened.
    """

    def __init__(self, layout: ModelLayout, arena_bytes: int | str, policy: str = "lru",
                 io_threads: int | None = None, direct_io: bool = True, n_expert_used: int | None = None,
                 fnu_alpha: float = 0.3, prefault: bool = True, policy_params: dict | None = None,
                 capacity_bytes: int | str | None = None):
        from .native import pager_core as core

        if policy not in POLICIES + OFFLINE_POLICIES:
            raise ValueError(f"unknown eviction policy {policy!r}; choose one of {', '.join(POLICIES + OFFLINE_POLICIES)}")
        prm = dict(policy_params or {})
        if policy == "fnu":
            prm.setdefault("fnu_alpha", fnu_alpha)
        prm = policy_params_checked(policy, prm)   # ValueError: unknown parameter or out of its range
        if io_threads is not None and (isinstance(io_threads, bool) or not isinstance(io_threads, int)
                                       or not 1 <= io_threads <= MAX_IO_THREADS):
            raise ValueError(f"io_threads must be an integer in 1..{MAX_IO_THREADS}, got {io_threads!r}")
        self.layout = layout
        k = int(n_expert_used or layout.n_expert_used or 1)
        if not 1 <= k <= layout.n_expert:
            raise ValueError(f"n_expert_used={k} must be between 1 and n_expert={layout.n_expert}")
        self.n_expert_used = k
        arena = parse_bytes(arena_bytes)
        need = self.min_arena_bytes(layout, k)
        if arena < need:
            raise ArenaTooSmall(
                f"arena of {fmt_bytes(arena)} cannot hold one layer's top-{k} experts of {layout.path.name}; "
                f"the smallest arena that works is {need} bytes ({fmt_bytes(need)})"
            )
        cap = max(arena, parse_bytes(capacity_bytes)) if capacity_bytes is not None else arena
        self._p = core.Pager(str(layout.path), _layer_specs(layout), layout.n_expert, k, cap, policy,
                             int(io_threads or default_io_threads()), bool(direct_io), float(fnu_alpha),
                             [str(f) for f in layout.files], native_params(policy, prm))
        self.policy_params = prm
        self.fnu_alpha = float(fnu_alpha)
        self.requested_arena_bytes = arena
        self.prefault = bool(prefault)
        if cap > arena:  # the slots above `arena` start out of use: no page is allocated for them
            self._p.resize(arena)
        if self.prefault:
            err = self._p.reserve_arena()
            if err:
                size = self._p.arena_bytes
                self._p = None
                raise MemoryError(
                    f"cannot allocate the arena's {fmt_bytes(size)} of RAM ({os.strerror(err)}): lower ram_budget "
                    "(or arena_bytes), or free memory; a memory cgroup's limit counts the arena")
        self.hot: np.ndarray = np.zeros((0, 2), np.int32)
        self._index = {l.layer: i for i, l in enumerate(layout.layers)}

    # -- sizing --------------------------------------------------------------------------------
    @staticmethod
    def unit_slot_bytes(layout: ModelLayout) -> list[int]:
        """Slot bytes one (layer, expert) unit of each MoE layer needs (whole pages, mirror layout)."""
        from .native import pager_core as core

        return list(core.Pager.unit_slot_bytes(_layer_specs(layout), layout.n_expert))

    @classmethod
    def min_arena_bytes(cls, layout: ModelLayout, k: int | None = None) -> int:
        """Smallest arena (bytes) that holds one layer's ``k`` largest experts (default k = top-k)."""
        k = int(k or layout.n_expert_used or 1)
        return k * max(cls.unit_slot_bytes(layout))

    @staticmethod
    def bounce_bytes() -> int:
        """Bytes of one reading thread's bounce buffer: with ``prefault=False`` expert reads go file ->
        bounce buffer -> arena memfd (pwrite), so no mapping of the arena is faulted in or zapped while
        another core computes (native/pager/io_pool.h). Every reader thread, and the computing thread when
        it reads inline, then holds one (allocated at its first such read). With the default fill mapping
        reads need none; ``plan_arena`` keeps their bytes out of the arena either way."""
        from .native import pager_core as core

        return int(core.BOUNCE_BYTES)

    @staticmethod
    def max_stage_bytes(layout: ModelLayout) -> int:
        """Bytes of the staging buffer an oversize ubatch needs: the largest expert tensor's span
        of whole file pages (one matrix of one layer, all experts). See native/engine/hook.h."""
        page = PAGE_SIZE
        return max((-(-(t.offset % page + t.n_bytes) // page) * page for l in layout.layers for t in l.tensors),
                   default=0)

    @classmethod
    def all_experts_bytes(cls, layout: ModelLayout) -> int:
        """Arena bytes at which every routed expert has its own slot."""
        return sum(b * layout.n_expert for b in cls.unit_slot_bytes(layout))

    # -- residency -----------------------------------------------------------------------------
    def _li(self, layer: int) -> int:
        try:
            return self._index[layer]
        except KeyError:
            raise ValueError(f"block {layer} has no routed experts; MoE layers are {self.layout.moe_layers}") from None

    def load_layer(self, layer: int, expert_ids: Sequence[int] | np.ndarray) -> np.ndarray:
        """Make experts of GGUF block ``layer`` resident and pinned; returns bool ``[n]``, True = hit.

        Raises:
            PagerIOError: a read failed or came back short (file, offset, errno in the message);
                the failed experts are not resident and the layer is unpinned.
            ArenaTooSmall: the request cannot fit even after evicting every unpinned expert.
            IndexError: an expert id outside ``[0, n_expert)``.
        """
        ids = np.ascontiguousarray(expert_ids, dtype=np.int32).ravel()
        return self._p.load_layer(self._li(layer), ids).astype(bool)

    def zero_overlay(self, layer: int, expert_ids: Sequence[int] | np.ndarray) -> None:
        """Lossy skip-cold support: until :meth:`release_layer` of ``layer``, the slices of the given
        non-resident experts read as zeros through the region; a boundary page shared with a
        resident expert keeps that expert's bytes (a private copy with only the skipped bytes
        zeroed). Residency and stats do not change. Raises IndexError for an id outside
        ``[0, n_expert)``, ValueError for a resident expert."""
        ids = np.ascontiguousarray(expert_ids, dtype=np.int32).ravel()
        self._p.zero_overlay(self._li(layer), ids)

    def prefetch(self, layer: int, expert_ids: Sequence[int] | np.ndarray) -> int:
        """Start reading the predicted experts of GGUF block ``layer`` in the background (priority
        order) into free or evictable slots (a batch): never a pinned expert, never an expert another
        batch is reading or one sharing a page with it, never one of ``expert_ids`` already resident.
        Stops quietly when no slot can be freed. Batches of several layers may be in flight: a
        request of ``layer`` (:meth:`load_layer`) waits for that layer's batches only (a load that
        finds no victim waits for all); other calls wait for every batch (:meth:`prefetch_finish`).
        Returns the number of experts issued. Raises ValueError for a block without experts."""
        return int(self._p.prefetch_start(self._li(layer), np.asarray(expert_ids, np.int32)))

    def prefetch_finish(self) -> None:
        """Wait for every batch in flight; their experts become resident (unpinned). A failed read
        only frees its slot (the demand read reports errors)."""
        self._p.prefetch_finish()

    @property
    def prefetch_active(self) -> bool:
        """Whether prefetch batches were started and not finished yet (their reads may be done)."""
        return bool(self._p.prefetch_active)

    @property
    def read_segment_bytes(self) -> int:
        """Segment size of expert reads, bytes (page multiple; 0 = one read per slice)."""
        return int(self._p.read_segment_bytes)

    @read_segment_bytes.setter
    def read_segment_bytes(self, n: int) -> None:
        self._p.read_segment_bytes = int(n)

    @property
    def read_delay_us(self) -> int:
        """Test knob: every read first sleeps this many µs (an artificially slow device)."""
        return int(self._p.read_delay_us)

    @read_delay_us.setter
    def read_delay_us(self, us: int) -> None:
        self._p.read_delay_us = int(us)

    @property
    def read_rate_limit(self) -> int:
        """Bench knob: expert reads are served as by a device of this many bytes/s with no burst credit
        (one shared device clock; each read takes bytes / rate on it, in the order reads start, and
        ends no earlier than the real read); 0 = off. A blkio throttle grants an idle cgroup a slice's
        worth of bytes at once, so it favours bursty reads (bench/README.md)."""
        return int(self._p.read_rate_limit)

    @read_rate_limit.setter
    def read_rate_limit(self, bytes_per_s: int) -> None:
        if bytes_per_s < 0:
            raise ValueError(f"read_rate_limit must be >= 0 bytes/s (0 = off), got {bytes_per_s}")
        self._p.read_rate_limit = int(bytes_per_s)

    def release_layer(self, layer: int) -> None:
        """Unpin the experts of GGUF block ``layer`` (they stay resident until evicted) and remove
        its zero overlay."""
        self._p.release_layer(self._li(layer))

    def release_all(self) -> None:
        self._p.release_all()

    def begin_pass(self) -> None:
        """Start a new forward pass (token or ubatch): experts used so far become "stale"."""
        self._p.begin_pass()

    def is_resident(self, layer: int, expert: int) -> bool:
        return bool(self._p.is_resident(self._li(layer), int(expert)))

    def read_expert(self, layer: int, tensor: int, expert: int) -> bytes:
        """Bytes of a resident expert's slice of tensor ``tensor`` (index in ``layout.layer(layer).tensors``),
        read through the region (or, with slot addressing, its slot). Raises ValueError if not resident."""
        t = self.layout.layer(layer).tensors[tensor]
        return self._p.read_expert(self._li(layer), tensor, int(expert), t.expert_bytes)

    def set_hot(self, experts) -> None:
        """Policy ``"static"``: mark experts as hot (evicted only when nothing else can be).

        Args:
            experts: int array ``[n, 2]`` of (GGUF block, expert id) pairs, e.g. from
                :func:`epqlab.studies.ablation.hot_experts`.
        Raises:
            ValueError: the policy is not ``"static"``, or a block/expert is out of range.
        """
        if self.policy != "static":
            raise ValueError(f"hot experts apply to policy 'static', not {self.policy!r}")
        hot = np.asarray(experts, dtype=np.int64).reshape(-1, 2)
        if hot.size and (hot[:, 1].min() < 0 or hot[:, 1].max() >= self.layout.n_expert):
            raise ValueError(f"hot expert ids must lie in [0, {self.layout.n_expert})")
        self._p.set_hot([self._li(int(b)) * self.layout.n_expert + int(e) for b, e in hot])
        self.hot = hot.astype(np.int32)

    def replay(self, route_log, layers: Sequence[int] | None = None, ubatch=None, probs=None) -> dict:
        """Drive the pager through a route log exactly as the live llama.cpp hook does (real reads,
        no compute) and return :meth:`stats`.

        Args:
            route_log: a path to a route-log NPZ (docs/DESIGN.md §6, read with
                :meth:`epqlab.routes.RouteLog.load`), a :class:`~epqlab.routes.RouteLog`, a dict or object
                with ``experts``, ``layers`` and (optionally) ``ubatch`` and ``probs``, or an int32 array
                ``[T, L, k]`` (then ``layers`` = GGUF block ids of its L columns, default the
                model's MoE layers).
            ubatch: int ``[T]``: the llama.cpp ubatch of each token (consecutive equal ids form one
                forward pass); default the log's, else one token per pass.
            probs: float ``[T, L, k]``: each selected expert's router probability (the log's ``probs`` by
                default); policy ``gate_rank`` weighs each request by it, as the live hook does.

        Per forward pass, per MoE layer in order: the previous layer is released; the routed
        tokens' experts are requested (one token: in router order; several: their sorted union),
        or, when the union exceeds the layer's slots, nothing (live, that layer is staged); rows
        of -1 (a token not routed through a layer) are skipped. This is the live hook's own code
        path (``pager::request_layer``), so replaying a live run's log reproduces its hits,
        misses and evictions exactly. Stats accumulate (call :meth:`reset_stats`).

        Raises:
            RouteLogError: ``route_log`` is a path to a file that is not a valid route log.
            ValueError: expert ids outside ``[-1, n_expert)``, layer / ubatch / probs counts that do not
                match the log's shape, or policy ``gate_rank`` without router probabilities.
        """
        log_ub = log_pr = None
        if isinstance(route_log, (str, os.PathLike)):
            route_log = RouteLog.load(route_log)  # the format's one reader; names what is wrong with the file
        if isinstance(route_log, dict):
            experts, layers, log_ub = route_log["experts"], route_log["layers"], route_log.get("ubatch")
            log_pr = route_log.get("probs")
        elif hasattr(route_log, "experts"):
            experts, layers = route_log.experts, route_log.layers
            log_ub = getattr(route_log, "ubatch", None)
            log_pr = getattr(route_log, "probs", None)
        else:
            experts = route_log
        experts = np.ascontiguousarray(experts, dtype=np.int32)
        if experts.ndim != 3:
            raise ValueError(f"route log experts must be [T, L, k], got shape {experts.shape}")
        layers = list(self.layout.moe_layers if layers is None else [int(x) for x in layers])
        if len(layers) != experts.shape[1]:
            raise ValueError(f"route log has {experts.shape[1]} layers but {len(layers)} layer ids were given")
        if experts.size and (experts.min() < -1 or experts.max() >= self.layout.n_expert):
            raise ValueError(f"route log has expert ids outside [0, {self.layout.n_expert})")
        ub = ubatch if ubatch is not None else log_ub
        ub = np.arange(experts.shape[0], dtype=np.int32) if ub is None else np.ascontiguousarray(ub, dtype=np.int32)
        if ub.shape != (experts.shape[0],):
            raise ValueError(f"ubatch must have one entry per token ({experts.shape[0]}), got shape {ub.shape}")
        pr = probs if probs is not None else log_pr
        if pr is not None:
            pr = np.ascontiguousarray(pr, dtype=np.float32)
            if pr.shape != experts.shape:
                raise ValueError(f"probs must have the experts' shape {experts.shape}, got {pr.shape}")
        elif self.policy == "gate_rank":
            raise ValueError("policy gate_rank replays need each selected expert's router probability: a route log "
                             "recorded by Session(route_log=...) of this version has them (`probs`), or pass probs=")
        self._p.replay(experts, ub, [self._li(l) for l in layers], pr)
        return self.stats

    def pass_history(self) -> tuple[np.ndarray, np.ndarray]:
        """Requests and hits of each forward pass since the last reset, int32 ``[passes]`` each,
        in order (the same for a live run and its replay)."""
        r, h = self._p.pass_history()
        return np.asarray(r), np.asarray(h)

    # -- stats ---------------------------------------------------------------------------------
    @property
    def stats(self) -> dict:
        """Counters since the last reset: requests, hits, misses, hit_rate, evictions (+ by group
        stale/current x left/right), bytes_read (bytes), read_us (sum of read durations, µs),
        io_wait_us (µs the caller waited for reads), map_us (µs in mmap), per-layer requests/hits,
        resident units, arena and slot classes, I/O mode."""
        s = dict(self._p.stats())
        s["hit_rate"] = s["hits"] / s["requests"] if s["requests"] else 0.0
        s["arena_bytes"] = self.arena_bytes
        s["slot_classes"] = [{"slot_bytes": b, "slots": n} for b, n in zip(self._p.class_slot_bytes, self._p.active_class_n)]
        s["capacity_bytes"] = self.capacity_bytes
        s["resizes"] = int(self._p.resizes)
        s["policy"] = self.policy
        s["io_threads"] = self.io_threads
        s["direct_io"] = self.direct_io
        return s

    def reset_stats(self) -> None:
        self._p.reset_stats()

    @property
    def arena_bytes(self) -> int:
        """Bytes of the arena's slots in use now (<= the requested size; :meth:`resize` changes it)."""
        return int(self._p.arena_bytes)

    @property
    def capacity_bytes(self) -> int:
        """Bytes of slots the arena was made with: the most :meth:`resize` can give back (address space
        only; slots out of use hold no memory)."""
        return int(self._p.capacity_bytes)

    @property
    def min_resize_bytes(self) -> int:
        """The smallest arena :meth:`resize` accepts, bytes: top-k slots of every slot class with slot
        addressing (each layer then uses only its own class), of the largest class without."""
        return int(self._p.min_arena_bytes)

    def resize(self, arena_bytes: int | str) -> int:
        """Shrink or grow the arena to the slots ``arena_bytes`` buys (the same split among slot classes
        as at creation), between forward passes. Shrinking takes free slots out first, then the policy's
        victims (evicted as on a miss), and punches their memfd pages out: the kernel and a memory
        cgroup uncharge them at once. Growing gives slots back, allocated and populated before use.
        Which bytes a matmul reads never changes, so logits do not (tests/test_resize.py).
        Returns :attr:`arena_bytes` after (<= ``arena_bytes``, whole slots). docs/DESIGN.md §5
        "Resizing the arena".

        Raises:
            ArenaTooSmall: below :attr:`min_resize_bytes`.
            ValueError: above :attr:`capacity_bytes` (make the Pager with ``capacity_bytes``).
        """
        b = parse_bytes(arena_bytes)
        if b > self.capacity_bytes:
            raise ValueError(f"arena of {fmt_bytes(b)} is above this arena's capacity of "
                             f"{fmt_bytes(self.capacity_bytes)}; make the Pager with capacity_bytes >= it")
        return int(self._p.resize(b))

    @property
    def fill_bytes(self) -> int:
        """Bytes of the fill mapping that reads land in (the whole arena once :attr:`prefault` made it,
        else 0): RssShmem counts these arena pages a second time (docs/DESIGN.md §5)."""
        return int(self._p.fill_bytes) if self._p is not None else 0

    @property
    def arena_resident_bytes(self) -> int:
        """Bytes of the arena that hold pages now (the memfd's allocated blocks), <= arena_bytes."""
        return int(self._p.arena_resident_bytes())

    @property
    def n_slots(self) -> int:
        """Slots in use now (those :meth:`resize` took out are not counted)."""
        return int(sum(self._p.active_class_n))

    def slot_states(self) -> dict:
        """What every arena slot holds now, as arrays of length ``n_slots`` (slots in arena order,
        largest class first): ``slot_class`` (index into ``stats["slot_classes"]``), ``layer`` (GGUF
        block of the resident expert, -1 for a free slot), ``expert`` (-1 free), ``pinned`` (bool:
        in use by the layer being computed, not evictable), ``hot`` (bool: a ``static`` policy hot
        expert). Call it between decode calls (e.g. between a stream's tokens)."""
        a = np.asarray(self._p.slot_states(), dtype=np.int32).reshape(-1, 5)
        blocks = np.asarray(self.layout.moe_layers, dtype=np.int32)
        li = a[:, 1]
        return {"slot_class": a[:, 0].copy(), "layer": np.where(li >= 0, blocks[np.clip(li, 0, None)], -1),
                "expert": a[:, 2].copy(), "pinned": a[:, 3].astype(bool), "hot": a[:, 4].astype(bool)}

    @property
    def policy(self) -> str:
        return self._p.policy

    @property
    def io_threads(self) -> int:
        return int(self._p.io_threads)

    @property
    def direct_io(self) -> bool:
        """True if O_DIRECT reads are in use, False if buffered pread + FADV_DONTNEED."""
        return bool(self._p.direct_io)

    def inject_fault(self, nth: int, err: int) -> None:
        """Test hook: make the ``nth`` read from now fail with errno ``err``."""
        self._p.inject_fault(int(nth), int(err))

    def inject_map_fault(self, nth: int) -> None:
        """Test hook: make the ``nth`` mmap of an expert slice from now fail with ENOMEM (as when
        ``vm.max_map_count`` runs out); 0 disables."""
        self._p.inject_map_fault(int(nth))

    @property
    def native(self):
        """The underlying ``epqlab._pager_core.Pager`` (the llama.cpp hook in ``epqlab._core`` takes it)."""
        return self._p

    def __repr__(self) -> str:
        return (f"Pager({self.layout.path.name}, arena={fmt_bytes(self.arena_bytes)}, slots={self.n_slots}, "
                f"policy={self.policy}, io_threads={self.io_threads}, direct_io={self.direct_io})")
