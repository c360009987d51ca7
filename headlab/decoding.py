"""headlab.decoding: utilities for decoding strategies (built-in and third-party).

Token selection (:class:`Selection`, :func:`pick`, :func:`filter_logits`, :func:`generator_for`), HF's
repetition penalty (:func:`repetition_penalty`, incrementally: :class:`SeenTokens`), batches of copies for a
batched contrast (:func:`stack_left`), and the forwards of the ``score`` action (:func:`score_forward`,
:func:`predicting`). A strategy's generation loop is :func:`headlab.generation.decode_loop`.

Contrastive strategies run several versions of one prompt in one batched forward: ``k`` copies of a
batch of ``B`` prompts are rows ``0..B-1`` (copy 0), ``B..2B-1`` (copy 1), ... A steering plan written
for the ``B`` rows of the request is carried over to the copies with :meth:`headlab.instrument.Plan.tile`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from pydantic import Field

from .forward_pass import forward
from .generation import Batch, ScoreRequest
from .spec import ComponentConfig, PositiveFloat, PositiveInt, Probability

__all__ = ["REQUEST_PLAN", "SeenTokens", "Selection", "batch_rows", "filter_logits", "generator_for", "pad_id_of",
           "pick", "predicting", "repetition_penalty", "score_forward", "stack_left"]


class Selection(ComponentConfig):
    """How the next token is picked from a strategy's scores: argmax (default) or sampling."""

    kind: str
    do_sample: bool = Field(False, description="sample from softmax(scores) instead of taking the argmax")
    temperature: PositiveFloat = Field(1.0, description="sampling temperature (with do_sample)")
    top_k: PositiveInt | None = Field(None, description="sample among the top-k scores (with do_sample)")
    top_p: Probability | None = Field(None, gt=0, description="nucleus sampling mass (with do_sample)")


def pick(scores: torch.Tensor, config: Selection, generator: torch.Generator | None) -> torch.Tensor:
    """Argmax of ``scores`` (batch, V), or a sample after temperature, top-k and top-p (in HF's order)."""
    if not config.do_sample:
        return scores.argmax(-1)
    logits = filter_logits(scores.float() / config.temperature, config.top_k, config.top_p)
    return torch.multinomial(logits.softmax(-1), 1, generator=generator)[:, 0]


def generator_for(request: Any, config: Selection) -> torch.Generator | None:
    """A generator seeded with the request's seed when the strategy samples."""
    if not config.do_sample:
        return None
    return torch.Generator(device=request.lm.device).manual_seed(int(request.seed))


def repetition_penalty(scores: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor, penalty: float) -> torch.Tensor:
    """HF's ``RepetitionPenaltyLogitsProcessor``: every token present in ``ids`` (batch, T) where ``mask``
    is true has its score divided by ``penalty`` if positive, multiplied if negative. Padding (mask 0) is
    not counted, so a padded row is penalised exactly like the same prompt alone."""
    if penalty == 1.0 or ids.shape[1] == 0:
        return scores
    counts = torch.zeros(scores.shape, dtype=torch.float32, device=scores.device)
    counts.scatter_add_(1, ids.to(scores.device), mask.to(scores.device, torch.float32))
    penalised = torch.where(scores < 0, scores * penalty, scores / penalty)
    return torch.where(counts > 0, penalised, scores)


class SeenTokens:
    """The set of tokens of each row so far (prompt without padding, then every generated token), kept
    incrementally for the repetition penalty: ``penalise(scores, generated)`` equals
    :func:`repetition_penalty` over ``prompt + generated`` without rescanning the sequence each step."""

    def __init__(self, ids: torch.Tensor, mask: torch.Tensor, vocab: int) -> None:
        self.seen = torch.zeros((ids.shape[0], vocab), dtype=torch.bool, device=ids.device)
        counts = torch.zeros((ids.shape[0], vocab), dtype=torch.float32, device=ids.device)
        self.seen |= counts.scatter_add_(1, ids, mask.to(torch.float32)) > 0
        self.n = 0

    def penalise(self, scores: torch.Tensor, generated: torch.Tensor, penalty: float) -> torch.Tensor:
        while self.n < generated.shape[1]:
            self.seen.scatter_(1, generated[:, self.n: self.n + 1].to(self.seen.device), True)
            self.n += 1
        if penalty == 1.0:
            return scores
        return torch.where(self.seen, torch.where(scores < 0, scores * penalty, scores / penalty), scores)


def filter_logits(logits: torch.Tensor, top_k: int | None, top_p: float | None) -> torch.Tensor:
    """Mask logits outside the top-k and outside the smallest set with cumulative probability >= top_p."""
    logits = logits.clone()
    if top_k is not None and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits[logits < kth] = -torch.inf
    if top_p is not None and top_p < 1:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum - sorted_logits.softmax(-1) >= top_p
        logits.scatter_(-1, order, sorted_logits.masked_fill(drop, -torch.inf))
    return logits


# --------------------------------------------------------------------------- batches of copies
def stack_left(parts: Sequence[tuple[torch.Tensor, torch.Tensor]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Concatenate left-padded ``(input_ids, attention_mask)`` blocks along the batch, padding each on the
    left to the longest."""
    n = max(ids.shape[1] for ids, _ in parts)
    ids_out, mask_out = [], []
    for ids, mask in parts:
        extra = n - ids.shape[1]
        ids_out.append(torch.nn.functional.pad(ids, (extra, 0), value=pad_id))
        mask_out.append(torch.nn.functional.pad(mask, (extra, 0), value=0))
    return torch.cat(ids_out), torch.cat(mask_out)


def pad_id_of(lm: Any) -> int:
    """The id used for padding (pad, else eos, else unk, else 0)."""
    return int(lm.pad_id)


# --------------------------------------------------------------------------- scoring forwards
REQUEST_PLAN: Any = object()


def score_forward(request: ScoreRequest, plan: Any = REQUEST_PLAN,
                  rows: tuple[torch.Tensor, torch.Tensor] | None = None, **kwargs: Any) -> Any:
    """One forward over the rows to score (or ``rows``), under ``plan`` (default: the request's plan;
    ``None``: no plan), keeping the logits of the last ``C + 1`` positions (``C``: the longest
    continuation). Rows made of copies of the batch get its images (processor inputs)."""
    batch = request.batch
    plan = request.plan if plan is REQUEST_PLAN else plan
    keep = request.width + 1
    if rows is None:
        return forward(request.lm, batch, plan, logits_to_keep=keep, **kwargs)[0]
    ids, mask = rows
    copies = ids.shape[0] // batch.size
    if batch.has_images and ids.shape[1] == batch.length and torch.equal(ids, batch.input_ids.repeat(copies, 1)):
        return forward(request.lm, batch, plan, copies=copies, logits_to_keep=keep, **kwargs)[0]
    if batch.has_images:
        raise ValueError("scoring rows other than copies of the batch cannot carry its images")
    return forward(request.lm, ids, plan, attention_mask=mask, logits_to_keep=keep, **kwargs)[0]


def predicting(logits: torch.Tensor, request: ScoreRequest) -> torch.Tensor:
    """The logits at the ``C`` positions that predict the continuation tokens (from ``C + 1`` kept)."""
    C = request.width
    return logits[:, -C - 1:-1]


def batch_rows(batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask)`` of a batch."""
    return batch.input_ids, batch.attention_mask
