"""Ships: each head's effect on the next-token distribution (Zhou et al., ICLR 2025, "On the Role of Attention
Heads in Large Language Model Safety"; reference ydyjya/SafetyHeadAttribution).

Definition: docs/methods.md#ships. For a prompt and a head ``(l, h)``, ``p`` is the model's next-token
distribution at the last prompt token and ``q`` the same with that head ablated at every position; the head's
value is ``KL(p || q) = sum_v p_v log((p_v + 1e-12) / (q_v + 1e-12))`` (the reference's 1e-12), and
``score (layer, head)`` is its mean over the task's prompts.

The ablation (``mode``, docs/methods.md#head-masking-and-scaling): ``query`` (default, the reference's) multiplies
the head's query by ``epsilon`` (default 1e-4; at 0 its attention is uniform over the causal prefix), ``score``
sets its pre-softmax scores to 0, ``output`` zeroes its output ``z``. Under grouped-query attention the query head
alone is ablated (its key/value head is shared).

One prompt at a time: its unablated run records the residual stream entering every decoder layer; then the
heads of each layer are rows of batched forwards (row ``r`` ablates one head, :meth:`headlab.Plan.scale_queries`
/ :meth:`headlab.Plan.mask_heads` with ``rows=[r]``; ``batch_size`` rows per forward) that start at that layer
from the recorded residual stream (:func:`headlab.start_at_layer`: an ablation at layer ``l`` changes nothing
below it), so a prompt costs one forward plus ``L * ceil(H / batch_size)`` forwards of the upper layers only,
where the reference runs ``1 + L * H`` whole forwards at batch 1. Only the last position's logits are computed.

Outputs: ``score (layer, head)``; with ``per_prompt: true`` also ``kl (example, layer, head)``.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import torch
import xarray as xr
from pydantic import Field

from headlab import start_at_layer
from headlab.plugin import (
    ComponentConfig,
    LoadedModel,
    NonNegativeFloat,
    Plan,
    PositiveInt,
    StepContext,
    forward,
    hookimpl,
    tokenize,
)
from headlab.resources import Estimate, EstimateContext

__all__ = ["Ships", "ablate", "detect", "kl", "prompt_kl"]

Mode = Literal["query", "score", "output"]


class Ships(ComponentConfig):
    """Ships (Zhou et al. 2025): KL of the last-token distribution when one head is ablated, per head."""

    kind: Literal["ships"] = "ships"
    mode: Mode = Field("query", description="query: the head's query times epsilon (reference); score: its scores "
                       "zeroed; output: its output zeroed")
    epsilon: NonNegativeFloat = Field(1e-4, description="mode query: the factor on the head's query")
    batch_size: PositiveInt = Field(32, description="rows (one ablated head each) per forward")
    per_prompt: bool = Field(False, description="also keep kl (example, layer, head)")

    def estimate(self, ctx: EstimateContext) -> list[Estimate]:
        """Hidden states of a forward of ``batch_size`` copies of the longest prompt (resource guard)."""
        return [ctx.activations(ctx.task.tokens, ctx.rows(self.batch_size))]


def kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> torch.Tensor:
    """``KL(p || q)`` per row in float64 from logits (rows, vocab), with the reference's 1e-12 in both logs."""
    p = torch.softmax(p_logits.double(), dim=-1)
    q = torch.softmax(q_logits.double(), dim=-1)
    return (p * (torch.log(p + 1e-12) - torch.log(q + 1e-12))).sum(-1)


def ablate(plan: Plan, head: tuple[int, int], row: int, mode: str, epsilon: float) -> Plan:
    """Add to ``plan`` the edit ablating ``head`` on batch row ``row``: its query times ``epsilon`` (``query``),
    its scores zeroed (``score``) or its output zeroed (``output``)."""
    if mode == "query":
        return plan.scale_queries([head], epsilon, [row])
    return plan.mask_heads([head], [row], mode=mode)


def _layer_inputs(lm, batch) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``(last-position logits (1, vocab), the residual stream entering each decoder layer)`` of the unablated
    run of a one-prompt ``batch``."""
    inputs: list[torch.Tensor] = []

    def keep(module, args, kwargs):
        inputs.append((args[0] if args else kwargs["hidden_states"]).detach())

    handles = [layer.register_forward_pre_hook(keep, with_kwargs=True) for layer in lm.decoder_layers]
    try:
        out, _ = forward(lm, batch, None, logits_to_keep=1)
    finally:
        for h in handles:
            h.remove()
    return out.logits[:, -1], inputs


def prompt_kl(lm, batch, heads: list[tuple[int, int]], mode: str = "query", epsilon: float = 1e-4,
              batch_size: int = 32) -> np.ndarray:
    """``KL(p || q_h)`` (float64, one per head of ``heads``) for a one-prompt ``batch``: the unablated run, then
    the heads of each layer as rows of forwards (``batch_size`` rows each) that start at that layer from the
    unablated run's residual stream (:func:`headlab.start_at_layer`; the layers below are not changed by the
    ablation)."""
    model = lm.model if isinstance(lm, LoadedModel) else lm
    base, resid = _layer_inputs(lm, batch)
    out = np.zeros(len(heads))
    by_layer: dict[int, list[int]] = {}
    for i, (layer, _) in enumerate(heads):
        by_layer.setdefault(layer, []).append(i)
    for layer, index in sorted(by_layer.items()):
        for start in range(0, len(index), batch_size):
            chunk = index[start:start + batch_size]
            plan = Plan()
            for r, i in enumerate(chunk):
                ablate(plan, heads[i], r, mode, epsilon)
            with start_at_layer(model, layer, resid[layer].expand(len(chunk), -1, -1)):
                res, _ = forward(lm, batch, plan, copies=len(chunk), logits_to_keep=1)
            out[chunk] = kl(base.expand(len(chunk), -1), res.logits[:, -1]).cpu().numpy()
    return out


def detect(config: Ships, ctx: StepContext) -> xr.Dataset:
    """The ``ships`` detector over the task's prompts."""
    geo = ctx.model.geometry
    L, H = geo.n_layers, geo.n_heads
    if not ctx.examples:
        raise ValueError("ships: the task has no examples")
    heads = [(layer, h) for layer in range(L) for h in range(H)]
    values = np.zeros((len(ctx.examples), L, H))
    for e in ctx.progress(range(len(ctx.examples)), "ships"):
        batch = tokenize(ctx.model, [ctx.examples[e]])
        values[e] = prompt_kl(ctx.model, batch, heads, config.mode, config.epsilon, config.batch_size).reshape(L, H)
    data = {"score": (("layer", "head"), values.mean(0))}
    if config.per_prompt:
        data["kl"] = (("example", "layer", "head"), values)
    ds = xr.Dataset(data, coords={"layer": np.arange(L), "head": np.arange(H)})
    ds.attrs.update(method="ships", model=ctx.model.name, mode=config.mode, epsilon=config.epsilon,
                    position="last", reference="docs/methods.md#ships")
    return ds


@hookimpl
def headlab_register_detectors(register):
    register(Ships, detect)
