"""``vhr``: Vision-aware Head Reinforcement (He et al. 2025).

Definition: docs/methods.md#vhr (and docs/methods.md#vhd). At the first generation step (the prefill forward
that produces the first token), layer by layer inside that one forward, for each layer ``l`` in range:

1. ``VHD[l, h] = || z[l, h](with the segment) - z[l, h](without the segment) ||_2`` at the current
   generation position (the last prompt position). "Without the segment" is the same layer, same inputs
   (the hidden states this forward produced so far, earlier layers' reinforcement included), with the
   segment's keys removed from the attention (a -1e30 pre-softmax bias, i.e. weight exactly 0): the
   instrumentation recomputes it through :attr:`headlab.instrument.LayerContext.attend`;
2. outlier filter: ``VHD[l, h] = 0`` where both ``VHD[l, h] > mean + std`` of the layer and
   ``TA[l, h] > mean + std``, with ``TA[l, h] = ||z[l, h](without the segment)||^2`` (``std`` is the
   sample standard deviation over the layer's heads, ``torch.std``);
3. select the heads with ``VHD[l, h] > median(VHD[l, :])`` (the median of the filtered values, the mean
   of the two middle values for an even head count);
4. scale the selected heads' outputs ``z[l, h] *= alpha`` (default 2; 3 stronger, 4 breaks generation)
   before ``o_proj``, so layer ``l + 1`` already sees the reinforced heads.

The choice is per batch row and stays fixed for the rest of the generation (the instrumentation keeps a
callback's scale for every later call of that layer). The segment is any marked span of the input: the
image tokens of a vision-language model (``segment_token_id``: positions holding the image token) or a
character span of the examples (``segment``: e.g. ``emphasis``, ``needle``). Rows without a segment are
not steered. Layers: ``all``, a list, or ``reference`` (layer 1 plus the last 14, the reference setting
for LLaVA-1.5-7B).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch
import xarray as xr
from pydantic import Field

from headlab import token_runs
from headlab.plugin import (
    Batch,
    ComponentConfig,
    NonEmptyStr,
    NonNegativeInt,
    PositiveFloat,
    StepContext,
    head_array,
    hookimpl,
)

Span = tuple[int, int]
#: pre-softmax bias that removes a key (exp underflows to exactly 0; finite, so no 0 * inf)
REMOVE = -1.0e30


class Vhr(ComponentConfig):
    """VHR: at the first generation step, reinforce the heads most sensitive to a segment (image tokens)."""

    kind: Literal["vhr"] = "vhr"
    alpha: PositiveFloat = Field(2.0, description="output scale of the selected heads (reference 2; 3 stronger)")
    layers: list[NonNegativeInt] | Literal["all", "reference"] = Field(
        "all", description="layers to reinforce: all, a list, or reference (layer 1 + the last 14)")
    segment: NonEmptyStr = Field("image", description="name of the examples' character spans forming the segment")
    segment_token_id: NonNegativeInt | None = Field(
        None, description="use the positions holding this token id as the segment (e.g. the image token)")
    outlier_filter: bool = Field(True, description="zero VHD where both VHD and TA exceed mean + std")


def reference_layers(n_layers: int) -> list[int]:
    """Layer 1 plus the last 14 layers (the reference setting on LLaVA-1.5-7B), within the model."""
    return sorted({ly for ly in [1, *range(n_layers - 14, n_layers)] if 0 <= ly < n_layers})


@dataclass
class VhrState:
    """What VHR chose, filled during the first forward: per layer, (batch, head) tensors."""

    vhd: dict[int, torch.Tensor] = field(default_factory=dict)
    ta: dict[int, torch.Tensor] = field(default_factory=dict)
    selected: dict[int, torch.Tensor] = field(default_factory=dict)


def vhr_select(vhd: torch.Tensor, ta: torch.Tensor, outlier_filter: bool = True) -> torch.Tensor:
    """VHR's head choice for one layer from ``vhd`` and ``ta`` (batch, head): outlier filter, then above median."""
    vhd = vhd.float()
    if outlier_filter:
        ta = ta.float()
        out = (vhd > vhd.mean(1, keepdim=True) + vhd.std(1, keepdim=True)) & (
            ta > ta.mean(1, keepdim=True) + ta.std(1, keepdim=True))
        vhd = vhd.masked_fill(out, 0.0)
    return vhd > vhd.quantile(0.5, dim=1, keepdim=True)


def add_vhr(plan: Any, segments: Sequence[Sequence[Span]], layers: Sequence[int] | None, alpha: float = 2.0,
            outlier_filter: bool = True, *, owner: Any = None) -> VhrState:
    """Register VHR on ``plan`` (an :meth:`~headlab.instrument.Plan.on_layer` callback).

    ``segments[r]``: the segment's absolute key spans in batch row ``r`` (empty: row not steered);
    ``layers``: the layers to reinforce (None = all). The callback declares every head of ``layers`` on
    the rows with a segment as heads it may scale (``owner``: the method, for the plan's conflict check;
    nothing is declared when ``layers`` is None). Returns the :class:`VhrState` filled during the first
    forward.
    """
    state = VhrState()
    rows = len(segments)
    S = max((len(s) for s in segments), default=0)
    spans = torch.zeros(rows, max(S, 1), 2, dtype=torch.long)
    bias = torch.zeros(rows, 1, max(S, 1))
    for r, segs in enumerate(segments):
        for j, (s, e) in enumerate(segs):
            spans[r, j, 0], spans[r, j, 1] = int(s), int(e)
            bias[r, 0, j] = REMOVE
    has_seg = torch.tensor([bool(s) for s in segments])
    keep = None if layers is None else {int(x) for x in layers}

    def callback(layer: int, z: torch.Tensor, ctx: Any) -> torch.Tensor | None:
        if ctx.call != 0 or (keep is not None and layer not in keep) or not bool(has_seg.any()):
            return None
        if z.shape[0] != rows:
            raise ValueError(f"vhr: plan built for {rows} rows, forward has {z.shape[0]}")
        z_with = z[:, :, -1].float()
        z_without = ctx.attend(spans.to(z.device), bias.to(z.device))[:, :, -1].float()
        vhd = (z_with - z_without).norm(dim=-1)
        ta = z_without.pow(2).sum(-1)
        sel = vhr_select(vhd, ta, outlier_filter) & has_seg.to(z.device)[:, None]
        state.vhd[layer], state.ta[layer], state.selected[layer] = vhd, ta, sel
        return torch.where(sel, torch.tensor(float(alpha), device=z.device), torch.tensor(1.0, device=z.device))

    declared = None if keep is None else [(ly, None) for ly in sorted(keep)]
    plan.on_layer(callback, heads=declared, rows=[r for r, s in enumerate(segments) if s], owner=owner)
    return state


def segments_of(batch: Batch, segment: str, segment_token_id: int | None) -> list[list[Span]]:
    """The segment spans per row: runs of ``segment_token_id`` in the input ids, or the examples' spans."""
    if segment_token_id is not None:
        return [token_runs(batch.input_ids[r].tolist(), segment_token_id) for r in range(batch.size)]
    return batch.spans(segment)


def steer(config: Vhr, ctx: StepContext, batch: Batch, plan: Any) -> Callable[[], dict[str, xr.DataArray]]:
    """Add VHR to ``plan`` for the rows of ``batch`` that have a segment; returns the report of its choice
    (:func:`state_arrays`), stored by the ``generate`` step as ``vhr_selected`` and ``vhr_vhd``."""
    n_layers = ctx.model.geometry.n_layers
    n_heads = ctx.model.geometry.n_heads
    if config.layers == "all":
        layers = list(range(n_layers))
    elif config.layers == "reference":
        layers = reference_layers(n_layers)
    else:
        layers = [int(x) for x in config.layers]
        bad = [x for x in layers if not 0 <= x < n_layers]
        if bad:
            raise ValueError(f"vhr: layers {bad} are outside this model ({n_layers} layers)")
    segments = segments_of(batch, config.segment, config.segment_token_id)
    rows = [r for r, s in enumerate(segments) if s]
    if not rows:
        raise ValueError(f"vhr: no row of the batch has a '{config.segment}' segment"
                         + ("" if config.segment_token_id is None else f" (token id {config.segment_token_id})"))
    state = add_vhr(plan, segments, layers, config.alpha, config.outlier_filter, owner=config)
    return lambda: state_arrays(state, batch.size, n_layers, n_heads)


def state_arrays(state: VhrState, rows: int, n_layers: int, n_heads: int) -> dict[str, xr.DataArray]:
    """What VHR chose for a batch, over ``(example, layer, head)``: ``vhr_selected`` (the reinforced heads) and
    ``vhr_vhd`` (each head's VHD at the first step; NaN on layers VHR did not consider)."""
    selected = np.zeros((rows, n_layers, n_heads), dtype=bool)
    vhd = np.full((rows, n_layers, n_heads), np.nan)
    for layer, sel in state.selected.items():
        selected[:, layer] = sel.cpu().numpy()
        vhd[:, layer] = state.vhd[layer].cpu().numpy()
    return {"vhr_selected": head_array(selected, "example"), "vhr_vhd": head_array(vhd, "example")}


@hookimpl
def headlab_register_steering(register):
    register(Vhr, steer)
