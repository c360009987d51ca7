"""A complete plugin module, a decoding strategy: docs/plugins.md, "One complete example per kind", shows it, and
tests/test_docs_plugins.py registers it and checks what it computes."""

# --8<-- [start:example]
from typing import Literal

import torch
from pydantic import Field

from headlab.plugin import ComponentConfig, Decoded, DecodeRequest, DecodeState, decode_loop, hookimpl


class MinP(ComponentConfig):
    """Min-p sampling: sample among the tokens with p >= min_p * (max p)."""

    kind: Literal["min_p"] = "min_p"
    min_p: float = Field(0.1, gt=0, le=1, description="relative probability floor")


def decode(config: MinP, request: DecodeRequest) -> Decoded:
    gen = torch.Generator(device=request.lm.device).manual_seed(request.seed)
    kept = []

    def choose(outputs, state: DecodeState) -> torch.Tensor:
        p = outputs.logits[:, -1].float().softmax(-1)
        p = torch.where(p >= config.min_p * p.max(-1, keepdim=True).values, p, 0.0)
        kept.append((p > 0).sum(-1).tolist())          # per step, one value per prompt
        return torch.multinomial(p, 1, generator=gen)[:, 0]

    decoded = decode_loop(request, choose)
    decoded.info["kept"] = kept                         # stored as an (example, step) array
    return decoded


@hookimpl
def headlab_register_decoders(register):
    register(MinP, decode)
# --8<-- [end:example]
