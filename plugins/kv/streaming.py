"""The ``streaming`` KV policy: DuoAttention's retrieval and streaming heads.

Guangxuan Xiao et al. (2024), "DuoAttention: Efficient Long-Context LLM Inference with Retrieval and Streaming
Heads", arXiv:2410.10819. The KV heads of ``full_heads`` keep their whole cache; every other KV head keeps its
row's ``sink`` first tokens and ``window`` most recent tokens. ``full_heads`` is any head selection (from a
detect step, pairs, layers, a JSON file; query heads mapped to KV heads by ``gqa``, ``top`` counting KV heads)
or DuoAttention's own ``full_attention_heads.tsv``; without it no head is full (StreamingLLM's cache).
"""

from typing import Literal

import numpy as np
from pydantic import Field

from headlab import ComponentConfig, StepContext, hookimpl
from headlab.kv import GqaRule, HeadMap, KvHeadSelection, kv_heads
from headlab.spec import NonNegativeInt, PositiveInt

from .common import GQA_FIELD, SINK_FIELD, WINDOW_FIELD


class StreamingKV(ComponentConfig):
    """DuoAttention's layout: full_heads keep every token, the other KV heads sink + window tokens."""

    kind: Literal["streaming"] = "streaming"
    full_heads: KvHeadSelection | None = Field(
        None, description="KV heads that keep their whole cache: {from: step, top: k} (k KV heads), a threshold, "
                          "[[layer, head], ...], {layer: [heads]}, {file: heads.json} or {file: "
                          "full_attention_heads.tsv}; none: every head is compressed")
    sink: NonNegativeInt = SINK_FIELD
    window: PositiveInt = WINDOW_FIELD
    gqa: GqaRule = GQA_FIELD


def compile_streaming(config: StreamingKV, ctx: StepContext) -> HeadMap:
    """The head map of ``full_heads`` with the bounded cache of the other KV heads."""
    full = kv_heads(config.full_heads, ctx.results, ctx.model.geometry, gqa=config.gqa,
                    rng=np.random.default_rng(ctx.seed))
    return HeadMap(full, sink=config.sink, window=config.window, attrs={"policy": "streaming", "gqa": config.gqa})


@hookimpl
def headlab_register_kv_policies(register):
    register(StreamingKV, compile_streaming)
