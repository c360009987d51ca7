"""Fast tests of the synthetic task generators (plugins/tasks/generators.py); the shipped headlab-tiny
checkpoint is checked by tests/test_models_tiny.py."""

from __future__ import annotations

import re

from headlab.plugins.tasks import generators as S


def test_haystack_file_bundled_and_filler_is_seeded():
    assert S.HAYSTACK_PATH.exists()
    text = S.haystack_text()
    assert S.count_tokens(text) > 20_000
    assert S.filler_text(200, 5) == S.filler_text(200, 5)
    assert S.filler_text(200, 5) != S.filler_text(200, 6)
    assert S.count_tokens(S.filler_text(200, 5)) >= 200


def test_niah_spans_answers_lengths_and_grid():
    exs = S.niah([128, 512], [0.0, 0.5, 1.0], seed=3)
    assert len(exs) == 2 * 3 * len(S.DEFAULT_NEEDLES)
    for ex in exs:
        s, e = ex["needle_span"]
        assert ex["prompt"][s:e] == ex["needle"]
        assert ex["target"] == " " + ex["answer"]
        needle_words = set(re.findall(r"\w+", ex["needle"]))
        assert set(re.findall(r"\w+", ex["answer"])) <= needle_words
        assert ex["prompt"].endswith("Answer:")
        assert ex["question"] in ex["prompt"]
        context = ex["prompt"][: ex["prompt"].rindex(" Question:")]
        assert S.count_tokens(context) == ex["context_length"]
    # depth orders the needle position
    by_depth = {ex["depth"]: ex["needle_span"][0] for ex in exs if ex["context_length"] == 512 and ex["needle_index"] == 0}
    assert by_depth[0.0] == 0 < by_depth[0.5] < by_depth[1.0]
    assert S.niah([256], [0.3], seed=1) == S.niah([256], [0.3], seed=1)


def test_niah_default_grid_and_foreign_length_fn():
    assert len(S.reference_context_lengths()) == 20
    ex = S.niah([300], [0.5], length_fn=lambda s: len(s.split()))[0]
    context = ex["prompt"][: ex["prompt"].rindex(" Question:")]
    assert abs(len(context.split()) - 300) <= 2
    ex = S.niah([400], [0.5], distractors=2, seed=2)[0]
    assert len(ex["distractor_spans"]) == 2
    for s, e in ex["distractor_spans"]:
        assert " is " in ex["prompt"][s:e]


def test_kv_retrieval():
    exs = S.kv_retrieval(5, [4, 16], seed=0)
    assert len(exs) == 10
    for ex in exs:
        keys = [k for k, _ in ex["pairs"]]
        assert len(set(keys)) == len(keys) == ex["num_pairs"]
        assert ex["prompt"].endswith(f" {ex['query_key']} :")
        s, e = ex["answer_span"]
        assert ex["prompt"][s:e] == ex["answer"] == ex["target"].strip()
    assert S.kv_retrieval(3, [8], seed=9) == S.kv_retrieval(3, [8], seed=9)


def test_repeated_tokens():
    exs = S.repeated_tokens([5, 40], 3, seed=1)
    assert len(exs) == 6
    for ex in exs:
        n = ex["length"]
        assert ex["words"][:n] == ex["words"][n:]
        assert len(ex["words"]) == 2 * n
        assert ex["prompt"] + ex["target"] == ex["text"]


def test_counterfact_and_emphasis():
    exs = S.counterfact(seed=0)
    assert len(exs) == len(S.FACTS)
    memory = dict(S.FACTS)
    for ex in exs:
        assert ex["context_answer"] != ex["memory_answer"] == memory[ex["country"]]
        assert ex["prompt"] == ex["context"] + " " + ex["question"]
        s, e = ex["context_span"]
        assert ex["context_answer"] in ex["prompt"][s:e]
        assert ex["target"] == " " + ex["context_answer"]
    agree = S.counterfact(5, conflict=False, seed=1)
    assert all(ex["context_answer"] == ex["memory_answer"] for ex in agree)
    for ex in S.emphasis(20, seed=4):
        (s, e), = ex["emphasis_spans"]
        assert ex["prompt"][s:e] == f"{ex['name']} lives in {ex['emphasis_answer']}."
        assert ex["prompt_marked"].replace("<em>", "").replace("</em>", "") == ex["prompt"]
        assert f"<em>{ex['prompt'][s:e]}</em>" in ex["prompt_marked"]
        assert ex["emphasis_answer"] != ex["default_answer"]
        assert ex["prompt"].index(ex["emphasis_answer"]) < ex["prompt"].rindex(ex["default_answer"])
        assert ex["target"] == " " + ex["emphasis_answer"]


def test_vocabulary_covers_generators():
    vocab = set(S.vocabulary())
    texts = [S.haystack_text()[:20_000]]
    texts += [ex["prompt"] + ex["target"] for ex in S.niah([256], [0.5], distractors=1)]
    texts += [ex["prompt"] + ex["target"] for ex in S.kv_retrieval(5)]
    texts += [ex["prompt"] + ex["target"] for ex in S.counterfact()]
    for ex in S.emphasis(10):
        texts += [ex["prompt"] + ex["target"], ex["plain_emphasis_prompt"]]
    for t in texts:
        assert set(S.tokenize_words(t)) <= vocab

