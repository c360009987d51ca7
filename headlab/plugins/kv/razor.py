"""The ``razor`` KV policy: streaming heads plus RazorAttention's compensation token.

Hanlin Tang et al. (2024), "RazorAttention: Efficient KV Cache Compression Through Retrieval Heads",
arXiv:2407.15891. The KV heads of ``full_heads`` (RazorAttention takes its retrieval heads from echo and
induction scores; here any head selection, as for ``streaming``) keep their whole cache; every other KV
head keeps its row's ``sink`` first tokens, the ``window`` most recent ones, and one compensation token: the
mean of the keys and of the values it dropped (own positions ``sink <= k <= q - window`` for the query at
``q``), attended like any other key once a token was dropped.

With ``prefill_chunk`` a longer prompt is fed in forwards of at most that many tokens: each chunk's queries
take their compensation tokens from the cache's running sums and ring plus the chunk's own prefix, so the
logits and the cache are those of one forward (up to float rounding).
"""

from typing import Literal

import numpy as np
from pydantic import Field

from headlab.kv import GqaRule, HeadMap, KvHeadSelection, kv_heads
from headlab.plugin import ComponentConfig, NonNegativeInt, PositiveInt, StepContext, hookimpl

from .common import GQA_FIELD, MEASURE_PEAK_FIELD, PREFILL_CHUNK_FIELD, SINK_FIELD, WINDOW_FIELD


class RazorKV(ComponentConfig):
    """Streaming heads with a compensation token: full_heads keep every token, the other KV heads sink + window
    tokens plus the mean of the keys and values they dropped."""

    kind: Literal["razor"] = "razor"
    measure_peak: bool = MEASURE_PEAK_FIELD
    full_heads: KvHeadSelection | None = Field(
        None, description="KV heads that keep their whole cache (as for streaming); none: every head is compressed")
    sink: NonNegativeInt = SINK_FIELD
    window: PositiveInt = WINDOW_FIELD
    gqa: GqaRule = GQA_FIELD
    prefill_chunk: PositiveInt | None = PREFILL_CHUNK_FIELD


def compile_razor(config: RazorKV, ctx: StepContext) -> HeadMap:
    """The head map of ``full_heads``, compressed heads with a compensation token."""
    full = kv_heads(config.full_heads, ctx.results, ctx.model.geometry, gqa=config.gqa,
                    rng=np.random.default_rng(ctx.seed))
    return HeadMap(full, sink=config.sink, window=config.window, compensate=True,
                   attrs={"policy": "razor", "gqa": config.gqa})


@hookimpl
def headlab_register_kv_policies(register):
    register(RazorKV, compile_razor)
