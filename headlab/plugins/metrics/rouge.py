"""ROUGE metrics: ``needle_recall`` (ROUGE-1 recall, the retrieval-head success test) and ``rouge_l``.

The scores are those of :mod:`headlab.text` (:func:`~headlab.text.rouge1`, :func:`~headlab.text.rouge_l`),
exactly those of Google's ``rouge-score`` package (``rouge_scorer.RougeScorer``), which the reference code
of the retrieval-head paper (docs/methods.md#retrieval-score) and the XSum evaluations use; the tests
compare against it. See :mod:`headlab.text` for the tokenisation and the formulas.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
from pydantic import Field

from headlab.plugin import ComponentConfig, Example, Probability, hookimpl
from headlab.text import lcs_length, rouge1, rouge_l, rouge_tokens

__all__ = ["NeedleRecall", "RougeL", "lcs_length", "needle_recall", "rouge1", "rouge_l", "rouge_l_metric",
           "rouge_tokens"]


class NeedleRecall(ComponentConfig):
    """ROUGE-1 recall of the answer in the output > threshold (needle retrieved: 1, else 0)."""

    kind: Literal["needle_recall"] = "needle_recall"
    threshold: Probability = Field(0.5, description="recall must exceed this to count as 1")
    raw: bool = Field(False, description="return the recall itself instead of 0/1")
    stemmer: bool = Field(True, description="Porter stemming, as the reference code (use_stemmer=True)")
    reference: Literal["answer", "target"] = Field(
        "answer", description="answer: meta['answer'] when the example has it (niah, kv_retrieval), "
        "else the target; target: always the target")

    def requires(self) -> list[tuple[str, ...]]:
        """The answer (``meta['answer']``, else the target) or, with ``reference: target``, the target."""
        return [("meta.answer", "target") if self.reference == "answer" else ("target",)]


def _reference(ex: Example, which: str, metric: str, i: int) -> str:
    if which == "answer" and isinstance(ex.meta.get("answer"), str):
        return ex.meta["answer"]
    if ex.target is None:
        raise ValueError(f"metric {metric}: example {i} has no target")
    return ex.target


def needle_recall(config: NeedleRecall, examples: list[Example], outputs: list[str]) -> np.ndarray:
    """Per example: ``rouge1(reference, output).recall > threshold`` (or the recall with ``raw``)."""
    values = []
    for i, (ex, out) in enumerate(zip(examples, outputs, strict=True)):
        recall = rouge1(_reference(ex, config.reference, "needle_recall", i), out.strip(), config.stemmer)[1]
        values.append(recall if config.raw else float(recall > config.threshold))
    return np.array(values, dtype=float)


class RougeL(ComponentConfig):
    """ROUGE-L F1 (or precision/recall) of the output against the target."""

    kind: Literal["rouge_l"] = "rouge_l"
    score: Literal["f1", "precision", "recall"] = Field("f1", description="which ROUGE-L value")
    stemmer: bool = Field(False, description="Porter stemming (rouge-score's use_stemmer)")

    def requires(self) -> list[tuple[str, ...]]:
        """The target (the reference summary or answer)."""
        return [("target",)]


def rouge_l_metric(config: RougeL, examples: list[Example], outputs: list[str]) -> np.ndarray:
    """Per example ROUGE-L of the output against ``target``."""
    pick = {"precision": 0, "recall": 1, "f1": 2}[config.score]
    values = []
    for i, (ex, out) in enumerate(zip(examples, outputs, strict=True)):
        values.append(rouge_l(_reference(ex, "target", "rouge_l", i), out.strip(), config.stemmer)[pick])
    return np.array(values, dtype=float)


@hookimpl
def headlab_register_metrics(register):
    register(NeedleRecall, needle_recall)
    register(RougeL, rouge_l_metric)
