"""Copies of a batch that share their lower layers: :func:`shared_trunk` runs them once below a layer,
:func:`expand_cache` repeats a cache prefilled once; a forward that resumes at a layer from hidden states
recorded there: :func:`start_at_layer`."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .layers import decoder_layers

__all__ = ["Trunk", "active_trunk", "expand_cache", "shared_trunk", "start_at_layer"]


@dataclass(frozen=True)
class Trunk:
    """An active :func:`shared_trunk`: ``copies`` copies of the batch run once below ``layer``."""

    layer: int
    copies: int


_TRUNK: contextvars.ContextVar[Trunk | None] = contextvars.ContextVar("headlab_trunk", default=None)


def active_trunk() -> Trunk | None:
    """The innermost active :func:`shared_trunk`, if any."""
    return _TRUNK.get()


def _repeat_rows(value: Any, B: int, copies: int, memo: dict[int, Any]) -> Any:
    """``value`` with every tensor of ``B`` rows (2-D or more) repeated ``copies`` times along the rows;
    ``memo`` keeps the repeats of one forward (the layers share their mask and position embeddings)."""
    if isinstance(value, Tensor):
        if value.dim() < 2 or value.shape[0] != B:
            return value
        hit = memo.get(id(value))
        if hit is None or hit[0] is not value:
            hit = memo[id(value)] = (value, value.repeat(copies, *([1] * (value.dim() - 1))))
        return hit[1]
    if isinstance(value, (tuple, list)):
        return type(value)(_repeat_rows(v, B, copies, memo) for v in value)
    return value


@contextlib.contextmanager
def shared_trunk(model: Any, layer: int, copies: int) -> Iterator[None]:
    """Run ``copies`` identical copies of a batch once below ``layer`` (an exact saving for DeCoRe).

    Inside the block the model is called with the ``B`` rows of copy 0 (input ids, attention mask,
    positions). Layers ``0..layer-1`` run on those rows once; on entering ``layer`` the hidden states and
    every per-row input of the layers (attention mask, position embeddings) are repeated to
    ``copies * B`` rows, ordered as the copies (row ``r + c * B`` is row ``r`` of copy ``c``), so the
    logits have ``copies * B`` rows, as if every copy had been run. A KV cache then holds ``B`` rows for
    the layers below ``layer`` and ``copies * B`` rows for the others (see :func:`expand_cache`).

    The active :class:`Plan` is written for the ``copies * B`` rows; below ``layer`` its edits must be the
    same for every copy (checked on every layer) and it may not probe there or have ``on_layer``
    callbacks. ``layer`` equal to the number of layers runs the whole model once (logits of ``B`` rows).
    """
    layers = decoder_layers(model)
    if not 0 <= layer <= len(layers) or copies < 1:
        raise ValueError(f"shared_trunk: layer must be in 0..{len(layers)} and copies >= 1, got {layer}, {copies}")
    state: dict[str, Any] = {}

    def first(module, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        state["B"] = B = int(hidden.shape[0])
        state["memo"] = memo = {}
        return (_repeat_rows(args, B, copies, memo),
                {k: _repeat_rows(v, B, copies, memo) for k, v in kwargs.items()})

    def later(module, args, kwargs):
        B, memo = state["B"], state["memo"]
        return args, {k: _repeat_rows(v, B, copies, memo) for k, v in kwargs.items()}

    handles = []
    if copies > 1 and layer < len(layers):
        handles.append(layers[layer].register_forward_pre_hook(first, with_kwargs=True))
        handles += [m.register_forward_pre_hook(later, with_kwargs=True) for m in layers[layer + 1:]]
    token = _TRUNK.set(Trunk(layer, copies))
    try:
        yield
    finally:
        _TRUNK.reset(token)
        for h in handles:
            h.remove()


def expand_cache(cache: Any, layer: int, copies: int) -> None:
    """Repeat the rows of a KV cache's layers ``layer..`` to ``copies`` copies of the batch (copy-major, as
    :func:`shared_trunk`), in place: a cache prefilled once for ``B`` rows becomes the cache of the
    ``copies * B`` rows that separate at ``layer``."""
    for cl in cache.layers[layer:]:
        if not getattr(cl, "is_initialized", True) or not hasattr(cl, "batch_select_indices"):
            raise ValueError(f"expand_cache: cannot repeat the rows of a {type(cl).__name__}")
        n = int(cl.keys.shape[0])
        cl.batch_select_indices(torch.arange(n, device=cl.keys.device).repeat(copies))


def _hidden_arg(args: tuple, kwargs: dict) -> Tensor:
    return args[0] if args else kwargs["hidden_states"]


@contextlib.contextmanager
def start_at_layer(model: Any, layer: int, hidden: Tensor) -> Iterator[None]:
    """Run the model's forwards inside the block from decoder layer ``layer`` on: layers ``0..layer-1`` are
    skipped and ``layer`` receives ``hidden`` (B, N, d_model) as its input hidden states.

    With ``hidden`` the residual stream a run of the same rows recorded at the input of ``layer`` (and the
    same attention mask, positions and KV cache), the outputs are those of the whole forward wherever
    nothing below ``layer`` would change them: an edit or a probe below ``layer`` does not run. The model
    is called as usual (input ids of ``N`` positions per row: its embeddings, masks and position
    embeddings are computed and the embeddings discarded); ``layer`` 0 replaces the embeddings' output.
    Inside the block the skipped layers' ``forward`` is replaced on the modules, so the model must not run
    other forwards concurrently.
    """
    layers = decoder_layers(model)
    if not 0 <= layer < len(layers):
        raise ValueError(f"start_at_layer: layer must be in 0..{len(layers) - 1}, got {layer}")

    def enter(module, args, kwargs):
        h = _hidden_arg(args, kwargs)
        if tuple(h.shape) != tuple(hidden.shape):
            raise ValueError(f"start_at_layer: hidden states of shape {tuple(hidden.shape)} for a forward whose "
                             f"layer {layer} input has shape {tuple(h.shape)}")
        value = hidden.to(device=h.device, dtype=h.dtype)
        if args:
            return (value, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": value}

    def skip(*args, **kwargs):
        return _hidden_arg(args, kwargs)

    saved = [m.__dict__.get("forward") for m in layers[:layer]]
    handle = layers[layer].register_forward_pre_hook(enter, with_kwargs=True)
    for m in layers[:layer]:
        m.forward = skip
    try:
        yield
    finally:
        handle.remove()
        for m, old in zip(layers[:layer], saved, strict=True):
            if old is None:
                del m.forward
            else:
                m.forward = old
