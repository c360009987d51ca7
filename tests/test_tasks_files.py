"""``jsonl`` / ``csv`` tasks: templates, lint, row errors, choices, labels, spans, selection."""

from __future__ import annotations

import csv
import json
import random
import sys
import types

import pytest
from pydantic import ValidationError

from headlab import SpecError, TaskContext, load_spec
from headlab.plugins.tasks.files import (
    CsvTask,
    JsonlTask,
    TaskDataError,
    build_file_task,
    lint_template,
    strip_tags,
)

CTX = TaskContext(tokenizer=None, seed=0, vocab_size=0)


def write_jsonl(path, rows, blank_after=None):
    lines = []
    for i, r in enumerate(rows):
        lines.append(json.dumps(r))
        if blank_after is not None and i == blank_after:
            lines.append("")
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def write_csv(path, header, rows, delimiter=","):
    with open(path, "w", newline="") as f:
        w = csv.writer(f, delimiter=delimiter)
        w.writerow(header)
        w.writerows(rows)
    return str(path)


QA = [{"question": "What is 2+2?", "answer": "4", "id": 7}, {"question": "Capital of Peru?", "answer": "Lima", "id": 8}]


def test_jsonl_prompt_and_target(tmp_path):
    path = write_jsonl(tmp_path / "qa.jsonl", QA)
    examples = build_file_task(JsonlTask(path=path, prompt="Q: {{ question }}\nA:", target="{{ answer }}",
                                         meta=["id"]), CTX)
    assert [ex.prompt for ex in examples] == ["Q: What is 2+2?\nA:", "Q: Capital of Peru?\nA:"]
    assert [ex.target for ex in examples] == [" 4", " Lima"]
    assert [ex.meta for ex in examples] == [{"row": 1, "id": 7}, {"row": 2, "id": 8}]
    assert all(ex.choices is None and ex.label is None and ex.spans == {} for ex in examples)
    raw = build_file_task(JsonlTask(path=path, prompt="{{ question }}", target="{{ answer }}",
                                    target_delimiter=""), CTX)
    assert raw[1].target == "Lima"


def test_single_brace_template_is_refused_with_the_fix(tmp_path):
    with pytest.raises(ValidationError) as err:
        JsonlTask(path="x.jsonl", prompt="Q: {question}\nA:")
    msg = str(err.value)
    assert "template `prompt`" in msg and "{question}" in msg and "{{ question }}" in msg
    with pytest.raises(ValueError, match=r"template `target` .*write double braces: '\{\{ answer \}\}'"):
        lint_template("{answer}", "target")
    spec = ("name: t\ntask:\n  kind: csv\n  path: x.csv\n  prompt: \"{{ q }}\"\n  target: \"{a}\"\n"
            "steps:\n  - id: g\n    generate: {}\n")
    with pytest.raises(SpecError) as located:
        load_spec(spec)
    assert str(located.value).startswith("<spec>:6:")
    assert "task.target" in str(located.value) and "{{ a }}" in str(located.value)
    # literal braces beside real Jinja are fine unless they name a field of the data
    lint_template('{{ question }} answer in JSON like {"a": 1}', "prompt")
    path = write_jsonl(tmp_path / "qa.jsonl", QA)
    with pytest.raises(TaskDataError, match=r"single-brace \{answer\}.*\{\{ answer \}\}"):
        build_file_task(JsonlTask(path=path, prompt="{{ question }} ({answer})"), CTX)


def test_jinja_syntax_error_is_named():
    with pytest.raises(ValidationError, match="template `prompt`.*syntax error"):
        JsonlTask(path="x.jsonl", prompt="{{ question ")


def test_missing_variable_names_row_line_and_variable(tmp_path):
    rows = [QA[0], {"question": "no answer here"}]
    path = write_jsonl(tmp_path / "qa.jsonl", rows, blank_after=0)
    with pytest.raises(TaskDataError) as err:
        build_file_task(JsonlTask(path=path, prompt="{{ question }}", target="{{ answer }}"), CTX)
    assert str(err.value) == ("jsonl task: qa.jsonl row 2 (line 3): template `target` uses variable "
                              "'answer', which this row does not have (fields: question)")
    csv_path = write_csv(tmp_path / "qa.csv", ["q", "a"], [["x", "1"]])
    with pytest.raises(TaskDataError, match=r"qa.csv row 1 \(line 2\): template `prompt` uses variable "
                                            r"'question'.*\(fields: q, a\)"):
        build_file_task(CsvTask(path=csv_path, prompt="{{ question }}"), CTX)
    nested = write_jsonl(tmp_path / "n.jsonl", [{"doc": {"title": "T"}}])
    with pytest.raises(TaskDataError, match="n.jsonl row 1: template `prompt`: .*body"):
        build_file_task(JsonlTask(path=nested, prompt="{{ doc.body }}"), CTX)


def test_bad_path_and_bad_json(tmp_path):
    with pytest.raises(TaskDataError, match=r"jsonl task: file not found: '.*missing.jsonl'"):
        build_file_task(JsonlTask(path=str(tmp_path / "missing.jsonl"), prompt="{{ q }}"), CTX)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"q": 1}\n{"q": \n')
    with pytest.raises(TaskDataError, match="bad.jsonl line 2: invalid JSON"):
        build_file_task(JsonlTask(path=str(bad), prompt="{{ q }}"), CTX)
    with pytest.raises(ValidationError, match="exactly one of `path`"):
        JsonlTask(prompt="{{ q }}")


def test_templates_are_sandboxed(tmp_path):
    path = write_jsonl(tmp_path / "qa.jsonl", QA)
    with pytest.raises(ValidationError, match="names starting with '_' are not allowed"):
        JsonlTask(path=path, prompt="{{ question.__class__.__mro__ }}")
    with pytest.raises(TaskDataError, match="unsafe"):  # a name built at render time: the sandbox refuses it
        build_file_task(JsonlTask(path=path, prompt="{% set n = '__cl' ~ 'ass__' %}{{ question[n] }}"), CTX)


def test_csv_choices_field_and_labels_in_every_form(tmp_path):
    path = write_csv(tmp_path / "mc.csv", ["question", "options", "gold"], [
        ["Sky?", json.dumps(["blue", "green", "red"]), "0"],
        ["Grass?", json.dumps(["blue", "green", "red"]), "green"],
        ["Blood?", "['blue', 'green', 'red']", "C"],
    ])
    examples = build_file_task(CsvTask(path=path, prompt="{{ question }}", choices="options", label="gold"), CTX)
    assert examples[0].choices == [" blue", " green", " red"]
    assert [ex.label for ex in examples] == [0, 1, 2]
    assert [ex.target for ex in examples] == [" blue", " green", " red"]
    bad = write_csv(tmp_path / "bad.csv", ["question", "options", "gold"], [["Sky?", '["a", "b"]', "purple"]])
    with pytest.raises(TaskDataError, match=r"bad.csv row 1 \(line 2\): label 'purple' is not a choice"):
        build_file_task(CsvTask(path=bad, prompt="{{ question }}", choices="options", label="gold"), CTX)
    with pytest.raises(ValidationError, match="`label` needs `choices`"):
        CsvTask(path=path, prompt="{{ question }}", label="gold")


def test_choice_templates_list_and_list_literal(tmp_path):
    rows = [{"q": "Pick", "a": "x", "b": "y", "answer": 1, "opts": ["p", "q"]}]
    path = write_jsonl(tmp_path / "c.jsonl", rows)
    per_choice = build_file_task(JsonlTask(path=path, prompt="{{ q }}", choices=["{{ a }}", "{{ b }}!"],
                                           label="answer"), CTX)[0]
    assert per_choice.choices == [" x", " y!"] and per_choice.label == 1 and per_choice.target == " y!"
    literal = build_file_task(JsonlTask(path=path, prompt="{{ q }}", choices="{{ opts }}", label="answer",
                                        target="{{ b }}"), CTX)[0]
    assert literal.choices == [" p", " q"] and literal.target == " y"


def test_tsv_delimiter(tmp_path):
    path = write_csv(tmp_path / "d.tsv", ["q", "a"], [["one, two", "3"]], delimiter="\t")
    (ex,) = build_file_task(CsvTask(path=path, prompt="{{ q }}", target="{{ a }}", delimiter="\t"), CTX)
    assert ex.prompt == "one, two" and ex.target == " 3"


def test_span_tags_and_span_fields(tmp_path):
    rows = [{"fact": "Mia lives in Oslo.", "q": "Where?", "hl": [0, 3]}]
    path = write_jsonl(tmp_path / "s.jsonl", rows)
    (ex,) = build_file_task(JsonlTask(path=path, prompt="Note. <em>{{ fact }}</em> {{ q }}",
                                      span_tags={"emphasis": "em"}, spans={"name": "hl"}), CTX)
    assert ex.prompt == "Note. Mia lives in Oslo. Where?"
    assert ex.spans == {"emphasis": [(6, 24)], "name": [(0, 3)]}
    assert ex.prompt[6:24] == "Mia lives in Oslo."
    bad = write_jsonl(tmp_path / "b.jsonl", [{"q": "short", "hl": [2, 99]}])
    with pytest.raises(TaskDataError, match=r"span 'x' \[2, 99\) is outside the prompt \(length 5\)"):
        build_file_task(JsonlTask(path=bad, prompt="{{ q }}", spans={"x": "hl"}), CTX)


def test_strip_tags():
    text, spans = strip_tags("a <em>b</em> c <ctx>d e</ctx> <em>f</em>", {"emphasis": "em", "context": "ctx"})
    assert text == "a b c d e f"
    assert spans == {"emphasis": [(2, 3), (10, 11)], "context": [(6, 9)]}
    with pytest.raises(TaskDataError, match="never closed"):
        strip_tags("<em>a", {"e": "em"})
    with pytest.raises(TaskDataError, match="without <em>"):
        strip_tags("a</em>", {"e": "em"})
    with pytest.raises(TaskDataError, match="nested"):
        strip_tags("<em><em>a</em></em>", {"e": "em"})


def test_n_and_seeded_shuffle(tmp_path):
    rows = [{"q": f"q{i}"} for i in range(10)]
    path = write_jsonl(tmp_path / "many.jsonl", rows)
    first = build_file_task(JsonlTask(path=path, prompt="{{ q }}", n=3), CTX)
    assert [ex.prompt for ex in first] == ["q0", "q1", "q2"]
    order = list(range(10))
    random.Random(5 + 2).shuffle(order)
    shuffled = build_file_task(JsonlTask(path=path, prompt="{{ q }}", n=4, shuffle=True, seed=2),
                               TaskContext(tokenizer=None, seed=5, vocab_size=0))
    assert [ex.prompt for ex in shuffled] == [f"q{i}" for i in order[:4]]
    assert [ex.meta["row"] for ex in shuffled] == [i + 1 for i in order[:4]]


def test_json_array_file(tmp_path):
    path = tmp_path / "arr.json"
    path.write_text(json.dumps(QA))
    examples = build_file_task(JsonlTask(path=str(path), prompt="{{ question }}"), CTX)
    assert [ex.prompt for ex in examples] == ["What is 2+2?", "Capital of Peru?"]


def test_hf_dataset_needs_datasets(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # import fails as if not installed
    with pytest.raises(TaskDataError, match=r"hf_dataset needs the `datasets` package \(pip install datasets\)"):
        build_file_task(JsonlTask(hf_dataset="some/dataset", prompt="{{ q }}"), CTX)


def test_hf_dataset_through_datasets(monkeypatch):
    calls = []

    def load_dataset(name, config, split):
        calls.append((name, config, split))
        return [{"q": "from hub", "a": "yes"}]

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    (ex,) = build_file_task(JsonlTask(hf_dataset="org/data", hf_config="c", split="test", prompt="{{ q }}",
                                      target="{{ a }}"), CTX)
    assert calls == [("org/data", "c", "test")]
    assert (ex.prompt, ex.target) == ("from hub", " yes")


# --- registration, spec validation and docs ---------------------------------------------------------

MY_TASKS = ("niah", "kv_retrieval", "counterfact", "emphasis", "jsonl", "csv", "truthfulqa", "nq_open",
            "nq_swap", "memotrap", "xsum", "shapes", "pope")
MY_METRICS = ("needle_recall", "rouge_l", "context_memory", "any_answer", "pope", "chair")


def test_kinds_are_registered_and_documented():
    from pathlib import Path

    from headlab.plugin_manager import get_manager

    mgr = get_manager()
    docs = (Path(__file__).parent.parent / "docs" / "tasks.md").read_text()
    for kind in MY_TASKS:
        assert mgr.get("tasks", kind).plugin.startswith("headlab.plugins.tasks.")
        assert f"kind: {kind}" in docs, f"docs/tasks.md has no spec example for task kind {kind}"
    for kind in MY_METRICS:
        assert mgr.get("metrics", kind).plugin.startswith("headlab.plugins.metrics.")
        assert f"`{kind}`" in docs, f"docs/tasks.md does not document metric kind {kind}"


def test_a_spec_builds_examples_through_the_plugin(tmp_path):
    from headlab.plugin_manager import get_manager

    path = write_jsonl(tmp_path / "qa.jsonl", QA)
    spec = load_spec(
        "name: t\n"
        f"task: {{kind: jsonl, path: {json.dumps(path)}, prompt: \"Q: {{{{ question }}}}\\nA:\", "
        "target: \"{{ answer }}\", n: 1}\n"
        "steps:\n  - id: g\n    generate:\n"
        "      metrics: [needle_recall, {kind: context_memory, match: contains}, any_answer, "
        "{kind: rouge_l, score: recall}]\n").spec
    examples = get_manager().get("tasks", spec.task.kind).impl(spec.task, CTX)
    assert [(ex.prompt, ex.target) for ex in examples] == [("Q: What is 2+2?\nA:", " 4")]
    assert [m.kind for m in spec.steps[0].generate.metrics] == ["needle_recall", "context_memory", "any_answer",
                                                                "rouge_l"]


def test_every_spec_example_in_the_docs_validates():
    import re
    import textwrap
    from pathlib import Path

    docs = (Path(__file__).parent.parent / "docs" / "tasks.md").read_text()
    blocks = re.findall(r"```yaml\n(.*?)```", docs, flags=re.S)
    steps = "steps:\n  - id: g\n    generate: {}\n"
    checked = 0
    for block in blocks:
        if block.startswith("task:\n"):
            texts = [block + steps]
        elif block.startswith("generate:"):
            texts = ["task: {kind: niah}\nsteps:\n  - id: g\n" + textwrap.indent(block, "    ")]
        else:
            texts = [line + "\n" + steps for line in block.splitlines() if line.startswith("task: {")]
        for text in texts:
            load_spec("name: doc\n" + text)
            checked += 1
    assert checked >= 12


# --- images ---------------------------------------------------------------------------------------

def draw(path, colour=(255, 0, 0)):
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (4, 4), colour).save(path)
    return path


def test_image_field_relative_to_the_data_file_and_marker(tmp_path):
    data = tmp_path / "data"
    draw(data / "img" / "a.png")
    draw(tmp_path / "abs.png")
    rows = [{"q": "What is shown?", "img": "img/a.png", "a": "red"},
            {"q": "And here?", "img": str(tmp_path / "abs.png"), "a": "red"}]
    path = write_jsonl(data / "vqa.jsonl", rows)
    exs = build_file_task(JsonlTask(path=path, prompt="USER: <image>\n{{ q }} ASSISTANT:", target="{{ a }}",
                                    image="img"), CTX)
    assert [e.prompt for e in exs] == ["USER: <image>\nWhat is shown? ASSISTANT:", "USER: <image>\nAnd here? ASSISTANT:"]
    assert [e.images for e in exs] == [[data / "img" / "a.png"], [tmp_path / "abs.png"]]
    assert build_file_task(JsonlTask(path=path, prompt="{{ q }}"), CTX)[0].images == []  # no image: option


def test_image_without_marker_is_put_in_front_and_spans_shift(tmp_path):
    draw(tmp_path / "pics" / "a.png")
    path = write_csv(tmp_path / "t.csv", ["q", "file", "span"], [["say cat", "a.png", "[4, 7]"]])
    task = CsvTask(path=path, prompt="{{ q }}", image="file", image_dir=str(tmp_path / "pics"),
                   spans={"word": "span"}, span_tags={"em": "em"})
    ex = build_file_task(task, CTX)[0]
    assert ex.prompt == "<image>\nsay cat" and ex.images == [tmp_path / "pics" / "a.png"]
    s, e = ex.spans["word"][0]
    assert ex.prompt[s:e] == "cat"
    tagged = build_file_task(task.model_copy(update={"prompt": "{{ q }} <em>now</em>"}), CTX)[0]
    s, e = tagged.spans["em"][0]
    assert tagged.prompt[s:e] == "now"


def test_a_list_of_images_needs_one_marker_each(tmp_path):
    draw(tmp_path / "a.png")
    draw(tmp_path / "b.png")
    path = write_jsonl(tmp_path / "two.jsonl", [{"imgs": ["a.png", "b.png"], "q": "same?"}])
    ex = build_file_task(JsonlTask(path=path, prompt="<image> vs <image>: {{ q }}", image="imgs"), CTX)[0]
    assert ex.images == [tmp_path / "a.png", tmp_path / "b.png"]
    assert build_file_task(JsonlTask(path=path, prompt="{{ q }}", image="imgs"), CTX)[0].prompt == \
        "<image>\n<image>\nsame?"
    with pytest.raises(TaskDataError, match=r"two.jsonl row 1: the prompt has 1 <image> markers for 2 image"):
        build_file_task(JsonlTask(path=path, prompt="<image> {{ q }}", image="imgs"), CTX)


def test_image_errors_name_the_row_and_path(tmp_path):
    path = write_jsonl(tmp_path / "v.jsonl", [{"q": "x", "img": "gone.png"}])
    with pytest.raises(TaskDataError, match=r"jsonl task: v.jsonl row 1: image not found: '.*gone.png'; set "
                       r"`image_dir:` to the folder holding the images"):
        build_file_task(JsonlTask(path=path, prompt="{{ q }}", image="img"), CTX)
    with pytest.raises(TaskDataError, match=r"image field 'picture' is missing"):
        build_file_task(JsonlTask(path=path, prompt="{{ q }}", image="picture"), CTX)
    url = write_jsonl(tmp_path / "u.jsonl", [{"q": "x", "img": "https://example.org/a.png"}])
    with pytest.raises(TaskDataError, match=r"is a URL; images must be local files"):
        build_file_task(JsonlTask(path=url, prompt="{{ q }}", image="img"), CTX)
    with pytest.raises(ValidationError, match="`image_dir` needs `image`"):
        JsonlTask(path=path, prompt="{{ q }}", image_dir="x")
