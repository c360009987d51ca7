"""The ``pope`` task: the published POPE question files (Li et al. 2023), read from local files.

A POPE file is JSON Lines, one question a line::

    {"question_id": 1, "image": "COCO_val2014_000000016631.jpg", "text": "Is there a person in the image?", "label": "yes"}

::

    task:
      kind: pope
      path: data/pope/coco_pope_adversarial.json
      image_dir: data/coco/val2014        # default: the file's folder
      n: 300

Each line is an example: the prompt template ``prompt`` (Jinja2; ``{{ question }}`` is the line's
``text``, and every field of the line is available too) with the ``<image>`` marker
(:data:`headlab.context.IMAGE_MARKER`; a template without one gets ``"<image>\\n"`` in front), the image
file (``image``, relative to ``image_dir``) and the target ``" yes"`` or ``" no"``. ``meta``: ``label``
(``yes``/``no``), ``answers`` (``[label]``), ``question_id``, ``image`` (the file name), ``object`` (parsed
from "Is there a/an <object> in the image?"; empty when the question has another form) and ``setting``
(``random``, ``popular`` or ``adversarial`` when the file's name says which, else empty). Score with
the ``pope`` metric. Images are checked to exist when the examples are built (opened only by the model's
processor).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator

from headlab import IMAGE_MARKER
from headlab.plugin import ComponentConfig, Example, PositiveInt, TaskContext, hookimpl
from headlab.resources import TaskSize

from .files import Row, TaskDataError, Template, check_data_file, read_rows, resolve_image
from .shapes import IMAGE_TOKENS, with_marker

__all__ = ["Pope", "build_pope", "question_object"]

DEFAULT_PROMPT = "<image>\n{{ question }} Answer yes or no.\nAnswer:"
_QUESTION = re.compile(r"^\s*is there (?:a|an|any) (.+?) in the (?:image|picture|photo)\s*\?", re.IGNORECASE)


def question_object(question: str) -> str:
    """The object of a POPE question ("Is there a dining table in the image?" -> "dining table"), or ""."""
    m = _QUESTION.match(question)
    return m.group(1).strip() if m else ""


class Pope(ComponentConfig):
    """POPE yes/no object questions from a local POPE file (JSON Lines) and its images."""

    kind: Literal["pope"] = "pope"
    path: str = Field(description="the POPE file (JSON Lines: question_id, image, text, label)")
    image_dir: str | None = Field(None, description="folder holding the images (default: the file's folder)")
    n: PositiveInt | None = Field(None, description="use only the first n questions (all when unset)")
    prompt: str = Field(DEFAULT_PROMPT, description="Jinja2 template with {{ question }} and the <image> marker "
                        "(added in front when missing)")

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v: str) -> str:
        if v.count(IMAGE_MARKER) > 1:
            raise ValueError(f"the prompt has {v.count(IMAGE_MARKER)} {IMAGE_MARKER} markers; a POPE question has "
                             "one image")
        Template(v, "prompt", "pope")  # lints: Jinja2 syntax, single braces
        return v

    def preflight(self) -> None:
        """Before a run's store is created: a POPE file over the data-file limit is refused by its size."""
        check_data_file(self.path, "pope", key="path")

    def example_fields(self) -> frozenset[str]:
        """The yes/no label, the image and the question's object (for ``requires()`` checks)."""
        return frozenset({"target", "images", "meta.label", "meta.answers", "meta.question_id", "meta.image",
                          "meta.object", "meta.setting"})

    def size(self) -> TaskSize | None:
        """``n`` questions of one image (:data:`headlab.plugins.tasks.shapes.IMAGE_TOKENS`) and a question each;
        unknown without ``n``."""
        return TaskSize(self.n, IMAGE_TOKENS + 64 + len(self.prompt)) if self.n is not None else None


def _field(row: Row, name: str) -> Any:
    if name not in row.data:
        raise TaskDataError(f"pope task: {row.where()}: missing field '{name}' (a POPE line has question_id, "
                            f"image, text and label; fields: {', '.join(map(str, row.data))})")
    return row.data[name]


def build_pope(config: Pope, ctx: TaskContext) -> list[Example]:
    """One example per line of the POPE file."""
    rows = read_rows(config.path, "pope", fmt="jsonl")
    if not rows:
        raise TaskDataError(f"pope task: {config.path} holds no questions")
    rows = rows[: config.n] if config.n is not None else rows
    base = Path(config.image_dir).expanduser() if config.image_dir is not None else Path(config.path).expanduser().parent
    if config.image_dir is not None and not base.is_dir():
        raise TaskDataError(f"pope task: image_dir {config.image_dir!r} is not a folder (looked at {base.resolve()})")
    hint = (f"set `image_dir:` to the folder holding {_field(rows[0], 'image')!r} and the other images"
            if config.image_dir is None else f"check `image_dir: {config.image_dir}`")
    name = Path(config.path).name.lower()
    setting = next((s for s in ("adversarial", "popular", "random") if s in name), "")
    template = Template(with_marker(config.prompt), "prompt", "pope")
    out = []
    for row in rows:
        question = str(_field(row, "text")).strip()
        label = str(_field(row, "label")).strip().lower()
        if label not in ("yes", "no"):
            raise TaskDataError(f"pope task: {row.where()}: label {label!r} is not yes or no")
        image = resolve_image(_field(row, "image"), base, row, "pope", hint)
        prompt = template.render(Row(row.number, {**row.data, "question": question}, row.source, row.line))
        meta = {"label": label, "answers": [label], "question_id": row.data.get("question_id", row.number),
                "image": str(row.data["image"]), "object": question_object(question), "setting": setting}
        out.append(Example(prompt=prompt, target=f" {label}", meta=meta, images=[image]))
    return out


@hookimpl
def headlab_register_tasks(register):
    register(Pope, build_pope)
