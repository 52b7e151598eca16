"""``epqlab ablate lossy MODEL --arenas 0.25,0.5 --deltas 0.02,0.05 --json out.json``: every lossy routing knob (top-k,
skip-cold, cache-aware routing, adaptive-k) on one trade-off table (:func:`epqlab.studies.ablation.lossy.lossy_knobs`)."""
from __future__ import annotations

import sys
from pathlib import Path

from ..errors import UsageError
from ..studies.ablation import batch_lossy_report, lossy_report
from ..paging.pager import POLICIES
from ..studies.ablation.lossy import DEFAULT_POLICY, lossy_knobs
from ._args import floats_or_sizes


def register(kinds) -> None:
    p = kinds.add_parser("lossy", help="LOSSY knobs (top-k, skip-cold, cache-aware routing, adaptive-k) vs exact: "
                                       "perplexity ratio, agreement, SSD MB/token, tok/s, hit rate")
    p.add_argument("model", help="path to a MoE .gguf")
    p.add_argument("--arenas", default="0.25,0.5", help="arenas: fractions of all expert slots or sizes (default 0.25,0.5)")
    # the per-token table's own flags: default None, so that one given with --batches (which has its own) is refused
    p.add_argument("--ks", default=None, help="top-k values below the model's own (default 1,2; '' none)")
    p.add_argument("--taus", default=None, help="skip-cold thresholds (default 0.3; '' none)")
    p.add_argument("--deltas", default=None, help="cache-aware routing margins (default 0.02,0.05,0.1; '' none)")
    p.add_argument("--adaptive", default=None,
                   help="adaptive-k rules separated by ';': 'default' (k 1/2/4 below 0.6/1.2 nats) or THRESHOLDS:KS "
                        "(default 'default;1.6,1.9:1,2,3'; '' none)")
    p.add_argument("--texts", default="prose,code,legal", help="held-out texts ('' = no perplexity: synthesized models)")
    p.add_argument("--text-chars", type=int, default=None, help="characters of each text (default 250)")
    p.add_argument("--ppl-n-ctx", type=int, default=None, help="perplexity window, tokens (default 128)")
    p.add_argument("--threads", type=int, default=1, help="compute threads (default 1)")
    p.add_argument("--policy", default=DEFAULT_POLICY, choices=list(POLICIES),
                   help=f"eviction policy (default {DEFAULT_POLICY}: LRU keeps nothing of a layer at small arenas, "
                        "which leaves cache-aware routing nothing to substitute)")
    p.add_argument("--json", default=None, help="write the table, settings and reading as JSON here (and .csv, .png beside it)")
    p.add_argument("--batches", default=None,
                   help="batched decode instead: batch sizes, e.g. 1,2,4,8 (teacher-forced batches of different held-out "
                        "windows; the knobs are batch-aware routing per --batch-deltas and the union budget per --budgets)")
    p.add_argument("--batch-deltas", default=None, help="with --batches: batch-aware routing margins (default 0.05,0.2; '' none)")
    p.add_argument("--budgets", default=None, help="with --batches: union budgets N (default top-k+1, 2 x top-k; '' none)")
    p.add_argument("--windows", type=int, default=None, help="with --batches: held-out windows scored per row (default 8)")
    p.set_defaults(func=run)


def _rules(text: str) -> list:
    out = []
    for r in (x.strip() for x in text.split(";")):
        if not r:
            continue
        if r == "default":
            out.append(True)
            continue
        try:
            thr, ks = r.split(":")
            out.append((tuple(float(x) for x in thr.split(",") if x), tuple(int(x) for x in ks.split(",") if x)))
        except ValueError:
            raise ValueError(f"--adaptive rule {r!r} is not 'default' or THRESHOLDS:KS like 1.6,1.9:1,2,3") from None
    return out


def run_batches(args) -> int:
    """``--batches``: :func:`epqlab.studies.ablation.batch_lossy.batch_lossy`'s table."""
    from ..layout import inspect
    from ..studies.ablation.batch_lossy import batch_lossy, batch_settings

    def ints(flag, text):
        try:
            return [int(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise ValueError(f"{flag} takes integers separated by commas, got {text!r}") from None

    sizes = ints("--batches", args.batches)
    windows = 8 if args.windows is None else args.windows
    if windows < 1:
        raise ValueError(f"--windows must be >= 1 held-out windows, got {windows}")
    own = inspect(args.model).n_expert_used
    budgets = ints("--budgets", args.budgets) if args.budgets is not None else None
    try:
        deltas = [float(x) for x in (args.batch_deltas if args.batch_deltas is not None else "0.05,0.2").split(",")
                  if x.strip()]
    except ValueError:
        raise ValueError(f"--batch-deltas takes numbers separated by commas, got {args.batch_deltas!r}") from None
    settings = batch_settings(own, deltas, budgets)
    texts = [t for t in args.texts.split(",") if t]
    df = batch_lossy(args.model, sizes, settings, arenas=floats_or_sizes(args.arenas), windows=windows,
                     score=bool(texts), progress=True, n_threads=args.threads, policy=args.policy)
    print(df[list(batch_lossy_report.COLUMNS)].to_markdown(index=False, floatfmt=".3f"))
    print()
    print(batch_lossy_report.reading(df, batch=4 if 4 in sizes else max(sizes)))
    if args.json:
        j = Path(args.json)
        paths = batch_lossy_report.save(df, j.parent, j.stem, extra={
            "parameters": {k: v for k, v in vars(args).items() if k != "func"}, "command": " ".join(sys.argv)})
        print("wrote", ", ".join(paths.values()))
    return 0


PER_TOKEN = {"ks": ("--ks", "1,2"), "taus": ("--taus", "0.3"), "deltas": ("--deltas", "0.02,0.05,0.1"),
             "adaptive": ("--adaptive", "default;1.6,1.9:1,2,3"), "text_chars": ("--text-chars", 250),
             "ppl_n_ctx": ("--ppl-n-ctx", 128)}
"""The per-token table's flags and their defaults; the batched table (``--batches``) has knobs of its own."""
BATCHED = {"budgets": "--budgets", "batch_deltas": "--batch-deltas", "windows": "--windows"}


def run(args) -> int:
    if args.batches:
        given = [flag for dest, (flag, _) in PER_TOKEN.items() if getattr(args, dest) is not None]
        if given:
            raise UsageError(f"{', '.join(given)} apply to the per-token table only, not with --batches (its knobs are "
                             "--batch-deltas and --budgets, its texts --texts, its size --windows): drop them")
        return run_batches(args)
    given = [flag for dest, flag in BATCHED.items() if getattr(args, dest) is not None]
    if given:
        raise UsageError(f"{', '.join(given)} apply to the batched table only: add --batches (e.g. --batches 1,2,4,8)")
    for dest, (_, default) in PER_TOKEN.items():
        if getattr(args, dest) is None:
            setattr(args, dest, default)
    nums = lambda s: [float(x) for x in s.split(",") if x.strip()]  # noqa: E731
    df = lossy_knobs(args.model, arenas=floats_or_sizes(args.arenas), ks=[int(k) for k in nums(args.ks)],
                     taus=nums(args.taus), deltas=nums(args.deltas), adaptive=_rules(args.adaptive),
                     texts=[t for t in args.texts.split(",") if t], text_chars=args.text_chars,
                     ppl_n_ctx=args.ppl_n_ctx, progress=True, n_threads=args.threads, policy=args.policy)
    print(lossy_report.format_table(df))
    print()
    print(lossy_report.reading(df))
    if args.json:
        j = Path(args.json)
        paths = lossy_report.save(df, j.parent, j.stem, extra={"notebook": None, "command": " ".join(sys.argv)})
        print("wrote", ", ".join(paths.values()))
    return 0
