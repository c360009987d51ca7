"""Segment divergence: how much each head's output depends on a marked span of the input (VHD, generalised).

Definition: docs/methods.md#vhd:
``VHD[l,h] = || z[l,h](x with segment) - z[l,h](x without segment) ||_2`` at the current generation
position (the last input position), where ``z[l,h]`` is the head's output ``A·V`` before ``o_proj``. In
a vision-language model the segment is the image tokens (``span: image``, the default for examples with
images); otherwise any marked span: the examples' character spans called ``span`` (several spans of one
example are removed together).

Two forwards per batch, both through :func:`headlab.instrument.instrument` with
``Probes(z_positions="last")`` (nothing else recorded): the input as is, and the input without the
segment. ``method: remove`` (default, VHR's text-only forward) deletes the segment's tokens and re-pads
(positions of the later tokens shift down); ``method: mask`` keeps the tokens and their positions but
hides them from every query through the attention mask.

Outputs: ``score (layer, head)`` (mean over examples), ``example_score (example, layer, head)`` and
``norm_without (example, layer, head)`` ``= ||z[l,h](x without segment)||^2`` (VHR's ``TA``, used by its
outlier filter). With images the forward with the segment gets the processor inputs (``pixel_values``,
...); ``remove``'s forward without it has neither the image tokens nor the image, ``mask``'s keeps both
and hides the tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import numpy as np
import torch
import xarray as xr
from pydantic import Field

from headlab import attention_preview, positions_from_mask
from headlab.plugin import (
    ComponentConfig,
    NonEmptyStr,
    Plan,
    PositiveInt,
    Probes,
    StepContext,
    forward,
    head_array,
    hookimpl,
    tokenize,
)
from headlab.resources import Estimate, EstimateContext

__all__ = ["SegmentDivergence", "detect", "last_z", "remove_spans", "segment_divergence"]

Spans = Sequence[Sequence[tuple[int, int]]]


class SegmentDivergence(ComponentConfig):
    """Per-head L2 distance of the output with vs without a marked span, at the generation position (VHD)."""

    kind: Literal["segment_divergence"] = "segment_divergence"
    span: NonEmptyStr | None = Field(
        None, description="name of the examples' span(s) to take away (default: image for examples with images "
        "(the image tokens), else context)")
    method: Literal["remove", "mask"] = Field(
        "remove", description="remove: delete the span's tokens (VHR's text-only forward); "
        "mask: keep them and their positions but hide them from attention")
    batch_size: PositiveInt = 8

    def estimate(self, ctx: EstimateContext) -> list[Estimate]:
        """Hidden states of a batch's forward over the longest prompt (resource guard)."""
        return [ctx.activations(ctx.task.tokens, ctx.rows(self.batch_size))]


def last_z(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, *,
           position_ids: torch.Tensor | None = None, **forward_kwargs: Any) -> torch.Tensor:
    """Head outputs ``z`` at the last position of one forward: (batch, layer, head, head_dim), float32."""
    if position_ids is not None:
        forward_kwargs = {**forward_kwargs, "position_ids": position_ids}
    # only z is read: no KV cache, no (batch, length, vocab) logits
    _, rec = forward(model, input_ids, Plan(probes=Probes(z_positions="last")), attention_mask=attention_mask,
                     logits_to_keep=1, **forward_kwargs)
    return rec.z[:, :, :, -1].float()


def remove_spans(input_ids: torch.Tensor, attention_mask: torch.Tensor, spans: Spans,
                 pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch without the tokens of ``spans`` (absolute positions per row), left-padded again."""
    rows = []
    for r in range(input_ids.shape[0]):
        keep = attention_mask[r].bool().clone()
        for s, e in spans[r]:
            keep[s:e] = False
        rows.append(input_ids[r][keep])
    n = max(len(x) for x in rows)
    ids = torch.full((len(rows), n), pad_id, dtype=input_ids.dtype, device=input_ids.device)
    mask = torch.zeros((len(rows), n), dtype=attention_mask.dtype, device=attention_mask.device)
    for r, x in enumerate(rows):
        ids[r, n - len(x):] = x
        mask[r, n - len(x):] = 1
    return ids, mask


def segment_divergence(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, spans: Spans, *,
                       method: Literal["remove", "mask"] = "remove", pad_id: int = 0,
                       forward_kwargs: dict[str, Any] | None = None,
                       forward_kwargs_without: dict[str, Any] | None = None,
                       position_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """VHD per (row, layer, head) and ``||z_without||^2``, both (batch, layer, head) float32.

    ``spans``: per row, ``[start, end)`` token positions (padded coordinates) of the segment; the last
    position (the generation position) must stay outside. ``forward_kwargs`` go to the forward with the
    segment (e.g. ``pixel_values``), ``forward_kwargs_without`` to the one without it; ``position_ids``
    (default: following the mask) to the forward with the segment and, with ``mask``, the one without.
    """
    n = input_ids.shape[1]
    for r, row in enumerate(spans):
        if not row:
            raise ValueError(f"row {r} has no segment span")
        if any(e >= n for _, e in row):
            raise ValueError(f"row {r}: the segment covers the last (generation) position")
    z_with = last_z(model, input_ids, attention_mask, position_ids=position_ids, **(forward_kwargs or {}))
    if method == "remove":
        ids, mask = remove_spans(input_ids, attention_mask, spans, pad_id)
        z_without = last_z(model, ids, mask, **(forward_kwargs_without or {}))
    elif method == "mask":
        pos = positions_from_mask(attention_mask) if position_ids is None else position_ids
        mask = attention_mask.clone()
        for r, row in enumerate(spans):
            for s, e in row:
                mask[r, s:e] = 0
        z_without = last_z(model, input_ids, mask, position_ids=pos, **(forward_kwargs_without or {}))
    else:
        raise ValueError(f"method must be 'remove' or 'mask', got {method!r}")
    return (z_with - z_without).norm(dim=-1), z_without.pow(2).sum(-1)


def detect(config: SegmentDivergence, ctx: StepContext) -> xr.Dataset:
    """The ``segment_divergence`` detector over the task's examples."""
    geo = ctx.model.geometry
    images = any(ex.images for ex in ctx.examples)
    name = config.span or ("image" if images else "context")
    for i, ex in enumerate(ctx.examples):
        if not ex.spans.get(name) and not (name == "image" and ex.images):
            raise ValueError(f"segment_divergence: example {i} has no '{name}' span")
    vhd = np.zeros((len(ctx.examples), geo.n_layers, geo.n_heads))
    norm = np.zeros_like(vhd)
    idx_all = list(range(len(ctx.examples)))
    chunks = [idx_all[j: j + config.batch_size] for j in range(0, len(idx_all), config.batch_size)]
    for idx in ctx.progress(chunks, "segment divergence"):
        batch = tokenize(ctx.model, [ctx.examples[i] for i in idx])
        spans = batch.spans(name)
        inputs = batch.forward_inputs()
        d, t = segment_divergence(ctx.model.model, batch.input_ids, batch.attention_mask, spans,
                                  method=config.method, pad_id=ctx.model.pad_id, forward_kwargs=inputs,
                                  forward_kwargs_without=inputs if config.method == "mask" else None,
                                  position_ids=batch.positions() if batch.has_images else None)
        vhd[idx] = d.double().cpu().numpy()
        norm[idx] = t.double().cpu().numpy()
    per = head_array(vhd, "example")
    ds = xr.Dataset({"score": per.mean("example"), "example_score": per,
                     "norm_without": head_array(norm, "example")})
    ds.attrs.update(method="segment_divergence", span=name, removal=config.method, model=ctx.model.name,
                    reference="docs/methods.md#vhd")
    if images:  # the first example's image with every head's attention on it, for the report
        ds = ds.merge(attention_preview(ctx.model, ctx.examples[0]))
    return ds


@hookimpl
def headlab_register_detectors(register):
    register(SegmentDivergence, detect)
