"""``epqlab ablate policies MODEL --budgets 0.25,0.5 --text FILE [--prefetch off,trained] [--json F]``: the
eviction-policy tournament (:func:`epqlab.studies.ablation.tournament.tournament`): every online policy
simulated on the routes of a held-out text, scored by its share of the LRU -> Belady gap, the top three per
arena confirmed live."""
from __future__ import annotations

from pathlib import Path

from ..models import default_model
from ..results import write_json
from ..studies.ablation.tournament import TOURNAMENT_POLICIES, reading, tournament, winners
from ._args import floats_or_sizes


def register(sub) -> None:
    p = sub.add_parser("policies", help="eviction-policy tournament: gap share to Belady per policy and arena")
    p.add_argument("model", help="path to a MoE .gguf, or 'default' for the embedded default model")
    p.add_argument("--budgets", default="0.25,0.5",
                   help="arena sizes: fractions of all expert slots or sizes like 256MiB (default 0.25,0.5)")
    p.add_argument("--text", default=None, help="evaluation text file (default: the shipped held-out prose)")
    p.add_argument("--policies", default=",".join(TOURNAMENT_POLICIES), help="online policies (default: all but static)")
    p.add_argument("-n", "--tokens", type=int, default=256, help="forced decode steps of the text (default 256)")
    p.add_argument("--prefetch", default="off", help="prefetch modes, e.g. off,trained (default off)")
    p.add_argument("--predictor", default=None, help="trained predictor NPZ for --prefetch trained")
    p.add_argument("--confirm", type=int, default=3, help="live runs per arena: the best simulated (default 3)")
    p.add_argument("--threads", type=int, default=None, help="compute threads")
    p.add_argument("--simulator", choices=["native", "python"], default="python",
                   help="replay engine of the ranking: epqlab.routes.simulate_online (no reads) or the pager's C++ "
                        "replay, which reads every miss from the file (equal counts; default python)")
    p.add_argument("--json", default=None, help="write the table and settings as JSON here")
    p.set_defaults(func=run)


def run(args) -> int:
    model = str(default_model()) if args.model == "default" else args.model
    text = Path(args.text).read_text() if args.text else None
    kw = {"n_threads": args.threads} if args.threads else {}
    df = tournament(model, floats_or_sizes(args.budgets), text,
                    policies=[x.strip() for x in args.policies.split(",") if x.strip()], n_tokens=args.tokens,
                    prefetch=[x.strip() for x in args.prefetch.split(",") if x.strip()], predictor=args.predictor,
                    confirm=args.confirm, session_kwargs=kw, simulator=args.simulator)
    cols = ["point", "slots", "policy", "prefetch", "kind", "rank", "hit_rate", "gap_share", "ssd_mb_per_token",
            "decode_tok_s", "live_equal"]
    import pandas as pd

    with pd.option_context("display.width", 160, "display.max_columns", 20, "display.float_format", "{:.3f}".format):
        print(df.sort_values(["point", "kind", "prefetch", "hit_rate"], ascending=[True, False, True, False])[cols]
              .to_string(index=False))
        print()
        print(winners(df).to_string(index=False))
    print()
    print(reading(df))
    if args.json:
        write_json({**df.attrs, "winners": winners(df).to_dict(orient="records"),
                    "rows": df.to_dict(orient="records")}, args.json)
    live = df[(df.kind == "live") & (df.prefetch == "off")]
    return 0 if bool(live.live_equal.all()) else 1
