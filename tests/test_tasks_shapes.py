"""The ``shapes`` task: determinism, what is drawn, yes/no balance, POPE's negatives per setting, the other
questions, config errors."""

from __future__ import annotations

from collections import Counter

import pytest
from pydantic import ValidationError

from headlab import TaskContext, load_spec
from headlab.context import IMAGE_MARKER
from headlab.plugin_manager import get_manager
from headlab.plugins.tasks.generators import tokenize_words, vocabulary
from headlab.plugins.tasks.shapes import COLOURS, Shapes, build_shapes

CTX = TaskContext(tokenizer=None, seed=0, vocab_size=0)


def build(**kw):
    return build_shapes(Shapes(**kw), CTX)


def images_of(examples):
    """image index -> its objects, from the examples' meta."""
    return {ex.meta["image"]: ex.meta["objects"] for ex in examples}


def test_same_seed_same_images_and_questions_other_seed_others():
    a, b = build(n=4, per_image=2), build(n=4, per_image=2)
    assert [(e.prompt, e.target, e.meta) for e in a] == [(e.prompt, e.target, e.meta) for e in b]
    assert all(x.images[0].tobytes() == y.images[0].tobytes() for x, y in zip(a, b, strict=True))
    c = build_shapes(Shapes(n=4, per_image=2), TaskContext(tokenizer=None, seed=1, vocab_size=0))
    d = build(n=4, per_image=2, seed=1)
    assert [e.meta for e in c] == [e.meta for e in d]  # the config's seed is added to the run seed
    assert [e.meta["objects"] for e in c] != [e.meta["objects"] for e in a]


def test_the_image_shows_exactly_the_objects_colours():
    for ex in build(n=6, question="caption", objects=(1, 9), colours=[c for c in COLOURS if c not in ("white", "black")]):
        image = ex.images[0]
        assert image.size == (224, 224) and image.mode == "RGB"
        drawn = {rgb for _, rgb in image.getcolors(maxcolors=1 << 16)} - {COLOURS["white"]}
        assert drawn == {COLOURS[o.split()[0]] for o in ex.meta["objects"]}
        assert ex.prompt.count(IMAGE_MARKER) == 1 and ex.target is None
        assert ex.meta["scene"] == ", ".join(ex.meta["objects"])


def test_presence_is_balanced_and_true():
    examples = build(n=10, per_image=2, objects=(2, 5))
    assert len(examples) == 40
    assert Counter(e.meta["label"] for e in examples) == {"yes": 20, "no": 20}
    assert [e.meta["label"] for e in examples] == ["yes", "no"] * 20
    for ex in examples:
        obj = ex.meta["object"]
        art = "an" if obj[0] in "aeiou" else "a"
        assert ex.prompt == f"<image>\nQuestion: Is there {art} {obj} in the image?\nAnswer:"
        assert ex.target == f" {ex.meta['label']}" and ex.meta["answers"] == [ex.meta["label"]]
        assert (obj in ex.meta["objects"]) == (ex.meta["label"] == "yes")
    for i in range(10):  # per image: distinct questions
        objs = [e.meta["object"] for e in examples if e.meta["image"] == i]
        assert len(set(objs)) == 4


def universe(config: Shapes) -> list[str]:
    return sorted(f"{c} {s}" for c in config.colours for s in config.shapes)


@pytest.mark.parametrize("setting", ["popular", "adversarial"])
def test_negatives_follow_popes_setting(setting):
    config = Shapes(n=12, per_image=2, objects=(2, 4), negatives=setting, colours=["red", "blue", "green"])
    examples = build_shapes(config, CTX)
    images = images_of(examples)
    # independent: how many images hold each object, and each pair of objects
    freq = {o: sum(o in objs for objs in images.values()) for o in universe(config)}
    both = {(a, b): sum(a in objs and b in objs for objs in images.values())
            for a in universe(config) for b in universe(config)}
    for i, objs in images.items():
        absent = [o for o in universe(config) if o not in objs]
        if setting == "popular":
            expected = sorted(absent, key=lambda o: (-freq[o], o))[:2]
        else:
            score = {o: sum(both[(p, o)] for p in objs) for o in absent}
            expected = sorted(absent, key=lambda o: (-score[o], -freq[o], o))[:2]
        got = [e.meta["object"] for e in examples if e.meta["image"] == i and e.meta["label"] == "no"]
        assert got == expected, (i, objs)
        assert all(e.meta["setting"] == setting for e in examples)


def test_random_negatives_are_absent_and_vary():
    examples = build(n=30, negatives="random")
    negatives = [e for e in examples if e.meta["label"] == "no"]
    assert all(e.meta["object"] not in e.meta["objects"] for e in negatives)
    assert len({e.meta["object"] for e in negatives}) > 5


def test_colour_and_count_questions():
    for ex in build(n=10, question="colour", per_image=2, objects=(3, 6)):
        shape = ex.meta["object"]
        holding = [o for o in ex.meta["objects"] if o.split()[1] == shape]
        assert holding == [f"{ex.meta['label']} {shape}"]  # the shape occurs once, in that colour
        assert ex.prompt == f"<image>\nQuestion: What colour is the {shape}?\nAnswer:"
        assert ex.target == f" {ex.meta['label']}"
    words = ["zero", "one", "two", "three", "four", "five", "six"]
    for ex in build(n=10, question="count", objects=(3, 6), shapes=["circle", "cross"]):
        shape = ex.meta["object"]
        count = sum(o.split()[1] == shape for o in ex.meta["objects"])
        assert count >= 1 and ex.meta["count"] == count
        assert ex.target == f" {words[count]}" and ex.meta["answers"] == [words[count], str(count)]
        plural = {"circle": "circles", "cross": "crosses"}[shape]
        assert ex.prompt == f"<image>\nQuestion: How many {plural} are there?\nAnswer:"


def test_prompt_template_and_marker():
    ex = build(n=1, prompt="Q: {{ question }} A:")[0]
    assert ex.prompt.startswith("<image>\nQ: Is there")
    ex = build(n=1, prompt="Look: <image> {{ question }}")[0]
    assert ex.prompt.startswith("Look: <image> Is there")
    with pytest.raises(ValidationError, match="2 <image> markers"):
        Shapes(prompt="<image><image> {{ question }}")
    with pytest.raises(ValidationError, match="single-brace|single braces|{{ question }}"):
        Shapes(prompt="<image> {question}")


def test_config_errors():
    with pytest.raises(ValidationError, match="background"):
        Shapes(background="red")
    with pytest.raises(ValidationError, match="lo <= hi"):
        Shapes(objects=(4, 2))
    with pytest.raises(ValidationError, match="less than or equal to 9"):
        Shapes(objects=(1, 10))
    with pytest.raises(ValidationError, match="per_image=3 yes questions need"):
        Shapes(per_image=3, objects=(2, 4))
    with pytest.raises(ValidationError, match="absent objects"):
        Shapes(shapes=["star"], colours=["red", "blue"], objects=(1, 2))
    assert Shapes(shapes=["star", "star"]).shapes == ["star"]


def test_size_and_registration():
    assert Shapes(n=5, per_image=2).size().examples == 20
    assert Shapes(n=5, question="caption", per_image=1).size().examples == 5
    assert get_manager().get("tasks", "shapes").plugin == "headlab.plugins.tasks.shapes"
    spec = load_spec({"name": "s", "task": {"kind": "shapes", "n": 2, "question": "count"},
                      "steps": [{"id": "g", "generate": {"metrics": ["any_answer"]}}]}).spec
    assert spec.task.question == "count"


def test_words_out_of_the_embedded_vocabulary_are_the_documented_ones():
    from headlab.plugins.tasks import shapes

    vocab = set(vocabulary())
    words = set()
    for q in ("presence", "colour", "count", "caption"):
        for ex in build(n=20, question=q, colours=[c for c in COLOURS if c not in ("white", "black")], objects=(3, 9)):
            words |= set(tokenize_words(ex.prompt.replace("<image>", "") + (ex.target or "")))
    missing = sorted(words - vocab)
    doc = shapes.__doc__
    for w in missing:
        plural_or_number = w.endswith("s") or w in ("four", "five", "six", "seven", "eight", "nine")
        assert f"``{w}``" in doc or plural_or_number, f"{w!r} is out of the vocabulary and not documented"
    assert "circle" in missing and "square" not in missing
