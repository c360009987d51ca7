"""Text utilities shared by tasks, metrics and detectors: ROUGE scores, the words of the shape scenes, single-token
words and the ordinal sequences (digits, number words, weekdays, months, letters) as tokens.

ROUGE (:func:`rouge1`, :func:`rouge_l`) scores exactly as Google's ``rouge-score`` package
(``rouge_scorer.RougeScorer``) does, which the retrieval-head reference code (docs/methods.md#retrieval-score)
and the XSum evaluations use. Tokenisation as in ``rouge_score.tokenize``: lower case, every run of
characters other than ``a-z0-9`` is a separator (so non-ASCII letters split words), and with
``stemmer=True`` tokens longer than 3 characters are reduced by NLTK's Porter stemmer (installed with
``rouge-score``).

- ROUGE-1: ``overlap = sum_w min(count_ref(w), count_out(w))``; recall ``= overlap / |ref|``,
  precision ``= overlap / |out|`` (0 when a side is empty), F1 their harmonic mean.
- ROUGE-L: ``lcs = LCS(ref, out)`` on tokens; recall ``= lcs / |ref|``, precision ``= lcs / |out|``,
  F1 their harmonic mean; all 0 when either side is empty.

The shape scenes (:data:`SHAPES`, :data:`COLOURS`, :func:`plural`) are the vocabulary the ``shapes`` task
draws and asks about and the ``chair`` metric recognises in generated captions.
"""

from __future__ import annotations

import functools
import re
from collections import Counter
from collections.abc import Sequence
from typing import Any

__all__ = ["COLOURS", "SEQUENCES", "SHAPES", "lcs_length", "plural", "rouge1", "rouge_l", "rouge_tokens", "sequence_tokens",
           "single_token"]

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


SHAPES = ("circle", "square", "triangle", "star", "cross")
"""The shapes of a scene."""

COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30), "green": (30, 160, 50), "blue": (30, 70, 220), "yellow": (240, 210, 20),
    "purple": (140, 50, 170), "orange": (245, 130, 20), "brown": (120, 70, 30), "black": (0, 0, 0),
    "gray": (128, 128, 128), "white": (255, 255, 255),
}
"""The colours of a scene by name (RGB)."""


def plural(shape: str) -> str:
    """``circles``, ``crosses``."""
    return shape + ("es" if shape.endswith(("s", "x", "sh", "ch")) else "s")


def single_token(tokenizer: Any, text: str) -> int | None:
    """The token id of ``text`` when it encodes (without special tokens) to exactly one token that is not
    the unknown token, else ``None``."""
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    if len(ids) != 1:
        return None
    unk = getattr(tokenizer, "unk_token_id", None)
    return None if unk is not None and ids[0] == unk else int(ids[0])


#: the default ordinal sequences
SEQUENCES: dict[str, list[str]] = {
    "digits": [str(i) for i in range(10)],
    "numbers": "one two three four five six seven eight nine ten eleven twelve".split(),
    "weekdays": "Monday Tuesday Wednesday Thursday Friday Saturday Sunday".split(),
    "months": ("January February March April May June July August September October November "
               "December").split(),
    "letters": [chr(c) for c in range(ord("A"), ord("Z") + 1)],
}


def sequence_tokens(tokenizer, sequences: dict[str, list[str]], prefix: str = " ") -> tuple[
        dict[str, list[int | None]], list[str]]:
    """Per sequence, the token of each item (``None``: skipped; a repeat of an earlier item's token is skipped
    too), and the skipped items as ``sequence:item``."""
    out: dict[str, list[int | None]] = {}
    skipped = []
    for name, items in sequences.items():
        seen: set[int] = set()
        ids: list[int | None] = []
        for item in items:
            t = single_token(tokenizer, prefix + item)
            if t is None or t in seen:
                skipped.append(f"{name}:{item}")
                t = None
            else:
                seen.add(t)
            ids.append(t)
        out[name] = ids
    return out, skipped
