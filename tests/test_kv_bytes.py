"""``kv_cache_bytes``: the sequence memory llama.cpp allocates, from the GGUF's keys. Checked against llama.cpp's
own report of what it allocated (its log at context creation: ``llama_kv_cache: size = ... MiB`` and
``llama_memory_recurrent: size = ... MiB``, two decimals) and against hand arithmetic from the spec, on a dense
attention model and on a Gated-DeltaNet hybrid with an MTP block (qwen35moe: KV only in every 4th layer, one
recurrent state per sequence in the others, nothing for the MTP block)."""
from __future__ import annotations

import re
import subprocess
import sys

import pytest

import epqlab
from epqlab.engine.arena_sizing import kv_cache_bytes
from epqlab.models.archs import tiny_spec, write_tiny

CHILD = """
import sys, epqlab
from epqlab.engine.native import core
core.set_verbose(True)
with epqlab.Session(sys.argv[1], pager=False, n_ctx=int(sys.argv[2]), n_seq_max=int(sys.argv[3]), n_threads=1):
    pass
"""


def _llama_sizes(path, n_ctx, n_seq) -> float:
    """MiB llama.cpp reports for its KV cache plus its recurrent state."""
    r = subprocess.run([sys.executable, "-c", CHILD, str(path), str(n_ctx), str(n_seq)], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    sizes = re.findall(r"llama_(?:kv_cache|memory_recurrent): size =\s+([\d.]+) MiB", r.stderr)
    assert sizes, r.stderr[-2000:]
    return sum(float(x) for x in sizes)


@pytest.mark.parametrize("arch,n_ctx,n_seq", [("qwen3moe", 1024, 2), ("qwen35moe", 2048, 3)])
def test_kv_cache_bytes_matches_llama_cpp(tmp_path, arch, n_ctx, n_seq):
    p = write_tiny(tmp_path / f"{arch}.gguf", arch)
    ours = kv_cache_bytes(epqlab.inspect(p), n_ctx, n_seq)
    assert ours / 2**20 == pytest.approx(_llama_sizes(p, n_ctx, n_seq), abs=0.011)


def test_kv_cache_bytes_of_a_hybrid_by_hand(tmp_path):
    s = tiny_spec("qwen35moe")
    lay = epqlab.inspect(write_tiny(tmp_path / "q.gguf", "qwen35moe"))
    n_ctx, n_seq = 512, 2
    attn = [il for il in range(s.n_layer) if (il + 1) % s.full_attn_interval == 0]  # block 3 of 0..3
    kv = len(attn) * s.n_head_kv * 2 * s.head_dim * n_ctx * n_seq * 2  # f16 K and V
    inner = s.ssm_d_state * s.ssm_dt_rank
    state = ((s.ssm_d_conv - 1) * (inner + 2 * s.ssm_n_group * s.ssm_d_state) + s.ssm_d_state * inner) * 4
    assert attn == [3] and s.n_nextn == 1
    assert kv_cache_bytes(lay, n_ctx, n_seq) == kv + state * (s.n_layer - len(attn)) * n_seq
