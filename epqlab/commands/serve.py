"""``epqlab serve MODEL --ram-budget 4GiB --host 127.0.0.1 --port 8000``: an OpenAI-compatible server
(/v1/models, /v1/completions, /v1/chat/completions with SSE streaming, /v1/epqlab/stats) on one Session,
with continuous batching of up to ``--max-batch`` sequences; see :mod:`epqlab.server`."""
from __future__ import annotations

import os
import sys

from ..engine.arena_sizing import default_max_batch, kv_cache_bytes
from ..engine.session import Session
from ..layout import inspect
from ..memory.auto_budget import auto_budget
from ..engine.prompt_disk_cache import check_dir
from ._args import check_n_ctx, policy_params_arg
from ..units import fmt_bytes, parse_bytes
from ..paging.pager import POLICIES
from ..server import MAX_BODY_BYTES, _require, bind_socket, serve
from .run import (add_lossy_args, add_memory_args, add_policy_param_arg, add_spec_args, lossy_kwargs,
                  spec_kwargs)

def lossy_banner(lossy: dict, n_expert: int) -> list[str]:
    """What the server says about its lossy knobs (``lossy``: :func:`~epqlab.commands.run.lossy_kwargs`): LOSSY for
    those that can change an answer; an ``expert_budget`` of at least the ``n_expert`` experts a layer has can never
    bind (no step reads more), so it is named a no-op and alone it leaves decoding exact."""
    on = {k: v for k, v in lossy.items() if v is not None}
    out = []
    if on.get("expert_budget") is not None and on["expert_budget"] >= n_expert:
        out.append(f"epqlab: expert_budget={on.pop('expert_budget')} is a no-op: a layer has {n_expert} experts, "
                   "so no step can read more")
    if on:
        out.append("epqlab: LOSSY routing on (answers differ from exact decoding): "
                   + ", ".join(f"{k}={v}" for k, v in on.items()))
    return out


def register(sub) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (needs pip install 'epqlab[serve]')")
    p.add_argument("model", help="path to a MoE .gguf")
    p.add_argument("--ram-budget", default=None,
                   help="RAM budget for the whole process, e.g. 4GiB, or 'auto' (default: every expert fits, "
                        "or auto when the model is larger than that)")
    add_memory_args(p)
    p.add_argument("--prompt-cache-dir", default=None,
                   help="also keep finished sequences' states in this directory, so a prompt that extends one starts "
                        "from it after a restart (same rule as --prompt-cache; epqlab.engine.prompt_disk_cache)")
    p.add_argument("--prompt-cache-size", default="4GiB",
                   help="most bytes the --prompt-cache-dir files may take, least recently used evicted (default 4GiB)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default 127.0.0.1: this machine only; 0.0.0.0 accepts every network "
                        "that reaches the machine: set --api-key then)")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every endpoint but /health (default: the "
                        "EPQLAB_API_KEY environment variable, which keeps the key out of the process list)")
    p.add_argument("--max-body-bytes", type=int, default=MAX_BODY_BYTES,
                   help=f"largest request body accepted, bytes (default {MAX_BODY_BYTES})")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--policy", default="lru", choices=list(POLICIES), help="eviction policy (see epqlab.Pager)")
    add_policy_param_arg(p)
    p.add_argument("--n-ctx", type=int, default=2048, help="context of each sequence, tokens (default 2048)")
    p.add_argument("--max-batch", type=int, default=None,
                   help="sequences decoded together (continuous batching); default: the most, up to 8, whose KV "
                        "cache takes at most a quarter of the budget (4 without a budget)")
    p.add_argument("--prompt-cache", default="exact", choices=["exact", "fast", "off"],
                   help="reuse a finished sequence's KV cells for a prompt that shares its prefix: exact (default: "
                        "only whole ubatches of the earlier prompt's evaluation, so every answer equals the "
                        "uncached one bit for bit), fast (the whole common prefix, generated tokens too, as "
                        "llama.cpp's server's cache_prompt: an answer may differ from the uncached one by "
                        "llama.cpp's rounding), off")
    p.add_argument("--n-ubatch", type=int, default=512,
                   help="llama.cpp's ubatch, tokens (default 512); --prompt-cache exact reuses whole ubatches, so "
                        "a smaller one reuses more of a short chat (and re-reads experts more often in prefill)")
    p.add_argument("--batch-window-ms", type=float, default=0.0,
                   help="when a batch starts from idle, wait this long for more requests before its first step")
    p.add_argument("--threads", type=int, default=None, help="compute threads")
    p.add_argument("--no-pager", dest="pager", action="store_false", default=True, help="plain llama.cpp (mmap)")
    p.add_argument("--model-alias", default=None, help="model name in responses (default: the file name)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    add_lossy_args(p)  # off by default; every answer then differs from exact decoding (the banner says so)
    add_spec_args(p)  # --spec-type draft-mtp: one request at a time
    p.set_defaults(func=run)


def run(args) -> int:
    _require()
    if args.max_batch is not None and args.max_batch < 1:
        raise ValueError(f"--max-batch must be >= 1, got {args.max_batch}")
    if args.batch_window_ms < 0:
        raise ValueError(f"--batch-window-ms must be >= 0, got {args.batch_window_ms}")
    if args.n_ubatch < 1:
        raise ValueError(f"--n-ubatch must be >= 1, got {args.n_ubatch}")
    if args.max_body_bytes < 1:
        raise ValueError(f"--max-body-bytes must be >= 1, got {args.max_body_bytes}")
    check_n_ctx(args.n_ctx)
    # the address before the model loads: a bad host or port costs no load, and the port stays ours
    sock = bind_socket(args.host, args.port)
    api_key = args.api_key or os.environ.get("EPQLAB_API_KEY") or None
    max_batch = args.max_batch
    if spec_kwargs(args):  # speculative decoding serves one sequence at a time (epqlab/engine/speculative.py)
        if max_batch not in (None, 1):
            raise ValueError(f"--spec-type draft-mtp serves one sequence at a time; drop --max-batch {max_batch} (or give 1)")
        max_batch = 1
    size = parse_bytes(args.prompt_cache_size)
    if args.prompt_cache_dir is not None:  # before the model loads
        check_dir(args.prompt_cache_dir)
        if size < 1:
            raise ValueError(f"--prompt-cache-size must be >= 1 byte, got {args.prompt_cache_size!r}")
    if max_batch is None:
        rb = args.ram_budget
        budget = None if rb is None else auto_budget().budget if str(rb).strip().lower() == "auto" else parse_bytes(rb)
        max_batch = default_max_batch(inspect(args.model), args.n_ctx, budget)
    with sock, Session(args.model, ram_budget=args.ram_budget, policy=args.policy, n_ctx=args.n_ctx, n_seq_max=max_batch,
                 policy_params=policy_params_arg(getattr(args, "policy_param", None)),
                 follow_memory=args.follow_memory, max_ram_budget=args.max_ram_budget,
                 n_threads=args.threads, pager=args.pager, n_ubatch=args.n_ubatch, **lossy_kwargs(args),
                 **spec_kwargs(args)) as s:
        if s.auto_budget is not None:
            print(f"epqlab: {s.auto_budget.describe()}", file=sys.stderr)
        kv = kv_cache_bytes(s.layout, s.n_ctx, max_batch)
        print(f"epqlab: serving {s.model_name} ({s!r}) on http://{args.host}:{args.port}/v1; up to {max_batch} "
              f"sequences of {s.n_ctx} tokens per step" + (f" (KV cache {fmt_bytes(kv)})" if kv else "")
              + ("; API key required" if api_key else ""), file=sys.stderr, flush=True)
        if s.speculative:
            print(f"epqlab: speculative decoding with the MTP block (draft up to {s.draft_max} tokens, p_min "
                  f"{s.draft_p_min:g}); one request at a time", file=sys.stderr, flush=True)
        for line in lossy_banner(lossy_kwargs(args), s.layout.n_expert):
            print(line, file=sys.stderr, flush=True)
        serve(s, args.host, args.port, model_name=args.model_alias, log_level=args.log_level, max_batch=max_batch,
              batch_window_s=args.batch_window_ms / 1000, api_key=api_key, max_body_bytes=args.max_body_bytes,
              prompt_cache=args.prompt_cache, sock=sock, prompt_cache_dir=args.prompt_cache_dir,
              prompt_cache_size=size)
    return 0
