"""The embedded ``headlab-tiny-vlm``: it loads by name with its processor, loads offline with transformers'
own Auto classes, fits the size limit, and answers presence questions about held-out ``shapes`` images
above chance, where a blank image gives no information.

Independent checks: the answers are recomputed with transformers' own processor and forward (no headlab
code), and the true answer of each question is recomputed here from the objects the task drew.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
from pathlib import Path

import pytest
import torch
from PIL import Image

import headlab
from headlab import TaskContext
from headlab.model import load_model
from headlab.plugins.models import embedded
from headlab.plugins.tasks.shapes import Shapes, build_shapes
from headlab.spec import ModelSpec

CHECKPOINT = embedded.VLM_CHECKPOINT
ROOT = Path(__file__).resolve().parent.parent
N_IMAGES = 24  # 48 questions, half yes


@pytest.fixture(scope="module")
def vlm():
    return load_model(ModelSpec(id="headlab-tiny-vlm", device="cpu"))


@pytest.fixture(scope="module")
def questions():
    """Presence questions (POPE format) about images the training never drew (the task's own seed stream)."""
    return build_shapes(Shapes(n=N_IMAGES, question="presence", per_image=1),
                        TaskContext(tokenizer=None, seed=2024, vocab_size=0))


def truth(ex) -> str:
    """yes if the asked object is one the task drew (recomputed from the prompt and the drawn objects)."""
    obj = ex.prompt.split("Is there ")[1].split(" in the image?")[0].split(" ", 1)[1]  # drop the article
    return "yes" if obj in ex.meta["objects"] else "no"


def own_answers(vlm, examples) -> list[str]:
    """transformers' processor and forward, greedy first token: the word it decodes to."""
    processor, model = vlm.processor, vlm.model
    out = []
    with torch.no_grad():
        for ex in examples:
            enc = processor(text=[ex.prompt], images=ex.images, return_tensors="pt")
            token = int(model(**enc).logits[0, -1].argmax())
            out.append(processor.tokenizer.decode([token]).strip())
    return out


def test_size_under_20_mb():
    files = [p for p in CHECKPOINT.iterdir() if p.is_file()]
    assert sum(p.stat().st_size for p in files) < 20 * 2**20
    names = {p.name for p in files}
    assert {"config.json", "model.safetensors", "tokenizer.json", "processor_config.json", "training.json"} <= names


def test_loads_by_name_with_a_processor(vlm):
    assert vlm.name == "headlab-tiny-vlm"
    assert vlm.is_vision and vlm.processor is not None
    assert vlm.model.config.model_type == "llava"
    assert vlm.image_token_id == vlm.processor.tokenizer.convert_tokens_to_ids("<image>")
    geo = vlm.geometry
    assert (geo.n_layers, geo.n_heads, geo.n_kv_heads) == (4, 8, 4)
    # an image becomes (96 / 12)^2 = 64 image tokens
    ex = build_shapes(Shapes(n=1, question="caption"), TaskContext(tokenizer=None, seed=0, vocab_size=0))[0]
    enc = vlm.processor(text=[ex.prompt], images=ex.images, return_tensors="pt")
    assert int((enc["input_ids"] == vlm.image_token_id).sum()) == 64
    assert tuple(enc["pixel_values"].shape) == (1, 3, 96, 96)


def test_transformers_auto_classes_load_it_offline(monkeypatch):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    processor = AutoProcessor.from_pretrained(CHECKPOINT)
    model = AutoModelForImageTextToText.from_pretrained(CHECKPOINT)
    assert type(processor).__name__ == "LlavaProcessor"
    if importlib.util.find_spec("torchvision") is None:  # the PIL image processor: no torchvision needed
        assert type(processor.image_processor).__name__ == "CLIPImageProcessorPil"
    assert type(model).__name__ == "LlavaForConditionalGeneration"


def test_presence_answers_depend_on_the_image(vlm, questions):
    labels = [truth(ex) for ex in questions]
    assert labels == [ex.meta["label"] for ex in questions] and labels.count("yes") == N_IMAGES
    texts = headlab.generate(vlm, questions, max_new_tokens=2, batch_size=len(questions)).texts
    answers = [t.split()[0] if t.split() else "" for t in texts]
    assert answers == own_answers(vlm, questions)  # headlab's batched generation = transformers alone
    right = sum(a == y for a, y in zip(answers, labels, strict=True))
    # chance is 1/2: P(>= 36 of 48 right by chance) < 1e-3
    assert right >= 36, (right, list(zip(answers, labels, strict=True)))
    assert sum(math.comb(48, k) for k in range(right, 49)) / 2**48 < 1e-3
    # with a blank canvas instead of the image, the answer cannot depend on the object: at most chance
    blank = [dataclasses.replace(ex, images=[Image.new("RGB", ex.images[0].size, "white")]) for ex in questions]
    blank_texts = headlab.generate(vlm, blank, max_new_tokens=2, batch_size=len(blank)).texts
    blank_right = sum((t.split() or [""])[0] == y for t, y in zip(blank_texts, labels, strict=True))
    assert blank_right <= 30 < right


def test_checkpoint_is_in_the_package_data():
    text = (Path(__file__).parents[1] / "pyproject.toml").read_text()
    assert '"headlab-tiny-vlm/*"' in text
