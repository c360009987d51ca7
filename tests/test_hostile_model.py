"""Hostile input, round two (issue [robustness]), between the model and the task: a tokenizer (or a task) whose
token ids have no row in the model's input embedding, and a metric used on a task whose examples lack the
fields it reads. Each is refused with one ``error:`` line naming the place and the fix, exit code 2, before the
run store exists (or, for what only a cell's examples show, before the step's first forward), through the
command line as a user types it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import headlab
from headlab import ComponentConfig, Example, hookimpl
from headlab.model import load_model
from headlab.spec import ModelSpec

from fixtures.cli import cli, error_line
from fixtures.specs import TINY_LLAMA

SMALL = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
         "intermediate_size": 64, "max_position_embeddings": 64}
DETECT = "  - id: ind\n    detect: {kind: previous_token}\n"
ROWS = [{"text": "the cat sat on the mat"}, {"text": "the dog ran to the river"}]


def tiny_tokenizer():
    from headlab.model import load_model_by_name_tokenizer

    return load_model_by_name_tokenizer("headlab-tiny")


def save_checkpoint(directory: Path, vocab_size: int, moved: dict[str, int] | None = None) -> Path:
    """A one-layer llama with random weights and ``vocab_size`` embedding rows, saved with headlab-tiny's
    tokenizer (811 tokens, ids 0..810); ``moved`` gives some of its words other ids (a vocabulary with gaps)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", vocab_size=vocab_size, **SMALL)) \
        .save_pretrained(directory)
    tiny_tokenizer().save_pretrained(directory)
    if moved:
        path = directory / "tokenizer.json"
        data = json.loads(path.read_text())
        data["model"]["vocab"].update(moved)
        path.write_text(json.dumps(data))
    return directory


def write(folder: Path, name: str, text: str) -> None:
    (folder / name).write_text(text)


def run_line(folder: Path, capfd, monkeypatch, *args: str) -> tuple[int, str]:
    """``headlab run spec.yaml --out runs`` (or ``args``) in ``folder``: the exit code and the one error line."""
    monkeypatch.chdir(folder)
    code, err = cli(list(args) or ["run", "spec.yaml", "--out", "runs"], capfd)
    return code, error_line(err)


# --------------------------------------------------------------------------- token ids past the embedding
def test_a_tokenizer_whose_ids_pass_the_embedding_is_refused_at_load(tmp_path, capfd, monkeypatch):
    # 811 tokens for 811 rows, but the word "the" has id 2,000: len(tokenizer) fits, its largest id does not
    # (before: the first prompt holding "the" ended in an IndexError blamed on the detector step, exit 1)
    save_checkpoint(tmp_path / "ckpt", 811, moved={"the": 2000})
    write(tmp_path, "d.jsonl", "".join(json.dumps(r) + "\n" for r in ROWS))
    write(tmp_path, "spec.yaml", "name: t\nmodel: {path: ckpt}\n"
          "task: {kind: jsonl, path: d.jsonl, prompt: '{{ text }}'}\nsteps:\n" + DETECT)
    code, line = run_line(tmp_path, capfd, monkeypatch)
    assert code == 2, line
    assert "model 'ckpt'" in line and "its tokenizer has 811 tokens (ids up to 2,000)" in line, line
    assert "its input embedding has 811 rows" in line and "vocab_size of at least 2,001" in line, line
    assert "give the tokenizer the model was trained with" in line
    assert not (tmp_path / "runs").exists()


def test_embeddings_larger_than_the_tokenizer_still_load(tmp_path, capfd, monkeypatch):
    # an embedding with more rows than the tokenizer has tokens (padded, or reserving ids) is common and fine
    save_checkpoint(tmp_path / "big", 1000)
    write(tmp_path, "spec.yaml", "name: t\nmodel: {path: big}\ntask: {kind: repeated_tokens, n: 2, length: 4}\n"
          "steps:\n" + DETECT)
    monkeypatch.chdir(tmp_path)
    code, err = cli(["run", "spec.yaml", "--out", "runs"], capfd)
    assert code == 0, err
    # the shipped models and the tiny config models the tests use
    from headlab.model import embedding_rows, largest_token_id

    for spec, rows in [(ModelSpec(id="headlab-tiny"), 832), (ModelSpec(id="headlab-tiny-vlm"), 896),
                       (ModelSpec(config={**TINY_LLAMA, "vocab_size": 811, "tokenizer": "headlab-tiny"}), 811),
                       (ModelSpec(config=TINY_LLAMA), 97)]:
        lm = load_model(spec)
        assert embedding_rows(lm.model) == rows, spec
        assert lm.tokenizer is None or largest_token_id(lm.tokenizer) < rows


class BigIds(ComponentConfig):
    """Token ids up to ``top``."""

    kind: str = "big_ids"
    top: int = 500


class BigIdsPlugin:
    """A third party's task on token ids, one of which has no row in a 97-row embedding."""

    @hookimpl
    def headlab_register_tasks(self, register):
        from typing import Literal

        class Config(BigIds):
            kind: Literal["big_ids"] = "big_ids"

        register(Config, lambda config, ctx: [Example(prompt="ids", input_ids=[1, 2, 3, 4]),
                                              Example(prompt="ids", input_ids=[1, 5, config.top, 6])])


@pytest.fixture
def plugins():
    names = []
    yield lambda obj, name: names.append(headlab.register_plugin(obj, name, replace=True))
    for name in names:
        headlab.unregister_plugin(name)


def test_a_tasks_token_ids_past_the_embedding_are_refused_before_the_forward(tmp_path, capfd, monkeypatch,
                                                                              plugins):
    plugins(BigIdsPlugin(), "big-ids")
    write(tmp_path, "spec.yaml", f"name: t\nmodel: {{config: {json.dumps(TINY_LLAMA)}}}\ntask: {{kind: big_ids}}\n"
          "steps:\n" + DETECT)
    code, line = run_line(tmp_path, capfd, monkeypatch)
    assert code == 2, line  # before: IndexError inside the detector's forward, exit 1
    assert "step 'ind' (task 'big_ids', plugin big-ids)" in line, line
    assert "example 1 has token id 500, but the model's input embedding has 97 rows (ids 0 to 96)" in line, line


# --------------------------------------------------------------------------- metrics on tasks they do not fit
CONTEXT = "meta['context_answer'] (or meta['context_answers'])"


def metric_spec(metric: str, task: str) -> str:
    return (f"name: m\nmodel: headlab-tiny\ntask: {task}\nsteps:\n"
            f"  - id: gen\n    generate: {{max_new_tokens: 2, metrics: [{metric}]}}\n")


@pytest.mark.parametrize(("metric", "task", "field", "fits"), [
    ("context_memory", "{kind: repeated_tokens, n: 2, length: 4}", CONTEXT,
     "context_memory fits counterfact, memotrap, nq_swap, or csv/jsonl with meta: [context_answer, memory_answer]"),
    ("context_memory", "{kind: niah, context_lengths: [64], depths: [0.5]}", CONTEXT,
     "context_memory fits counterfact, memotrap, nq_swap"),
    ("context_memory", "{kind: counterfact, n: 2, closed_book: true}", CONTEXT,
     "context_memory fits counterfact, memotrap, nq_swap"),
    ("chair", "{kind: niah, context_lengths: [64], depths: [0.5]}", "meta['objects']",
     "chair fits shapes, or csv/jsonl with meta: [objects]"),
    ("rouge_l", "{kind: repeated_tokens, n: 2, length: 4}", "target", "rouge_l fits counterfact"),
    ("any_answer", "{kind: repeated_tokens, n: 2, length: 4}", "meta['answers'] (or meta['answer'], target)",
     "any_answer fits nq_open, nq_swap, pope, shapes"),
    ("{kind: needle_recall, reference: target}", "{kind: repeated_tokens, n: 2, length: 4}", "target",
     "needle_recall fits"),
])
def test_a_metric_on_a_task_without_its_fields_is_refused_when_validated(tmp_path, capfd, monkeypatch, metric,
                                                                         task, field, fits):
    # before: validate said ok, and run generated, then failed in the metric with exit 1, the store "failed"
    write(tmp_path, "spec.yaml", metric_spec(metric, task))
    kind = metric.split("kind: ")[-1].split(",")[0].strip("{} ")
    for args in (["validate", "spec.yaml"], ["run", "spec.yaml", "--out", "runs"]):
        code, line = run_line(tmp_path, capfd, monkeypatch, *args)
        assert code == 2, line
        assert line.startswith("error: spec.yaml:6:") and "steps[0].generate.metrics[0]: step 'gen'" in line, line
        task_kind = task.split(",")[0].removeprefix("{kind: ")
        assert f"metric '{kind}' reads {field}, which task '{task_kind}' does not give" in line, line
        assert fits in line, line
    assert not (tmp_path / "runs").exists()


def test_examples_that_lack_a_metrics_field_are_refused_before_the_store(tmp_path, capfd, monkeypatch):
    # the task gives the field (meta: [...]), but a row leaves it empty: found on the examples, before the store
    rows = [{"q": "the cat", "context_answer": "river", "memory_answer": "stone"},
            {"q": "the dog", "context_answer": "road", "memory_answer": ""}]
    write(tmp_path, "d.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
    write(tmp_path, "spec.yaml", metric_spec(
        "context_memory", "{kind: jsonl, path: d.jsonl, prompt: '{{ q }}', meta: [context_answer, memory_answer]}"))
    monkeypatch.chdir(tmp_path)
    assert cli(["validate", "spec.yaml"], capfd)[0] == 0  # the task can give it: validation cannot tell
    code, line = run_line(tmp_path, capfd, monkeypatch)
    assert code == 2, line
    assert "steps[0].generate.metrics[0]: step 'gen': metric 'context_memory' reads meta['memory_answer']" in line
    assert "which example 1 (data row 2) of task 'jsonl' lacks (1 of 2 examples)" in line, line
    assert "context_memory fits counterfact, memotrap, nq_swap" in line
    assert not (tmp_path / "runs").exists()


class NoFieldsPlugin:
    """A third party's task that does not declare its fields, and a metric of its own that declares none."""

    @hookimpl
    def headlab_register_tasks(self, register):
        from typing import Literal

        class Config(ComponentConfig):
            kind: Literal["plain_text"] = "plain_text"

        register(Config, lambda config, ctx: [Example(prompt="the cat sat"), Example(prompt="the dog ran")])

    @hookimpl
    def headlab_register_metrics(self, register):
        from typing import Literal

        import numpy as np

        class Config(ComponentConfig):
            kind: Literal["length"] = "length"

        register(Config, lambda config, examples, outputs: np.array([len(o) for o in outputs], dtype=float))


def test_undeclared_tasks_are_checked_on_their_examples_and_third_party_metrics_keep_working(
        tmp_path, capfd, monkeypatch, plugins):
    plugins(NoFieldsPlugin(), "no-fields")
    write(tmp_path, "spec.yaml", metric_spec("context_memory", "{kind: plain_text}"))
    code, line = run_line(tmp_path, capfd, monkeypatch)
    assert code == 2, line
    assert "metric 'context_memory' reads meta['context_answer']" in line, line
    assert "which example 0 of task 'plain_text' lacks (2 of 2 examples)" in line, line
    assert not (tmp_path / "runs").exists()
    # a metric that declares nothing is not checked: it runs as before, on any task
    write(tmp_path, "spec.yaml", metric_spec("length", "{kind: plain_text}"))
    code, err = cli(["run", "spec.yaml", "--out", "runs"], capfd)
    assert code == 0, err


def test_each_cell_checks_its_examples_before_the_step_runs(tmp_path, capfd, monkeypatch):
    # what the examples built before the store do not cover (past PREFLIGHT_TASKS tasks, a Ray worker's cell)
    import headlab.preflight

    monkeypatch.setattr(headlab.preflight, "PREFLIGHT_TASKS", 0)
    rows = [{"q": "the cat", "context_answer": "river", "memory_answer": ""}]
    write(tmp_path, "d.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
    write(tmp_path, "spec.yaml", metric_spec(
        "context_memory", "{kind: jsonl, path: d.jsonl, prompt: '{{ q }}', meta: [context_answer, memory_answer]}"))
    code, line = run_line(tmp_path, capfd, monkeypatch)
    assert code == 2, line
    assert "step 'gen' (metric 'context_memory', plugin headlab.plugins.metrics.answers): ValueError: metric " \
           "'context_memory' reads meta['memory_answer']" in line, line
    assert "example 0 (data row 1) of task 'jsonl' lacks (1 of 1 examples)" in line, line


# --------------------------------------------------------------------------- the declarations hold
def observed(examples: list[Example]) -> set[str]:
    from headlab.scoring import EXAMPLE_FIELDS, has_field

    fields = {f for ex in examples for f in EXAMPLE_FIELDS if has_field(ex, f)}
    return fields | {f"meta.{k}" for ex in examples for k in ex.meta}


def test_every_builtin_task_declares_the_fields_its_examples_have(tmp_path):
    """Each built-in task's ``example_fields()`` holds every field its built examples have (a field left out
    would refuse a metric that fits), over its modes."""
    from PIL import Image

    from headlab.plugin_manager import get_manager
    from headlab.scoring import build_examples, declared_fields

    def jsonl(name: str, rows: list[dict]) -> str:
        path = tmp_path / name
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        return str(path)

    Image.new("RGB", (8, 8), "white").save(tmp_path / "a.png")
    tqa = tmp_path / "TruthfulQA.csv"
    tqa.write_text("Type,Category,Question,Best Answer,Correct Answers,Incorrect Answers,Source\n"
                   "Adversarial,Misc,Where is Paris?,In France,In France; In Europe,In Italy,https://x.org\n")
    memo = tmp_path / "memo.csv"
    memo.write_text('prompt,classes,answer_index\n"Write a quote: a stitch in time saves","[\' nine.\', \' ten.\']",1\n')
    pair = {"clean": "red : blue , green : cat . red :", "corrupt": "red : blue , green : cat . green :",
            "answer": "blue", "wrong": "cat"}
    cases = [
        {"kind": "repeated_tokens", "n": 2, "length": 4},
        {"kind": "niah", "context_lengths": [64], "depths": [0.5]},
        {"kind": "kv_retrieval", "n": 2, "num_pairs": 4},
        {"kind": "counterfact", "n": 2}, {"kind": "counterfact", "n": 2, "closed_book": True},
        {"kind": "emphasis", "n": 2},
        {"kind": "jsonl", "path": jsonl("f.jsonl", [{"q": "a", "a": "b", "c": ["x", "y"], "l": 0, "s": [0, 1],
                                                     "img": "a.png", "m": 3}]),
         "prompt": "{{ q }}", "target": "{{ a }}", "choices": "c", "label": "l", "spans": {"x": "s"},
         "image": "img", "meta": ["m"]},
        {"kind": "csv", "path": str(tqa), "prompt": "{{ Question }}", "meta": ["Source"]},
        {"kind": "truthfulqa", "path": str(tqa), "mode": "generation"},
        {"kind": "truthfulqa", "path": str(tqa), "mode": "mc1"},
        {"kind": "nq_open", "path": jsonl("nq.jsonl", [{"question": "where is paris", "answer": ["France"]}])},
        {"kind": "nq_swap", "path": jsonl("swap.jsonl", [{"question": "where is paris", "org_context": "Paris is in "
                                                          "France.", "org_answer": "France", "sub_context": "Paris is "
                                                          "in Peru.", "sub_answer": "Peru"}])},
        {"kind": "memotrap", "path": str(memo)},
        {"kind": "xsum", "path": jsonl("x.jsonl", [{"document": "A cat sat.", "summary": "Cat.", "id": "1"}])},
        {"kind": "pairs", "path": jsonl("p.jsonl", [pair])},
        {"kind": "kv_swap", "n": 2}, {"kind": "repeated_pairs", "n": 2}, {"kind": "ioi_pairs", "n": 2},
        {"kind": "pope", "path": jsonl("pope.jsonl", [{"question_id": 1, "image": "a.png",
                                                       "text": "Is there a dog in the image?", "label": "yes"}])},
        *({"kind": "shapes", "n": 2, "question": q, "image_size": 32} for q in ("presence", "colour", "count",
                                                                                "caption")),
    ]
    assert {c["kind"] for c in cases} >= {k for k, c in get_manager().components["tasks"].items()
                                          if c.plugin.startswith("headlab.plugins")}  # a new task is added here
    lm = load_model(ModelSpec(id="headlab-tiny"))
    for case in cases:
        config = get_manager().get("tasks", case["kind"]).config(**case)
        examples = build_examples(config, lm, 0)
        declared = declared_fields(config)
        assert declared is not None, case
        assert observed(examples) <= declared, (case, observed(examples) - declared)
