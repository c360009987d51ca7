"""Figures of a labelled head cube (:mod:`headlab.roles`): every head of a model scored and labelled by several
detectors, its causal check, and the comparison of two models. Vega-Lite charts (:mod:`headlab.figures`), shown
by ``headlab report``, by JupyterLab and by :func:`headlab.figures.save`; keyed on what a result stores, not on
the method that stored it.

- :func:`role_grid_chart`: the ``layer x head`` grid with each cell split into one stripe per role the head
  carries, coloured by role, the stripe's opacity growing with the score; a head with several roles shows
  them side by side, so it reads at 32 x 32;
- :func:`role_panels_chart`: small multiples, one ``layer x head`` panel per detector, the score as shade
  (divided by the detector's largest ``|score|``, so every panel uses the whole scale) and labelled heads
  outlined;
- :func:`causal_chart`: the causal check, per role the harm of ablating its top labelled heads beside the
  mean of random heads with mean ± 2 std of the draws, each bar saying "supported" or "NOT supported";
- :func:`change_grid_chart`: a comparison's ``score_diff`` per detector as small multiples on a diverging
  scale, with the heads that gained (triangle up) or lost (triangle down) the role marked;
- :func:`rank_correlation_chart`: the rank correlation of each detector's scores between the two models;
- :func:`cube_parts`: what a report shows for such a result, in order (figures, tables and sentences).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import altair as alt
import numpy as np
import xarray as xr
from altair.utils.schemapi import debug_mode

from . import figures
from .roles import (
    causal_rows,
    causal_sentence,
    changed_heads,
    detectors,
    heads_text,
    is_cube,
    is_cube_comparison,
    per_detector,
    roles_by_head,
    top_heads,
)

__all__ = ["CHANGE_SHAPES", "Part", "causal_chart", "cell_size", "change_grid_chart", "change_rows", "cube_parts",
           "grid_rows", "panel_rows", "rank_correlation_chart", "role_colours", "role_grid_chart", "role_panels_chart"]

CHANGE_SHAPES = {"gained": "triangle-up", "lost": "triangle-down"}
"""The glyph of a head that gained or lost a role in a comparison."""

_TABLEAU = ["#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1", "#ff9da7", "#9c755f",
            "#bab0ac"]


def role_colours(names: Sequence[str]) -> dict[str, str]:
    """One colour per detector, in order (Tableau 10, repeated past ten)."""
    return {n: _TABLEAU[i % len(_TABLEAU)] for i, n in enumerate(names)}


def cell_size(n_layers: int, n_heads: int, *, largest: int = 24, smallest: int = 6, span: int = 460) -> int:
    """The side of one cell in pixels: ``largest`` for small models, shrinking so that the grid's longer side
    stays near ``span`` pixels (32 heads: 14), never below ``smallest``."""
    return max(smallest, min(largest, span // max(n_layers, n_heads, 1)))


def _configure(chart: Any) -> Any:
    return (chart.configure(font="-apple-system,Segoe UI,Helvetica,Arial,sans-serif")
            .configure_axis(labelFontSize=11, titleFontSize=12, labelOverlap="greedy", titlePadding=6)
            .configure_title(fontSize=13, anchor="start").configure_legend(labelLimit=200)
            .configure_view(stroke="#bbbbbb"))


def _finite(v: Any) -> float | None:
    if v is None:
        return None
    f = float(v)
    return f if math.isfinite(f) else None


def _scores_texts(cube: xr.Dataset) -> np.ndarray:
    """Per (layer, head), every detector's score as text, labelled ones ticked (the tooltips' list)."""
    names = detectors(cube)
    score = cube["score"].transpose("detector", "layer", "head").values.astype(float)
    label = cube["label"].transpose("detector", "layer", "head").values.astype(bool)
    out = np.empty(score.shape[1:], dtype=object)
    for i, j in np.ndindex(*score.shape[1:]):
        out[i, j] = "; ".join(f"{n} {'nan' if not math.isfinite(score[d, i, j]) else format(score[d, i, j], '.3g')}"
                              + (" ✓" if label[d, i, j] else "") for d, n in enumerate(names))
    return out


def _max_abs(cube: xr.Dataset) -> dict[str, float]:
    out = {}
    for name in detectors(cube):
        v = np.abs(cube["score"].sel(detector=name).values.astype(float))
        v = v[np.isfinite(v)]
        out[name] = float(v.max()) if v.size and v.max() > 0 else 1.0
    return out


def _tick_step(n: int) -> int:
    """Every head (layer) labelled up to 16, else every 2nd, 4th, ... so that at most 16 labels show."""
    return 1 if n <= 16 else int(math.ceil(n / 16))


def _axis_values(n: int) -> list[float]:
    return [i + 0.5 for i in range(0, n, _tick_step(n))]


def _ordinal_axes(n_layers: int, n_heads: int) -> tuple[alt.X, alt.Y]:
    x = alt.X("head:O", title="head", axis=alt.Axis(labelAngle=0, values=list(range(0, n_heads,
                                                                                      _tick_step(n_heads)))))
    y = alt.Y("layer:O", title="layer", axis=alt.Axis(values=list(range(0, n_layers, _tick_step(n_layers)))))
    return x, y


def grid_rows(cube: xr.Dataset) -> list[dict[str, Any]]:
    """The data of :func:`role_grid_chart`: one row per (head, role) stripe, and one per head without a role
    (``role`` None); each row has ``layer, head, role, score`` (the role's score), ``shade`` (score divided by
    the detector's largest ``|score|``, clipped to [0, 1]), the stripe's ``x0, x1`` (the head's position along
    the axis plus the stripe's share of its cell) and ``y0, y1`` (the layer's), ``roles`` and ``scores`` (every
    detector's score, labelled ones ticked) for the tooltip."""
    rows = []
    biggest = _max_abs(cube)
    names = detectors(cube)
    score = cube["score"].transpose("detector", "layer", "head").values.astype(float)
    texts = _scores_texts(cube)
    layer_index = {int(v): i for i, v in enumerate(cube["layer"].values)}
    head_index = {int(v): j for j, v in enumerate(cube["head"].values)}
    for (layer, head), roles in roles_by_head(cube).items():
        i, j = layer_index[layer], head_index[head]
        tip = {"layer": layer, "head": head, "roles": ", ".join(roles) or "none", "scores": texts[i, j],
               "y0": i, "y1": i + 1}
        if not roles:
            rows.append({**tip, "role": None, "score": None, "shade": None, "x0": j, "x1": j + 1})
            continue
        for k, role in enumerate(roles):
            s = _finite(score[names.index(role), i, j])
            shade = None if s is None else min(1.0, max(0.0, s / biggest[role]))
            rows.append({**tip, "role": role, "score": s, "shade": shade,
                         "x0": j + k / len(roles), "x1": j + (k + 1) / len(roles)})
    return rows


def _positional_axes(n_layers: int, n_heads: int) -> tuple[alt.X, alt.Y]:
    x = alt.X("x0:Q", title="head", scale=alt.Scale(domain=[0, n_heads], nice=False, zero=True),
              axis=alt.Axis(values=_axis_values(n_heads), labelExpr="floor(datum.value)", grid=False, ticks=False))
    y = alt.Y("y0:Q", title="layer", scale=alt.Scale(domain=[0, n_layers], nice=False, zero=True, reverse=True),
              axis=alt.Axis(values=_axis_values(n_layers), labelExpr="floor(datum.value)", grid=False, ticks=False))
    return x, y


def role_grid_chart(cube: xr.Dataset, *, title: str | Sequence[str] = "", cell: int | None = None) -> figures.Chart:
    """The roles of every head on one ``layer x head`` grid (:func:`grid_rows`): a head's cell is split into a
    stripe per role, coloured by role (:func:`role_colours`), more opaque the higher its score; heads without a
    role are light grey and every labelled head is outlined. The tooltip lists the head's roles and every
    detector's score."""
    names = detectors(cube)
    n_layers, n_heads = cube.sizes["layer"], cube.sizes["head"]
    cell = cell or cell_size(n_layers, n_heads)
    rows = grid_rows(cube)
    colours = role_colours(names)
    x, y = _positional_axes(n_layers, n_heads)
    tip = [alt.Tooltip("layer:O"), alt.Tooltip("head:O"), alt.Tooltip("roles:N"), alt.Tooltip("scores:N")]
    base = alt.Chart().encode(x=x, x2="x1:Q", y=y, y2="y1:Q", tooltip=tip)
    empty = base.mark_rect(color="#eeeeee", stroke="#ffffff", strokeWidth=0.5).transform_filter(
        "datum.role === null")
    stripes = base.mark_rect().encode(
        color=alt.Color("role:N", title="role", scale=alt.Scale(domain=names, range=[colours[n] for n in names])),
        opacity=alt.Opacity("shade:Q", title="score / detector's max", scale=alt.Scale(domain=[0, 1],
                                                                                       range=[0.35, 1.0])),
        tooltip=[*tip, alt.Tooltip("role:N", title="this stripe"), alt.Tooltip("score:Q", format=".4g")],
    ).transform_filter("datum.role !== null")
    outline = alt.Chart().mark_rect(fill=None, stroke="#333333", strokeWidth=0.6).encode(
        x=x, x2="xe:Q", y=y, y2="y1:Q").transform_filter(
        "datum.role !== null && datum.x0 === floor(datum.x0)").transform_calculate(xe="datum.x0 + 1")
    n_labelled = sum(1 for r in rows if r["role"] is not None and r["x0"] == int(r["x0"]))
    title = title or [f"roles of each head ({n_labelled} of {n_layers * n_heads} heads carry at least one)",
                      "a stripe per role; opacity: score / the detector's largest"]
    chart = alt.layer(empty, stripes, outline).properties(width=cell * n_heads, height=cell * n_layers,
                                                          title=alt.TitleParams(text=title))
    return _with_data(_configure(chart), rows)


def _with_data(chart: Any, rows: list[dict[str, Any]]) -> Any:
    """``chart`` with its inline data set last, unvalidated: Altair copies a chart's data at every ``configure``
    call and validates an ``alt.Data`` row by row when it is made (seconds at 32 x 32 heads); the whole chart is
    validated when its specification is made (:func:`headlab.figures.figure_spec`)."""
    with debug_mode(False):
        chart.data = alt.Data(values=rows)
    return chart


def panel_rows(cube: xr.Dataset) -> list[dict[str, Any]]:
    """The data of :func:`role_panels_chart`: one row per (detector, layer, head) with ``panel`` (the detector
    and its threshold), ``score``, ``shade`` (score / the detector's largest ``|score|``), ``label`` and
    ``rank``."""
    biggest = _max_abs(cube)
    rows = []
    for name in detectors(cube):
        d = cube.sel(detector=name).transpose("layer", "head", ...)
        threshold = per_detector(cube, "threshold", name)
        n = int(d["label"].values.sum())
        panel = f"{name}: {n} labelled" + (f" (≥ {threshold:.3g})" if threshold is not None else "")
        score, label = d["score"].values.astype(float), d["label"].values.astype(bool)
        rank = d["rank"].values if "rank" in d else None
        for i, layer in enumerate(d["layer"].values.tolist()):
            for j, head in enumerate(d["head"].values.tolist()):
                s = _finite(score[i, j])
                rows.append({"detector": name, "panel": panel, "layer": int(layer), "head": int(head), "score": s,
                             "shade": None if s is None else s / biggest[name], "label": bool(label[i, j]),
                             "rank": int(rank[i, j]) if rank is not None else None,
                             "threshold": threshold})
    return rows


def _small_multiples(layers: list[Any], rows: list[dict[str, Any]], panels: list[str], columns: int,
                     cell: int, n_layers: int, n_heads: int, title: Any) -> figures.Chart:
    chart = alt.layer(*layers).properties(width=cell * n_heads, height=cell * n_layers)
    faceted = chart.facet(facet=alt.Facet("panel:N", sort=panels, title=None, header=alt.Header(
        labelFontSize=12, labelAnchor="start", labelLimit=max(cell * n_heads + 30, 220))), columns=columns,
        data=alt.Data(values=[]))
    return _with_data(_configure(faceted.properties(title=alt.TitleParams(text=title))), rows)


def role_panels_chart(cube: xr.Dataset, *, columns: int = 4, cell: int | None = None,
                      title: str | Sequence[str] = "") -> figures.Chart:
    """One small ``layer x head`` map per detector (:func:`panel_rows`), ``columns`` to a row: the score as
    shade (divided by the detector's largest ``|score|``; diverging around 0 when a score is negative), NaN grey,
    labelled heads outlined in black (red is a colour of the diverging scale). The tooltip gives the score, label,
    rank and threshold."""
    names = detectors(cube)
    n_layers, n_heads = cube.sizes["layer"], cube.sizes["head"]
    cell = cell or cell_size(n_layers, n_heads, span=240, smallest=5)
    rows = panel_rows(cube)
    signed = any(r["score"] is not None and r["score"] < 0 for r in rows)
    scale = (alt.Scale(scheme=figures.DIVERGING_SCHEME, reverse=True, domain=[-1, 1], domainMid=0) if signed
             else alt.Scale(scheme=figures.SEQUENTIAL_SCHEME, domain=[0, 1]))
    x, y = _ordinal_axes(n_layers, n_heads)
    tip = [alt.Tooltip("detector:N"), alt.Tooltip("layer:O"), alt.Tooltip("head:O"),
           alt.Tooltip("score:Q", format=".4g"), alt.Tooltip("label:N"), alt.Tooltip("rank:O"),
           alt.Tooltip("threshold:Q", format=".4g")]
    grey = alt.Chart().mark_rect(color=figures.NAN_COLOR).encode(x=x, y=y, tooltip=tip).transform_filter(
        "!isValid(datum.shade)")
    cells = alt.Chart().mark_rect().encode(x=x, y=y, tooltip=tip, color=alt.Color(
        "shade:Q", title="score / detector's max |score|", scale=scale)).transform_filter("isValid(datum.shade)")
    marked = alt.Chart().mark_rect(fill=None, stroke="#000000", strokeWidth=1.5).encode(
        x=x, y=y, tooltip=tip).transform_filter("datum.label")
    panels = list(dict.fromkeys(r["panel"] for r in rows))
    title = title or "score per detector (shade), labelled heads outlined"
    return _small_multiples([grey, cells, marked], rows, panels, min(columns, len(names)), cell, n_layers,
                            n_heads, title)


def causal_chart(cube: xr.Dataset, *, title: str | Sequence[str] = "") -> figures.Chart:
    """The causal check (:func:`headlab.roles.causal_rows`) as bars, per measured role: the harm done to its own
    metric by ablating its top labelled heads, then the random heads' mean with mean ± 2 std of the draws
    (drawn light, as a control; the label is supported when the first bar is positive and passes the control's
    upper end); the text past each bar says whether the label is supported."""
    rows = []
    for r in causal_rows(cube):
        if r["effect"] is None:
            continue
        role = r["detector"] + (f" ({r['metric']})" if r["metric"] else "")
        verdict = {True: "supported", False: "NOT supported", None: ""}[r["supported"]]
        top = f"top {r['k']} labelled" if r["k"] else "top labelled"
        rows.append({"bar": f"{r['detector']}: {top}", "value": r["effect"], "low": None, "high": None,
                     "note": verdict, "role": role, "control": False})
        if r["control_mean"] is not None:
            rows.append({"bar": f"{r['detector']}: random", "value": r["control_mean"], "low": r["control_low"],
                         "high": r["control_high"], "note": f"{r['draws']} draws", "role": role, "control": True})
    title = title or ["causal check: harm to the role's own metric when its top labelled heads are ablated",
                      "against random heads matched by layer (mean, ± 2 std of the draws)"]
    return figures.bar_chart(rows, category="bar", value="value", value_title="harm to the role's metric",
                             category_title="heads ablated", low="low", high="high", note="note", group="role",
                             marked="control", title=title, interval="mean ± 2 std")


def change_rows(comparison: xr.Dataset) -> list[dict[str, Any]]:
    """The data of :func:`change_grid_chart`: one row per (detector, layer, head) with ``panel``,
    ``score_diff``, ``change`` (``gained``, ``lost`` or None) and ``label_change``."""
    rows = []
    for name in detectors(comparison):
        d = comparison.sel(detector=name).transpose("layer", "head", ...)
        change, diff = d["label_change"].values.astype(int), d["score_diff"].values.astype(float)
        gained, lost = int((change > 0).sum()), int((change < 0).sum())
        rho = per_detector(comparison, "rank_correlation", name)
        panel = f"{name}: +{gained} / -{lost}" + (f", rank corr. {rho:.2f}" if rho is not None else "")
        for i, layer in enumerate(d["layer"].values.tolist()):
            for j, head in enumerate(d["head"].values.tolist()):
                c = int(change[i, j])
                rows.append({"detector": name, "panel": panel, "layer": int(layer), "head": int(head),
                             "score_diff": _finite(diff[i, j]), "label_change": c,
                             "change": "gained" if c > 0 else "lost" if c < 0 else None})
    return rows


def change_grid_chart(comparison: xr.Dataset, *, columns: int = 4, cell: int | None = None,
                      title: str | Sequence[str] = "") -> figures.Chart:
    """A comparison of two cubes as one small ``layer x head`` map per detector (:func:`change_rows`): the score
    difference (second model minus first) on a diverging scale centred at 0, the heads that gained the role
    marked with a triangle up and those that lost it with a triangle down (:data:`CHANGE_SHAPES`)."""
    names = detectors(comparison)
    n_layers, n_heads = comparison.sizes["layer"], comparison.sizes["head"]
    cell = cell or cell_size(n_layers, n_heads, span=260, smallest=6)
    rows = change_rows(comparison)
    finite = [abs(r["score_diff"]) for r in rows if r["score_diff"] is not None]
    m = max(finite) if finite and max(finite) > 0 else 1.0
    x, y = _ordinal_axes(n_layers, n_heads)
    tip = [alt.Tooltip("detector:N"), alt.Tooltip("layer:O"), alt.Tooltip("head:O"),
           alt.Tooltip("score_diff:Q", format=".4g"), alt.Tooltip("change:N")]
    grey = alt.Chart().mark_rect(color=figures.NAN_COLOR).encode(x=x, y=y, tooltip=tip).transform_filter(
        "!isValid(datum.score_diff)")
    cells = alt.Chart().mark_rect().encode(x=x, y=y, tooltip=tip, color=alt.Color(
        "score_diff:Q", title="score difference", scale=alt.Scale(
            scheme=figures.DIVERGING_SCHEME, reverse=True, domain=[-m, m], domainMid=0))).transform_filter(
        "isValid(datum.score_diff)")
    glyphs = alt.Chart().mark_point(filled=True, color="#111111", stroke="#ffffff", strokeWidth=0.5,
                                    size=max(16, int(cell * cell * 0.8))).encode(
        x=x, y=y, tooltip=tip, shape=alt.Shape("change:N", title="label", scale=alt.Scale(
            domain=list(CHANGE_SHAPES), range=list(CHANGE_SHAPES.values())))).transform_filter("datum.change")
    panels = list(dict.fromkeys(r["panel"] for r in rows))
    title = title or "score difference per detector (second model - first); role gained ▲ / lost ▼"
    return _small_multiples([grey, cells, glyphs], rows, panels, min(columns, len(names)), cell, n_layers,
                            n_heads, title)


def rank_correlation_chart(comparison: xr.Dataset, *, title: str | Sequence[str] = "") -> figures.Chart:
    """The rank correlation of each detector's scores between the two compared models, one bar per detector
    on a fixed axis from -1 to 1."""
    rows = [{"detector": r["detector"], "rho": r["rank_correlation"],
             "note": f"+{len(r['gained'])} / -{len(r['lost'])} labels"} for r in changed_heads(comparison)]
    return figures.bar_chart(rows, category="detector", value="rho", value_title="rank correlation of scores",
                             note="note", value_domain=(-1.0, 1.0),
                             title=title or "rank correlation of each detector's scores between the two models")


@dataclass(frozen=True)
class Part:
    """One piece of a report section: a figure (``chart`` with its ``name``), a table (``header`` and
    ``rows``) or a sentence (``text``), under an optional ``heading``."""

    heading: str = ""
    name: str = ""
    chart: figures.Chart | None = None
    header: Sequence[str] = ()
    rows: Sequence[Sequence[Any]] = field(default_factory=list)
    text: str = ""


def _top_table(cube: xr.Dataset, k: int) -> Part:
    rows, seen = [], set()
    for r in top_heads(cube, k):  # where the threshold comes from: said once per detector
        rows.append([r["detector"], r["rank"], r["layer"], r["head"], _cell(r["score"]), "yes" if r["label"] else "",
                     _cell(r["threshold"]), _cell(r["margin"]), _cell(r["null_z"]),
                     "" if r["detector"] in seen else r["threshold_source"]])
        seen.add(r["detector"])
    return Part(heading=f"top {k} heads per role (margin: score - threshold; null z: (score - null mean) / null std)",
                header=["detector", "rank", "layer", "head", "score", "label", "threshold", "margin", "null z",
                        "threshold from"], rows=rows)


def _cell(v: float | None) -> Any:
    return "" if v is None else float(v)


def cube_parts(ds: xr.Dataset, step: str = "", *, top: int = 5) -> list[Part]:
    """What a report shows for a cube (:func:`headlab.roles.is_cube`) and a comparison
    (:func:`headlab.roles.is_cube_comparison`), in order: the role grid, the per-detector panels, the top heads
    per role, the causal check (a chart and one sentence per role), then the comparison's change grid, rank
    correlations and the heads that gained or lost each role. Figure names start with ``step``."""
    prefix = f"{step}: " if step else ""
    parts: list[Part] = []
    if is_cube(ds):
        parts.append(Part(heading="roles of every head", name=f"{prefix}roles", chart=role_grid_chart(ds)))
        parts.append(Part(name=f"{prefix}score per detector", chart=role_panels_chart(ds)))
        parts.append(_top_table(ds, top))
        causal = causal_rows(ds)
        if any(r["effect"] is not None for r in causal):
            parts.append(Part(heading="causal check", name=f"{prefix}causal check", chart=causal_chart(ds)))
        parts.extend(Part(text=causal_sentence(r)) for r in causal)
    if is_cube_comparison(ds):
        parts.append(Part(heading="comparison of two models", name=f"{prefix}changes",
                          chart=change_grid_chart(ds)))
        if "rank_correlation" in ds:
            parts.append(Part(name=f"{prefix}rank correlation", chart=rank_correlation_chart(ds)))
        parts.append(Part(heading="heads that gained or lost a role", header=[
            "detector", "gained", "lost", "rank correlation"], rows=[
            [r["detector"], heads_text(r["gained"]), heads_text(r["lost"]), _cell(r["rank_correlation"])]
            for r in changed_heads(ds)]))
    return parts
