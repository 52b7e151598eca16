"""``epqlab tune MODEL --quality 0.5% [--budget 8GiB] [--batch N]``: the fastest setting whose perplexity cost on
held-out text stays within the quality budget.

It plans first (``epqlab plan``: the budget and the exact candidates, every policy and prefetch setting), adds the
knobs that trade quality (top-k, cache-aware routing with δ, adaptive top-k; with --batch > 1 the union budget),
measures every candidate --repeats times, interleaved, teacher-forced on the second half of the held-out text,
and prints the frontier it found, what it tried and why the winner wins. Every lossy setting is labelled LOSSY.
Bad input is one line on stderr and exit status 2.
"""
from __future__ import annotations

import sys

from ..errors import EpqlabError
from ._args import load_text
from ..results import write_json


def register(sub) -> None:
    p = sub.add_parser("tune", help="the fastest setting within a perplexity budget (exact first, LOSSY labelled)",
                       description=__doc__.split("\n\n", 1)[1])
    p.add_argument("model", help="path to a MoE .gguf")
    p.add_argument("--quality", default="0.5%", help="perplexity increase allowed, e.g. 0.5%% (default %(default)s; 0..50%%)")
    p.add_argument("--budget", default=None, help="RAM budget (default: the one plan recommends)")
    p.add_argument("--batch", type=int, default=1, help="sequences decoded together (default %(default)s)")
    p.add_argument("--text", default=None, metavar="FILE", help="a UTF-8 file or a held-out text: prose, code, legal "
                   "(default: the shipped held-out prose)")
    p.add_argument("-n", type=int, default=48, help="tokens per sequence per run (default %(default)s)")
    p.add_argument("--repeats", type=int, default=3, help="runs per candidate (default %(default)s)")
    p.add_argument("--threads", type=int, default=None, help="compute threads")
    p.add_argument("--dask", default=None, metavar="ADDRESS",
                   help="run the grid on a Dask scheduler (e.g. tcp://host:8786) instead of one local worker")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the frontier as JSON")
    p.set_defaults(func=run)


def run(args) -> int:
    from ..studies.sweeps import executor_from
    from ..studies.tune import format_tuning, parse_quality, tune

    try:
        parse_quality(args.quality)  # before any run
        text = load_text(args.text)[1] if args.text is not None else None
        t = tune(args.model, args.quality, budget=args.budget, batch=args.batch, text=text, n=args.n,
                 repeats=args.repeats, executor=executor_from(args.dask), n_threads=args.threads)
    except (EpqlabError, ValueError, OSError) as e:
        print(f"epqlab tune: error: {e}", file=sys.stderr)
        return 2
    print(format_tuning(t))
    if args.json:
        cols = [c for c in t.frame.columns if c != "kwargs"]
        write_json({"model": t.model, "quality": t.quality, "budget": t.budget, "batch": t.batch, "best": t.best,
                    "why": t.why, "rule": t.rule, "frontier": t.frame[cols].to_dict(orient="records"),
                    "runs": t.points}, args.json)
    return 0
