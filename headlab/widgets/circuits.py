"""Widgets of circuit analyses: :class:`PatchingMap` (a patching score per head; a click shows the head's
score per token), :class:`DLABars` (direct logit attribution as signed bars) and :class:`CircuitGraph` (an edge
attribution's strongest edges as a graph, with a slider for how many).

They show the Vega-Lite figures of ``headlab report`` (:mod:`headlab.circuit_figures`, on the numbers of
:mod:`headlab.circuit_view`) in :class:`~headlab.widgets.chart.ChartView` s, offline, so a result looks the same
in both; the figure shown is each widget's ``chart`` (``charts`` for DLABars).
"""

from __future__ import annotations

from collections.abc import Sequence
from html import escape
from typing import Any

import ipywidgets
import numpy as np
import xarray as xr

from ..circuit_figures import circuit_chart, dla_chart, token_chart
from ..circuit_view import Edge, Reduce, circuit_edges, dla_terms, head_map
from ..figures import Chart
from ..heads import Head
from .chart import ChartView
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
    the per-token score of largest magnitude, ``sum`` or ``mean``); ``tokens`` labels the token columns (default: their index);
the per-token figure is :func:`headlab.circuit_figures.token_chart`, as in the report (``chart``);
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
        self.figure = ChartView()
        self.figure.add_class("headlab-patching-tokens")
        super().__init__([self.headmap, self.panel, self.figure])
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

    @property
    def chart(self) -> Chart | None:
        """The per-token figure shown (None until a head is selected, or without a token dimension)."""
        return self.figure.chart

    def token_chart(self, heads: Sequence[Head]) -> Chart:
        """The per-token scores of ``heads`` (rows ``L<layer>H<head>``) as the report's token heatmap."""
        per_token = self.score.transpose("layer", "head", "token")
        n = per_token.sizes["token"]
        if self.tokens is not None:
            tokens = [str(t) for t in self.tokens]
        elif "token" in per_token.coords:
            tokens = [str(int(t)) for t in per_token["token"].values]
        else:
            tokens = [str(t) for t in range(n)]
        if len(tokens) != n:
            raise ValueError(f"PatchingMap: {len(tokens)} token labels for {n} tokens")
        values = np.array([per_token.sel(layer=a, head=b).values for a, b in heads], dtype=float).reshape(len(heads), n)
        return token_chart(values, [f"L{a}H{b}" for a, b in heads], tokens,
                           title="score per token of the selected heads", row_title="head")

    def _show(self, heads: list[Head]) -> None:
        if not heads:
            self.panel.value = ('<p class="hl-hint">Click a head to see its score per token.</p>' if self.by_token
                                else '<p class="hl-hint">Click a head to see its score.</p>')
            self.figure.show(None)
            return
        if self.by_token:
            self.panel.value = ""
            self.figure.show(self.token_chart(heads[-MAX_PANEL_HEADS:]))
            return
        shown = heads
        dim = "kv_head" if self.kv else "head"
        rows = "".join(f"<tr><td>L{a}{'KV' if self.kv else 'H'}{b}</td><td class=\"num\">"
                       f"{float(self.score.sel({'layer': a, dim: b})):.4g}</td></tr>" for a, b in shown)
        metrics = ""
        if isinstance(self.result, xr.Dataset):
            metrics = "".join(f"<tr><td>{escape(name)} (mean)</td><td class=\"num\">"
                              f"{float(self.result[name].mean()):.4g}</td></tr>"
                              for name in ("clean", "corrupt") if name in self.result)
        self.panel.value = f'<table class="hl-patching-scores"><tbody>{rows}{metrics}</tbody></table>'


class DLABars(ipywidgets.HBox):
    """A ``direct_logit_attribution`` result as the report's two panels of signed bars
    (:func:`headlab.circuit_figures.dla_chart`, ``charts``): every head (or the ``max_heads`` of largest
    magnitude and the sum of the others), and beside them the heads' sum, the rest (embeddings, MLPs, biases)
    and the logit difference they add up to (``terms``: :func:`headlab.circuit_view.dla_terms`)."""

    def __init__(self, result: xr.Dataset, *, max_heads: int = 32, title: str = "direct logit attribution") -> None:
        if not isinstance(result, xr.Dataset) or "score" not in result:
            raise ValueError("DLABars: a direct_logit_attribution result (a dataset with score, rest, logit_diff)")
        self.terms = dla_terms(result, max_heads)
        self.charts: tuple[Chart, Chart] = dla_chart(result, max_heads=max_heads, title=title)
        super().__init__([ChartView(chart) for chart in self.charts])
        self.add_class("headlab-dla")


class CircuitGraph(ipywidgets.VBox):
    """An edge attribution result as a circuit graph (nodes by layer, edges by weight and sign) with a slider
    for the number of edges shown, strongest first: the report's :func:`headlab.circuit_figures.circuit_chart`
    (``chart``).

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
        self.figure = ChartView()
        super().__init__([self.slider, self.figure])
        self.add_class("headlab-circuit")
        self.slider.observe(lambda _: self._draw(), names="value")
        self._draw()

    @property
    def edges(self) -> list[Edge]:
        """The edges shown, strongest first."""
        return self.all_edges[: self.slider.value]

    @property
    def chart(self) -> Chart | None:
        """The figure shown (None without edges)."""
        return self.figure.chart

    def _draw(self) -> None:
        edges = self.edges
        self.figure.show(circuit_chart(edges, title=f"{self.title}: the {len(edges)} strongest edges")
                         if edges else None, empty="<p>(no edges)</p>")
