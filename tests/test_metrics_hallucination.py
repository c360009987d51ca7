"""``pope`` and ``chair`` metrics against hand-computed values on fixture files; the ``aggregate=`` contract."""

from __future__ import annotations

import json
import math
import types

import numpy as np
import pytest
from PIL import Image

import headlab
from headlab import Example
from headlab.context import TaskContext
from headlab.errors import ContractError
from headlab.plugin_manager import PluginError, get_manager
from headlab.plugins.metrics.hallucination import (
    Chair,
    ObjectMatcher,
    PopeMetric,
    chair,
    chair_aggregate,
    default_synonyms,
    load_synonyms,
    pope,
    pope_aggregate,
    pope_answer,
)
from headlab.plugins.tasks.pope import Pope, build_pope
from headlab.scoring import metric_values

CTX = TaskContext(tokenizer=None, seed=0, vocab_size=0)

# label, output, parsed answer (by hand, POPE's rule)
POPE_CASES = [
    ("yes", " Yes, there is a person.", "yes"),
    ("yes", " No, there is not.", "no"),
    ("yes", "There is a dog in the image.", "yes"),
    ("no", " No.", "no"),
    ("no", " Yes.", "yes"),
    ("no", "I do not see one. Yes", "no"),
    ("no", "Not really.", "yes"),  # "Not" is not in the reference's word list
]


@pytest.fixture
def pope_file(tmp_path):
    """A POPE file of the seven questions and the images it names (drawn here)."""
    images = tmp_path / "val2014"
    images.mkdir()
    lines = []
    for i, (label, _, _) in enumerate(POPE_CASES):
        name = f"COCO_val2014_{i:012d}.jpg"
        Image.new("RGB", (8, 8), (i * 30, 0, 0)).save(images / name)
        obj = ["person", "dining table", "dog", "apple", "umbrella", "car", "oven"][i]
        art = "an" if obj[0] in "aeiou" else "a"
        lines.append({"question_id": i + 1, "image": name, "text": f"Is there {art} {obj} in the image?",
                      "label": label})
    path = tmp_path / "coco_pope_popular.json"
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    return path, images


def test_pope_answer_follows_the_reference_rule():
    for _, output, parsed in POPE_CASES:
        assert pope_answer(output) == parsed, output
    assert pope_answer(" Yes\nQuestion: is there no cat?") == "yes"
    assert pope_answer(" Yes\nQuestion: is there no cat?", first_line=False) == "no"
    assert pope_answer("") == "yes"


def test_pope_on_a_fixture_file_equals_hand_computed_values(pope_file):
    path, images = pope_file
    examples = build_pope(Pope(path=str(path), image_dir=str(images)), CTX)
    outputs = [o for _, o, _ in POPE_CASES]
    got = pope(PopeMetric(), examples, outputs)
    np.testing.assert_array_equal(got, [1, 0, 1, 1, 0, 1, 0])
    # TP 2 (1, 3), FN 1 (2), TN 2 (4, 6), FP 2 (5, 7)
    agg = pope_aggregate(PopeMetric(), examples, outputs, got)
    assert agg == pytest.approx({"accuracy": 4 / 7, "precision": 2 / 4, "recall": 2 / 3, "f1": 4 / 7,
                                 "yes_ratio": 4 / 7})
    stored = metric_values("pope", examples, outputs)
    assert list(stored) == ["pope", "pope_accuracy", "pope_precision", "pope_recall", "pope_f1", "pope_yes_ratio"]
    assert stored["pope"].dims == ("example",) and stored["pope_f1"].dims == ()
    assert float(stored["pope_recall"]) == pytest.approx(2 / 3)
    assert float(stored["pope"].mean()) == pytest.approx(float(stored["pope_accuracy"]))


def test_pope_degenerate_counts_and_labels():
    exs = [Example("q", meta={"label": "No"}), Example("q", target=" no")]
    agg = pope_aggregate(PopeMetric(), exs, [" no", " no"], np.ones(2))
    assert agg["accuracy"] == 1 and agg["yes_ratio"] == 0
    assert math.isnan(agg["precision"]) and math.isnan(agg["recall"]) and math.isnan(agg["f1"])
    with pytest.raises(ValueError, match="metric pope: example 0 has no yes/no answer"):
        pope(PopeMetric(), [Example("q", target=" maybe")], [" yes"])


# caption, ground-truth objects, (mentions, hallucinated) by hand, and with unique: true
CAPTIONS = [
    ("A red circle and a blue box.", ["red circle", "blue square"], (2, 0), (2, 0)),
    ("A green star next to a yellow triangle and two grey dots.", ["green star"], (3, 2), (3, 2)),
    ("Purple cross, purple plus, red star.", ["purple cross"], (3, 1), (2, 1)),
    ("Nothing here but a circle.", ["red circle"], (0, 0), (0, 0)),
]


def test_chair_on_captions_with_known_hallucinations():
    examples = [Example("<image>\nDescribe the image.", meta={"objects": objs}) for _, objs, _, _ in CAPTIONS]
    outputs = [c for c, _, _, _ in CAPTIONS]
    np.testing.assert_array_equal(chair(Chair(), examples, outputs), [0, 1, 1, 0])
    assert chair_aggregate(Chair(), examples, outputs, np.zeros(4)) == pytest.approx(
        {"s": 2 / 4, "i": 3 / 8, "mentions": 8 / 4})
    assert chair_aggregate(Chair(unique=True), examples, outputs, np.zeros(4)) == pytest.approx(
        {"s": 2 / 4, "i": 3 / 7, "mentions": 7 / 4})
    stored = metric_values({"kind": "chair"}, examples, outputs)
    assert list(stored) == ["chair", "chair_s", "chair_i", "chair_mentions"]
    assert float(stored["chair"].mean()) == float(stored["chair_s"]) == 0.5


def test_chair_ground_truth_as_a_string_and_missing():
    exs = [Example("p", meta={"objects": "red circle, blue square"}), Example("p", meta={"objects": '["red star"]'})]
    np.testing.assert_array_equal(chair(Chair(), exs, ["a blue square", "a red star and a red circle"]), [0, 1])
    with pytest.raises(ValueError, match=r"example 0 has no meta\['objects'\]"):
        chair(Chair(), [Example("p")], ["a red star"])


SYNONYMS = {"dog": ["puppy", "hound"], "hot dog": ["hotdog"], "dining table": ["table"]}


@pytest.mark.parametrize("form", ["mapping", "json", "yaml", "txt"])
def test_chair_with_a_synonym_list(form, tmp_path):
    if form == "mapping":
        value = SYNONYMS
    elif form == "json":
        value = tmp_path / "syn.json"
        value.write_text(json.dumps(SYNONYMS))
    elif form == "yaml":
        value = tmp_path / "syn.yaml"
        value.write_text("".join(f"{k}: [{', '.join(v)}]\n" for k, v in SYNONYMS.items()))
    else:
        value = tmp_path / "synonyms.txt"
        value.write_text("".join(", ".join([k, *v]) + "\n" for k, v in SYNONYMS.items()))
    config = Chair(synonyms=value if form == "mapping" else str(value))
    # "hot dog" is one mention (longest phrase first), "table" is the dining table, "puppy" a dog
    exs = [Example("p", meta={"objects": ["dining table"]}), Example("p", meta={"objects": ["Dog", "Table"]})]
    outs = ["A hot dog on the table next to a puppy.", "A hound at the dining table."]
    np.testing.assert_array_equal(chair(config, exs, outs), [1, 0])
    assert chair_aggregate(config, exs, outs, np.zeros(2)) == pytest.approx({"s": 0.5, "i": 2 / 5, "mentions": 2.5})


def test_synonym_errors(tmp_path):
    with pytest.raises(ValueError, match="synonym of both 'a' and 'b'"):
        ObjectMatcher({"a": ["thing"], "b": ["thing"]})
    with pytest.raises(ValueError, match="synonyms file not found: 'nope.json'"):
        load_synonyms("nope.json")
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]")
    with pytest.raises(ValueError, match="must map each category"):
        load_synonyms(str(bad))


def test_default_synonyms_cover_the_shapes_vocabulary():
    syn = default_synonyms()
    assert len(syn) == 10 * 5
    matcher = ObjectMatcher(syn)
    assert matcher.mentions("Grey DISKS, an orange plus and a blue boxes; a square.") == \
        ["gray circle", "orange cross", "blue square"]


def _plugin(aggregate, category="metrics"):
    from typing import Literal

    class Cfg(headlab.ComponentConfig):
        kind: Literal["agg_probe"] = "agg_probe"

    def compute(config, examples, outputs):
        return np.array([len(o) for o in outputs], dtype=float)

    hook = "headlab_register_metrics" if category == "metrics" else "headlab_register_tasks"

    @headlab.hookimpl(specname=hook)
    def register_it(register):
        register(Cfg, compute, aggregate=aggregate)

    return types.SimpleNamespace(register_it=register_it)


def test_aggregate_contract():
    name = headlab.register_plugin(_plugin(lambda c, e, o, v: {"total": float(v.sum()), "n": len(v)}),
                                   name="agg-ok", replace=True)
    try:
        out = metric_values("agg_probe", [Example("a"), Example("b")], ["xy", "xyz"])
        assert float(out["agg_probe_total"]) == 5 and float(out["agg_probe_n"]) == 2
        assert get_manager().get("metrics", "agg_probe").aggregate is not None
    finally:
        headlab.unregister_plugin(name)
    for bad, message in ((lambda c, e, o, v: [1.0], "not a mapping"), (lambda c, e, o, v: {"a b": 1}, "identifier"),
                         (lambda c, e, o, v: {"x": "many"}, "not a number")):
        name = headlab.register_plugin(_plugin(bad), name="agg-bad", replace=True)
        try:
            with pytest.raises(ContractError, match=message):
                metric_values("agg_probe", [Example("a")], ["xy"])
        finally:
            headlab.unregister_plugin(name)
    assert get_manager().get("metrics", "any_answer").aggregate is None  # metrics without one are as before


def test_only_metrics_take_aggregate():
    with pytest.raises(PluginError, match="task 'agg_probe': only metrics take a callable aggregate="):
        headlab.register_plugin(_plugin(lambda *a: {}, category="tasks"), name="agg-task", replace=True)
    with pytest.raises(PluginError):
        get_manager().get("tasks", "agg_probe")
