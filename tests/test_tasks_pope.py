"""The ``pope`` task on a POPE file and images written here: prompts, images, meta, limits, errors."""

from __future__ import annotations

import json

import pytest
from PIL import Image
from pydantic import ValidationError

from headlab import TaskContext
from headlab.plugin_manager import get_manager
from headlab.plugins.tasks.files import TaskDataError
from headlab.plugins.tasks.pope import Pope, build_pope, question_object

CTX = TaskContext(tokenizer=None, seed=0, vocab_size=0)
LINES = [
    {"question_id": 1, "image": "COCO_val2014_000000016631.jpg", "text": "Is there a person in the image?",
     "label": "yes"},
    {"question_id": 2, "image": "COCO_val2014_000000016631.jpg", "text": "Is there an apple in the image?",
     "label": "no"},
    {"question_id": 3, "image": "COCO_val2014_000000000042.jpg", "text": "Is there a dining table in the image?",
     "label": "Yes"},
]


def write(folder, lines=LINES, name="coco_pope_adversarial.json", images=True):
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    if images:
        for r in lines:
            Image.new("RGB", (4, 4), (200, 0, 0)).save(folder / r["image"])
    return path


def test_examples_from_a_pope_file(tmp_path):
    path = write(tmp_path / "pope")
    examples = build_pope(Pope(path=str(path)), CTX)
    assert [e.prompt for e in examples] == [
        f"<image>\n{r['text']} Answer yes or no.\nAnswer:" for r in LINES]
    assert [e.target for e in examples] == [" yes", " no", " yes"]
    assert [e.images for e in examples] == [[tmp_path / "pope" / r["image"]] for r in LINES]
    assert examples[2].meta == {"label": "yes", "answers": ["yes"], "question_id": 3,
                                "image": "COCO_val2014_000000000042.jpg", "object": "dining table",
                                "setting": "adversarial"}
    assert [e.meta["object"] for e in examples] == ["person", "apple", "dining table"]


def test_image_dir_n_and_prompt(tmp_path):
    path = write(tmp_path / "questions", images=False)
    write(tmp_path / "coco", name="unused.jsonl")
    examples = build_pope(Pope(path=str(path), image_dir=str(tmp_path / "coco"), n=2,
                               prompt="USER: {{ question }} ({{ question_id }})"), CTX)
    assert [e.prompt for e in examples] == ["<image>\nUSER: Is there a person in the image? (1)",
                                            "<image>\nUSER: Is there an apple in the image? (2)"]
    assert examples[0].images == [tmp_path / "coco" / LINES[0]["image"]]
    assert examples[0].meta["setting"] == "adversarial"


def test_errors_name_the_path_and_the_fix(tmp_path):
    with pytest.raises(TaskDataError, match=r"pope task: file not found: 'nope.json'"):
        build_pope(Pope(path="nope.json"), CTX)
    path = write(tmp_path / "q", images=False)
    with pytest.raises(TaskDataError, match=r"row 1: image not found: '.*COCO_val2014_000000016631.jpg'; set "
                       r"`image_dir:` to the folder holding"):
        build_pope(Pope(path=str(path)), CTX)
    with pytest.raises(TaskDataError, match=r"image_dir 'nowhere' is not a folder"):
        build_pope(Pope(path=str(path), image_dir="nowhere"), CTX)
    (tmp_path / "empty").mkdir()
    with pytest.raises(TaskDataError, match=r"image not found: .*; check `image_dir: "):
        build_pope(Pope(path=str(path), image_dir=str(tmp_path / "empty")), CTX)
    bad = write(tmp_path / "b", [{**LINES[0], "label": "maybe"}])
    with pytest.raises(TaskDataError, match=r"row 1: label 'maybe' is not yes or no"):
        build_pope(Pope(path=str(bad)), CTX)
    missing = write(tmp_path / "m", [{k: v for k, v in LINES[0].items() if k != "text"}])
    with pytest.raises(TaskDataError, match=r"row 1: missing field 'text'"):
        build_pope(Pope(path=str(missing)), CTX)
    with pytest.raises(ValidationError, match="2 <image> markers"):
        Pope(path="x", prompt="<image> <image> {{ question }}")


def test_question_object_and_registration():
    assert question_object("Is there a traffic light in the image?") == "traffic light"
    assert question_object("is there an orange in the picture?") == "orange"
    assert question_object("What is this?") == ""
    assert get_manager().get("tasks", "pope").plugin == "headlab.plugins.tasks.pope"
    assert Pope(path="x", n=10).size().examples == 10 and Pope(path="x").size() is None
