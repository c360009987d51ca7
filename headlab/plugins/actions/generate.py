"""The ``generate`` action: steer, decode in batches, score the outputs with metrics.

Stored: ``output`` (the text, over ``example``), ``output_ids`` (the generated token ids over ``example,
step``, -1 after a row's last token; special tokens kept, EOS not included), one variable per metric, the
decoder's diagnostics (:func:`headlab.generation.decode_info`) and the steering methods' reports; with a ``kv``
policy, what its caches held (:func:`.common.kv_results`)."""

from typing import Annotated, Any

import numpy as np
import xarray as xr
from pydantic import BeforeValidator, Field

from headlab import attention_preview, component
from headlab.generation import decode_info
from headlab.kv import KvPolicyError
from headlab.plugin import (
    ContractError,
    Decoded,
    DecodeRequest,
    NonEmptyStr,
    PositiveInt,
    StepContext,
    StrictModel,
    hookimpl,
    tokenize,
)
from headlab.resources import Estimate, EstimateContext
from headlab.scoring import metric_values
from headlab.spec import SpecTypes

from .common import compile_kv, decoding_config, kind_shorthand, kv_results, kv_running, steering_plan


def generate_config(types: SpecTypes) -> type[StrictModel]:
    """The config of a generate step: decoder, steering, metrics, ``max_new_tokens`` and stop strings."""
    Metric = Annotated[types.union("metrics"), BeforeValidator(kind_shorthand)]

    class Generate(decoding_config(types)):
        """Generate continuations for every example, optionally steered and with a decoding strategy."""

        QUESTION_SPLIT = True

        metrics: list[Metric] = Field(default_factory=list)
        max_new_tokens: PositiveInt = Field(16)
        stop: list[NonEmptyStr] = Field(default_factory=list, description="stop strings (non-empty)")

        def estimate(self, ctx: EstimateContext) -> list[Estimate]:
            """The KV cache of a batch decoding ``max_new_tokens`` after the longest prompt (resource guard)."""
            return [ctx.kv_cache(ctx.task.tokens + self.max_new_tokens, ctx.rows(self.batch_size))]

    return Generate


def generate(action: Any, ctx: StepContext) -> xr.Dataset:
    """The ``generate`` action: steer, decode in batches, score with metrics."""
    decoder = component("decoders", action.decode.kind)
    outputs: list[str] = []
    tokens: list[list[int]] = []
    infos: list[tuple[dict[str, Any], list[int]]] = []
    steered: dict[str, list[xr.DataArray]] = {}
    batches = [ctx.examples[i: i + action.batch_size] for i in range(0, len(ctx.examples), action.batch_size)]
    tokenized = [tokenize(ctx.model, chunk) for chunk in batches] if action.kv is not None else None
    longest = max((b.length for b in tokenized), default=0) if tokenized else 0
    kv = compile_kv(action.kv, ctx, longest + action.max_new_tokens)
    if kv is not None and kv.question_tokens and not kv.head_map.is_full:
        _check_question(tokenized, kv.question_tokens, action.batch_size)
    with kv_running(kv, ctx):
        for i, chunk in enumerate(ctx.progress(batches, "generating", total=len(batches))):
            batch = tokenized[i] if tokenized else tokenize(ctx.model, chunk)
            plan, reports = steering_plan(action.steer, ctx, batch)
            request = DecodeRequest(ctx.model, batch, action.max_new_tokens, list(action.stop), plan, ctx.seed, ctx)
            decoded = decoder.impl(action.decode, request)
            if not isinstance(decoded, Decoded) or len(decoded.texts) != len(chunk):
                raise ContractError(f"the decoder returned {type(decoded).__name__}, not Decoded with one text per "
                                    "prompt", category="decoders", kind=action.decode.kind)
            outputs.extend(decoded.texts)
            tokens.extend(decoded.tokens)
            infos.append((decoded.info, [len(t) for t in decoded.tokens]))
            for report in reports:
                for name, array in report().items():
                    steered.setdefault(name, []).append(array)
    arrays, attrs = decode_info(infos, ctx.model.geometry)
    steps = max([len(t) for t in tokens] + [a.sizes["step"] for a in arrays.values() if "step" in a.dims])
    ids = np.full((len(tokens), steps), -1, dtype=np.int64)
    for row, toks in zip(ids, tokens, strict=True):
        row[: len(toks)] = toks
    ds = xr.Dataset({"output": ("example", np.array(outputs, dtype=object)), "output_ids": (("example", "step"), ids)})
    ds = ds.assign(arrays)
    for name, parts in steered.items():
        if len(parts) == len(batches):
            ds[name] = xr.concat(parts, dim="example", join="outer")
    ds.attrs.update(attrs)
    names = []
    for cfg in action.metrics:
        for name, array in metric_values(cfg, ctx.examples, outputs).items():
            ds[name] = array
            names.append(name)
    ds.attrs.update(decode=action.decode.kind, steer=[c.kind for c in action.steer], metrics=names)
    ds = kv_results(ds, kv)
    if ctx.examples and ctx.examples[0].images:  # the first image with every head's attention, for the report
        ds = ds.merge(attention_preview(ctx.model, ctx.examples[0]))
    return ds


def _check_question(batches: list[Any], question_tokens: int, batch_size: int) -> None:
    """Refuse a prompt of at most ``question_tokens`` tokens: its context, before the question, would be empty."""
    for i, batch in enumerate(batches):
        for r, n in enumerate(batch.attention_mask.sum(-1).tolist()):
            if n <= question_tokens:
                raise KvPolicyError(f"kv question_tokens {question_tokens}: example {i * batch_size + r} has {n} "
                                    "prompt tokens, so no context before its question; give fewer question tokens "
                                    "or longer prompts")


@hookimpl
def headlab_register_actions(register):
    register("generate", generate_config, generate, description="generate outputs and metrics")
