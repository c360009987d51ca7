"""Figures of head rankings, keyed on what a result stores rather than on the method that stored it:

- :func:`ranked_accuracy_chart`: a ``score (layer, head)`` of accuracies with the data set's ``chance`` attribute
  (the accuracy of always answering the most frequent class), each layer's heads sorted by accuracy, highest
  first, layer down and rank across, the colour scale diverging and centred at chance, and each cell's tooltip
  giving the real head index (:func:`ranked_by_layer` gives the same table as an array);
- :func:`masking_curve_chart`: a ``metric (fraction)`` of heads masked in ranking order beside its two
  controls, ``reverse (fraction)`` and the random rankings' ``random_mean`` with its spread ``random_std``
  (a band), and ``base``, the unmasked metric, drawn at fraction 0.

Both return Vega-Lite charts (:mod:`headlab.figures`), shown by ``headlab report``, by JupyterLab and by
:func:`headlab.figures.save`.
"""

from __future__ import annotations

import json
import math
from typing import Any

import altair as alt
import numpy as np
import xarray as xr

from . import figures

__all__ = ["CURVE_VARIABLES", "has_chance", "is_masking_curve", "masking_curve_chart", "ranked_accuracy_chart",
           "ranked_by_layer"]

CURVE_VARIABLES = ("base", "metric", "reverse", "random_mean", "random_std")
"""The variables a masking curve stores (each over ``fraction`` but ``base``)."""


def has_chance(ds: xr.Dataset) -> bool:
    """Whether ``ds`` is a map of accuracies: a ``score`` over ``layer`` and ``head`` and a finite numeric
    ``chance`` attribute."""
    chance = ds.attrs.get("chance")
    return ("score" in ds and {"layer", "head"} <= set(ds["score"].dims)
            and isinstance(chance, (int, float, np.number)) and math.isfinite(float(chance)))


def is_masking_curve(ds: xr.Dataset) -> bool:
    """Whether ``ds`` holds a masking curve and its controls (:data:`CURVE_VARIABLES`, over ``fraction``)."""
    return all(v in ds for v in CURVE_VARIABLES) and all(
        "fraction" in ds[v].dims for v in CURVE_VARIABLES if v != "base")


def _head_scores(score: xr.DataArray) -> xr.DataArray:
    extra = [d for d in score.dims if d not in ("layer", "head")]
    return (score.mean(extra) if extra else score).transpose("layer", "head")


def ranked_by_layer(score: xr.DataArray) -> xr.Dataset:
    """Each layer's heads sorted by ``score``, highest first (ties: lower head first; NaN last).

    ``score`` has dims ``layer`` and ``head`` (any other dim is averaged over). Returns ``value (layer, rank)``,
    the sorted scores, and ``head (layer, rank)``, the head index at each rank."""
    da = _head_scores(score)
    values = da.values.astype(float)
    keys = np.where(np.isnan(values), np.inf, -values)
    order = np.argsort(keys, axis=1, kind="stable")
    heads = np.asarray(da["head"].values if "head" in da.coords else np.arange(values.shape[1]))
    layers = da["layer"].values if "layer" in da.coords else np.arange(values.shape[0])
    rank = np.arange(values.shape[1])
    return xr.Dataset({"value": (("layer", "rank"), np.take_along_axis(values, order, axis=1)),
                       "head": (("layer", "rank"), heads[order])},
                      coords={"layer": layers, "rank": rank})


def _finite(v: Any) -> float | None:
    f = float(v)
    return f if math.isfinite(f) else None


def _configure(chart: Any, width: int, height: int, title: str | list[str]) -> Any:
    return chart.properties(width=width, height=height, title=alt.TitleParams(text=title, anchor="start")) \
        .configure_axis(labelFontSize=11, titleFontSize=12, labelOverlap="greedy", titlePadding=6) \
        .configure_view(stroke="#bbbbbb")


def ranked_accuracy_chart(ds: xr.Dataset, *, title: str | None = None, cell: int = 20) -> figures.Chart:
    """The accuracy map of ``ds`` (:func:`has_chance`) with each layer's heads sorted by accuracy: layer down,
    the rank within the layer across, and the colour diverging from ``ds.attrs['chance']`` (white) to the
    best and worst accuracies. Each cell's tooltip gives the layer, the rank, the head and its accuracy (and
    ``accuracy_std`` when stored). NaN cells are grey."""
    if not has_chance(ds):
        raise ValueError("ranked_accuracy_chart needs a score over (layer, head) and a numeric attrs['chance']")
    chance = float(ds.attrs["chance"])
    table = ranked_by_layer(ds["score"])
    std = None
    if "accuracy_std" in ds and {"layer", "head"} <= set(ds["accuracy_std"].dims):
        std = _head_scores(ds["accuracy_std"])
    rows = []
    for i, layer in enumerate(table["layer"].values.tolist()):
        for r in table["rank"].values.tolist():
            head = int(table["head"].values[i, r])
            row = {"layer": int(layer), "rank": int(r), "head": head,
                   "accuracy": _finite(table["value"].values[i, r])}
            if std is not None:
                row["accuracy_std"] = _finite(std.sel(layer=layer, head=head))
            rows.append(row)
    finite = table["value"].values[np.isfinite(table["value"].values)]
    spread = max(float(np.abs(finite - chance).max()) if finite.size else 0.0, 1e-6)
    scale = alt.Scale(scheme=figures.DIVERGING_SCHEME, reverse=True, domain=[chance - spread, chance + spread],
                      domainMid=chance)
    tips = [alt.Tooltip("layer:O"), alt.Tooltip("rank:O", title="rank in layer"), alt.Tooltip("head:O"),
            alt.Tooltip("accuracy:Q", format=".4g")]
    if std is not None:
        tips.append(alt.Tooltip("accuracy_std:Q", title="std over folds", format=".3g"))
    n_layers, n_ranks = table.sizes["layer"], table.sizes["rank"]
    base = alt.Chart(alt.Data(values=rows)).encode(
        x=alt.X("rank:O", title="heads of the layer, sorted by accuracy (rank)", axis=alt.Axis(labelAngle=0)),
        y=alt.Y("layer:O", title="layer", sort=[int(v) for v in table["layer"].values]), tooltip=tips)
    grey = base.mark_rect().encode(color=alt.value(figures.NAN_COLOR)).transform_filter("!isValid(datum.accuracy)")
    ticks = sorted({round(chance - spread, 4), round(chance, 4), round(chance + spread, 4)})
    cells = base.mark_rect().encode(color=alt.Color(
        "accuracy:Q", title="accuracy", scale=scale,
        legend=alt.Legend(values=ticks, format=".3g", gradientLength=max(80, min(200, cell * n_layers))))
    ).transform_filter(
        "isValid(datum.accuracy)")
    title = title or f"held-out accuracy per head, sorted within each layer (chance {chance:.3g})"
    return _configure(alt.layer(grey, cells), max(60, cell * n_ranks), max(40, cell * n_layers), title)


def _metric_name(ds: xr.Dataset) -> str:
    """The measured metric's name from the step's stored config (``metric``, else the measuring action's first
    metric), or ``metric``."""
    try:
        config = json.loads(str(ds.attrs.get("config", "{}")))
    except ValueError:
        return "metric"
    if not isinstance(config, dict):
        return "metric"
    if isinstance(config.get("metric"), str):
        return config["metric"]
    measure = config.get("measure")
    for action in (measure.values() if isinstance(measure, dict) else []):
        metrics = action.get("metrics") if isinstance(action, dict) else None
        first = metrics[0] if isinstance(metrics, list) and metrics else None
        if isinstance(first, dict):
            first = first.get("kind")
        if isinstance(first, str):
            return first
    return "metric"


def masking_curve_chart(ds: xr.Dataset, *, title: str | None = None, metric_name: str | None = None,
                        ) -> figures.Chart:
    """The masking curve of ``ds`` (:func:`is_masking_curve`) and its controls on one chart: x the fraction of
    heads masked (0 is the unmasked ``base``), y the metric from 0; the ranking, its reverse and the mean of the
    random rankings as lines, the random mean plus and minus ``random_std`` as a band (cut at 0 when no stored
    value is negative). Any dim besides
    ``fraction`` (sweep cells) is averaged over."""
    if not is_masking_curve(ds):
        raise ValueError(f"masking_curve_chart needs {', '.join(CURVE_VARIABLES)} over fraction")

    def curve(name: str) -> list[float]:
        da = ds[name]
        extra = [d for d in da.dims if d != "fraction"]
        return (da.mean(extra) if extra else da).values.astype(float).tolist()

    base = ds["base"]
    base_value = float(base.mean()) if base.ndim else float(base)
    fractions = [0.0, *[float(f) for f in ds["fraction"].values]]
    mean, std = curve("random_mean"), curve("random_std")
    ranked, reverse = curve("metric"), curve("reverse")
    band = [(base_value, base_value), *[(m - s, m + s) for m, s in zip(mean, std, strict=True)]]
    non_negative = all(v >= 0 for v in (base_value, *ranked, *reverse, *mean) if math.isfinite(v))
    cut = non_negative and any(lo < 0 for lo, _ in band)
    if cut:  # a metric that is never negative: the band stops at 0
        band = [(max(lo, 0.0), hi) for lo, hi in band]
    n_random = ds.sizes.get("draw")
    random_name = (f"random ranking (mean of {n_random}" if n_random else "random ranking (mean") + \
        (", ±1 std cut at 0)" if cut else ", ±1 std)")
    series = {"least important first": [base_value, *ranked],
              "most important first (reverse)": [base_value, *reverse],
              random_name: [base_value, *mean]}
    name = metric_name or _metric_name(ds)
    return figures.line_chart(fractions, series, x_title="fraction of heads masked", y_title=name,
                              title=title or f"{name} as heads are masked (fraction 0: unmasked)",
                              intervals={random_name: band}, y_zero=True, series_title="order")
