"""Bad inputs, one table row each: every one raises a clear Python exception of a stated class
whose message names the problem (asserted by a fragment), and never crashes, hangs or answers
silently. CLI rows run ``python -m epqlab`` and assert the exit code, no traceback, and one
``epqlab: error:`` line (argparse's own usage errors: exit 2 and one ``error:`` line).

The files are built once per module: a copy of the tiny MoE (conftest ``tiny_gguf``),
truncations of it at header offsets read from gguf-py's parse, a small layout-only MoE
(tests/ggufs.py write_moe) with edited headers and 3-shard splits broken one way each
(split_gguf), a dense GGUF, and non-GGUF files.
"""
from __future__ import annotations

import shutil
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import epqlab
from epqlab import (ArenaTooSmall, EpqlabError, ModelNotFoundError, NotGGUFError, NotMoEError, SplitModelError,
                    TruncatedModelError)
from ggufs import LayerSpec, split_gguf, write_moe


def _dense_gguf(path: Path) -> None:
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_embedding_length(16)
    w.add_tensor("token_embd.weight", np.zeros((8, 16), np.float32))
    for k in ("gate", "up", "down"):
        w.add_tensor(f"blk.0.ffn_{k}.weight", np.zeros((16, 16), np.float32))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()


def _set_split_key(path: Path, key: str, value: int) -> None:
    """Overwrite an integer split.* key in place through gguf-py's writable memmap."""
    import gguf

    r = gguf.GGUFReader(path, "r+")
    r.fields[key].parts[-1][0] = value
    r.data.flush()
    del r


@pytest.fixture(scope="module")
def f(tmp_path_factory, tiny_gguf):
    """Paths of every file the rows use, by name."""
    import gguf

    d = tmp_path_factory.mktemp("bad")
    out: dict[str, Path] = {}
    # neutral names: a message fragment must come from the message, never from the path
    tiny = out["tiny"] = d / "m.gguf"
    shutil.copy(tiny_gguf, tiny)
    data = tiny.read_bytes()
    r = gguf.GGUFReader(tiny)
    kv_mid = list(r.fields.values())[len(r.fields) // 2].offset + 3
    ti_first, ti_last = r.tensors[0].field.offset, r.tensors[-1].field.offset
    data0 = min(int(t.data_offset) for t in r.tensors)
    del r
    cuts = {"magic": 4, "version": 8, "counts": 20, "kv": kv_mid, "tensor_info": ti_first + 10,
            "last_tensor_info": ti_last + 5, "data_start": data0, "data_mid": (data0 + len(data)) // 2,
            "last_byte": len(data) - 1}
    for name, n in cuts.items():
        p = out[f"cut_{name}"] = d / f"c{len(out)}.gguf"
        p.write_bytes(data[:n])
    out["empty"] = d / "f1.gguf"
    out["empty"].write_bytes(b"")
    out["text"] = d / "f2.gguf"
    out["text"].write_text("this is a text file, not a model\n" * 10)
    out["safetensors"] = d / "f3.safetensors"
    out["safetensors"].write_bytes(struct.pack("<Q", 2) + b"{}" + bytes(64))
    out["v99"] = d / "f4.gguf"
    out["v99"].write_bytes(data[:4] + struct.pack("<I", 99) + data[8:4096])
    out["dir"] = d / "f5.gguf"
    out["dir"].mkdir()
    out["missing"] = d / "f6.gguf"
    out["dense"] = d / "f7.gguf"
    _dense_gguf(out["dense"])
    # split sets (inspect refuses them before llama.cpp sees them, so a small layout-only MoE will
    # do): a good 3-shard one, then copies broken one way each
    small = d / "f9.gguf"
    write_moe(small, [LayerSpec(i, "Q8_0", 64, 32) for i in range(3)], n_expert=8, n_expert_used=2)
    good = split_gguf(small, d / "good", 3)
    out["split"] = good[0]

    def variant(tag: str) -> list[Path]:
        ps = [d / p.name.replace("good", tag) for p in good]
        for a, b in zip(good, ps):
            shutil.copy(a, b)
        return ps

    ps = variant("noshard2")
    ps[1].unlink()
    out["split_missing"] = ps[0]
    ps = variant("wrongno")
    _set_split_key(ps[2], "split.no", 1)  # the third shard claims to be the second
    out["split_wrong_no"] = ps[0]
    ps = variant("wrongcount")
    _set_split_key(ps[1], "split.count", 4)  # a shard of another (4-way) split run
    out["split_wrong_count"] = ps[0]
    ps = variant("ntensors")
    _set_split_key(ps[0], "split.tensors.count", 999)
    out["split_tensor_count"] = ps[0]
    ps = variant("renamed")
    out["split_renamed"] = d / "f8.gguf"  # the first shard under a name llama.cpp cannot expand
    shutil.copy(ps[0], out["split_renamed"])
    out["split_renamed_count"] = d / "four-00001-of-00004.gguf"  # name says 4 shards, split.count says 3
    shutil.copy(good[0], out["split_renamed_count"])
    # headers that llama.cpp would abort on (GGML_ASSERT) or refuse, each a copy of the small MoE
    def edited(tag: str, edit) -> Path:
        p = d / f"h{len(out)}.gguf"
        shutil.copy(small, p)
        r = gguf.GGUFReader(p, "r+")
        edit(r)
        r.data.flush()
        del r
        out[tag] = p
        return p

    def set_kv(key, v):
        return lambda r: r.fields[key].parts[-1].__setitem__(0, v)

    edited("layers0", set_kv("llama.block_count", 0))
    edited("layers4096", set_kv("llama.block_count", 4096))
    edited("topk0", set_kv("llama.expert_used_count", 0))
    edited("topk9", set_kv("llama.expert_used_count", 9))
    # the last tensor moved one alignment unit on: aligned, no overlap, but not packed
    edited("gap", lambda r: r.tensors[-1].field.parts[-1].__setitem__(0, int(r.tensors[-1].field.parts[-1][0]) + 32))
    with open(out["gap"], "ab") as fh:
        fh.write(bytes(32))  # so the moved tensor still ends inside the file
    edited("badkey", lambda r: r.fields["llama.expert_count"].parts[1].__setitem__(0, 0xFF))  # not UTF-8
    edited("badtype", lambda r: r.fields["llama.expert_count"].parts[2].__setitem__(0, 77))  # no such value type
    # per-layer top-k arrays with a 0 or a negative entry (their max passes; llama.cpp segfaults / aborts)
    for tag, arr in (("topk_arr0", [2, 0, 2]), ("topk_arr_neg", [2, -1, 2])):
        write_moe(d / f"{tag}.gguf", [LayerSpec(i, "Q8_0", 64, 32) for i in range(3)], n_expert=8, n_expert_used=arr)
        out[tag] = d / f"{tag}.gguf"
    # a tensor in two shards: shard 2 of a split that also put token_embd there replaces shard 2
    out["split_dup"] = split_gguf(small, d / "dup", 2)[0]
    split_gguf(small, d / "dupx", 2, shard_of=lambda i, name: 1 if name == "token_embd.weight" or name.startswith("blk.1.") else 0)
    shutil.copy(d / "dupx-00002-of-00002.gguf", d / "dup-00002-of-00002.gguf")
    return out


@pytest.fixture(scope="module")
def sess(f):
    """One paged Session at the smallest arena on the tiny model, shared by the call rows."""
    lay = epqlab.inspect(f["tiny"])
    s = epqlab.Session(f["tiny"], arena_bytes=epqlab.Pager.min_arena_bytes(lay), n_threads=1, n_ctx=256)
    yield s
    s.close()


def S(path_key, **kw):
    return lambda f, s: epqlab.Session(f[path_key], n_threads=kw.pop("n_threads", 1), **kw)


def I(path_key, **kw):
    return lambda f, s: epqlab.inspect(f[path_key], **kw)


def _closed(f, s):
    t = epqlab.Session(f["tiny"], pager=False, n_threads=1, n_ctx=256)
    t.close()
    t.generate("hi", 2)


def _pager(**kw):
    def go(f, s):
        lay = epqlab.inspect(f["tiny"])
        a = kw.pop("arena", epqlab.Pager.min_arena_bytes(lay))
        return epqlab.Pager(lay, a, io_threads=1, **kw)
    return go


def _pager_load(layer, ids):
    def go(f, s):
        lay = epqlab.inspect(f["tiny"])
        epqlab.Pager(lay, epqlab.Pager.min_arena_bytes(lay), io_threads=1).load_layer(layer, ids)
    return go


ROWS = [
    # -- files ----------------------------------------------------------------------------------
    ("missing", I("missing"), ModelNotFoundError, "not found"),
    ("directory", I("dir"), ModelNotFoundError, "not a regular file"),
    ("empty", I("empty"), NotGGUFError, "is empty (0 bytes)"),
    ("text file", I("text"), NotGGUFError, "not a GGUF file"),
    ("safetensors", I("safetensors"), NotGGUFError, "not a GGUF file"),
    ("version 99", I("v99"), NotGGUFError, "version"),
    ("cut after magic", I("cut_magic"), TruncatedModelError, "truncated"),
    ("cut after version", I("cut_version"), TruncatedModelError, "truncated"),
    ("cut in counts", I("cut_counts"), TruncatedModelError, "truncated"),
    ("cut in metadata", I("cut_kv"), TruncatedModelError, "truncated"),
    ("cut in tensor infos", I("cut_tensor_info"), TruncatedModelError, "truncated"),
    ("cut in last tensor info", I("cut_last_tensor_info"), TruncatedModelError, "truncated"),
    ("cut at data start", I("cut_data_start"), TruncatedModelError, "truncated"),
    ("cut in data", I("cut_data_mid"), TruncatedModelError, "truncated"),
    ("cut last byte", I("cut_last_byte"), TruncatedModelError, "truncated"),
    ("Session on truncated", S("cut_data_mid"), TruncatedModelError, "truncated"),
    ("Session on text", S("text"), NotGGUFError, "not a GGUF file"),
    ("dense model paged", S("dense"), NotMoEError, "dense model"),
    ("dense model inspect", I("dense"), NotMoEError, "dense model"),
    ("dense model route log", S("dense", pager=False, route_log="r.npz"), NotMoEError, "dense model"),
    ("dense model expert_used", S("dense", pager=False, expert_used=2), ValueError, "dense"),
    ("block_count 0", I("layers0"), NotGGUFError, "block_count is missing or 0"),
    ("block_count 4096", I("layers4096"), NotGGUFError, "block_count is 4096, but llama.cpp needs 1..512"),
    ("top-k 0", I("topk0"), NotGGUFError, "expert_used_count is missing or 0"),
    ("top-k above experts", I("topk9"), NotGGUFError, "expert_used_count is 9, but llama.cpp needs 1..8"),
    ("Session top-k 0", S("topk0"), NotGGUFError, "expert_used_count is missing or 0"),
    ("per-layer top-k with a 0", I("topk_arr0"), NotGGUFError, "expert_used_count is 0 in its per-layer array"),
    ("per-layer top-k with -1", I("topk_arr_neg"), NotGGUFError, "expert_used_count is -1 in its per-layer array"),
    ("Session per-layer top-k 0", S("topk_arr0"), NotGGUFError, "every layer's value in 1..8"),
    ("tensor data not packed", I("gap"), NotGGUFError, "but the tensors before it in the header end at"),
    ("key not UTF-8", I("badkey"), NotGGUFError, "header is corrupt"),
    ("unknown value type", I("badtype"), NotGGUFError, "header is corrupt"),
    # -- split sets -----------------------------------------------------------------------------
    ("split missing shard", I("split_missing"), SplitModelError, "is missing"),
    ("split shard numbers", I("split_wrong_no"), SplitModelError, "split.no=1"),
    ("split shard of other run", I("split_wrong_count"), SplitModelError, "split.count=4"),
    ("split tensor count", I("split_tensor_count"), SplitModelError, "split.tensors.count says 999"),
    ("split renamed shard", I("split_renamed"), SplitModelError, "-of-00003.gguf"),
    ("split name count", I("split_renamed_count"), SplitModelError, "name does not end in"),
    ("split duplicated tensor", I("split_dup"), NotGGUFError, "token_embd.weight is also in"),
    ("Session on split missing", S("split_missing"), SplitModelError, "is missing"),
    # -- sizes, policies, threads, context ------------------------------------------------------
    ("budget word", S("tiny", ram_budget="lots"), ValueError, "not a byte count"),
    ("budget negative", S("tiny", ram_budget=-1), ValueError, ">= 0"),
    ("budget 0.5", S("tiny", ram_budget=0.5), ValueError, "0.5 is not a whole number of bytes"),
    ("budget '0.5'", S("tiny", ram_budget="0.5"), ValueError, "'0.5' is not a whole number of bytes"),
    ("budget 1e30", S("tiny", ram_budget=1e30), ValueError, "too large"),
    ("budget tiny", S("tiny", ram_budget="1KiB"), ArenaTooSmall, "smallest budget that works"),
    ("arena 1 byte", S("tiny", arena_bytes=1), ArenaTooSmall, "smallest arena that works"),
    ("arena nan", S("tiny", arena_bytes=float("nan")), ValueError, "not a byte count"),
    ("reserve negative", S("tiny", reserve="-5MiB"), ValueError, "not a byte count"),
    ("policy unknown", S("tiny", policy="fifo"), ValueError, "unknown eviction policy"),
    ("policy None", S("tiny", policy=None), ValueError, "unknown eviction policy"),
    ("policy belady live", S("tiny", policy="belady"), ValueError, "needs the future routes"),
    ("dense_weights unknown", S("tiny", dense_weights="ram"), ValueError, "unknown dense_weights"),
    ("io_threads 0", S("tiny", io_threads=0), ValueError, "io_threads must be >= 1"),
    ("io_threads huge", S("tiny", io_threads=10**6), ValueError, "io_threads must be <="),
    ("n_threads 0", S("tiny", n_threads=0), ValueError, "n_threads must be >= 1"),
    ("n_threads negative", S("tiny", n_threads=-4), ValueError, "n_threads must be >= 1"),
    ("n_threads huge", S("tiny", n_threads=10**6), ValueError, "n_threads must be <="),
    ("n_threads str", S("tiny", n_threads="4"), ValueError, "n_threads must be an integer"),
    ("n_ctx 0", S("tiny", n_ctx=0), ValueError, "n_ctx must be >= 1"),
    ("n_ctx float", S("tiny", n_ctx=1.5), ValueError, "n_ctx must be an integer"),
    ("n_ctx 255", S("tiny", n_ctx=255), ValueError,
     "n_ctx=255 is below llama.cpp's smallest context of 256 tokens per sequence (it would silently become 256); "
     "give n_ctx=256 or more"),
    ("n_ctx huge", S("tiny", n_ctx=50_000_000), epqlab.LlamaCppError, "could not create a context"),
    ("n_batch 0", S("tiny", n_batch=0), ValueError, "n_batch must be >= 1"),
    ("n_ubatch 0", S("tiny", n_ubatch=0), ValueError, "n_ubatch must be >= 1"),
    ("expert_used 0", S("tiny", expert_used=0), ValueError, "outside 1..8"),
    ("expert_used 99", S("tiny", expert_used=99), ValueError, "outside 1..8"),
    # -- calls on an open Session ---------------------------------------------------------------
    ("empty prompt", lambda f, s: s.generate("", 2, add_special=False), ValueError, "empty prompt"),
    ("empty token list", lambda f, s: s.generate([], 2), ValueError, "empty prompt"),
    ("stream empty prompt", lambda f, s: next(s.stream([], 2)), ValueError, "empty prompt"),
    ("negative token id", lambda f, s: s.generate([1, -1, 2], 2), ValueError, "token ids must be in"),
    ("token id = n_vocab", lambda f, s: s.generate([1, s.n_vocab], 2), ValueError, "token ids must be in"),
    ("token id 2**40", lambda f, s: s.logits([2**40]), ValueError, "token ids must be in"),
    ("float token ids", lambda f, s: s.logits([1.5, 2.0]), ValueError, "token ids must be integers"),
    ("prompt None", lambda f, s: s.generate(None, 2), TypeError, "prompt must be a str or a sequence of token ids"),
    ("logits of nothing", lambda f, s: s.logits([]), ValueError, "no tokens"),
    ("n_predict negative", lambda f, s: s.generate([1, 2], -1), ValueError, "n_predict must be >= 0"),
    ("prompt beyond n_ctx", lambda f, s: s.generate([1] * 300, 2), ValueError, "exceed the context"),
    ("temperature nan", lambda f, s: s.generate([1, 2], 2, temperature=float("nan")), ValueError, "temperature"),
    ("closed session", _closed, EpqlabError, "closed"),
    ("perplexity of one token", lambda f, s: s.perplexity("a"), ValueError, "at least 2 tokens"),
    ("chat messages str", lambda f, s: s.chat_prompt("hi"), ValueError, "messages must be a list"),
    ("route_log without recording", lambda f, s: s.route_log(), EpqlabError, "route_log=PATH"),
    # -- Pager ----------------------------------------------------------------------------------
    ("pager arena too small", _pager(arena=4096), ArenaTooSmall, "smallest arena that works"),
    ("pager policy", _pager(policy="mru"), ValueError, "unknown eviction policy"),
    ("pager top-k 0", _pager(n_expert_used=99), ValueError, "n_expert_used=99"),
    ("pager layer w/o experts", _pager_load(99, [0]), ValueError, "no routed experts"),
    ("pager expert id", _pager_load(0, [8]), IndexError, "out of range"),
]


@pytest.mark.parametrize("call,exc,fragment", [r[1:] for r in ROWS], ids=[r[0] for r in ROWS])
def test_bad_input(f, sess, call, exc, fragment, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(exc) as ei:
        call(f, sess)
    assert fragment in str(ei.value), str(ei.value)


def test_session_usable_after_bad_calls(sess):
    # Each row above that failed on the shared session left it usable: its output equals a fresh session's.
    got = sess.generate([1, 2, 3, 4], 4).tokens
    lay = sess.layout
    with epqlab.Session(lay.path, arena_bytes=epqlab.Pager.min_arena_bytes(lay), n_threads=1, n_ctx=256) as s2:
        assert s2.generate([1, 2, 3, 4], 4).tokens == got


CLI_ROWS = [
    # (id, argv with {key} file placeholders, exit code, fragment)
    ("info missing", ["info", "{missing}"], 1, "not found"),
    ("info directory", ["info", "{dir}"], 1, "not a regular file"),
    ("info empty", ["info", "{empty}"], 1, "is empty (0 bytes)"),
    ("info truncated", ["info", "{cut_kv}"], 1, "truncated"),
    ("info dense", ["info", "{dense}"], 1, "dense model"),
    ("info split missing", ["info", "{split_missing}"], 1, "is missing"),
    ("run text", ["run", "{text}", "-n", "1"], 1, "not a GGUF file"),
    ("run empty prompt", ["run", "{tiny}", "-p", "", "-n", "1", "--no-pager"], 1, "empty prompt"),
    ("run threads 0", ["run", "{tiny}", "-n", "1", "--threads", "0"], 1, "n_threads must be >= 1"),
    ("run io threads 0", ["run", "{tiny}", "-n", "1", "--io-threads", "0"], 1, "io_threads must be >= 1"),
    ("run n_ctx 10", ["run", "{tiny}", "-n", "1", "--n-ctx", "10"], 2,
     "epqlab: error: --n-ctx 10 is below llama.cpp's smallest context of 256 tokens per sequence (it would silently "
     "become 256); give --n-ctx 256 or more"),
    ("run budget tiny", ["run", "{tiny}", "-n", "1", "--ram-budget", "1KiB"], 1, "smallest budget that works"),
    ("run n negative", ["run", "{tiny}", "-n", "-5"], 1, "n_predict must be >= 0"),
    ("run split wrong count", ["run", "{split_wrong_count}", "-n", "1"], 1, "split.count=4"),
    ("routes missing", ["routes", "{missing}"], 1, "does not exist"),
    ("policy choice", ["run", "{tiny}", "--policy", "fifo"], 2, "invalid choice"),
    ("threads not int", ["run", "{tiny}", "--threads", "two"], 2, "invalid int value"),
]


@pytest.mark.parametrize("argv,code,fragment", [r[1:] for r in CLI_ROWS], ids=[r[0] for r in CLI_ROWS])
def test_cli_bad_input(f, argv, code, fragment):
    argv = [a.format(**{k: str(v) for k, v in f.items()}) for a in argv]
    r = subprocess.run([sys.executable, "-m", "epqlab", *argv], capture_output=True, text=True, timeout=300)
    assert r.returncode == code, (r.returncode, r.stdout[-500:], r.stderr[-1500:])
    assert "Traceback" not in r.stderr, r.stderr
    errs = [line for line in r.stderr.splitlines() if "error:" in line]
    assert len(errs) == 1 and fragment in errs[0], r.stderr
    if code == 1:
        assert r.stderr.startswith("epqlab: error:"), r.stderr
    if "-n" in argv and argv[argv.index("-n") + 1].startswith("-"):
        assert r.stdout == "", r.stdout  # refused before the prompt is echoed: no message glued to it
