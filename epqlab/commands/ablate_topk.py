"""``epqlab ablate topk MODEL --ks 2,4,7 --arenas 0.25,0.5 --json out.json``: the top-k ablation
(:func:`epqlab.studies.ablation.topk.topk`), optionally with the lossy skip-cold sweep (``--taus``)."""
from __future__ import annotations

from ..models import default_model
from ..results import write_json
from ..studies.ablation import topk_report
from ..studies.ablation.skip_cold import skip_cold
from ..studies.ablation.topk import topk
from ._args import floats_or_sizes


def register(sub) -> None:
    p = sub.add_parser("topk", help="perplexity, speed and SSD I/O per top-k and arena; greedy divergence; skip-cold")
    p.add_argument("model", help="path to a MoE .gguf, or 'default' for the embedded default model")
    p.add_argument("--ks", default=None, help="top-k values, e.g. 2,4,7 (default: 1..n_expert)")
    p.add_argument("--arenas", default="0.25,0.5", help="arenas: fractions of all expert slots or bytes (default 0.25,0.5)")
    p.add_argument("--budgets", default=None, help="RAM budgets as further memory points, e.g. 2GiB,4GiB")
    p.add_argument("--texts", default="prose,code,legal", help="held-out texts for perplexity (default prose,code,legal; '' = no perplexity)")
    p.add_argument("--text-chars", type=int, default=None, help="use only the first N characters of each text")
    p.add_argument("--ppl-n-ctx", type=int, default=512, help="perplexity window, tokens (default 512)")
    p.add_argument("--prompts", default=None, help="prompt ids from epqlab.data.prompts() (default: all)")
    p.add_argument("-n", "--n-predict", type=int, default=32, help="greedy tokens per prompt (default 32)")
    p.add_argument("--repeats", type=int, default=3, help="speed runs per (k, point); medians (default 3)")
    p.add_argument("--policy", default="lru", help="eviction policy (default lru)")
    p.add_argument("--threads", type=int, default=None, help="compute threads")
    p.add_argument("--taus", default=None, help="LOSSY skip-cold thresholds to sweep, e.g. 0,0.3,1 (default: none)")
    p.add_argument("--tau-arena", default="0.25", help="arena of the skip-cold sweep (default 0.25)")
    p.add_argument("--json", default=None, help="write the results as JSON here")
    p.add_argument("--out-dir", default=None, help="write JSON, CSV and PNG files here (topk.*)")
    p.set_defaults(func=run)


def run(args) -> int:
    model = args.model
    if model == "default":
        model = str(default_model())
    kw = {"policy": args.policy}
    if args.threads:
        kw["n_threads"] = args.threads
    df = topk(model, args.ks, arenas=floats_or_sizes(args.arenas), budgets=floats_or_sizes(args.budgets) or None,
              texts=args.texts, text_chars=args.text_chars, prompts=args.prompts, n_predict=args.n_predict,
              repeats=args.repeats, ppl_n_ctx=args.ppl_n_ctx, progress=True, **kw)
    skip = None
    if args.taus:
        arena = floats_or_sizes(args.tau_arena)[0]
        skip = skip_cold(model, floats_or_sizes(args.taus), arena=arena, texts=args.texts, text_chars=args.text_chars,
                         ppl_n_ctx=args.ppl_n_ctx, progress=True, **kw)
    print(topk_report.format_table(df))
    if skip is not None:
        print()
        print(skip.to_string(index=False))
    print()
    print(topk_report.reading(df, skip))
    if args.json:
        write_json(topk_report.to_json(df, skip), args.json)
    if args.out_dir:
        paths = topk_report.save(df, args.out_dir, "topk", skip=skip)
        print("wrote", ", ".join(paths.values()))
    return 0
