"""Text metrics: ``exact_match`` and ``contains`` (normalised like SQuAD: case, punctuation, articles)."""

from __future__ import annotations

import re
import string
from typing import Literal

import numpy as np
from pydantic import Field

from headlab.plugin import ComponentConfig, Example, hookimpl


def normalize(text: str) -> str:
    """Lower-case, strip punctuation and English articles, collapse whitespace."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


class ExactMatch(ComponentConfig):
    """1 if the output equals the target (normalised), else 0."""

    kind: Literal["exact_match"] = "exact_match"
    normalize: bool = Field(True, description="compare normalised text")
    first_line: bool = Field(True, description="compare only the output's first line")


class Contains(ComponentConfig):
    """1 if the target occurs in the output (normalised), else 0."""

    kind: Literal["contains"] = "contains"
    normalize: bool = True


def _prep(text: str, norm: bool) -> str:
    return normalize(text) if norm else text.strip()


def exact_match(config: ExactMatch, examples: list[Example], outputs: list[str]) -> np.ndarray:
    """Per-example exact match."""
    out = []
    for ex, o in zip(examples, outputs, strict=True):
        o = o.strip().splitlines()[0] if config.first_line and o.strip() else o
        out.append(float(_prep(o, config.normalize) == _prep(ex.target or "", config.normalize)))
    return np.array(out)


def contains(config: Contains, examples: list[Example], outputs: list[str]) -> np.ndarray:
    """Per-example containment of the target in the output."""
    return np.array([float(_prep(ex.target or "", config.normalize) in _prep(o, config.normalize))
                     for ex, o in zip(examples, outputs, strict=True)])


@hookimpl
def headlab_register_metrics(register):
    register(ExactMatch, exact_match)
    register(Contains, contains)
