"""``dola``: Decoding by Contrasting Layers (docs/methods.md#dola; Chuang et al. 2023).

Native and batched, on any model with an output embedding, through the shared KV-cache loop: each
forward returns the hidden states (``output_hidden_states``), the early-exit ("premature") logits of
the candidate layers are ``lm_head(hidden_states[j])`` at the last position, and the next token is
chosen from ``log_softmax(mature) - log_softmax(premature)`` on the tokens that pass the adaptive
plausibility constraint, after HF's repetition penalty. The semantics are those of transformers'
former ``_dola_decoding`` (removed from its core; it now needs remote code):

- candidate layers: ``low`` / ``high`` / an explicit list with HF's bucket rules, starting at 0 for
  untied embeddings and at 2 (1 for 2-layer, 0 for 1-layer models) for tied ones (:func:`candidate_layers`);
- premature logits without the final norm (``final_norm: true`` applies it);
- layer choice by the reference's divergence (``F.kl_div``-based, means over the vocabulary) or the
  textbook Jensen-Shannon divergence (``divergence: jsd``);
- the layer is chosen **per row** by default; ``layer_choice: batch`` averages the divergence over the
  batch and picks one layer for all rows, as the reference does (then a row's output depends on the
  other rows of its batch);
- ``relative_top`` 0.1, repetition penalty 1.2 (the reference's recommended setting; padding tokens
  are not penalised, so batched equals batch-1).

Scoring (the ``score`` action) follows the reference's TruthfulQA MC code (``lm_score``, mode
``dola``): per continuation token the premature layer is chosen by the same divergence,
``diff = log_softmax(mature) - log_softmax(premature)`` (``score_post_softmax`` renormalises it),
tokens failing ``score_relative_top`` get ``relative_top_value`` (-1000), and the token scores add up.
The reference runs TruthfulQA MC with ``relative_top 0`` and ``post_softmax false``, the defaults here.
"""

from __future__ import annotations

import math
from typing import Annotated, Literal

import torch
from pydantic import Field

from headlab.decoding import SeenTokens, Selection, generator_for, pick, predicting, score_forward
from headlab.generation import ModelCall
from headlab.plugin import (
    Decoded,
    DecodeRequest,
    DecodeState,
    FiniteFloat,
    NonNegativeInt,
    PositiveFloat,
    Probability,
    Scored,
    ScoreRequest,
    decode_loop,
    hookimpl,
    sum_continuation,
)

from .common import final_norm, output_head, tied_embeddings


class DoLa(Selection):
    """DoLa: contrast the final layer with the most divergent early layer (docs/methods.md#dola)."""

    kind: Literal["dola"] = "dola"
    layers: Literal["low", "high"] | Annotated[list[NonNegativeInt], Field(min_length=1)] = Field(
        "high", description="candidate premature layers: 'low', 'high' (HF buckets) or explicit indices "
        "(hidden_states index: 0 = embeddings; indices >= num_layers are dropped)")
    divergence: Literal["reference", "jsd"] = Field(
        "reference", description="reference: 0.5*(mean KL(M||p) + mean KL(M||q)) as F.kl_div computes it; "
        "jsd: the textbook 0.5*(KL(p||M) + KL(q||M)) (sums over the vocabulary)")
    layer_choice: Literal["row", "batch"] = Field(
        "row", description="row: each row picks its own premature layer (batch-invariant, default); batch: "
        "one layer for the whole batch from the batch-mean divergence (the reference)")
    relative_top: Probability = Field(0.1, lt=1, description="adaptive plausibility: keep tokens with "
                                "p >= relative_top * max p (0 keeps all)")
    repetition_penalty: PositiveFloat = Field(1.2, description="HF repetition penalty on prompt and generated "
                                      "tokens (reference 1.2; 1 disables)")
    final_norm: bool = Field(False, description="apply the model's final norm to premature hidden states "
                             "(the reference does not)")
    score_relative_top: Probability = Field(0.0, lt=1, description="plausibility filter when scoring "
                                      "choices (reference TruthfulQA MC: 0)")
    score_post_softmax: bool = Field(False, description="renormalise the contrast with log_softmax when scoring")
    relative_top_value: FiniteFloat = Field(-1000.0, description="score of a token failing the plausibility "
                                      "filter when scoring")


def candidate_layers(n_layers: int, tied: bool, layers: str | list[int]) -> list[int]:
    """The candidate premature layers (indices into ``hidden_states``), with HF ``_dola_decoding``'s rules.

    ``start`` is 0 for untied embeddings (the embedding output is a meaningful early exit), else 2 if
    ``N > 2``, 1 if ``N == 2``, 0 otherwise. ``low``: ``range(start, N // 2, 2)`` (``[start]`` when
    ``start == N // 2``), or ``range(start, 20, 2)`` for ``N > 40``; ``high``: ``range(N // 2, N, 2)``,
    or ``range(N - 20, N, 2)`` for ``N > 40``; a list keeps the indices ``< N``.
    """
    N = n_layers
    if not tied:
        start = 0
    elif N > 2:
        start = 2
    elif N == 2:
        start = 1
    else:
        start = 0
    if layers == "low":
        if start == N // 2:
            out = [start]
        else:
            out = list(range(start, N // 2, 2)) if N <= 40 else list(range(start, 20, 2))
    elif layers == "high":
        out = list(range(N // 2, N, 2)) if N <= 40 else list(range(N - 20, N, 2))
    elif isinstance(layers, list):
        out = [int(i) for i in layers if int(i) < N]
    else:
        raise ValueError("layers must be 'low', 'high' or a list of layer indices")
    if not out:
        raise ValueError(f"DoLa: no candidate premature layer for layers={layers!r} on a {N}-layer model")
    return out


def divergence(final: torch.Tensor, premature: torch.Tensor, kind: str = "reference") -> torch.Tensor:
    """Divergence between the mature distribution (``final``: (..., V) logits) and each premature one
    (``premature``: (J, ..., V)); returns (J, ...).

    ``reference``: ``0.5 * (F.kl_div(log p, M).mean(-1) + F.kl_div(log q, M).mean(-1))`` with
    ``M = (p + q) / 2``, i.e. means over the vocabulary of ``M (log M - log p)`` and ``M (log M - log q)``.
    ``jsd``: ``0.5 * (KL(p || M) + KL(q || M))`` summed over the vocabulary.
    """
    logp = final.float().log_softmax(-1)[None]
    logq = premature.float().log_softmax(-1)
    p, q = logp.exp(), logq.exp()
    m = 0.5 * (p + q)
    if kind == "reference":
        kl1 = torch.nn.functional.kl_div(logp.expand_as(logq), m, reduction="none").mean(-1)
        kl2 = torch.nn.functional.kl_div(logq, m, reduction="none").mean(-1)
        return 0.5 * (kl1 + kl2)
    if kind == "jsd":
        logm = torch.log(m)
        return 0.5 * ((p * (logp - logm)).sum(-1) + (q * (logq - logm)).sum(-1))
    raise ValueError(f"unknown divergence {kind!r}")


def plausible(final_logp: torch.Tensor, relative_top: float) -> torch.Tensor:
    """Tokens passing adaptive plausibility: ``log p >= max log p + log(relative_top)`` (the threshold is
    never above the top-1 value, so at least one token survives)."""
    if relative_top <= 0:
        return torch.ones_like(final_logp, dtype=torch.bool)
    top = final_logp.max(-1, keepdim=True).values
    return final_logp >= torch.minimum(top, top + math.log(relative_top))


class _Contrast:
    """Premature logits of the candidate layers and the per-row layer choice."""

    def __init__(self, config: DoLa, model) -> None:
        self.config = config
        self.head = output_head(model)
        self.norm = final_norm(model) if config.final_norm else None
        n_layers = int(model.config.get_text_config().num_hidden_layers)
        self.layers = candidate_layers(n_layers, tied_embeddings(model), config.layers)
        self.vocab = int(self.head.weight.shape[0])

    def premature(self, hidden_states, index) -> torch.Tensor:
        """(J, ..., V) float logits of the candidate layers at ``hidden_states[j][index]``."""
        out = []
        for j in self.layers:
            h = hidden_states[j][index]
            if self.norm is not None:
                h = self.norm(h)
            out.append(self.head(h).float())
        return torch.stack(out)

    def choose_layer(self, final: torch.Tensor, prem: torch.Tensor, shared: bool) -> torch.Tensor:
        """Index into the candidates per row (..., ) of the most divergent premature layer."""
        if prem.shape[0] == 1:
            return torch.zeros(final.shape[:-1], dtype=torch.long, device=final.device)
        div = divergence(final, prem, self.config.divergence)  # (J, ...)
        if shared:
            return div.mean(dim=tuple(range(1, div.dim()))).argmax().expand(final.shape[:-1])
        return div.argmax(0)


def dola(config: DoLa, request: DecodeRequest) -> Decoded:
    """Generate with DoLa through the shared KV-cache loop (steering plan applied)."""
    contrast = _Contrast(config, request.lm.model)
    gen = generator_for(request, config)
    seen = SeenTokens(request.batch.input_ids, request.batch.attention_mask, contrast.vocab)
    chosen: list[list[int]] = []

    def choose(out, state: DecodeState) -> torch.Tensor:
        final = out.logits[:, -1].float()
        prem = contrast.premature(out.hidden_states, (slice(None), -1))
        idx = contrast.choose_layer(final, prem, config.layer_choice == "batch")
        chosen.append([contrast.layers[i] for i in idx.tolist()])
        base = prem.gather(0, idx[None, :, None].expand(1, *prem.shape[1:]))[0]
        logp = final.log_softmax(-1)
        scores = torch.where(plausible(logp, config.relative_top), logp - base.log_softmax(-1), -torch.inf)
        scores = seen.penalise(scores, state.generated, config.repetition_penalty)
        return pick(scores, config, gen)

    result = decode_loop(request, choose, call=ModelCall(kwargs={"output_hidden_states": True}))
    result.info["premature_layer"] = chosen
    result.info["candidate_layers"] = contrast.layers
    return result


def score_dola(config: DoLa, request: ScoreRequest) -> Scored:
    """Score continuations as the reference's ``lm_score`` (mode ``dola``), batched."""
    contrast = _Contrast(config, request.lm.model)
    out = score_forward(request, output_hidden_states=True)
    C = request.width
    final = predicting(out.logits, request).float()  # (R, C, V)
    prem = contrast.premature(out.hidden_states, (slice(None), slice(-C - 1, -1)))  # (J, R, C, V)
    idx = contrast.choose_layer(final, prem, shared=False)  # (R, C): per row and position, as the reference
    base = prem.gather(0, idx[None, ..., None].expand(1, *prem.shape[1:]))[0]
    logp = final.log_softmax(-1)
    diff = logp - base.log_softmax(-1)
    if config.score_post_softmax:
        diff = diff.log_softmax(-1)
    if config.score_relative_top > 0:
        diff = torch.where(plausible(logp, config.score_relative_top), diff, config.relative_top_value)
    return sum_continuation(diff, request)


@hookimpl
def headlab_register_decoders(register):
    register(DoLa, dola, score=score_dola)
