"""``AtlasMap``: the roles of every head of a labelled head cube (:mod:`headlab.roles`) as a notebook widget, with
hover listing the head's scores.

The grid is the report's (:func:`headlab.role_figures.role_grid_chart`): a cell per head split into a stripe
per role, coloured by role, more opaque the higher the score. Hovering a cell lists every detector's score,
label, rank and threshold margin under the grid (and in the cell's tooltip); clicking a cell selects that head.
The view is an anywidget whose JavaScript is inline, so it works offline in JupyterLab (Altair's interactive
renderer fetches Vega from a CDN); Python computes every text the view shows, and ``hovered`` / ``selected``
are synced back (:meth:`AtlasMap.on_hover`, :meth:`AtlasMap.on_select`). Its static fallback (``_repr_html_``) is
the report's figure as SVG.

For a compared cube (:func:`headlab.roles.is_cube_comparison`: ``score_diff`` and ``label_change``) the view adds
the report's grid of changes (:func:`headlab.role_figures.change_grid_chart`): a cell per head split into a
stripe per detector, blue where the second model's score is higher and red where it is lower, more opaque the
larger the difference, ▲ where the head gained the role and ▼ where it lost it; the hover text adds each
detector's score difference and change.
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
from ..role_figures import change_grid_chart, role_colours, role_grid_chart
from ..roles import detectors, head_card, head_cards, is_cube, is_cube_comparison

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
      const changes = model.get("changes") || [];
      if (changes.length) {
        const sub = document.createElement("div");
        sub.className = "ha-title"; sub.textContent = model.get("change_title"); root.appendChild(sub);
        const cg = document.createElement("div");
        cg.className = "ha-grid ha-changes";
        cg.style.gridTemplateColumns = `28px repeat(${nh}, ${cell}px)`;
        cg.appendChild(document.createElement("span"));
        for (let h = 0; h < nh; h++) {
          const a = document.createElement("span"); a.className = "ha-axis";
          a.textContent = (nh <= 16 || h % Math.ceil(nh / 16) === 0) ? h : ""; cg.appendChild(a);
        }
        for (let l = 0; l < nl; l++) {
          const a = document.createElement("span"); a.className = "ha-axis"; a.textContent = "L" + l; cg.appendChild(a);
          for (let h = 0; h < nh; h++) {
            const c = document.createElement("div");
            c.className = "ha-cell"; c.style.width = c.style.height = (cell - 1) + "px";
            c.dataset.layer = l; c.dataset.head = h;
            for (const [d, shade, change] of changes[l][h]) {
              const s = document.createElement("div");
              s.className = "ha-stripe ha-change"; s.dataset.detector = d;
              const v = shade === null ? 0 : Math.abs(shade);
              s.style.background = shade === null ? "#bbbbbb" :
                (shade >= 0 ? `rgba(33,102,172,${v})` : `rgba(178,24,43,${v})`);
              s.textContent = change > 0 ? "\u25B2" : change < 0 ? "\u25BC" : "";
              c.appendChild(s);
            }
            c.title = tips[l][h];
            c.addEventListener("mouseenter", () => {
              info.textContent = tips[l][h];
              model.set("hovered", [l, h]); model.save_changes();
            });
            c.addEventListener("click", () => { model.set("selected", [l, h]); model.save_changes(); });
            cg.appendChild(c);
          }
        }
        root.appendChild(cg);
      }
      root.appendChild(info);
    }
    for (const name of ["cells", "tips", "title", "selected", "cell_size", "colours", "changes", "change_title"])
      model.on("change:" + name, draw);
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
.headlab-atlas .ha-change { font-size: 8px; line-height: 1; text-align: center; color: #111; overflow: hidden; }
.headlab-atlas .ha-changes { margin-top: 4px; }
.headlab-atlas .ha-legend { margin-top: 6px; display: flex; flex-wrap: wrap; gap: 10px; }
.headlab-atlas .ha-key i { display: inline-block; width: 10px; height: 10px; margin-right: 3px; }
.headlab-atlas .ha-info { margin: 6px 0 0 0; padding: 4px; background: #f6f6f6; min-height: 60px;
  white-space: pre; font-size: 11px; }
"""


def _fmt(v: float | None) -> str:
    return "nan" if v is None else f"{v:.4g}"


def _signed(v: float | None) -> str:
    return f"{'+' if v is not None and v >= 0 else ''}{_fmt(v)}"


def hover_lines(cube: xr.Dataset, layer: int, head: int) -> str:
    """What hovering a head shows: ``L<layer>H<head>: roles ...`` then one line per detector with its score,
    label (``✓``), rank and margin over the threshold (:func:`headlab.roles.head_card`); for a compared cube also
    the score difference (second model minus first) and ``gained`` or ``lost`` where the label changed."""
    card = head_card(cube, layer, head)
    return _hover_text(card, cube.sizes["layer"] * cube.sizes["head"], _head_changes(cube, layer, head))


def _head_changes(cube: xr.Dataset, layer: int, head: int) -> dict[str, tuple[float | None, int]] | None:
    """Per detector, ``(score_diff, label_change)`` of one head of a compared cube; None for a cube alone."""
    if not is_cube_comparison(cube):
        return None
    one = cube.sel(layer=layer, head=head)
    diff = one["score_diff"].transpose("detector", ...).values.astype(float).reshape(len(detectors(cube)), -1)[:, 0]
    change = one["label_change"].transpose("detector", ...).values.astype(int).reshape(len(detectors(cube)), -1)[:, 0]
    return {name: (float(diff[d]) if math.isfinite(diff[d]) else None, int(change[d]))
            for d, name in enumerate(detectors(cube))}


def _hover_text(card: dict[str, Any], n: int, changes: dict[str, tuple[float | None, int]] | None = None) -> str:
    layer, head = card["layer"], card["head"]
    lines = [f"L{layer}H{head}: " + (", ".join(card["roles"]) or "no role")]
    width = max(len(name) for name in card["detectors"])
    for name, e in card["detectors"].items():
        line = (f"{'✓' if e['label'] else ' '} {name:<{width}}  score {_fmt(e['score'])}  rank {e['rank']}/{n}"
                f"  margin {_signed(e['margin'])}")
        if changes is not None:
            diff, change = changes[name]
            line += f"  diff {_signed(diff)}" + {1: "  gained", -1: "  lost"}.get(change, "")
        lines.append(line)
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
    changes = traitlets.List(help="a compared cube's per layer, per head: [detector index, score difference / the "
                             "largest |difference| of that detector, label change] of every detector; [] for a "
                             "cube alone").tag(sync=True)
    change_title = traitlets.Unicode("").tag(sync=True)

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
        compared = is_cube_comparison(cube)
        texts = iter(_hover_text(card, len(layers) * len(heads),
                                 _head_changes(cube, card["layer"], card["head"]) if compared else None)
                     for card in head_cards(cube))
        tips = [[next(texts) for _ in heads] for _ in layers]
        changes: list[Any] = []
        change_title = ""
        if compared:
            diff = cube["score_diff"].transpose("detector", "layer", "head", ...).values.astype(float)
            change = cube["label_change"].transpose("detector", "layer", "head", ...).values.astype(int)
            largest = [float(np.nanmax(np.abs(x))) if np.isfinite(x).any() and np.nanmax(np.abs(x)) > 0 else 1.0
                       for x in diff]
            changes = [[[[d, float(diff[d, i, j]) / largest[d] if math.isfinite(diff[d, i, j]) else None,
                          int(change[d, i, j])] for d in range(len(names))] for j in range(len(heads))]
                       for i in range(len(layers))]
            other = cube.attrs.get("compare_model", "")
            change_title = (f"changes{f' in {other}' if other else ''}: score difference per detector (stripes in "
                            f"legend order; blue higher, red lower), role gained ▲ / lost ▼ ({int((change > 0).sum())}"
                            f" gained, {int((change < 0).sum())} lost)")
        n_roles = sum(1 for row in cells for c in row if c)
        model = cube.attrs.get("model", "")
        super().__init__(detectors=names, colours=list(role_colours(names).values()), cells=cells, tips=tips,
                         title=title or f"roles of each head{f' of {model}' if model else ''} ({n_roles} of "
                                         f"{len(layers) * len(heads)} heads carry at least one)",
                         cell_size=cell_size or max(8, min(22, 480 // max(len(layers), len(heads)))),
                         changes=changes, change_title=change_title)
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

    def change_chart(self) -> Any:
        """For a compared cube, the report's grid of changes (:func:`headlab.role_figures.change_grid_chart`);
        None for a cube alone."""
        return change_grid_chart(self.cube) if is_cube_comparison(self.cube) else None

    def __repr__(self) -> str:
        return f"AtlasMap({self.title!r}, {len(self.cells)} layers x {len(self.cells[0]) if self.cells else 0} heads)"

    def _repr_html_(self) -> str:  # static fallback (nbconvert, GitHub); JupyterLab shows the widget
        changes = self.change_chart()
        return to_svg(self.chart()) + (to_svg(changes) if changes is not None else "")
