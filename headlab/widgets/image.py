"""``ImagePatchView``: an image with one value per patch drawn as a heatmap over its patches.

Used by :class:`headlab.widgets.AttentionView` for the images of a vision-language prompt (a head's
attention from the query to each image token), and usable alone::

    ImagePatchView.from_values(image, grid=(24, 24), values=attention_to_image_tokens, token_start=5)

Hovering a patch shows its value, row, column and token index as a tooltip; clicking one shows the same
under the image and sets ``selected`` (the patch's index in reading order) on the Python side.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import anywidget
import numpy as np
import traitlets

from ..image_attention import image_array, png_data_uri, resize_image
from .js import PRELUDE

__all__ = ["ImagePatchView"]

_ESM = PRELUDE + """
function fmt(v) { return (v === null || v === undefined || !isFinite(v)) ? "n/a" : Number(v).toPrecision(4); }
export default {
  render({ model, el }) {
    const root = document.createElement("div");
    root.className = "headlab-image-attention";
    el.appendChild(root);
    function describe(i) {
      const cols = model.get("cols"), v = model.get("values")[i];
      return `row ${Math.floor(i / cols)}, col ${i % cols}, token #${model.get("token_start") + i}: ${fmt(v)}`;
    }
    function draw() {
      const rows = model.get("rows"), cols = model.get("cols"), values = model.get("values");
      const W = model.get("width"), aspect = model.get("aspect"), H = Math.round(W * aspect);
      const hi = topOf(values, model.get("vmax"));
      root.innerHTML = "";
      root.appendChild(element("div", "hl-caption", model.get("caption")));
      const row = document.createElement("div");
      row.className = "hl-image-row";
      const stage = document.createElement("div");
      stage.className = "hl-stage";
      stage.style.width = W + "px"; stage.style.height = H + "px";
      const img = document.createElement("img");
      img.className = "hl-image";
      img.src = model.get("image");
      img.width = W; img.height = H;
      img.draggable = false;
      stage.appendChild(img);
      const grid = document.createElement("div");
      grid.className = "hl-grid";
      grid.style.gridTemplateColumns = `repeat(${cols}, 1fr)`;
      grid.style.gridTemplateRows = `repeat(${rows}, 1fr)`;
      const tip = document.createElement("div");
      tip.className = "hl-tip";
      const opacity = model.get("opacity"), selected = model.get("selected");
      for (let i = 0; i < rows * cols; i++) {
        const v = values[i], c = colour(v, hi);
        const p = document.createElement("div");
        p.className = "hl-patch" + (i === selected ? " hl-selected" : "") + (c ? "" : " hl-novalue");
        if (c) p.style.background = `rgba(${c[0]}, ${c[1]}, ${c[2]}, ${opacity})`;
        p.dataset.index = i; p.dataset.row = Math.floor(i / cols); p.dataset.col = i % cols;
        p.dataset.token = model.get("token_start") + i;
        p.dataset.value = fmt(v);
        p.title = describe(i);
        p.addEventListener("mouseenter", () => { tip.textContent = describe(i); tip.style.visibility = "visible"; });
        p.addEventListener("mouseleave", () => { tip.style.visibility = "hidden"; });
        p.addEventListener("click", () => { model.set("selected", i); model.save_changes(); });
        grid.appendChild(p);
      }
      stage.appendChild(grid);
      stage.appendChild(tip);
      row.appendChild(stage);
      // colour bar: 0 at the bottom, the scale's top at the top
      const bar = document.createElement("div");
      bar.className = "hl-colourbar";
      bar.style.height = H + "px";
      const grad = document.createElement("div");
      grad.className = "hl-gradient";
      grad.style.background = "linear-gradient(to top, " + PALETTE.map(c => `rgb(${c})`).join(", ") + ")";
      const top = document.createElement("span"); top.className = "hl-bar-max"; top.textContent = fmt(hi);
      const bottom = document.createElement("span"); bottom.className = "hl-bar-min"; bottom.textContent = "0";
      bar.append(top, grad, bottom);
      row.appendChild(bar);
      root.appendChild(row);
      const info = document.createElement("div");
      info.className = "hl-patch-info";
      info.textContent = selected >= 0 && selected < rows * cols ? describe(selected) : "click a patch for its value";
      root.appendChild(info);
    }
    for (const name of ["image", "rows", "cols", "values", "token_start", "caption", "vmax", "width", "aspect",
                        "opacity", "selected"])
      model.on("change:" + name, draw);
    draw();
  }
};
"""

_CSS = """
.headlab-image-attention { font-family: sans-serif; font-size: 12px; display: inline-block; margin: 4px 8px; }
.headlab-image-attention .hl-caption { color: #444; margin-bottom: 4px; }
.headlab-image-attention .hl-image-row { display: flex; gap: 8px; align-items: stretch; }
.headlab-image-attention .hl-stage { position: relative; }
.headlab-image-attention .hl-image { position: absolute; left: 0; top: 0; image-rendering: pixelated; }
.headlab-image-attention .hl-grid { position: absolute; inset: 0; display: grid; }
.headlab-image-attention .hl-patch { box-sizing: border-box; border: 1px solid rgba(255,255,255,0.15); cursor: pointer; }
.headlab-image-attention .hl-patch:hover { border: 1px solid #fff; }
.headlab-image-attention .hl-patch.hl-selected { border: 2px solid #e4002b; }
.headlab-image-attention .hl-tip { position: absolute; left: 0; bottom: -22px; visibility: hidden; background: #333;
  color: #fff; padding: 1px 5px; border-radius: 3px; white-space: nowrap; pointer-events: none; z-index: 2; }
.headlab-image-attention .hl-colourbar { display: flex; flex-direction: column; align-items: center; width: 44px; }
.headlab-image-attention .hl-gradient { flex: 1; width: 12px; border: 1px solid #999; }
.headlab-image-attention .hl-patch-info { margin-top: 24px; font-family: monospace; }
"""


class ImagePatchView(anywidget.AnyWidget):
    """An image (``image``: a PNG data URI) with ``values`` (one per patch of a ``rows`` x ``cols`` grid,
    reading order; None for no value) as semi-transparent viridis cells and a colour bar. ``token_start``
    is the token index of the first patch. Clicking a patch sets ``selected`` to its index."""

    _esm = _ESM
    _css = _CSS
    image = traitlets.Unicode("").tag(sync=True)
    aspect = traitlets.Float(1.0, help="height / width of the image").tag(sync=True)
    width = traitlets.Int(280, help="display width in pixels").tag(sync=True)
    rows = traitlets.Int(1).tag(sync=True)
    cols = traitlets.Int(1).tag(sync=True)
    values = traitlets.List().tag(sync=True)
    token_start = traitlets.Int(0).tag(sync=True)
    caption = traitlets.Unicode("").tag(sync=True)
    vmax = traitlets.Float(0.0, help="top of the colour scale; 0 = the largest value").tag(sync=True)
    opacity = traitlets.Float(0.6).tag(sync=True)
    selected = traitlets.Int(-1, help="index of the clicked patch (-1: none)").tag(sync=True)

    @classmethod
    def from_values(cls, image: Any, grid: tuple[int, int], values: Sequence[float | None] | np.ndarray, *,
                    token_start: int = 0, caption: str = "", width: int = 280, max_side: int = 448,
                    **kwargs: Any) -> ImagePatchView:
        """A view of ``image`` (PIL image, path or ``(H, W, 3)`` uint8 array) with ``values`` (one per image
        token, reading order, or a ``(rows, cols)`` array) over its ``grid`` (rows, cols)."""
        view = cls(width=int(width), caption=caption, token_start=int(token_start), **kwargs)
        view.set_image(image, max_side=max_side)
        view.set_values(grid, values)
        return view

    def set_image(self, image: Any, *, max_side: int = 448) -> None:
        """Show ``image`` (downscaled to at most ``max_side`` pixels for the page)."""
        arr = image_array(image)
        self.aspect = arr.shape[0] / arr.shape[1]
        self.image = png_data_uri(resize_image(arr, max_side))

    def set_values(self, grid: tuple[int, int], values: Sequence[float | None] | np.ndarray) -> None:
        """Set the grid and one value per patch (reading order; None or NaN: no value)."""
        rows, cols = int(grid[0]), int(grid[1])
        flat = [None if v is None or not np.isfinite(v) else float(v)
                for v in np.asarray(values, dtype=object).reshape(-1)]
        if len(flat) != rows * cols:
            raise ValueError(f"{len(flat)} values do not fill a {rows} x {cols} grid")
        with self.hold_sync():
            self.rows, self.cols = rows, cols
            self.values = flat
            if self.selected >= rows * cols:
                self.selected = -1

    @property
    def grid_values(self) -> np.ndarray:
        """The values as a ``(rows, cols)`` float array (NaN: no value)."""
        return np.array([np.nan if v is None else v for v in self.values], dtype=float).reshape(self.rows, self.cols)

    def patch(self, index: int | None = None) -> dict[str, Any]:
        """What clicking patch ``index`` (default the selected one) shows: row, col, token index and value."""
        i = self.selected if index is None else int(index)
        if not 0 <= i < self.rows * self.cols:
            raise ValueError(f"no patch {i} (the grid has {self.rows * self.cols})")
        return {"row": i // self.cols, "col": i % self.cols, "token": self.token_start + i, "value": self.values[i]}
