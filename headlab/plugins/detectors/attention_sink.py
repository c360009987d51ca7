"""Attention sinks and massive activations.

Definition: docs/methods.md#attention-sinks-and-massive-activations. The sink score of head ``(l, h)`` on
a prompt is the mean over its queries ``i >= 1`` of ``A[l,h][i, 0]``, the attention on the prompt's first
token (the first non-padding position of a left-padded row); ``score (layer, head)`` is its mean over the
examples. A head whose score is above ``epsilon`` (default 0.3, Gu et al. 2024) is a sink head;
``attrs["sink_rate"]`` is the fraction of heads that are.

The attention on the first token comes from one span-mass probe per row (``Probes(spans=...)``, a
streaming reduction inside the attention kernel): the full pattern is never formed.

Massive activations (Sun et al. 2024): per layer, the output hidden state of the decoder layer (the
residual stream after it) at every real position of a prompt; ``massive_ratio (layer)`` is the largest
``|h|`` entry over the median ``|h|`` entry, the maximum over the examples, and ``massive_count (layer)``
the mean over examples of the number of entries above ``massive_threshold`` (default 100) times that
example's median.

Outputs: ``score (layer, head)``, ``example_score (example, layer, head)``, ``massive_ratio (layer)``,
``massive_count (layer)``.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import torch
import xarray as xr
from pydantic import Field

from headlab.plugin import (
    ComponentConfig,
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

__all__ = ["AttentionSink", "attention_sink", "detect"]


class AttentionSink(ComponentConfig):
    """Heads that park their attention on the first token (sink heads), and massive activations per layer."""

    kind: Literal["attention_sink"] = "attention_sink"
    epsilon: float = Field(0.3, gt=0, lt=1, description="a head with a sink score above this is a sink head")
    massive_threshold: float = Field(100.0, gt=1, description="an entry this many times the median |h| is massive")
    batch_size: PositiveInt = 8

    def estimate(self, ctx: EstimateContext) -> list[Estimate]:
        """Hidden states of a batch's forward over the longest prompt (resource guard)."""
        return [ctx.activations(ctx.task.tokens, ctx.rows(self.batch_size))]


def _median(values: torch.Tensor) -> torch.Tensor:
    """The median of a 1-D tensor (the mean of the two middle values for an even count)."""
    ordered = values.sort().values
    n = ordered.numel()
    return ordered[n // 2] if n % 2 else (ordered[n // 2 - 1] + ordered[n // 2]) / 2


def attention_sink(lm, batch, threshold: float = 100.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For one left-padded batch: the sink scores (batch, layer, head), and per row and layer the largest
    ``|h|`` over the median ``|h|`` and the number of entries above ``threshold`` times the median
    (both (batch, layer)), float64."""
    pads = [int(p) for p in batch.pad]
    n = batch.length
    if any(n - p < 2 for p in pads):
        row = next(r for r, p in enumerate(pads) if n - p < 2)
        raise ValueError(f"attention_sink: row {row} has a single token: no query after the first token")
    layers = lm.decoder_layers
    stats: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def record(layer: int):
        def hook(module, args, output):
            h = (output[0] if isinstance(output, tuple) else output).detach().abs().double()
            ratios, counts = [], []
            for r, p in enumerate(pads):
                entries = h[r, p:].flatten()
                median = _median(entries)
                ratios.append(entries.max() / median)
                counts.append((entries > threshold * median).sum().double())
            stats[layer] = (torch.stack(ratios), torch.stack(counts))
        return hook

    handles = [m.register_forward_hook(record(i)) for i, m in enumerate(layers)]
    try:
        _, rec = forward(lm, batch, Plan(probes=Probes(spans=[[(p, p + 1)] for p in pads])), logits_to_keep=1)
    finally:
        for handle in handles:
            handle.remove()
    mass = rec.span_mass[..., 0].double()  # (B, L, H, query)
    queries = torch.arange(mass.shape[-1], device=mass.device)
    after = (queries[None, :] > torch.tensor(pads, device=mass.device)[:, None]).double()  # (B, query)
    score = (mass * after[:, None, None]).sum(-1) / after.sum(-1)[:, None, None]
    ratio = torch.stack([stats[i][0] for i in range(len(layers))], dim=1)
    count = torch.stack([stats[i][1] for i in range(len(layers))], dim=1)
    return score, ratio, count


def detect(config: AttentionSink, ctx: StepContext) -> xr.Dataset:
    """The ``attention_sink`` detector over the task's prompts."""
    geo = ctx.model.geometry
    n = len(ctx.examples)
    scores = np.zeros((n, geo.n_layers, geo.n_heads))
    ratio = np.zeros((n, geo.n_layers))
    count = np.zeros((n, geo.n_layers))
    chunks = [list(range(j, min(j + config.batch_size, n))) for j in range(0, n, config.batch_size)]
    for idx in ctx.progress(chunks, "attention sinks"):
        batch = tokenize(ctx.model, [ctx.examples[i] for i in idx])
        s, r, c = attention_sink(ctx.model, batch, config.massive_threshold)
        scores[idx], ratio[idx], count[idx] = s.cpu().numpy(), r.cpu().numpy(), c.cpu().numpy()
    per = head_array(scores, "example")
    score = per.mean("example")
    layer = np.arange(geo.n_layers)
    ds = xr.Dataset({
        "score": score,
        "example_score": per,
        "massive_ratio": xr.DataArray(ratio.max(axis=0), dims=("layer",), coords={"layer": layer}),
        "massive_count": xr.DataArray(count.mean(axis=0), dims=("layer",), coords={"layer": layer}),
    })
    ds.attrs.update(method="attention_sink", model=ctx.model.name, epsilon=config.epsilon,
                    sink_rate=float((score.values > config.epsilon).mean()),
                    massive_threshold=config.massive_threshold,
                    reference="docs/methods.md#attention-sinks-and-massive-activations")
    return ds


@hookimpl
def headlab_register_detectors(register):
    register(AttentionSink, detect)
