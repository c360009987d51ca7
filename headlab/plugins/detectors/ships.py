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

One prompt at a time, its unablated run and one row per head (row ``r`` ablates one head,
:meth:`headlab.Plan.scale_queries` / :meth:`headlab.Plan.mask_heads` with ``rows=[r]``) run as
rows of batched forwards of ``batch_size`` rows: ``ceil((L * H + 1) / batch_size)`` forwards per prompt, where the
reference runs ``1 + L * H`` forwards at batch 1. Only the last position's logits are computed.

Outputs: ``score (layer, head)``; with ``per_prompt: true`` also ``kl (example, layer, head)``.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import torch
import xarray as xr
from pydantic import Field

from headlab import ComponentConfig, Plan, StepContext, forward, hookimpl, tokenize
from headlab.resources import Estimate, EstimateContext
from headlab.spec import NonNegativeFloat, PositiveInt

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


def prompt_kl(lm, batch, heads: list[tuple[int, int]], mode: str = "query", epsilon: float = 1e-4,
              batch_size: int = 32) -> np.ndarray:
    """``KL(p || q_h)`` (float64, one per head of ``heads``) for a one-prompt ``batch``: the unablated run and
    one row per ablated head, ``batch_size`` rows per forward."""
    rows: list[tuple[int, int] | None] = [None, *heads]
    base = None
    out = []
    for start in range(0, len(rows), batch_size):
        chunk = rows[start:start + batch_size]
        plan = Plan()
        for r, h in enumerate(chunk):
            if h is not None:
                ablate(plan, h, r, mode, epsilon)
        res, _ = forward(lm, batch, plan, copies=len(chunk), logits_to_keep=1)
        logits = res.logits[:, -1]
        if base is None:
            base, logits = logits[:1], logits[1:]
        out.append(kl(base.expand_as(logits), logits).cpu())
    return torch.cat(out).numpy()


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
