"""A complete plugin module, a detector: docs/plugins.md, "One complete example per kind", shows it, and
tests/test_docs_plugins.py registers it and checks what it computes."""

# --8<-- [start:example]
from typing import Literal

import numpy as np
import xarray as xr

from headlab.plugin import ComponentConfig, Probes, StepContext, forward, head_array, hookimpl, tokenize


class SelfMass(ComponentConfig):
    """Mean attention each head puts on the query's own token."""

    kind: Literal["self_mass"] = "self_mass"


def detect(config: SelfMass, ctx: StepContext) -> xr.Dataset:
    geo = ctx.model.geometry
    scores = np.zeros((len(ctx.examples), geo.n_layers, geo.n_heads))
    for i, example in enumerate(ctx.progress(ctx.examples, "self mass")):
        batch = tokenize(ctx.model, [example])
        _, rec = forward(ctx.model, batch, Probes(offsets=[0]))   # probes alone: a plan without edits
        mass = rec.to_xarray("offset_mass").sel(example=0, offset=0)   # (layer, head, query)
        scores[i] = mass.mean("query").values
    per_example = head_array(scores, "example")
    return xr.Dataset({"score": per_example.mean("example"), "example_score": per_example})


@hookimpl
def headlab_register_detectors(register):
    register(SelfMass, detect)
# --8<-- [end:example]
