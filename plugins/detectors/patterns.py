"""Pattern detectors: previous-token, duplicate-token and induction heads.

METHODS.md, "Pattern detectors (TransformerLens `head_detector` definitions)". A detection pattern
``D`` (queries x keys) is compared with each head's attention ``A``: ``mul`` scores
``sum(A * D) / sum(A)``, ``abs`` scores ``1 - sum|A - D| / n``. ``exclude_bos`` zeroes ``A[:, 0]``,
``exclude_current_token`` zeroes the diagonal. Scores are averaged over the task's sequences.

Every detection pattern here is lower-triangular, so each of its ones ``D[i, j] = 1`` sits at an offset
``delta = i - j >= 0`` behind its query. When a batch's patterns use at most :data:`MAX_OFFSETS` distinct
offsets (previous-token: one; a random sequence repeated twice: a handful), the detectors record only the
attention at those offsets (``Probes(offsets=...)``, ``M[i, delta] = A[i, i - delta]``) plus two span masses
per query (``A[i, 0]`` and the row total), and :func:`probe_scores` computes exactly what
:func:`similarity` computes on the full pattern. Otherwise they fall back to ``Probes(pattern=True)``. The
result's ``attrs["probe"]`` says which ran (``"offsets"``, ``"pattern"`` or ``"offsets+pattern"``).
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import torch
import xarray as xr
from pydantic import Field

from headlab import ComponentConfig, StepContext, hookimpl
from headlab.dims import head_array
from headlab.generation import tokenize
from headlab.resources import Estimate, EstimateContext
from headlab.spec import PositiveInt

#: a batch is scored from offset probes when every row's detection pattern (with the diagonal, when it is
#: excluded) needs at most this many distinct offsets; otherwise from the full attention pattern
MAX_OFFSETS = 64


class _Pattern(ComponentConfig):
    error_measure: Literal["mul", "abs"] = Field("mul", description="mul: sum(A*D)/sum(A); abs: 1 - sum|A-D|/n")
    exclude_bos: bool = Field(False, description="zero attention to the first token")
    exclude_current_token: bool = Field(False, description="zero attention to the query's own token")
    batch_size: PositiveInt = 8

    def estimate(self, ctx: EstimateContext) -> list[Estimate]:
        """The detection patterns (n x n per row, host) and the offset probes of a batch (resource guard)."""
        rows, n = ctx.rows(self.batch_size), ctx.task.tokens
        return [Estimate("detection patterns", rows * n * n * 4, f"{rows:,} rows x {n:,} x {n:,} tokens x 4 bytes",
                         "host"),
                ctx.attention(n, MAX_OFFSETS, rows, "attention at the pattern's offsets")]


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


def pattern_offsets(det: torch.Tensor, exclude_current: bool = False) -> list[int] | None:
    """The distinct offsets ``i - j`` of the ones of ``det`` (n, n), sorted, plus 0 when the diagonal is
    excluded (its mass is then needed); ``None`` when a one lies above the diagonal (not an offset probe)."""
    ii, jj = det.nonzero(as_tuple=True)
    deltas = set((ii - jj).tolist())
    if any(d < 0 for d in deltas):
        return None
    if exclude_current:
        deltas.add(0)
    return sorted(deltas)


def probe_scores(offset_mass: torch.Tensor, offsets: list[int], bos_mass: torch.Tensor, row_mass: torch.Tensor,
                 det: torch.Tensor, measure: str, exclude_bos: bool, exclude_current: bool) -> torch.Tensor:
    """:func:`similarity` from probes instead of the pattern ``A`` (n x n); returns ``(...)``.

    ``offset_mass`` (..., n, O): ``A[i, i - offsets[o]]`` (0 where ``i - offsets[o] < 0``), with ``offsets``
    distinct and covering every offset of ``det``'s ones (and 0 when ``exclude_current``); ``bos_mass``
    (..., n): ``A[i, 0]``; ``row_mass`` (..., n): ``sum_j A[i, j]`` (1, or 0 for a padding query).

    With ``A∘D`` summed over ``det``'s ones read off the offsets, and the excluded cells (column 0, the
    diagonal, counted once where they meet at ``(0, 0)``) read off ``bos_mass`` and offset 0:
    ``mul`` = ``(sum(A∘D) - sum_excl A·D) / (sum(A) - sum_excl A)``; ``abs`` = ``1 - (sum|A-D| - sum_excl
    |A-D|) / n`` with ``sum|A-D| = sum(A) + sum(D) - 2 sum(A∘D)`` (A in [0, 1], D in {0, 1}). As in
    :func:`similarity`, the exclusions remove cells of ``A`` under ``mul`` and cells of ``|A - D|`` under
    ``abs``.
    """
    det = det.double()
    n = det.shape[-1]
    m = offset_mass.double()
    offsets = [int(d) for d in offsets]
    if m.shape[-1] != len(offsets) or m.shape[-2] != n:
        raise ValueError(f"offset_mass {tuple(m.shape)} does not match {len(offsets)} offsets and n = {n}")
    i = torch.arange(n)[:, None]
    j = i - torch.tensor(offsets, dtype=torch.long).reshape(1, -1)
    w = torch.where(j >= 0, det[i.expand_as(j), j.clamp_min(0)], torch.zeros((), dtype=torch.float64))  # (n, O)
    a_d = (m * w).sum((-1, -2))  # sum(A ∘ D)
    total = row_mass.double().sum(-1)  # sum(A)
    bos = bos_mass.double()
    zero = torch.zeros_like(total)
    ex_a, ex_ad, ex_abs = zero, zero, zero  # sums over the excluded cells of A, A·D and |A - D|
    if exclude_bos:
        col = det[:, 0]
        ex_a, ex_ad, ex_abs = ex_a + bos.sum(-1), ex_ad + (bos * col).sum(-1), ex_abs + (bos - col).abs().sum(-1)
    if exclude_current:
        diag, dd = m[..., offsets.index(0)], det.diagonal()
        ex_a, ex_ad, ex_abs = ex_a + diag.sum(-1), ex_ad + (diag * dd).sum(-1), ex_abs + (diag - dd).abs().sum(-1)
    if exclude_bos and exclude_current:  # (0, 0) is both the first column and the diagonal: count it once
        a00, d00 = bos[..., 0], det[0, 0]
        ex_a, ex_ad, ex_abs = ex_a - a00, ex_ad - a00 * d00, ex_abs - (a00 - d00).abs()
    if measure == "mul":
        return (a_d - ex_ad) / (total - ex_a)
    return 1 - (total + det.sum() - 2 * a_d - ex_abs) / n


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
    used: set[str] = set()
    for idx in ctx.progress(groups, f"{config.kind} heads"):
        batch = tokenize(ctx.model, [ctx.examples[i] for i in idx])
        ids = batch.input_ids.cpu()
        n = ids.shape[1]
        dets = [detection_pattern(config.kind, ids[r]) for r in range(len(idx))]
        offsets = [pattern_offsets(d, config.exclude_current_token) for d in dets]
        use_offsets = all(o is not None and len(o) <= MAX_OFFSETS for o in offsets)
        if use_offsets:  # the attention at the patterns' offsets, A[:, 0] and the row totals
            probes = Probes(offsets=offsets, spans=[(0, 1), (0, n)])
        else:
            probes = Probes(pattern=True)
        used.add("offsets" if use_offsets else "pattern")
        with torch.no_grad(), instrument(ctx.model.model, Plan(probes=probes)) as rec:
            ctx.model.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask)
        if use_offsets:
            om = rec.offset_mass.float().cpu()  # (example, layer, head, query, offset)
            sm = rec.span_mass.float().cpu()  # (example, layer, head, query, 2)
            for r, i in enumerate(idx):
                scores[i] = probe_scores(om[r, ..., :len(offsets[r])], offsets[r], sm[r, ..., 0], sm[r, ..., 1],
                                         dets[r], config.error_measure, config.exclude_bos,
                                         config.exclude_current_token).numpy()
            continue
        pattern = rec.pattern.float().cpu()  # (example, layer, head, query, key)
        for r, i in enumerate(idx):
            scores[i] = similarity(pattern[r], dets[r], config.error_measure, config.exclude_bos,
                                   config.exclude_current_token).numpy()
    per_example = head_array(scores, "example")
    ds = xr.Dataset({"score": per_example.mean("example"), "example_score": per_example})
    ds.attrs.update(method=config.kind, error_measure=config.error_measure, model=ctx.model.name,
                    reference="METHODS.md#pattern-detectors", probe="+".join(sorted(used)) or "none")
    return ds


@hookimpl
def headlab_register_detectors(register):
    for config in (PreviousToken, DuplicateToken, Induction):
        register(config, detect)
