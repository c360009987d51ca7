"""ROUGE metrics on hand-computed cases, and agreement with the rouge-score package."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from headlab import Example
from headlab.plugins.metrics.rouge import (
    NeedleRecall,
    RougeL,
    lcs_length,
    needle_recall,
    rouge1,
    rouge_l,
    rouge_l_metric,
    rouge_tokens,
)

NEEDLE_ANSWER = "eat a sandwich and sit in Dolores Park"


def test_tokens_follow_rouge_score():
    assert rouge_tokens("Hello, World! It's 2024.") == ["hello", "world", "it", "s", "2024"]
    assert rouge_tokens("Zürich") == ["z", "rich"]
    assert rouge_tokens("running sandwiches cat", stemmer=True) == ["run", "sandwich", "cat"]
    assert rouge_tokens("runs", stemmer=True) == ["run"] and rouge_tokens("ran", stemmer=True) == ["ran"]


def test_rouge1_hand_computed():
    # reference tokens: eat a sandwich and sit in dolores park (8); output shares eat, in, park (+ sandwich stemmed)
    p, r, f = rouge1(NEEDLE_ANSWER, "I eat sandwiches in the park", stemmer=False)
    assert (p, r) == (3 / 6, 3 / 8) and math.isclose(f, 2 * (0.5 * 0.375) / 0.875)
    assert rouge1(NEEDLE_ANSWER, "I eat sandwiches in the park", stemmer=True)[1] == 4 / 8
    # repeated words count with multiplicity: min(2, 1) + min(1, 2)
    assert rouge1("the the cat", "the cat cat")[:2] == (2 / 3, 2 / 3)
    assert rouge1("", "anything") == (0.0, 0.0, 0.0)
    assert rouge1("x", "") == (0.0, 0.0, 0.0)


def test_rouge_l_hand_computed():
    assert lcs_length("the cat sat on the mat".split(), "the cat on the mat sat".split()) == 5
    assert rouge_l("the cat sat on the mat", "the cat on the mat sat") == (5 / 6, 5 / 6, 5 / 6)
    p, r, f = rouge_l("a b c d", "b d e")
    assert (p, r) == (2 / 3, 2 / 4) and math.isclose(f, 4 / 7)
    assert rouge_l("a b", "...") == (0.0, 0.0, 0.0)


def test_needle_recall_threshold_raw_and_reference():
    niah = Example(prompt="...", target=" " + NEEDLE_ANSWER, meta={"answer": NEEDLE_ANSWER})
    outs = [" eat a sandwich in Dolores Park.", " I eat sandwiches in the park", " Go to the zoo.",
            "Dolores Park, eat a sandwich and sit in it\n"]
    got = needle_recall(NeedleRecall(), [niah] * 4, outs)
    assert got.tolist() == [1.0, 0.0, 0.0, 1.0]  # recalls 6/8, 4/8 (not > 0.5), 0, 8/8
    raw = needle_recall(NeedleRecall(raw=True), [niah] * 4, outs)
    assert raw.tolist() == [6 / 8, 4 / 8, 0.0, 1.0]
    assert needle_recall(NeedleRecall(threshold=0.4), [niah], [outs[1]]).tolist() == [1.0]
    # meta["answer"] is preferred over the target; `reference: target` uses the target
    ex = Example(prompt="", target=" silver lantern moon", meta={"answer": "silver lantern"})
    assert needle_recall(NeedleRecall(raw=True), [ex], ["silver lantern"]).tolist() == [1.0]
    assert needle_recall(NeedleRecall(raw=True, reference="target"), [ex], ["silver lantern"]).tolist() == [2 / 3]


def test_rouge_l_metric():
    exs = [Example(prompt="", target=" the cat sat on the mat"), Example(prompt="", target=" a b c d")]
    got = rouge_l_metric(RougeL(), exs, ["the cat on the mat sat", "b d e"])
    assert np.allclose(got, [5 / 6, 4 / 7])
    assert np.allclose(rouge_l_metric(RougeL(score="recall"), exs, ["the cat on the mat sat", "b d e"]), [5 / 6, 0.5])
    with pytest.raises(ValueError, match="example 0 has no target"):
        rouge_l_metric(RougeL(), [Example(prompt="")], ["x"])


def test_agrees_with_rouge_score():
    rs = pytest.importorskip("rouge_score.rouge_scorer")
    rng = random.Random(0)
    words = "the cat sat on mat running runs ran dogs dog Park parks eat eating a an of, Zürich 42 sandwich".split()
    pairs = [(NEEDLE_ANSWER, "I eat sandwiches in the park")]
    pairs += [(" ".join(rng.choices(words, k=rng.randint(0, 12))), " ".join(rng.choices(words, k=rng.randint(0, 12))))
              for _ in range(200)]
    for stem in (False, True):
        scorer = rs.RougeScorer(["rouge1", "rougeL"], use_stemmer=stem)
        for ref, out in pairs:
            want = scorer.score(ref, out)
            assert np.allclose(rouge1(ref, out, stem), tuple(want["rouge1"])), (ref, out, stem)
            assert np.allclose(rouge_l(ref, out, stem), tuple(want["rougeL"])), (ref, out, stem)
