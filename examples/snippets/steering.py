"""A complete plugin module, a steering method: docs/plugins.md, "One complete example per kind", shows it, and
tests/test_docs_plugins.py registers it and checks what it computes."""

# --8<-- [start:example]
from typing import Literal

from pydantic import Field

from headlab.plugin import Batch, ComponentConfig, HeadSelection, Plan, StepContext, hookimpl


class HeadTemperature(ComponentConfig):
    """Divide the attention scores of the chosen heads by a temperature."""

    kind: Literal["head_temperature"] = "head_temperature"
    heads: HeadSelection = Field(description="{from: step, top: k}, [[layer, head], ...], ...")
    temperature: float = Field(gt=0, description="< 1 sharpens, > 1 flattens")


def steer(config: HeadTemperature, ctx: StepContext, batch: Batch, plan: Plan) -> None:
    heads = ctx.heads(config.heads)
    if heads:
        plan.scale_queries(heads, 1.0 / config.temperature, owner=config)


@hookimpl
def headlab_register_steering(register):
    register(HeadTemperature, steer)
# --8<-- [end:example]
