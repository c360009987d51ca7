"""Task kinds over the synthetic generators: niah, kv_retrieval, counterfact, emphasis."""

from __future__ import annotations

from pathlib import Path

import pytest

from headlab import SpecError, TaskContext, load_spec
from headlab.plugins.tasks import generators as S
from headlab.plugins.tasks.files import TaskDataError
from headlab.plugins.tasks.synthetic_tasks import (
    Counterfact,
    Emphasis,
    KvRetrieval,
    Niah,
    build_counterfact,
    build_emphasis,
    build_kv,
    build_niah,
)

ROOT = Path(__file__).parent.parent
CHECKPOINT = ROOT / "headlab" / "plugins" / "models" / "tiny" / "headlab-tiny"


def ctx(seed: int = 0, tokenizer=None) -> TaskContext:
    return TaskContext(tokenizer=tokenizer, seed=seed, vocab_size=0)


def span_text(ex, name, i=0):
    s, e = ex.spans[name][i]
    return ex.prompt[s:e]


# --- niah ---------------------------------------------------------------------------------------------

def test_niah_default_grid_spans_and_meta():
    examples = build_niah(Niah(), ctx())
    assert len(examples) == 3 * 5 * 3
    assert sorted({ex.meta["context_length"] for ex in examples}) == [128, 256, 512]
    assert sorted({ex.meta["depth"] for ex in examples}) == [0.0, 0.25, 0.5, 0.75, 1.0]
    for ex in examples:
        needle, question, answer = S.DEFAULT_NEEDLES[ex.meta["needle_index"]]
        assert span_text(ex, "needle") == needle
        assert span_text(ex, "answer") == answer
        assert ex.target == " " + answer
        assert ex.meta["answer"] == answer and ex.meta["question"] == question
        assert ex.prompt.endswith(f" Question: {question} Answer:")
        assert ex.prompt.count(needle) == 1
        # context (haystack + needle) measured in the embedded model's word tokens
        context = ex.prompt[: ex.prompt.rindex(" Question:")]
        assert S.count_tokens(context) == ex.meta["context_length"]


def test_niah_depth_extremes_place_the_needle_at_the_ends():
    first, last = build_niah(Niah(context_lengths=[200], depths=[0.0, 1.0], needles=1), ctx())
    assert first.spans["needle"][0][0] == 0
    end = last.spans["needle"][0][1]
    # after the last sentence end of the haystack cut (the generator moves it back to a boundary)
    assert "." not in last.prompt[end: last.prompt.rindex(" Question:")]


def test_niah_matches_the_generator_with_the_seed_offset():
    cfg = Niah(context_lengths=[100, 150], depths=[0.3], needles=2, random_offset=True, seed=4)
    examples = build_niah(cfg, ctx(seed=3))
    rows = S.niah([100, 150], [0.3], S.DEFAULT_NEEDLES[:2], seed=7, random_offset=True)
    assert [ex.prompt for ex in examples] == [r["prompt"] for r in rows]
    other = build_niah(cfg.model_copy(update={"seed": 5}), ctx(seed=3))
    assert [ex.prompt for ex in other] != [r["prompt"] for r in rows]


def test_niah_reference_grid_forms():
    cfg = Niah(context_lengths={"lo": 100, "hi": 200, "n": 3}, depths=10, needles=3)
    lengths, depths, needles = cfg.grid()
    assert lengths == [100, 150, 200]
    assert depths == [i / 9 for i in range(10)]
    assert needles == list(S.DEFAULT_NEEDLES)


def test_niah_n_spreads_over_the_grid():
    full = build_niah(Niah(context_lengths=[64, 96, 128], depths=[0.0, 1.0], needles=1), ctx())
    some = build_niah(Niah(context_lengths=[64, 96, 128], depths=[0.0, 1.0], needles=1, n=3), ctx())
    assert [ex.prompt for ex in some] == [full[0].prompt, full[2].prompt, full[4].prompt]
    with pytest.raises(TaskDataError, match="n=7 exceeds the grid"):
        build_niah(Niah(context_lengths=[64, 96, 128], depths=[0.0, 1.0], needles=1, n=7), ctx())


def test_niah_custom_needle_and_haystack_file(tmp_path):
    hay = tmp_path / "hay.txt"
    hay.write_text("The dog ran far away.\n" * 300)
    needle = {"needle": "The magic number of Zed is forty two.", "question": "What is the magic number of Zed?",
              "answer": "forty two"}
    (ex,) = build_niah(Niah(context_lengths=[80], depths=[0.5], needles=[needle], haystack=str(hay)), ctx())
    assert span_text(ex, "needle") == needle["needle"]
    assert span_text(ex, "answer") == "forty two"
    rest = ex.prompt.replace(needle["needle"], "").replace(" Question: What is the magic number of Zed? Answer:", "")
    assert set(S.tokenize_words(rest)) == {"The", "dog", "ran", "far", "away", "."}


def test_niah_missing_haystack_is_a_clear_error(tmp_path):
    with pytest.raises(TaskDataError, match="file not found: .*nowhere.txt"):
        build_niah(Niah(haystack=str(tmp_path / "nowhere.txt")), ctx())


def test_niah_distractors_have_spans():
    (ex,) = build_niah(Niah(context_lengths=[300], depths=[0.5], needles=1, distractors=2), ctx())
    assert len(ex.spans["distractor"]) == 2
    for s, e in ex.spans["distractor"]:
        assert ex.prompt[s:e].endswith(".") and ex.prompt[s:e] != S.DEFAULT_NEEDLES[0][0]


class CharTokenizer:
    """A stand-in tokenizer with one token per character."""

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [ord(c) for c in text]}


def test_niah_measures_length_with_the_model_tokenizer():
    (ex,) = build_niah(Niah(context_lengths=[300], depths=[0.5], needles=1), ctx(tokenizer=CharTokenizer()))
    context = ex.prompt[: ex.prompt.rindex(" Question:")]
    assert 260 <= len(context) <= 302  # ~300 characters, not ~300 words
    (words,) = build_niah(Niah(context_lengths=[300], depths=[0.5], needles=1), ctx())
    assert len(words.prompt) > 3 * len(ex.prompt)


@pytest.mark.skipif(not any((CHECKPOINT / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")),
                    reason="headlab-tiny is being trained; its tokenizer is not in the tree yet")
def test_niah_with_the_embedded_tokenizer():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(CHECKPOINT))
    for ex in build_niah(Niah(context_lengths=[128, 256], depths=[0.0, 0.5, 1.0]), ctx(tokenizer=tok)):
        context = ex.prompt[: ex.prompt.rindex(" Question:")]
        assert len(tok(context, add_special_tokens=False)["input_ids"]) == ex.meta["context_length"]
        assert tok.unk_token_id not in tok(ex.prompt)["input_ids"]


@pytest.mark.skipif(not (CHECKPOINT / "model.safetensors").is_file(), reason="headlab-tiny is not built")
def test_niah_spec_without_a_model_runs_the_embedded_model_and_finds_the_needle(tmp_path):
    """[model] done-when, at small size: no `model` -> headlab-tiny, needle recall >= 0.9 at trained lengths
    (the model card's full grid goes to 2048 tokens)."""
    import headlab

    spec = ("name: niah-default\ntask: {kind: niah, context_lengths: [128, 512, 1024], depths: 4}\n"
            "steps:\n  - id: g\n    generate: {max_new_tokens: 16, metrics: [needle_recall]}\n")
    run = headlab.run(spec, out=tmp_path)
    assert run.attrs["model"] == "headlab-tiny"
    recall = run.results["g"]["needle_recall"]
    assert recall.sizes["example"] == 3 * 4 * 3
    assert float(recall.mean()) >= 0.9, recall.values


def test_niah_spec_validation():
    spec = "name: t\ntask: {kind: niah, depths: [0.5, 1.5]}\nsteps:\n  - id: g\n    generate: {}\n"
    with pytest.raises(SpecError, match=r"task.depths\[1\]: Input should be less than or equal to 1"):
        load_spec(spec)
    ok = load_spec("name: t\ntask: {kind: niah, context_lengths: {lo: 64, hi: 128, n: 2}, depths: 3}\n"
                   "steps:\n  - id: g\n    generate: {}\n")
    assert ok.spec.task.grid()[0] == [64, 128]


# --- kv_retrieval ---------------------------------------------------------------------------------

def test_kv_retrieval_prompts_and_answer_spans():
    examples = build_kv(KvRetrieval(n=5, num_pairs=[3, 6]), ctx(seed=1))
    assert len(examples) == 10
    assert [ex.meta["num_pairs"] for ex in examples] == [3] * 5 + [6] * 5
    for ex in examples:
        body, query = ex.prompt.rsplit(" . ", 1)
        assert query == f"{ex.meta['query_key']} :"
        pairs = [p.split(" : ") for p in body.split(" , ")]
        assert len(pairs) == ex.meta["num_pairs"]
        assert pairs[ex.meta["query_index"]] == [ex.meta["query_key"], ex.meta["answer"]]
        assert span_text(ex, "answer") == ex.meta["answer"]
        assert ex.target == " " + ex.meta["answer"]


def test_kv_retrieval_rejects_too_many_pairs():
    with pytest.raises(ValueError, match="num_pairs"):
        KvRetrieval(num_pairs=[4, len(S.KEYS) + 1])


# --- counterfact ----------------------------------------------------------------------------------

def test_counterfact_conflicting_contexts():
    memory = dict(S.FACTS)
    examples = build_counterfact(Counterfact(n=12), ctx())
    assert len(examples) == 12
    for ex in examples:
        country = ex.meta["country"]
        assert ex.meta["memory_answer"] == memory[country]
        assert ex.meta["context_answer"] != memory[country]
        assert ex.target == " " + ex.meta["context_answer"]
        fact = span_text(ex, "context")
        assert fact.lower().endswith(f"the capital of {country.lower()} is {ex.meta['context_answer'].lower()}.")
        assert ex.prompt.endswith(f"Question: What is the capital of {country}? Answer:")
        assert ex.meta["strength"] == ("strong" if country in S.STRONG_COUNTRIES else "weak")


def test_counterfact_agreeing_closed_book_and_strength():
    for ex in build_counterfact(Counterfact(n=5, conflict=False), ctx()):
        assert ex.meta["context_answer"] == ex.meta["memory_answer"]
    closed = build_counterfact(Counterfact(closed_book=True, n=3), ctx())
    assert [(ex.prompt, ex.target) for ex in closed] == [
        (f"Question: What is the capital of {c}? Answer:", " " + a) for c, a in S.FACTS[:3]]
    assert not closed[0].spans
    weak = build_counterfact(Counterfact(strength="weak"), ctx())
    assert len(weak) == len(S.FACTS) - len(S.STRONG_COUNTRIES)
    assert all(ex.meta["country"] not in S.STRONG_COUNTRIES for ex in weak)


# --- emphasis -------------------------------------------------------------------------------------

def test_emphasis_markers_are_stripped_and_recorded():
    rows = S.emphasis(6, seed=2)
    examples = build_emphasis(Emphasis(n=6, seed=2), ctx())
    for ex, r in zip(examples, rows, strict=True):
        assert "<em>" not in ex.prompt and "</em>" not in ex.prompt
        assert ex.prompt == r["prompt"]
        assert [list(s) for s in ex.spans["emphasis"]] == r["emphasis_spans"]
        assert span_text(ex, "emphasis") == f"{r['name']} lives in {r['emphasis_answer']}."
        assert ex.target == " " + r["emphasis_answer"]
        assert ex.meta["default_answer"] == r["default_answer"]


def test_emphasis_as_plain_text():
    rows = S.emphasis(3, seed=5)
    marked = build_emphasis(Emphasis(n=3, seed=5, emphasis="markers"), ctx())
    said = build_emphasis(Emphasis(n=3, seed=5, emphasis="instruction"), ctx())
    for m, s, r in zip(marked, said, rows, strict=True):
        statement = f"{r['name']} lives in {r['emphasis_answer']}."
        assert m.prompt == r["prompt_marked"] and f"<em>{statement}</em>" in m.prompt
        assert span_text(m, "emphasis") == statement
        assert s.prompt == r["plain_emphasis_prompt"] and "<em>" not in s.prompt
        assert span_text(s, "emphasis") == statement
