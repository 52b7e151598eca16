"""``epqlab demo``: the main job on the embedded default model with an arena smaller than its experts,
then the same prompt with plain llama.cpp, side by side."""
from __future__ import annotations

from ..engine.session import Session
from ..layout import inspect
from ..models import default_model
from ..paging.pager import Pager
from ..units import fmt_bytes
from ._args import check_n_ctx
from .run import add_session_args
from .run import run_session

# Chosen from the eviction ablation on the default model (notebooks/03_least_stale.ipynb): at half
# of the expert slots, fnu keeps the most experts resident (about 60% hits, LRU about 45%); at a
# quarter, LRU and Least-Stale get no hits at all (one token's experts do not fit).
DEMO_POLICY = "fnu"
DEMO_ARENA_FRACTION = 0.5


def register(sub) -> None:
    p = sub.add_parser("demo", help="run the embedded default MoE model with its experts paged (arena < experts), "
                                    "then with plain llama.cpp")
    add_session_args(p)
    p.add_argument("--arena-fraction", type=float, default=DEMO_ARENA_FRACTION,
                   help="arena size as a fraction of all expert slots when --ram-budget is not given "
                        f"(default {DEMO_ARENA_FRACTION})")
    p.add_argument("--no-baseline", dest="baseline", action="store_false",
                   help="skip the plain llama.cpp run")
    # an instruction for the chat template (run's default prompt is a continuation for plain text)
    p.set_defaults(func=run, chat=True, prompt="Explain what a CPU cache is in two sentences.", policy=DEMO_POLICY)


def run(args) -> int:
    check_n_ctx(args.n_ctx)  # before the banner and the model
    path = default_model()
    arena = None
    if args.ram_budget is None and args.pager:
        lay = inspect(path)
        total = Pager.all_experts_bytes(lay)
        arena = max(Pager.min_arena_bytes(lay, args.expert_used), int(args.arena_fraction * total))
        print(f"[demo] {path.name}: {len(lay.layers)} MoE layers x {lay.n_expert} experts, top-{args.expert_used or lay.n_expert_used}; "
              f"routed experts {fmt_bytes(lay.routed_expert_bytes)}; arena {fmt_bytes(arena)} "
              f"({arena / total:.0%} of the bytes that give every expert a slot), policy {args.policy}\n")
    paged: dict = {}
    rc = run_session(path, args, arena_bytes=arena, result=paged)
    if rc or not args.pager or not args.baseline:
        return rc
    print("\n[demo] the same prompt with plain llama.cpp (pager off: every weight mapped from the file)")
    plain = _plain(path, args)
    a, b = paged["stats"], plain["stats"]
    rows = [("", "paged", "plain llama.cpp"),
            ("decode tok/s", f"{a['decode_tok_s']:.1f}", f"{b['decode_tok_s']:.1f}"),
            ("peak memory", fmt_bytes(a["peak_total"]), fmt_bytes(b["peak_total"])),
            ("expert bytes in RAM", fmt_bytes(a["arena_bytes"]), fmt_bytes(inspect(path).routed_expert_bytes) + " (mapped)"),
            ("read at load", fmt_bytes(a["load_bytes_read"]) if a.get("load_bytes_read") is not None else "?",
             fmt_bytes(b["load_bytes_read"]) if b.get("load_bytes_read") is not None else "?"),
            ("same tokens", "yes" if paged["tokens"] == plain["tokens"] else "NO", "")]
    w = [max(len(r[i]) for r in rows) for i in range(3)]
    for r in rows:
        print(f"  {r[0]:<{w[0]}}  {r[1]:>{w[1]}}  {r[2]:>{w[2]}}")
    print("\n(one run each on a small model that fits in RAM: paging costs speed here and buys memory; "
          "the point is models larger than RAM — see bench/bench_memory.py)")
    return 0


def _plain(path, args) -> dict:
    with Session(path, pager=False, n_threads=args.threads, n_ctx=args.n_ctx, expert_used=args.expert_used) as s:
        prompt = s.chat_prompt([{"role": "user", "content": args.prompt}]) if args.chat else args.prompt
        g = s.generate(prompt, args.n_predict, args.temperature, args.seed, add_special=not args.chat)
    return {"text": g.text, "tokens": g.tokens, "stats": g.stats}
