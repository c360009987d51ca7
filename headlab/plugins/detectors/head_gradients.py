"""Every head's output ``z`` (the input of its layer's attention output projection) and the gradient of a metric
with respect to it, from one forward and one backward: the pieces that attribution patching
(docs/methods.md#attribution-patching) and gradient head importance (docs/methods.md#gradient-head-importance)
share.

:func:`head_outputs` records each layer's ``z`` during a forward (in the autograd graph with ``grad``);
:func:`head_gradients` runs a batch under ``headlab.forward(..., grad=True)`` inside it and returns ``z`` and
``d metric / d z`` for all heads at once (``torch.autograd.grad`` with respect to those tensors only: no parameter
gets a gradient).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

from headlab.plugin import Batch, Plan, forward

__all__ = ["by_head", "head_gradients", "head_outputs", "out_projections"]


def out_projections(lm, method: str = "attribution_patching") -> list[torch.nn.Module]:
    """Each decoder layer's attention output projection, whose input is the layer's head outputs ``z`` as
    (rows, positions, head * head_dim); a ValueError naming ``method`` and the layer where there is none."""
    projections = []
    for layer in range(lm.geometry.n_layers):
        attn = lm.attention_module(layer)
        proj = next((m for m in (getattr(attn, name, None) for name in ("o_proj", "c_proj"))
                     if isinstance(m, torch.nn.Module)), None)
        if proj is None:
            raise ValueError(f"{method}: the attention of layer {layer} ({type(attn).__name__}) has no "
                             "output projection (o_proj or c_proj) whose input is the heads' z")
        projections.append(proj)
    return projections


@contextlib.contextmanager
def head_outputs(lm, grad: bool = False, last_only: bool = False,
                 method: str = "attribution_patching") -> Iterator[tuple[list[torch.Tensor], list[torch.Tensor]]]:
    """Inside the block, ``(z, leaves)``: every layer's head outputs (rows, position, head * head_dim) of one
    forward, in layer order and detached; with ``grad``, each layer's ``z`` in the autograd graph (rows,
    position, head * head_dim), whose gradient is ``d output / d z`` (a leaf of the same values in its place
    where nothing before it requires grad). ``last_only``: the
    last layer's output projection and MLP run at the last position only (the residual stream there is
    exact, the other positions' is not: for forwards that read the last position's logits only)."""
    projections = out_projections(lm, method)
    zs: list[torch.Tensor] = []
    leaves: list[torch.Tensor] = []

    def pre(module, args):
        x = args[0]
        zs.append(x.detach())
        if grad:
            if not x.requires_grad:
                x = x.detach().requires_grad_()
            leaves.append(x)
        if last_only and module is projections[-1]:
            x = x[:, -1:]
        return None if x is args[0] else (x, *args[1:])

    handles = [m.register_forward_pre_hook(pre) for m in projections]
    mlp = getattr(lm.decoder_layers[-1], "mlp", None)
    if last_only and isinstance(mlp, torch.nn.Module):  # its output is added to the residual stream by broadcasting
        handles.append(mlp.register_forward_pre_hook(
            lambda module, args: (args[0][:, -1:], *args[1:]) if args else None))
    try:
        yield zs, leaves
    finally:
        for h in handles:
            h.remove()


def by_head(lm, x: torch.Tensor) -> torch.Tensor:
    """(..., position, head * head_dim) as a (..., head, position, head_dim) view."""
    return x.view(*x.shape[:-1], lm.geometry.n_heads, -1).transpose(-2, -3)


def head_gradients(lm, batch: Batch, metric: Callable[[torch.Tensor], torch.Tensor], logits_to_keep: int = 1,
                   method: str = "head_importance",
                   plan: Plan | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(z, d metric / d z, metric)`` of a tokenized batch: ``z`` and its gradient (row, layer, head, position,
    head_dim) for every head, ``metric`` (row,) detached. ``metric`` maps the logits of the last
    ``logits_to_keep`` positions (row, position, vocab) to one differentiable number per row; a row's gradient is
    that of its own number (rows do not interact). One forward (``headlab.forward(..., grad=True)``) and one
    backward; with ``logits_to_keep=1`` the last layer's output projection and MLP run at the last position
    only. ``plan``: edits the forward runs under (a head mask), none by default."""
    with head_outputs(lm, grad=True, last_only=logits_to_keep == 1, method=method) as (zs, leaves):
        out, _ = forward(lm, batch, plan if plan is not None else Plan(), grad=True, logits_to_keep=logits_to_keep)
        m = metric(out.logits[:, -logits_to_keep:])
    grads = torch.autograd.grad(m.sum(), leaves, allow_unused=True)
    g = torch.stack([torch.zeros_like(x) if d is None else d for x, d in zip(leaves, grads, strict=True)], dim=1)
    return by_head(lm, torch.stack(zs, dim=1)), by_head(lm, g), m.detach()
