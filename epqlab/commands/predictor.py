"""``epqlab predictor fit MODEL OUT.npz`` fits the learned expert predictor of ``prefetch="trained"``
(:mod:`epqlab.engine.predictor`) on the shipped calibration texts (or ``--text``); ``epqlab predictor eval MODEL
P.npz`` scores it against router lookahead on a held-out text (recall of the top-k, per depth and weight type)."""
from __future__ import annotations

import dataclasses
import time

from ..engine.predictor import WEIGHT_TYPES, ExpertPredictor, router_weights
from ..engine.session import Session
from ..studies.predictor_fit import fit_for_model, predictor_recall, record_router_inputs
from ._args import load_text


def register(sub) -> None:
    p = sub.add_parser("predictor", help="fit / evaluate the learned expert predictor for prefetch='trained'")
    ps = p.add_subparsers(dest="predictor_cmd", metavar="ACTION", required=True)
    f = ps.add_parser("fit", help="record router inputs on calibration text and fit the predictor")
    f.add_argument("model", help="path to a MoE .gguf")
    f.add_argument("out", help="where to save the predictor (.npz)")
    f.add_argument("--tokens", type=int, default=1024, help="calibration tokens (default 1024)")
    f.add_argument("--depth", type=int, default=2, help="layers ahead it predicts, 1..4 (default 2)")
    f.add_argument("--text", default=None, help="a UTF-8 calibration file (default: the shipped calibration texts)")
    f.add_argument("--weight-type", default=WEIGHT_TYPES[0], choices=WEIGHT_TYPES,
                   help=f"the type the engine keeps the weights in (default {WEIGHT_TYPES[0]}; bf16 streams twice the bytes)")
    f.set_defaults(func=run_fit)
    e = ps.add_parser("eval", help="top-k recall of the predictor and of router lookahead on a held-out text")
    e.add_argument("model", help="path to the MoE .gguf the predictor was fitted on")
    e.add_argument("predictor", help="a predictor .npz")
    e.add_argument("--text", default="prose", help="a UTF-8 file or a held-out text: prose, code, legal (default prose)")
    e.add_argument("--tokens", type=int, default=256, help="tokens evaluated (default 256)")
    e.set_defaults(func=run_eval)


def run_fit(args) -> int:
    from pathlib import Path

    text = Path(args.text).read_text(encoding="utf-8") if args.text else None
    t0 = time.perf_counter()
    p = dataclasses.replace(fit_for_model(args.model, n_tokens=args.tokens, depth=args.depth, text=text),
                            weight_type=args.weight_type)
    out = p.save(args.out)
    L, E, D = p.shape
    print(f"fitted on {p.n_tokens} tokens in {time.perf_counter() - t0:.0f} s: depth {p.depth}, {L} layers x {E} experts "
          f"x width {D}, ridge alpha {', '.join(f'{a:g}' for a in p.alpha)}, weights kept in {p.weight_type}; saved {out}")
    return 0


def run_eval(args) -> int:
    name, text = load_text(args.text)
    p = ExpertPredictor.load(args.predictor)
    Ws, bs = router_weights(args.model)
    p.check_model(len(Ws), Ws[0].shape[0], Ws[0].shape[1])  # before recording, which takes a while
    with Session(args.model, pager=False, n_ctx=256) as s:
        ids = s.tokenize(text)[:args.tokens]
    H, routes = record_router_inputs(args.model, ids)
    print(f"{name}: {len(ids)} tokens, top-{routes.shape[2]} recall (|predicted ∩ selected| / |selected|)")
    for d in range(1, p.depth + 1):
        la = predictor_recall(H, routes, Ws, bs, None, d)
        tr = "  ".join(f"trained {wt} {predictor_recall(H, routes, Ws, bs, dataclasses.replace(p, weight_type=wt), d):.3f}"
                       for wt in WEIGHT_TYPES)
        print(f"  {d} layer(s) ahead: lookahead {la:.3f}  {tr}")
    return 0
