"""Misuse that used to crash or answer wrongly now raises clear errors: one Session shared by
threads, a stream resumed after another call, a model file rewritten under an open Session,
llama.cpp's own errors and absurd sizes at the CLI. Expected values: the same calls made
serially (threads), plain llama.cpp on the unchanged file, exit codes and message fragments."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

import epqlab
import epqlab.models
from epqlab.models import synthesize


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    p = tmp_path_factory.mktemp("rel") / "tiny.gguf"
    synthesize(p, "tiny", progress=False)
    return p


THREADS_CHILD = r"""
import sys, threading, numpy as np, epqlab
s = epqlab.Session(sys.argv[1], arena_bytes=epqlab.Pager.min_arena_bytes(epqlab.inspect(sys.argv[1])), n_threads=1)
prompts = [[1, 5, 9, 13, 17, 21, 25, 29], [2, 4, 6, 8, 10, 12, 14, 16, 18, 20]]
serial = [s.logits(p) for p in prompts]
out, errs = {}, []
def work(i):
    try:
        for _ in range(10):
            out[i] = s.logits(prompts[i % 2])
            assert np.array_equal(out[i], serial[i % 2]), "thread got another call's logits"
    except Exception as e:
        errs.append(repr(e))
ts = [threading.Thread(target=work, args=(i,)) for i in range(4)]
[t.start() for t in ts]; [t.join() for t in ts]
print("OK" if not errs else errs[0])
"""


def test_session_shared_by_threads_is_serialized(tiny):
    # In a child: a crash (SIGSEGV, GGML_ASSERT abort) must show as a failure, not kill pytest.
    r = subprocess.run([sys.executable, "-c", THREADS_CHILD, str(tiny)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
    assert r.stdout.strip() == "OK", r.stdout


def test_stale_stream_raises(tiny):
    with epqlab.Session(tiny, n_threads=1) as s:
        it = s.stream([1, 2, 3, 4], 6)
        next(it)
        s.generate([5, 6, 7], 2)  # resets the context the stream was decoding in
        with pytest.raises(epqlab.EpqlabError, match="reset by another call"):
            list(it)
        # the session itself is fine: a fresh stream equals a fresh session's
        a = s.generate([1, 2, 3, 4], 6).tokens
    with epqlab.Session(tiny, n_threads=1) as s2:
        assert s2.generate([1, 2, 3, 4], 6).tokens == a


@pytest.mark.parametrize("pager", [True, False])
def test_model_rewritten_in_place_is_refused(tiny, tmp_path, pager):
    p = tmp_path / "m.gguf"
    shutil.copy(tiny, p)
    lay = epqlab.inspect(p)
    t = lay.layers[0].tensors[0]
    with epqlab.Session(p, pager=pager, n_threads=1, **({"arena_bytes": epqlab.Pager.min_arena_bytes(lay)} if pager else {})) as s:
        s.generate([1, 2, 3], 2)
        st = p.stat()
        with open(p, "r+b") as f:  # same size, other weights for expert 0 of the first tensor
            f.seek(t.offset)
            f.write(bytes(np.random.default_rng(1).integers(0, 255, t.expert_bytes, dtype=np.uint8)))
        size = st.st_size
        assert p.stat().st_size == size
        with pytest.raises(epqlab.ModelChangedError, match="changed on disk"):
            s.generate([1, 2, 3], 2)


def test_pager_refuses_a_changed_file(tiny, tmp_path):
    p = tmp_path / "m.gguf"
    shutil.copy(tiny, p)
    lay = epqlab.inspect(p)
    pg = epqlab.Pager(lay, epqlab.Pager.min_arena_bytes(lay), io_threads=1)
    pg.load_layer(lay.moe_layers[0], [0])
    pg.release_all()
    st = p.stat()
    os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    with pytest.raises(epqlab.PagerIOError, match="changed"):
        pg.load_layer(lay.moe_layers[0], [1])
    assert pg.is_resident(lay.moe_layers[0], 0) and not pg.is_resident(lay.moe_layers[0], 1)


@pytest.mark.parametrize("args,fragment", [
    (["-n", "2", "--n-ctx", "50000128"], "context"),
    (["-n", "2", "--ram-budget", "99999999999TiB"], "too large"),
    (["-n", "2", "--ram-budget", "1e30"], "not a byte count"),
    (["-n", "2", "--ram-budget", "lots"], "not a byte count"),
])
def test_cli_errors_are_one_line(tiny, args, fragment):
    r = subprocess.run([sys.executable, "-m", "epqlab", "run", str(tiny), *args], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 1, (r.returncode, r.stderr[-1500:])
    assert "Traceback" not in r.stderr
    assert r.stderr.startswith("epqlab: error:") and fragment in r.stderr, r.stderr


def test_parse_bytes_bounds():
    for bad in (1e30, float("nan"), float("inf"), 2**63, "5EiB"):
        with pytest.raises(ValueError):
            epqlab.parse_bytes(bad)
    assert epqlab.parse_bytes(2**62) == 2**62


@pytest.mark.parametrize("content", [b"not a route log\n", None])
def test_routes_cli_names_the_format(tmp_path, content):
    p = tmp_path / ("r.txt" if content else "r.npy")
    if content:
        p.write_bytes(content)
    else:
        np.save(p, np.zeros((3, 2, 2), np.int32))
    r = subprocess.run([sys.executable, "-m", "epqlab", "routes", str(p)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert "not an NPZ archive" in r.stderr and "experts" in r.stderr and len(r.stderr.strip().splitlines()) == 1


# -- GGUF structure that llama.cpp would refuse -------------------------------------------------

def _moved(tmp_path, name, how):
    """A small MoE GGUF whose tensor ``name`` has its data offset moved (``how``: 'plus1' or
    'onto-previous'), edited in place through gguf-py's writable memmap of the header."""
    from ggufs import LayerSpec, write_moe

    p = tmp_path / f"{how}.gguf"
    write_moe(p, [LayerSpec(1, "Q8_0", 64, 32), LayerSpec(2, "Q8_0", 64, 32)], n_expert=4, n_expert_used=2)
    import gguf

    r = gguf.GGUFReader(p, "r+")
    ts = {t.name: t for t in r.tensors}
    t = ts[name]
    offs = sorted(int(x.field.parts[-1][0]) for x in r.tensors)
    cur = int(t.field.parts[-1][0])
    t.field.parts[-1][0] = cur + 1 if how == "plus1" else offs[offs.index(cur) - 1]
    r.data.flush()
    del r
    return p


@pytest.mark.parametrize("how,fragment", [("plus1", "not a multiple of general.alignment"), ("onto-previous", "overlaps")])
def test_inspect_refuses_misplaced_tensor_data(tmp_path, how, fragment):
    p = _moved(tmp_path, "blk.2.ffn_up_exps.weight", how)
    with pytest.raises(epqlab.NotGGUFError, match=fragment) as ei:
        epqlab.inspect(p)
    assert "blk.2.ffn_up_exps.weight" in str(ei.value)


def test_per_expert_layout_is_named(tmp_path):
    import gguf

    p = tmp_path / "legacy.gguf"
    w = gguf.GGUFWriter(str(p), "llama")
    w.add_block_count(1)
    w.add_expert_count(4)
    w.add_expert_used_count(2)
    w.add_tensor("token_embd.weight", np.zeros((8, 16), np.float32))
    for e in range(4):
        for k in ("gate", "up", "down"):
            w.add_tensor(f"blk.0.ffn_{k}.{e}.weight", np.zeros((16, 16), np.float32))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    with pytest.raises(epqlab.NotMoEError, match="one tensor per expert") as ei:
        epqlab.inspect(p)
    assert "ffn_*_exps" in str(ei.value) or "_exps" in str(ei.value)


def test_expert_used_count_as_per_layer_array(tmp_path):
    from ggufs import LayerSpec, write_moe
    import gguf

    p = tmp_path / "arr.gguf"
    write_moe(p, [LayerSpec(0, "Q8_0", 64, 32), LayerSpec(1, "Q8_0", 64, 32)], n_expert=4, n_expert_used=2)
    # rewrite with expert_used_count as an array [2, 3]: copy every kv and tensor through gguf-py
    r = gguf.GGUFReader(p)
    q = tmp_path / "arr2.gguf"
    w = gguf.GGUFWriter(str(q), "llama")
    for k, f in r.fields.items():
        if k.startswith("GGUF.") or k == "general.architecture":
            continue
        if k == "llama.expert_used_count":
            w.add_array(k, [2, 3])
            continue
        v = f.contents()
        if isinstance(v, list):
            w.add_array(k, v)
        elif isinstance(v, str):
            w.add_string(k, v)
        elif isinstance(v, int):
            w.add_uint32(k, v)
    for t in r.tensors:
        w.add_tensor_info(t.name, [int(x) for x in reversed(t.shape)] if False else tuple(int(x) for x in t.data.shape),
                          t.data.dtype, int(t.n_bytes), raw_dtype=t.tensor_type)
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_ti_data_to_file()
    for t in r.tensors:
        w.write_tensor_data(np.asarray(t.data))
    w.close()
    lay = epqlab.inspect(q)
    assert lay.n_expert_used == 3 and len(lay.layers) == 2


# -- 4: native resource failures ------------------------------------------------------------
_THREADS_CHILD = r"""
import resource, sys, epqlab
lay = epqlab.inspect(sys.argv[1])
p = epqlab.Pager(lay, epqlab.Pager.min_arena_bytes(lay), io_threads=2)   # the library is loaded and works
del p
vm = int([l for l in open("/proc/self/status") if l.startswith("VmSize")][0].split()[1]) * 1024
resource.setrlimit(resource.RLIMIT_AS, (vm + 64 * 2**20, resource.RLIM_INFINITY))  # room for ~7 thread stacks
try:
    epqlab.Pager(lay, epqlab.Pager.min_arena_bytes(lay), io_threads=64)
except RuntimeError as e:
    print("ERROR", e)
resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
p = epqlab.Pager(lay, epqlab.Pager.min_arena_bytes(lay), io_threads=4)  # still usable afterwards
print("AFTER", p.io_threads)
"""


def test_io_thread_start_failure_is_an_exception(tiny):
    """Starting 64 I/O threads under an address-space limit that holds a few stacks: a Python
    RuntimeError naming the thread, not `terminate called without an active exception`."""
    r = subprocess.run([sys.executable, "-c", _THREADS_CHILD, str(tiny)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "ERROR cannot start I/O thread" in r.stdout and "of 64" in r.stdout
    assert "AFTER 4" in r.stdout


# -- 9: rates named by scope ----------------------------------------------------------------
def test_run_rates_by_scope(default_model_path):
    """decode_hit_rate from the pass history equals the one worked out from two runs: the prefill's
    counts come from an identical fresh session that generates one token (prefill only)."""
    lay = epqlab.inspect(default_model_path)
    arena = int(0.4 * epqlab.Pager.all_experts_bytes(lay))
    prompt = "A CPU cache is a small, fast memory that"
    with epqlab.Session(default_model_path, arena_bytes=arena, policy="lru") as s:
        pre = s.generate(prompt, 1).stats
    with epqlab.Session(default_model_path, arena_bytes=arena, policy="lru") as s:
        st = s.generate(prompt, 14).stats
    assert pre["decode_passes"] == 0 and st["decode_passes"] == 13
    dec_req, dec_hit = st["requests"] - pre["requests"], st["hits"] - pre["hits"]
    assert dec_req == 13 * len(lay.layers) * lay.n_expert_used
    assert st["decode_hit_rate"] == pytest.approx(dec_hit / dec_req)
    assert st["hit_rate"] == pytest.approx(st["hits"] / st["requests"])
    assert 0 <= st["steady_hit_rate"] <= 1 and st["steady_hit_rate"] != st["decode_hit_rate"]
    if st["storage_read_bytes"] is not None:  # /proc/self/io: O_DIRECT expert reads count too
        assert st["storage_read_bytes"] >= st["ssd_bytes"] > 0
