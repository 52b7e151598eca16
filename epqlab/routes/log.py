"""Route logs: which routed experts every token selected in every MoE layer (docs/DESIGN.md §6).

A route log is an NPZ file with

- ``experts``      int32 ``[T, L, k]``: tokens in processing order, MoE layers in order, the k selected
                   expert ids in router order (ids in ``[0, n_expert)``, distinct within a row);
- ``layers``       int32 ``[L]``: the GGUF block id of each MoE layer;
- ``phase``        uint8 ``[T]``: 0 = prefill, 1 = decode;
- ``ubatch``       int32 ``[T]``, optional (older files lack it): the forward pass (llama.cpp ubatch) each token
                   was computed in, counted from the Session's start (files of 2026-11-30 and before restart
                   at ``reset_stats``); consecutive equal ids form one pass (:meth:`epqlab.Pager.replay` follows them);
- ``expert_bytes`` int64 ``[L]``: bytes of one expert (gate+up+down) in each layer;
- ``n_expert``     scalar: experts per layer;
- ``meta``         a JSON string (model path, arch, k, prompt hash, ...);
- ``probs``        float32 ``[T, L, k]``, optional (files of 2026-12-06 and before lack it): the router's
                   probability of each selected expert (``ffn_moe_probs``, normalised over all the layer's
                   experts), which the ``gate_rank`` policy weighs requests by.

:class:`RouteLog` is the one owner of this format: it loads, validates, saves and synthesises such logs
(:meth:`epqlab.Session.save_route_log` and :meth:`epqlab.Pager.replay` go through it). Everything in
:mod:`epqlab.routes` works on a :class:`RouteLog` alone: no model, no engine. docs/DESIGN.md §6 allows -1 for a
token not routed through a layer; a :class:`RouteLog` refuses it, because every analysis here needs each token's
k experts (a Session records with logits for every token, so every token is routed; :meth:`epqlab.Pager.replay`
takes -1 rows from arrays).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import numpy as np

from ..errors import RouteLogError
from ..results import atomic_path


REQUIRED = ("experts", "layers", "phase", "expert_bytes", "n_expert")  # arrays every route-log NPZ holds


@dataclass(frozen=True)
class RouteLog:
    """One run's routing decisions. ``experts[t, i, j]`` is the j-th expert (router order) that token t
    selected in the i-th MoE layer (GGUF block ``layers[i]``); ``ubatch[t]`` (or None) the forward pass of
    token t."""

    experts: np.ndarray       # int32 (T, L, k)
    layers: np.ndarray        # int32 (L,)
    phase: np.ndarray         # uint8 (T,)
    expert_bytes: np.ndarray  # int64 (L,)
    n_expert: int
    meta: dict = field(default_factory=dict)
    ubatch: np.ndarray | None = None  # int32 (T,) or None
    probs: np.ndarray | None = None   # float32 (T, L, k) or None

    def __post_init__(self) -> None:
        self.validate()

    # ----------------------------------------------------------------------------------- shape
    @property
    def n_tokens(self) -> int:
        return int(self.experts.shape[0])

    @property
    def n_layers(self) -> int:
        return int(self.experts.shape[1])

    @property
    def k(self) -> int:
        return int(self.experts.shape[2])

    @property
    def n_requests(self) -> int:
        return int(self.experts.size)

    def __repr__(self) -> str:
        return (f"RouteLog(T={self.n_tokens}, L={self.n_layers}, k={self.k}, n_expert={self.n_expert}, "
                f"prefill={int((self.phase == 0).sum())}, decode={int((self.phase == 1).sum())})")

    # ------------------------------------------------------------------------------ validation
    def validate(self) -> None:
        """Raise :class:`RouteLogError` naming the array at fault if anything breaks docs/DESIGN.md §6."""
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise RouteLogError(f"route log: {msg}")

        e, ly, ph, eb = self.experts, self.layers, self.phase, self.expert_bytes
        for name, a in (("experts", e), ("layers", ly), ("phase", ph), ("expert_bytes", eb)):
            need(isinstance(a, np.ndarray), f"`{name}` must be a numpy array, got {type(a).__name__}")
        need(e.dtype == np.int32, f"`experts` must be int32, got {e.dtype}")
        need(e.ndim == 3, f"`experts` must have shape [T, L, k], got shape {e.shape}")
        T, L, k = e.shape
        need(L >= 1 and k >= 1, f"`experts` needs at least one layer and k >= 1, got shape {e.shape}")
        need(ly.dtype == np.int32 and ly.shape == (L,), f"`layers` must be int32 of shape ({L},), got {ly.dtype} {ly.shape}")
        need(ph.dtype == np.uint8 and ph.shape == (T,), f"`phase` must be uint8 of shape ({T},), got {ph.dtype} {ph.shape}")
        need(eb.dtype == np.int64 and eb.shape == (L,), f"`expert_bytes` must be int64 of shape ({L},), got {eb.dtype} {eb.shape}")
        need(isinstance(self.n_expert, (int, np.integer)) and int(self.n_expert) >= 1,
             f"`n_expert` must be a positive integer, got {self.n_expert!r}")
        n = int(self.n_expert)
        need(k <= n, f"k = {k} experts per token exceeds n_expert = {n}")
        if e.size:
            lo, hi = int(e.min()), int(e.max())
            need(lo >= 0, f"`experts` holds a negative id ({lo}); -1 (a token not routed through a layer) is "
                          "not accepted here: the analyses need every token's k experts (docs/DESIGN.md §6)")
            if hi >= n:
                t, i, j = (int(x[0]) for x in np.nonzero(e >= n))
                raise RouteLogError(f"route log: `experts` holds id {hi} >= n_expert = {n} "
                                    f"(first at token {t}, layer index {i}, slot {j})")
            s = np.sort(e, axis=2)
            dup = (s[:, :, 1:] == s[:, :, :-1]).any(axis=2)
            if dup.any():
                t, i = (int(x[0]) for x in np.nonzero(dup))
                raise RouteLogError(f"route log: token {t}, layer index {i} selects the same expert twice: "
                                    f"{e[t, i].tolist()}")
        if ph.size:
            need(int(ph.max()) <= 1, "`phase` values must be 0 (prefill) or 1 (decode)")
        need((eb >= 0).all(), "`expert_bytes` must be >= 0")
        need(isinstance(self.meta, dict), f"`meta` must be a dict, got {type(self.meta).__name__}")
        ub = self.ubatch
        if ub is not None:
            need(isinstance(ub, np.ndarray) and ub.dtype == np.int32 and ub.shape == (T,),
                 f"`ubatch` must be int32 of shape ({T},), got {getattr(ub, 'dtype', type(ub).__name__)} "
                 f"{getattr(ub, 'shape', '')}")
            need(not ub.size or int(ub.min()) >= 0, "`ubatch` ids must be >= 0")
        pr = self.probs
        if pr is not None:
            need(isinstance(pr, np.ndarray) and pr.dtype == np.float32 and pr.shape == e.shape,
                 f"`probs` must be float32 of shape {e.shape} like `experts`, got "
                 f"{getattr(pr, 'dtype', type(pr).__name__)} {getattr(pr, 'shape', '')}")
            need(bool(np.isfinite(pr).all()) and (not pr.size or float(pr.min()) >= 0.0),
                 "`probs` must be finite router probabilities >= 0")

    # ----------------------------------------------------------------------------------- I/O
    def save(self, path: str | os.PathLike) -> None:
        """Write the NPZ of docs/DESIGN.md §6 (``meta`` as a JSON string; ``ubatch`` when known), creating
        the folder, whole or not at all (:func:`epqlab.results.atomic_path`). As with :func:`numpy.savez`,
        ``.npz`` is appended to a path without it."""
        arrays = dict(experts=self.experts, layers=self.layers, phase=self.phase, expert_bytes=self.expert_bytes,
                      n_expert=np.int64(self.n_expert), meta=np.array(json.dumps(self.meta)))
        if self.ubatch is not None:
            arrays["ubatch"] = self.ubatch
        if self.probs is not None:
            arrays["probs"] = self.probs
        path = os.fspath(path)
        if not path.endswith(".npz"):
            path += ".npz"
        with atomic_path(path) as tmp, open(tmp, "wb") as f:
            np.savez(f, **arrays)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "RouteLog":
        """Read and validate a route log NPZ; :class:`RouteLogError` names any missing or malformed array."""
        path = os.fspath(path)
        if os.path.isdir(path):
            raise RouteLogError(f"route log {path!r} is a directory: give the .npz file Session(route_log=...) wrote")
        if not os.path.isfile(path):
            raise RouteLogError(f"route log {path!r} does not exist")
        with open(path, "rb") as f:
            magic = f.read(4)
        if magic != b"PK\x03\x04":  # np.load would return a bare array (.npy) or try to unpickle text
            raise RouteLogError(
                f"route log {path!r} is not an NPZ archive: a route log is an .npz with arrays experts (int32 "
                "[tokens, layers, k]), layers, phase, expert_bytes and n_expert, as Session(route_log=...) "
                "writes it (docs/DESIGN.md §6)")
        try:
            z = np.load(path, allow_pickle=False)
        except Exception as ex:  # zipfile / format errors
            raise RouteLogError(f"route log {path!r} is not a readable NPZ file: {ex}") from ex
        with z:
            missing = [n for n in REQUIRED if n not in z.files]
            if missing:
                raise RouteLogError(f"route log {path!r} lacks array(s) {', '.join(missing)} (see docs/DESIGN.md §6)")
            ne = z["n_expert"]
            if ne.ndim != 0 or ne.dtype.kind not in "iu":
                raise RouteLogError(f"route log {path!r}: `n_expert` must be an integer scalar, got {ne.dtype} {ne.shape}")
            meta = {}
            if "meta" in z.files:
                try:
                    meta = json.loads(str(z["meta"][()]))
                except json.JSONDecodeError as ex:
                    raise RouteLogError(f"route log {path!r}: `meta` is not a JSON string: {ex}") from ex
            try:
                return cls(experts=z["experts"], layers=z["layers"], phase=z["phase"],
                           expert_bytes=z["expert_bytes"], n_expert=int(ne), meta=meta,
                           ubatch=z["ubatch"] if "ubatch" in z.files else None,
                           probs=z["probs"] if "probs" in z.files else None)
            except RouteLogError as ex:
                raise RouteLogError(f"{ex} (file {path!r})") from None

    @classmethod
    def from_dict(cls, d) -> "RouteLog":
        """A log from a mapping of the NPZ's arrays, e.g. a loaded NPZ or arrays built by hand
        (:meth:`epqlab.Session.route_log` already returns a :class:`RouteLog`; ``meta`` as a dict or a JSON string; ``ubatch`` and ``probs`` optional). Raises :class:`RouteLogError` naming a
        missing or malformed entry."""
        missing = [n for n in REQUIRED if n not in d]
        if missing:
            raise RouteLogError(f"route log: lacks {', '.join(missing)} (see docs/DESIGN.md §6)")
        meta = d.get("meta", {})
        meta = json.loads(str(meta)) if isinstance(meta, (str, np.ndarray)) else dict(meta)
        return cls(experts=d["experts"], layers=d["layers"], phase=d["phase"], expert_bytes=d["expert_bytes"],
                   n_expert=int(d["n_expert"]), meta=meta, ubatch=d.get("ubatch"), probs=d.get("probs"))

    @classmethod
    def from_arrays(cls, experts, n_expert: int, *, layers=None, phase=None, expert_bytes=None,
                    meta: dict | None = None, ubatch=None, probs=None) -> "RouteLog":
        """Build a log from a nested list / array ``[T][L][k]``, filling the optional arrays with defaults
        (layers 0..L-1, all decode, 1 byte per expert, no ubatch, no probs)."""
        e = np.asarray(experts)
        if e.ndim != 3:
            raise RouteLogError(f"route log: `experts` must have shape [T, L, k], got shape {e.shape}")
        if e.dtype.kind not in "iu":
            raise RouteLogError(f"route log: `experts` must hold integers, got {e.dtype}")
        T, L, _ = e.shape
        return cls(experts=e.astype(np.int32),
                   layers=np.arange(L, dtype=np.int32) if layers is None else np.asarray(layers, dtype=np.int32),
                   phase=np.ones(T, np.uint8) if phase is None else np.asarray(phase, dtype=np.uint8),
                   expert_bytes=(np.ones(L, np.int64) if expert_bytes is None
                                 else np.broadcast_to(np.asarray(expert_bytes, dtype=np.int64), (L,)).copy()),
                   n_expert=int(n_expert), meta=dict(meta or {}),
                   ubatch=None if ubatch is None else np.asarray(ubatch, dtype=np.int32),
                   probs=None if probs is None else np.asarray(probs, dtype=np.float32))

    # ------------------------------------------------------------------------------ synthetic
    @classmethod
    def synthetic(cls, n_tokens: int = 256, n_layers: int = 8, n_expert: int = 64, k: int = 4, *,
                  locality: float = 0.7, skew: float = 1.0, n_prefill: int = 0,
                  expert_bytes: int = 1 << 20, seed: int = 0) -> "RouteLog":
        """A random log with tunable temporal locality, for tests and notebooks.

        Per token and layer, each of the k slots repeats an expert the previous token used in that layer with
        probability ``locality`` (0 = independent tokens, 1 = the same set as long as possible); the rest are
        drawn without replacement from a Zipf-like popularity ``p(rank) ~ 1/(rank+1)**skew`` (a random
        permutation per layer; ``skew=0`` is uniform). ``probs`` holds each selected expert's popularity
        p(rank), normalised per layer (a stand-in for the router's probability)."""
        if not (0.0 <= locality <= 1.0):
            raise ValueError(f"locality must be in [0, 1], got {locality}")
        if k > n_expert:
            raise ValueError(f"k = {k} exceeds n_expert = {n_expert}")
        rng = np.random.default_rng(seed)
        pop = 1.0 / np.arange(1, n_expert + 1) ** skew
        logp = np.empty((n_layers, n_expert))
        for i in range(n_layers):
            logp[i, rng.permutation(n_expert)] = np.log(pop / pop.sum())
        out = np.empty((n_tokens, n_layers, k), np.int32)
        rows = np.arange(n_layers)[:, None]
        for t in range(n_tokens):
            # Gumbel top-k = k draws without replacement from p; kept experts get +inf so they win.
            score = logp - np.log(-np.log(rng.random((n_layers, n_expert))))
            if t > 0 and locality > 0:
                keep = rng.random((n_layers, k)) < locality
                score[np.broadcast_to(rows, (n_layers, k))[keep], out[t - 1][keep]] = np.inf
            top = np.argpartition(-score, k - 1, axis=1)[:, :k]
            out[t] = np.take_along_axis(top, rng.permuted(np.tile(np.arange(k), (n_layers, 1)), axis=1), 1)
        phase = np.ones(n_tokens, np.uint8)
        phase[:n_prefill] = 0
        probs = np.exp(np.take_along_axis(np.broadcast_to(logp, (n_tokens, n_layers, n_expert)), out, 2))
        return cls(experts=out, layers=np.arange(n_layers, dtype=np.int32), phase=phase,
                   expert_bytes=np.full(n_layers, expert_bytes, np.int64), n_expert=int(n_expert),
                   meta={"synthetic": True, "k": k, "locality": locality, "skew": skew, "seed": seed},
                   probs=probs.astype(np.float32))
