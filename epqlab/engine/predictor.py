"""A learned expert predictor for prefetch, at run time (fitting it: :mod:`epqlab.studies.predictor_fit`) (``prefetch="trained"``): layer l+d's router logits
predicted from layer l's router input by a linear map fitted on recorded router inputs.

Router lookahead (``prefetch="lookahead"``) applies layer l+d's router ``G_{l+d}`` (``ffn_gate_inp``,
[n_expert, n_embd]) to layer l's router input ``h_l`` (the RMS-normed FFN input the router reads,
[n_embd]): it assumes ``h_{l+d} ≈ h_l``. What the layers in between add is partly linear in ``h_l``, so
a per-layer linear map learned from the model's own activations predicts better (a pre-attention
predictor of this kind reaches 93-95% on real MoEs: arXiv 2511.10676). The map is fitted as a ridge
regression shrunk toward lookahead, so that with little data it falls back to lookahead:

    W_{l,d} = G_{l+d} + A,   A = argmin ||X A^T + 1 b^T - (Y - X G_{l+d}^T)||^2 + lam ||A||^2

with ``X`` = recorded ``h_l`` rows [T, n_embd], ``A`` [n_expert, n_embd], ``Y = H_{l+d} G_{l+d}^T`` (+ the
router's bias, if any) the router logits the model computed [T, n_expert], ``b`` an unpenalised intercept
and ``lam`` = ``alpha * trace(X_c^T X_c) / n_embd`` with ``alpha`` chosen by top-k recall on held-back
blocks of the calibration tokens. The prediction is top-k of ``W_{l,d} h_l + b``. Fit on one text,
evaluate on another (:func:`epqlab.studies.predictor_fit.predictor_recall`): a predictor scored on its calibration text overstates
itself.
"""
from __future__ import annotations

import hashlib
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..constants import MAX_FIT_DEPTH
from ..errors import EpqlabError
from ..layout import _open_reader, inspect



WEIGHT_TYPES = ("q8_0", "bf16")
"""Types the engine can keep a trained predictor's ``W`` in (native/engine/hook.h ``set_predictor``), with the
bytes a token streams per depth on a 40-layer, 256-expert, 2048-wide model: Q8_0 22 MB (the default), bfloat16
42 MB. Q4_0 (12 MB) is not offered: on the 35B-A3B shape its top-8 recall on held-out prose fell to 0.835 from
bfloat16's 0.919 (Q8_0: 0.917), below router lookahead's 0.858 (bench/README.md)."""


def bf16_round(a: np.ndarray) -> np.ndarray:
    """``a`` (float32) rounded to bfloat16 (nearest, ties to even) and widened back to float32: the
    weights the engine computes with when it keeps ``W`` in bfloat16 (native/engine/hook.h
    ``set_predictor``). Finite inputs only."""
    u = np.ascontiguousarray(a, np.float32).view(np.uint32)
    r = ((u.astype(np.uint64) + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint32) << 16
    return r.view(np.float32).reshape(np.shape(a))


def check_weight_type(weight_type: str) -> str:
    """Raises ValueError unless ``weight_type`` is one of :data:`WEIGHT_TYPES`; returns it."""
    if weight_type not in WEIGHT_TYPES:
        raise ValueError(f"predictor weight_type must be one of {', '.join(WEIGHT_TYPES)}, got {weight_type!r}")
    return weight_type


def _q8_0_round_trip(a: np.ndarray) -> np.ndarray:
    """Rows of ``a`` (float32 [..., n], n a multiple of 32) quantized to ggml's Q8_0 blocks and dequantized
    again (gguf-py's NumPy port of ggml's reference quantizer)."""
    from gguf.constants import GGMLQuantizationType as T  # gguf-py: ~0.3 s to import, only needed here
    from gguf.quants import dequantize, quantize

    a = np.ascontiguousarray(a, np.float32)
    return dequantize(quantize(a, T.Q8_0), T.Q8_0).astype(np.float32).reshape(a.shape)


def applied_weights(W: np.ndarray, weight_type: str) -> np.ndarray:
    """``W`` (float32 [..., n_embd]) as the engine holds it in ``weight_type``, widened back to float32."""
    return bf16_round(W) if check_weight_type(weight_type) == "bf16" else _q8_0_round_trip(W)


def applied_input(h: np.ndarray, weight_type: str) -> np.ndarray:
    """Router inputs ``h`` (float32 [..., n_embd]) as the engine's dot product sees them: unchanged for bfloat16
    weights; for Q8_0 weights quantized to Q8_0 first, as ggml-cpu's ``vec_dot`` of that type takes its second
    operand (``vec_dot_type``; ggml-cpu.c)."""
    return h if check_weight_type(weight_type) == "bf16" else _q8_0_round_trip(h)


def check_depth(depth: int) -> None:
    """Raises ValueError unless ``depth`` is in 1..:data:`~epqlab.constants.MAX_FIT_DEPTH` layers ahead."""
    if not 1 <= depth <= MAX_FIT_DEPTH:
        raise ValueError(f"depth must be 1..{MAX_FIT_DEPTH} layers ahead, got {depth}")


@dataclass
class ExpertPredictor:
    """Per-depth, per-layer linear predictors of router logits.

    Attributes:
        W: float32 [depth, n_layers, n_expert, n_embd]: ``W[d-1, l]`` maps MoE layer l's router input
            to MoE layer l+d's router logits (rows for l+d >= n_layers are zero and unused). The engine
            keeps it in :attr:`weight_type` (Q8_0: 22 MB per depth for 40 layers x 256 experts x 2048).
        b: float32 [depth, n_layers, n_expert]: intercepts.
        alpha: the ridge strength chosen per depth (relative; see the module docstring).
        n_tokens: calibration tokens the fit used.
        model_fingerprint: :func:`router_fingerprint` of the model it was fitted on ("" = unknown); a
            Session refuses a predictor whose fingerprint is not the model's.
        weight_type: the type the engine keeps ``W`` in (:data:`WEIGHT_TYPES`): ``"q8_0"`` (default: 1.06
            bytes per weight) or ``"bf16"`` (2). A token streams ``W`` once per depth, so the
            type sets the predictor's time per token; its recall on held-out text is in bench/README.md.
            ``dataclasses.replace(p, weight_type="bf16")`` makes a copy in another type.
    """

    W: np.ndarray
    b: np.ndarray
    alpha: tuple
    n_tokens: int
    model_fingerprint: str = ""
    weight_type: str = "q8_0"

    def __post_init__(self):
        check_weight_type(self.weight_type)

    @property
    def depth(self) -> int:
        return int(self.W.shape[0])

    @property
    def shape(self) -> tuple[int, int, int]:
        """(n_layers, n_expert, n_embd)."""
        return tuple(int(x) for x in self.W.shape[1:])

    def logits(self, h: np.ndarray, layer: int, d: int = 1) -> np.ndarray:
        """Predicted router logits of MoE layer ``layer + d`` from layer ``layer``'s router inputs
        ``h`` [T, n_embd]: float32 [T, n_expert], with ``W`` and ``h`` rounded as the engine applies them in
        :attr:`weight_type` (:func:`applied_weights`, :func:`applied_input`)."""
        return (applied_input(h, self.weight_type) @ applied_weights(self.W[d - 1, layer], self.weight_type).T
                + self.b[d - 1, layer])

    def save(self, path) -> Path:
        """Write the predictor as NPZ (``.npz`` appended when missing, as NumPy does); returns the path written."""
        path = Path(path)
        np.savez(path, W=self.W, b=self.b, alpha=np.asarray(self.alpha, np.float64), n_tokens=self.n_tokens,
                 model_fingerprint=np.asarray(self.model_fingerprint), weight_type=np.asarray(self.weight_type))
        return path if path.suffix == ".npz" else path.with_suffix(path.suffix + ".npz")

    @classmethod
    def load(cls, path) -> "ExpertPredictor":
        """Raises EpqlabError when the file is not a predictor saved by :meth:`save`."""
        try:
            with np.load(path) as z:
                W, b = z["W"].astype(np.float32, copy=False), z["b"].astype(np.float32, copy=False)
                fp = str(z["model_fingerprint"]) if "model_fingerprint" in z.files else ""
                wt = str(z["weight_type"]) if "weight_type" in z.files else cls.weight_type  # files saved before it
                p = cls(W, b, tuple(float(a) for a in z["alpha"]), int(z["n_tokens"]), fp, wt)
        except (OSError, KeyError, ValueError, EOFError, zipfile.BadZipFile, AttributeError, TypeError) as e:
            raise EpqlabError(f"{path} is not an epqlab expert predictor ({e}); fit one with "
                              "epqlab.studies.predictor_fit.fit_predictor and save it with .save(path)") from None
        if W.ndim != 4 or b.shape != W.shape[:3] or not 1 <= W.shape[0] <= MAX_FIT_DEPTH:
            raise EpqlabError(f"{path}: predictor arrays W {W.shape} and b {b.shape} are not [depth<={MAX_FIT_DEPTH}, layers, "
                              "experts, width] and [depth, layers, experts]; refit it")
        if not (np.isfinite(W).all() and np.isfinite(b).all()):
            raise EpqlabError(f"{path}: the predictor's weights are not finite (NaN or inf); refit it")
        return p

    def check_model(self, n_layers: int, n_expert: int, n_embd: int | None = None) -> None:
        """Raises ValueError when the predictor was fitted for another shape of model (n_embd None: not checked), or
        its width is not a multiple of the 32-weight blocks of a quantized :attr:`weight_type`."""
        L, E, D = self.shape
        if (L, E) != (n_layers, n_expert) or (n_embd is not None and D != n_embd):
            raise ValueError(f"the predictor was fitted for {L} MoE layers x {E} experts x width {D}, the model has "
                             f"{n_layers} x {n_expert} x {n_embd}: fit one on this model (epqlab.studies.predictor_fit.fit_predictor)")
        if self.weight_type != "bf16" and D % 32:
            raise ValueError(f"the predictor's width {D} is not a multiple of {self.weight_type}'s block of 32 weights: "
                             "use dataclasses.replace(predictor, weight_type='bf16')")


def router_fingerprint(model) -> str:
    """SHA-1 (hex) of the first MoE layer's router tensor bytes as stored in the GGUF, with the model's
    MoE layer count: cheap (one tensor of n_expert x n_embd) and different between models of one shape."""
    lay = inspect(model)
    il = lay.moe_layers[0]
    t = next((t for t in _open_reader(Path(lay.path)).tensors if t.name == f"blk.{il}.ffn_gate_inp.weight"), None)
    if t is None:
        raise ValueError(f"{lay.path}: block {il} has no router (blk.{il}.ffn_gate_inp.weight)")
    h = hashlib.sha1(np.ascontiguousarray(t.data).tobytes())
    h.update(f"|{len(lay.moe_layers)}".encode())
    return h.hexdigest()


def router_weights(model) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Each MoE layer's router, read with gguf-py: (weights [n_expert, n_embd] float32 per layer,
    biases [n_expert] float32 per layer, zeros where the model has none)."""
    from gguf.quants import dequantize  # gguf-py: ~0.3 s to import, only needed here

    lay = inspect(model)
    r = _open_reader(Path(lay.path))
    ts = {t.name: t for t in r.tensors}
    Ws, bs = [], []
    for il in lay.moe_layers:
        t = ts.get(f"blk.{il}.ffn_gate_inp.weight")
        if t is None:
            raise ValueError(f"{lay.path}: block {il} has no router (blk.{il}.ffn_gate_inp.weight)")
        W = dequantize(t.data, t.tensor_type).astype(np.float32).reshape(lay.n_expert, -1)
        tb = ts.get(f"blk.{il}.ffn_gate_inp.bias")
        b = (dequantize(tb.data, tb.tensor_type).astype(np.float32).reshape(-1) if tb is not None
             else np.zeros(lay.n_expert, np.float32))
        Ws.append(W)
        bs.append(b)
    return Ws, bs
