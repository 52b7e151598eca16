"""``epqlab info MODEL [--ram-budget 4GiB]``: print a GGUF's routed-expert layout."""
from __future__ import annotations

from ..engine.session import DEFAULT_RESERVE
from ..layout import inspect
from ..memory.auto_budget import auto_budget
from ..units import fmt_bytes, parse_bytes


def register(sub) -> None:
    p = sub.add_parser("info", help="print the routed-expert layout of a MoE GGUF")
    p.add_argument("model", help="path to a .gguf file")
    p.add_argument("--ram-budget", default=None,
                   help="show how much of the experts a whole-process RAM budget can hold, e.g. 4GiB, or 'auto'")
    p.set_defaults(func=run)


def run(args) -> int:
    layout = inspect(args.model)
    print(layout.summary())
    if args.ram_budget is not None:
        if str(args.ram_budget).strip().lower() == "auto":
            ab = auto_budget()
            print(f"\n{ab.describe()}")
            budget = ab.budget
        else:
            budget = parse_bytes(args.ram_budget)
        arena = budget - layout.non_expert_bytes - DEFAULT_RESERVE
        cov = layout.budget_coverage(max(0, arena))
        print(f"\nram_budget {fmt_bytes(budget)} bounds the whole process (RssAnon + RssShmem + RssFile). Of it, "
              f"the dense weights take {fmt_bytes(layout.non_expert_bytes)} and the reserve {fmt_bytes(DEFAULT_RESERVE)}; "
              f"the rest, {fmt_bytes(max(0, arena))}, holds at most {cov:.1%} of the routed experts "
              f"({fmt_bytes(layout.routed_expert_bytes)}). The KV cache, compute buffers and libraries are measured "
              f"when a Session loads and come out of the arena too (see `epqlab run ... --ram-budget`).")
    return 0
