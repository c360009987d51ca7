"""context_memory and any_answer on hand-made outputs."""

from __future__ import annotations

import math

import numpy as np
import pytest

from headlab import Example
from headlab.plugins.metrics.answers import AnyAnswer, ContextMemory, any_answer, context_memory


def cf(context="Montevideo", memory="Paris"):
    return Example(prompt="...", target=" " + context, meta={"context_answer": context, "memory_answer": memory})


def values(arr):
    return ["nan" if math.isnan(v) else v for v in np.asarray(arr).tolist()]


def test_context_memory_prefix():
    outs = [" Montevideo. Question: What is", " Paris.", " Rome.", " The Montevideo", " montevideo!", "",
            " Parisian food"]
    got = context_memory(ContextMemory(), [cf()] * len(outs), outs)
    # articles are dropped by normalisation; "Parisian" is not the word "Paris"
    assert values(got) == [1.0, 0.0, "nan", 1.0, 1.0, "nan", "nan"]


def test_context_memory_first_line_and_contains():
    ex = cf()
    assert values(context_memory(ContextMemory(), [ex], ["\n\n Paris\nMontevideo"])) == [0.0]
    assert values(context_memory(ContextMemory(first_line=False), [ex], ["I think\nMontevideo"])) == ["nan"]
    contains = ContextMemory(match="contains", first_line=False)
    assert values(context_memory(contains, [ex], ["I think\nMontevideo"])) == [1.0]
    # both present: the earlier one wins
    assert values(context_memory(contains, [ex] * 2, ["It is Paris, not Montevideo", "Montevideo, not Paris"])) == [0.0, 1.0]
    exact = ContextMemory(match="exact")
    assert values(context_memory(exact, [ex] * 2, [" Montevideo.", " Montevideo is"])) == [1.0, "nan"]


def test_context_memory_longer_answer_wins_and_lists():
    ex = Example(prompt="", meta={"context_answers": ["New York City", "NYC"], "memory_answers": ["New York"],
                                  "context_answer": "ignored", "memory_answer": "ignored"})
    got = context_memory(ContextMemory(), [ex] * 3, [" New York City is big", " New York is big", " NYC"])
    assert values(got) == [1.0, 0.0, 1.0]
    same = Example(prompt="", meta={"context_answer": "Paris", "memory_answer": "Paris"})
    assert values(context_memory(ContextMemory(), [same], ["Paris"])) == [1.0]


def test_context_memory_needs_answers():
    with pytest.raises(ValueError, match="example 0 has no meta context_answer"):
        context_memory(ContextMemory(), [Example(prompt="", target=" x")], ["x"])


def test_any_answer():
    ex = Example(prompt="", target=" William Shakespeare", meta={"answers": ["William Shakespeare", "Shakespeare"]})
    outs = [" Shakespeare wrote it", " He was Shakespeare", " william shakespeare.", " Marlowe"]
    assert any_answer(AnyAnswer(), [ex] * 4, outs).tolist() == [1.0, 0.0, 1.0, 0.0]
    assert any_answer(AnyAnswer(match="contains"), [ex] * 4, outs).tolist() == [1.0, 1.0, 1.0, 0.0]
    assert any_answer(AnyAnswer(match="exact"), [ex] * 4, outs).tolist() == [0.0, 0.0, 1.0, 0.0]
    target_only = Example(prompt="", target=" 1945")
    assert any_answer(AnyAnswer(), [target_only] * 2, [" 1945.", " 1946"]).tolist() == [1.0, 0.0]
