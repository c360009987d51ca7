"""``HeadMap``: a (layer x head) heatmap of any score array; hover for values, click or drag to select.

The view is an anywidget whose JavaScript is inline (no CDN). It is drawn by hand, not by
:mod:`headlab.figures`: click-and-drag selection synced both ways with Python needs a widget, and Altair's
(``JupyterChart``) loads vega-embed from esm.sh at run time, so it would not work offline. Its static
fallback (``_repr_html_``) is the library's heatmap. Python holds the state: ``selected``
(a list of ``[layer, head]``) is synced both ways, and the selection is offered as a head list
(:attr:`HeadMap.heads`), a spec fragment (:attr:`HeadMap.spec_fragment`, ``heads: [[l, h], ...]``) and
PASTA's JSON (:attr:`HeadMap.pasta_json`), which the view shows live under the map.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import anywidget
import numpy as np
import traitlets
import xarray as xr

from ..dims import head_array
from ..figures import Chart, heatmap, to_svg
from ..head_figures import ranked_accuracy_chart
from ..heads import Head, ranked, to_pasta_json
from ..results import Run, open_run
from ..svg import NAN_COLOR, PALETTE

__all__ = ["HeadMap", "as_head_scores", "spec_fragment"]

__all__ = ["HeadMap", "as_head_scores", "spec_fragment"]

_ESM = """
const PALETTE = %PALETTE%;
const NAN = "%NAN%";
function colour(v, lo, hi) {
  if (v === null || v === undefined || !isFinite(v)) return NAN;
  let t = hi > lo ? Math.min(1, Math.max(0, (v - lo) / (hi - lo))) : 0;
  const x = t * (PALETTE.length - 1), i = Math.min(Math.floor(x), PALETTE.length - 2), f = x - i;
  const a = PALETTE[i], b = PALETTE[i + 1];
  return `rgb(${Math.round(a[0] + (b[0] - a[0]) * f)},${Math.round(a[1] + (b[1] - a[1]) * f)},${Math.round(a[2] + (b[2] - a[2]) * f)})`;
}
function fmt(v) {
  if (v === null || v === undefined || !isFinite(v)) return "nan";
  const a = Math.abs(Number(v));
  return (a > 0 && a < 1e-3) || a >= 1e5 ? Number(v).toExponential(2) : Number(v).toPrecision(4);
}

export default {
  render({ model, el }) {
    const root = document.createElement("div");
    root.className = "headlab-headmap";
    el.appendChild(root);
    let drag = null;   // {l0, h0, l1, h1, moved}
    const key = (l, h) => l + ":" + h;

    function selectedSet() { return new Set((model.get("selected") || []).map(([l, h]) => key(l, h))); }
    function setSelection(set) {
      const out = [...set].map(k => k.split(":").map(Number)).sort((a, b) => a[0] - b[0] || a[1] - b[1]);
      model.set("selected", out);
      model.save_changes();
    }
    function inRect(l, h) {
      if (!drag) return false;
      return l >= Math.min(drag.l0, drag.l1) && l <= Math.max(drag.l0, drag.l1)
          && h >= Math.min(drag.h0, drag.h1) && h <= Math.max(drag.h0, drag.h1);
    }

    function draw() {
      const values = model.get("values") || [];
      const nl = values.length, nh = nl ? values[0].length : 0;
      const cell = model.get("cell_size");
      let lo = model.get("vmin"), hi = model.get("vmax");
      const sel = selectedSet();
      root.innerHTML = "";
      const title = document.createElement("div");
      title.className = "hl-title";
      title.textContent = model.get("title");
      root.appendChild(title);
      const wrap = document.createElement("div");
      wrap.className = "hl-wrap";
      const grid = document.createElement("div");
      grid.className = "hl-grid";
      grid.style.gridTemplateColumns = `32px repeat(${nh}, ${cell}px)`;
      grid.appendChild(document.createElement("span"));
      for (let h = 0; h < nh; h++) {
        const c = document.createElement("span"); c.className = "hl-axis"; c.textContent = h; grid.appendChild(c);
      }
      for (let l = 0; l < nl; l++) {
        const r = document.createElement("span"); r.className = "hl-axis"; r.textContent = "L" + l; grid.appendChild(r);
        for (let h = 0; h < nh; h++) {
          const v = values[l][h];
          const d = document.createElement("div");
          d.className = "hl-cell" + (sel.has(key(l, h)) ? " hl-sel" : "") + (inRect(l, h) ? " hl-drag" : "");
          d.style.background = colour(v, lo, hi);
          d.style.width = d.style.height = (cell - 2) + "px";
          d.dataset.layer = l; d.dataset.head = h; d.dataset.value = fmt(v);
          d.title = `layer ${l}, head ${h}: ${fmt(v)}`;
          d.addEventListener("mouseenter", () => {
            tip.textContent = `layer ${l}, head ${h}: ${fmt(v)}`;
            if (drag) { drag.l1 = l; drag.h1 = h; drag.moved = drag.moved || l !== drag.l0 || h !== drag.h0; paintDrag(); }
          });
          d.addEventListener("mousedown", (e) => { e.preventDefault(); drag = { l0: l, h0: h, l1: l, h1: h, moved: false, remove: e.altKey }; });
          grid.appendChild(d);
        }
      }
      wrap.appendChild(grid);
      const bar = document.createElement("div");
      bar.className = "hl-bar";
      bar.innerHTML = `<span>${fmt(hi)}</span><div class="hl-grad" style="height:${Math.max(nl * cell, 40)}px;background:linear-gradient(to top, ${PALETTE.map(c => `rgb(${c})`).join(",")})"></div><span>${fmt(lo)}</span>`;
      wrap.appendChild(bar);
      root.appendChild(wrap);
      const tip = document.createElement("div");
      tip.className = "hl-tip";
      tip.textContent = `${sel.size} of ${nl * nh} heads selected (click to toggle, drag to add a block, alt-drag to remove)`;
      root.appendChild(tip);
      const frag = document.createElement("pre");
      frag.className = "hl-fragment";
      frag.textContent = model.get("fragment");
      root.appendChild(frag);
    }
    function paintDrag() {
      root.querySelectorAll(".hl-cell").forEach(d => {
        d.classList.toggle("hl-drag", inRect(Number(d.dataset.layer), Number(d.dataset.head)));
      });
    }
    function finish() {
      if (!drag) return;
      const set = selectedSet();
      const values = model.get("values") || [];
      if (!drag.moved) {
        const k = key(drag.l0, drag.h0);
        if (set.has(k)) set.delete(k); else set.add(k);
      } else {
        for (let l = 0; l < values.length; l++)
          for (let h = 0; h < values[l].length; h++)
            if (inRect(l, h)) { if (drag.remove) set.delete(key(l, h)); else set.add(key(l, h)); }
      }
      drag = null;
      setSelection(set);
    }
    window.addEventListener("mouseup", finish);
    model.on("change:values", draw);
    model.on("change:selected", draw);
    model.on("change:fragment", draw);
    model.on("change:title", draw);
    model.on("change:vmin", draw);
    model.on("change:vmax", draw);
    draw();
    return () => window.removeEventListener("mouseup", finish);
  }
};
""".replace("%PALETTE%", json.dumps([list(c) for c in PALETTE])).replace("%NAN%", NAN_COLOR)

_CSS = """
.headlab-headmap { font-family: sans-serif; font-size: 11px; user-select: none; margin: 0 24px 8px 0;
  max-width: 680px; }
.headlab-headmap .hl-title { font-weight: bold; font-size: 12px; margin-bottom: 4px; }
.headlab-headmap .hl-wrap { display: flex; gap: 8px; align-items: flex-start; }
.headlab-headmap .hl-grid { display: grid; gap: 0; align-items: center; }
.headlab-headmap .hl-axis { text-align: center; color: #555; font-size: 10px; }
.headlab-headmap .hl-cell { margin: 1px; cursor: pointer; box-sizing: border-box; }
.headlab-headmap .hl-cell:hover { outline: 1px solid #000; }
.headlab-headmap .hl-sel { outline: 2px solid #e4002b; outline-offset: -2px; }
.headlab-headmap .hl-drag { outline: 2px dashed #ff8c00; outline-offset: -2px; }
.headlab-headmap .hl-bar { display: flex; flex-direction: column; align-items: center; font-size: 10px; }
.headlab-headmap .hl-grad { width: 10px; }
.headlab-headmap .hl-tip { margin-top: 4px; color: #333; min-height: 14px; }
.headlab-headmap .hl-fragment { margin: 4px 0 0 0; padding: 4px; background: #f6f6f6; font-size: 11px;
  white-space: pre-wrap; max-width: 640px; }
"""


def as_head_scores(scores: Any, **sel: Any) -> xr.DataArray:
    """A ``(layer, head)`` DataArray from a DataArray, a Dataset with ``score``, or a 2-D array.

    ``sel`` picks coordinates of extra dimensions (``task.length=24``); remaining extra dimensions
    (sweep keys, ``example``) are averaged.
    """
    if isinstance(scores, xr.Dataset):
        if "score" not in scores:
            raise ValueError("this dataset has no `score` variable (is it a detect step?)")
        scores = scores["score"]
    if isinstance(scores, xr.DataArray):
        da = scores.sel(sel) if sel else scores
        missing = {"layer", "head"} - set(da.dims)
        if missing:
            raise ValueError(f"scores need dimensions layer and head; missing {sorted(missing)}")
        extra = [d for d in da.dims if d not in ("layer", "head")]
        da = da.mean(extra) if extra else da
        return da.transpose("layer", "head").astype(float)
    arr = np.asarray(scores, dtype=float)
    if arr.ndim != 2:
        raise ValueError(f"scores must be (layer, head), got shape {arr.shape}")
    return head_array(arr)


def spec_fragment(heads: Iterable[Head], key: str = "heads") -> str:
    """``heads: [[l, h], ...]``: a head list as a line of spec YAML."""
    pairs = ", ".join(f"[{int(layer)}, {int(head)}]" for layer, head in heads)
    return f"{key}: [{pairs}]"


class HeadMap(anywidget.AnyWidget):
    """A (layer x head) heatmap with hover values and click/drag head selection.

    ``HeadMap(run.results["induction"])``, ``HeadMap(score_array, title=...)`` or
    :meth:`HeadMap.from_run`. Extra dimensions are averaged unless picked with keyword arguments
    (``HeadMap(ds, **{"task.length": 24})``). Click a cell to toggle it, drag to add a block,
    alt-drag to remove one; or select from Python with :meth:`select`, :meth:`select_top`,
    :meth:`select_threshold`.
    """

    _esm = _ESM
    _css = _CSS

    values = traitlets.List(help="(layer x head) values, None for NaN").tag(sync=True)
    selected = traitlets.List(help="selected heads as [layer, head] pairs, sorted").tag(sync=True)
    title = traitlets.Unicode("").tag(sync=True)
    vmin = traitlets.Float(0.0).tag(sync=True)
    vmax = traitlets.Float(1.0).tag(sync=True)
    cell_size = traitlets.Int(22).tag(sync=True)
    fragment = traitlets.Unicode("", help="the selection as a spec fragment and PASTA JSON").tag(sync=True)

    def __init__(self, scores: Any, *, title: str | None = None, vmin: float | None = None,
                 vmax: float | None = None, selected: Iterable[Head] = (), cell_size: int = 22,
                 **sel: Any) -> None:
        da = as_head_scores(scores, **sel)
        arr = da.values.astype(float)
        finite = arr[np.isfinite(arr)]
        lo = float(finite.min()) if finite.size else 0.0
        hi = float(finite.max()) if finite.size else 1.0
        if title is None:
            src = scores.attrs.get("method") or scores.attrs.get("step") if hasattr(scores, "attrs") else None
            title = f"{src} score" if src else "score"
        super().__init__(values=[[None if not math.isfinite(v) else float(v) for v in row] for row in arr],
                         title=title, vmin=lo if vmin is None else float(vmin),
                         vmax=(hi if hi > lo else lo + 1.0) if vmax is None else float(vmax),
                         cell_size=cell_size)
        self.scores = da
        chance = scores.attrs.get("chance") if isinstance(scores, (xr.Dataset, xr.DataArray)) else None
        self.chance: float | None = float(chance) if isinstance(chance, (int, float, np.number)) else None
        self._callbacks: list[Callable[[list[Head]], None]] = []
        self.observe(self._on_selected, names="selected")
        self.select(selected)
        self._update_fragment()

    @classmethod
    def from_run(cls, run: Any, step: str, **kwargs: Any) -> HeadMap:
        """The map of a detect step of a :class:`headlab.Run` (or a run directory)."""

        run = run if isinstance(run, Run) else open_run(run)
        if step not in run.results:
            raise KeyError(f"run {run.name!r} has no step {step!r} (steps: {', '.join(run.results)})")
        kwargs.setdefault("title", f"{step}: {run.results[step].attrs.get('method', '')} score")
        return cls(run.results[step], **kwargs)

    # ---- geometry
    @property
    def n_layers(self) -> int:
        return len(self.values)

    @property
    def n_heads(self) -> int:
        return len(self.values[0]) if self.values else 0

    # ---- selection
    @traitlets.validate("selected")
    def _valid_selection(self, proposal: dict[str, Any]) -> list[list[int]]:
        out = set()
        for item in proposal["value"]:
            layer, head = (int(x) for x in item)
            if not (0 <= layer < self.n_layers and 0 <= head < self.n_heads):
                raise traitlets.TraitError(
                    f"head ({layer}, {head}) is outside this map ({self.n_layers} layers x {self.n_heads} heads)")
            out.add((layer, head))
        return [[layer, head] for layer, head in sorted(out)]

    def _on_selected(self, change: dict[str, Any]) -> None:
        self._update_fragment()
        for fn in list(self._callbacks):
            fn(self.heads)

    def _update_fragment(self) -> None:
        self.fragment = f"{self.spec_fragment}\nPASTA: {json.dumps(self.pasta_json)}" if self.selected else \
            "(no heads selected)"

    def on_select(self, fn: Callable[[list[Head]], None]) -> None:
        """Call ``fn(heads)`` whenever the selection changes (from the view or from Python)."""
        self._callbacks.append(fn)

    def select(self, heads: Iterable[Sequence[int]], *, add: bool = False) -> HeadMap:
        """Select ``heads`` (``(layer, head)`` pairs); ``add=True`` keeps the current selection."""
        current = [tuple(h) for h in self.selected] if add else []
        self.selected = [list(h) for h in [*current, *(tuple(int(x) for x in h) for h in heads)]]
        return self

    def select_rect(self, layers: tuple[int, int], heads: tuple[int, int], *, remove: bool = False) -> HeadMap:
        """Add (or remove) the block of heads ``layers[0]..layers[1]`` x ``heads[0]..heads[1]``
        (inclusive, either order): what a drag in the view does."""
        l0, l1 = sorted(layers)
        h0, h1 = sorted(heads)
        block = {(la, he) for la in range(l0, l1 + 1) for he in range(h0, h1 + 1)}
        current = {tuple(h) for h in self.selected}
        self.selected = [list(h) for h in (current - block if remove else current | block)]
        return self

    def toggle(self, layer: int, head: int) -> HeadMap:
        """Toggle one head: what a click in the view does."""
        current = {tuple(h) for h in self.selected}
        current ^= {(int(layer), int(head))}
        self.selected = [list(h) for h in current]
        return self

    def select_top(self, k: int) -> HeadMap:
        """Select the ``k`` highest-scoring heads (ties by layer, head; NaN last)."""
        return self.select([h for h, _ in ranked(self.scores)[:k]])

    def select_threshold(self, threshold: float) -> HeadMap:
        """Select every head whose score is >= ``threshold``."""
        return self.select([h for h, s in ranked(self.scores) if s >= threshold])

    def clear(self) -> HeadMap:
        """Select nothing."""
        self.selected = []
        return self

    @property
    def heads(self) -> list[Head]:
        """The selected heads as sorted ``(layer, head)`` tuples."""
        return [(int(a), int(b)) for a, b in self.selected]

    @property
    def spec_fragment(self) -> str:
        """The selection as spec YAML: ``heads: [[l, h], ...]``."""
        return spec_fragment(self.heads)

    @property
    def pasta_json(self) -> dict[str, list[int]]:
        """The selection in PASTA's ``{"<layer>": [heads]}`` format."""
        return to_pasta_json(self.heads)

    def selection_scores(self) -> list[tuple[Head, float]]:
        """The selected heads with their values, highest first."""
        vals = self.scores.values
        return sorted(((h, float(vals[h])) for h in self.heads), key=lambda t: (-t[1], t[0]))

    def sorted_chart(self, chance: float | None = None) -> Chart:
        """The values with each layer's heads sorted, highest first, and the colour centred at ``chance``
        (default: the scores' ``attrs['chance']``, as a probe step stores it): the report's figure
        (:func:`headlab.head_figures.ranked_accuracy_chart`), which JupyterLab shows. Each cell's tooltip gives
        the real head index."""
        level = self.chance if chance is None else float(chance)
        if level is None:
            raise ValueError("HeadMap.sorted_chart: these scores carry no attrs['chance']; pass chance=...")
        ds = xr.Dataset({"score": self.scores}, attrs={"chance": level})
        return ranked_accuracy_chart(ds, title=f"{self.title}, each layer sorted; white: chance {level:.3g}")

    def __repr__(self) -> str:
        return (f"HeadMap({self.title!r}, {self.n_layers} layers x {self.n_heads} heads, "
                f"selected: {self.spec_fragment.removeprefix('heads: ')})")

    def _repr_html_(self) -> str:  # static fallback (nbconvert, GitHub); JupyterLab shows the widget
        return to_svg(heatmap(self.scores, title=self.title, highlight=self.heads))
