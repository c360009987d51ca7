"""Composition scores between heads of different layers, from the weights (Elhage et al. 2021).

Definition: docs/methods.md#composition-scores. For an earlier head ``(s, j)`` and a later head ``(l, h)``
(``s < l``), with ``OV = W_V W_O`` and ``QK = W_Q W_K^T`` (d_model x d_model, row-vector convention):

    q_comp = ||OV[s, j] QK[l, h]||_F   / (||OV[s, j]||_F ||QK[l, h]||_F)
    k_comp = ||OV[s, j] QK[l, h]^T||_F / (||OV[s, j]||_F ||QK[l, h]||_F)
    v_comp = ||OV[s, j] OV[l, h]||_F   / (||OV[s, j]||_F ||OV[l, h]||_F)

and 0 where ``s >= l``, as TransformerLens' ``all_composition_scores``. ``W_K`` and ``W_V`` of a head are those
of its key/value head (grouped-query attention). The weights are folded as TransformerLens folds them
(``fold_ln``, ``center_writing_weights``):

- the gain of layer ``l``'s input norm multiplies the rows (the d_model side) of ``W_Q``, ``W_K`` and ``W_V``;
- LayerNorm models (gpt2): ``W_Q``, ``W_K``, ``W_V`` are then centred over d_model (LayerNorm's output has no
  component along the all-ones direction, so nothing reads it) and ``W_O`` is centred over d_model (the
  writing weights: what a head writes along the all-ones direction is removed by every later LayerNorm);
- RMS norm models (llama, mistral, qwen2, gemma2, olmo2, phi3): only the gains are folded; nothing is centred
  (an RMS norm removes no direction);
- where the attention output is normalised before the residual stream (gemma2's and olmo2's
  ``post_attention_layernorm``) that norm's gain multiplies the columns of ``W_O``; olmo2's query and key norms
  (RMS norms over the projections of all heads) put their gains on the d_head side of ``W_Q`` and ``W_K``.

Left out: the norms' ``1 / s(x)`` scales (one positive factor per token, which no Frobenius ratio of weights
can hold), every bias, rotary embeddings and the attention scale (a constant factor the ratios cancel).

How it is computed: with ``A B`` a factored matrix (``A`` d_model x d_head, ``B`` d_head x d_model) and
``R_A``, ``R_B`` the d_head x d_head triangular factors of ``A``'s and ``B^T``'s QR decompositions (so that
``R_A^T R_A = A^T A`` and ``R_B^T R_B = B B^T``, the Gram matrices), ``||A_1 B_1 A_2 B_2||_F = ||(R_A1 B_1) (A_2
R_B2^T)||_F``: one (heads x d_head, d_model) by (d_model, 3 x heads x d_head) product per pair of layers gives
every score of the pair. Memory is that product, ``3 x d_model^2`` numbers when heads x d_head = d_model, never
the ``[L, H, L, H, d_head, d_head]`` tensor; each earlier layer's factors are made again for each later layer.

The baseline: the same ratio for ``baseline_samples`` pairs of factored matrices of the same shapes with
independent standard normal entries (seeded with the step's seed), its mean and standard deviation, so that a
score can be read against chance (about ``baseline_mean + 3 x baseline_std`` and above is unlikely by chance).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch
import xarray as xr
from pydantic import Field
from torch import Tensor

from headlab.anatomy import AnatomyError
from headlab.plugin import ComponentConfig, PositiveInt, StepContext, hookimpl
from headlab.plugins.detectors.norms import affine_norm
from headlab.plugins.detectors.ov_circuit import attention_output_norm
from headlab.resources import Estimate, EstimateContext

__all__ = ["Composition", "FoldedHeads", "composition_scores", "detect", "folded_heads", "pair_scores",
           "random_baseline", "require"]

Precision = Literal["float32", "float64"]
_DTYPES = {"float32": torch.float32, "float64": torch.float64}
MODES = ("q", "k", "v")


class Composition(ComponentConfig):
    """Q-, K- and V-composition between every earlier and later head, from the weights, with a random baseline."""

    kind: Literal["composition"] = "composition"
    precision: Precision = Field("float32", description="dtype of the products")
    baseline_samples: PositiveInt = Field(200, description="random factored-matrix pairs behind the baseline")

    def estimate(self, ctx: EstimateContext) -> list[Estimate]:
        """The product of one pair of layers, and the factors of the two layers."""
        g = ctx.geometry
        width = 8 if self.precision == "float64" else 4
        rows = g.n_heads * g.head_dim
        return [Estimate("composition products of a pair of layers", rows * 3 * rows * width,
                         f"{rows:,} x {3 * rows:,} (heads x head_dim, 3 x heads x head_dim) x {width} bytes"),
                Estimate("folded head weights of two layers", 2 * 4 * rows * ctx.hidden_size * width,
                         f"2 layers x 4 matrices x {rows:,} x {ctx.hidden_size} hidden x {width} bytes")]


@dataclass(frozen=True)
class FoldedHeads:
    """One layer's folded head weights (see the module docstring), one entry per query head: ``W_Q``, ``W_K``,
    ``W_V`` (head, d_model, d_head), ``W_O`` (head, d_head, d_model)."""

    W_Q: Tensor
    W_K: Tensor
    W_V: Tensor
    W_O: Tensor


def require(what: str, read: Any) -> Any:
    """``read()``, with an :class:`AnatomyError` from the model's anatomy restated as one line naming ``what``
    (the weight the caller needed)."""
    try:
        return read()
    except AnatomyError as e:
        raise AnatomyError(f"composition: the model's anatomy has no {what}: {e}") from None


def _gain(lm: Any, norm: torch.nn.Module, width: int) -> Any:
    with lm.weights_loaded(norm):
        return affine_norm(norm, width)


def folded_heads(lm: Any, layer: int, dtype: torch.dtype = torch.float32, device: Any = None) -> FoldedHeads:
    """Layer ``layer``'s head weights with the model's norms folded in as TransformerLens folds them."""
    hw = require(f"W_Q, W_K, W_V, W_O of layer {layer}", lambda: lm.head_weights(layer))
    device = hw.W_Q.device if device is None else device
    cast = lambda t: t.to(device, dtype)  # noqa: E731
    W_Q, W_K, W_V, W_O = cast(hw.W_Q), cast(hw.per_query_head(hw.W_K)), cast(hw.per_query_head(hw.W_V)), cast(hw.W_O)
    d_model = hw.d_model
    norm = require(f"input norm of layer {layer}", lambda: lm.input_norm(layer))
    layer_norm = False
    if norm is not None:
        rule = _gain(lm, norm, d_model)
        g = cast(rule.gain)[None, :, None]
        W_Q, W_K, W_V = W_Q * g, W_K * g, W_V * g
        if rule.centre:
            layer_norm = True
            W_Q, W_K, W_V = (w - w.mean(1, keepdim=True) for w in (W_Q, W_K, W_V))
    qk = require(f"query and key norms of layer {layer}", lambda: lm.query_key_norms(layer))
    if qk is not None:
        gq = cast(_gain(lm, qk[0], hw.n_heads * hw.d_head).gain).reshape(hw.n_heads, 1, hw.d_head)
        gk = cast(_gain(lm, qk[1], hw.n_kv_heads * hw.d_head).gain).reshape(hw.n_kv_heads, 1, hw.d_head)
        W_Q, W_K = W_Q * gq, W_K * hw.per_query_head(gk)
    post = attention_output_norm(lm, layer)
    if post is not None:
        W_O = W_O * cast(_gain(lm, post, d_model).gain)[None, None, :]
    if layer_norm:
        W_O = W_O - W_O.mean(-1, keepdim=True)
    return FoldedHeads(W_Q, W_K, W_V, W_O)


def _r(a: Tensor) -> Tensor:
    """The (..., d_head, d_head) triangular factor ``R`` of ``a``'s (..., d_model, d_head) reduced QR: ``R^T R``
    is ``a^T a``."""
    return torch.linalg.qr(a, mode="r")[1]


def _left(w: FoldedHeads) -> Tensor:
    """``R_V W_O`` (head, d_head, d_model): the OV circuit's left factor, with ``||OV||_F`` its norm."""
    return _r(w.W_V) @ w.W_O


def _right(w: FoldedHeads) -> tuple[Tensor, Tensor]:
    """The right factors (head, d_model, d_head) ``W_Q R_K^T``, ``W_K R_Q^T``, ``W_V R_O^T`` (Q, K, V side),
    and the norms (3, head) of ``QK``, ``QK^T`` and ``OV``."""
    r_q, r_k, r_o = _r(w.W_Q), _r(w.W_K), _r(w.W_O.transpose(1, 2))
    right = torch.stack([w.W_Q @ r_k.transpose(1, 2), w.W_K @ r_q.transpose(1, 2), w.W_V @ r_o.transpose(1, 2)])
    qk = torch.linalg.matrix_norm(r_q @ r_k.transpose(1, 2))
    ov = torch.linalg.matrix_norm(_r(w.W_V) @ r_o.transpose(1, 2))
    return right, torch.stack([qk, qk, ov])


def _ratio(num: Tensor, den: Tensor) -> Tensor:
    return torch.where(den > 0, num / torch.where(den > 0, den, torch.ones_like(den)), torch.zeros_like(num))


def pair_scores(left: Tensor, left_norm: Tensor, right: Tensor, right_norm: Tensor) -> Tensor:
    """(3, src_head, head) composition scores of the earlier heads' ``left`` factors (src_head, d_head, d_model)
    with the later heads' ``right`` factors (3, head, d_model, d_head), from one matrix product."""
    hs, e, d = left.shape
    _, h, _, e2 = right.shape
    prod = left.reshape(hs * e, d) @ right.permute(2, 0, 1, 3).reshape(d, 3 * h * e2)
    num = prod.reshape(hs, e, 3, h, e2).pow(2).sum((1, 4)).sqrt().permute(1, 0, 2)  # (3, src_head, head)
    return _ratio(num, left_norm[None, :, None] * right_norm[:, None, :])


def composition_scores(lm: Any, precision: Precision = "float32", progress: Any = None) -> np.ndarray:
    """(3, src_layer, src_head, layer, head) float64 array: the Q-, K- and V-composition scores of the model's
    heads (zero where ``src_layer >= layer``), one later layer at a time."""
    dtype = _DTYPES[precision]
    L, H = lm.geometry.n_layers, lm.geometry.n_heads
    out = np.zeros((3, L, H, L, H))
    device = require("W_Q, W_K, W_V, W_O of layer 0", lambda: lm.head_weights(0)).W_Q.device
    layers = range(1, L)
    with torch.no_grad():
        for layer in (progress(layers, "composition") if progress is not None else layers):
            right, right_norm = _right(folded_heads(lm, layer, dtype, device))
            for src in range(layer):
                left = _left(folded_heads(lm, src, dtype, device))
                left_norm = torch.linalg.matrix_norm(left)
                out[:, src, :, layer, :] = pair_scores(left, left_norm, right, right_norm).double().cpu().numpy()
    return out


def random_baseline(d_model: int, d_head: int, samples: int, seed: int, precision: Precision = "float32",
                    chunk: int = 16) -> np.ndarray:
    """(samples,) composition scores ``||A_1 B_1 A_2 B_2||_F / (||A_1 B_1||_F ||A_2 B_2||_F)`` of factored
    matrices with independent standard normal entries of the heads' shapes, seeded."""
    gen = torch.Generator().manual_seed(int(seed))
    dtype = _DTYPES[precision]
    scores = []
    with torch.no_grad():
        for start in range(0, samples, chunk):
            n = min(chunk, samples - start)
            a1, a2 = (torch.randn(n, d_model, d_head, generator=gen, dtype=dtype) for _ in range(2))
            b1, b2 = (torch.randn(n, d_head, d_model, generator=gen, dtype=dtype) for _ in range(2))
            left = _r(a1) @ b1  # (n, e, d)
            right = a2 @ _r(b2.transpose(1, 2)).transpose(1, 2)  # (n, d, e)
            num = torch.linalg.matrix_norm(left @ right)
            den = torch.linalg.matrix_norm(left) * torch.linalg.matrix_norm(_r(a2) @ b2)
            scores.append((num / den).double())
    return torch.cat(scores).numpy()


def detect(config: Composition, ctx: StepContext) -> xr.Dataset:
    """The ``composition`` detector on the model's weights (the task's examples are not used)."""
    lm = ctx.model
    L, H, D = lm.geometry.n_layers, lm.geometry.n_heads, lm.geometry.head_dim
    scores = composition_scores(lm, config.precision, ctx.progress)
    d_model = int(require("W_Q, W_K, W_V, W_O of layer 0", lambda: lm.head_weights(0)).d_model)
    baseline = random_baseline(d_model, D, config.baseline_samples, ctx.seed, config.precision)
    dims = ("src_layer", "src_head", "layer", "head")
    coords = {"src_layer": np.arange(L), "src_head": np.arange(H), "layer": np.arange(L), "head": np.arange(H)}
    data: dict[str, Any] = {f"{m}_comp": xr.DataArray(scores[i], dims=dims, coords=coords)
                            for i, m in enumerate(MODES)}
    data["score"] = xr.DataArray(scores.max(axis=(0, 1, 2)), dims=("layer", "head"),
                                 coords={"layer": np.arange(L), "head": np.arange(H)})
    data["baseline_mean"] = xr.DataArray(float(baseline.mean()))
    data["baseline_std"] = xr.DataArray(float(baseline.std(ddof=1)) if len(baseline) > 1 else 0.0)
    ds = xr.Dataset(data)
    ds.attrs.update(method="composition", model=lm.name, precision=config.precision,
                    baseline_samples=config.baseline_samples, baseline_seed=ctx.seed,
                    reference="docs/methods.md#composition-scores")
    return ds


@hookimpl
def headlab_register_detectors(register):
    register(Composition, detect)
