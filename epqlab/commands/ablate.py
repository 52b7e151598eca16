"""``epqlab ablate eviction MODEL --arenas 0.25,0.5,0.75 --policies lru,ls,ls_pos --json out.json`` and
``epqlab ablate topk MODEL --ks 2,4,7 --arenas 0.25,0.5 --json out.json`` (epqlab/commands/ablate_topk.py),
``epqlab ablate policies MODEL --budgets 0.25,0.5 --json out.json`` (epqlab/commands/ablate_policies.py):
ablations (one knob swept over arenas or RAM budgets); each kind is a subcommand here."""
from __future__ import annotations

from ..constants import ONLINE_POLICIES
from ..data import prompts
from ..studies.ablation import eviction, eviction_reading, save
from .ablate_lossy import register as register_lossy
from .ablate_policies import register as register_policies
from .ablate_topk import register as register_topk
from ._args import floats_or_sizes
from ..results import save_csv


def register(sub) -> None:
    p = sub.add_parser("ablate", help="ablations: sweep one knob (eviction policy, ...) over arenas or RAM budgets")
    kinds = p.add_subparsers(dest="ablation", metavar="KIND")
    e = kinds.add_parser("eviction", help="eviction policies live, replayed, and against Belady's bound")
    e.add_argument("model", help="path to a MoE .gguf")
    e.add_argument("--arenas", default="0.25,0.5,0.75",
                   help="arena sizes: fractions of all expert slots or sizes like 256MiB (default 0.25,0.5,0.75)")
    e.add_argument("--budgets", default="", help="RAM budgets for the whole process, e.g. 1GiB,2GiB")
    e.add_argument("--policies", default=",".join(ONLINE_POLICIES), help="online policies (default: all)")
    e.add_argument("--prompts", default=None, help="prompt ids from epqlab/data/prompts.jsonl (default: all)")
    e.add_argument("-n", "--n-predict", type=int, default=32, help="tokens per prompt (default 32)")
    e.add_argument("--repeats", type=int, default=3, help="runs per setting; speeds are medians (default 3)")
    e.add_argument("--warmup", type=int, default=8, help="decode passes per prompt before steady state (default 8)")
    e.add_argument("--threads", type=int, default=None, help="compute threads")
    e.add_argument("--json", default=None, help="write the table and settings as JSON here")
    e.add_argument("--csv", default=None, help="write the table as CSV here")
    e.set_defaults(func=run_eviction)

    register_topk(kinds)
    register_lossy(kinds)
    register_policies(kinds)
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])


def run_eviction(args) -> int:
    from pathlib import Path

    import pandas as pd

    chosen = prompts()
    if args.prompts:
        ids = [x.strip() for x in args.prompts.split(",") if x.strip()]
        unknown = sorted(set(ids) - {p.id for p in chosen})
        if unknown:
            raise ValueError(f"unknown prompt ids {unknown}; known: {', '.join(p.id for p in chosen)}")
        chosen = [p for p in chosen if p.id in ids]
    kw = {"n_threads": args.threads} if args.threads else {}
    df = eviction(args.model, floats_or_sizes(args.arenas), [x.strip() for x in args.policies.split(",") if x.strip()],
                  prompts=chosen, n_predict=args.n_predict, repeats=args.repeats,
                  budgets=floats_or_sizes(args.budgets) or None, warmup=args.warmup, session_kwargs=kw)
    cols = ["point", "policy", "slots", "hit_rate", "steady_hit_rate", "belady_steady_hit_rate", "steady_belady_share",
            "ssd_mb_per_token", "decode_tok_s", "io_wait_share", "replay_equal"]
    with pd.option_context("display.width", 160, "display.max_columns", 20, "display.float_format", "{:.3f}".format):
        print(df[cols].to_string(index=False))
    print()
    print(eviction_reading(df))
    meta = {k: v for k, v in df.attrs.items() if k != "route_log"}
    if args.json:
        save(df, Path(args.json).parent, Path(args.json).stem, meta)
    if args.csv:
        save_csv(df, args.csv)
    return 0 if bool(df["replay_equal"].all()) else 1
