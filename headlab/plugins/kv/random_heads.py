"""The ``random`` KV policy: the control of ``streaming``, with as many full KV heads drawn at random.

The number of full KV heads is the count ``like`` selects (resolved exactly as ``streaming`` resolves its
``full_heads``), ``n_full``, or as many as ``budget`` fits (the count ``streaming`` keeps under the same budget,
sink and window); they are drawn without replacement with a generator seeded by the run seed (plus ``seed``, so
that several controls of one cell differ). The other KV heads keep ``sink`` + ``window`` tokens, as under
``streaming``: the same budget on other heads, and ``prefill`` and ``question_tokens`` (kvpress's
context/question split, with ``prefill: full``) as under ``streaming``.
"""

from __future__ import annotations

from typing import ClassVar, Literal

import numpy as np
import xarray as xr
from pydantic import Field, model_validator

from headlab.kv import (
    GqaRule,
    HeadMap,
    KvBudget,
    KvHeadSelection,
    ScoresFrom,
    kv_heads,
    random_kv_heads,
    token_bytes,
)
from headlab.plugin import ComponentConfig, NonNegativeInt, PositiveInt, Seed, StepContext, hookimpl

from .common import (
    BUDGET_FIELD,
    GQA_FIELD,
    MEASURE_PEAK_FIELD,
    PREFILL_CHUNK_FIELD,
    PREFILL_FIELD,
    QUESTION_TOKENS_FIELD,
    SINK_FIELD,
    WINDOW_FIELD,
    check_prefill,
    model_dtype,
)


class RandomKV(ComponentConfig):
    """The control: as many full KV heads as `like` selects (or n_full, or a budget fits), drawn at random."""

    kind: Literal["random"] = "random"
    control: ClassVar[bool] = True
    measure_peak: bool = MEASURE_PEAK_FIELD
    like: KvHeadSelection | None = Field(None, description="the selection whose number of full KV heads is matched")
    n_full: NonNegativeInt | None = Field(None, description="the number of full KV heads (instead of `like`)")
    budget: KvBudget | None = BUDGET_FIELD
    match_layers: bool = Field(False, description="as many full KV heads per layer as `like` has")
    exclude: bool = Field(False, description="never draw one of `like`'s full KV heads")
    seed: Seed = Field(0, description="offset added to the run seed, so that several controls in one cell differ")
    sink: NonNegativeInt = SINK_FIELD
    window: PositiveInt = WINDOW_FIELD
    gqa: GqaRule = GQA_FIELD
    prefill_chunk: PositiveInt | None = PREFILL_CHUNK_FIELD
    prefill: Literal["bounded", "full"] = PREFILL_FIELD
    question_tokens: NonNegativeInt = QUESTION_TOKENS_FIELD

    @model_validator(mode="after")
    def _one_count(self) -> RandomKV:
        if sum(x is not None for x in (self.like, self.n_full, self.budget)) != 1:
            raise ValueError("give exactly one of `like` (a head selection to match), `n_full` and `budget`")
        if self.like is None and (self.match_layers or self.exclude):
            raise ValueError("`match_layers` and `exclude` refer to `like`: give `like`")
        if isinstance(self.like, ScoresFrom):
            raise ValueError("like {from: step} without `top` or `threshold` selects no count of heads: give `top` "
                             "or `threshold`, or a `budget` instead of `like`")
        check_prefill(self)
        return self


def compile_random(config: RandomKV, ctx: StepContext) -> HeadMap:
    """The head map of the random draw (under a budget: a random order of every KV head, of which as many as
    fit are full, pending until the context length is known when the budget has none)."""
    geometry = ctx.model.geometry
    rng = np.random.default_rng([ctx.seed, config.seed])
    attrs = {"policy": "random", "gqa": config.gqa, "seed": config.seed}
    if config.budget is not None:
        order = rng.permutation(geometry.n_layers * geometry.n_kv_heads).reshape(geometry.n_layers,
                                                                                   geometry.n_kv_heads)
        priority = xr.DataArray(-order.astype(float), dims=("layer", "kv_head"), name="kv_priority")
        size = token_bytes(geometry, model_dtype(ctx))
        return HeadMap.budgeted(priority, config.budget, sink=config.sink, window=config.window, token_bytes=size,
                                attrs=attrs, prefill=config.prefill)
    if config.like is None:
        full = random_kv_heads(config.n_full, geometry, rng)
    else:
        chosen = kv_heads(config.like, ctx.results, geometry, gqa=config.gqa, rng=rng)
        per_layer = chosen.sum("kv_head").values.tolist() if config.match_layers else None
        full = random_kv_heads(int(chosen.sum()), geometry, rng, per_layer=per_layer,
                               exclude=chosen if config.exclude else None)
    return HeadMap(full, sink=config.sink, window=config.window, attrs=attrs, prefill=config.prefill)


@hookimpl
def headlab_register_kv_policies(register):
    register(RandomKV, compile_random)
