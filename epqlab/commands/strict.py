"""``epqlab strict MODEL --levels 2GiB,4GiB,8GiB``: generate in a child process under a hard memory
limit at each level (a cgroup when one is writable, else a 20 ms RSS sampler), and print the table.

Each run starts with the model dropped from the page cache. The Session's ram_budget is the level
minus --headroom. MODEL may be ``default`` for the default model. See epqlab.studies.strict.
"""
from __future__ import annotations

from ..data import heldout_texts
from ._args import check_n_ctx
from ..paging.pager import POLICIES
from ..results import save_csv, write_json
from ..studies import strict
from ..studies.strict import DEFAULT_PROMPT


def register(sub) -> None:
    p = sub.add_parser("strict", help="generate under hard memory limits (cgroup), level by level, and tabulate",
                       description=__doc__.split("\n\n", 1)[1])
    p.add_argument("model", help="path to a MoE .gguf, or 'default'")
    p.add_argument("--levels", required=True, help="memory limits, e.g. 2GiB,4GiB,8GiB")
    p.add_argument("-p", "--prompt", default=DEFAULT_PROMPT)
    p.add_argument("-n", "--n-predict", type=int, default=16, help="tokens to generate per run (default %(default)s)")
    p.add_argument("--repeats", type=int, default=3, help="runs per level (default %(default)s; medians reported)")
    p.add_argument("--teacher-forced", nargs="?", const="prose", default=None, choices=["prose", "code", "legal"],
                   help="feed a held-out text (default prose) one token per decode step instead of the greedy "
                        "tokens: timings and hit rates from real text (use it on random-weight models)")
    p.add_argument("--simulate-routes", action="store_true",
                   help="also replay each paged run's routes with LRU and Belady at its slot count")

    p.add_argument("--policy", default="lru", choices=list(POLICIES))
    p.add_argument("--mmap-baseline", action="store_true",
                   help="also run plain llama.cpp (mmap, pager off) under each limit, and the ratio")
    p.add_argument("--no-pager", dest="pager", action="store_false", help="run only plain llama.cpp (mmap)")
    p.add_argument("--headroom", default="16MiB",
                   help="part of each limit kept out of ram_budget (default %(default)s)")
    p.add_argument("--limit-mode", default=None, choices=["auto", "cgroup", "cgroup-v1", "cgroup-v2", "sampled"],
                   help="how the limit is enforced (default auto: cgroup if writable, else sampled)")
    p.add_argument("--n-ctx", type=int, default=None, help="llama.cpp context size (Session default if omitted)")
    p.add_argument("--threads", type=int, default=None, help="compute threads")
    p.add_argument("--timeout", type=float, default=3600, help="seconds per run before it is killed (a FAIL)")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the table, runs and reading as JSON")
    p.add_argument("--csv", default=None, metavar="FILE", help="also write the table as CSV")
    p.add_argument("--quiet", "-q", action="store_true", help="no per-run progress lines")
    p.set_defaults(func=run)


def run(args) -> int:
    check_n_ctx(args.n_ctx)
    kw = {}
    if args.n_ctx is not None:
        kw["n_ctx"] = args.n_ctx
    if args.threads is not None:
        kw["n_threads"] = args.threads
    forced = heldout_texts()[args.teacher_forced] if args.teacher_forced else None
    df = strict.run(None if args.model == "default" else args.model, args.levels, prompt=args.prompt,
                    n_predict=args.n_predict, forced=forced, simulate_routes=args.simulate_routes, policy=args.policy, pager=args.pager, repeats=args.repeats,
                    mmap_baseline=args.mmap_baseline, headroom=args.headroom, limit_mode=args.limit_mode,
                    timeout_s=args.timeout, progress=not args.quiet, **kw)
    print(f"{df.attrs['model']}  ({args.repeats} run(s) per level, n_predict {args.n_predict}"
          f"{', teacher-forced on the held-out ' + args.teacher_forced + ' text' if forced else ''})")
    print(strict.format_table(df))
    print()
    print(strict.reading(df))
    if args.json:
        write_json(strict.to_json(df), args.json)
    if args.csv:
        save_csv(df.drop(columns=["tokens"], errors="ignore"), args.csv)
    return 0  # a FAIL level is a result (the table says why), not an error of the command
