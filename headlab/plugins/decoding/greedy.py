"""``greedy`` and ``sample``: the baselines every decoding comparison needs.

Both score choices (the ``score`` action) by the model's log-likelihood of the continuation tokens
(``sample``: of the temperature-scaled distribution), as the TruthfulQA / DoLa baseline does.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field

from headlab.decoding import filter_logits, predicting, score_forward
from headlab.plugin import (
    ComponentConfig,
    Decoded,
    DecodeRequest,
    PositiveFloat,
    PositiveInt,
    Probability,
    Scored,
    ScoreRequest,
    decode_loop,
    hookimpl,
    sum_continuation,
)


class Greedy(ComponentConfig):
    """Pick the most likely next token."""

    kind: Literal["greedy"] = "greedy"


class Sample(ComponentConfig):
    """Sample the next token with temperature, top-k and top-p (nucleus) filtering."""

    kind: Literal["sample"] = "sample"
    temperature: PositiveFloat = 1.0
    top_k: PositiveInt | None = None
    top_p: Probability | None = Field(None, gt=0)


def greedy(config: Greedy, request: DecodeRequest) -> Decoded:
    """Greedy decoding through the shared KV-cache loop."""
    return decode_loop(request, lambda out, _: out.logits[:, -1].argmax(-1))


def sample(config: Sample, request: DecodeRequest) -> Decoded:
    """Seeded sampling through the shared KV-cache loop."""
    gen = torch.Generator(device=request.lm.device).manual_seed(request.seed)

    def choose(out, _):
        logits = filter_logits(out.logits[:, -1].float() / config.temperature, config.top_k, config.top_p)
        return torch.multinomial(logits.softmax(-1), 1, generator=gen)[:, 0]

    return decode_loop(request, choose)


def score_loglik(config: Greedy, request: ScoreRequest) -> Scored:
    """Sum of ``log p(token)`` over each row's continuation (one forward, steering plan applied)."""

    logits = predicting(score_forward(request).logits, request)
    return sum_continuation(logits.float().log_softmax(-1), request)


def score_sample(config: Sample, request: ScoreRequest) -> Scored:
    """Sum of ``log softmax(logits / temperature)`` over each row's continuation (no top-k/top-p cut)."""

    logits = predicting(score_forward(request).logits, request)
    return sum_continuation((logits.float() / config.temperature).log_softmax(-1), request)


@hookimpl
def headlab_register_decoders(register):
    register(Greedy, greedy, default=True, score=score_loglik)
    register(Sample, sample, score=score_sample)
