"""What the built-in KV policies share: the fields of the compressed heads' bounded cache and of the GQA rule."""

from __future__ import annotations

from pydantic import Field

__all__ = ["GQA_FIELD", "SINK_FIELD", "WINDOW_FIELD"]

#: StreamingLLM keeps 4 attention-sink tokens (Xiao et al. 2023)
SINK_FIELD = Field(4, description="first tokens of each row a compressed KV head keeps (attention sinks)")
WINDOW_FIELD = Field(description="most recent tokens a compressed KV head keeps, the query's own token included")
GQA_FIELD = Field("any", description="when a KV head is full from its query heads: any of them selected (ranked by "
                                     "their highest score), all of them (lowest score), or mean (mean score)")
