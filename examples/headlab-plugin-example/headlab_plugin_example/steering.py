"""``head_temperature``: a steering method written against headlab's public API only.

A head's attention temperature: its pre-softmax scores are divided by ``temperature`` (sharper attention
below 1, flatter above), i.e. its query is multiplied by ``1 / temperature``. The edit goes into the step's
:class:`headlab.Plan` with the method as owner, so headlab's conflict check names it if another
method of the same step scales the same heads' queries.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from headlab.plugin import Batch, ComponentConfig, HeadSelection, Plan, StepContext


class HeadTemperature(ComponentConfig):
    """Divide the attention scores of the chosen heads by a temperature."""

    kind: Literal["head_temperature"] = "head_temperature"
    heads: HeadSelection = Field(description="heads to heat or cool: {from: step, top: k}, [[layer, head], ...], ...")
    temperature: float = Field(gt=0, description="score divisor: < 1 sharpens the head's attention, > 1 flattens it")


def steer(config: HeadTemperature, ctx: StepContext, batch: Batch, plan: Plan) -> None:
    """Scale the queries of the selected heads by ``1 / temperature`` on every row of the batch."""
    heads = ctx.heads(config.heads)
    if heads:
        plan.scale_queries(heads, 1.0 / config.temperature, owner=config)
