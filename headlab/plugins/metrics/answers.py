"""Answer-matching metrics: ``context_memory`` (context vs memory) and ``any_answer``.

Texts are compared after SQuAD normalisation (:func:`headlab.plugins.metrics.text.normalize`: lower
case, punctuation and English articles removed, whitespace collapsed), on the output's first
non-empty line by default. An answer *matches* the output under ``match``:

- ``prefix`` (default): the output starts with the answer, ending at a word boundary
  (" Paris. Question: ..." matches "Paris");
- ``contains``: the answer occurs in the output as whole words;
- ``exact``: the output equals the answer.

``context_memory`` (for ``counterfact``, ``nq_swap``, ``memotrap``): 1 if the output matches the
answer the context supports (``meta["context_answers"]`` or ``meta["context_answer"]``), 0 if it
matches the memorised answer (``meta["memory_answers"]`` or ``meta["memory_answer"]``), NaN if it
matches neither. When both match, the one found earlier in the output wins (at the same place the
longer answer wins; an answer that is in both lists counts as context). Averaging the non-NaN
values (``numpy.nanmean``) gives the context-faithfulness rate among answers that were one or the
other; the fraction of NaN is the rate of other answers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, ClassVar, Literal

import numpy as np
from pydantic import Field

from headlab.plugin import ComponentConfig, Example, hookimpl

from .text import normalize


def _prepare(output: str, first_line: bool) -> str:
    if first_line:
        lines = [ln for ln in output.splitlines() if ln.strip()]
        output = lines[0] if lines else ""
    return normalize(output)


def match_position(output: str, answer: str, match: str) -> int | None:
    """Where the (normalised) answer matches the (normalised) output under ``match``, else None."""
    if not answer:
        return None
    if match == "exact":
        return 0 if output == answer else None
    if match == "prefix":
        return 0 if output == answer or output.startswith(answer + " ") else None
    padded = f" {output} "
    at = padded.find(f" {answer} ")
    return at if at >= 0 else None


def _answers(ex: Example, plural: str, singular: str) -> list[str]:
    values: Any = ex.meta.get(plural)
    if isinstance(values, (list, tuple)) and values:
        return [str(v) for v in values]
    value = ex.meta.get(singular)
    return [str(value)] if isinstance(value, str) and value else []


class _AnswerMatch(ComponentConfig):
    match: Literal["prefix", "contains", "exact"] = Field("prefix", description="how an answer matches")
    first_line: bool = Field(True, description="compare only the output's first non-empty line")


class ContextMemory(_AnswerMatch):
    """1 if the output gives the context's answer, 0 if the memorised one, NaN if neither."""

    kind: Literal["context_memory"] = "context_memory"
    undefined_when: ClassVar[str] = "the output matches neither answer"

    def requires(self) -> list[tuple[str, ...]]:
        """The context's answer and the memorised one (``counterfact``, ``nq_swap``, ``memotrap``)."""
        return [("meta.context_answer", "meta.context_answers"), ("meta.memory_answer", "meta.memory_answers")]


def context_memory(config: ContextMemory, examples: list[Example], outputs: list[str]) -> np.ndarray:
    """Per example: 1.0 (context), 0.0 (memory) or NaN (neither)."""
    values = []
    for i, (ex, out) in enumerate(zip(examples, outputs, strict=True)):
        ctx_answers = _answers(ex, "context_answers", "context_answer")
        mem_answers = _answers(ex, "memory_answers", "memory_answer")
        if not ctx_answers or not mem_answers:
            raise ValueError(f"metric context_memory: example {i} has no meta context_answer / "
                             "memory_answer (use it with counterfact, nq_swap or memotrap)")
        text = _prepare(out, config.first_line)
        best: tuple[int, int, float] | None = None  # (position, -length, value)
        for answers, value in ((ctx_answers, 1.0), (mem_answers, 0.0)):
            for answer in answers:
                norm = normalize(answer)
                at = match_position(text, norm, config.match)
                if at is not None and (best is None or (at, -len(norm)) < best[:2]):
                    best = (at, -len(norm), value)
        values.append(best[2] if best is not None else math.nan)
    return np.array(values, dtype=float)


class AnyAnswer(_AnswerMatch):
    """1 if the output matches any acceptable answer (meta['answers'], else the target), else 0."""

    kind: Literal["any_answer"] = "any_answer"

    def requires(self) -> list[tuple[str, ...]]:
        """The acceptable answers, else the target."""
        return [("meta.answers", "meta.answer", "target")]


def any_answer(config: AnyAnswer, examples: list[Example], outputs: list[str]) -> np.ndarray:
    """Per example: whether any acceptable answer matches."""
    values = []
    for i, (ex, out) in enumerate(zip(examples, outputs, strict=True)):
        answers: Sequence[str] = _answers(ex, "answers", "answer") or ([ex.target] if ex.target else [])
        if not answers:
            raise ValueError(f"metric any_answer: example {i} has neither meta['answers'] nor a target")
        text = _prepare(out, config.first_line)
        values.append(float(any(match_position(text, normalize(a), config.match) is not None for a in answers)))
    return np.array(values, dtype=float)


@hookimpl
def headlab_register_metrics(register):
    register(ContextMemory, context_memory)
    register(AnyAnswer, any_answer)
