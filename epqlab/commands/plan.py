"""``epqlab plan MODEL [--budgets 4GiB,8GiB,16GiB|auto] [--text FILE] [--verify] [--json F]``: forecast decode and
prefill speed at each RAM budget, per eviction policy and prefetch setting, with the model's terms printed, and
the recommended command.

It probes the device under MODEL (cached per device and file size under the epqlab cache; --reprobe measures
again), then decodes the first half of a held-out text teacher-forced at the smallest budget, in a child process
under a hard memory limit of that budget (+16 MiB), once with prefetch off and once with the predictor. --verify
then runs every row the same way on the text's second half and prints forecast against measured. Bad input
(a budget below the minimum, a text too short, a device without O_DIRECT, a corrupt probe cache, a predictor of
another model) is one line on stderr and exit status 2, with nothing half-written left behind.
"""
from __future__ import annotations

import sys

from ..errors import EpqlabError
from ._args import check_n_ctx, load_text
from ..results import write_json


def register(sub) -> None:
    p = sub.add_parser("plan", help="forecast speed at each RAM budget, policy and prefetch, and recommend a setting",
                       description=__doc__.split("\n\n", 1)[1])
    p.add_argument("model", help="path to a MoE .gguf")
    p.add_argument("--budgets", default="auto",
                   help="RAM budgets, e.g. 4GiB,8GiB,16GiB, or auto: arenas of 1/8, 1/4, 1/2 and all of the experts")
    p.add_argument("--text", default=None, metavar="FILE",
                   help="a UTF-8 file or a held-out text (prose, code, legal): the calibration decodes its first half, "
                        "--verify its second (default: the "
                        "shipped held-out prose)")
    p.add_argument("-n", type=int, default=48, help="teacher-forced decode steps per run (default %(default)s)")
    p.add_argument("--predictor", default=None, metavar="NPZ",
                   help="a fitted predictor for the trained-prefetch rows (default MODEL's .predictor.npz if present, "
                        "else router lookahead)")
    p.add_argument("--threads", type=int, default=None, help="compute threads")
    p.add_argument("--n-ctx", type=int, default=None)
    p.add_argument("--io-threads", type=int, default=None)
    p.add_argument("--reprobe", action="store_true",
                   help="probe the device even if a cached probe exists (do it when the cached one ran on a busy box)")
    p.add_argument("--row-policies", default="best+default", choices=["best+default", "best"],
                   help="forecast rows per budget: the best simulated policy and lru (default), or the best only")
    p.add_argument("--verify", action="store_true",
                   help="measure every row under a hard memory limit and print forecast vs measured")
    p.add_argument("--repeats", type=int, default=3, help="runs per row with --verify (default %(default)s)")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the plan as JSON")
    p.set_defaults(func=run)


def run(args) -> int:
    from ..studies.plan import plan
    from ..studies.plan_report import format_plan, to_json

    try:
        check_n_ctx(args.n_ctx)
        text = load_text(args.text)[1] if args.text is not None else None
        if args.verify and args.repeats < 1:
            raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
        p = plan(args.model, args.budgets, text=text, n=args.n, predictor=args.predictor, n_threads=args.threads,
                 n_ctx=args.n_ctx, io_threads=args.io_threads, reprobe=args.reprobe, progress=sys.stderr.isatty(),
                 row_policies=args.row_policies)
        if args.verify:
            p.verify(repeats=args.repeats, progress=sys.stderr.isatty())
    except (EpqlabError, ValueError, OSError) as e:
        print(f"epqlab plan: error: {e}", file=sys.stderr)
        return 2
    print(format_plan(p))
    if args.json:
        write_json(to_json(p), args.json)
    return 0
