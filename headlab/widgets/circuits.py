"""Widgets of circuit analyses: :class:`PatchingMap` (a patching score per head; a click shows the head's
score per token), :class:`DLABars` (direct logit attribution as signed bars) and :class:`CircuitGraph` (an edge
attribution's strongest edges as a graph, with a slider for how many).

They draw with :mod:`headlab.circuit_view`, the figures of ``headlab report``, so a result looks the same in
both.
"""

from __future__ import annotations

from collections.abc import Sequence
from html import escape
from typing import Any

import ipywidgets
import xarray as xr

from ..circuit_view import (
    Edge,
    Reduce,
    circuit_edges,
    circuit_graph_svg,
    dla_bars_svg,
    dla_terms,
    head_map,
    position_grid_svg,
)
from ..heads import Head
from .headmap import HeadMap

__all__ = ["CircuitGraph", "DLABars", "PatchingMap"]

#: the most heads the per-token panel of a PatchingMap shows at once (the latest selected)
MAX_PANEL_HEADS = 12


def _score_of(result: xr.Dataset | xr.DataArray, what: str) -> xr.DataArray:
    if isinstance(result, xr.Dataset):
        if "score" not in result:
            raise ValueError(f"{what}: this dataset has no `score` variable (is it a detect step?)")
        return result["score"]
    return result


class PatchingMap(ipywidgets.VBox):
    """An activation or attribution patching result as a (layer x head) :class:`~headlab.widgets.HeadMap`;
    selecting heads (a click) shows their scores per token under the map when the score has a ``token``
    dimension (``unit: z_position``), else their scores and the unpatched metrics.

    ``PatchingMap(run.results["patch"])``; a per-token score is reduced for the map by ``reduce`` (``peak``:
    the per-token score of largest magnitude, ``sum`` or ``mean``); ``tokens`` labels the token columns;
    key/value patching (``(layer, kv_head)``) is drawn with one column per key/value head. Keyword arguments
    pick coordinates of extra dimensions (sweep keys); the others are averaged.
    """

    def __init__(self, result: xr.Dataset | xr.DataArray, *, reduce: Reduce = "peak",
                 tokens: Sequence[str] | None = None, title: str | None = None, selected: Sequence[Head] = (),
                 cell_size: int = 22, **sel: Any) -> None:
        score = _score_of(result, "PatchingMap")
        score = score.sel(sel) if sel else score
        if "layer" not in score.dims or not ({"head", "kv_head"} & set(score.dims)):
            raise ValueError(f"PatchingMap: a score over (layer, head[, token]) or (layer, kv_head), "
                             f"got {tuple(score.dims)}")
        self.result = result
        self.by_token = "token" in score.dims
        self.kv = "kv_head" in score.dims and "head" not in score.dims
        extra = [d for d in score.dims if d not in ("layer", "head", "kv_head", "token")]
        self.score = score.mean(extra) if extra else score
        self.tokens = list(tokens) if tokens is not None else None
        flat = head_map(self.score, reduce)
        if self.kv:
            flat = flat.rename(kv_head="head")
        if title is None:
            method = result.attrs.get("method", "patching") if hasattr(result, "attrs") else "patching"
            title = f"{method} score" + (f" ({reduce} over tokens; click a head for its scores per token)"
                                         if self.by_token else "") + (" per key/value head" if self.kv else "")
        self.headmap = HeadMap(flat, title=title, cell_size=cell_size)
        self.panel = ipywidgets.HTML()
        self.panel.add_class("headlab-patching-tokens")
        super().__init__([self.headmap, self.panel])
        self.add_class("headlab-patching")
        self.headmap.on_select(self._show)
        self.headmap.select(selected)
        self._show(self.headmap.heads)

    @property
    def heads(self) -> list[Head]:
        """The selected heads (key/value heads for key/value patching)."""
        return self.headmap.heads

    def select(self, heads: Sequence[Sequence[int]]) -> PatchingMap:
        """Select ``heads``, as clicks in the map do."""
        self.headmap.select(heads)
        return self

    def position_scores(self, layer: int, head: int) -> xr.DataArray:
        """One head's score per token (a score without a ``token`` dimension raises ``ValueError``)."""
        if not self.by_token:
            raise ValueError("this score has no token dimension (run activation_patching with unit: z_position)")
        return self.score.sel(layer=layer, head=head)

    def _show(self, heads: list[Head]) -> None:
        if not heads:
            self.panel.value = ('<p class="hl-hint">Click a head to see its score per token.</p>' if self.by_token
                                else '<p class="hl-hint">Click a head to see its score.</p>')
            return
        shown = heads[-MAX_PANEL_HEADS:] if self.by_token else heads
        if self.by_token:
            self.panel.value = position_grid_svg(self.score, shown, tokens=self.tokens,
                                                 title="score per token of the selected heads")
            return
        dim = "kv_head" if self.kv else "head"
        rows = "".join(f"<tr><td>L{a}{'KV' if self.kv else 'H'}{b}</td><td class=\"num\">"
                       f"{float(self.score.sel({'layer': a, dim: b})):.4g}</td></tr>" for a, b in shown)
        metrics = ""
        if isinstance(self.result, xr.Dataset):
            metrics = "".join(f"<tr><td>{escape(name)} (mean)</td><td class=\"num\">"
                              f"{float(self.result[name].mean()):.4g}</td></tr>"
                              for name in ("clean", "corrupt") if name in self.result)
        self.panel.value = f'<table class="hl-patching-scores"><tbody>{rows}{metrics}</tbody></table>'


class DLABars(ipywidgets.HTML):
    """A ``direct_logit_attribution`` result as signed bars: every head (or the ``max_heads`` of largest
    magnitude and the sum of the others), the rest (embeddings, MLPs, biases) and the logit difference they
    sum to (:func:`headlab.circuit_view.dla_terms`)."""

    def __init__(self, result: xr.Dataset, *, max_heads: int = 32, title: str = "direct logit attribution") -> None:
        if not isinstance(result, xr.Dataset) or "score" not in result:
            raise ValueError("DLABars: a direct_logit_attribution result (a dataset with score, rest, logit_diff)")
        self.terms = dla_terms(result, max_heads)
        super().__init__(dla_bars_svg(result, max_heads=max_heads, title=title))
        self.add_class("headlab-dla")


class CircuitGraph(ipywidgets.VBox):
    """An edge attribution result as a circuit graph (nodes by layer, edges by weight and sign) with a slider
    for the number of edges shown, strongest first (:func:`headlab.circuit_view.circuit_graph_svg`).

    ``result`` is a dataset with ``score`` over ``(source, destination)`` (or one edge dimension with
    ``source`` / ``destination`` coordinates), or that DataArray; ``threshold`` drops edges below
    ``|score|``; at most ``max_edges`` are offered.
    """

    def __init__(self, result: xr.Dataset | xr.DataArray, *, top_k: int = 20, threshold: float | None = None,
                 max_edges: int = 200, title: str = "circuit") -> None:
        self.all_edges: list[Edge] = circuit_edges(_score_of(result, "CircuitGraph"), top_k=max_edges,
                                                   threshold=threshold)
        n = len(self.all_edges)
        self.title = title
        self.slider = ipywidgets.IntSlider(value=min(top_k, n), min=min(1, n), max=max(n, 1),
                                           description="edges", disabled=n == 0)
        self.figure = ipywidgets.HTML()
        super().__init__([self.slider, self.figure])
        self.add_class("headlab-circuit")
        self.slider.observe(lambda _: self._draw(), names="value")
        self._draw()

    @property
    def edges(self) -> list[Edge]:
        """The edges shown, strongest first."""
        return self.all_edges[: self.slider.value]

    def _draw(self) -> None:
        edges = self.edges
        self.figure.value = circuit_graph_svg(edges, title=f"{self.title}: the {len(edges)} strongest edges") \
            if edges else "<p>(no edges)</p>"
