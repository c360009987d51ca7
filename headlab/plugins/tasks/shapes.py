"""The ``shapes`` task: PIL-drawn coloured shapes with questions whose answers are in the image.

Each of ``n`` images is a plain canvas (``background``) with ``objects: [lo, hi]`` shapes on it, each a
distinct *object*: a colour and a shape, named ``"<colour> <shape>"`` (``"red circle"``); the objects
are the categories of the POPE questions and the ground truth of the ``chair`` metric
(``meta["objects"]``, sorted). Shapes are placed in distinct cells of a 3 x 3 grid (so they never
overlap), with seeded sizes and offsets. Everything is drawn from the run seed plus ``seed``: the
same seed gives the same images and questions.

``question`` chooses the examples (the prompt template ``prompt`` gets ``{{ question }}``; its
``<image>`` marker, :data:`headlab.IMAGE_MARKER`, is where the image goes, and a template
without one gets ``"<image>\\n"`` in front):

- ``presence`` (POPE, Li et al. 2023): "Is there a red circle in the image?", target ``" yes"`` or
  ``" no"``; per image ``per_image`` questions about present objects (chosen at random) and as many
  about absent ones, alternating yes/no, so yes and no are exactly balanced. The absent objects follow
  ``negatives`` (POPE's three settings), over every colour x shape object of the config:

  - ``random``: absent objects chosen uniformly at random;
  - ``popular``: the absent objects that are in the most images of the task (ties: by name);
  - ``adversarial``: the absent objects that co-occur most with the image's objects: an object's
    score is the sum, over the image's objects, of the number of images holding both (ties: the
    more frequent object, then by name).

- ``colour``: "What colour is the circle?" about a shape that is in the image exactly once (target:
  the colour); ``per_image`` different shapes per image.
- ``count``: "How many circles are there?" about a shape in the image (target: the count in words,
  ``" two"``; ``meta["answers"]`` also accepts the digit); ``per_image`` different shapes per image.
- ``caption``: "Describe the image." with no target (one example per image; for the ``chair`` metric).

``meta``: ``objects`` (the image's objects, a sorted list), ``image`` (the image's index), ``question``
(the kind), ``scene`` (the objects joined by ``", "``, stored with the results), and except for
captions ``label`` (the answer: ``yes``/``no``, a colour, a number word), ``answers`` (accepted answers,
for ``any_answer``) and ``object`` (the object or shape asked about); presence adds ``setting`` (the
negatives setting), count adds ``count``.

Vocabulary: the words are those of the embedded ``headlab-tiny`` tokenizer
(:func:`headlab.plugins.tasks.generators.vocabulary`) where possible; out of it are ``Is``, ``image``,
``yes``, ``no``, ``colour``, ``How``, ``are``, ``Describe``, the shapes ``circle``, ``triangle``,
``cross`` and every plural but none (``square``, ``star`` are in it), and the numbers above ``three``.
All colours (``red``, ``green``, ``blue``, ``yellow``, ``purple``, ``orange``, ``brown``, ``gray``; the
canvas is ``white`` or ``black``) are in it.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, field_validator, model_validator

from headlab import IMAGE_MARKER
from headlab.plugin import ComponentConfig, Example, PositiveInt, Seed, TaskContext, hookimpl
from headlab.resources import TaskSize
from headlab.text import COLOURS, SHAPES, plural

from .files import Row, Template

__all__ = [
    "SHAPES", "COLOURS", "NUMBER_WORDS", "IMAGE_TOKENS", "Shapes", "build_shapes", "draw_scene", "object_name",
    "plural", "with_marker", "popular_ranking", "adversarial_ranking",
]

NUMBER_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
"""Counts in words (``count`` targets)."""

IMAGE_TOKENS = 576
"""Tokens an image is counted as in :meth:`Shapes.size` (LLaVA-1.5's 24 x 24 patches), for the resource guard."""

GRID = 3
MAX_OBJECTS = GRID * GRID
DEFAULT_PROMPT = "<image>\nQuestion: {{ question }}\nAnswer:"

Colour = Literal["red", "green", "blue", "yellow", "purple", "orange", "brown", "gray"]
Background = Literal["white", "black"]
Shape = Literal["circle", "square", "triangle", "star", "cross"]


def object_name(colour: str, shape: str) -> str:
    """``"red circle"``: how an object is named in questions and in ``meta["objects"]``."""
    return f"{colour} {shape}"


def with_marker(prompt: str) -> str:
    """``prompt`` with ``"<image>\\n"`` in front when it has no image marker."""
    return prompt if IMAGE_MARKER in prompt else f"{IMAGE_MARKER}\n{prompt}"


def _ordered(value: tuple[int, int]) -> tuple[int, int]:
    if value[0] > value[1]:
        raise ValueError(f"[lo, hi] with lo <= hi (got [{value[0]}, {value[1]}])")
    return value


ObjectCount = Annotated[int, Field(ge=1, le=MAX_OBJECTS)]
ObjectRange = Annotated[tuple[ObjectCount, ObjectCount], AfterValidator(_ordered)]
"""``[lo, hi]`` objects per image, ``1 <= lo <= hi <= 9`` (a 3 x 3 grid)."""


class Shapes(ComponentConfig):
    """Synthetic images of coloured shapes with presence (POPE), colour, count or caption questions."""

    kind: Literal["shapes"] = "shapes"
    n: PositiveInt = Field(16, description="number of images")
    question: Literal["presence", "colour", "count", "caption"] = Field(
        "presence", description="presence: POPE yes/no; colour: the colour of a shape; count: how many of a "
        "shape; caption: 'Describe the image.' (no target)")
    negatives: Literal["random", "popular", "adversarial"] = Field(
        "random", description="POPE's setting for the absent objects of presence questions")
    per_image: PositiveInt = Field(1, description="questions per image (presence: this many yes and as many no)")
    objects: ObjectRange = Field((2, 4), description="objects per image: [lo, hi] (hi <= 9)")
    shapes: list[Shape] = Field(default_factory=lambda: list(SHAPES), min_length=1,
                                description="shapes to draw (a repeated entry counts once)")
    colours: list[Colour] = Field(default_factory=lambda: ["red", "green", "blue", "yellow", "purple", "orange"],
                                  min_length=1, description="colours to draw with (a repeated entry counts once)")
    background: Background = Field("white", description="canvas colour")
    image_size: PositiveInt = Field(224, le=4096, description="image width and height in pixels")
    prompt: str = Field(DEFAULT_PROMPT, description="Jinja2 template with {{ question }} and the <image> marker "
                        "(added in front when missing)")
    seed: Seed = Field(0, description="offset added to the run seed")

    @field_validator("shapes", "colours")
    @classmethod
    def _distinct(cls, v: list[str]) -> list[str]:
        return list(dict.fromkeys(v))  # a repeated entry counts once

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v: str) -> str:
        if v.count(IMAGE_MARKER) > 1:
            raise ValueError(f"the prompt has {v.count(IMAGE_MARKER)} {IMAGE_MARKER} markers; an example has one image")
        Template(v, "prompt", "shapes")  # lints: Jinja2 syntax, single braces
        return v

    @model_validator(mode="after")
    def _feasible(self) -> Shapes:
        lo, hi = self.objects
        universe = len(self.shapes) * len(self.colours)
        if hi > universe:
            raise ValueError(f"objects hi={hi} is more than the {universe} distinct colour x shape objects")
        if self.question == "presence":
            if self.per_image > lo:
                raise ValueError(f"per_image={self.per_image} yes questions need at least that many objects "
                                 f"per image (objects lo={lo})")
            if universe - hi < self.per_image:
                raise ValueError(f"per_image={self.per_image} no questions need that many absent objects; with "
                                 f"{universe} colour x shape objects and up to {hi} per image there are "
                                 f"{universe - hi} (add colours or shapes)")
        elif self.question in ("colour", "count") and self.per_image > min(lo, len(self.shapes)):
            raise ValueError(f"per_image={self.per_image} {self.question} questions are about different shapes: "
                             f"at most min(objects lo, number of shapes) = {min(lo, len(self.shapes))}")
        return self

    def examples_per_image(self) -> int:
        """Examples each image gives."""
        return {"presence": 2 * self.per_image, "caption": 1}.get(self.question, self.per_image)

    def example_fields(self) -> frozenset[str]:
        """The image, its objects and, but for captions, the answer (for ``requires()`` checks)."""
        fields = {"images", "meta.objects", "meta.image", "meta.question", "meta.scene"}
        if self.question != "caption":
            fields |= {"target", "meta.label", "meta.answers", "meta.object"}
        if self.question == "presence":
            fields.add("meta.setting")
        if self.question == "count":
            fields.add("meta.count")
        return frozenset(fields)

    def size(self) -> TaskSize:
        """``n`` images times the questions per image; a prompt is an image (:data:`IMAGE_TOKENS`) and a question."""
        return TaskSize(self.n * self.examples_per_image(), IMAGE_TOKENS + 64 + len(self.prompt))


# --- drawing ---------------------------------------------------------------------------------------

def _polygon(shape: str, cx: float, cy: float, r: float) -> list[tuple[float, float]]:
    if shape == "square":
        h = r * 0.8
        return [(cx - h, cy - h), (cx + h, cy - h), (cx + h, cy + h), (cx - h, cy + h)]
    if shape == "triangle":
        return [(cx + r * math.cos(a), cy + r * math.sin(a)) for a in (-math.pi / 2 + k * 2 * math.pi / 3
                                                                        for k in range(3))]
    if shape == "star":
        return [(cx + rr * math.cos(a), cy + rr * math.sin(a))
                for k in range(10) for a, rr in [(-math.pi / 2 + k * math.pi / 5, r if k % 2 == 0 else 0.45 * r)]]
    if shape == "cross":
        w = r * 0.33
        return [(cx - w, cy - r), (cx + w, cy - r), (cx + w, cy - w), (cx + r, cy - w), (cx + r, cy + w),
                (cx + w, cy + w), (cx + w, cy + r), (cx - w, cy + r), (cx - w, cy + w), (cx - r, cy + w),
                (cx - r, cy - w), (cx - w, cy - w)]
    raise ValueError(f"unknown shape {shape!r} (one of {', '.join(SHAPES)})")


def draw_scene(objects: list[tuple[str, str, tuple[float, float, float]]], size: int = 224,
               background: str = "white") -> Any:
    """An RGB ``PIL.Image.Image`` of ``size`` x ``size`` pixels: each ``(colour, shape, (cx, cy, r))`` drawn
    filled, centred at ``(cx, cy)`` with radius ``r`` (pixels), on a ``background`` canvas."""
    from PIL import Image, ImageDraw  # noqa: PLC0415 - Pillow is needed only to draw

    image = Image.new("RGB", (size, size), COLOURS[background])
    draw = ImageDraw.Draw(image)
    for colour, shape, (cx, cy, r) in objects:
        fill = COLOURS[colour]
        if shape == "circle":
            draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=fill)
        else:
            draw.polygon(_polygon(shape, cx, cy, r), fill=fill)
    return image


def _scene(rng: random.Random, config: Shapes) -> list[tuple[str, str, tuple[float, float, float]]]:
    k = rng.randint(*config.objects)
    pairs = rng.sample([(c, s) for c in config.colours for s in config.shapes], k)
    cells = rng.sample(range(MAX_OBJECTS), k)
    cell = config.image_size / GRID
    out = []
    for (colour, shape), at in zip(pairs, cells, strict=True):
        r = cell * 0.4 * rng.uniform(0.6, 1.0)
        slack = cell / 2 - r
        cx = (at % GRID + 0.5) * cell + rng.uniform(-slack, slack)
        cy = (at // GRID + 0.5) * cell + rng.uniform(-slack, slack)
        out.append((colour, shape, (cx, cy, r)))
    return out


def _askable(scene: list[tuple[str, str, Any]], question: str) -> list[str]:
    counts = Counter(s for _, s, _ in scene)
    if question == "colour":
        return sorted(s for s, c in counts.items() if c == 1)
    return sorted(counts)


# --- POPE negatives --------------------------------------------------------------------------------

def popular_ranking(images: list[list[str]], universe: list[str]) -> list[str]:
    """``universe`` ranked by the number of ``images`` (lists of object names) holding each, most first
    (ties: by name)."""
    freq = Counter(o for objs in images for o in set(objs))
    return sorted(universe, key=lambda o: (-freq[o], o))


def adversarial_ranking(present: list[str], images: list[list[str]], universe: list[str]) -> list[str]:
    """``universe`` ranked by co-occurrence with ``present``: the sum over ``present`` objects of the number
    of ``images`` holding both, most first (ties: more images holding it, then by name)."""
    freq = Counter(o for objs in images for o in set(objs))
    cooc: Counter[str] = Counter()
    wanted = set(present)
    for objs in images:
        s = set(objs)
        hits = len(s & wanted)
        if hits:
            for o in s:
                cooc[o] += hits - (1 if o in wanted else 0)
    return sorted(universe, key=lambda o: (-cooc[o], -freq[o], o))


# --- the task --------------------------------------------------------------------------------------

def _article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def build_shapes(config: Shapes, ctx: TaskContext) -> list[Example]:
    """Draw the images and ask the questions."""
    rng = random.Random(ctx.seed + config.seed)
    scenes = []
    for _ in range(config.n):
        for _attempt in range(1000):
            scene = _scene(rng, config)
            if config.question not in ("colour", "count") or len(_askable(scene, config.question)) >= config.per_image:
                break
        else:
            raise ValueError(f"shapes task: could not draw an image with {config.per_image} shapes that occur "
                             f"once (colour questions); lower per_image or raise objects")
        scenes.append(scene)
    names = [sorted(object_name(c, s) for c, s, _ in scene) for scene in scenes]
    universe = sorted(object_name(c, s) for c in config.colours for s in config.shapes)
    template = Template(with_marker(config.prompt), "prompt", "shapes")
    popular = popular_ranking(names, universe) if config.negatives == "popular" else []
    out: list[Example] = []

    def add(i: int, question: str, meta: dict[str, Any], image: Any, answer: str | None) -> None:
        prompt = template.render(Row(len(out) + 1, {"question": question}, "shapes"))
        base = {"objects": names[i], "image": i, "question": config.question, "scene": ", ".join(names[i])}
        out.append(Example(prompt=prompt, target=None if answer is None else f" {answer}",
                           meta={**base, **meta}, images=[image]))

    for i, scene in enumerate(scenes):
        image = draw_scene(scene, config.image_size, config.background)
        if config.question == "caption":
            add(i, "Describe the image.", {}, image, None)
        elif config.question == "presence":
            present = names[i]
            yes = rng.sample(present, config.per_image)
            absent = [o for o in universe if o not in present]
            if config.negatives == "random":
                no = rng.sample(absent, config.per_image)
            else:
                ranking = popular if config.negatives == "popular" else adversarial_ranking(present, names, universe)
                no = [o for o in ranking if o not in present][: config.per_image]
            for pos, neg in zip(yes, no, strict=True):
                for obj, label in ((pos, "yes"), (neg, "no")):
                    add(i, f"Is there {_article(obj)} {obj} in the image?",
                        {"label": label, "answers": [label], "object": obj, "setting": config.negatives},
                        image, label)
        else:
            counts = Counter(s for _, s, _ in scene)
            for shape in rng.sample(_askable(scene, config.question), config.per_image):
                if config.question == "colour":
                    colour = next(c for c, s, _ in scene if s == shape)
                    add(i, f"What colour is the {shape}?",
                        {"label": colour, "answers": [colour], "object": shape}, image, colour)
                else:
                    word = NUMBER_WORDS[counts[shape]]
                    add(i, f"How many {plural(shape)} are there?",
                        {"label": word, "answers": [word, str(counts[shape])], "object": shape,
                         "count": counts[shape]}, image, word)
    return out


@hookimpl
def headlab_register_tasks(register):
    register(Shapes, build_shapes)
