"""The residual-stream norms of a model as affine maps: what the circuit detectors fold into weights.

A norm of the supported architectures computes ``norm(x) = centre(x) / s(x) * g + b``: ``centre`` subtracts
the mean over the model dimension for LayerNorm (``torch.nn.LayerNorm``: gpt2) and is the identity for RMS
norms (llama, qwen2, gemma2, ...); ``s(x)`` is ``sqrt(mean(centre(x)^2) + eps)``; ``g`` the gain; ``b`` the
bias (LayerNorm only). :func:`affine_norm` reads ``g``, ``b`` and ``eps`` from the module (the gain as the
module applies it, so gemma2's ``1 + weight`` is covered) and checks the reading against the module's own
output, so a norm of another form is an error rather than a silently wrong number.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["AffineNorm", "affine_norm"]


@dataclass(frozen=True)
class AffineNorm:
    """A norm as ``centre(x) / s(x) * gain + bias`` (float64 tensors on the module's device)."""

    centre: bool
    gain: Tensor
    bias: Tensor | None
    eps: float

    def centred(self, x: Tensor) -> Tensor:
        """``x`` minus its mean over the last dimension for LayerNorm, else ``x``."""
        return x - x.mean(-1, keepdim=True) if self.centre else x

    def scale(self, x: Tensor) -> Tensor:
        """``s(x)`` over the last dimension, keeping it (..., 1)."""
        c = self.centred(x)
        return (c.pow(2).mean(-1, keepdim=True) + self.eps).sqrt()

    def linear(self, c: Tensor, scale: Tensor) -> Tensor:
        """The norm's linear part applied to ``c`` with the scale frozen at ``scale``:
        ``centre(c) / scale * gain`` (no bias)."""
        return self.centred(c) / scale * self.gain

    def __call__(self, x: Tensor) -> Tensor:
        out = self.linear(x, self.scale(x))
        return out if self.bias is None else out + self.bias


def affine_norm(norm: torch.nn.Module, d_model: int) -> AffineNorm:
    """``norm`` (a final or input norm module of the model) as an :class:`AffineNorm`; a ``ValueError`` naming
    the module when its output does not follow that form."""
    param = next(norm.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    dtype = param.dtype if param is not None else torch.float32
    centre = isinstance(norm, torch.nn.LayerNorm)
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    if eps is None:
        raise ValueError(f"{type(norm).__name__}: no eps (variance_epsilon) to read; not a LayerNorm or RMS norm")
    eps = float(eps)
    with torch.no_grad():
        if centre:
            weight, b = norm.weight, norm.bias
            gain = torch.ones(d_model, dtype=torch.float64, device=device) if weight is None else weight.double()
            bias = None if b is None else b.detach().double()
        else:  # an RMS norm maps the all-ones vector (scale sqrt(1 + eps)) to gain / sqrt(1 + eps)
            ones = torch.ones(1, d_model, dtype=dtype, device=device)
            gain = norm(ones)[0].double() * (1.0 + eps) ** 0.5
            bias = None
        rule = AffineNorm(centre, gain.detach(), bias, eps)
        probe = torch.randn(4, d_model, generator=torch.Generator().manual_seed(0), dtype=torch.float64).to(device)
        expected = norm(probe.to(dtype)).double()
        got = rule(probe)
        if not torch.allclose(got, expected, rtol=1e-3, atol=1e-4 * float(expected.abs().max())):
            raise ValueError(f"{type(norm).__name__} is not of the form centre(x) / sqrt(mean(x^2) + eps) * g + b "
                             "(LayerNorm or RMS norm); the circuit detectors cannot fold it")
    return rule
