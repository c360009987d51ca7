"""``pasta``: post-hoc attention steering (Zhang et al. 2023, "Tell Your Model Where to Attend").

Definition: docs/methods.md#pasta. On the steered heads, attention to non-emphasised tokens is multiplied by
``alpha`` and every row renormalised, which is exactly adding ``log(alpha)`` to the pre-softmax scores of
the non-emphasised key columns for every query row. headlab hands that bias to the instrumentation as key
spans (:meth:`headlab.instrument.Plan.bias_keys`), so it runs on the fast attention path (Triton on CUDA,
the query-blocked torch path elsewhere), per batch row, inside ``generate``, without a dense 4-D mask and
without patching the model.

``scale_position`` reproduces the reference code's additions per emphasised section ``[ti, tj)`` of a row
whose prompt occupies keys ``[p0, n)`` (``p0`` = the row's left padding, ``n`` = where its prompt ends,
:meth:`headlab.generation.Batch.prompt_span`; so BOS is a prompt key, and generated-token keys, at
``>= n``, are never touched; nor, in a ``score`` step, the tokens of the choice being scored, which
follow the prompt in the same row):

- ``exclude`` (default): ``log(alpha)`` on ``[p0, ti)`` and ``[tj, n)``;
- ``include``: ``log(alpha)`` on ``[ti, tj)``, and once per row ``-log(alpha)`` on ``[p0, n)`` (net:
  emphasised 0, other prompt keys ``-log(alpha)``, generated keys 0);
- ``generation``: ``log(alpha)`` on ``[p0, n)``.

With several sections the additions accumulate section by section, as in the reference (in ``exclude``
mode each section's complement gets the bias). Emphasis comes from the examples' character spans (the
``emphasis`` task strips ``<em>...</em>`` markers and records them in ``Example.spans["emphasis"]``),
mapped to token positions through the tokenizer's offsets with :meth:`headlab.generation.Batch.spans`.

Heads: ``{from: step, top: k}``, ``[[layer, head], ...]``, PASTA's ``{"<layer>": [heads]}``, a list of
layers (every head of those layers), or ``{file: heads.json}`` in the retrieval-head or PASTA format;
:func:`headlab.heads.to_pasta_json` writes the PASTA format (the ``pasta_profile`` detector can write it).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Literal

from pydantic import Field

from headlab import KeyBias
from headlab.plugin import (
    Batch,
    ComponentConfig,
    HeadSelection,
    NonEmptyStr,
    NonNegativeInt,
    Probability,
    StepContext,
    hookimpl,
)

from .common import resolve_heads

ScalePosition = Literal["exclude", "include", "generation"]
Span = tuple[int, int]


class Pasta(ComponentConfig):
    """PASTA: down-weight attention to non-emphasised prompt tokens on the selected heads."""

    kind: Literal["pasta"] = "pasta"
    heads: HeadSelection | list[NonNegativeInt] = Field(
        description="heads to steer: {from: step, top: k}, [[layer, head], ...], {\"<layer>\": [heads]}, "
        "a list of layers, or {file: heads.json}")
    alpha: Probability = Field(0.01, gt=0, description="attention to non-emphasised tokens is multiplied by "
                         "alpha (log(alpha) added to their scores); 1 = no steering")
    scale_position: ScalePosition = Field(
        "exclude", description="exclude: log(alpha) on prompt keys outside the emphasis (BOS included); "
        "include: net -log(alpha) on prompt keys outside the emphasis; generation: log(alpha) on all prompt keys")
    span: NonEmptyStr = Field("emphasis", description="name of the examples' character spans to emphasise")
    missing: Literal["error", "skip"] = Field(
        "error", description="what to do with an example that has no emphasised span")


def pasta_bias(sections: Sequence[Span], region: Span, alpha: float,
               scale_position: ScalePosition = "exclude") -> list[tuple[Span, float]]:
    """The additive key biases of one row: ``[((start, end), bias), ...]`` in absolute key positions.

    ``sections``: emphasised token spans ``[ti, tj)``; ``region``: the row's prompt keys ``[p0, n)``.
    Overlapping spans add. Follows the reference code's additions (see the module docstring).
    """
    la = math.log(alpha)
    p0, n = int(region[0]), int(region[1])
    out: list[tuple[Span, float]] = []
    for ti, tj in sections:
        ti, tj = max(int(ti), p0), min(int(tj), n)
        if scale_position == "include":
            out.append(((ti, tj), la))
        elif scale_position == "exclude":
            out.append(((p0, ti), la))
            out.append(((tj, n), la))
        elif scale_position == "generation":
            out.append(((p0, n), la))
        else:
            raise ValueError(f"scale_position must be exclude, include or generation, got {scale_position!r}")
    if scale_position == "include" and sections:
        out.append(((p0, n), -la))
    return out


def apply_pasta(plan: Any, heads: Sequence[tuple[int, int]], sections: Sequence[Sequence[Span]],
                regions: Sequence[Span], alpha: float, scale_position: ScalePosition = "exclude",
                rows: Sequence[int] | None = None, *, owner: Any = None) -> None:
    """Add PASTA's biases to ``plan`` for ``heads``.

    ``sections[i]`` and ``regions[i]`` belong to batch row ``rows[i]`` (``rows`` defaults to
    ``range(len(sections))``). Rows with no section are left unsteered. Rows whose biases line up (same
    number of sections) share one :class:`~headlab.instrument.KeyBias` edit. ``owner``: the method adding
    them (its config or name), for the plan's conflict check; the edits are added all or none.
    """
    rows = list(range(len(sections))) if rows is None else [int(r) for r in rows]
    if not (len(rows) == len(sections) == len(regions)):
        raise ValueError("apply_pasta: rows, sections and regions must have the same length")
    groups: dict[tuple[float, ...], list[tuple[int, list[Span]]]] = {}
    for r, secs, region in zip(rows, sections, regions, strict=True):
        if not secs:
            continue
        pairs = pasta_bias(secs, region, alpha, scale_position)
        key = tuple(b for _, b in pairs)
        groups.setdefault(key, []).append((r, [s for s, _ in pairs]))
    heads = [(int(a), int(b)) for a, b in heads]
    if not heads:
        return
    plan.add(*(KeyBias(heads, [spans for _, spans in members], list(biases), [r for r, _ in members], owner=owner)
               for biases, members in groups.items()))


def emphasis_sections(batch: Batch, span: str, missing: str = "error") -> list[list[Span]]:
    """Token spans of the examples' ``span`` character spans, per row (padded coordinates)."""
    sections = batch.spans(span)
    if missing == "error":
        empty = [r for r, s in enumerate(sections) if not s]
        if empty:
            prompt = batch.examples[empty[0]].prompt if batch.examples else ""
            raise ValueError(
                f"pasta: {len(empty)} example(s) have no '{span}' span (first: {prompt[:60]!r}); mark the "
                f"emphasis in the prompt template (e.g. <em>...</em> with the emphasis task) or set missing: skip")
    return sections


def steer(config: Pasta, ctx: StepContext, batch: Batch, plan: Any) -> None:
    """Add PASTA's key biases for every row of ``batch`` to ``plan``."""
    heads = resolve_heads(ctx, config.heads)
    sections = emphasis_sections(batch, config.span, config.missing)
    regions = [batch.prompt_span(r) for r in range(batch.size)]
    apply_pasta(plan, heads, sections, regions, config.alpha, config.scale_position, owner=config)


@hookimpl
def headlab_register_steering(register):
    register(Pasta, steer)
