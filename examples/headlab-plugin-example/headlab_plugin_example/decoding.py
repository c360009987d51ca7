"""``head_contrast``: a decoding strategy written against headlab's public API only.

Greedy decoding on the contrast between the model and the same model with some heads ablated (their
outputs zeroed)::

    s_t = (1 + beta) * log_softmax(logits_base) - beta * log_softmax(logits_ablated)

Both versions of every prompt run in one batched forward per step: the step's steering plan is tiled
over two copies of the batch (:meth:`headlab.Plan.tile`, every copy steered like its source
row) and the heads are zeroed on copy 1 only; :func:`headlab.generation.decode_loop` (its ``rows`` option) keeps one KV cache
for the ``2B`` rows. The scorer gives the same contrast, summed over a choice's tokens, to the ``score``
action.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import torch
from pydantic import Field

from headlab.plugin import (
    ComponentConfig,
    Decoded,
    DecodeRequest,
    DecodeState,
    HeadSelection,
    Plan,
    Rows,
    Scored,
    ScoreRequest,
    decode_loop,
    forward,
    sum_continuation,
)


class HeadContrast(ComponentConfig):
    """Greedy decoding on the contrast with the model whose chosen heads are ablated."""

    kind: Literal["head_contrast"] = "head_contrast"
    heads: HeadSelection = Field(description="heads to ablate in the contrasted copy")
    beta: float = Field(0.5, ge=0, description="contrast strength (0 = greedy)")


def contrast(beta: float, base: torch.Tensor, ablated: torch.Tensor) -> torch.Tensor:
    """``(1 + beta) log_softmax(base) - beta log_softmax(ablated)`` over the last dimension."""
    return (1 + beta) * base.float().log_softmax(-1) - beta * ablated.float().log_softmax(-1)


def two_copy_plan(config: HeadContrast, request: DecodeRequest | ScoreRequest) -> Plan:
    """The request's steering plan over two copies of its rows, the heads zeroed on copy 1."""
    B = request.batch.size
    plan = Plan() if request.plan is None else request.plan.tile(2, B, mirror=True)
    heads = request.heads(config.heads)
    if heads:
        plan.mask_heads(heads, rows=range(B, 2 * B), mode="output", owner=config.kind)
    return plan


def decode(config: HeadContrast, request: DecodeRequest) -> Decoded:
    """Generate greedily from the contrast, both copies in one forward per step."""
    B = request.batch.size
    rows = Rows(request.batch.input_ids.repeat(2, 1), request.batch.attention_mask.repeat(2, 1))

    def choose(outputs, state: DecodeState) -> torch.Tensor:
        logits = outputs.logits[:, -1]
        return contrast(config.beta, logits[:B], logits[B:]).argmax(-1)

    return decode_loop(dataclasses.replace(request, plan=two_copy_plan(config, request)), choose, rows=rows)


def score(config: HeadContrast, request: ScoreRequest) -> Scored:
    """Each row's choice tokens scored by the contrast, summed."""
    R, C = request.batch.size, request.width
    out, _ = forward(request.lm, request.batch, two_copy_plan(config, request), copies=2)
    logits = out.logits
    return sum_continuation(contrast(config.beta, logits[:R, -C - 1:-1], logits[R:, -C - 1:-1]), request)
