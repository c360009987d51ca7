"""``contrastive`` (expert vs amateur model) and ``cad`` (context-aware decoding).

Definitions: docs/methods.md#contrastive-decoding and docs/methods.md#context-aware-decoding.

- ``contrastive`` (Li et al. 2023): ``log p_expert(x) - log p_amateur(x)`` on the tokens passing the
  plausibility constraint ``p_expert(x) >= alpha * max p_expert`` (alpha 0.1), -inf elsewhere. The
  amateur is a second model spec (``amateur: <name or {path|config: ...}>``), loaded once per process and
  cached; it must share the expert's tokenizer (same ids). Both models keep their own KV cache and
  advance together in the shared loop. A steering plan of the step applies to the expert only.
- ``cad`` (Shi et al. 2023): ``(1 + alpha) * logits(y | context, x) - alpha * logits(y | x)``, alpha 0.5.
  The rows with and without the context run in **one** batched forward (``2B`` rows). The prompt without
  the context is the prompt with the example's ``spans["context"]`` characters removed (the
  counterfact and nq_swap tasks mark it), or with ``meta["context"]`` removed when there is no span.
  Steering applies to the rows with context only (its spans are positions of the full prompt).

Scoring (the ``score`` action): ``cad`` sums ``log_softmax`` of the CAD logits over the continuation
tokens (the rows without context get the same continuation); ``contrastive`` sums the contrast
``log p_expert - log p_amateur``, with implausible tokens at ``relative_top_value`` when
``score_plausibility`` is on.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Annotated, Any, Literal

import torch
from pydantic import BeforeValidator, Field

from headlab import load_model
from headlab.decoding import Selection, generator_for, pad_id_of, pick, predicting, score_forward, stack_left
from headlab.generation import ModelCall, continuation_batch
from headlab.plugin import (
    Decoded,
    DecodeRequest,
    DecodeState,
    Example,
    FiniteFloat,
    LoadedModel,
    ModelSpec,
    NonNegativeFloat,
    PositiveFloat,
    Probability,
    Rows,
    Scored,
    ScoreRequest,
    decode_loop,
    forward,
    hookimpl,
    sum_continuation,
    tokenize,
)


def _coerce_model(value: Any) -> Any:
    return {"id": value} if isinstance(value, str) else value


# --------------------------------------------------------------------------- contrastive decoding
class Contrastive(Selection):
    """Contrastive decoding: expert log-probs minus amateur log-probs on plausible tokens."""

    kind: Literal["contrastive"] = "contrastive"
    amateur: Annotated[ModelSpec, BeforeValidator(_coerce_model)] = Field(
        description="the amateur model: a name/id or {path: ...} / {config: ...}; same tokenizer as the expert")
    alpha: Probability = Field(0.1, description="plausibility: keep tokens with p_expert >= alpha * max p_expert")
    amateur_temperature: PositiveFloat = Field(1.0, description="divide the amateur's logits by this before log_softmax")
    score_plausibility: bool = Field(False, description="apply the plausibility filter when scoring choices")
    relative_top_value: FiniteFloat = Field(-1000.0, description="score of an implausible token when scoring")


_AMATEURS: dict[tuple[str, int, str], LoadedModel] = {}


def amateur_model(spec: ModelSpec, seed: int, device: str) -> LoadedModel:
    """The amateur model, loaded once per (spec, seed, device) and cached for the process."""
    if spec.device == "auto":
        spec = spec.model_copy(update={"device": device})
    key = (spec.model_dump_json(), int(seed), device)
    if key not in _AMATEURS:
        _AMATEURS[key] = load_model(spec, seed)
    return _AMATEURS[key]


class _Pair:
    """Outputs of the expert and the amateur for one step; ``cache`` holds both caches."""

    def __init__(self, expert: Any, amateur: Any) -> None:
        self.logits = expert.logits
        self.amateur_logits = amateur.logits
        self.cache = (expert.cache, amateur.cache)


def _pair_forward(expert: Any, amateur: Any):
    def forward(cache: Any = None, **kwargs: Any) -> _Pair:
        e = expert(**kwargs, **({} if cache is None else {"cache": cache[0]}))
        a = amateur(**kwargs, **({} if cache is None else {"cache": cache[1]}))
        return _Pair(e, a)

    return forward


def contrastive_scores(config: Contrastive, expert_logits: torch.Tensor, amateur_logits: torch.Tensor,
                       plausible_only: bool = True, fill: float = -math.inf) -> torch.Tensor:
    """``log p_e - log p_a`` (amateur at ``amateur_temperature``) where ``p_e >= alpha max p_e``, ``fill``
    elsewhere. Vocabularies are cut to the smaller of the two."""
    V = min(expert_logits.shape[-1], amateur_logits.shape[-1])
    le = expert_logits[..., :V].float().log_softmax(-1)
    la = (amateur_logits[..., :V].float() / config.amateur_temperature).log_softmax(-1)
    diff = le - la
    if plausible_only and config.alpha > 0:
        keep = le >= le.max(-1, keepdim=True).values + math.log(config.alpha)
        diff = torch.where(keep, diff, fill)
    if V < expert_logits.shape[-1]:
        diff = torch.nn.functional.pad(diff, (0, expert_logits.shape[-1] - V), value=fill)
    return diff


def contrastive(config: Contrastive, request: DecodeRequest) -> Decoded:
    """Generate with contrastive decoding; expert and amateur advance together, each with its cache."""
    amateur = amateur_model(config.amateur, request.seed, request.lm.device)
    gen = generator_for(request, config)

    def choose(out: _Pair, state: DecodeState) -> torch.Tensor:
        scores = contrastive_scores(config, out.logits[:, -1], out.amateur_logits[:, -1])
        return pick(scores, config, gen)

    return decode_loop(request, choose, call=ModelCall(forward=_pair_forward(request.lm.model, amateur.model)))


def score_contrastive(config: Contrastive, request: ScoreRequest) -> Scored:
    """Sum of the contrast over the continuation tokens (expert under the step's plan)."""
    amateur = amateur_model(config.amateur, request.seed, request.lm.device)
    expert = predicting(score_forward(request).logits, request)
    am = forward(amateur, request.batch.input_ids, attention_mask=request.batch.attention_mask,
                 logits_to_keep=request.width + 1)[0].logits
    scores = contrastive_scores(config, expert, predicting(am, request), config.score_plausibility,
                                config.relative_top_value)
    return sum_continuation(scores, request)


# --------------------------------------------------------------------------- CAD
class CAD(Selection):
    """Context-aware decoding: with-context logits contrasted with no-context logits, one batched forward."""

    kind: Literal["cad"] = "cad"
    alpha: NonNegativeFloat = Field(0.5, description="(1 + alpha) * logits(y|c,x) - alpha * logits(y|x)")
    context: Literal["auto", "span", "meta"] = Field(
        "auto", description="how to find the context to remove: span (spans['context']), meta "
        "(meta['context'] text), auto (span, else meta)")


def without_context(example: Example, how: str = "auto") -> str:
    """The prompt with its context removed: the characters of ``spans["context"]`` (``span``), or the
    first occurrence of ``meta["context"]`` (``meta``); spaces left at the seams are collapsed."""
    prompt = example.prompt
    spans = example.spans.get("context") or []
    if how in ("auto", "span") and spans:
        out, last = [], 0
        for s, e in sorted(spans):
            out.append(prompt[last:s])
            last = max(last, e)
        out.append(prompt[last:])
        text = "".join(out)
    elif how in ("auto", "meta") and isinstance(example.meta.get("context"), str) and example.meta["context"] in prompt:
        text = prompt.replace(example.meta["context"], "", 1)
    else:
        raise ValueError("cad needs the context of each example: spans['context'] (character offsets) or "
                         "meta['context'] (text found in the prompt)")
    text = re.sub(r"[ \t]{2,}", " ", text)
    return text.lstrip(" \t")


def _no_context_examples(batch_examples: list[Example], how: str) -> list[Example]:
    return [Example(prompt=without_context(ex, how), meta=ex.meta) for ex in batch_examples]


def cad(config: CAD, request: DecodeRequest) -> Decoded:
    """Generate with CAD: rows with and without the context in one forward per step."""
    batch = request.batch
    B = batch.size
    if not batch.examples or any(ex.input_ids is not None for ex in batch.examples):
        raise ValueError("cad needs text prompts (examples without input_ids)")
    plain = tokenize(request.lm, _no_context_examples(batch.examples, config.context))
    rows = stack_left([(batch.input_ids, batch.attention_mask), (plain.input_ids, plain.attention_mask)],
                      pad_id_of(request.lm))
    if rows[0].shape[1] > batch.length and request.plan is not None:
        raise ValueError("cad: a prompt without its context is longer than the batch; steering positions would shift")
    plan = request.plan.tile(2, B, mirror=False) if request.plan is not None else None
    gen = generator_for(request, config)

    def choose(out, state: DecodeState) -> torch.Tensor:
        logits = out.logits[:, -1].float()
        scores = (1 + config.alpha) * logits[:B] - config.alpha * logits[B:]
        return pick(scores, config, gen)

    return decode_loop(dataclasses.replace(request, plan=plan), choose, rows=Rows(*rows))


def score_cad(config: CAD, request: ScoreRequest) -> Scored:
    """Sum of ``log_softmax`` of the CAD logits over the continuation tokens, both versions in one forward."""
    R = request.batch.size
    plain_pairs = [(Example(prompt=without_context(src, config.context), meta=src.meta), cont)
                   for src, cont in zip(request.sources, request.continuations, strict=True)]
    plain, n_plain = continuation_batch(request.lm, plain_pairs)
    C = request.width
    for r in range(R):
        n = request.n_tokens[r]
        if n_plain[r] != n or not torch.equal(plain.input_ids[r, -n:], request.batch.input_ids[r, -n:]):
            raise ValueError("cad: the continuation tokenizes differently without the context")
    rows = stack_left([(request.batch.input_ids, request.batch.attention_mask),
                       (plain.input_ids, plain.attention_mask)], pad_id_of(request.lm))
    plan = request.plan.tile(2, R, mirror=False) if request.plan is not None else None
    if plan is not None and rows[0].shape[1] > request.batch.length:
        raise ValueError("cad: a prompt without its context is longer than the batch; steering positions would shift")
    logits = score_forward(request, plan=plan, rows=rows).logits
    logits = logits[:, -C - 1:-1].float()
    scores = ((1 + config.alpha) * logits[:R] - config.alpha * logits[R:]).log_softmax(-1)
    return sum_continuation(scores, request)


@hookimpl
def headlab_register_decoders(register):
    register(Contrastive, contrastive, score=score_contrastive)
    register(CAD, cad, score=score_cad)
