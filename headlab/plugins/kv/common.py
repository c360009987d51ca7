"""What the built-in KV policies share: the fields of the compressed heads' bounded cache, of the GQA rule and
of a budget, and the dtype a ``bytes`` budget counts in."""

from __future__ import annotations

from typing import Any

import torch
from pydantic import Field

__all__ = ["BUDGET_FIELD", "GQA_FIELD", "MEASURE_PEAK_FIELD", "PREFILL_CHUNK_FIELD", "PREFILL_FIELD",
           "QUESTION_TOKENS_FIELD", "SINK_FIELD", "WINDOW_FIELD", "check_prefill", "model_dtype"]

#: StreamingLLM keeps 4 attention-sink tokens (Xiao et al. 2023)
SINK_FIELD = Field(4, description="first tokens of each row a compressed KV head keeps (attention sinks)")
WINDOW_FIELD = Field(description="most recent tokens a compressed KV head keeps, the query's own token included")
GQA_FIELD = Field("any", description="when a KV head is full from its query heads: any of them selected (ranked by "
                                     "their highest score), all of them (lowest score), or mean (mean score)")
PREFILL_CHUNK_FIELD = Field(None, description="feed a longer prompt (or scored row) in forwards of at most this many "
                                              "tokens, so that its transient memory is bounded by the chunk "
                                              "(default: one forward)")
PREFILL_FIELD = Field("bounded", description="what a compressed KV head attends in a row's prefill: bounded, its "
                                             "sinks + window as in decode; full, every prompt token (kvpress's and "
                                             "DuoAttention's deployment), the cache then keeping sinks + window")
QUESTION_TOKENS_FIELD = Field(0, description="with prefill: full, how many of each prompt's last tokens (its "
                                             "question) are fed after the prefill's compression, in a second "
                                             "forward whose compressed KV heads attend only the sinks + window "
                                             "kept, as decode does (kvpress's context/question split; generate "
                                             "steps only); 0: the whole prompt is prefilled in full")
MEASURE_PEAK_FIELD = Field(False, description="on a CPU, also measure the step's peak memory (live tensor bytes; "
                                              "slows decoding down about 4x); on CUDA it is always measured")
BUDGET_FIELD = Field(None, description="keep as many full KV heads as fit: {fraction: f} of the full cache, "
                                       "{bytes: n} or {tokens_per_head: t} per row, at `length` tokens per row "
                                       "(default: the step's context length)")


def check_prefill(config: Any) -> None:
    """Refuse ``prefill: full`` with ``prefill_chunk`` (a later chunk would attend the earlier chunks' full keys,
    which the cache no longer holds), and ``question_tokens`` without ``prefill: full`` (under a bounded prefill
    every query already attends the compressed cache)."""
    if config.prefill == "full" and config.prefill_chunk is not None:
        raise ValueError("prefill: full attends every head over the whole prompt in one forward; prefill_chunk "
                         "would need the earlier chunks' full keys: give one of them")
    if config.question_tokens and config.prefill != "full":
        raise ValueError(f"question_tokens {config.question_tokens}: the question is fed after a full prefill's "
                         "compression; give prefill: full (under prefill: bounded every query already attends the "
                         "compressed cache)")


def model_dtype(ctx: Any) -> torch.dtype | str:
    """The dtype the model's keys and values are stored in: the loaded module's, else the name it was loaded
    with (float32 when neither says)."""
    dtype = getattr(getattr(ctx.model, "model", None), "dtype", None)
    if isinstance(dtype, torch.dtype):
        return dtype
    name = getattr(ctx.model, "dtype", None)
    return name if isinstance(name, str) and name and name != "auto" else "float32"
