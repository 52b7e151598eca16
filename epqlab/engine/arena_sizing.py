"""Arena sizing: how many bytes of a RAM budget go to the expert arena (docs/DESIGN.md, "Memory
accounting"). The budget bounds the whole resident set; the arena gets what is left once the
model, its dense weights and the context exist: budget - measured usage - reserve - the staging
buffer (only when not every expert fits, since then a ubatch may overflow a layer's slots) - the
readers' bounce buffers."""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import ArenaTooSmall
from ..layout import ModelLayout
from ..paging.pager import Pager
from ..units import fmt_bytes, parse_bytes


@dataclass(frozen=True)
class ArenaPlan:
    """``arena``, ``stage_reserve`` and ``read_buffers`` (the readers' bounce buffers kept out of
    the budget's arena share), bytes."""

    arena: int
    stage_reserve: int
    read_buffers: int = 0


def plan_arena(lay: ModelLayout, k: int, *, budget: int | None, used_before_arena: int, reserve: int,
               dense_bytes: int = 0, arena_bytes=None, io_threads: int = 0) -> ArenaPlan:
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

    Raises:
        ArenaTooSmall: the budget cannot hold one layer's top-k experts beside what is used; the
            message states the smallest budget that works.
    """
    all_bytes = Pager.all_experts_bytes(lay)
    bounce = (io_threads + 1) * Pager.bounce_bytes() if io_threads else 0
    if arena_bytes is not None:
        return ArenaPlan(parse_bytes(arena_bytes), 0, bounce)
    if budget is None:
        return ArenaPlan(all_bytes, 0, bounce)
    arena = budget - used_before_arena - reserve - bounce
    stage = 0
    if arena < all_bytes:  # some ubatch may overflow a layer's slots: reserve staging
        stage = Pager.max_stage_bytes(lay)
        arena -= stage
    need = Pager.min_arena_bytes(lay, k)
    if arena < need:
        smallest = used_before_arena + reserve + bounce + Pager.max_stage_bytes(lay) + need
        raise ArenaTooSmall(
            f"ram_budget {fmt_bytes(budget)} is too small for {lay.path.name}: the process already "
            f"holds {fmt_bytes(used_before_arena)} (dense weights {fmt_bytes(dense_bytes)}, "
            f"KV cache, compute buffers, heap, libraries), the reserve is {fmt_bytes(reserve)}, "
            f"the staging buffer {fmt_bytes(Pager.max_stage_bytes(lay))}, the read buffers {fmt_bytes(bounce)}, "
            f"and one layer's top-{k} experts "
            f"need {fmt_bytes(need)}. The smallest budget that works is {smallest} bytes "
            f"({fmt_bytes(smallest)}); or lower n_ctx / reserve / expert_used.")
    return ArenaPlan(arena, stage, bounce)


__all__ = ["ArenaPlan", "plan_arena"]
