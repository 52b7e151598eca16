"""``epqlab demo``: the main job on the embedded default model at a budget smaller than its experts."""
from __future__ import annotations


def register(sub) -> None:
    from .run import add_session_args

    p = sub.add_parser("demo", help="run the embedded default MoE model with its experts paged (arena < experts)")
    add_session_args(p)
    p.add_argument("--arena-fraction", type=float, default=0.25,
                   help="arena size as a fraction of the routed-expert bytes when --ram-budget is not given (default 0.25)")
    # an instruction for the chat template (run's default prompt is a continuation for plain text)
    p.set_defaults(func=run, chat=True, prompt="Explain what a CPU cache is in two sentences.")


def run(args) -> int:
    from ..layout import inspect
    from ..models import default_model
    from ..pager import Pager
    from ..units import fmt_bytes
    from .run import run_session

    path = default_model()
    arena = None
    if args.ram_budget is None and args.pager:
        lay = inspect(path)
        total = Pager.all_experts_bytes(lay)
        arena = max(Pager.min_arena_bytes(lay, args.expert_used), int(args.arena_fraction * total))
        print(f"[demo] {path.name}: {len(lay.layers)} MoE layers x {lay.n_expert} experts, top-{args.expert_used or lay.n_expert_used}; "
              f"routed experts {fmt_bytes(lay.routed_expert_bytes)}; arena {fmt_bytes(arena)} "
              f"({arena / total:.0%} of the experts' slots)\n")
    return run_session(path, args, arena_bytes=arena)
