"""The ``streaming`` KV policy: DuoAttention's retrieval and streaming heads.

Guangxuan Xiao et al. (2024), "DuoAttention: Efficient Long-Context LLM Inference with Retrieval and Streaming
Heads", arXiv:2410.10819. The KV heads of ``full_heads`` keep their whole cache; every other KV head keeps its
row's ``sink`` first tokens and ``window`` most recent tokens. ``full_heads`` is any head selection (from a
detect step, pairs, layers, a JSON file; query heads mapped to KV heads by ``gqa``, ``top`` counting KV heads)
or DuoAttention's own ``full_attention_heads.tsv``; without it no head is full (StreamingLLM's cache).

With a ``budget`` the number of full KV heads is the largest whose cache fits it at the context length, taken
in the order of ``full_heads``'s scores (``{from: step}`` ranks every head; a ``top`` or ``threshold`` bounds
the candidates).

``prefill`` (``bounded`` by default) says what a compressed KV head attends in a row's prefill: ``bounded``, its
sinks and window, as in decode (the mask of the issue's definition); ``full``, every prompt token, as kvpress's
``DuoAttentionPress`` and DuoAttention's deployment do, the cache keeping only sinks + window afterwards (the same
bytes; the prefill holds one layer's full keys and values at a time). ``full`` cannot be combined with
``prefill_chunk``.

``question_tokens`` (0 by default; only with ``prefill: full``, in ``generate`` steps) is kvpress's
context/question split: each prompt's last ``question_tokens`` tokens are fed after the prefill's compression,
in a second forward whose compressed KV heads attend only the sinks and window they kept (and the question's
own earlier tokens), as decode steps do; the rest of the prompt is prefilled with every head in full. Use it to
compare with kvpress's pipeline, which prefills its context in full and runs its question against the
compressed cache.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
from pydantic import Field, model_validator

from headlab.kv import (
    GqaRule,
    HeadMap,
    KvBudget,
    KvHeadSelection,
    ScoresFrom,
    kv_heads,
    kv_priority,
    token_bytes,
)
from headlab.plugin import ComponentConfig, NonNegativeInt, PositiveInt, StepContext, hookimpl

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


class StreamingKV(ComponentConfig):
    """DuoAttention's layout: full_heads keep every token, the other KV heads sink + window tokens."""

    kind: Literal["streaming"] = "streaming"
    measure_peak: bool = MEASURE_PEAK_FIELD
    full_heads: KvHeadSelection | None = Field(
        None, description="KV heads that keep their whole cache: {from: step, top: k} (k KV heads), a threshold, "
                          "[[layer, head], ...], {layer: [heads]}, {file: heads.json} or {file: "
                          "full_attention_heads.tsv}; with a budget, {from: step} ranks every head; none: every "
                          "head is compressed")
    sink: NonNegativeInt = SINK_FIELD
    window: PositiveInt = WINDOW_FIELD
    gqa: GqaRule = GQA_FIELD
    budget: KvBudget | None = BUDGET_FIELD
    prefill_chunk: PositiveInt | None = PREFILL_CHUNK_FIELD
    prefill: Literal["bounded", "full"] = PREFILL_FIELD
    question_tokens: NonNegativeInt = QUESTION_TOKENS_FIELD

    @model_validator(mode="after")
    def _ranked(self) -> StreamingKV:
        if self.budget is None and isinstance(self.full_heads, ScoresFrom):
            raise ValueError("full_heads {from: step} without `top` or `threshold` ranks heads for a `budget`: give "
                             "`top`, `threshold` or a `budget`")
        if self.budget is not None and self.full_heads is None:
            raise ValueError("a `budget` ranks KV heads by `full_heads`: give one ({from: step} ranks every head)")
        check_prefill(self)
        return self


def compile_streaming(config: StreamingKV, ctx: StepContext) -> HeadMap:
    """The head map of ``full_heads`` with the bounded cache of the other KV heads (under a budget: as many
    of its KV heads as fit, pending until the context length is known when the budget has none)."""
    geometry = ctx.model.geometry
    attrs = {"policy": "streaming", "gqa": config.gqa}
    if config.budget is not None:
        priority = kv_priority(config.full_heads, ctx.results, geometry, gqa=config.gqa,
                               rng=np.random.default_rng(ctx.seed))
        size = token_bytes(geometry, model_dtype(ctx))
        return HeadMap.budgeted(priority, config.budget, sink=config.sink, window=config.window, token_bytes=size,
                                attrs=attrs, prefill=config.prefill)
    full = kv_heads(config.full_heads, ctx.results, geometry, gqa=config.gqa, rng=np.random.default_rng(ctx.seed))
    return HeadMap(full, sink=config.sink, window=config.window, attrs=attrs, prefill=config.prefill)


@hookimpl
def headlab_register_kv_policies(register):
    register(StreamingKV, compile_streaming)
