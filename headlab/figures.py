"""The figures of reports, notebook widgets and exported files: Vega-Lite charts built with Vega-Altair.

One builder per kind of figure, each returning an :class:`altair.Chart` (or a layered chart) that JupyterLab
renders natively, that a report page embeds (:func:`to_html_fragment` plus :func:`page_script` once per page)
and that :func:`save` writes as SVG, PNG or a standalone HTML page:

- :func:`heatmap`: a value over two named dimensions (``layer x head`` by default), with a sequential colour
  scale for non-negative values and a diverging one centred at 0 for signed values (:func:`color_scale_kind`);
- :func:`line_chart`: one line per series against a shared x, optionally with an interval band;
- :func:`scatter`: points with a text label beside each one (step ids), optionally joined per series;
- :func:`bar_chart`: one bar per category with its interval as an error bar and a text (``n=...``) at its end.

Every axis has a title, every mark a tooltip; byte counts are shown in MiB (:func:`mib`). Pages open with no
network: the Vega, Vega-Lite and vega-embed JavaScript comes from ``vl-convert-python`` and is inlined once
per page by :func:`page_script`; SVG and PNG are rendered by the same library, without a browser.
"""

from __future__ import annotations

import contextlib
import functools
import html
import json
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import altair as alt
import numpy as np
import vl_convert
import xarray as xr

__all__ = [
    "FIGURE_CLASS", "NAN_COLOR", "SEQUENTIAL_SCHEME", "DIVERGING_SCHEME", "Chart", "ScaleKind", "bar_chart",
    "color_scale_kind", "combine", "figure_spec", "heatmap", "line_chart", "mib", "page_script", "save", "scatter",
    "standalone_html", "to_html_fragment", "to_svg",
]

Chart = alt.TopLevelMixin
"""Any chart this module builds (a single, layered or concatenated Altair chart)."""

ScaleKind = Literal["auto", "sequential", "diverging"]
"""A heatmap's colour scale: chosen from the data (``auto``), or forced."""

SEQUENTIAL_SCHEME = "viridis"
"""The colour scheme of non-negative values (scores, attention, probabilities)."""
DIVERGING_SCHEME = "redblue"
"""The colour scheme of signed values, centred at 0 and reversed (Vega's redblue runs red to blue), so that negative
is blue and positive red."""
NAN_COLOR = "#dddddd"
"""The colour of an undefined (NaN) cell."""
FIGURE_CLASS = "headlab-figure"
"""The CSS class of the ``<div>`` that holds one chart in a page (:func:`to_html_fragment`)."""

_MIB = float(2 ** 20)
_FONT = "-apple-system,Segoe UI,Helvetica,Arial,sans-serif"
_CONFIG = {
    "axis": {"labelFontSize": 11, "titleFontSize": 12, "labelOverlap": "greedy", "labelLimit": 160,
             "titlePadding": 6},
    "title": {"fontSize": 13, "anchor": "start"},
    "legend": {"labelLimit": 200},
    "view": {"stroke": "#bbbbbb"},
}


def mib(nbytes: float) -> float:
    """``nbytes`` in MiB (2**20 bytes), the unit byte axes are drawn in."""
    return float(nbytes) / _MIB


def _finite(v: Any) -> float | None:
    """A JSON-ready number: ``None`` (Vega's null) for NaN, infinities and missing values."""
    if v is None:
        return None
    f = float(v)
    return f if math.isfinite(f) else None


def _plain(v: Any) -> Any:
    """A coordinate value as a plain JSON value."""
    if isinstance(v, np.generic):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, (str, int, float, bool)) or v is None:
        return v
    return str(v)


def _configure(chart: Chart) -> Chart:
    return (chart.configure(font=_FONT).configure_axis(**_CONFIG["axis"]).configure_title(**_CONFIG["title"])
            .configure_legend(**_CONFIG["legend"]).configure_view(**_CONFIG["view"]))


def _sized(chart: Chart, width: int, height: int, title: str | Sequence[str]) -> Chart:
    props: dict[str, Any] = {"width": width, "height": height}
    if title:
        props["title"] = alt.TitleParams(text=title if isinstance(title, str) else list(title))
    return _configure(chart.properties(**props))


def color_scale_kind(values: np.ndarray | xr.DataArray | Sequence[float]) -> Literal["sequential", "diverging"]:
    """``diverging`` when ``values`` has a finite value below 0, else ``sequential``."""
    arr = np.asarray(getattr(values, "values", values), dtype=float)
    finite = arr[np.isfinite(arr)]
    return "diverging" if finite.size and float(finite.min()) < 0 else "sequential"


def _color_scale(values: np.ndarray, kind: ScaleKind, vmin: float | None, vmax: float | None) -> alt.Scale:
    kind = color_scale_kind(values) if kind == "auto" else kind
    finite = values[np.isfinite(values)]
    if kind == "diverging":
        m = max(abs(vmin) if vmin is not None else 0.0, abs(vmax) if vmax is not None else 0.0,
                float(np.abs(finite).max()) if finite.size and vmin is None and vmax is None else 0.0)
        m = m if m > 0 else 1.0
        return alt.Scale(scheme=DIVERGING_SCHEME, reverse=True, domain=[-m, m], domainMid=0)
    lo = vmin if vmin is not None else (float(finite.min()) if finite.size else 0.0)
    hi = vmax if vmax is not None else (float(finite.max()) if finite.size else 1.0)
    lo = min(lo, 0.0) if vmin is None and lo >= 0 else lo  # non-negative scores start at 0
    if hi <= lo:
        hi = lo + 1.0
    return alt.Scale(scheme=SEQUENTIAL_SCHEME, domain=[lo, hi])


def heatmap(values: xr.DataArray | np.ndarray, *, x: str = "head", y: str = "layer", value: str = "score",
            title: str | Sequence[str] = "", x_title: str | None = None, y_title: str | None = None,
            x_labels: Sequence[Any] | None = None, y_labels: Sequence[Any] | None = None,
            scale: ScaleKind = "auto", vmin: float | None = None, vmax: float | None = None,
            highlight: Sequence[tuple[Any, Any]] = (), cell: int = 18, max_width: int = 900) -> Chart:
    """``values`` over two dimensions as a grid of coloured cells, ``y`` down and ``x`` across.

    ``values`` is a DataArray with dims ``y`` and ``x`` (transposed to that order) or a 2-D array. Tick labels
    are the coordinates, or ``x_labels`` / ``y_labels`` (token strings, say). The colour scale is sequential
    from 0 for non-negative values and diverging and centred at 0 for signed ones (``scale="auto"``), or
    forced; ``vmin`` / ``vmax`` fix its range. NaN cells are grey. Cells at ``(y, x)`` in ``highlight`` (by
    coordinate value) are outlined. Each cell's tooltip gives both coordinates and the value.
    """
    if isinstance(values, xr.DataArray):
        da = values.transpose(y, x)
        ys = [_plain(v) for v in (da[y].values if y in da.coords else range(da.sizes[y]))]
        xs = [_plain(v) for v in (da[x].values if x in da.coords else range(da.sizes[x]))]
        arr = np.asarray(da.values, dtype=float)
    else:
        arr = np.asarray(values, dtype=float)
        ys, xs = list(range(arr.shape[0])), list(range(arr.shape[1]))
    y_text = [str(v) for v in (y_labels if y_labels is not None else ys)]
    x_text = [str(v) for v in (x_labels if x_labels is not None else xs)]
    # positions keep repeated labels (the same token twice) apart; the axis shows the label of each position
    rows = [{"_y": i, "_x": j, y: ys[i], x: xs[j], "_ylabel": y_text[i], "_xlabel": x_text[j],
             value: _finite(arr[i, j])} for i in range(arr.shape[0]) for j in range(arr.shape[1])]
    marked = {(_plain(a), _plain(b)) for a, b in highlight}
    for r in rows:
        r["_marked"] = (r[y], r[x]) in marked
    ylab = json.dumps(dict(enumerate(y_text)))
    xlab = json.dumps(dict(enumerate(x_text)))
    width = min(max_width, max(cell * len(xs), 60))
    x_axis = alt.Axis(title=x_title or x, labelExpr=f"{xlab}[datum.value]", labelAngle=0 if max(
        (len(t) for t in x_text), default=1) <= 3 else -45)
    y_axis = alt.Axis(title=y_title or y, labelExpr=f"{ylab}[datum.value]")
    base = alt.Chart(alt.Data(values=rows)).encode(
        x=alt.X("_x:O", axis=x_axis, sort=list(range(len(xs)))),
        y=alt.Y("_y:O", axis=y_axis, sort=list(range(len(ys)))),
        tooltip=[alt.Tooltip("_ylabel:N", title=y_title or y), alt.Tooltip("_xlabel:N", title=x_title or x),
                 alt.Tooltip(f"{value}:Q", title=value, format=".4g")])
    grey = base.mark_rect().encode(color=alt.value(NAN_COLOR)).transform_filter(f"!isValid(datum['{value}'])")
    cells = base.mark_rect().encode(
        color=alt.Color(f"{value}:Q", title=value, scale=_color_scale(arr, scale, vmin, vmax),
                        legend=alt.Legend(gradientLength=max(60, min(200, cell * len(ys)))))
    ).transform_filter(f"isValid(datum['{value}'])")
    layers = [grey, cells]
    if marked:
        layers.append(base.mark_rect(fill=None, stroke="#e4002b", strokeWidth=2)
                      .transform_filter("datum._marked"))
    return _sized(alt.layer(*layers), width, max(cell * len(ys), 40), title)


def line_chart(xs: Sequence[Any], series: Mapping[str, Sequence[float]], *, x_title: str, y_title: str,
               title: str | Sequence[str] = "", intervals: Mapping[str, Sequence[tuple[float, float]]] | None = None,
               y_zero: bool = False, series_title: str = "series", width: int = 380, height: int = 220) -> Chart:
    """One line with point markers per series against ``xs``; numeric ``xs`` on a linear axis, others as
    categories in the given order; up to 12 numeric xs are the ticks themselves. ``intervals`` (per series, one ``(low, high)`` per x) draws a band.
    ``y_zero`` starts the y axis at 0 (for ratios). Points with a NaN value are left out."""
    numeric = all(isinstance(v, (int, float, np.number)) and not isinstance(v, bool) for v in xs)
    rows = []
    for name, ys in series.items():
        bands = (intervals or {}).get(name)
        for k, (xv, yv) in enumerate(zip(xs, ys, strict=True)):
            if _finite(yv) is None:
                continue
            row = {"x": _plain(xv) if numeric else str(_plain(xv)), "y": _finite(yv), series_title: name}
            if bands is not None:
                row["low"], row["high"] = _finite(bands[k][0]), _finite(bands[k][1])
            rows.append(row)
    whole = numeric and all(float(v).is_integer() for v in xs)
    ticks = alt.Axis(values=[_plain(v) for v in xs], format="d" if whole else ".4~g") if len(set(xs)) <= 12 \
        else alt.Axis(format="~g")
    x_enc = alt.X("x:Q", title=x_title, scale=alt.Scale(zero=False), axis=ticks) if numeric else \
        alt.X("x:O", title=x_title, sort=[str(_plain(v)) for v in xs], axis=alt.Axis(labelAngle=0))
    y_enc = alt.Y("y:Q", title=y_title, scale=alt.Scale(zero=y_zero))
    color = alt.Color(f"{series_title}:N", title=series_title, sort=list(series))
    base = alt.Chart(alt.Data(values=rows)).encode(x=x_enc, color=color)
    tip = [alt.Tooltip(f"{series_title}:N"), alt.Tooltip("x:Q" if numeric else "x:N", title=x_title),
           alt.Tooltip("y:Q", title=y_title, format=".4g")]
    layers = []
    if intervals:
        layers.append(base.mark_area(opacity=0.2).encode(y=alt.Y("low:Q", title=y_title), y2="high:Q"))
    layers.append(base.mark_line(point=True).encode(y=y_enc, tooltip=tip))
    return _sized(alt.layer(*layers), width, height, title)


def scatter(points: Sequence[Mapping[str, Any]], *, x: str, y: str, x_title: str, y_title: str,
            label: str = "label", series: str | None = None, title: str | Sequence[str] = "",
            x_bytes: bool = False, x_zero: bool = False, y_zero: bool = False,
            x_domain: tuple[float, float] | None = None, y_domain: tuple[float, float] | None = None,
            connect: bool = False, tooltip: Sequence[str] = (), width: int = 380, height: int = 240) -> Chart:
    """Points at ``(point[x], point[y])``, each with its ``point[label]`` written beside it; coloured by
    ``point[series]`` when given (and joined in order of x per series when ``connect``).

    ``x_bytes`` converts x from bytes to MiB (the axis title gains ``(MiB)``). ``x_zero`` / ``y_zero`` start an
    axis at 0 (ratios); ``x_domain`` / ``y_domain`` fix it. ``tooltip`` names extra fields of the points shown
    on hover, besides the label and both coordinates. Points with a non-finite coordinate are left out."""
    rows = []
    for p in points:
        xv, yv = _finite(p[x]), _finite(p[y])
        if xv is None or yv is None:
            continue
        row = {k: _plain(v) for k, v in p.items() if isinstance(v, (str, int, float, bool, np.generic)) or v is None}
        row["_x"] = mib(xv) if x_bytes else xv
        row["_y"] = yv
        rows.append(row)
    xt = f"{x_title} (MiB)" if x_bytes else x_title
    x_scale = alt.Scale(zero=x_zero, nice=True) if x_domain is None else alt.Scale(domain=list(x_domain))
    y_scale = alt.Scale(zero=y_zero, nice=True) if y_domain is None else alt.Scale(domain=list(y_domain))
    enc = {"x": alt.X("_x:Q", title=xt, scale=x_scale, axis=alt.Axis(format="~g", tickCount=6)),
           "y": alt.Y("_y:Q", title=y_title, scale=y_scale, axis=alt.Axis(format="~g", tickCount=6))}
    tip = [alt.Tooltip(f"{label}:N", title="point"), alt.Tooltip("_x:Q", title=xt, format=".4g"),
           alt.Tooltip("_y:Q", title=y_title, format=".4g"), *[alt.Tooltip(f"{t}:N") for t in tooltip]]
    if series:
        enc["color"] = alt.Color(f"{series}:N", title=series)
        tip.insert(1, alt.Tooltip(f"{series}:N"))
    base = alt.Chart(alt.Data(values=rows)).encode(**enc)
    layers = []
    if connect and series:
        layers.append(base.mark_line(opacity=0.6).encode(order="_x:Q", detail=f"{series}:N"))
    layers.append(base.mark_point(filled=True, size=60).encode(tooltip=tip))
    _place_labels(rows, label, width, height, x_domain, y_domain, x_zero, y_zero)
    for dy in sorted({r["_dy"] for r in rows}):  # one text layer per line a label moved by
        layers.append(base.mark_text(align="left", dx=6, dy=-6 + dy, fontSize=10)
                      .encode(text=f"{label}:N", color=alt.value("#333333")).transform_filter(f"datum._dy == {dy}"))
    return _sized(alt.layer(*layers), width, height, title)


def _place_labels(rows: list[dict[str, Any]], label: str, width: int, height: int,
                  x_domain: tuple[float, float] | None, y_domain: tuple[float, float] | None,
                  x_zero: bool, y_zero: bool, char: float = 5.5, line: float = 11.0) -> None:
    """Set each row's ``_dy`` (pixels) so that point labels do not cover each other: a label that would
    overlap one placed before it moves up a line, else down, a few lines at most (greedy, in point order)."""
    def span(values: list[float], fixed: tuple[float, float] | None, zero: bool) -> tuple[float, float]:
        if fixed is not None:
            return float(fixed[0]), float(fixed[1])
        lo, hi = min(values + ([0.0] if zero else [])), max(values + ([0.0] if zero else []))
        return (lo, hi) if hi > lo else (lo - 0.5, hi + 0.5)

    if not rows:
        return
    (x0, x1), (y0, y1) = span([r["_x"] for r in rows], x_domain, x_zero), span([r["_y"] for r in rows], y_domain,
                                                                              y_zero)
    placed: list[tuple[float, float, float, float]] = []
    for r in rows:
        px, py = (r["_x"] - x0) / (x1 - x0) * width, (1 - (r["_y"] - y0) / (y1 - y0)) * height
        w = char * len(str(r.get(label, "")))
        for dy in (0.0, -line, line, -2 * line, 2 * line, -3 * line, 3 * line):
            box = (px + 6, py - 6 + dy - line / 2, px + 6 + w, py - 6 + dy + line / 2)
            if not any(box[0] < b[2] and b[0] < box[2] and box[1] < b[3] and b[1] < box[3] for b in placed):
                break
        else:
            dy = 0.0
            box = (px + 6, py - 6 - line / 2, px + 6 + w, py - 6 + line / 2)
        r["_dy"] = dy
        placed.append(box)


def bar_chart(rows: Sequence[Mapping[str, Any]], *, category: str, value: str, value_title: str,
              category_title: str | None = None, low: str | None = None, high: str | None = None,
              group: str | None = None, note: str | None = None, marked: str | None = None,
              title: str | Sequence[str] = "", value_domain: tuple[float, float] | None = None,
              value_zero: bool = True, width: int = 360, bar: int = 20, interval: str = "95%") -> Chart:
    """Horizontal bars, one per row in the given order, from 0 to ``row[value]``; ``row[low]`` to
    ``row[high]`` as an error bar; ``row[note]`` (``n=96``) written past the end of the bar or interval.

    ``group`` colours bars by that field (steps sharing a task); ``marked`` names a boolean field whose true
    rows (controls) are drawn light with a dashed outline, and named in the tooltip. Signed values get bars either
    side of a zero rule. ``interval`` names the error bar in the tooltip (``95% low``, ``95% high``)."""
    data = []
    for r in rows:
        d = {k: _plain(v) for k, v in r.items()}
        d["_v"] = _finite(r[value])
        if low and high:
            d["_lo"], d["_hi"] = _finite(r[low]), _finite(r[high])
        ends = [v for v in (d["_v"], d.get("_hi")) if v is not None]
        d["_end"] = max(ends) if ends else 0.0
        data.append(d)
    order = [str(d[category]) for d in data]
    signed = any(d["_v"] is not None and d["_v"] < 0 for d in data)
    scale = alt.Scale(domain=list(value_domain)) if value_domain else alt.Scale(zero=value_zero, nice=True)
    y_enc = alt.Y(f"{category}:N", sort=order, title=category_title or category,
                  axis=alt.Axis(labelLimit=260))
    x_enc = alt.X("_v:Q", title=value_title, scale=scale, axis=alt.Axis(format="~g"))
    tip = [alt.Tooltip(f"{category}:N", title=category_title or category),
           alt.Tooltip("_v:Q", title=value_title, format=".4g")]
    if low and high:
        tip += [alt.Tooltip("_lo:Q", title=f"{interval} low", format=".4g"),
                alt.Tooltip("_hi:Q", title=f"{interval} high", format=".4g")]
    if note:
        tip.append(alt.Tooltip(f"{note}:N", title="n"))
    if group:
        tip.insert(1, alt.Tooltip(f"{group}:N"))
    if marked:
        tip.append(alt.Tooltip(f"{marked}:N", title="control"))
    base = alt.Chart(alt.Data(values=data)).encode(y=y_enc)
    bar_enc: dict[str, Any] = {"x": x_enc, "tooltip": tip}
    if group:
        bar_enc["color"] = alt.Color(f"{group}:N", title=group)
    if marked:
        bar_enc["opacity"] = alt.condition(f"datum['{marked}']", alt.value(0.35), alt.value(0.9))
        bar_enc["strokeDash"] = alt.condition(f"datum['{marked}']", alt.value([4, 2]), alt.value([1, 0]))
    layers = [base.mark_bar(height=bar * 0.7, stroke="#333333", strokeWidth=0.5).encode(**bar_enc)
              .transform_filter("isValid(datum._v)")]
    if low and high:
        layers.append(base.mark_rule(color="#222222", strokeWidth=1.5).encode(x="_lo:Q", x2="_hi:Q")
                      .transform_filter("isValid(datum._lo) && isValid(datum._hi)"))
        layers.append(base.mark_tick(color="#222222", thickness=1.5, size=bar * 0.5).encode(x="_lo:Q")
                      .transform_filter("isValid(datum._lo)"))
        layers.append(base.mark_tick(color="#222222", thickness=1.5, size=bar * 0.5).encode(x="_hi:Q")
                      .transform_filter("isValid(datum._hi)"))
    if note:
        layers.append(base.mark_text(align="left", dx=5, fontSize=10, color="#333333")
                      .encode(x="_end:Q", text=f"{note}:N"))
    if signed:
        layers.append(alt.Chart(alt.Data(values=[{"zero": 0}])).mark_rule(color="#555555").encode(x="zero:Q"))
    return _sized(alt.layer(*layers), width, max(bar * len(data), 40), title)


def combine(charts: Sequence[Chart], *, direction: Literal["horizontal", "vertical"] = "horizontal") -> Chart:
    """Several figures of this module side by side (or one above the other) as one figure, each keeping its own
    scales (a DLA panel beside the heads' map, say)."""
    parts = []
    for chart in charts:
        part = chart.copy(deep=True)
        part.config = alt.Undefined  # the style is set once, on the whole
        parts.append(part)
    whole = alt.hconcat(*parts) if direction == "horizontal" else alt.vconcat(*parts)
    return _configure(whole.resolve_scale(color="independent", x="independent", y="independent"))


def figure_spec(chart: Chart, *, validate: bool = True) -> dict[str, Any]:
    """The Vega-Lite specification of ``chart`` as a JSON-ready dict, checked against Vega-Lite's schema
    unless ``validate`` is false."""
    return chart.to_dict(validate=validate)


def _vl_version() -> str:
    return ".".join(alt.SCHEMA_VERSION.lstrip("v").split(".")[:2])


_RENDER_ALL = """
for (const div of document.querySelectorAll('div.@CLASS@:not([data-rendered])')) {
  div.setAttribute('data-rendered', 'pending');
  const spec = JSON.parse(div.querySelector('script[type="application/json"]').textContent);
  vegaEmbed(div.querySelector('.chart'), spec, {renderer: 'svg', actions: false})
    .then(() => div.setAttribute('data-rendered', 'done'))
    .catch(err => { div.setAttribute('data-rendered', 'error'); console.error(err); });
}
""".replace("@CLASS@", FIGURE_CLASS)


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "headlab"


@functools.lru_cache(maxsize=1)
def _bundle() -> str:
    """The Vega, Vega-Lite and vega-embed JavaScript, built by vl-convert once per version and kept in
    ``~/.cache/headlab`` (building it takes seconds)."""
    name = f"vega-bundle-{vl_convert.get_vega_version()}-{_vl_version()}-{vl_convert.get_vega_embed_version()}.js"
    cached = _cache_dir() / name
    with contextlib.suppress(OSError):
        return cached.read_text(encoding="utf-8")
    bundle = vl_convert.javascript_bundle(vl_version=_vl_version())
    with contextlib.suppress(OSError):
        cached.parent.mkdir(parents=True, exist_ok=True)
        partial = cached.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(bundle, encoding="utf-8")
        partial.replace(cached)
    return bundle


def page_script() -> str:
    """A ``<script>`` element, included once per page after its figures: the Vega, Vega-Lite and vega-embed
    JavaScript inlined (no network), then the rendering of every figure of :func:`to_html_fragment` on the
    page as SVG."""
    return f'<script type="module">{_bundle()}\n{_RENDER_ALL}</script>'


def to_html_fragment(chart: Chart, *, name: str = "") -> str:
    """A ``<div class="headlab-figure">`` holding ``chart``'s specification, drawn by the page's
    :func:`page_script`; ``name`` becomes its ``data-figure`` attribute (what the figure shows)."""
    # <, > and & as JSON escapes: no text of the data (labels, prompts) can end the script element or be markup
    spec = json.dumps(figure_spec(chart, validate=False), separators=(",", ":"))
    spec = spec.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
    return (f'<div class="{FIGURE_CLASS}" data-figure="{html.escape(name)}"><div class="chart"></div>'
            f'<script type="application/json">{spec}</script></div>')


def standalone_html(charts: Sequence[Chart] | Chart, *, title: str = "headlab figure") -> str:
    """A complete HTML page of ``charts`` that opens with no network."""
    charts = [charts] if not isinstance(charts, Sequence) else list(charts)
    body = "".join(to_html_fragment(c) for c in charts)
    return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
            f"</head><body>{body}{page_script()}</body></html>")


def to_svg(chart: Chart) -> str:
    """``chart`` as a static SVG document (no tooltips; for places that show no JavaScript)."""
    return vl_convert.vegalite_to_svg(figure_spec(chart), vl_version=_vl_version())


def save(chart: Chart, path: str | Path, *, format: Literal["svg", "png", "html"] | None = None,
         scale: float = 2.0) -> Path:
    """Write ``chart`` to ``path`` as SVG, PNG (``scale`` times its size in pixels) or a standalone HTML page;
    ``format`` defaults to the path's suffix. Returns the path written."""
    path = Path(path)
    fmt = format or path.suffix.lstrip(".").lower()
    if fmt not in ("svg", "png", "html"):
        raise ValueError(f"cannot save a figure as {fmt!r}: use svg, png or html")
    path.parent.mkdir(parents=True, exist_ok=True)
    if fmt == "html":
        path.write_text(standalone_html(chart), encoding="utf-8")
    elif fmt == "svg":
        path.write_text(to_svg(chart), encoding="utf-8")
    else:
        path.write_bytes(vl_convert.vegalite_to_png(figure_spec(chart), vl_version=_vl_version(), scale=scale))
    return path
