"""Per-token time split of paged decoding, from the hook's own timestamps (native/engine/hook.h "Time split").

Parts, microseconds, per decode call (one forward pass per token in decode) and MoE layer:

- ``attn_us``: the graph piece ending at the layer's router (attention, norms, router; layer 0's
  also holds the embedding), timed between ggml's start and end of that piece;
- ``expert_us``: the piece ending at the layer's last expert matmul (gate/up/down and their
  elementwise ops);
- ``io_us``: wall time the pager waited for reads (demand reads and the rest of a prefetch);
- ``map_us``: mmap/munmap of slots (residency, eviction);
- ``predict_us``: the prefetch predictor's own compute and issuing its reads (evictions' unmaps
  are ``map_us``);
- ``other_us`` (per call only): wall time of the call minus all the above, the only remainder
  (output head, graph build, the hook's bookkeeping).
"""
from __future__ import annotations

import numpy as np

PARTS = ("attn_us", "expert_us", "io_us", "map_us", "predict_us")
_LAYER_COLS = ("call", "layer_index", "n_tokens") + PARTS


class TimeSplitLog:
    """Accumulates the hook's time records (``Engine.take_time_split``) for one Session."""

    def __init__(self, moe_layers):
        self.blocks = np.asarray(moe_layers, np.int64)
        self._layers: list[np.ndarray] = []
        self._calls: list[np.ndarray] = []

    def take(self, engine) -> None:
        """Move the engine's records since the last take into this log."""
        lt, ct = engine.take_time_split()
        if len(ct):
            self._layers.append(np.asarray(lt, np.int64))
            self._calls.append(np.asarray(ct, np.int64))

    def clear(self) -> None:
        self._layers.clear()
        self._calls.clear()

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        lt = np.concatenate(self._layers) if self._layers else np.zeros((0, 8), np.int64)
        ct = np.concatenate(self._calls) if self._calls else np.zeros((0, 4), np.int64)
        return lt, ct

    def frame(self, per: str = "token"):
        """pandas.DataFrame of the split.

        Args:
            per: ``"token"``: one row per decode call (``call``, ``n_tokens``, ``wall_us``, the parts
                summed over layers, ``other_us`` = wall - their sum, and ``io_busy_us``: the wall time
                during which at least one expert read was in progress, waited for or hidden; not a
                part of the sum); a decode step is one token.
                ``"layer"``: one row per (call, MoE layer): ``call``, ``layer`` (GGUF block),
                ``n_tokens`` and the parts.

        Raises:
            ValueError: ``per`` is neither "token" nor "layer".
        """
        import pandas as pd

        lt, ct = self.arrays()
        if per == "layer":
            df = pd.DataFrame(lt, columns=list(_LAYER_COLS))
            df.insert(1, "layer", self.blocks[df.pop("layer_index").to_numpy()] if len(df) else np.zeros(0, np.int64))
            return df
        if per != "token":
            raise ValueError(f"per must be 'token' or 'layer', got {per!r}")
        calls = pd.DataFrame(ct, columns=["call", "n_tokens", "wall_us", "io_busy_us"])
        sums = pd.DataFrame(lt, columns=list(_LAYER_COLS)).groupby("call")[list(PARTS)].sum()
        df = calls.join(sums, on="call").fillna(0)
        for p in PARTS:
            df[p] = df[p].astype(np.int64)
        df["other_us"] = df["wall_us"] - df[list(PARTS)].sum(axis=1)
        return df


def decode_summary(df) -> dict:
    """Mean of each part per single-token decode call, milliseconds (``df`` from
    ``TimeSplitLog.frame("token")``), with ``t_io_ms`` = io + map and ``t_compute_ms`` = the rest,
    and ``io_busy_ms`` (device busy time per token, hidden or not; see ``frame``)."""
    d = df[df["n_tokens"] == 1]
    if len(d) == 0:
        return {}
    out = {p.replace("_us", "_ms"): float(d[p].mean()) / 1e3 for p in PARTS + ("other_us", "wall_us")}
    if "io_busy_us" in d:
        out["io_busy_ms"] = float(d["io_busy_us"].mean()) / 1e3
    out["t_io_ms"] = out["io_ms"] + out["map_ms"]
    out["t_compute_ms"] = out["wall_ms"] - out["t_io_ms"]
    out["calls"] = int(len(d))
    return out


def decode_series(df) -> dict:
    """Per single-token decode call, in order, milliseconds: ``wall_ms``, ``io_busy_ms`` (device busy),
    ``t_compute_ms`` (wall - io wait - map). A per-token bound sum_i max(T_dev_i, T_compute_i) needs them:
    the first decode steps after a prefill can be I/O bound while the rest are compute bound, and the
    max of the means then understates the bound."""
    d = df[df["n_tokens"] == 1]
    if len(d) == 0:
        return {}
    out = {"wall_ms": (d["wall_us"] / 1e3).round(3).tolist(),
           "t_compute_ms": ((d["wall_us"] - d["io_us"] - d["map_us"]) / 1e3).round(3).tolist()}
    if "io_busy_us" in d:
        out["io_busy_ms"] = (d["io_busy_us"] / 1e3).round(3).tolist()
    return out


def format_summary(s: dict) -> str:
    """One line for the CLI: the decode split per token, ms and share of the wall time."""
    if not s:
        return "time split: no single-token decode steps"
    w = s["wall_ms"] or 1.0
    parts = [("attn", "attn_ms"), ("experts", "expert_ms"), ("io wait", "io_ms"), ("map", "map_ms"),
             ("predict", "predict_ms"), ("other", "other_ms")]
    body = ", ".join(f"{n} {s[k]:.1f} ({100 * s[k] / w:.0f}%)" for n, k in parts)
    busy = f"; disk busy {s['io_busy_ms']:.1f} ms/token" if s.get("io_busy_ms") is not None else ""
    return f"time/token {w:.1f} ms: {body}{busy}"
