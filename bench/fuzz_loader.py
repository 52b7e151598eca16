"""Fuzz the GGUF loader path: mutants of small synthetic models, each run as ``epqlab.inspect`` +
``epqlab.Session`` load + one short decode in a forked child (docs/DESIGN.md §1: bad input gets a
named exception, never a signal). A child killed by a signal (a llama.cpp ``GGML_ASSERT`` abort,
a segfault) or still running after ``--timeout`` seconds (a hang) is a failure; a named exception
(epqlab's, or llama.cpp's refusal surfacing as one) or a normal decode is a pass.

Bases (both built from epqlab's own writers, so no download):
- ``bpe``: ``epqlab.models.synthesize(..., "tiny")`` (qwen3moe, SmolLM2's GPT-2 BPE tokenizer with
  merges) cut to a 512-token vocabulary (tests/ggufs.py ``shrink_vocab``), plus a
  ``tokenizer.ggml.scores`` array so that scores are fuzzed too: a 15 KiB header.
- ``spm``: ``epqlab.models.archs.write_tiny(..., "llama")`` (Mixtral-style, a 355-token
  SentencePiece vocabulary with scores, token types and byte tokens).

Mutations of the header bytes (1-3 per mutant, from a seeded ``random.Random``): bit flips;
integer fields (counts, key/string lengths, value types, array item types and lengths, scalar
values, tensor name lengths, dims, types and offsets) set to boundary values (0, 1, -1, 2**31,
2**63, the original +-1, ...); value and tensor type tags changed (to any id, or to a type of the
same element size); array lengths changed; tokenizer array elements edited (a token made a copy
of another, token bytes, merge strings without their space, token types, scores to NaN/inf,
special token ids to n_vocab and beyond); truncation.

    .venv/bin/python bench/fuzz_loader.py --trials 1000 --seed 1 --out /tmp/fuzz.json
    .venv/bin/python bench/fuzz_loader.py --trials 300 --archs deepseek2,dots1,gpt-oss --only-archs

prints one line per failure and a table of outcome classes; ``--out`` writes every trial
(mutations, class, message, the child's last stderr line) as JSON. tests/test_fuzz.py runs a
fixed-seed sample of 40.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import random
import signal
import struct
import sys
import tempfile
import time
from pathlib import Path

from epqlab.models.gguf_rewrite import rewrite_gguf

HERE = Path(__file__).resolve().parent

PROMPT = "Hello world\n"  # goes through the tokenizer (BPE merges / SPM byte fallback) and a newline


# ---- bases -------------------------------------------------------------------------------------

def make_bases(workdir: Path, mini: Path | None = None, archs: tuple[str, ...] = ()) -> dict[str, Path]:
    """Write the ``bpe`` and ``spm`` bases into ``workdir`` (see the module docstring); ``mini``: an
    existing 512-token cut of the tiny preset to start the ``bpe`` base from (tests' ``mini_gguf``);
    ``archs``: more bases, ``epqlab.models.archs.write_tiny`` of these architectures (e.g. ``deepseek2``,
    ``dots1``, ``gpt-oss``: their own hyperparameters, the SentencePiece vocabulary)."""
    from epqlab.models.archs import write_tiny

    workdir.mkdir(parents=True, exist_ok=True)
    out = {}
    for a in archs:
        p = workdir / f"base_{a}.gguf"
        if not p.exists():
            write_tiny(p, a)
        out[a] = p
    bpe = workdir / "base_bpe.gguf"
    if not bpe.exists():
        if mini is None:
            sys.path.insert(0, str(HERE.parent / "tests"))
            from ggufs import shrink_vocab

            from epqlab.models import synthesize

            tiny = workdir / "tiny.gguf"
            synthesize(tiny, "tiny", progress=False)
            mini = shrink_vocab(tiny, workdir / "mini.gguf", 512)
            tiny.unlink()
        _add_scores(mini, bpe)
    out["bpe"] = bpe
    spm = workdir / "base_spm.gguf"
    if not spm.exists():
        write_tiny(spm, "llama", n_layer=2)
    out["spm"] = spm
    return out


def _add_scores(src: Path, dst: Path) -> None:
    """Copy ``src`` adding ``tokenizer.ggml.scores`` (float32 zeros, one per token) after the tokens."""
    import gguf

    n = len(gguf.GGUFReader(src).fields["tokenizer.ggml.tokens"].data)
    rewrite_gguf(src, dst, after_key={"tokenizer.ggml.tokens": lambda w: w.add_token_scores([0.0] * n)})


# ---- where the header's fields are -------------------------------------------------------------

class Catalog:
    """Byte slots of a GGUF header from gguf-py's parse. ``ints``: (label, offset, width, kind) with kind
    one of count, key_len, vtype, str_len, itype, alen, value, elem, tname_len, n_dims, dim, ttype,
    toff; ``strs``: (label, offset, length, kind) with kind key, str, token, merge, tname;
    ``tokens`` / ``merges``: (offset, length) of each element's bytes; ``data_offset``: end of header."""

    def __init__(self, path: Path):
        import gguf

        r = gguf.GGUFReader(path)
        self.data = path.read_bytes()
        base = r.data.ctypes.data
        off = lambda part: part.ctypes.data - base  # noqa: E731
        ints = [("version", 4, 4, "count"), ("tensor_count", 8, 8, "count"), ("kv_count", 16, 8, "count")]
        strs = []
        self.tokens, self.merges, self.elems = [], [], {}
        self.special = []
        self.n_vocab = 0
        for name, f in r.fields.items():
            if name.startswith("GGUF."):
                continue
            p = f.parts
            ints += [(f"{name}:key_len", off(p[0]), 8, "key_len"), (f"{name}:type", off(p[2]), 4, "vtype")]
            strs.append((f"{name}:key", off(p[1]), len(p[1]), "key"))
            vt = gguf.GGUFValueType(int(p[2][0]))
            if vt == gguf.GGUFValueType.STRING:
                ints.append((f"{name}:str_len", off(p[3]), 8, "str_len"))
                if len(p[4]):
                    strs.append((f"{name}:str", off(p[4]), len(p[4]), "str"))
            elif vt == gguf.GGUFValueType.ARRAY:
                ints += [(f"{name}:item_type", off(p[3]), 4, "itype"), (f"{name}:array_len", off(p[4]), 8, "alen")]
                it = gguf.GGUFValueType(int(p[3][0]))
                if it == gguf.GGUFValueType.STRING:
                    items = [(off(p[i]), len(p[i])) for i in f.data]
                    lens = [(off(p[i - 1]), 8) for i in f.data]
                    if name == "tokenizer.ggml.tokens":
                        self.tokens, self.token_lens = items, lens
                        self.n_vocab = len(items)
                    elif name == "tokenizer.ggml.merges":
                        self.merges, self.merge_lens = items, lens
                else:
                    self.elems[name] = [(off(p[i]), p[i].nbytes, it) for i in f.data]
            elif len(p) > 3 and p[3].nbytes in (1, 2, 4, 8):
                ints.append((f"{name}:value", off(p[3]), p[3].nbytes, "value"))
                if name.startswith("tokenizer.ggml.") and name.endswith("_token_id"):
                    self.special.append((name, off(p[3]), p[3].nbytes))
        for t in r.tensors:
            p = t.field.parts  # name_len, name, n_dims, dims, type, offset
            ints += [(f"{t.name}:name_len", off(p[0]), 8, "tname_len"), (f"{t.name}:n_dims", off(p[2]), 4, "n_dims"),
                     (f"{t.name}:type", off(p[4]), 4, "ttype"), (f"{t.name}:offset", off(p[5]), 8, "toff")]
            ints += [(f"{t.name}:dim{i}", off(p[3]) + 8 * i, 8, "dim") for i in range(len(p[3]))]
            strs.append((f"{t.name}:name", off(p[1]), len(p[1]), "tname"))
        self.ints, self.strs = ints, strs
        self.data_offset = int(r.tensors[0].data_offset) if r.tensors else len(self.data)
        self.hp_values = [s for s in ints if s[3] == "value" and not s[0].startswith(("tokenizer.", "general."))]


# ---- mutations ---------------------------------------------------------------------------------

_SAME_SIZE = [(0, 26), (1, 25, 30), (2, 20), (27, 28)]  # ggml type ids of one element size: F32/I32, F16/I16/BF16, Q4_0/IQ4_NL, I64/F64


def _bounds(width: int, orig: int, rng: random.Random) -> int:
    top = 2 ** (8 * width) - 1
    vals = [0, 1, 2, top, top - 1, 2 ** (8 * width - 1), 2 ** (8 * width - 1) - 1, orig + 1, orig - 1, orig * 2,
            orig // 2, 2**31, 2**31 - 1, 2**32 - 1, 2**16, rng.randrange(top + 1)]
    return rng.choice([v for v in vals if 0 <= v <= top])


def mutate(cat: Catalog, rng: random.Random) -> tuple[bytes, list[str]]:
    """One mutant of ``cat``'s file: (bytes, descriptions of the 1-3 mutations applied)."""
    hdr = bytearray(cat.data[:cat.data_offset])
    tail = cat.data[cat.data_offset:]
    desc = []

    def put(o, w, v):
        hdr[o:o + w] = int(v).to_bytes(w, "little")

    def get(o, w):
        return int.from_bytes(hdr[o:o + w], "little")

    ops = ["flip", "int", "hparam", "vtype", "ttype", "alen", "token", "merge", "elem", "special", "str"]
    weights = [2, 2, 5, 1, 2, 1, 4, 3, 3, 3, 1]  # most mutants keep the header parseable, to reach llama.cpp
    cut = None
    for _ in range(rng.choice((1, 1, 1, 1, 2, 3))):
        op = rng.choices(ops, weights)[0]
        if op == "flip":
            o = rng.randrange(len(hdr))
            b = 1 << rng.randrange(8) if rng.random() < 0.7 else rng.randrange(1, 256)
            hdr[o] ^= b
            desc.append(f"flip byte {o} ^{b:#x}")
        elif op in ("int", "hparam"):
            pool = cat.ints if op == "int" or not cat.hp_values else cat.hp_values
            label, o, w, _ = rng.choice(pool)
            v = _bounds(w, get(o, w), rng)
            put(o, w, v)
            desc.append(f"{label}={v}")
        elif op == "vtype":
            label, o, w, _ = rng.choice([s for s in cat.ints if s[3] in ("vtype", "itype")])
            v = rng.randrange(0, 16) if rng.random() < 0.9 else rng.choice((2**31, 2**32 - 1))
            put(o, w, v)
            desc.append(f"{label}={v}")
        elif op == "ttype":
            label, o, w, _ = rng.choice([s for s in cat.ints if s[3] == "ttype"])
            orig = get(o, w)
            same = next((g for g in _SAME_SIZE if orig in g), ())
            if len(same) > 1 and rng.random() < 0.5:
                v = rng.choice([x for x in same if x != orig])
            else:
                v = rng.randrange(0, 45)
            put(o, w, v)
            desc.append(f"{label}={v}")
        elif op == "alen":
            label, o, w, _ = rng.choice([s for s in cat.ints if s[3] == "alen"])
            orig = get(o, w)
            v = rng.choice([0, 1, orig - 1, orig + 1, orig // 2, orig * 2, 2**32, 2**63])
            put(o, w, max(v, 0))
            desc.append(f"{label}={v}")
        elif op == "token" and cat.tokens:
            i = rng.randrange(len(cat.tokens))
            o, n = cat.tokens[i]
            kind = rng.random()
            same = [j for j, (_, m) in enumerate(cat.tokens) if m == n and j != i]
            if kind < 0.5 and same:
                j = rng.choice(same)
                oj = cat.tokens[j][0]
                hdr[o:o + n] = cat.data[oj:oj + n]
                desc.append(f"token {i} := token {j} ({bytes(hdr[o:o + n])[:16]!r})")
            elif kind < 0.8 and n:
                hdr[o:o + n] = bytes(rng.randrange(256) for _ in range(n))
                desc.append(f"token {i} bytes := {bytes(hdr[o:o + n])[:16]!r}")
            else:
                lo, lw = cat.token_lens[i]
                v = rng.choice([0, n + 1, max(n - 1, 0), 2**32])
                put(lo, lw, v)
                desc.append(f"token {i} len={v}")
        elif op == "merge" and cat.merges:
            i = rng.randrange(len(cat.merges))
            o, n = cat.merges[i]
            s = bytes(hdr[o:o + n])
            if b" " in s and rng.random() < 0.5:
                s = s.replace(b" ", rng.choice([b"x", b"\n", b"\x00"]))
            else:
                s = bytes(rng.randrange(256) for _ in range(n))
            hdr[o:o + n] = s
            desc.append(f"merge {i} := {s[:16]!r}")
        elif op == "elem" and cat.elems:
            name = rng.choice(sorted(cat.elems))
            o, w, it = rng.choice(cat.elems[name])
            if it.name == "FLOAT32":
                v = rng.choice([float("nan"), float("inf"), -float("inf"), 3e38, -1e9])
                hdr[o:o + 4] = struct.pack("<f", v)
            else:
                v = _bounds(w, get(o, w), rng) if rng.random() < 0.5 else rng.randrange(-2, 9) % 2**(8 * w)
                put(o, w, v)
            desc.append(f"{name}[{(o - cat.elems[name][0][0]) // w}]={v}")
        elif op == "special" and cat.special:
            name, o, w = rng.choice(cat.special)
            v = rng.choice([cat.n_vocab, cat.n_vocab - 1, cat.n_vocab + 1, 2**31, 2**32 - 1, 0])
            put(o, w, v % 2**(8 * w))
            desc.append(f"{name}={v}")
        elif op == "str":
            label, o, n, _ = rng.choice(cat.strs)
            hdr[o:o + n] = bytes(rng.randrange(256) for _ in range(n))
            desc.append(f"{label} := {bytes(hdr[o:o + n])[:16]!r}")
        else:
            continue
    if not desc or rng.random() < 0.05:
        size = len(hdr) + len(tail)
        cut = rng.randrange(len(hdr)) if rng.random() < 0.6 else rng.randrange(len(hdr), size)
        desc.append(f"cut at {cut} of {size}")
    blob = bytes(hdr) + tail
    return (blob[:cut] if cut is not None else blob), desc


# ---- one trial in a child ----------------------------------------------------------------------

def _trial(path: str) -> dict:
    """inspect + Session + a 2-token decode of ``path``: {stage, class, msg}. Runs in the child."""
    import epqlab
    from epqlab.errors import EpqlabError

    stage = "inspect"
    try:
        epqlab.inspect(path)
        stage = "load"
        with epqlab.Session(path, n_threads=1, n_ctx=256, io_threads=1) as s:
            stage = "decode"
            s.generate(PROMPT, 2)
        return {"stage": "done", "class": "ok", "msg": ""}
    except Exception as e:  # noqa: BLE001 -- classified, not swallowed: the parent records it
        named = isinstance(e, EpqlabError)
        cls = ("refused by inspect: " if stage == "inspect" else f"{stage}: ") + type(e).__name__
        return {"stage": stage, "class": cls if named else f"{cls} (not an epqlab error)", "msg": str(e)[:400]}


def run_child(path: Path, timeout: float, mem_limit: int | None = 8 << 30) -> dict:
    """Fork, run :func:`_trial` on ``path`` in the child (stderr to a file, address space capped at
    ``mem_limit`` bytes), and classify: the child's answer, ``SIGNAL <name>`` or ``HANG``."""
    err = tempfile.NamedTemporaryFile(prefix="fuzzerr", delete=False)
    rfd, wfd = os.pipe()
    t0 = time.monotonic()
    pid = os.fork()
    if pid == 0:  # child
        try:
            os.close(rfd)
            os.dup2(err.fileno(), 2)
            os.dup2(err.fileno(), 1)
            os.environ["GGML_NO_BACKTRACE"] = "1"  # ggml's abort would otherwise attach gdb for a backtrace
            if mem_limit:
                import resource

                resource.setrlimit(resource.RLIMIT_AS, (mem_limit, mem_limit))
            res = _trial(str(path))
        except BaseException as e:  # noqa: BLE001
            res = {"stage": "?", "class": f"child error {type(e).__name__}", "msg": str(e)[:400]}
        os.write(wfd, json.dumps(res).encode())
        os._exit(0)
    os.close(wfd)
    status = None
    while True:
        done, st = os.waitpid(pid, os.WNOHANG)
        if done:
            status = st
            break
        if time.monotonic() - t0 > timeout:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            break
        time.sleep(0.01)
    with os.fdopen(rfd, "rb") as fh:
        raw = fh.read()
    err.close()
    tail = Path(err.name).read_text(errors="replace").strip().splitlines()
    os.unlink(err.name)
    last = next((line for line in reversed(tail) if "GGML_A" in line or "fatal" in line), None)
    last = last or next((line for line in reversed(tail) if "error" in line.lower()), tail[-1] if tail else "")
    if status is None:
        res = {"stage": "?", "class": "HANG", "msg": f"still running after {timeout:.0f} s"}
    elif os.WIFSIGNALED(status):
        res = {"stage": "?", "class": f"SIGNAL {signal.Signals(os.WTERMSIG(status)).name}", "msg": ""}
    elif raw:
        res = json.loads(raw)
    else:
        res = {"stage": "?", "class": f"exit {os.WEXITSTATUS(status)} without an answer", "msg": ""}
    res["stderr"] = last[-300:]
    res["seconds"] = round(time.monotonic() - t0, 2)
    return res


def is_failure(res: dict) -> bool:
    """A signal, a hang, or a child that died without answering."""
    return res["class"].startswith(("SIGNAL", "HANG", "exit", "child error"))


def fuzz(bases: dict[str, Path], trials: int, seed: int, workdir: Path, timeout: float = 60.0, log=print,
         jsonl: Path | None = None) -> list[dict]:
    """Run ``trials`` mutants (alternating bases) from ``seed``; returns one record per trial (each also
    appended to ``jsonl`` as one JSON line when given, so an interrupted run keeps its record)."""
    cats = {k: Catalog(p) for k, p in bases.items()}
    names = sorted(cats)
    rng = random.Random(seed)
    out = []
    for i in range(trials):
        base = names[i % len(names)]
        blob, desc = mutate(cats[base], rng)
        p = workdir / f"mutant{i}.gguf"
        p.write_bytes(blob)
        res = run_child(p, timeout)
        p.unlink()
        res.update(trial=i, base=base, mutations=desc)
        out.append(res)
        if jsonl is not None:
            with open(jsonl, "a") as fh:
                fh.write(json.dumps(res) + "\n")
        if is_failure(res):
            log(f"[fuzz] FAIL trial {i} ({base}): {res['class']}: {'; '.join(desc)} | {res['stderr']}")
    return out


def summary(records: list[dict]) -> str:
    """Table of outcome classes (count, share) with the number of Session-loading trials."""
    c = collections.Counter(r["class"] for r in records)
    loaded = sum(r["stage"] in ("load", "decode", "done") for r in records)
    n = len(records)
    lines = [f"trials {n}; past inspect into the Session load {loaded}; "
             f"signals {sum(r['class'].startswith('SIGNAL') for r in records)}; "
             f"hangs {sum(r['class'] == 'HANG' for r in records)}", ""]
    lines += [f"{k:<70} {v:>6} {v / max(n, 1):>7.1%}" for k, v in c.most_common()]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds before a child counts as hung")
    ap.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "epqlab-fuzz")
    ap.add_argument("--out", type=Path, help="write every trial as JSON here")
    ap.add_argument("--archs", default="", help="more bases: comma-separated write_tiny architectures")
    ap.add_argument("--only-archs", action="store_true", help="fuzz only the --archs bases")
    a = ap.parse_args(argv)
    archs = tuple(x for x in a.archs.split(",") if x)
    bases = make_bases(a.workdir, archs=archs)
    if a.only_archs:
        bases = {k: v for k, v in bases.items() if k in archs}
    t0 = time.time()
    recs = fuzz(bases, a.trials, a.seed, a.workdir, a.timeout,
                jsonl=a.out.with_suffix(".jsonl") if a.out else None)
    print(summary(recs))
    print(f"\n{time.time() - t0:.0f} s")
    if a.out:
        a.out.write_text(json.dumps(recs, indent=1))
    return 1 if any(is_failure(r) for r in recs) else 0


if __name__ == "__main__":
    sys.exit(main())
