"""Attention over images (``headlab.image_attention``): per-patch values of a head's attention to an image's tokens, and pictures of it.

- :func:`image_array`: an image (``PIL.Image``, a local file path, or an array) as ``(height, width, 3)``
  uint8.
- :func:`patch_grid`: one value per image token -> ``(..., rows, cols)`` in reading order.
- :func:`image_token_attention`: a model's attention from one query to each image's tokens, for every
  (layer, head), read with the instrumentation's ``pairs`` probe (one forward, memory linear in the
  number of image tokens).
- :func:`attention_preview`: what a run stores to draw that attention later without the model: the first
  image (downscaled) and the attention of every head over its patches (``preview_image``,
  ``preview_attention``).
- :func:`png_data_uri`, :func:`image_attention_svg`: the image with the values as semi-transparent cells
  over its patches and a colour bar, as inline SVG (used by ``headlab report`` and the widgets).
"""

from __future__ import annotations

import base64
import io
import math
from collections.abc import Sequence
from html import escape
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import xarray as xr
from PIL import Image

from .forward_pass import forward
from .generation import Batch, tokenize
from .instrument import Plan, Probes
from .svg import color, colour_bar_svg

if TYPE_CHECKING:
    from .example import Example
    from .generation import Batch
    from .model import LoadedModel

__all__ = ["PREVIEW_ATTENTION", "PREVIEW_IMAGE", "attention_preview", "forward_kwargs", "image_array",
           "image_attention_svg", "image_token_attention", "model_view", "patch_grid", "png_bytes", "png_data_uri",
           "preview_of", "resize_image"]

PREVIEW_IMAGE = "preview_image"
"""Name of the stored preview image: ``(pixel_y, pixel_x, channel)`` uint8."""
PREVIEW_ATTENTION = "preview_attention"
"""Name of the stored preview attention: ``(layer, head, patch_row, patch_col)`` float32."""


def image_array(image: Any) -> np.ndarray:
    """``image`` (a ``PIL.Image``, a local file path, or an ``(H, W)``, ``(H, W, 3|4)`` array, uint8 or
    floats in [0, 1]) as a ``(height, width, 3)`` uint8 array."""
    if isinstance(image, (str, Path)):

        with Image.open(image) as im:
            return np.asarray(im.convert("RGB"), dtype=np.uint8).copy()
    if hasattr(image, "convert") and hasattr(image, "size"):  # a PIL image
        return np.asarray(image.convert("RGB"), dtype=np.uint8).copy()
    arr = np.asarray(image)
    if arr.dtype.kind == "f":
        arr = np.clip(np.round(arr * 255.0), 0, 255)
    arr = arr.astype(np.uint8)
    if arr.ndim == 2:
        arr = np.repeat(arr[:, :, None], 3, axis=2)
    if arr.ndim != 3 or arr.shape[2] not in (3, 4):
        raise ValueError(f"an image array must be (H, W), (H, W, 3) or (H, W, 4); got shape {arr.shape}")
    return np.ascontiguousarray(arr[:, :, :3])


def resize_image(image: Any, max_side: int) -> np.ndarray:
    """``image`` as ``(H, W, 3)`` uint8, downscaled (aspect kept) so that its longer side is at most
    ``max_side`` pixels (unchanged if already smaller)."""
    arr = image_array(image)
    h, w = arr.shape[:2]
    if max(h, w) <= max_side:
        return arr
    scale = max_side / max(h, w)
    nh, nw = max(1, round(h * scale)), max(1, round(w * scale))

    return np.asarray(Image.fromarray(arr).resize((nw, nh), Image.Resampling.BILINEAR), dtype=np.uint8).copy()


def png_bytes(image: Any) -> bytes:
    """``image`` encoded as PNG (8-bit RGB)."""


    buf = io.BytesIO()
    Image.fromarray(image_array(image)).save(buf, format="PNG")
    return buf.getvalue()


def png_data_uri(image: Any) -> str:
    """``image`` as a ``data:image/png;base64,...`` URI (inline in HTML/SVG; nothing is fetched)."""
    return "data:image/png;base64," + base64.b64encode(png_bytes(image)).decode("ascii")


def patch_grid(values: Any, grid: tuple[int, int]) -> np.ndarray:
    """One value per image token (last axis, reading order) as ``(..., rows, cols)``."""
    arr = np.asarray(values, dtype=float)
    rows, cols = int(grid[0]), int(grid[1])
    if arr.shape[-1] != rows * cols:
        raise ValueError(f"{arr.shape[-1]} image-token values do not fill a {rows} x {cols} grid")
    return arr.reshape(*arr.shape[:-1], rows, cols)


def forward_kwargs(batch: Batch) -> dict[str, Any]:
    """Keyword arguments of the model's forward over ``batch`` besides ``input_ids`` and ``attention_mask``:
    for a batch with images, its processor inputs (``pixel_values``, ...) and its ``position_ids``
    (multimodal for Qwen2-VL); nothing for a text batch."""
    if not batch.has_images:
        return {}
    return {**batch.forward_inputs(), "position_ids": batch.positions()}


def model_view(lm: LoadedModel, batch: Batch, index: int = 0) -> np.ndarray | None:
    """Image ``index`` of ``batch`` (in the order of its ``pixel_values``: row 0's images first) as the
    model sees it, ``(H, W, 3)`` uint8, so that its token grid lies exactly on it (a LLaVA processor crops
    and resizes): the processor's ``pixel_values`` with the normalisation undone. None when they are not
    one ``(channel, height, width)`` picture per image (Qwen2-VL's flattened patches, LLaVA-NeXT's tiles):
    then the original image is what the grid covers."""
    pv = batch.model_inputs.get("pixel_values")
    if pv is None or pv.dim() != 4 or pv.shape[1] != 3 or not 0 <= index < pv.shape[0]:
        return None
    ip = getattr(lm.processor, "image_processor", None)
    x = pv[index].float().cpu().numpy().transpose(1, 2, 0)
    if getattr(ip, "do_normalize", True):
        mean = np.asarray(getattr(ip, "image_mean", None) or [0.5, 0.5, 0.5], dtype=float)
        std = np.asarray(getattr(ip, "image_std", None) or [0.5, 0.5, 0.5], dtype=float)
        x = x * std + mean
    scale = float(getattr(ip, "rescale_factor", 1 / 255)) if getattr(ip, "do_rescale", True) else 1.0
    return np.clip(np.round(x / scale), 0, 255).astype(np.uint8)


def image_token_attention(lm: LoadedModel, batch: Batch, *, row: int = 0, query: int | None = None,
                          layers: Sequence[int] | None = None) -> list[np.ndarray]:
    """Attention of every (layer, head) from ``query`` (a padded position of row ``row``; default the
    last position) to each image token of that row: one ``(layer, head, rows, cols)`` float array per
    image of the row, in the grid of ``batch.image_grids``.

    One forward of the batch (with its ``model_inputs``) under ``Probes(pairs=...)``; layers not in
    ``layers`` (default all) are not recorded and are absent from the layer axis.
    """


    spans = [tuple(s) for s in batch.image_spans[row]] if batch.image_spans else []
    grids = [tuple(g) for g in batch.image_grids[row]] if batch.image_grids else []
    if not spans:
        return []
    q = batch.length - 1 if query is None else int(query)
    if not 0 <= q < batch.length:
        raise ValueError(f"query {q} outside 0..{batch.length - 1}")
    keys = [k for a, b in spans for k in range(a, b)]
    per_row = [[(q, k) for k in keys] if r == row else [] for r in range(batch.size)]
    probes = Probes(pairs=per_row, layers=None if layers is None else [int(x) for x in layers])
    _, rec = forward(lm, batch, Plan(probes=probes), logits_to_keep=1)
    mass = rec.pair_mass[row].float().cpu().numpy()[..., : len(keys)]  # (layer, head, pair)
    out, at = [], 0
    for (a, b), grid in zip(spans, grids, strict=True):
        out.append(patch_grid(mass[..., at: at + (b - a)], grid))
        at += b - a
    return out


def attention_preview(lm: LoadedModel, example: Example | Batch, *, query: int | None = None,
                      max_side: int = 224) -> xr.Dataset:
    """The first image of ``example`` (an :class:`headlab.Example` with images, or a :class:`Batch` whose
    first row has one) as the model sees it (:func:`model_view`, else the original), downscaled to at most
    ``max_side`` pixels, and every head's attention from ``query`` (default: the last prompt token) over its
    patches.

    Returns a Dataset with ``preview_image (pixel_y, pixel_x, channel)`` uint8 and ``preview_attention
    (layer, head, patch_row, patch_col)`` float32 (attrs ``query``: the padded query position, ``image_tokens``:
    ``[start, end)`` of the image's tokens), ready to merge into a step's results; empty when there is no
    image. :func:`image_attention_svg` draws it.
    """

    batch = example if isinstance(example, Batch) else tokenize(lm, [example], device=lm.device)
    first = batch.examples[0] if batch.examples else None
    images = list(first.images) if first is not None else []
    if not images or not batch.image_spans or not batch.image_spans[0]:
        return xr.Dataset()
    att = image_token_attention(lm, batch, row=0, query=query)[0]
    q = batch.length - 1 if query is None else int(query)
    seen = model_view(lm, batch, 0)
    img = resize_image(images[0] if seen is None else seen, max_side)
    start, end = batch.image_spans[0][0]
    ds = xr.Dataset({
        PREVIEW_IMAGE: (("pixel_y", "pixel_x", "channel"), img),
        PREVIEW_ATTENTION: (("layer", "head", "patch_row", "patch_col"), att.astype(np.float32)),
    }, coords={"layer": np.arange(att.shape[0]), "head": np.arange(att.shape[1])})
    ds[PREVIEW_ATTENTION].attrs.update(query=q, image_tokens=[int(start), int(end)])
    return ds


def preview_of(ds: xr.Dataset) -> tuple[np.ndarray, xr.DataArray] | None:
    """The stored preview of a step's results (the first sweep cell's), or None: ``(image (H, W, 3)
    uint8, attention (layer, head, patch_row, patch_col))``, with any padding from combining cells of
    different sizes cut off."""
    if PREVIEW_IMAGE not in ds or PREVIEW_ATTENTION not in ds:
        return None
    img, att = ds[PREVIEW_IMAGE], ds[PREVIEW_ATTENTION]
    img = img.isel({d: 0 for d in img.dims if d not in ("pixel_y", "pixel_x", "channel")})
    att = att.isel({d: 0 for d in att.dims if d not in ("layer", "head", "patch_row", "patch_col")})
    pix = img.transpose("pixel_y", "pixel_x", "channel").values.astype(float)
    valid = np.isfinite(pix) & (pix >= 0) & (pix <= 255)
    ys = np.flatnonzero(valid.all(axis=(1, 2)))
    xs = np.flatnonzero(valid.all(axis=(0, 2)))
    if ys.size == 0 or xs.size == 0:
        return None
    pix = pix[: ys[-1] + 1, : xs[-1] + 1].astype(np.uint8)
    att = att.transpose("layer", "head", "patch_row", "patch_col")
    finite = np.isfinite(att.values)
    rows = np.flatnonzero(finite.any(axis=(0, 1, 3)))
    cols = np.flatnonzero(finite.any(axis=(0, 1, 2)))
    if rows.size == 0 or cols.size == 0:
        return None
    return pix, att.isel(patch_row=slice(0, rows[-1] + 1), patch_col=slice(0, cols[-1] + 1))


def image_attention_svg(image: Any, values: Any, *, title: str = "", width: int = 280,
                        vmin: float = 0.0, vmax: float | None = None, opacity: float = 0.6) -> str:
    """``image`` with one value per patch (``values``: ``(rows, cols)``) drawn as semi-transparent cells
    on the viridis scale of :func:`headlab.svg.color`, and a colour bar, as inline SVG. Each cell
    carries ``data-row``, ``data-col``, ``data-value`` and a ``<title>`` with its value."""
    arr = image_array(image)
    vals = np.asarray(values, dtype=float)
    if vals.ndim != 2:
        raise ValueError(f"values must be (rows, cols); got shape {vals.shape}")
    rows, cols = vals.shape
    h, w = arr.shape[:2]
    finite = vals[np.isfinite(vals)]
    hi = (float(finite.max()) if finite.size else 1.0) if vmax is None else float(vmax)
    if hi <= vmin:
        hi = vmin + 1.0
    iw, ih = int(width), max(1, round(width * h / w))
    left, top = 4, 22 if title else 6
    bar_x = left + iw + 10
    total_w = max(bar_x + 60, left + 7 * len(title) + 8)
    total_h = top + ih + 8
    cw, ch = iw / cols, ih / rows
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" class="image-attention" width="{total_w}" '
             f'height="{total_h}" viewBox="0 0 {total_w} {total_h}" font-family="sans-serif" font-size="10">']
    if title:
        parts.append(f'<text x="{left}" y="14" font-size="12" font-weight="bold">{escape(title)}</text>')
    parts.append(f'<image x="{left}" y="{top}" width="{iw}" height="{ih}" preserveAspectRatio="none" '
                 f'href="{png_data_uri(arr)}"/>')
    for r in range(rows):
        for c in range(cols):
            v = float(vals[r, c])
            label = "nan" if not math.isfinite(v) else f"{v:.4g}"
            parts.append(f'<rect class="patch" x="{left + c * cw:.2f}" y="{top + r * ch:.2f}" width="{cw:.2f}" '
                         f'height="{ch:.2f}" fill="{color(v, vmin, hi)}" fill-opacity="{opacity}" '
                         f'data-row="{r}" data-col="{c}" data-value="{label}">'
                         f"<title>row {r}, col {c}: {label}</title></rect>")
    parts.extend(colour_bar_svg(bar_x, top, ih, vmin, hi))
    parts.append("</svg>")
    return "".join(parts)
