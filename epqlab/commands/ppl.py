"""``epqlab ppl MODEL TEXT [--expert-used k]``: perplexity of a text (the llama-perplexity habit), with
:func:`epqlab.engine.perplexity.perplexity` (its docstring states the windowing). Plain llama.cpp by default;
``--arena`` / ``--ram-budget`` page the experts (same numbers: paging is exact), ``--skip-cold`` is the
lossy knob (decodes one token per step so that it applies)."""
from __future__ import annotations

from ..engine.perplexity import perplexity
from ..engine.session import Session
from ..layout import inspect
from ..results import run_info, write_json
from ..studies.ablation.grid import memory_points
from ..units import fmt_bytes
from ._args import load_text


def register(sub) -> None:
    p = sub.add_parser("ppl", help="perplexity of a text file or a held-out text (prose, code, legal)")
    p.add_argument("model", help="path to a .gguf (MoE or dense)")
    p.add_argument("text", help="a UTF-8 text file, or the name of a held-out text shipped in epqlab.data: prose, code, legal")
    p.add_argument("--expert-used", type=int, default=None, help="override top-k (graph and pager)")
    p.add_argument("--n-ctx", type=int, default=512, help="window length, tokens (default 512)")
    p.add_argument("--stride", type=int, default=None, help="tokens between window starts (default n_ctx)")
    p.add_argument("--arena", default=None,
                   help="page the experts with this arena: a fraction of all expert slots (0.25) or bytes (256MiB)")
    p.add_argument("--ram-budget", default=None, help="page the experts under this process budget, e.g. 4GiB")
    p.add_argument("--policy", default="lru", help="eviction policy when paging (default lru)")
    p.add_argument("--skip-cold", type=float, default=None, metavar="TAU",
                   help="LOSSY: skip non-resident experts whose router weight < TAU (needs --arena or --ram-budget; "
                        "evaluates one token per llama_decode so every step is a decode step)")
    p.add_argument("--threads", type=int, default=None, help="compute threads")
    p.add_argument("--json", default=None, help="write the result (and pager stats) as JSON here")
    p.set_defaults(func=run)


def run(args) -> int:
    name, text = load_text(args.text)
    paged = args.arena is not None or args.ram_budget is not None
    if args.skip_cold is not None and not paged:
        raise ValueError("--skip-cold skips reads of non-resident experts: page them with --arena or --ram-budget")
    kw = dict(expert_used=args.expert_used, n_ctx=max(256, args.n_ctx), n_threads=args.threads, pager=paged)
    if paged:
        kw.update(policy=args.policy, ram_budget=args.ram_budget, skip_cold=args.skip_cold)
        if args.arena is not None:  # the ablation grid's definition of an arena (fraction of all slots, or bytes)
            kw.update(memory_points(inspect(args.model), arenas=[args.arena], k=args.expert_used)[0].session_kwargs())
    if args.skip_cold is not None:
        kw.update(n_batch=1, n_ubatch=1)
    with Session(args.model, **kw) as s:
        r = perplexity(s, text, n_ctx=args.n_ctx, stride=args.stride)
        st = s.stats if paged else {}
        k = s.n_expert_used
    print(f"{name}: PPL = {r.ppl:.4f}  (NLL {r.nll:.5f} nats/token, {r.n_scored} tokens scored in {r.n_windows} "
          f"windows of {r.n_ctx}, stride {r.stride}, top-{k}, {'paged' if paged else 'plain llama.cpp'})")
    if paged:
        print(f"arena {fmt_bytes(st['arena_bytes'])}, hit rate {st['hit_rate']:.1%}, SSD {fmt_bytes(st['bytes_read'])} "
              f"({st['bytes_read'] / max(1, st['tokens_routed']) / 1e6:.3f} MB/token), evictions {st['evictions']}"
              + (f", skipped experts {st['cold_skipped']} (skip_cold={args.skip_cold})" if args.skip_cold is not None else ""))
    if args.json:
        out = {"model": str(args.model), "text": name, "n_expert_used": k, "paged": paged, "skip_cold": args.skip_cold,
               "ppl": r.ppl, "nll": r.nll, "n_scored": r.n_scored, "n_windows": r.n_windows, "n_ctx": r.n_ctx,
               "stride": r.stride, "stats": {x: v for x, v in st.items() if isinstance(v, (int, float, str))}}

        out["run"] = run_info(args.model)
        write_json(out, args.json)
    return 0
