"""ROUGE metrics: ``needle_recall`` (ROUGE-1 recall, the retrieval-head success test) and ``rouge_l``.

The scores are exactly those of Google's ``rouge-score`` package (``rouge_scorer.RougeScorer``),
which the reference code of the retrieval-head paper (docs/methods.md#retrieval-score) and the XSum
evaluations use; the tests compare against it. Tokenisation as in ``rouge_score.tokenize``: lower
case, every run of characters other than ``a-z0-9`` is a separator (so non-ASCII letters split
words), and with ``stemmer: true`` tokens longer than 3 characters are reduced by NLTK's Porter
stemmer (installed with ``rouge-score``).

- ROUGE-1: ``overlap = sum_w min(count_ref(w), count_out(w))``; recall ``= overlap / |ref|``,
  precision ``= overlap / |out|`` (0 when a side is empty), F1 their harmonic mean.
- ROUGE-L: ``lcs = LCS(ref, out)`` on tokens; recall ``= lcs / |ref|``, precision ``= lcs / |out|``,
  F1 their harmonic mean; all 0 when either side is empty.
"""

from __future__ import annotations

import functools
import re
from collections import Counter
from collections.abc import Sequence
from typing import Literal

import numpy as np
from pydantic import Field

from headlab import ComponentConfig, Example, hookimpl
from headlab.spec import Probability

_NON_ALNUM = re.compile(r"[^a-z0-9]+")


@functools.lru_cache(maxsize=1)
def _stemmer():
    try:
        from nltk.stem import porter
    except ImportError:
        raise ImportError("stemmer: true needs NLTK's Porter stemmer, installed with rouge-score "
                          "(pip install rouge-score); or set stemmer: false") from None
    return porter.PorterStemmer()


@functools.lru_cache(maxsize=65536)
def _stem(token: str) -> str:
    return _stemmer().stem(token)


def rouge_tokens(text: str, stemmer: bool = False) -> list[str]:
    """Tokens as ``rouge_score.tokenize.tokenize`` makes them."""
    tokens = [t for t in _NON_ALNUM.sub(" ", text.lower()).split() if t]
    if stemmer:
        tokens = [_stem(t) if len(t) > 3 else t for t in tokens]
    return tokens


def _prf(hit: int, n_ref: int, n_out: int) -> tuple[float, float, float]:
    precision = hit / n_out if n_out else 0.0
    recall = hit / n_ref if n_ref else 0.0
    f = 2 * precision * recall / (precision + recall) if precision + recall > 0 else 0.0
    return precision, recall, f


def rouge1(reference: str, output: str, stemmer: bool = False) -> tuple[float, float, float]:
    """ROUGE-1 (precision, recall, F1) of ``output`` against ``reference``."""
    ref, out = Counter(rouge_tokens(reference, stemmer)), Counter(rouge_tokens(output, stemmer))
    hit = sum(min(c, out[w]) for w, c in ref.items())
    return _prf(hit, sum(ref.values()), sum(out.values()))


def lcs_length(a: Sequence[str], b: Sequence[str]) -> int:
    """Length of the longest common subsequence of two token lists."""
    if not a or not b:
        return 0
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0]
        for j, y in enumerate(b, 1):
            cur.append(prev[j - 1] + 1 if x == y else max(prev[j], cur[j - 1]))
        prev = cur
    return prev[-1]


def rouge_l(reference: str, output: str, stemmer: bool = False) -> tuple[float, float, float]:
    """ROUGE-L (precision, recall, F1) of ``output`` against ``reference``."""
    ref, out = rouge_tokens(reference, stemmer), rouge_tokens(output, stemmer)
    if not ref or not out:
        return 0.0, 0.0, 0.0
    return _prf(lcs_length(ref, out), len(ref), len(out))


class NeedleRecall(ComponentConfig):
    """ROUGE-1 recall of the answer in the output > threshold (needle retrieved: 1, else 0)."""

    kind: Literal["needle_recall"] = "needle_recall"
    threshold: Probability = Field(0.5, description="recall must exceed this to count as 1")
    raw: bool = Field(False, description="return the recall itself instead of 0/1")
    stemmer: bool = Field(True, description="Porter stemming, as the reference code (use_stemmer=True)")
    reference: Literal["answer", "target"] = Field(
        "answer", description="answer: meta['answer'] when the example has it (niah, kv_retrieval), "
        "else the target; target: always the target")


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
