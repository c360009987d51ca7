"""The ``generate`` action: steer, decode in batches, score the outputs with metrics.

Its dataset holds ``output`` (the text, special tokens skipped, cut at the first stop string) and
``output_ids`` over ``(example, step)``: the generated token ids up to EOS (excluded), -1 after a row's last.
"""

from typing import Annotated, Any

import numpy as np
import xarray as xr
from pydantic import BeforeValidator, Field

from headlab import StepContext, hookimpl
from headlab.generation import DecodeRequest, tokenize
from headlab.plugin_manager import get_manager
from headlab.runner import decode_info
from headlab.spec import SpecTypes, StrictModel

from .common import decoding_config, kind_shorthand, steering_plan


def generate_config(types: SpecTypes) -> type[StrictModel]:
    """The config of a generate step: decoder, steering, metrics, ``max_new_tokens`` and stop strings."""
    Metric = Annotated[types.union("metrics"), BeforeValidator(kind_shorthand)]

    class Generate(decoding_config(types)):
        """Generate continuations for every example, optionally steered and with a decoding strategy."""

        metrics: list[Metric] = Field(default_factory=list)
        max_new_tokens: int = Field(16, ge=1)
        stop: list[str] = Field(default_factory=list, description="stop strings")

    return Generate


def generate(action: Any, ctx: StepContext) -> xr.Dataset:
    """The ``generate`` action: steer, decode in batches, score with metrics."""
    mgr = get_manager()
    decoder = mgr.get("decoders", action.decode.kind)
    outputs: list[str] = []
    tokens: list[list[int]] = []
    infos: list[tuple[dict[str, Any], list[int]]] = []
    steered: dict[str, list[xr.DataArray]] = {}
    batches = [ctx.examples[i: i + action.batch_size] for i in range(0, len(ctx.examples), action.batch_size)]
    for chunk in ctx.progress(batches, "generating", total=len(batches)):
        batch = tokenize(ctx.model, chunk)
        plan, reports = steering_plan(action.steer, ctx, batch)
        request = DecodeRequest(ctx.model, batch, action.max_new_tokens, list(action.stop), plan, ctx.seed, ctx)
        decoded = decoder.impl(action.decode, request)
        outputs.extend(decoded.texts)
        tokens.extend(decoded.tokens)
        infos.append((decoded.info, [len(t) for t in decoded.tokens]))
        for report in reports:
            for name, array in report().items():
                steered.setdefault(name, []).append(array)
    ds = xr.Dataset({"output": ("example", np.array(outputs, dtype=object))})
    arrays, attrs = decode_info(infos, ctx.model.geometry)
    ds = ds.assign(arrays)
    # the step that chose EOS is a step of the per-step diagnostics but not a token of output_ids
    width = max([len(t) for t in tokens] + [ds.sizes.get("step", 0)])
    ids = np.full((len(tokens), width), -1, dtype=np.int64)
    for i, t in enumerate(tokens):
        ids[i, : len(t)] = t
    ds["output_ids"] = (("example", "step"), ids)
    for name, parts in steered.items():
        if len(parts) == len(batches):
            ds[name] = xr.concat(parts, dim="example", join="outer")
    ds.attrs.update(attrs)
    names = []
    for cfg in action.metrics:
        comp = mgr.get("metrics", cfg.kind)
        values = np.asarray(comp.impl(cfg, ctx.examples, outputs), dtype=float)
        ds[cfg.kind] = ("example", values)
        names.append(cfg.kind)
    ds.attrs.update(decode=action.decode.kind, steer=[c.kind for c in action.steer], metrics=names)
    return ds


@hookimpl
def headlab_register_actions(register):
    register("generate", generate_config, generate, description="generate outputs and metrics")
