"""Quality and routing of the default MoE model, measured with plain llama.cpp (llama-cpp-python).

Prints: E, k, bytes per expert of each type; perplexity on the evaluation text (Python Language
Reference, "Execution model") of the dense SmolLM2 GGUF, of the MoE model at k = E and at the
default k (and any --k values); the greedy answer to a CPU-cache prompt; for 256 generated tokens,
the fraction of (layer, expert) requests that repeat within the last 1 and 8 tokens next to
uniform random routing; optionally the write speed of synthesize().

    python bench/bench_default_model.py [--k 4 10] [--synth-layers 4]

Routing is read back by running the generated tokens through a NumPy model that uses the MoE
GGUF's own router, routed and shared experts (llama.cpp's ``deepseek`` gating: softmax, top-k, no
renormalisation, times ``expert_weights_scale``, plus the shared expert; see
epqlab.models.moefy.moe_ffn), because llama.cpp does not expose the selected experts.
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np


def _k_override(path, k: int | None) -> dict | None:
    """kv_overrides setting ``<arch>.expert_used_count`` = k (None: keep the file's k)."""
    if not k:
        return None
    from gguf import GGUFReader

    arch = GGUFReader(path).fields["general.architecture"].contents()
    return {f"{arch}.expert_used_count": k}


def perplexity(path, text: str, k: int | None = None, n_ctx: int = 512) -> tuple[float, int]:
    """exp(mean NLL) over ``text`` in windows of ``n_ctx`` tokens (each window restarts with BOS)."""
    from llama_cpp import Llama

    kv = _k_override(path, k)
    llm = Llama(str(path), n_ctx=n_ctx, logits_all=True, verbose=False, n_threads=2, kv_overrides=kv)
    toks = llm.tokenize(text.encode())
    nll = []
    for i in range(0, len(toks) - 1, n_ctx - 1):
        ch = toks[i:i + n_ctx] if i == 0 else [toks[0]] + toks[i:i + n_ctx - 1]
        if len(ch) < 16:
            break
        llm.reset()
        llm.eval(ch)
        L = np.array(llm.scores[:len(ch)], dtype=np.float64)[:-1]
        m = L.max(-1, keepdims=True)
        lse = np.log(np.exp(L - m).sum(-1)) + m[:, 0]
        nll.append(lse - L[np.arange(len(ch) - 1), ch[1:]])
    llm.close()
    nll = np.concatenate(nll)
    return float(np.exp(nll.mean())), len(nll)


def generate(path, prompt: str, n: int, k: int | None = None) -> tuple[str, list[int]]:
    from llama_cpp import Llama

    kv = _k_override(path, k)
    llm = Llama(str(path), n_ctx=1024, verbose=False, n_threads=2, kv_overrides=kv)
    out = llm.create_chat_completion([{"role": "user", "content": prompt}], max_tokens=n, temperature=0.0,
                                     top_k=1, seed=0)
    text = out["choices"][0]["message"]["content"]
    toks = llm.tokenize(text.encode(), add_bos=False)
    llm.close()
    return text, toks


def routed_sets(moe_path, src_path, toks: list[int]) -> np.ndarray:
    """(T, n_layer, k) expert ids llama.cpp's gating picks for ``toks`` (NumPy replica)."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    from epqlab.models.moefy import DenseLlama, moe_ffn

    m = DenseLlama(src_path)
    r = GGUFReader(moe_path)
    arch = r.fields["general.architecture"].contents()
    k = int(r.fields[f"{arch}.expert_used_count"].contents())
    w_scale = float(r.fields[f"{arch}.expert_weights_scale"].contents())
    T = {t.name: t for t in r.tensors}
    sel = []
    names = ("ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps",
             "ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp")

    def ffn(il, xn):
        p = f"blk.{il}."
        W = [dequantize(T[p + n + ".weight"].data, T[p + n + ".weight"].tensor_type).astype(np.float32)
             for n in names]
        out, top = moe_ffn(xn, *W, k=k, w_scale=w_scale)
        sel.append(top)
        return out

    m.forward(toks, ffn=ffn)
    return np.stack(sel, 1)  # (T, n_layer, k)


def repeat_fraction(sel: np.ndarray, window: int = 8) -> float:
    """Fraction of (token, layer, expert) requests whose (layer, expert) was also requested by one of
    the previous ``window`` tokens (tokens before the first ``window`` are skipped)."""
    T = sel.shape[0]
    hits = tot = 0
    for t in range(window, T):
        for il in range(sel.shape[1]):
            recent = set(sel[t - window:t, il].ravel().tolist())
            for e in sel[t, il]:
                hits += e in recent
                tot += 1
    return hits / tot


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--k", type=int, nargs="*", default=[], help="extra top-k values to measure")
    ap.add_argument("--gen-tokens", type=int, default=256)
    ap.add_argument("--synth-layers", type=int, default=0, help="also time synthesize(qwen3-30b-a3b, n_layer=N)")
    ap.add_argument("--synth-out", default="/tmp/epqlab-synth-bench.gguf")
    args = ap.parse_args()

    from epqlab.layout import inspect
    from epqlab.models import DEFAULT_CONFIG, default_model, eval_text
    from epqlab.models.smollm2 import source_gguf

    res: dict = {}
    t0 = time.perf_counter()
    path = default_model()
    res["default_model_seconds"] = round(time.perf_counter() - t0, 1)
    src = source_gguf()
    lay = inspect(path)
    E, k = lay.n_expert, lay.n_expert_used
    res.update(arch=lay.architecture, E=E, k=k, n_ff_exp=DEFAULT_CONFIG.n_ff_exp,
               shared_width=DEFAULT_CONFIG.shared_width,
               expert_bytes={"/".join(c.types): c.expert_bytes for c in lay.slot_classes})
    text = eval_text()
    res["ppl_dense"], res["eval_tokens"] = perplexity(src, text)
    res["ppl_k=E"] = perplexity(path, text, E)[0]
    res[f"ppl_k={k}"] = perplexity(path, text, k)[0]
    for kk in args.k:
        res[f"ppl_k={kk}"] = perplexity(path, text, kk)[0]
    res["ratio_k=E"] = res["ppl_k=E"] / res["ppl_dense"]
    res[f"ratio_k={k}"] = res[f"ppl_k={k}"] / res["ppl_dense"]
    print(json.dumps(res, indent=1), flush=True)

    prompt = "Explain what a CPU cache is in two sentences."
    for kk, label in ((k, "default k"), (E, "k = E")):
        ans, _ = generate(path, prompt, 80, kk)
        print(f"\n[greedy, {label} = {kk}] {prompt}\n{ans}", flush=True)

    gen, toks = generate(path, "Write a short story about a lighthouse keeper.", args.gen_tokens, k)
    sel = routed_sets(path, src, [1] + toks)[1:]
    rng = np.random.default_rng(0)
    uni = np.stack([np.stack([rng.permutation(E)[:k] for _ in range(sel.shape[1])]) for _ in range(sel.shape[0])])
    print(f"\nrouting over {sel.shape[0]} generated tokens, {sel.shape[1]} layers, top-{k} of {E}:")
    for win in (1, 8):  # at k = E/2 a window of 8 saturates (uniform ~1 - 2^-8); 1 shows the contrast
        print(f"  requests repeating within the last {win} token(s): {repeat_fraction(sel, win):.3f}   "
              f"uniform random routing: {repeat_fraction(uni, win):.3f} (analytic {1 - (1 - k / E) ** win:.3f})")
    counts = np.bincount(sel.reshape(-1, k)[:, :].ravel() % E, minlength=E)
    print(f"  expert load (all layers): min {counts.min()} max {counts.max()} of {counts.sum()}")

    if args.synth_layers:
        from epqlab.models import synthesize

        r = synthesize(args.synth_out, "qwen3-30b-a3b", n_layer=args.synth_layers)
        print(f"\nsynthesize qwen3-30b-a3b n_layer={args.synth_layers}: {r['bytes'] / 1e9:.2f} GB in "
              f"{r['seconds']:.1f} s = {r['mb_per_s']:.0f} MB/s")


if __name__ == "__main__":
    main()
