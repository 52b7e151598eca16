"""``epqlab info MODEL [--ram-budget 4GiB]``: print a GGUF's routed-expert layout."""
from __future__ import annotations


def register(sub) -> None:
    p = sub.add_parser("info", help="print the routed-expert layout of a MoE GGUF")
    p.add_argument("model", help="path to a .gguf file")
    p.add_argument("--ram-budget", default=None, help="show how much of the experts a budget covers, e.g. 4GiB")
    p.set_defaults(func=run)


def run(args) -> int:
    from ..layout import inspect
    from ..units import fmt_bytes, parse_bytes

    layout = inspect(args.model)
    print(layout.summary())
    if args.ram_budget is not None:
        budget = parse_bytes(args.ram_budget)
        cov = layout.budget_coverage(budget)
        print(f"\nbudget {fmt_bytes(budget)} holds {cov:.1%} of the routed experts "
              f"({fmt_bytes(min(budget, layout.routed_expert_bytes))} of {fmt_bytes(layout.routed_expert_bytes)})")
    return 0
