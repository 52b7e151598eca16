"""``epqlab report RESULTS_DIR --out papers/ [--extra FILE ...]``: write ``papers/<NN>_<study>.md`` from the
results the notebooks wrote (:func:`epqlab.papers.write_papers`)."""
from __future__ import annotations

from ..papers import write_papers


def register(sub) -> None:
    p = sub.add_parser("report", help="write papers/<NN>_<study>.md from a results folder (notebooks' JSON + figures)")
    p.add_argument("results_dir", help="folder the notebooks wrote into (results_dir/<NN>_<study>/*.json)")
    p.add_argument("--out", default="papers", help="folder for the papers and their figures (default papers)")
    p.add_argument("--extra", action="append", default=[], metavar="FILE",
                   help="also report this results JSON (e.g. from 'epqlab ablate eviction ... --json'); repeatable")
    p.set_defaults(func=run)


def run(args) -> int:
    for path in write_papers(args.results_dir, args.out, extra=args.extra):
        print("wrote", path)
    return 0
