"""Object-hallucination metrics of vision-language models: ``pope`` and ``chair``.

Definitions: docs/methods.md#pope and docs/methods.md#chair.

``pope`` (Li et al. 2023) scores yes/no answers to "Is there a <object> in the image?". The answer is
read with POPE's reference rule: keep the text before the first ``.``, remove commas, split into words
(on any whitespace; the reference splits on single spaces), and the answer is ``no`` if a word is
``No``, ``no`` or ``not`` (case as written), else ``yes``. With ``first_line: true`` (the default; a
generated continuation goes on past the answer) only the output's first non-empty line is read; with
``false`` the rule is the reference's. The true answer is ``meta["label"]`` (``yes``/``no``, any case),
else the target. Per example: 1 if the answer is right, else 0 (their mean is the accuracy). The step
also stores, over all its examples with ``yes`` as the positive class (``TP``: yes when the truth is
yes, ...): ``pope_accuracy``, ``pope_precision = TP / (TP + FP)`` (NaN without any yes answer),
``pope_recall = TP / (TP + FN)`` (NaN without any yes truth), ``pope_f1 = 2 TP / (2 TP + FP + FN)`` (NaN
when all three are 0) and ``pope_yes_ratio`` (the fraction of yes answers).

``chair`` (Rohrbach et al. 2018) scores captions against the objects in the image (``meta["objects"]``,
a list of names, or a string holding a JSON list or names separated by commas). Objects are found in a
caption through a synonym list mapping each object *category* to its phrases (the category's own name
is one of them): the caption and the phrases are lower-cased and split into words (``[a-z0-9]+``),
then, left to right, the longest phrase starting at each word is taken and its words skipped, so "red
circle" is one mention of the category ``red circle``, not also of another category. Each mention
counts (``unique: true``: each category once per caption). A ground-truth object is mapped to its
category in the same way (a name that is no phrase is its own category). A mention is *hallucinated*
when its category is not among the image's. Per example: 1 if the caption has a hallucinated mention,
else 0 (their mean is CHAIR_s). The step also stores ``chair_s`` (captions with a hallucinated mention /
captions), ``chair_i`` (hallucinated mentions / mentions, over all captions; NaN without mentions) and
``chair_mentions`` (the mentions per caption).

The default synonym list (``synonyms`` unset) is the ``shapes`` task's vocabulary: a category per colour
x shape (``red circle``) with the phrases ``<colour> <shape word>`` for the colour's names (``gray``,
``grey``) and the shape's words and plurals (``circle``, ``disc``, ``disk``, ``dot``; ``square``,
``box``; ``triangle``; ``star``; ``cross``, ``plus``). A shape named without a colour is not an object
of this list (it is neither counted nor hallucinated). ``synonyms`` may instead be a mapping (category:
list of phrases) or the path of a JSON or YAML file holding one, or of a text file in CHAIR's
``synonyms.txt`` form (one category a line: the category, then its synonyms, separated by commas).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import Field
from ruamel.yaml import YAML
from ruamel.yaml.error import YAMLError

from headlab.plugin import ComponentConfig, Example, hookimpl
from headlab.text import COLOURS, SHAPES, plural

__all__ = [
    "PopeMetric", "pope", "pope_aggregate", "pope_answer", "Chair", "chair", "chair_aggregate", "default_synonyms",
    "load_synonyms", "ObjectMatcher",
]

_WORD = re.compile(r"[a-z0-9]+")


# --- POPE --------------------------------------------------------------------------------------------

def pope_answer(output: str, first_line: bool = True) -> str:
    """``"yes"`` or ``"no"``: the answer ``output`` gives under POPE's rule (see the module docstring)."""
    if first_line:
        lines = [ln for ln in output.splitlines() if ln.strip()]
        output = lines[0] if lines else ""
    text = output.split(".")[0].replace(",", "")
    return "no" if {"No", "no", "not"} & set(text.split()) else "yes"


def _truth(ex: Example, i: int) -> str:
    value = ex.meta.get("label", ex.target)
    text = str(value).strip().lower() if value is not None else ""
    if text not in ("yes", "no"):
        raise ValueError(f"metric pope: example {i} has no yes/no answer (meta['label'] or the target, got "
                         f"{value!r}); use it with the pope task or shapes with question: presence")
    return text


class PopeMetric(ComponentConfig):
    """POPE: 1 if the yes/no answer is right; the step adds accuracy, precision, recall, F1, yes-ratio."""

    kind: Literal["pope"] = "pope"
    first_line: bool = Field(True, description="read only the output's first non-empty line (false: the "
                             "whole output, as POPE's reference)")

    def requires(self) -> list[tuple[str, ...]]:
        """The true yes/no answer: ``meta['label']``, else the target."""
        return [("meta.label", "target")]


def pope(config: PopeMetric, examples: list[Example], outputs: list[str]) -> np.ndarray:
    """Per example: 1.0 if the parsed answer equals the true one, else 0.0."""
    return np.array([float(pope_answer(out, config.first_line) == _truth(ex, i))
                     for i, (ex, out) in enumerate(zip(examples, outputs, strict=True))], dtype=float)


def _ratio(num: float, den: float) -> float:
    return num / den if den else math.nan


def pope_aggregate(config: PopeMetric, examples: list[Example], outputs: list[str],
                   values: np.ndarray) -> dict[str, float]:
    """Accuracy, precision, recall, F1 (``yes`` positive) and the yes-ratio over all examples."""
    pred = [pope_answer(out, config.first_line) == "yes" for out in outputs]
    true = [_truth(ex, i) == "yes" for i, ex in enumerate(examples)]
    tp = sum(p and t for p, t in zip(pred, true, strict=True))
    fp = sum(p and not t for p, t in zip(pred, true, strict=True))
    fn = sum(t and not p for p, t in zip(pred, true, strict=True))
    return {"accuracy": _ratio(sum(p == t for p, t in zip(pred, true, strict=True)), len(pred)),
            "precision": _ratio(tp, tp + fp), "recall": _ratio(tp, tp + fn), "f1": _ratio(2 * tp, 2 * tp + fp + fn),
            "yes_ratio": _ratio(sum(pred), len(pred))}


# --- CHAIR -------------------------------------------------------------------------------------------

SHAPE_WORDS: dict[str, tuple[str, ...]] = {
    "circle": ("circle", "disc", "disk", "dot"), "square": ("square", "box"), "triangle": ("triangle",),
    "star": ("star",), "cross": ("cross", "plus"),
}
COLOUR_WORDS: dict[str, tuple[str, ...]] = {c: (c, "grey") if c == "gray" else (c,) for c in COLOURS}


def default_synonyms() -> dict[str, list[str]]:
    """The synonym list of the ``shapes`` task: ``{"red circle": ["red circle", "red circles", "red disc", ...]}``."""
    out: dict[str, list[str]] = {}
    for colour in COLOURS:
        for shape in SHAPES:
            out[f"{colour} {shape}"] = [f"{c} {w}" for c in COLOUR_WORDS[colour] for word in SHAPE_WORDS[shape]
                                        for w in (word, plural(word))]
    return out


def _words(text: str) -> tuple[str, ...]:
    return tuple(_WORD.findall(text.lower()))


class ObjectMatcher:
    """Finds the object categories a text mentions through a synonym list (longest phrase first)."""

    def __init__(self, synonyms: Mapping[str, Sequence[str]]) -> None:
        self.phrases: dict[tuple[str, ...], str] = {}
        for category, phrases in synonyms.items():
            for phrase in [category, *phrases]:
                words = _words(str(phrase))
                if not words:
                    continue
                other = self.phrases.get(words)
                if other is not None and other != category:
                    raise ValueError(f"metric chair: the phrase {' '.join(words)!r} is a synonym of both "
                                     f"{other!r} and {category!r}")
                self.phrases[words] = category
        self.longest = max((len(w) for w in self.phrases), default=0)

    def mentions(self, text: str) -> list[str]:
        """The categories ``text`` mentions, one per mention, in order."""
        words = _words(text)
        out, i = [], 0
        while i < len(words):
            for n in range(min(self.longest, len(words) - i), 0, -1):
                category = self.phrases.get(words[i: i + n])
                if category is not None:
                    out.append(category)
                    i += n
                    break
            else:
                i += 1
        return out

    def category(self, name: str) -> str:
        """The category of an object's name (the name itself, lower-cased, when it is no phrase)."""
        words = _words(name)
        return self.phrases.get(words, " ".join(words))


def load_synonyms(value: Mapping[str, Any] | str | None) -> dict[str, list[str]]:
    """A synonym list: the default (None), a mapping, or a JSON, YAML or CHAIR ``synonyms.txt`` file."""
    if value is None:
        return default_synonyms()
    if isinstance(value, Mapping):
        data: Any = value
    else:
        p = Path(value).expanduser()
        if not p.is_file():
            raise ValueError(f"metric chair: synonyms file not found: {str(value)!r} (looked at {p.resolve()}; "
                             "give a JSON or YAML mapping of category to phrases, or leave synonyms unset for "
                             "the shapes vocabulary)")
        text = p.read_text(encoding="utf-8")
        if p.suffix.lower() == ".txt":
            data = {}
            for line in text.splitlines():
                names = [w.strip() for w in line.split(",") if w.strip()]
                if names:
                    data[names[0]] = names[1:]
        elif p.suffix.lower() == ".json":
            try:
                data = json.loads(text)
            except json.JSONDecodeError as e:
                raise ValueError(f"metric chair: synonyms file {p.name} line {e.lineno}: invalid JSON: {e.msg}") from None
        else:
            try:
                data = YAML(typ="safe").load(text)
            except YAMLError as e:
                raise ValueError(f"metric chair: synonyms file {p.name}: invalid YAML: {e}") from None
    if not isinstance(data, Mapping):
        raise ValueError(f"metric chair: synonyms must map each category to a list of phrases, got "
                         f"{type(data).__name__}")
    out = {}
    for category, phrases in data.items():
        phrases = [phrases] if isinstance(phrases, str) else phrases
        if not isinstance(phrases, (list, tuple)) or not all(isinstance(x, str) for x in phrases):
            raise ValueError(f"metric chair: synonyms of {category!r} must be a list of phrases, got {phrases!r}")
        out[str(category)] = list(phrases)
    return out


class Chair(ComponentConfig):
    """CHAIR: 1 if a caption mentions an object not in the image; the step adds CHAIR_s and CHAIR_i."""

    kind: Literal["chair"] = "chair"
    synonyms: dict[str, list[str]] | str | None = Field(
        None, description="category -> phrases, or a JSON / YAML / CHAIR synonyms.txt file of them (default: the "
        "shapes task's colour x shape objects)")
    unique: bool = Field(False, description="count each category once per caption")

    def requires(self) -> list[tuple[str, ...]]:
        """The objects in the image (``meta['objects']``: ``shapes``, or a data file's meta field)."""
        return [("meta.objects",)]


def _objects(ex: Example, i: int) -> list[str]:
    value = ex.meta.get("objects")
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("["):
            try:
                value = json.loads(text)
            except json.JSONDecodeError:
                value = None
        else:
            value = [v for v in (w.strip() for w in text.split(",")) if v]
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"metric chair: example {i} has no meta['objects'] (the objects in its image, a list of "
                         f"names; got {ex.meta.get('objects')!r}); use it with the shapes task or a meta field")
    return list(value)


def _chair_counts(config: Chair, examples: list[Example], outputs: list[str]) -> list[tuple[int, int]]:
    """Per caption: (mentions, hallucinated mentions)."""
    matcher = ObjectMatcher(load_synonyms(config.synonyms))
    counts = []
    for i, (ex, out) in enumerate(zip(examples, outputs, strict=True)):
        truth = {matcher.category(o) for o in _objects(ex, i)}
        mentions = matcher.mentions(out)
        if config.unique:
            mentions = list(dict.fromkeys(mentions))
        counts.append((len(mentions), sum(m not in truth for m in mentions)))
    return counts


def chair(config: Chair, examples: list[Example], outputs: list[str]) -> np.ndarray:
    """Per caption: 1.0 if it mentions an object not in the image, else 0.0."""
    return np.array([float(bad > 0) for _, bad in _chair_counts(config, examples, outputs)], dtype=float)


def chair_aggregate(config: Chair, examples: list[Example], outputs: list[str],
                    values: np.ndarray) -> dict[str, float]:
    """CHAIR_s, CHAIR_i and the mentions per caption over all captions."""
    counts = _chair_counts(config, examples, outputs)
    mentions = sum(m for m, _ in counts)
    return {"s": _ratio(sum(bad > 0 for _, bad in counts), len(counts)),
            "i": _ratio(sum(bad for _, bad in counts), mentions), "mentions": _ratio(mentions, len(counts))}


@hookimpl
def headlab_register_metrics(register):
    register(PopeMetric, pope, aggregate=pope_aggregate)
    register(Chair, chair, aggregate=chair_aggregate)
