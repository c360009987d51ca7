"""The figure each stored step takes in the notebook: :func:`step_view` for one step, :func:`run_views` for a
run (what :class:`~headlab.widgets.RunBrowser` and :class:`~headlab.widgets.SpecRunner` show).

A patching result gets a :class:`~headlab.widgets.PatchingMap` (residual-stream patching: a
:class:`~headlab.widgets.chart.ChartView` of the report's (layer x token) map with one example's tokens), a
direct logit attribution :class:`~headlab.widgets.DLABars`, an edge attribution a :class:`~headlab.widgets.CircuitGraph`, a labelled
head cube (the atlas) an :class:`~headlab.widgets.AtlasMap` and a comparison of two cubes its change grid, any other
detect result over ``(layer, head)`` a :class:`~headlab.widgets.HeadMap`; a run whose steps have a ``kv`` policy
adds one :class:`~headlab.widgets.KvTradeoff` over them: the figures ``headlab report`` draws for the same run
(:mod:`headlab.circuit_figures`, :mod:`headlab.figures`).
"""

from __future__ import annotations

import ipywidgets
import xarray as xr

from ..circuit_figures import token_chart
from ..circuit_view import circuit_kind, resid_map, token_labels, tokenizer_for
from ..kv.view import kv_points
from ..results import Run
from ..role_figures import change_grid_chart
from ..roles import is_cube, is_cube_comparison
from .atlas import AtlasMap
from .chart import ChartView
from .circuits import CircuitGraph, DLABars, PatchingMap
from .headmap import HeadMap
from .kv import KvTradeoff

__all__ = ["figure_box", "run_views", "step_view"]


def _is_head_score(ds: xr.Dataset) -> bool:
    return "score" in ds and {"layer", "head"} <= set(ds["score"].dims)


def step_view(run: Run, step: str) -> ipywidgets.Widget | None:
    """The figure of ``step`` of ``run`` (see the module's docstring), or None for a step that takes none
    (a generate or score step: their numbers are in :class:`~headlab.widgets.Compare`)."""
    if step not in run.results:
        raise KeyError(f"run {run.name!r} has no step {step!r} (steps: {', '.join(run.results)})")
    ds = run.results[step]
    kind = circuit_kind(ds)
    method = ds.attrs.get("method", "")
    if kind == "patching" and not {"head", "kv_head"} & set(ds["score"].dims):
        score = resid_map(ds["score"])
        tokens = token_labels(ds, tokenizer_for(str(run.attrs.get("model", "")), run.attrs.get("model_revision")))
        return ChartView(token_chart(score.values, [f"L{int(v)}" for v in score["layer"].values], tokens,
                                     title=f"{step}: residual stream patching per layer and token", row_title="layer"))
    if kind == "patching":
        return PatchingMap(ds, title=f"{step}: {method or 'patching'} score")
    if kind == "dla":
        return DLABars(ds, title=f"{step}: direct logit attribution")
    if kind == "edges":
        return CircuitGraph(ds, title=f"{step}: circuit")
    if is_cube(ds):
        return AtlasMap(ds, title=f"{step}: roles of each head")
    if is_cube_comparison(ds):
        return ChartView(change_grid_chart(ds))
    if _is_head_score(ds):
        return HeadMap.from_run(run, step)
    return None


def run_views(run: Run) -> list[ipywidgets.Widget]:
    """The figures of every step of ``run`` in step order (:func:`step_view`), then one
    :class:`~headlab.widgets.KvTradeoff` when a step with a ``kv`` policy finished."""
    views = [v for v in (step_view(run, step) for step in run.results) if v is not None]
    if kv_points(run):
        views.append(KvTradeoff(run))
    return views


def figure_box(views: list[ipywidgets.Widget]) -> ipywidgets.Box:
    """``views`` side by side, wrapping onto new rows when the notebook is narrower than they are."""
    return ipywidgets.Box(views, layout=ipywidgets.Layout(flex_flow="row wrap", align_items="flex-start"))
