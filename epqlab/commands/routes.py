"""``epqlab routes LOG [--capacities 16,32,64] [--total] [--window 48]``: routing locality of a route log:
hit rate per policy and capacity (Belady's optimum included), one-off share, U(k) savings, popularity."""
from __future__ import annotations

from ..errors import EpqlabError
from ..routes import RouteLog, summarize
from ..routes import RouteLogError
from ..routes.report import summary_table


def register(sub) -> None:
    p = sub.add_parser("routes", help="analyse a route log: cache hit rates (LRU, Least-Stale, Belady), U(k), reuse")
    p.add_argument("log", help="route log NPZ (docs/DESIGN.md §6)")
    p.add_argument("--capacities", default=None,
                   help="comma-separated slot counts (default: ~12 from k to all experts)")
    p.add_argument("--total", action="store_true",
                   help="capacities are total slots of one shared pool (default: slots per layer)")
    p.add_argument("--window", type=int, default=48, help="window in tokens for the one-off share (default 48)")
    p.set_defaults(func=run)


def run(args) -> int:
    import pandas as pd

    log = RouteLog.load(args.log)
    if log.n_tokens == 0:
        raise RouteLogError(f"{args.log} holds no routes (a Session closed before it decoded anything): record one "
                            "with Session(route_log=...) and generate or score some text first")
    caps = None
    if args.capacities:
        try:
            caps = [int(x) for x in args.capacities.split(",") if x.strip()]
        except ValueError:
            raise RouteLogError(f"--capacities must be comma-separated integers, got {args.capacities!r}") from None
    try:
        s = summarize(log, caps, window=args.window, per_layer=not args.total)
    except ValueError as ex:
        raise EpqlabError(str(ex)) from None
    print(f"{args.log}: {log!r}")
    unit = "total slots" if args.total else "slots per layer"
    print(f"\nhit rate by capacity ({unit}):")
    with pd.option_context("display.float_format", "{:.4f}".format, "display.width", 120):
        print(summary_table(s).to_string())
    u = pd.DataFrame(s["union"]).set_index("k")
    print(f"\none-off requests in {args.window}-token windows: {s['one_off_share']:.1%}")
    for k in (2, 4, 8, 16):
        if k in u.index:
            print(f"U({k}) = {u.loc[k, 'union']:.2f} experts/layer, batch saving {u.loc[k, 'saving']:.1%}")
    pop = pd.DataFrame(s["popularity"])
    for _, r in pop.iterrows():
        print(f"top-{int(r.n)} per layer: {r.top_share:.1%} of requests (held-out pin list {r.hot_set_hit_rate:.1%})")
    return 0
