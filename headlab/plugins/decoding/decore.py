"""``decore``: Decoding by Contrasting Retrieval Heads (docs/methods.md#decore; Gema et al. 2024).

Per step ``next = (1 + alpha) * log_softmax(base) - alpha * log_softmax(masked)``, where ``masked`` is
the same model with the retrieval heads masked (query zeroed, docs/methods.md#head-masking-and-scaling).
The reference runs batch size 1 with two full forwards per token on forked modelling files; here the
base rows and the masked rows run in **one** batched forward: a batch of ``B`` prompts becomes ``2B``
rows, rows ``B..2B-1`` carry the mask as per-row edits of the instrumentation plan
(``Plan.mask_heads(heads, rows=..., mode="query")``), and the shared KV-cache loop feeds each chosen
token to both copies.

- ``alpha``: a number (static; vanilla DeCoRe 0.5) or ``entropy``: ``alpha_t = H(p_base,t)`` in nats
  (computed as the reference: ``-sum p log(p + 1e-12)``), divided by ``log |V|`` with ``scale_alpha``
  and capped by ``alpha_cap``.
- ``heads``: any head selection (``{from: <retrieval step>, top: k}``, ``[[layer, head], ...]``,
  ``{file: heads.json, top: k}`` in the reference's retrieval-head JSON). ``random: true`` masks as many
  heads drawn at random (seeded; never the selected heads): DeCoRe-random, the control.
- ``prefix``: ``reference`` (default, the reference code's behaviour): the prompt without its last
  token is prefilled unmasked in both copies (the reference copies the base cache), the mask applies
  from the last prompt token on; ``masked``: the masked copy is masked over the whole prompt.
- Steering plans of the same ``generate`` step apply to both copies (mirrored rows).
- ``share_trunk`` (default): below the first layer with a masked head the two copies compute the same
  thing, so those layers (and their KV cache) run once on ``B`` rows and the hidden states are repeated
  to ``2B`` rows on entering that layer (:func:`headlab.instrument.shared_trunk`); with the reference
  prefix the whole prefix is prefilled once, as the reference copies the base cache. Not used when the
  step records probes or runs ``on_layer`` callbacks (those see every row).

Scoring (the ``score`` action) runs the whole sequence masked, as the reference's ``lm_score``; the
per-token ``alpha`` comes from the base distribution at each position; ``score_post_softmax``
renormalises the contrast.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import numpy as np
import torch
from pydantic import Field

from headlab import shared_trunk
from headlab.decoding import Selection, generator_for, pick, predicting, score_forward
from headlab.generation import PromptSplit
from headlab.plugin import (
    Decoded,
    DecodeRequest,
    DecodeState,
    HeadSelection,
    NonNegativeFloat,
    Plan,
    PositiveFloat,
    Rows,
    Scored,
    ScoreRequest,
    Seed,
    decode_loop,
    hookimpl,
    sum_continuation,
)

from .common import entropy_alpha


class DeCoRe(Selection):
    """DeCoRe: contrast the model with itself with its retrieval heads masked, in one batched forward."""

    kind: Literal["decore"] = "decore"
    heads: HeadSelection = Field(description="the retrieval heads to mask: {from: <step>, top: k}, "
                                 "[[layer, head], ...], {file: heads.json, top: k} or {\"<layer>\": [heads]}")
    random: bool = Field(False, description="DeCoRe-random: mask as many heads drawn at random (not the selected ones)")
    random_seed: Seed = Field(0, description="offset added to the run seed for the random heads")
    alpha: NonNegativeFloat | Literal["entropy"] = Field(0.5, description="static alpha, or 'entropy': the base "
                                              "distribution's entropy at each step")
    alpha_cap: PositiveFloat | None = Field(None, description="entropy alpha: cap at this value")
    scale_alpha: bool = Field(False, description="entropy alpha: divide by log |V|")
    mask: Literal["query", "score", "output"] = Field(
        "query", description="query: zero the query (the reference's flash mode); score: zero the scores; "
        "output: zero the head output")
    prefix: Literal["reference", "masked"] = Field(
        "reference", description="reference: prompt prefix prefilled unmasked, masked from the last prompt "
        "token on (the reference code); masked: mask the whole prompt")
    score_post_softmax: bool = Field(False, description="renormalise the contrast with log_softmax when scoring")
    share_trunk: bool = Field(True, description="run the layers below the first masked head once for both "
                              "copies (exact: they see the same inputs); false runs every layer on 2B rows")


def resolve_heads(config: DeCoRe, request: DecodeRequest | ScoreRequest) -> list[tuple[int, int]]:
    """The heads to mask: the selection, or (``random``) as many others drawn with the run seed."""
    heads = [(int(a), int(b)) for a, b in request.heads(config.heads)]
    if not config.random:
        return heads
    geo = request.lm.geometry
    others = [(a, b) for a in range(geo.n_layers) for b in range(geo.n_heads) if (a, b) not in set(heads)]
    if len(heads) > len(others):
        raise ValueError(f"cannot draw {len(heads)} random heads besides the selected ones ({len(others)} left)")
    rng = np.random.default_rng(int(request.seed) + config.random_seed)
    idx = rng.choice(len(others), size=len(heads), replace=False)
    return sorted(others[i] for i in idx)


def alpha_of(config: DeCoRe, base_logits: torch.Tensor) -> torch.Tensor:
    """Alpha per row (and position): static, or the entropy of the base distribution."""
    if config.alpha == "entropy":
        return entropy_alpha(base_logits, scale=config.scale_alpha, cap=config.alpha_cap)
    return torch.full(base_logits.shape[:-1], float(config.alpha), device=base_logits.device)


def contrast(config: DeCoRe, base_logits: torch.Tensor, masked_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``((1 + alpha) log_softmax(base) - alpha log_softmax(masked), alpha)``."""
    a = alpha_of(config, base_logits)
    scores = (1 + a)[..., None] * base_logits.float().log_softmax(-1) - a[..., None] * masked_logits.float().log_softmax(-1)
    return scores, a


def trunk_layer(config: DeCoRe, heads: list[tuple[int, int]], plan: Plan) -> int | None:
    """The first layer with a masked head, when the layers below it can run once for both copies."""
    if not config.share_trunk or not heads or plan.probes.any() or plan.callbacks:
        return None
    first = min(layer for layer, _ in heads)
    return first if first > 0 else None


def decore(config: DeCoRe, request: DecodeRequest) -> Decoded:
    """Generate with DeCoRe: base and masked copies of the batch in one forward per step."""
    B = request.batch.size
    heads = resolve_heads(config, request)
    plan = Plan() if request.plan is None else request.plan.tile(2, B, mirror=True)
    masked_rows = list(range(B, 2 * B))

    def add_mask() -> None:
        plan.mask_heads(heads, rows=masked_rows, mode=config.mask)

    split = None
    if config.prefix == "reference":
        split = PromptSplit(then=add_mask)
    else:
        add_mask()
    rows = Rows(request.batch.input_ids.repeat(2, 1), request.batch.attention_mask.repeat(2, 1),
                shared_until=trunk_layer(config, heads, plan))
    gen = generator_for(request, config)
    alphas: list[list[float]] = []

    def choose(out, state: DecodeState) -> torch.Tensor:
        logits = out.logits[:, -1]
        scores, a = contrast(config, logits[:B], logits[B:])
        alphas.append(a.tolist())
        return pick(scores, config, gen)

    result = decode_loop(dataclasses.replace(request, plan=plan), choose, rows=rows, split=split)
    result.info.update(alpha=alphas, heads=heads)
    return result


def score_decore(config: DeCoRe, request: ScoreRequest) -> Scored:
    """Score continuations as the reference's ``lm_score``: base and (whole-sequence) masked rows in one
    forward, per-token alpha from the base distribution."""
    R = request.batch.size
    heads = resolve_heads(config, request)
    plan = Plan() if request.plan is None else request.plan.tile(2, R, mirror=True)
    plan.mask_heads(heads, rows=list(range(R, 2 * R)), mode=config.mask)
    trunk = trunk_layer(config, heads, plan)
    if trunk is None:
        rows = (request.batch.input_ids.repeat(2, 1), request.batch.attention_mask.repeat(2, 1))
        logits = predicting(score_forward(request, plan=plan, rows=rows).logits, request)
    else:
        with shared_trunk(request.lm.model, trunk, 2):
            logits = predicting(score_forward(request, plan=plan).logits, request)
    scores, _ = contrast(config, logits[:R], logits[R:])
    if config.score_post_softmax:
        scores = scores.log_softmax(-1)
    return sum_continuation(scores, request)


@hookimpl
def headlab_register_decoders(register):
    register(DeCoRe, decore, score=score_decore)
