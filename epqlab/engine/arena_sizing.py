"""Arena sizing: how many bytes of a RAM budget go to the expert arena (docs/DESIGN.md, "Memory
accounting"). The budget bounds the whole resident set; the arena gets what is left once the
model, its dense weights and the context exist: budget - measured usage - reserve - the readers'
bounce buffers. When not every expert fits, a ubatch may overflow a layer's slots and be staged; the
staged matrix's pages are then lent by the arena itself (native/pager/pager.h, ``lend``; docs/DESIGN.md
§3 item 8), so no staging buffer is held beside it: the budget only has to hold the larger of one
staged matrix and one layer's top-k experts."""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import ArenaTooSmall
from ..layout import ModelLayout
from ..paging.pager import Pager
from ..units import fmt_bytes, parse_bytes


QUOTE_MARGIN_MIN = 32 * 2**20  # bytes added to the smallest budget an ArenaTooSmall quotes ...
QUOTE_MARGIN_FRACTION = 0.10  # ... or this share of what the process held, whichever is larger
"""The quote must open when passed back: a later Session in the same process (or a fresh one) holds more
before its arena (libllama's and the heap's growth after a first load, measured 140 -> 156 MiB over five tries
on the tiny model), so the smallest budget is quoted with this margin, rounded up to a MiB."""
KV_BYTES_PER_VALUE = 2  # llama.cpp's default KV cache type, f16 (llama_context_params.type_k / type_v)


def kv_cache_bytes(lay: ModelLayout, n_ctx: int, n_seq: int = 1) -> int | None:
    """Bytes of llama.cpp's sequence memory for ``n_seq`` sequences of ``n_ctx`` cells each: the KV cache (f16 K
    and V, ``n_ctx * n_seq * head_count_kv * (key_length + value_length) * 2`` per attention layer) plus, on
    Gated-DeltaNet hybrids (``<arch>.full_attention_interval`` with ``ssm.*`` keys: qwen35moe, qwen3next), each
    recurrent layer's f32 state per sequence, ``(conv_kernel - 1) * (inner + 2 * group_count * state_size) +
    state_size * inner`` values (llama.cpp's ``llama_hparams::n_embd_r`` / ``n_embd_s``). Only the trunk's
    layers count (an ordinary context allocates nothing for ``nextn_predict_layers`` MTP blocks), and only
    attention layers hold KV (every ``full_attention_interval``-th there; a per-layer ``head_count_kv`` array
    with zeros, as lfm2moe and nemotron_h_moe write, marks the others). Sliding-window layers are counted at
    ``n_ctx`` (an upper bound). From the GGUF's keys (key/value length default ``embedding_length /
    head_count``); None when the metadata lacks them."""
    md, a = lay.metadata or {}, lay.architecture
    n_layer, n_embd, n_head = md.get(f"{a}.block_count"), md.get(f"{a}.embedding_length"), md.get(f"{a}.attention.head_count")
    kv_heads = md.get(f"{a}.attention.head_count_kv", n_head)
    if not n_layer or not n_embd or not n_head:
        return None
    n_trunk = int(n_layer) - int(md.get(f"{a}.nextn_predict_layers") or 0)
    heads = list(kv_heads) if isinstance(kv_heads, (list, tuple)) else [kv_heads] * int(n_layer)
    heads = [int(h) for h in heads[:n_trunk]]
    head_dim = int(n_embd) // int(n_head[0] if isinstance(n_head, (list, tuple)) else n_head)
    k_len = int(md.get(f"{a}.attention.key_length", head_dim))
    v_len = int(md.get(f"{a}.attention.value_length", head_dim))
    interval = int(md.get(f"{a}.full_attention_interval") or 0)
    recurrent = 0
    if interval and md.get(f"{a}.ssm.inner_size"):
        attn = [il for il in range(n_trunk) if (il + 1) % interval == 0]
        heads = [h if il in attn else 0 for il, h in enumerate(heads)]
        inner, state = int(md[f"{a}.ssm.inner_size"]), int(md.get(f"{a}.ssm.state_size") or 0)
        conv, groups = int(md.get(f"{a}.ssm.conv_kernel") or 0), int(md.get(f"{a}.ssm.group_count") or 0)
        per_layer = (max(conv - 1, 0) * (inner + 2 * groups * state) + state * inner) * 4
        recurrent = per_layer * (n_trunk - len(attn)) * n_seq
    return int(sum(heads) * (k_len + v_len) * n_ctx * n_seq * KV_BYTES_PER_VALUE) + recurrent


@dataclass(frozen=True)
class ArenaPlan:
    """``arena``, ``stage_reserve`` and ``read_buffers`` (the readers' bounce buffers kept out of
    the budget's arena share), bytes; ``stage_lend``: a staged matrix borrows its pages from the arena
    (set for budgets, so the arena and staging together stay inside it; ``stage_reserve`` is then 0)."""

    arena: int
    stage_reserve: int
    read_buffers: int = 0
    stage_lend: bool = False


def plan_arena(lay: ModelLayout, k: int, *, budget: int | None, used_before_arena: int, reserve: int,
               dense_bytes: int = 0, arena_bytes=None, io_threads: int = 0, n_ctx: int = 0,
               n_seq: int = 1) -> ArenaPlan:
    """The arena for ``lay`` at top-``k``.

    Args:
        budget: bytes for the whole process, or None (the arena holds every routed expert).
        used_before_arena: bytes the process holds once model and context exist (RSS + malloc'd
            but untouched buffers).
        reserve: bytes kept out of the arena for growth.
        dense_bytes: anonymous dense-weight bytes (part of ``used_before_arena``; named in errors).
        arena_bytes: size the arena directly (bytes or "256MiB"), ignoring ``budget``.
        io_threads: the pager's reader threads: each, and the computing thread, holds one bounce
            buffer of ``Pager.bounce_bytes()`` bytes, kept out of the arena.
        n_ctx, n_seq: the context (tokens per sequence) and sequences, named with their KV cache
            (:func:`kv_cache_bytes`) in the refusal.

    Raises:
        ArenaTooSmall: the budget cannot hold one layer's top-k experts beside what is used; the
            message states the smallest budget that works, with a margin (:data:`QUOTE_MARGIN_MIN`,
            :data:`QUOTE_MARGIN_FRACTION`) so that passing it back opens.
    """
    all_bytes = Pager.all_experts_bytes(lay)
    bounce = (io_threads + 1) * Pager.bounce_bytes() if io_threads else 0
    if arena_bytes is not None:
        return ArenaPlan(parse_bytes(arena_bytes), 0, bounce)
    if budget is None:
        return ArenaPlan(all_bytes, 0, bounce)
    arena = budget - used_before_arena - reserve - bounce
    # A staged matrix (at most one expert tensor's span) borrows the arena's pages, so the arena must
    # hold the larger of it and one layer's top-k; below every expert only (above, nothing is staged).
    need = Pager.min_arena_bytes(lay, k)
    if arena < all_bytes:
        need = max(need, Pager.max_stage_bytes(lay))
    if arena < need:
        exact = used_before_arena + reserve + bounce + need
        margin = max(QUOTE_MARGIN_MIN, int(QUOTE_MARGIN_FRACTION * used_before_arena))
        smallest = -(-(exact + margin) // 2**20) * 2**20
        kv = kv_cache_bytes(lay, n_ctx, n_seq) if n_ctx else None
        kv_s = (f"KV cache {fmt_bytes(kv)} for {n_seq} sequence{'s' if n_seq > 1 else ''} x {n_ctx} tokens"
                if kv is not None else "KV cache")
        raise ArenaTooSmall(
            f"ram_budget {fmt_bytes(budget)} is too small for {lay.path.name}: the process already "
            f"holds {fmt_bytes(used_before_arena)} (dense weights {fmt_bytes(dense_bytes)}, "
            f"{kv_s}, compute buffers, heap, libraries), the reserve is {fmt_bytes(reserve)}, "
            f"the read buffers {fmt_bytes(bounce)}, and the arena needs {fmt_bytes(need)} (the larger of one layer's "
            f"top-{k} experts, {fmt_bytes(Pager.min_arena_bytes(lay, k))}, and one staged expert matrix, "
            f"{fmt_bytes(Pager.max_stage_bytes(lay))}, which the arena lends its pages to). The smallest budget that works is {smallest} bytes "
            f"({fmt_bytes(smallest)}; that is {exact} bytes as measured now plus a margin of {fmt_bytes(margin)} "
            f"for the growth of a later load); or lower n_ctx / n_seq_max / reserve / expert_used.")
    return ArenaPlan(arena, 0, bounce, stage_lend=True)


def default_max_batch(lay: ModelLayout, n_ctx: int, budget: int | None, cap: int = 8) -> int:
    """The server's default ``--max-batch``: the most sequences (1..``cap``) whose KV cache of ``n_ctx``
    tokens each takes at most a quarter of ``budget`` (the rest stays for the dense weights and the arena);
    4 without a budget. Batches beyond 8 stop paying on MoE decode (the expert union grows toward
    all experts per layer; the Crow streamer of llama.cpp PR 25294 reports the same)."""
    if budget is None:
        return min(cap, 4)
    per = kv_cache_bytes(lay, n_ctx, 1)
    if not per:
        return 1
    return max(1, min(cap, int(budget // 4 // per)))


__all__ = ["ArenaPlan", "plan_arena", "kv_cache_bytes", "default_max_batch"]
