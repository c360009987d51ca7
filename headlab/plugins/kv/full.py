"""The ``full`` KV policy: every KV head keeps every token (today's cache)."""

from typing import Literal

from headlab.kv import HeadMap
from headlab.plugin import ComponentConfig, PositiveInt, StepContext, hookimpl

from .common import MEASURE_PEAK_FIELD, PREFILL_CHUNK_FIELD


class FullKV(ComponentConfig):
    """Every KV head keeps its whole cache (the default)."""

    kind: Literal["full"] = "full"
    measure_peak: bool = MEASURE_PEAK_FIELD
    prefill_chunk: PositiveInt | None = PREFILL_CHUNK_FIELD


def compile_full(config: FullKV, ctx: StepContext) -> HeadMap:
    """The head map with every KV head full."""
    return HeadMap.full(ctx.model.geometry)


@hookimpl
def headlab_register_kv_policies(register):
    register(FullKV, compile_full, default=True)
