"""Images in prompts: the processor of a vision-language model, and image tokens in a batch.

An :class:`headlab.Example` carries ``images`` (PIL images or local file paths) and marks where each goes in
its prompt with ``<image>`` (:data:`headlab.context.IMAGE_MARKER`). :func:`encode` turns one such example
into the token ids the model reads: each marker becomes the model's image placeholder, which the
processor expands into one token per image patch (LLaVA: ``(image_size / patch_size)^2``; Qwen2-VL: one
per merged patch of the image's grid). Characters of the prompt keep their offsets: the tokens of an
image map to the characters of its marker, so ``Batch.token_span`` of a marker's span is the image's
tokens, and :attr:`headlab.generation.Batch.image_spans` lists them per row.

Random VLMs built from a config (``model: {config: {model_type: llava, ...}}``) get a processor made
here from the config and the named tokenizer (:func:`processor_for_config`); pretrained VLMs use their
own ``AutoProcessor``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import transformers
from PIL import Image

from .example import IMAGE_MARKER, Example

__all__ = ["EncodedImages", "Qwen2VLImageTokens", "encode", "image_grid", "image_token_id", "load_image",
           "placeholder", "processor_for_config", "tile_inputs", "token_runs", "vision_tokens_for_config"]

QWEN_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")


def load_image(image: Any) -> Any:
    """A PIL image in RGB from a PIL image or a local file path (a clear error for a missing file, one that is
    not an image, and a decompression bomb: ``ValueError``, exit code 2)."""

    if isinstance(image, Image.Image):
        return image.convert("RGB")
    if isinstance(image, (str, Path)):
        path = Path(image)
        if not path.is_file():
            raise FileNotFoundError(f"image file '{path}' does not exist")
        try:
            with Image.open(path) as img:
                return img.convert("RGB")
        except OSError as e:
            raise ValueError(f"image file '{path}' cannot be read as an image: {e}") from None
        except Image.DecompressionBombError as e:  # a header claiming billions of pixels: refused, not decoded
            raise ValueError(f"image file '{path}' is too large to decode ({e}); resize it") from None
    raise TypeError(f"an image is a PIL image or a local file path, not {type(image).__name__}")


class Qwen2VLImageTokens:
    """Qwen2-VL's processor without a video processor (transformers' needs torchvision for video).

    Same outputs as ``Qwen2VLProcessor`` for images: ``pixel_values`` and ``image_grid_thw`` from the image
    processor; each ``<|image_pad|>`` of the text repeated ``t * h * w / merge_size^2`` times for its image;
    ``mm_token_type_ids`` 1 on image tokens.
    """

    image_token = "<|image_pad|>"

    def __init__(self, image_processor: Any, tokenizer: Any) -> None:
        self.image_processor = image_processor
        self.tokenizer = tokenizer
        self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)

    def __call__(self, text: list[str], images: list[Any] | None = None, return_tensors: str = "pt",
                 **_: Any) -> dict[str, torch.Tensor]:
        out: dict[str, Any] = {}
        grids: list[list[int]] = []
        if images:
            flat = [im for row in images for im in (row if isinstance(row, list) else [row])]
            out.update(self.image_processor(images=flat, return_tensors="pt"))
            grids = out["image_grid_thw"].tolist()
        merge = int(self.image_processor.merge_size) ** 2
        it = iter(grids)
        expanded = []
        for t in text:
            parts = t.split(self.image_token)
            pieces = [parts[0]]
            for p in parts[1:]:
                pieces.append(self.image_token * (math.prod(next(it)) // merge))
                pieces.append(p)
            expanded.append("".join(pieces))
        enc = self.tokenizer(expanded, return_tensors=return_tensors, padding=True)
        out["input_ids"], out["attention_mask"] = enc["input_ids"], enc["attention_mask"]
        out["mm_token_type_ids"] = (enc["input_ids"] == self.image_token_id).int()
        return out


def vision_tokens_for_config(model_type: str) -> tuple[str, ...]:
    """The special tokens a tokenizer needs for a VLM family (added to a text tokenizer for random models)."""
    return QWEN_TOKENS if model_type.startswith("qwen2") else (IMAGE_MARKER,)


def processor_for_config(model_type: str, config: Any, tokenizer: Any, options: dict[str, Any] | None = None) -> Any:
    """A processor for a random VLM built from ``config``, around ``tokenizer`` (which has the image tokens).

    LLaVA: ``LlavaProcessor`` with a CLIP image processor resizing to the vision tower's ``image_size``;
    Qwen2-VL: :class:`Qwen2VLImageTokens` with ``Qwen2VLImageProcessorPil`` (``options``: ``min_pixels``,
    ``max_pixels``; defaults 4 and 16 merged patches a side).
    """

    opts = dict(options or {})
    vc = config.vision_config
    if model_type in ("llava",):
        size = int(opts.pop("image_size", vc.image_size))
        image_processor = transformers.CLIPImageProcessorPil(
            size={"shortest_edge": size}, crop_size={"height": size, "width": size}, **opts)
        return transformers.LlavaProcessor(
            image_processor=image_processor, tokenizer=tokenizer, patch_size=vc.patch_size,
            vision_feature_select_strategy=config.vision_feature_select_strategy, num_additional_image_tokens=1,
            image_token=IMAGE_MARKER)
    if model_type.startswith("qwen2"):
        side = vc.patch_size * vc.spatial_merge_size
        image_processor = transformers.Qwen2VLImageProcessorPil(
            min_pixels=int(opts.pop("min_pixels", (4 * side) ** 2)), max_pixels=int(opts.pop("max_pixels", (16 * side) ** 2)),
            patch_size=vc.patch_size, merge_size=vc.spatial_merge_size, temporal_patch_size=vc.temporal_patch_size,
            **opts)
        return Qwen2VLImageTokens(image_processor, tokenizer)
    raise ValueError(f"model.config: no processor for a random '{model_type}' model; use llava or qwen2_vl, "
                     "or a pretrained checkpoint with its own processor")


def image_token_id(processor: Any, config: Any) -> int | None:
    """The id of the token that stands for an image patch, from the model config or the processor."""
    for attr in ("image_token_id", "image_token_index"):
        value = getattr(config, attr, None)
        if isinstance(value, int):
            return value
    tok = getattr(processor, "tokenizer", None)
    token = getattr(processor, "image_token", None)
    if tok is not None and isinstance(token, str):
        return int(tok.convert_tokens_to_ids(token))
    return None


def placeholder(processor: Any) -> str:
    """The text one image becomes before the processor expands it (``<image>``; Qwen2-VL's
    ``<|vision_start|><|image_pad|><|vision_end|>``)."""
    token = getattr(processor, "image_token", IMAGE_MARKER)
    tok = getattr(processor, "tokenizer", None)
    if token == "<|image_pad|>" and tok is not None:
        start = tok.convert_tokens_to_ids("<|vision_start|>")
        if start is not None and start != tok.unk_token_id:
            return f"<|vision_start|>{token}<|vision_end|>"
    return token


@dataclass
class EncodedImages:
    """One example's model input with its images (no padding).

    ``ids`` and ``offsets`` (prompt character offsets; an image token's are its marker's), ``per_token``
    (per-token tensors of the processor beyond ids and mask, each ``(1, n)``), ``inputs`` (the rest:
    ``pixel_values``, ``image_grid_thw``, ...), ``spans`` (``[start, end)`` token positions of each image),
    ``grids`` (rows, cols of each image's tokens).
    """

    ids: list[int]
    offsets: list[tuple[int, int]]
    per_token: dict[str, torch.Tensor] = field(default_factory=dict)
    inputs: dict[str, torch.Tensor] = field(default_factory=dict)
    spans: list[tuple[int, int]] = field(default_factory=list)
    grids: list[tuple[int, int]] = field(default_factory=list)


def token_runs(ids: Sequence[int], token_id: int) -> list[tuple[int, int]]:
    """Maximal runs ``[s, e)`` of positions holding ``token_id``."""
    out: list[tuple[int, int]] = []
    start = None
    for i, t in enumerate([*ids, None]):
        if t == token_id and start is None:
            start = i
        elif t != token_id and start is not None:
            out.append((start, i))
            start = None
    return out


def image_grid(processor: Any, inputs: dict[str, torch.Tensor], index: int, n_tokens: int) -> tuple[int, int]:
    """Rows and columns of image ``index``'s tokens: Qwen2-VL's merged grid, a square for LLaVA, else one row."""
    grid = inputs.get("image_grid_thw")
    if grid is not None:
        merge = int(getattr(processor.image_processor, "merge_size", 1))
        t, h, w = (int(x) for x in grid[index])
        return t * h // merge, w // merge
    side = math.isqrt(n_tokens)
    return (side, side) if side * side == n_tokens else (1, n_tokens)


def encode(lm: Any, example: Example) -> EncodedImages:
    """Token ids, offsets, image spans and processor inputs of one example with images."""
    processor = lm.processor
    if processor is None:
        raise ValueError(f"model '{lm.name}' takes no images (it has no processor); use a vision-language model "
                         "or a task without images")
    images = [load_image(im) for im in example.images]
    prompt = example.prompt
    markers = prompt.count(IMAGE_MARKER)
    if markers != len(images):
        raise ValueError(f"an example has {len(images)} image(s) and {markers} '{IMAGE_MARKER}' marker(s) in its "
                         f"prompt; put one marker where each image goes")
    place = placeholder(processor)
    text = prompt.replace(IMAGE_MARKER, place)
    out = dict(processor(text=[text], images=images, return_tensors="pt"))
    ids = out.pop("input_ids")[0].tolist()
    out.pop("attention_mask", None)
    n = len(ids)
    per_token = {k: v for k, v in out.items() if torch.is_tensor(v) and v.dim() == 2 and v.shape == (1, n)}
    inputs = {k: v for k, v in out.items() if k not in per_token and torch.is_tensor(v)}

    tok = processor.tokenizer
    enc = tok(text, return_offsets_mapping=True, add_special_tokens=True)
    short, short_offsets = list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]]
    # characters of `text` back to `prompt`: a placeholder's characters are its marker's
    to_prompt: list[tuple[int, int, int]] = []  # (text start, text end, prompt start) of each placeholder
    t_pos = p_pos = 0
    while (at := prompt.find(IMAGE_MARKER, p_pos)) >= 0:
        t_at = t_pos + (at - p_pos)
        to_prompt.append((t_at, t_at + len(place), at))
        t_pos, p_pos = t_at + len(place), at + len(IMAGE_MARKER)

    def back(a: int, b: int) -> tuple[int, int]:
        shift = 0
        for ts, te, ps in to_prompt:
            if b <= ts:
                break
            if a < te:  # a token of the placeholder: the marker's characters
                return ps, ps + len(IMAGE_MARKER)
            shift += (te - ts) - len(IMAGE_MARKER)
        return a - shift, b - shift

    image_id = lm.image_token_id
    offsets: list[tuple[int, int]] = []
    j = 0
    for i, t in enumerate(ids):
        if j < len(short) and t == short[j] and t != image_id:
            a, b = short_offsets[j]
            offsets.append(back(a, b) if b > a else (a, b))
            j += 1
        elif t == image_id and j < len(short) and short[j] == image_id:
            offsets.append(back(*short_offsets[j]))
            if i + 1 >= n or ids[i + 1] != image_id:
                j += 1
        else:
            raise ValueError(f"the processor's tokens of an example differ from its tokenizer's at position {i}; "
                             "headlab cannot map the prompt's characters to tokens")
    if j != len(short):
        raise ValueError("the processor's tokens of an example differ from its tokenizer's; headlab cannot map "
                         "the prompt's characters to tokens")
    spans = token_runs(ids, image_id) if image_id is not None else []
    if len(spans) != len(images):
        raise ValueError(f"the processor made {len(spans)} image token run(s) for {len(images)} image(s)")
    grids = [image_grid(processor, inputs, k, e - s) for k, (s, e) in enumerate(spans)]
    return EncodedImages(ids, offsets, per_token, inputs, spans, grids)


def tile_inputs(inputs: dict[str, torch.Tensor], copies: int) -> dict[str, torch.Tensor]:
    """Processor inputs for ``copies`` copy-major copies of a batch (each tensor repeated along its first dim)."""
    if copies == 1:
        return dict(inputs)
    return {k: torch.cat([v] * copies) for k, v in inputs.items()}
