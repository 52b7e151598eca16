"""Child process of tests/test_fuzz.py: hypothesis mutates a GGUF header (counts, value types,
string and array lengths, string bytes, tensor dims, types and offsets, truncation) and feeds
each mutant to ``epqlab.inspect`` or ``epqlab.Session``. An epqlab error is fine; any other
exception fails the hypothesis run (exit 1); a signal kills this process,
and the parent reports it with the last mutant, which is printed to stderr before each call.

    python tests/fuzz_gguf.py {inspect|session} BASE.gguf WORKDIR N_EXAMPLES
"""
from __future__ import annotations

import sys
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import epqlab
from epqlab.errors import EpqlabError

# What a bad header may raise: epqlab's own errors, which name the file, the key or tensor, and
# the fix (anything else -- a numpy or gguf-py error leaking through -- fails the run).
ACCEPTED = (EpqlabError,)


def catalog(path: Path) -> tuple[list, list]:
    """Byte slots of the header, from gguf-py's parse: ``ints`` = (label, offset, width) of every
    integer the parser reads (counts, lengths, types, dims, offsets, scalar values); ``strs`` =
    (label, offset, length) of key, string-value and tensor-name bytes."""
    import gguf

    r = gguf.GGUFReader(path)
    base = r.data.ctypes.data
    ints = [("version", 4, 4), ("tensor_count", 8, 8), ("kv_count", 16, 8)]
    strs = []

    def off(part) -> int:
        return part.ctypes.data - base

    for name, f in r.fields.items():
        if name.startswith("GGUF."):
            continue
        p = f.parts
        ints += [(f"{name}:key_len", off(p[0]), 8), (f"{name}:type", off(p[2]), 4)]
        strs.append((f"{name}:key", off(p[1]), len(p[1])))
        vt = gguf.GGUFValueType(int(p[2][0]))
        if vt == gguf.GGUFValueType.STRING:
            ints.append((f"{name}:str_len", off(p[3]), 8))
            if len(p[4]):
                strs.append((f"{name}:str", off(p[4]), len(p[4])))
        elif vt == gguf.GGUFValueType.ARRAY:
            ints += [(f"{name}:item_type", off(p[3]), 4), (f"{name}:array_len", off(p[4]), 8)]
        elif len(p) > 3 and p[3].nbytes in (1, 2, 4, 8):
            ints.append((f"{name}:value", off(p[3]), p[3].nbytes))
    for t in r.tensors:
        p = t.field.parts  # name_len, name, n_dims, dims, type, offset
        ints += [(f"{t.name}:name_len", off(p[0]), 8), (f"{t.name}:n_dims", off(p[2]), 4),
                 (f"{t.name}:type", off(p[4]), 4), (f"{t.name}:offset", off(p[5]), 8)]
        ints += [(f"{t.name}:dim{i}", off(p[3]) + 8 * i, 8) for i in range(len(p[3]))]
        strs.append((f"{t.name}:name", off(p[1]), len(p[1])))
    return ints, strs


def int_values(width: int, orig: int):
    top = 2 ** (8 * width) - 1
    special = sorted(v for v in {0, 1, 2, 3, 7, 31, 32, 4096, orig - 1, orig + 1, orig * 2, 2 ** (8 * width - 1), top,
                                 2**31, 2**32 - 1} if 0 <= v <= top)
    return st.one_of(st.sampled_from(special), st.integers(0, top))


def main(mode: str, base: Path, workdir: Path, n_examples: int) -> None:
    data = base.read_bytes()
    ints, strs = catalog(base)
    data_offset = epqlab.inspect(base).data_offset
    header = data[:data_offset]
    tail = data[data_offset:]

    def int_mut(slot):
        label, o, w = slot
        orig = int.from_bytes(header[o:o + w], "little")
        return int_values(w, orig).map(lambda v: ("int", label, o, w, v))

    def str_mut(slot):
        label, o, n = slot
        return st.binary(min_size=n, max_size=n).map(lambda b: ("str", label, o, n, b))

    mutation = st.one_of(st.sampled_from(ints).flatmap(int_mut), st.sampled_from(strs).flatmap(str_mut))
    if mode == "session":
        # Half the mutants change only what inspect does not read (hyperparameter values, dims of
        # non-expert tensors), so that many get past inspect into llama.cpp's own loader and graph.
        deep = [x for x in ints if x[0].endswith(":value") or (":dim" in x[0] and "_exps" not in x[0])]
        mutation = st.one_of(st.sampled_from(deep).flatmap(int_mut), mutation)
    mutations = st.lists(mutation, min_size=1, max_size=3)
    cut = st.one_of(st.none(), st.integers(0, len(data)))
    counter = iter(range(10**9))

    @settings(max_examples=n_examples, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(mutations, cut if mode == "inspect" else st.none())
    def run(muts, cut_at):
        buf = bytearray(header)
        for kind, _, o, w, v in muts:
            buf[o:o + w] = v.to_bytes(w, "little") if kind == "int" else v
        blob = bytes(buf) + tail
        if cut_at is not None:
            blob = blob[:cut_at]
        p = workdir / f"m{next(counter)}.gguf"
        p.write_bytes(blob)
        desc = "; ".join(f"{label}={v if kind == 'int' else v[:16]!r}" for kind, label, _, _, v in muts)
        print(f"[fuzz] {p.name}: {desc}" + (f"; cut at {cut_at}" if cut_at is not None else ""), file=sys.stderr,
              flush=True)
        try:
            if mode == "inspect":
                epqlab.inspect(p, require_moe=False)
            else:
                with epqlab.Session(p, n_threads=1, n_ctx=256, io_threads=1) as s:
                    s.generate([1, 2, 3], 2)
            outcome = "ok"
        except ACCEPTED as e:
            outcome = f"{type(e).__name__}: {str(e)[:150]}"
        finally:
            p.unlink()
        print(f"[fuzz]   -> {outcome}", file=sys.stderr, flush=True)

    run()
    print("fuzz ok", file=sys.stderr)


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4]))
