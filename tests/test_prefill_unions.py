"""The hook's per-ubatch expert unions (``Engine.layer_unions``), which bench_seed_scale divides the
prefill's reads by, checked against a route log of the same one-ubatch prefill.

Without a route log llama.cpp computes logits only for the last token, and its graph keeps only that row
before the last layer's FFN (inp_out_ids), so the last layer routes one token: its union is that token's
k experts. Every other layer's union is the distinct experts of the whole prompt. The route-logging
Session asks for every token's logits, so its last layer routes them all; with a prompt shorter than one
16 MiB logits block both prefills are one ubatch and route alike.
"""
from __future__ import annotations

import numpy as np

import epqlab


def test_prefill_unions_equal_distinct_experts(default_model_path, tmp_path):
    prompt = "The committee reviewed the budget and agreed to publish the report by the end of the month."
    with epqlab.Session(default_model_path, n_threads=1, n_ctx=256, route_log=tmp_path / "r.npz") as s:
        s.generate(prompt, n_predict=1)
        log = s.route_log()
    pre = log.experts[log.phase == 0]  # [T, L, k]
    assert len(np.unique(log.ubatch[log.phase == 0])) == 1  # one ubatch, as the unlogged prefill below
    want = [np.unique(pre[:, li]).size for li in range(pre.shape[1] - 1)]
    want.append(np.unique(pre[-1, -1]).size)  # the last layer: only the output token
    with epqlab.Session(default_model_path, n_threads=1, n_ctx=256, ram_budget="2GiB") as s:
        u0 = s.decoder.engine.layer_unions().copy()
        g = s.generate(prompt, n_predict=1)
        got = s.decoder.engine.layer_unions() - u0
        read = g.stats["prefill_ssd_bytes"]
        layers = s.layout.layers
    assert got.tolist() == want
    # an empty arena that holds them all reads each distinct expert once, each slice as the whole file pages
    # it touches (docs/DESIGN.md §3 item 5): computed here from the GGUF offsets
    experts = [np.unique(pre[:, li]) for li in range(pre.shape[1] - 1)] + [np.unique(pre[-1, -1])]
    pages = 0
    for layer, es in zip(layers, experts):
        for t in layer.tensors:
            for e in es:
                a = t.expert_offset(int(e))
                pages += -(-(a + t.expert_bytes) // 4096) - a // 4096
    assert read == pages * 4096
