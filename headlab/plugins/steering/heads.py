"""``head_mask`` and ``head_scale``: switch heads off or turn them up or down.

Definition: docs/methods.md#head-masking-and-scaling.

``head_mask`` modes:

- ``query`` (default; DeCoRe and Retrieval_Head "flash" mode): the query is zeroed, so the head attends
  uniformly over its causal prefix and outputs the mean of the visible values;
- ``score`` (their "torch" mode): the pre-softmax scores are set to 0 (the same uniform attention);
- ``output``: the head output ``z`` is zeroed before ``o_proj`` (ablation);
- ``mean``: the head output ``z`` is replaced, at every position, by the head's mean ``z`` read from an earlier
  step's ``z_mean (layer, head, head_dim)`` (``means_from``; a ``prune_curve`` with ``mode: mean`` records one):
  mean ablation, a :class:`headlab.ReplaceZ` with ``from_position=0``.

``head_scale`` targets:

- ``output``: ``z[l, h] *= factor``;
- ``values``: the value vectors of the key/value head that query head ``h`` reads are multiplied by
  ``factor``. Attention is linear in V, so this is ``z *= factor`` for every query head sharing that kv
  head: the same as ``output`` under multi-head attention, the whole GQA group under GQA/MQA;
- ``queries``: ``q[l, h] *= factor`` (a temperature on that head's scores: sharper above 1, flatter below).

Both act on every row of the batch and every position, prompt and generated tokens alike.
"""

from __future__ import annotations

from typing import Any, Literal

import numpy as np
import torch
from pydantic import Field, model_validator

from headlab import ReplaceZ
from headlab.plugin import (
    Batch,
    ComponentConfig,
    FiniteFloat,
    HeadSelection,
    NonEmptyStr,
    NonNegativeInt,
    StepContext,
    hookimpl,
)

from .common import resolve_heads


class HeadMask(ComponentConfig):
    """Mask heads: zero their query (uniform attention), their scores, or their output, or replace their output
    by its mean."""

    kind: Literal["head_mask"] = "head_mask"
    heads: HeadSelection | list[NonNegativeInt] = Field(
        description="heads to mask: {from: step, top: k} (random: true for the control), [[layer, head], ...], "
        "{\"<layer>\": [heads]}, a list of layers, or {file: heads.json}")
    mode: Literal["query", "score", "output", "mean"] = Field(
        "query", description="query: zero the query (mean of V); score: zero the scores; output: zero z; mean: z "
        "replaced by the head's mean z from `means_from`")
    means_from: NonEmptyStr | None = Field(
        None, description="mode mean: id of an earlier step whose result has z_mean (layer, head, head_dim), e.g. a "
        "prune_curve with mode: mean")

    @model_validator(mode="after")
    def _means(self) -> Any:
        if self.mode == "mean" and self.means_from is None:
            raise ValueError("mode mean replaces z by a mean: give means_from: <step id> (a step whose result has "
                             "z_mean, e.g. a prune_curve with mode: mean)")
        if self.mode != "mean" and self.means_from is not None:
            raise ValueError(f"means_from is read by mode mean only (mode is {self.mode}); drop it or set mode: mean")
        return self


class HeadScale(ComponentConfig):
    """Scale heads: multiply their output, their value vectors or their query by a factor."""

    kind: Literal["head_scale"] = "head_scale"
    heads: HeadSelection | list[NonNegativeInt] = Field(description="heads to scale (same forms as head_mask)")
    factor: FiniteFloat = Field(description="multiplier (finite)")
    target: Literal["output", "values", "queries"] = Field(
        "output", description="output: z *= factor; values: V of the head's kv head *= factor (its whole GQA "
        "group); queries: q *= factor")


def kv_group(heads: list[tuple[int, int]], n_heads: int, n_kv_heads: int) -> list[tuple[int, int]]:
    """Every query head that reads the same key/value head as one of ``heads`` (sorted, unique)."""
    group = n_heads // n_kv_heads
    out = {(layer, (h // group) * group + i) for layer, h in heads for i in range(group)}
    return sorted(out)


def steer_mask(config: HeadMask, ctx: StepContext, batch: Batch, plan: Any) -> None:
    """Add the mask to ``plan`` for every row."""
    heads = resolve_heads(ctx, config.heads)
    if not heads:
        return
    if config.mode == "mean":
        values = head_means(ctx, config.means_from, heads)[:, None, :]  # (heads, 1, head_dim)
        plan.add(ReplaceZ(heads, values, owner=config, from_position=0))
    else:
        plan.mask_heads(heads, mode=config.mode, owner=config)


def head_means(ctx: StepContext, step: str, heads: list[tuple[int, int]]) -> torch.Tensor:
    """The mean ``z`` (heads, head_dim) of ``heads`` from step ``step``'s ``z_mean (layer, head, head_dim)``."""
    geo = ctx.model.geometry
    if step not in ctx.results or "z_mean" not in ctx.results[step]:
        raise ValueError(f"head_mask: means_from: step '{step}' has no z_mean in this cell (a prune_curve with mode: "
                         "mean records one); name such a step")
    means = ctx.results[step]["z_mean"].transpose("layer", "head", "head_dim")
    want = (geo.n_layers, geo.n_heads, geo.head_dim)
    if tuple(means.shape) != want:
        raise ValueError(f"head_mask: means_from: step '{step}' has z_mean of shape {tuple(means.shape)}, this model's "
                         f"(layer, head, head_dim) is {want}; take the means on this model")
    values = np.asarray(means.values, dtype=np.float64)[[h[0] for h in heads], [h[1] for h in heads]]
    if not np.isfinite(values).all():
        raise ValueError(f"head_mask: means_from: step '{step}' has a z_mean that is not finite")
    return torch.as_tensor(values)


def steer_scale(config: HeadScale, ctx: StepContext, batch: Batch, plan: Any) -> None:
    """Add the scale to ``plan`` for every row."""
    heads = resolve_heads(ctx, config.heads)
    if config.target == "values":
        geo = ctx.model.geometry
        heads = kv_group(heads, geo.n_heads, geo.n_kv_heads)
    if not heads:
        return
    if config.target == "queries":
        plan.scale_queries(heads, config.factor, owner=config)
    else:
        plan.scale_heads(heads, config.factor, owner=config)


@hookimpl
def headlab_register_steering(register):
    register(HeadMask, steer_mask)
    register(HeadScale, steer_scale)
