"""The ``headkv`` KV policy: a total budget split across KV heads by a head score (HeadKV).

Yu Fu, Zefan Cai, Abedelkadir Asi, Wayne Xiong, Yue Dong, Wen Xiao (2024), "Not All Heads Matter: A
Head-Level KV Cache Compression Method with Integrated Retrieval and Reasoning", arXiv:2410.19258. The budget
gives every KV head ``B`` tokens on average (the observation window included); each KV head gives
``floor((B - window) / beta)`` of them to a pool shared in proportion to the normalised scores
(:func:`headlab.kv.headkv_allocation`), and keeps, after the prefill, its top keys by SnapKV's pooled
observation-window attention plus the window (:func:`headlab.kv.snapkv_keep`). Constants are those of the
authors' scripts: an observation window of 8 queries, max pooling of width 7, ``temp`` 1, ``beta`` 1.5 (their
default; they sweep 1.005 to 10). Under GQA the unit is the KV head: a KV head's score aggregates its query
heads' by ``gqa`` (``mean`` by default, so that its share of the pool is its query heads' total share).
A step runs it on :class:`headlab.kv.HeadBudgetLayer` caches: the prefill attends every head in full, then
each compressed KV head holds only its kept keys and the tokens generated since.

With ``prefill_chunk`` a longer prompt is fed in forwards of at most that many tokens: every chunk attends
every head over all earlier prompt keys, which the cache holds until the prompt's last chunk, and the
selection runs at the end of that chunk over the prompt's last ``observation_window`` queries (kept across
chunks), so the kept keys, the cache and the logits are those of one forward (up to float rounding). The
chunk bounds the activations (MLP buffers, attention blocks), not the prompt's keys.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from headlab.kv import (
    GqaRule,
    HeadBudgetMap,
    HeadScoreSource,
    KvBudget,
    ScoresFile,
    kv_head_scores,
    token_bytes,
)
from headlab.plugin import ComponentConfig, PositiveFloat, PositiveInt, StepContext, hookimpl

from .common import MEASURE_PEAK_FIELD, model_dtype


class HeadKV(ComponentConfig):
    """HeadKV: each KV head keeps its own number of tokens, split from a total budget by a head score."""

    kind: Literal["headkv"] = "headkv"
    measure_peak: bool = MEASURE_PEAK_FIELD
    scores: HeadScoreSource = Field(description="per-head importance: {from: step} (its `score`), {file: "
                                                "heads.json} (HeadKV's / the retrieval-head format; every head must "
                                                "have a score) or {file: full_attention_heads.tsv} (KV heads)")
    budget: KvBudget = Field(description="the total: {fraction: f} of the full cache, {bytes: n} or "
                                         "{tokens_per_head: t} (HeadKV's KV size, window included) per row; the "
                                         "mean tokens per KV head B = floor(K / N) include the observation window")
    beta: float = Field(1.5, ge=1, le=1e6, description="each KV head puts floor((B - W) / beta) tokens into the "
                                                       "shared pool (larger beta: a smaller pool)")
    temp: PositiveFloat = Field(1.0, description="exponent of the normalised scores before the split")
    observation_window: PositiveInt = Field(8, description="W: the last prompt queries whose attention scores the keys; "
                                                           "every KV head keeps their tokens")
    kernel_size: PositiveInt = Field(7, description="width of the pooling over neighbouring key positions (odd)")
    pooling: Literal["max", "avg"] = Field("max", description="pooling of the key scores")
    gqa: GqaRule = Field("mean", description="a KV head's score from its query heads' scores: mean (default), "
                                             "any (the highest) or all (the lowest); with mean a KV head's share of "
                                             "the pool is its query heads' total share")
    prefill_chunk: PositiveInt | None = Field(
        None, description="feed a longer prompt (or scored row) in forwards of at most this many tokens: bounds its "
                          "activations by the chunk; every KV head holds the prompt's keys until its last chunk, "
                          "where they are compressed as after one forward (default: one forward)")

    @model_validator(mode="after")
    def _checks(self) -> HeadKV:
        if self.kernel_size % 2 == 0:
            raise ValueError(f"kernel_size {self.kernel_size}: an odd width is needed (the pooling is centred)")
        if isinstance(self.scores, ScoresFile) and self.scores.threshold is not None:
            raise ValueError("scores: `threshold` cuts a head selection; headkv weighs every head")
        return self


def compile_headkv(config: HeadKV, ctx: StepContext) -> HeadBudgetMap:
    """HeadKV's per-KV-head budgets from the scores (pending for a fraction budget without a length)."""
    geometry = ctx.model.geometry
    scores = kv_head_scores(config.scores, ctx.results, geometry, gqa=config.gqa)
    size = token_bytes(geometry, model_dtype(ctx))
    return HeadBudgetMap.allocate(scores, config.budget, beta=config.beta, temp=config.temp,
                                  observation_window=config.observation_window, kernel_size=config.kernel_size,
                                  pooling=config.pooling, token_bytes=size,
                                  attrs={"policy": "headkv", "gqa": config.gqa, "temp": config.temp})


@hookimpl
def headlab_register_kv_policies(register):
    register(HeadKV, compile_headkv)
