"""Pattern detectors: previous-token, duplicate-token and induction heads.

METHODS.md, "Pattern detectors (TransformerLens `head_detector` definitions)". A detection pattern
``D`` (queries x keys) is compared with each head's attention ``A``: ``mul`` scores
``sum(A * D) / sum(A)``, ``abs`` scores ``1 - sum|A - D| / n``. ``exclude_bos`` zeroes ``A[:, 0]``,
``exclude_current_token`` zeroes the diagonal. Scores are averaged over the task's sequences.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import torch
import xarray as xr
from pydantic import Field

from headlab import ComponentConfig, StepContext, hookimpl
from headlab.generation import tokenize


class _Pattern(ComponentConfig):
    error_measure: Literal["mul", "abs"] = Field("mul", description="mul: sum(A*D)/sum(A); abs: 1 - sum|A-D|/n")
    exclude_bos: bool = Field(False, description="zero attention to the first token")
    exclude_current_token: bool = Field(False, description="zero attention to the query's own token")
    batch_size: int = Field(8, ge=1)


class PreviousToken(_Pattern):
    """Heads that attend to the previous token."""

    kind: Literal["previous_token"] = "previous_token"


class DuplicateToken(_Pattern):
    """Heads that attend to earlier copies of the current token."""

    kind: Literal["duplicate_token"] = "duplicate_token"


class Induction(_Pattern):
    """Heads that attend to the token after an earlier copy of the current token."""

    kind: Literal["induction"] = "induction"


def detection_pattern(kind: str, tokens: torch.Tensor) -> torch.Tensor:
    """The (n x n) detection pattern ``D`` of ``kind`` for one token sequence."""
    n = tokens.shape[0]
    if kind == "previous_token":
        return torch.diag(torch.ones(n - 1), -1)
    dup = (tokens[:, None] == tokens[None, :]).float().tril(-1)
    if kind == "duplicate_token":
        return dup
    shifted = torch.zeros_like(dup)
    shifted[:, 1:] = dup[:, :-1]
    return shifted.tril()


def similarity(pattern: torch.Tensor, det: torch.Tensor, measure: str, exclude_bos: bool,
               exclude_current: bool) -> torch.Tensor:
    """Scores of attention patterns ``(..., n, n)`` against ``det`` ``(n, n)``; returns ``(...)``."""
    a = pattern.clone().double()
    det = det.double()
    n = a.shape[-1]
    eye = torch.eye(n, dtype=torch.bool)
    if measure == "mul":
        if exclude_bos:
            a[..., :, 0] = 0
        if exclude_current:
            a = a.masked_fill(eye, 0)
        return (a * det).sum((-1, -2)) / a.sum((-1, -2))
    diff = (a - det).abs()
    if exclude_bos:
        diff[..., :, 0] = 0
    if exclude_current:
        diff = diff.masked_fill(eye, 0)
    return 1 - diff.sum((-1, -2)) / n


def detect(config: _Pattern, ctx: StepContext) -> xr.Dataset:
    """Score every head of the model against the pattern, per example and averaged."""
    from headlab.instrument import Plan, Probes, instrument

    geo = ctx.model.geometry
    scores = np.zeros((len(ctx.examples), geo.n_layers, geo.n_heads))
    by_len: dict[int, list[int]] = {}
    for i, ex in enumerate(ctx.examples):
        n = len(ex.input_ids) if ex.input_ids is not None else len(ctx.model.tokenizer(ex.prompt)["input_ids"])
        by_len.setdefault(n, []).append(i)
    groups = [idx[j: j + config.batch_size] for idx in by_len.values() for j in range(0, len(idx), config.batch_size)]
    for idx in ctx.progress(groups, f"{config.kind} heads"):
        batch = tokenize(ctx.model, [ctx.examples[i] for i in idx])
        with torch.no_grad(), instrument(ctx.model.model, Plan(probes=Probes(pattern=True))) as rec:
            ctx.model.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask)
        pattern = rec.pattern.float().cpu()  # (batch, layer, head, query, key)
        for r, i in enumerate(idx):
            det = detection_pattern(config.kind, batch.input_ids[r].cpu())
            scores[i] = similarity(pattern[r], det, config.error_measure, config.exclude_bos,
                                   config.exclude_current_token).numpy()
    per_example = xr.DataArray(scores, dims=("example", "layer", "head"),
                               coords={"layer": np.arange(geo.n_layers), "head": np.arange(geo.n_heads)})
    ds = xr.Dataset({"score": per_example.mean("example"), "example_score": per_example})
    ds.attrs.update(method=config.kind, error_measure=config.error_measure, model=ctx.model.name,
                    reference="METHODS.md#pattern-detectors")
    return ds


@hookimpl
def headlab_register_detectors(register):
    for config in (PreviousToken, DuplicateToken, Induction):
        register(config, detect)
