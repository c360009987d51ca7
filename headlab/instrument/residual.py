"""The plan's per-layer residual-stream edits (:class:`ReplaceResid`, :class:`DropResidGrad`) as hooks on the
decoder layers for the duration of one :func:`~headlab.instrument.instrument` context."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from .layers import decoder_layers
from .plan import DropResidGrad, Plan, ReplaceResid
from .session import Session
from .trunk import active_trunk

__all__ = ["residual_hooks"]


class _SkipWrite(torch.autograd.Function):
    """Identity in the forward pass on a layer's output; in the backward pass the rows in ``drop`` send the
    gradient to the layer's input (the skip) and none into the layer."""

    @staticmethod
    def forward(ctx, out: Tensor, inp: Tensor, drop: Tensor) -> Tensor:
        ctx.save_for_backward(drop)
        return out.clone()

    @staticmethod
    def backward(ctx, grad: Tensor):
        (drop,) = ctx.saved_tensors
        keep = (~drop).to(grad.dtype).view(-1, *([1] * (grad.dim() - 1)))
        return grad * keep, grad * (1 - keep), None


def _hidden(args: tuple, kwargs: dict) -> Tensor:
    return args[0] if args else kwargs["hidden_states"]


def _with_hidden(args: tuple, kwargs: dict, hidden: Tensor) -> tuple[tuple, dict]:
    if args:
        return (hidden, *args[1:]), kwargs
    return args, {**kwargs, "hidden_states": hidden}


def _rows(rows: list[int] | None, B: int, what: str) -> list[int]:
    out = list(range(B)) if rows is None else rows
    if out and max(out) >= B:
        raise ValueError(f"{what} rows {rows} out of range for batch size {B}")
    return out


def _replaced(e: ReplaceResid, hidden: Tensor, q_start: int) -> Tensor:
    """``hidden`` (B, Nq, d) of a call whose first query is at ``q_start`` with ``e``'s values at its rows and
    the call's positions (out of place)."""
    B, Nq, d = hidden.shape
    rows = _rows(e.rows, B, "ReplaceResid")
    values = e.full_values(len(rows))
    if values.shape[-1] != d:
        raise ValueError(f"ReplaceResid: values have hidden size {values.shape[-1]}, layer {e.layer} has {d}")
    positions = torch.arange(e.n_positions()) if e.positions is None else torch.tensor(e.positions)
    q = positions - q_start
    p_sel = ((q >= 0) & (q < Nq)).nonzero().flatten()
    if not p_sel.numel():
        return hidden
    vals = values[:, p_sel.to(values.device)].to(device=hidden.device, dtype=hidden.dtype)
    r_idx = torch.tensor(rows, device=hidden.device)[:, None]
    q_idx = q[p_sel].to(hidden.device)[None, :]
    r_idx, q_idx = torch.broadcast_tensors(r_idx, q_idx)
    return hidden.index_put((r_idx, q_idx), vals)


@contextlib.contextmanager
def residual_hooks(model: Any, sess: Session) -> Iterator[None]:
    """Install the session plan's residual edits on ``model``'s decoder layers inside the block (nothing when
    the plan has none): a forward pre-hook replacing the input hidden states, a forward hook wrapping the
    output for the gradient drops."""
    plan: Plan = sess.plan
    edits = [e for e in plan.edits if isinstance(e, (ReplaceResid, DropResidGrad))]
    if not edits:
        yield
        return
    layers = decoder_layers(model)
    bad = sorted({e.layer for e in edits if e.layer >= len(layers)})
    if bad:
        raise ValueError(f"residual edit layers {bad} out of range (model has {len(layers)})")
    handles = []

    def pre(layer: int, replace: list[ReplaceResid]):
        def hook(module, args, kwargs):
            if active_trunk() is not None:
                raise ValueError("ReplaceResid: the residual stream cannot be replaced under shared_trunk")
            hidden = _hidden(args, kwargs)
            q_start = sess.q_count.get(layer, 0)
            for e in replace:
                hidden = _replaced(e, hidden, q_start)
            return _with_hidden(args, kwargs, hidden)
        return hook

    def post(drops: list[DropResidGrad]):
        def hook(module, args, kwargs, output):
            inp = _hidden(args, kwargs)
            out = output[0] if isinstance(output, tuple) else output
            drop = torch.zeros(out.shape[0], dtype=torch.bool, device=out.device)
            for e in drops:
                drop[_rows(e.rows, out.shape[0], "DropResidGrad")] = True
            out = _SkipWrite.apply(out, inp, drop)
            return (out, *output[1:]) if isinstance(output, tuple) else out
        return hook

    try:
        for layer in sorted({e.layer for e in edits}):
            replace = [e for e in edits if isinstance(e, ReplaceResid) and e.layer == layer]
            drops = [e for e in edits if isinstance(e, DropResidGrad) and e.layer == layer]
            if replace:
                handles.append(layers[layer].register_forward_pre_hook(pre(layer, replace), with_kwargs=True))
            if drops:
                handles.append(layers[layer].register_forward_hook(post(drops), with_kwargs=True))
        yield
    finally:
        for h in handles:
            h.remove()
