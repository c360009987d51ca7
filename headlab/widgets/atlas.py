"""``AtlasMap``: the roles of every head of a labelled head cube (:mod:`headlab.roles`) as a notebook widget, with
hover listing the head's scores.

The grid is the report's (:func:`headlab.role_figures.role_grid_chart`): a cell per head split into a stripe
per role, coloured by role, more opaque the higher the score. Hovering a cell lists every detector's score,
label, rank and threshold margin under the grid (and in the cell's tooltip); clicking a cell selects that head.
The view is an anywidget whose JavaScript is inline, so it works offline in JupyterLab (Altair's interactive
renderer fetches Vega from a CDN); Python computes every text the view shows, and ``hovered`` / ``selected``
are synced back (:meth:`AtlasMap.on_hover`, :meth:`AtlasMap.on_select`). Its static fallback (``_repr_html_``) is
the report's figure as SVG.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import anywidget
import numpy as np
import traitlets
import xarray as xr

from ..figures import to_svg
from ..results import Run, open_run
from ..role_figures import role_colours, role_grid_chart
from ..roles import detectors, head_card, head_cards, is_cube

__all__ = ["AtlasMap", "hover_lines"]

_ESM = """
export default {
  render({ model, el }) {
    const root = document.createElement("div");
    root.className = "headlab-atlas";
    el.appendChild(root);
    function draw() {
      const cells = model.get("cells") || [], names = model.get("detectors") || [];
      const colours = model.get("colours") || [], tips = model.get("tips") || [];
      const cell = model.get("cell_size"), sel = model.get("selected") || [];
      const nl = cells.length, nh = nl ? cells[0].length : 0;
      root.innerHTML = "";
      const title = document.createElement("div");
      title.className = "ha-title"; title.textContent = model.get("title"); root.appendChild(title);
      const grid = document.createElement("div");
      grid.className = "ha-grid";
      grid.style.gridTemplateColumns = `28px repeat(${nh}, ${cell}px)`;
      grid.appendChild(document.createElement("span"));
      for (let h = 0; h < nh; h++) {
        const a = document.createElement("span"); a.className = "ha-axis";
        a.textContent = (nh <= 16 || h % Math.ceil(nh / 16) === 0) ? h : ""; grid.appendChild(a);
      }
      const info = document.createElement("pre");
      info.className = "ha-info"; info.textContent = model.get("hint");
      for (let l = 0; l < nl; l++) {
        const a = document.createElement("span"); a.className = "ha-axis"; a.textContent = "L" + l; grid.appendChild(a);
        for (let h = 0; h < nh; h++) {
          const c = document.createElement("div");
          c.className = "ha-cell" + (sel.length === 2 && sel[0] === l && sel[1] === h ? " ha-sel" : "");
          c.style.width = c.style.height = (cell - 1) + "px";
          c.dataset.layer = l; c.dataset.head = h;
          const stripes = cells[l][h];
          if (!stripes.length) c.classList.add("ha-none");
          for (const [d, shade] of stripes) {
            const s = document.createElement("div");
            s.className = "ha-stripe"; s.style.background = colours[d];
            s.style.opacity = 0.35 + 0.65 * (shade === null ? 0 : shade);
            c.appendChild(s);
          }
          c.title = tips[l][h];
          c.addEventListener("mouseenter", () => {
            info.textContent = tips[l][h];
            model.set("hovered", [l, h]); model.save_changes();
          });
          c.addEventListener("click", () => { model.set("selected", [l, h]); model.save_changes(); });
          grid.appendChild(c);
        }
      }
      root.appendChild(grid);
      const legend = document.createElement("div");
      legend.className = "ha-legend";
      names.forEach((n, d) => {
        const k = document.createElement("span"); k.className = "ha-key";
        k.innerHTML = `<i style="background:${colours[d]}"></i>`;
        k.appendChild(document.createTextNode(n)); legend.appendChild(k);
      });
      root.appendChild(legend);
      root.appendChild(info);
    }
    for (const name of ["cells", "tips", "title", "selected", "cell_size", "colours"]) model.on("change:" + name, draw);
    draw();
  }
};
"""

_CSS = """
.headlab-atlas { font-family: sans-serif; font-size: 11px; margin: 0 24px 8px 0; }
.headlab-atlas .ha-title { font-weight: bold; font-size: 12px; margin-bottom: 4px; }
.headlab-atlas .ha-grid { display: grid; gap: 1px; align-items: center; }
.headlab-atlas .ha-axis { text-align: center; color: #555; font-size: 10px; }
.headlab-atlas .ha-cell { display: flex; cursor: pointer; box-sizing: border-box; outline: 1px solid #555; }
.headlab-atlas .ha-cell.ha-none { background: #eeeeee; outline: none; }
.headlab-atlas .ha-cell:hover { outline: 2px solid #000; }
.headlab-atlas .ha-sel { outline: 2px solid #e4002b; }
.headlab-atlas .ha-stripe { flex: 1; height: 100%; }
.headlab-atlas .ha-legend { margin-top: 6px; display: flex; flex-wrap: wrap; gap: 10px; }
.headlab-atlas .ha-key i { display: inline-block; width: 10px; height: 10px; margin-right: 3px; }
.headlab-atlas .ha-info { margin: 6px 0 0 0; padding: 4px; background: #f6f6f6; min-height: 60px;
  white-space: pre; font-size: 11px; }
"""


def _fmt(v: float | None) -> str:
    return "nan" if v is None else f"{v:.4g}"


def hover_lines(cube: xr.Dataset, layer: int, head: int) -> str:
    """What hovering a head shows: ``L<layer>H<head>: roles ...`` then one line per detector with its score,
    label (``✓``), rank and margin over the threshold (:func:`headlab.roles.head_card`)."""
    return _hover_text(head_card(cube, layer, head), cube.sizes["layer"] * cube.sizes["head"])


def _hover_text(card: dict[str, Any], n: int) -> str:
    layer, head = card["layer"], card["head"]
    lines = [f"L{layer}H{head}: " + (", ".join(card["roles"]) or "no role")]
    width = max(len(name) for name in card["detectors"])
    for name, e in card["detectors"].items():
        lines.append(f"{'✓' if e['label'] else ' '} {name:<{width}}  score {_fmt(e['score'])}  rank {e['rank']}/{n}"
                     f"  margin {'+' if e['margin'] is not None and e['margin'] >= 0 else ''}{_fmt(e['margin'])}")
    return "\n".join(lines)


class AtlasMap(anywidget.AnyWidget):
    """The roles of every head of ``cube`` (a labelled head cube: ``score`` and ``label`` over ``(detector,
    layer, head)``), hover listing a head's scores (:func:`hover_lines`), click selecting it.

    ``AtlasMap(run.results["atlas"])`` or :meth:`AtlasMap.from_run`; :meth:`card` gives a head's card,
    :meth:`on_hover` / :meth:`on_select` call back with ``(layer, head)``; :meth:`chart` is the report's figure.
    """

    _esm = _ESM
    _css = _CSS

    detectors = traitlets.List(help="the cube's detectors, in order").tag(sync=True)
    colours = traitlets.List(help="a colour per detector").tag(sync=True)
    cells = traitlets.List(help="per layer, per head: [detector index, shade] of each role").tag(sync=True)
    tips = traitlets.List(help="per layer, per head: the hover text (hover_lines)").tag(sync=True)
    title = traitlets.Unicode("").tag(sync=True)
    hint = traitlets.Unicode("hover a head to list its scores; click to select it").tag(sync=True)
    cell_size = traitlets.Int(16).tag(sync=True)
    hovered = traitlets.List(help="[layer, head] under the pointer, [] before any hover").tag(sync=True)
    selected = traitlets.List(help="[layer, head] clicked last, [] for none").tag(sync=True)

    def __init__(self, cube: xr.Dataset, *, title: str | None = None, cell_size: int | None = None) -> None:
        if not is_cube(cube):
            raise ValueError("AtlasMap needs a labelled head cube: score and label over (detector, layer, head)")
        names = detectors(cube)
        extra = [d for d in cube["score"].dims if d not in ("detector", "layer", "head")]
        cube = cube.isel({d: 0 for d in extra}) if extra else cube
        score = cube["score"].transpose("detector", "layer", "head", ...).values.astype(float)
        label = cube["label"].transpose("detector", "layer", "head", ...).values.astype(bool)
        biggest = [float(np.nanmax(np.abs(s))) if np.isfinite(s).any() and np.nanmax(np.abs(s)) > 0 else 1.0
                   for s in score]
        layers = [int(v) for v in cube["layer"].values]
        heads = [int(v) for v in cube["head"].values]

        def stripe(d: int, i: int, j: int) -> list[Any]:
            s = score[d, i, j]
            return [d, None if not math.isfinite(s) else min(1.0, max(0.0, s / biggest[d]))]

        cells = [[[stripe(d, i, j) for d in range(len(names)) if label[d, i, j]] for j in range(len(heads))]
                 for i in range(len(layers))]
        texts = iter(_hover_text(card, len(layers) * len(heads)) for card in head_cards(cube))
        tips = [[next(texts) for _ in heads] for _ in layers]
        n_roles = sum(1 for row in cells for c in row if c)
        model = cube.attrs.get("model", "")
        super().__init__(detectors=names, colours=list(role_colours(names).values()), cells=cells, tips=tips,
                         title=title or f"roles of each head{f' of {model}' if model else ''} ({n_roles} of "
                                         f"{len(layers) * len(heads)} heads carry at least one)",
                         cell_size=cell_size or max(8, min(22, 480 // max(len(layers), len(heads)))))
        self.cube = cube
        self._hover: list[Callable[[int, int], None]] = []
        self._select: list[Callable[[int, int], None]] = []
        self.observe(lambda c: self._call(self._hover, c["new"]), names="hovered")
        self.observe(lambda c: self._call(self._select, c["new"]), names="selected")

    @classmethod
    def from_run(cls, run: Any, step: str, **kwargs: Any) -> AtlasMap:
        """The map of a step of a :class:`headlab.Run` (or a run directory) that stored a cube."""

        run = run if isinstance(run, Run) else open_run(run)
        if step not in run.results:
            raise KeyError(f"run {run.name!r} has no step {step!r} (steps: {', '.join(run.results)})")
        return cls(run.results[step], **kwargs)

    @staticmethod
    def _call(callbacks: list[Callable[[int, int], None]], head: list[int]) -> None:
        if len(head) == 2:
            for fn in list(callbacks):
                fn(int(head[0]), int(head[1]))

    def on_hover(self, fn: Callable[[int, int], None]) -> None:
        """Call ``fn(layer, head)`` whenever the pointer enters a head's cell."""
        self._hover.append(fn)

    def on_select(self, fn: Callable[[int, int], None]) -> None:
        """Call ``fn(layer, head)`` whenever a head is clicked (or :meth:`select` ed)."""
        self._select.append(fn)

    def select(self, layer: int, head: int) -> AtlasMap:
        """Select one head, as a click does."""
        self.selected = [int(layer), int(head)]
        return self

    def card(self, layer: int, head: int) -> dict[str, Any]:
        """The head's card (:func:`headlab.roles.head_card`): every detector's score, label, rank, threshold
        and margin."""
        return head_card(self.cube, layer, head)

    def chart(self) -> Any:
        """The report's grid of roles (:func:`headlab.role_figures.role_grid_chart`), which JupyterLab shows."""
        return role_grid_chart(self.cube)

    def __repr__(self) -> str:
        return f"AtlasMap({self.title!r}, {len(self.cells)} layers x {len(self.cells[0]) if self.cells else 0} heads)"

    def _repr_html_(self) -> str:  # static fallback (nbconvert, GitHub); JupyterLab shows the widget
        return to_svg(self.chart())
