"""``epqlab serve MODEL --ram-budget 4GiB --host 127.0.0.1 --port 8000``: an OpenAI-compatible server
(/v1/models, /v1/completions, /v1/chat/completions with SSE streaming, /v1/epqlab/stats) on one Session;
see :mod:`epqlab.server`."""
from __future__ import annotations

import sys
from ..engine.session import Session
from ..paging.pager import POLICIES
from ..server import _require, serve


def register(sub) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (needs pip install 'epqlab[serve]')")
    p.add_argument("model", help="path to a MoE .gguf")
    p.add_argument("--ram-budget", default=None,
                   help="RAM budget for the whole process, e.g. 4GiB, or 'auto' (default: every expert fits, "
                        "or auto when the model is larger than that)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--policy", default="lru", choices=list(POLICIES), help="eviction policy (see epqlab.Pager)")
    p.add_argument("--n-ctx", type=int, default=2048, help="context size, tokens (shared by all requests)")
    p.add_argument("--threads", type=int, default=None, help="compute threads")
    p.add_argument("--no-pager", dest="pager", action="store_false", default=True, help="plain llama.cpp (mmap)")
    p.add_argument("--model-alias", default=None, help="model name in responses (default: the file name)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.set_defaults(func=run)


def run(args) -> int:
    _require()
    with Session(args.model, ram_budget=args.ram_budget, policy=args.policy, n_ctx=args.n_ctx,
                 n_threads=args.threads, pager=args.pager) as s:
        if s.auto_budget is not None:
            print(f"epqlab: {s.auto_budget.describe()}", file=sys.stderr)
        print(f"epqlab: serving {s.model_name} ({s!r}) on http://{args.host}:{args.port}/v1", file=sys.stderr, flush=True)
        serve(s, args.host, args.port, model_name=args.model_alias, log_level=args.log_level)
    return 0
