"""Pair tasks (``pairs``, ``kv_swap``, ``ioi_pairs``): the examples' prompts, answers and answer tokens, and
the located errors for unequal lengths and multi-token answers."""

from __future__ import annotations

import csv
import json

import pytest

from headlab import TaskContext, load_spec
from headlab.model import load_model_by_name_tokenizer
from headlab.plugins.tasks.files import TaskDataError
from headlab.plugins.tasks.pairs import (
    IoiPairs,
    KvSwap,
    PairTask,
    RepeatedPairs,
    build_ioi,
    build_kv_swap,
    build_pairs,
    build_repeated_pairs,
)

from fixtures.detectors import word_tokenizer
from fixtures.specs import spec_text

WORDS = "ant bee cat dog eel fox gnu hen ibis jay".split()


@pytest.fixture(scope="module")
def tok():
    return word_tokenizer(WORDS)


def ctx(tokenizer) -> TaskContext:
    return TaskContext(tokenizer=tokenizer, seed=0, vocab_size=len(tokenizer))


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


ROWS = [{"clean": "ant bee cat : ant", "corrupt": "ant bee dog : ant", "answer": "bee", "wrong": "cat"},
        {"clean": "eel fox . fox", "corrupt": "eel gnu . gnu", "answer": "eel", "wrong": "hen"}]


def test_jsonl_pairs_carry_the_corrupt_prompt_and_the_answer_tokens(tmp_path, tok):
    path = write_jsonl(tmp_path / "p.jsonl", ROWS)
    examples = build_pairs(PairTask(path=path), ctx(tok))
    assert [e.prompt for e in examples] == [r["clean"] for r in ROWS]
    for ex, row in zip(examples, ROWS, strict=True):
        assert ex.meta["corrupt_prompt"] == row["corrupt"]
        assert ex.meta["answer_id"] == tok.convert_tokens_to_ids(row["answer"])
        assert ex.meta["wrong_id"] == tok.convert_tokens_to_ids(row["wrong"])
        assert ex.target == " " + row["answer"] and ex.choices == [" " + row["answer"], " " + row["wrong"]]
        assert ex.label == 0
    assert [e.meta["row"] for e in examples] == [1, 2]


def test_csv_pairs_read_the_same_fields(tmp_path, tok):
    path = tmp_path / "p.csv"
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["clean", "corrupt", "answer", "wrong"])
        w.writeheader()
        w.writerows(ROWS)
    examples = build_pairs(PairTask(path=str(path)), ctx(tok))
    assert [e.meta["corrupt_prompt"] for e in examples] == [r["corrupt"] for r in ROWS]
    assert examples[1].meta["answer_id"] == tok.convert_tokens_to_ids("eel")


def test_unequal_lengths_name_the_file_and_row(tmp_path, tok):
    rows = [ROWS[0], {**ROWS[1], "corrupt": "eel gnu gnu . gnu"}]
    path = write_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(TaskDataError, match=r"bad\.jsonl row 2: the clean prompt is 5 tokens and the corrupted "
                                            r"one 6"):
        build_pairs(PairTask(path=path), ctx(tok))


def test_a_multi_token_answer_is_a_located_error(tmp_path, tok):
    path = write_jsonl(tmp_path / "multi.jsonl", [{**ROWS[0], "answer": "bee cat"}])
    with pytest.raises(TaskDataError, match=r"multi\.jsonl row 1: the answer ' bee cat' is 2 tokens"):
        build_pairs(PairTask(path=path), ctx(tok))
    path = write_jsonl(tmp_path / "unk.jsonl", [{**ROWS[0], "wrong": "zebra"}])
    with pytest.raises(TaskDataError, match=r"unk\.jsonl row 1: the wrong answer ' zebra' is the tokenizer's "
                                            "unknown token"):
        build_pairs(PairTask(path=path), ctx(tok))


def test_a_missing_field_is_named(tmp_path, tok):
    path = write_jsonl(tmp_path / "m.jsonl", [{"clean": "ant", "answer": "bee", "wrong": "cat"}])
    with pytest.raises(TaskDataError, match=r"m\.jsonl row 1: missing field\(s\) corrupt"):
        build_pairs(PairTask(path=path), ctx(tok))


@pytest.fixture(scope="module")
def tiny_tok():
    return load_model_by_name_tokenizer("headlab-tiny")


def test_kv_swap_queries_another_key_of_the_same_context(tiny_tok):
    examples = build_kv_swap(KvSwap(n=6, num_pairs=5), ctx(tiny_tok))
    assert len(examples) == 6
    for ex in examples:
        body, query = ex.prompt.rsplit(" . ", 1)
        cbody, cquery = ex.meta["corrupt_prompt"].rsplit(" . ", 1)
        assert body == cbody and query == f"{ex.meta['query_key']} :" and cquery == f"{ex.meta['swap_key']} :"
        pairs = dict(item.split(" : ") for item in body.split(" , "))
        assert pairs[ex.meta["query_key"]] == ex.meta["answer"]
        assert pairs[ex.meta["swap_key"]] == ex.meta["wrong"] != ex.meta["answer"]
        assert ex.meta["answer_id"] == tiny_tok.convert_tokens_to_ids(ex.meta["answer"])
        assert ex.meta["wrong_id"] == tiny_tok.convert_tokens_to_ids(ex.meta["wrong"])
        assert len(tiny_tok(ex.prompt).input_ids) == len(tiny_tok(ex.meta["corrupt_prompt"]).input_ids)


def test_ioi_pairs_swap_the_names_of_the_second_clause(tiny_tok):
    examples = build_ioi(IoiPairs(n=6), ctx(tiny_tok))
    for i, ex in enumerate(examples):
        a, b = ex.meta["answer"], ex.meta["wrong"]
        assert a != b
        template = IoiPairs().templates[i % 3]
        fill = {"place": ex.prompt.split(" the ")[1].split()[0].strip(",.")}
        assert ex.prompt.startswith(template.split("{A}")[0] + a + " and " + b)
        assert ex.prompt.count(b) == 2 and ex.meta["corrupt_prompt"].count(a) == 2
        assert ex.meta["corrupt_prompt"] == ex.prompt[: ex.prompt.rindex(b)] + a + ex.prompt[ex.prompt.rindex(b) + len(b):]
        assert fill["place"] in IoiPairs().places
        assert ex.meta["answer_id"] == tiny_tok.convert_tokens_to_ids(a)


def test_ioi_names_that_are_several_tokens_are_an_error(tok):
    with pytest.raises(TaskDataError, match="name ' ant bee' is 2 tokens"):
        build_ioi(IoiPairs(n=2, names=["cat", "ant bee"], templates=["{A} and {B} . {B} to"]), ctx(tok))
    examples = build_ioi(IoiPairs(n=4, names=["cat", "dog"], templates=["{A} and {B} . {B} to"]), ctx(tok))
    assert {(e.prompt, e.meta["corrupt_prompt"]) for e in examples} <= {
        ("cat and dog . dog to", "cat and dog . cat to"), ("dog and cat . cat to", "dog and cat . dog to")}


def test_ioi_templates_are_checked_when_the_spec_is_validated():
    with pytest.raises(Exception, match=r"must name \{A\} once, then \{B\} twice"):
        load_spec(spec_text("  - id: d\n    detect: {kind: direct_logit_attribution}\n",
                            task='{kind: ioi_pairs, templates: ["{B} and {A} went, {B} to"]}'))
    load_spec(spec_text("  - id: d\n    detect: {kind: direct_logit_attribution}\n", task="{kind: kv_swap, n: 2}"))


def test_repeated_pairs_corrupt_the_word_after_the_repeat_in_the_first_copy(tiny_tok):
    examples = build_repeated_pairs(RepeatedPairs(n=8, length=7), ctx(tiny_tok))
    assert len(examples) == 8 and len({e.prompt for e in examples}) == 8
    for ex in examples:
        words, corrupt = ex.prompt.split(), ex.meta["corrupt_prompt"].split()
        j = ex.meta["repeat_index"]
        first, second = words[:7], words[7:]
        assert len(set(first)) == 7 and second == first[:j + 1]  # the prompt ends at a repeat of first[j]
        assert ex.meta["answer"] == first[j + 1]  # what the first copy says comes next
        differ = [i for i, (a, b) in enumerate(zip(words, corrupt, strict=True)) if a != b]
        assert differ == [j + 1] == [ex.meta["corrupt_index"]]
        assert corrupt[j + 1] == ex.meta["wrong"] and ex.meta["wrong"] not in first
        assert ex.meta["answer_id"] == tiny_tok.convert_tokens_to_ids(first[j + 1])
        assert ex.meta["wrong_id"] == tiny_tok.convert_tokens_to_ids(ex.meta["wrong"])
        assert len(tiny_tok(ex.prompt).input_ids) == len(tiny_tok(ex.meta["corrupt_prompt"]).input_ids) == 1 + 8 + j
    assert {e.meta["repeat_index"] for e in examples} != {examples[0].meta["repeat_index"]}  # positions vary


def test_repeated_pairs_from_given_words_and_their_errors(tok):
    examples = build_repeated_pairs(RepeatedPairs(n=3, length=4, words=WORDS[:5]), ctx(tok))
    for ex in examples:
        assert set(ex.prompt.split()) | {ex.meta["wrong"]} == set(WORDS[:5])
    with pytest.raises(TaskDataError, match=r"repeated_pairs task: 5 single-token words for sequences of 5 "
                                            r"distinct words and a replacement"):
        build_repeated_pairs(RepeatedPairs(n=1, length=5, words=WORDS[:5]), ctx(tok))
    with pytest.raises(TaskDataError, match=r"repeated_pairs task: word 'zebra': the word ' zebra' is the "
                                            r"tokenizer's unknown token"):
        build_repeated_pairs(RepeatedPairs(n=1, length=3, words=[*WORDS, "zebra"]), ctx(tok))
    with pytest.raises(Exception, match=r"length must be at least 2"):
        RepeatedPairs(length=1)
    with pytest.raises(Exception, match=r"each must be one word without spaces"):
        RepeatedPairs(words=["ant bee", "cat"])
