"""One sequence's saved state on disk: what :meth:`Session.save_state` writes and the server's prompt cache on disk
(:mod:`epqlab.engine.prompt_disk_cache`) keeps, one file per sequence.

Layout: the magic ``b"EPQSTATE1\\n"``, the header's length (8 bytes, little-endian), the header (JSON: ``identity``,
``tokens`` the sequence's cells hold, ``ubatch_ends`` of its prompt, ``state_bytes``, ``state_sha256``), then the
state as llama.cpp serializes it (``llama_state_seq_get_data``: the sequence's KV cells, or its recurrent state).
Files are written whole to a temporary name and renamed (atomic on one file system), so a reader never sees half a
file; a file that is truncated, corrupt or made for another model or context is refused with
:class:`StateFileError` naming why.

The identity (:func:`identity`) covers what decides the bytes of the state: the model file (name, size, the first
MiB of its header), the context (n_ctx per sequence, n_batch, n_ubatch) and every knob that changes the computation
(top-k, the lossy routing knobs, skip-cold). A state restored under another identity could decode on cells another
model or setting computed, so it is refused.
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ..errors import EpqlabError

MAGIC = b"EPQSTATE1\n"
_LEN = struct.Struct("<Q")
MAX_HEADER = 64 << 20  # bytes: a header longer than this is corrupt (a million tokens of ids is ~8 MB of JSON)


class StateFileError(EpqlabError, ValueError):
    """A saved state that cannot be used: truncated, corrupt, or for another model or context (the message says which)."""


@dataclass(frozen=True)
class Entry:
    """A state file's header: ``path``, ``identity``, ``tokens`` (ids the sequence's cells hold), ``ubatch_ends``
    (where its prompt's ubatches ended: the exact prompt cache's rule), ``state_bytes``, ``state_sha256``,
    ``offset`` (where the state starts in the file, bytes)."""

    path: Path
    identity: str
    tokens: tuple
    ubatch_ends: tuple
    state_bytes: int
    state_sha256: str
    offset: int


def identity(session) -> str:
    """A hex digest of what decides a sequence state's bytes for ``session`` (module docstring)."""
    lay, o = session.layout, session.options
    h = hashlib.sha256()
    with open(lay.path, "rb") as f:
        h.update(f.read(1 << 20))
    knobs = {"file": lay.path.name, "size": lay.file_size, "n_ctx": session.n_ctx, "n_batch": session.n_batch,
             "n_ubatch": o.n_ubatch, "expert_used": o.n_expert_used, "skip_cold": o.skip_cold,
             "route_bias": o.route_bias, "route_delta": o.route_delta, "adaptive_k": repr(o.adaptive_k),
             "expert_budget": o.expert_budget}
    h.update(json.dumps(knobs, sort_keys=True, default=str).encode())
    return h.hexdigest()


def write(path: Path, ident: str, tokens, ubatch_ends, state: bytes) -> int:
    """Write one state file atomically (a temporary file in the same directory, fsync'd, then renamed). Returns its
    size in bytes. Raises OSError (a full disk, no permission): the temporary file is removed first."""
    path = Path(path)
    head = json.dumps({"identity": ident, "tokens": [int(t) for t in tokens],
                       "ubatch_ends": [int(t) for t in ubatch_ends], "state_bytes": len(state),
                       "state_sha256": hashlib.sha256(state).hexdigest()}).encode()
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".epqs", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(MAGIC + _LEN.pack(len(head)) + head)
            f.write(state)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return len(MAGIC) + _LEN.size + len(head) + len(state)


def read_header(path: Path, ident: str | None = None) -> Entry:
    """The header of a state file. Raises StateFileError (not a state file, a header cut short or not JSON, a size
    that does not match the file, another identity when ``ident`` is given) or OSError (unreadable)."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        if f.read(len(MAGIC)) != MAGIC:
            raise StateFileError(f"{path} is not an epqlab state file (no {MAGIC!r} at its start)")
        raw = f.read(_LEN.size)
        if len(raw) != _LEN.size or not 0 < _LEN.unpack(raw)[0] <= MAX_HEADER:
            raise StateFileError(f"{path}: its header is cut short or corrupt")
        n = _LEN.unpack(raw)[0]
        try:
            h = json.loads(f.read(n))
            e = Entry(path, str(h["identity"]), tuple(int(t) for t in h["tokens"]),
                      tuple(int(t) for t in h["ubatch_ends"]), int(h["state_bytes"]), str(h["state_sha256"]),
                      len(MAGIC) + _LEN.size + n)
        except (ValueError, KeyError, TypeError) as ex:
            raise StateFileError(f"{path}: its header is not a state header ({ex})") from None
    if e.offset + e.state_bytes != size:
        raise StateFileError(f"{path} is truncated or has trailing bytes: {size} bytes, its header says "
                             f"{e.offset + e.state_bytes}")
    if ident is not None and e.identity != ident:
        raise StateFileError(f"{path} was saved for another model or context (its identity differs: model file, "
                             "n_ctx, n_batch, n_ubatch, top-k or a lossy knob); open it with the same settings")
    return e


def read_state(e: Entry) -> bytes:
    """The state bytes of entry ``e``, checked against its length and SHA-256. Raises StateFileError or OSError."""
    with open(e.path, "rb") as f:
        f.seek(e.offset)
        b = f.read(e.state_bytes + 1)
    if len(b) != e.state_bytes or hashlib.sha256(b).hexdigest() != e.state_sha256:
        raise StateFileError(f"{e.path}: its state does not match its header's length and checksum (corrupt)")
    return b
