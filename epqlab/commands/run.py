"""``epqlab run MODEL -p PROMPT -n N --ram-budget 4GiB``: generate with paged experts, then print stats."""
from __future__ import annotations

import sys
from ..engine.session import Session
from ..engine.time_split import format_summary
from ..paging.pager import POLICIES
from ._args import check_n_ctx, policy_params_arg
from ..units import fmt_bytes


def add_memory_args(p) -> None:
    """``--follow-memory`` and ``--max-ram-budget`` (run and serve)."""
    p.add_argument("--follow-memory", action="store_true",
                   help="follow memory pressure: a monitor re-reads what 'auto' reads (every 50 ms) and Linux PSI; the "
                        "arena shrinks between two layers when headroom falls below the margin or memory stalls rise, "
                        "and grows back slowly (epqlab.engine.arena_resize states the rule); needs --ram-budget")
    p.add_argument("--max-ram-budget", default=None,
                   help="the largest budget a resize may grow to (default: the opening --ram-budget)")


def add_policy_param_arg(p) -> None:
    """``--policy-param NAME=VALUE`` (run and serve; :func:`epqlab.commands._args.policy_params_arg` parses it)."""
    p.add_argument("--policy-param", action="append", default=[], metavar="NAME=VALUE",
                   help="an eviction policy parameter, e.g. half_life=64 for heat, hir_ratio=0.01 for lirs, "
                        "admit=stage for wtinylfu (repeatable; ranges: epqlab.routes.policy_params)")


def add_session_args(p) -> None:
    p.add_argument("-p", "--prompt", default="A CPU cache is a small, fast memory that")
    p.add_argument("-n", "--n-predict", type=int, default=64, help="tokens to generate (default 64)")
    p.add_argument("--ram-budget", default=None,
                   help="RAM budget for the whole process (anon + shmem + file-backed RSS), e.g. 4GiB, or 'auto' "
                        "(cgroup limit or MemAvailable minus a margin; default: all experts fit, or auto when the "
                        "model is larger than that)")
    add_memory_args(p)
    p.add_argument("--dense-weights", default=None, choices=["anon", "mlock", "mmap"],
                   help="non-expert weights: anonymous copy (default when paging), locked copy, or llama's file mapping")
    p.add_argument("--policy", default="lru", choices=list(POLICIES), help="eviction policy (see epqlab.Pager)")
    add_policy_param_arg(p)
    p.add_argument("--expert-used", type=int, default=None, help="override top-k")
    p.add_argument("--io-threads", type=int, default=None)
    p.add_argument("--threads", type=int, default=None, help="compute threads")
    p.add_argument("--n-ctx", type=int, default=2048)
    p.add_argument("--pager", dest="pager", action="store_true", default=True, help="page experts (default)")
    p.add_argument("--no-pager", dest="pager", action="store_false", help="plain llama.cpp (mmap) for comparison")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stats-file", default=None, help="append run stats as JSON lines")
    p.add_argument("--route-log", default=None, help="save the route log (NPZ) here")
    p.add_argument("--prefetch", default=None, choices=["lookahead", "previous", "union", "trained"],
                   help="next-layer expert prefetch predictor (default off; see epqlab.engine.prefetch)")
    p.add_argument("--predictor", default=None,
                   help="--prefetch trained: a predictor .npz fitted on this model (epqlab predictor fit)")
    p.add_argument("--prefetch-depth", type=int, default=1, help="layers ahead the predictor prefetches, 1..8")
    p.add_argument("--prefetch-budget", default=None, help="bytes prefetched per layer at most, e.g. 64MiB")
    p.add_argument("--read-segment", default=None, help="split expert reads into segments of this size, e.g. 512KiB")
    p.add_argument("--no-pipeline-reads", action="store_true",
                   help="decode: read all of a layer's missing experts before its first matmul (default: each "
                        "expert matmul waits only for its own matrix's reads; timing only)")
    p.add_argument("--expert-addressing", default="auto", choices=["auto", "slots", "region"],
                   help="how the expert matmuls find a resident expert (docs/DESIGN.md §3f): slots = read the arena's "
                        "slots in place, nothing remapped; region = an mmap per expert; auto (default) = slots where possible")
    add_lossy_args(p)
    add_spec_args(p)


def add_spec_args(p) -> None:
    """Speculative decoding with the model's MTP block (epqlab.Session's speculative, draft_max, draft_p_min; the
    names of llama.cpp's --spec-type draft-mtp, --spec-draft-n-max, --draft-p-min)."""
    p.add_argument("--spec-type", default=None, choices=["draft-mtp"],
                   help="speculative decoding: draft-mtp drafts with the model's MTP block (its experts paged like any "
                        "layer's); one sequence at a time")
    p.add_argument("--spec-draft-n-max", type=int, default=None, metavar="N",
                   help="--spec-type draft-mtp: most tokens drafted per verify pass, 1..8 (default 3)")
    p.add_argument("--draft-p-min", type=float, default=None, metavar="P",
                   help="--spec-type draft-mtp: stop a draft at a token whose probability is below P (default 0)")


def spec_kwargs(args) -> dict:
    """Session keyword arguments of :func:`add_spec_args`' flags."""
    on = getattr(args, "spec_type", None) == "draft-mtp"
    n, p = getattr(args, "spec_draft_n_max", None), getattr(args, "draft_p_min", None)
    if not on and (n is not None or p is not None):
        raise ValueError("--spec-draft-n-max and --draft-p-min go with --spec-type draft-mtp")
    return dict(speculative="mtp", draft_max=n, draft_p_min=p) if on else {}


def add_lossy_args(p) -> None:
    """The lossy routing knobs (off by default; epqlab.Session's skip_cold, route_bias, route_delta, adaptive_k,
    expert_budget)."""
    p.add_argument("--skip-cold", type=float, default=None, metavar="TAU",
                   help="LOSSY: in decode, do not read a non-resident expert whose router weight is below TAU")
    p.add_argument("--route-bias", default=None, choices=["cache", "batch"],
                   help="LOSSY routing in decode steps: cache = replace a non-resident expert by the best resident one "
                        "within --route-delta of its router probability; batch = also by one another token of the "
                        "same batched step already reads (with one sequence, as in epqlab run, batch = cache)")
    p.add_argument("--route-delta", type=float, default=None, metavar="DELTA",
                   help="router-probability margin of --route-bias (0 changes nothing)")
    p.add_argument("--expert-budget", type=int, default=None, metavar="N",
                   help="LOSSY union budget: at most N distinct experts per MoE layer in a decode step (resident ones "
                        "first, then by aggregate router probability; colibri EXPERT_BUDGET)")
    p.add_argument("--adaptive-k", default=None, metavar="RULE", nargs="?", const="default",
                   help="LOSSY entropy-adaptive top-k in decode: bare flag = k 1/2/4 below entropy 0.6/1.2 nats; "
                        "or THRESHOLDS:KS, e.g. 1.5,1.9:1,2,3")


def lossy_kwargs(args) -> dict:
    """Session keyword arguments of :func:`add_lossy_args`' flags (ValueError on a malformed --adaptive-k)."""
    ak = getattr(args, "adaptive_k", None)
    if ak == "default":
        ak = True
    elif ak is not None:
        try:
            thr, ks = ak.split(":")
            ak = (tuple(float(x) for x in thr.split(",") if x.strip()), tuple(int(x) for x in ks.split(",") if x.strip()))
        except ValueError:
            raise ValueError(f"--adaptive-k takes THRESHOLDS:KS, e.g. 1.5,1.9:1,2,3 (one more k than thresholds); got {ak!r}") from None
    return dict(skip_cold=getattr(args, "skip_cold", None), route_bias=getattr(args, "route_bias", None),
                route_delta=getattr(args, "route_delta", None), adaptive_k=ak,
                expert_budget=getattr(args, "expert_budget", None))


def register(sub) -> None:
    p = sub.add_parser("run", help="generate text with routed experts paged under a RAM budget")
    p.add_argument("model", help="path to a MoE .gguf")
    add_session_args(p)
    p.set_defaults(func=run)


def arena_share(session) -> str:
    """``"119 of 240 expert slots (50%)"``: the arena's slots against one per routed expert of the model (slots
    are sized by class, so bytes against the experts' bytes would overstate the share)."""
    total = len(session.layout.layers) * session.layout.n_expert
    n = session.pager.n_slots
    return f"{n} of {total} expert slots ({n / max(1, total):.0%})"


def stats_table(st: dict, session) -> str:
    rows = [
        ("model", st["model"]),
        ("pager", "on" if st["pager"] else "off (plain llama.cpp mmap)"),
    ]
    if st["pager"]:
        classes = ", ".join(f"{c['slots']} x {fmt_bytes(c['slot_bytes'])}" for c in st["slot_classes"] if c["slots"])
        rows += [
            ("budget", fmt_bytes(st["budget_bytes"]) if st["budget_bytes"] is not None else
             ("none (arena holds every expert)" if st["arena_bytes"] >= session.pager.all_experts_bytes(session.layout)
              else "none (arena sized directly)")),
            ("arena", f"{fmt_bytes(st['arena_bytes'])} = {classes}  ({arena_share(session)})"),
            ("policy / top-k", f"{st['policy']} / {st['n_expert_used']}"),
            ("expert addressing", str(st.get("expert_addressing"))),
            ("I/O", f"{'O_DIRECT' if st['direct_io'] else 'buffered'}, {st['io_threads']} threads"),
            ("hit rate", f"{st['hit_rate']:.1%}  ({st['hits']} hits, {st['misses']} misses of {st['requests']} requests)"),
            ("evictions", str(st["evictions"])),
            ("SSD read", f"{fmt_bytes(st['ssd_bytes'])}; {st['decode_ssd_bytes_per_token'] / 1e6:.2f} MB/token in decode"),
            ("I/O wait", f"{st['io_wait_s']:.3f} s"),
            ("time split (decode)", format_summary(st.get("time_split") or {})),
            ("prefetch", f"{st['prefetch']}: precision {st['prefetch_precision']:.1%}, recall {st['prefetch_recall']:.1%}, "
                         f"{fmt_bytes(st['prefetch_bytes'])} read ahead, {fmt_bytes(st['prefetch_wasted_bytes'])} in vain"
             if st.get("prefetch") else "off"),
            ("lossy knobs", lossy_line(st)),
            ("staged (layer, ubatch)", f"{st['staged_layers']} pairs whose experts exceeded the slots "
                                       f"({fmt_bytes(st['staged_bytes'])} read, {st['staged_copies']} copied from the arena; "
                                       f"{fmt_bytes(st.get('stage_lent_bytes', 0))} of arena lent to staging, "
                                       f"{st.get('stage_lent_evictions', 0)} residents evicted for it)"),
        ]
    rows += [
        ("prefill", f"{st['n_prompt']} tokens, {st['prefill_tok_s']:.1f} tok/s"),
        ("decode", f"{st['n_gen']} tokens, {st['decode_tok_s']:.2f} tok/s"),
        *([("speculative (MTP)", f"{st['spec_accepted']} of {st['spec_drafted']} drafted tokens accepted "
                                 f"({st['spec_acceptance']:.1%}) in {st['spec_verify_steps']} verify passes, "
                                 f"{st['spec_mean_accepted']:.2f} per pass")] if st.get("speculative") else []),
        ("load", f"{st['load_s']:.2f} s, "
                 + (f"{fmt_bytes(st['load_bytes_read'])} read from storage" if st.get("load_bytes_read") is not None else "bytes read unknown")
                 + f"; dense weights: {st['dense_weights']}"),
        ("peak memory", f"{fmt_bytes(st['peak_total'])} = anon {fmt_bytes(st['peak_rss_anon'])} + shmem "
                        f"{fmt_bytes(max(st['peak_rss_shmem'], st['peak_arena_resident']))} + file {fmt_bytes(st['peak_rss_file'])}"
                        f" (peaks sampled per decode call)"),
    ]
    w = max(len(r[0]) for r in rows)
    return "\n".join(f"{k:<{w}}  {v}" for k, v in rows)


def lossy_line(st: dict) -> str:
    """One line on the lossy knobs of run stats ``st``: which are on, routing agreement, bytes not read."""
    on = []
    if st.get("skip_cold") is not None:
        on.append(f"skip_cold={st['skip_cold']:g}")
    if st.get("route_bias"):
        on.append(f"route_bias={st['route_bias']} (delta {st['route_delta']:g}, {st['route_substituted']} substituted)")
    if st.get("adaptive_k"):
        on.append(f"adaptive_k={st['adaptive_k']} ({st['adaptive_dropped']} slots dropped)")
    if st.get("expert_budget"):
        on.append(f"expert_budget={st['expert_budget']} ({st['budget_dropped']} slots dropped, "
                  f"{st['budget_overflow']} tokens over)")
    if st.get("lossy_union_before"):
        on.append(f"union {st['lossy_union_before']} -> {st['lossy_union_after']} experts")
    if not on:
        return "off (exact)"
    return (", ".join(on) + f"; routing agreement {st['routing_agreement']:.1%}, "
            f"{fmt_bytes(st['lossy_bytes_saved'])} not read")


def run_session(model, args, arena_bytes=None, result: dict | None = None) -> int:
    """Stream one generation with the CLI's session arguments and print its stats; ``result``, when
    given, receives ``text``, ``tokens`` and ``stats``."""
    if args.n_predict < 0:  # before the model loads, and before the prompt is echoed
        raise ValueError(f"n_predict must be >= 0 (-n), got {args.n_predict}")
    check_n_ctx(args.n_ctx)
    with Session(model, ram_budget=args.ram_budget, policy=args.policy, expert_used=args.expert_used,
                 policy_params=policy_params_arg(getattr(args, "policy_param", None)),
                 follow_memory=getattr(args, "follow_memory", False), max_ram_budget=getattr(args, "max_ram_budget", None),
                 io_threads=args.io_threads, n_threads=args.threads, n_ctx=args.n_ctx, pager=args.pager,
                 route_log=args.route_log, stats_file=args.stats_file, arena_bytes=arena_bytes,
                 dense_weights=getattr(args, "dense_weights", None), prefetch=getattr(args, "prefetch", None),
                 prefetch_budget=getattr(args, "prefetch_budget", None),
                 prefetch_predictor=getattr(args, "predictor", None),
                 prefetch_depth=getattr(args, "prefetch_depth", 1),
                 read_segment_bytes=getattr(args, "read_segment", None),
                 pipeline_reads=False if getattr(args, "no_pipeline_reads", False) else None,
                 expert_addressing=getattr(args, "expert_addressing", "auto") if args.pager else "auto",
                 **lossy_kwargs(args), **spec_kwargs(args)) as s:
        if s.auto_budget is not None:
            print(f"epqlab: {s.auto_budget.describe()}", file=sys.stderr)
        prompt = args.prompt
        if args.chat:
            prompt = s.chat_prompt([{"role": "user", "content": args.prompt}])
        stream = s.stream(prompt, args.n_predict, args.temperature, args.seed, add_special=not args.chat)  # checks first
        print(f"user: {args.prompt}\nassistant: " if args.chat else prompt, end="", flush=True)
        for piece in stream:
            sys.stdout.write(piece)
            sys.stdout.flush()
        print("\n")
        print(stats_table(stream.stats, s))
        if result is not None:
            g = stream.result
            result.update(text=g.text, tokens=g.tokens, prompt_tokens=g.prompt_tokens, stats=g.stats)
    return 0


def run(args) -> int:
    return run_session(args.model, args)
