"""Inline SVG figures on one colour scale: the viridis palette (:func:`color`), a colour bar, a
(layer x head) heatmap, a labelled grid (:func:`grid_svg`), a line plot, a scatter plot of labelled points (:func:`scatter_svg`), and a bar chart of signed values
(:func:`bar_chart_svg`, coloured by sign: :data:`SIGN_COLORS`).

A leaf: it imports nothing of headlab, so the static reports (:mod:`headlab.report`), the pictures of
attention over images (:mod:`headlab.image_attention`) and the notebook widgets draw with the same
colours without importing each other. A head looks the same in a report and in a
:class:`headlab.widgets.HeadMap`. :mod:`headlab.report` re-exports every name here.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from html import escape
from typing import Any

import numpy as np
import xarray as xr

__all__ = ["NAN_COLOR", "PALETTE", "SIGN_COLORS", "bar_chart_svg", "color", "colour_bar_svg", "finite_range",
           "grid_svg", "heatmap_svg", "line_plot_svg", "scatter_svg", "sign_color", "text_color"]

# viridis at 9 stops (matplotlib's data, rounded): low -> high
PALETTE: tuple[tuple[int, int, int], ...] = (
    (68, 1, 84), (71, 44, 122), (59, 81, 139), (44, 113, 142), (33, 144, 141),
    (39, 173, 129), (92, 200, 99), (170, 220, 50), (253, 231, 37),
)
NAN_COLOR = "#dddddd"
#: the colours of positive and negative values where the sign is what matters (bars, circuit edges)
SIGN_COLORS = {"positive": "#2166ac", "negative": "#b2182b"}


def color(value: float | None, vmin: float = 0.0, vmax: float = 1.0) -> str:
    """Hex colour of ``value`` on the viridis scale between ``vmin`` and ``vmax`` (grey for NaN/None)."""
    if value is None or not math.isfinite(float(value)):
        return NAN_COLOR
    t = 0.0 if vmax <= vmin else min(1.0, max(0.0, (float(value) - vmin) / (vmax - vmin)))
    x = t * (len(PALETTE) - 1)
    i = min(int(x), len(PALETTE) - 2)
    f = x - i
    a, b = PALETTE[i], PALETTE[i + 1]
    rgb = [round(a[k] + (b[k] - a[k]) * f) for k in range(3)]
    return "#{:02x}{:02x}{:02x}".format(*rgb)


def sign_color(value: float) -> str:
    """:data:`SIGN_COLORS`' colour of ``value``'s sign (zero counts as positive; grey for NaN)."""
    if not math.isfinite(float(value)):
        return NAN_COLOR
    return SIGN_COLORS["negative"] if value < 0 else SIGN_COLORS["positive"]


def _fmt(v: float) -> str:
    return "nan" if not math.isfinite(v) else f"{v:.4g}"


def text_color(background: str) -> str:
    """Black or white, whichever reads better on ``background`` (``#rrggbb``)."""
    r, g, b = (int(background[i: i + 2], 16) for i in (1, 3, 5))
    return "#000000" if 0.299 * r + 0.587 * g + 0.114 * b > 140 else "#ffffff"


def finite_range(values: np.ndarray) -> tuple[float, float]:
    """``(min, max)`` of the finite entries of ``values``: ``(0, 1)`` when there are none, ``(lo, lo + 1)``
    when they are all equal."""
    finite = values[np.isfinite(values)]
    if finite.size == 0:
        return 0.0, 1.0
    lo, hi = float(finite.min()), float(finite.max())
    return (lo, hi) if hi > lo else (lo, lo + 1.0)


def heatmap_svg(values: np.ndarray | xr.DataArray, *, title: str = "", cell: int = 18,
                vmin: float | None = None, vmax: float | None = None,
                highlight: Sequence[tuple[int, int]] = ()) -> str:
    """A (layer x head) heatmap as inline SVG; each cell has a ``<title>`` with its value.

    ``values`` is ``(layer, head)`` (an xarray DataArray is transposed to that order). Cells in
    ``highlight`` are outlined.
    """
    if isinstance(values, xr.DataArray):
        values = values.transpose("layer", "head").values
    arr = np.asarray(values, dtype=float)
    n_layers, n_heads = arr.shape
    lo, hi = finite_range(arr)
    vmin = lo if vmin is None else vmin
    vmax = hi if vmax is None else vmax
    left, top = 34, 22 if title else 8
    width = max(left + n_heads * cell + 70, left + 7 * len(title) + 8)
    height = top + n_layers * cell + 22
    marked = {(int(a), int(b)) for a, b in highlight}
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" class="heatmap" width="{width}" height="{height}" '
             f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="10">']
    if title:
        parts.append(f'<text x="{left}" y="13" font-size="12" font-weight="bold">{escape(title)}</text>')
    for layer in range(n_layers):
        y = top + layer * cell
        parts.append(f'<text x="{left - 4}" y="{y + cell * 0.7:.1f}" text-anchor="end">L{layer}</text>')
        for head in range(n_heads):
            v = arr[layer, head]
            x = left + head * cell
            label = "nan" if not math.isfinite(v) else f"{v:.4g}"
            stroke = ' stroke="#e4002b" stroke-width="2"' if (layer, head) in marked else ""
            parts.append(f'<rect x="{x}" y="{y}" width="{cell - 1}" height="{cell - 1}" '
                         f'fill="{color(v, vmin, vmax)}" data-layer="{layer}" data-head="{head}" '
                         f'data-value="{label}"{stroke}><title>layer {layer}, head {head}: {label}</title></rect>')
    base = top + n_layers * cell + 12
    for head in range(n_heads):
        if n_heads <= 16 or head % max(1, n_heads // 16) == 0:
            parts.append(f'<text x="{left + head * cell + cell / 2:.1f}" y="{base}" '
                         f'text-anchor="middle">{head}</text>')
    parts.extend(colour_bar_svg(left + n_heads * cell + 14, top, max(n_layers * cell, 40), vmin, vmax))
    parts.append("</svg>")
    return "".join(parts)


def colour_bar_svg(x: float, top: float, height: float, vmin: float, vmax: float, steps: int = 20) -> list[str]:
    """SVG elements of a vertical colour bar on :func:`color`'s scale at ``(x, top)``, ``vmax`` at the top,
    labelled with both ends."""
    parts = []
    for i in range(steps):
        v = vmax - (vmax - vmin) * i / (steps - 1)
        parts.append(f'<rect x="{x}" y="{top + i * height / steps:.1f}" width="10" '
                     f'height="{height / steps + 0.5:.1f}" fill="{color(v, vmin, vmax)}"/>')
    parts.append(f'<text x="{x + 13}" y="{top + 8}">{vmax:.3g}</text>')
    parts.append(f'<text x="{x + 13}" y="{top + height}">{vmin:.3g}</text>')
    return parts


def line_plot_svg(xs: Sequence[Any], series: Mapping[str, Sequence[float]], *, xlabel: str = "",
                  ylabel: str = "", title: str = "", width: int = 420, height: int = 240) -> str:
    """A line plot as inline SVG: one polyline (with point markers and a legend entry) per series.

    Numeric ``xs`` are placed proportionally; other values evenly, labelled by their text.
    """
    numeric = all(isinstance(x, (int, float, np.number)) and not isinstance(x, bool) for x in xs)
    n = len(xs)
    pos = [float(x) for x in xs] if numeric else list(range(n))
    x0, x1 = (min(pos), max(pos)) if pos else (0.0, 1.0)
    if x1 == x0:
        x0, x1 = x0 - 1, x1 + 1
    all_y = np.array([v for ys in series.values() for v in ys if v is not None and math.isfinite(v)], dtype=float)
    y0, y1 = finite_range(all_y) if all_y.size else (0.0, 1.0)
    pad = (y1 - y0) * 0.08
    y0, y1 = y0 - pad, y1 + pad
    ml, mr, mt, mb = 52, 12, 24 if title else 10, 40
    pw, ph = width - ml - mr, height - mt - mb

    def sx(v: float) -> float:
        return ml + (v - x0) / (x1 - x0) * pw

    def sy(v: float) -> float:
        return mt + (1 - (v - y0) / (y1 - y0)) * ph

    colors = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f"]
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" class="lineplot" width="{width}" height="{height + 16 * len(series)}" '
             f'font-family="sans-serif" font-size="10">']
    if title:
        parts.append(f'<text x="{ml}" y="14" font-size="12" font-weight="bold">{escape(title)}</text>')
    parts.append(f'<rect x="{ml}" y="{mt}" width="{pw}" height="{ph}" fill="none" stroke="#999"/>')
    for i in range(5):
        v = y0 + (y1 - y0) * i / 4
        parts.append(f'<text x="{ml - 4}" y="{sy(v) + 3:.1f}" text-anchor="end">{v:.3g}</text>')
        parts.append(f'<line x1="{ml}" x2="{ml + pw}" y1="{sy(v):.1f}" y2="{sy(v):.1f}" stroke="#eee"/>')
    for x, p in zip(xs, pos, strict=True):
        parts.append(f'<text x="{sx(p):.1f}" y="{mt + ph + 13}" text-anchor="middle">{escape(str(x))}</text>')
    parts.append(f'<text x="{ml + pw / 2}" y="{mt + ph + 28}" text-anchor="middle">{escape(xlabel)}</text>')
    parts.append(f'<text x="12" y="{mt + ph / 2}" text-anchor="middle" transform="rotate(-90 12 {mt + ph / 2})">'
                 f'{escape(ylabel)}</text>')
    for k, (name, ys) in enumerate(series.items()):
        c = colors[k % len(colors)]
        pts = [(sx(p), sy(float(y))) for p, y in zip(pos, ys, strict=True) if y is not None and math.isfinite(y)]
        if len(pts) > 1:
            parts.append(f'<polyline fill="none" stroke="{c}" stroke-width="2" points="'
                         + " ".join(f"{a:.1f},{b:.1f}" for a, b in pts) + '"/>')
        for (a, b), y in zip(pts, [y for y in ys if y is not None and math.isfinite(y)], strict=True):
            parts.append(f'<circle cx="{a:.1f}" cy="{b:.1f}" r="3" fill="{c}" data-series="{escape(name)}" '
                         f'data-y="{float(y):.6g}"><title>{escape(name)}: {float(y):.4g}</title></circle>')
        ly = height + 4 + 16 * k
        parts.append(f'<line x1="{ml}" x2="{ml + 18}" y1="{ly}" y2="{ly}" stroke="{c}" stroke-width="2"/>')
        parts.append(f'<text x="{ml + 24}" y="{ly + 3}">{escape(name)}</text>')
    parts.append("</svg>")
    return "".join(parts)


_SERIES_COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f")


def _ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    return [lo + (hi - lo) * i / (n - 1) for i in range(n)]


def scatter_svg(series: Mapping[str, Sequence[tuple[float, float, str]]], *, xlabel: str = "", ylabel: str = "",
                title: str = "", xlim: tuple[float, float] | None = None, ylim: tuple[float, float] | None = None,
                width: int = 460, height: int = 280) -> str:
    """Labelled points on two numeric axes as inline SVG, one colour and legend entry per series; the points of
    a series are joined in order of x. Each point is ``(x, y, label)`` and carries ``data-series``,
    ``data-label``, ``data-x``, ``data-y`` and a ``<title>``; points with a non-finite coordinate are left out.

    ``xlim`` / ``ylim`` fix an axis's range (by default the points' range, padded by 8%).
    """
    points = {name: sorted(((float(x), float(y), str(label)) for x, y, label in pts
                            if math.isfinite(float(x)) and math.isfinite(float(y))), key=lambda p: p[0])
              for name, pts in series.items()}

    def limits(values: list[float], fixed: tuple[float, float] | None) -> tuple[float, float]:
        if fixed is not None:
            lo, hi = float(fixed[0]), float(fixed[1])
        else:
            lo, hi = (min(values), max(values)) if values else (0.0, 1.0)
            pad = (hi - lo) * 0.08
            lo, hi = lo - pad, hi + pad
        return (lo - 0.5, hi + 0.5) if hi == lo else (lo, hi)

    x0, x1 = limits([p[0] for pts in points.values() for p in pts], xlim)
    y0, y1 = limits([p[1] for pts in points.values() for p in pts], ylim)
    ml, mr, mt, mb = 52, 12, 24 if title else 10, 40
    pw, ph = width - ml - mr, height - mt - mb

    def sx(v: float) -> float:
        return ml + (v - x0) / (x1 - x0) * pw

    def sy(v: float) -> float:
        return mt + (1 - (v - y0) / (y1 - y0)) * ph

    total = height + 16 * len(points)
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" class="scatter" width="{width}" height="{total}" '
             f'viewBox="0 0 {width} {total}" font-family="sans-serif" font-size="10">']
    if title:
        parts.append(f'<text x="{ml}" y="14" font-size="12" font-weight="bold">{escape(title)}</text>')
    parts.append(f'<rect x="{ml}" y="{mt}" width="{pw}" height="{ph}" fill="none" stroke="#999"/>')
    for v in _ticks(y0, y1):
        parts.append(f'<text x="{ml - 4}" y="{sy(v) + 3:.1f}" text-anchor="end">{v:.3g}</text>')
        parts.append(f'<line x1="{ml}" x2="{ml + pw}" y1="{sy(v):.1f}" y2="{sy(v):.1f}" stroke="#eee"/>')
    for v in _ticks(x0, x1):
        parts.append(f'<text x="{sx(v):.1f}" y="{mt + ph + 13}" text-anchor="middle">{v:.3g}</text>')
        parts.append(f'<line x1="{sx(v):.1f}" x2="{sx(v):.1f}" y1="{mt}" y2="{mt + ph}" stroke="#eee"/>')
    parts.append(f'<text x="{ml + pw / 2}" y="{mt + ph + 28}" text-anchor="middle">{escape(xlabel)}</text>')
    parts.append(f'<text x="12" y="{mt + ph / 2}" text-anchor="middle" transform="rotate(-90 12 {mt + ph / 2})">'
                 f'{escape(ylabel)}</text>')
    for k, (name, pts) in enumerate(points.items()):
        c = _SERIES_COLORS[k % len(_SERIES_COLORS)]
        if len(pts) > 1:
            parts.append(f'<polyline fill="none" stroke="{c}" stroke-width="1.5" stroke-opacity="0.7" points="'
                         + " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y, _ in pts) + '"/>')
        for x, y, label in pts:
            parts.append(f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="4" fill="{c}" data-series="{escape(name)}" '
                         f'data-label="{escape(label)}" data-x="{x:.6g}" data-y="{y:.6g}">'
                         f'<title>{escape(label)}: {x:.4g}, {y:.4g}</title></circle>')
        ly = height + 4 + 16 * k
        parts.append(f'<circle cx="{ml + 9}" cy="{ly}" r="4" fill="{c}"/>')
        parts.append(f'<text x="{ml + 24}" y="{ly + 3}">{escape(name)}</text>')
    parts.append("</svg>")
    return "".join(parts)


def grid_svg(values: np.ndarray, rows: Sequence[str], cols: Sequence[str], *, title: str = "", cell: int = 18,
             vmin: float | None = None, vmax: float | None = None, row_width: int = 46) -> str:
    """A (row x column) heatmap on :func:`color`'s scale with text labels as inline SVG; each cell carries
    ``data-row`` / ``data-col`` (the labels), ``data-value`` and a ``<title>``.

    ``values`` is ``(len(rows), len(cols))``. Columns are labelled below, every one up to 64 columns (every
    k-th beyond), slanted when a label is longer than two characters.
    """
    arr = np.asarray(values, dtype=float).reshape(len(rows), len(cols))
    lo, hi = finite_range(arr)
    vmin = lo if vmin is None else vmin
    vmax = hi if vmax is None else vmax
    left, top = row_width, 22 if title else 8
    n_rows, n_cols = arr.shape
    slant = any(len(str(c)) > 2 for c in cols)
    longest = max((len(str(c)) for c in cols), default=1)
    width = max(left + n_cols * cell + 90, left + 7 * len(title) + 8)
    height = top + n_rows * cell + (14 + int(5.5 * min(longest, 16)) if slant else 22)
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" class="grid" width="{width}" height="{height}" '
             f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="10">']
    if title:
        parts.append(f'<text x="{left}" y="13" font-size="12" font-weight="bold">{escape(title)}</text>')
    for i, row in enumerate(rows):
        y = top + i * cell
        parts.append(f'<text x="{left - 4}" y="{y + cell * 0.7:.1f}" text-anchor="end">{escape(str(row))}</text>')
        for j, col in enumerate(cols):
            v = float(arr[i, j])
            label = _fmt(v)
            parts.append(f'<rect x="{left + j * cell}" y="{y}" width="{cell - 1}" height="{cell - 1}" '
                         f'fill="{color(v, vmin, vmax)}" data-row="{escape(str(row))}" data-col="{escape(str(col))}" '
                         f'data-value="{label}"><title>{escape(str(row))}, {escape(str(col))}: {label}</title></rect>')
    base = top + n_rows * cell + 12
    step = 1 if n_cols <= 64 else math.ceil(n_cols / 64)
    for j, col in enumerate(cols):
        if j % step == 0:
            x = left + j * cell + cell / 2
            if slant:
                parts.append(f'<text x="{x:.1f}" y="{base - 4}" text-anchor="end" '
                             f'transform="rotate(-60 {x:.1f} {base - 4})">{escape(str(col))}</text>')
            else:
                parts.append(f'<text x="{x:.1f}" y="{base}" text-anchor="middle">{escape(str(col))}</text>')
    parts.extend(colour_bar_svg(left + n_cols * cell + 14, top, max(n_rows * cell, 40), vmin, vmax))
    parts.append("</svg>")
    return "".join(parts)


def bar_chart_svg(labels: Sequence[str], values: Sequence[float], *, title: str = "", xlabel: str = "",
                  width: int = 420, bar: int = 14, label_width: int = 90) -> str:
    """Horizontal bars of signed values from a zero line as inline SVG, one per label in the given order,
    coloured by sign (:func:`sign_color`); each bar carries ``data-label`` and ``data-value`` and a
    ``<title>``, and its value is written beside it. NaN values get no bar."""
    vals = [float(v) for v in values]
    finite = [v for v in vals if math.isfinite(v)]
    lo, hi = min([0.0, *finite]), max([0.0, *finite])
    if hi == lo:
        hi = lo + 1.0
    top = 22 if title else 8
    plot_left, plot_width = label_width, width - label_width - 50
    height = top + len(vals) * bar + (30 if xlabel else 16)

    def sx(v: float) -> float:
        return plot_left + (v - lo) / (hi - lo) * plot_width

    zero = sx(0.0)
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" class="bars" width="{width}" height="{height}" '
             f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="10">']
    if title:
        parts.append(f'<text x="4" y="13" font-size="12" font-weight="bold">{escape(title)}</text>')
    for i, (name, v) in enumerate(zip(labels, vals, strict=True)):
        y = top + i * bar
        text = escape(str(name))
        parts.append(f'<text x="{plot_left - 4}" y="{y + bar * 0.75:.1f}" text-anchor="end">{text}</text>')
        if not math.isfinite(v):
            parts.append(f'<text x="{zero + 3:.1f}" y="{y + bar * 0.75:.1f}" fill="#888">nan</text>')
            continue
        x0, x1 = sorted((zero, sx(v)))
        parts.append(f'<rect x="{x0:.1f}" y="{y + 1}" width="{max(x1 - x0, 0.5):.1f}" height="{bar - 2}" '
                     f'fill="{sign_color(v)}" data-label="{text}" data-value="{_fmt(v)}">'
                     f'<title>{text}: {_fmt(v)}</title></rect>')
        anchor, tx = ("start", x1 + 3) if v >= 0 else ("end", x0 - 3)
        if v < 0 and tx < plot_left + 24:  # no room left of the bar: write the value right of zero
            anchor, tx = "start", zero + 3
        parts.append(f'<text x="{tx:.1f}" y="{y + bar * 0.75:.1f}" text-anchor="{anchor}">{_fmt(v)}</text>')
    bottom = top + len(vals) * bar
    parts.append(f'<line x1="{zero:.1f}" x2="{zero:.1f}" y1="{top}" y2="{bottom}" stroke="#555"/>')
    parts.append(f'<text x="{plot_left}" y="{bottom + 11}">{lo:.3g}</text>')
    parts.append(f'<text x="{plot_left + plot_width}" y="{bottom + 11}" text-anchor="end">{hi:.3g}</text>')
    if xlabel:
        parts.append(f'<text x="{plot_left + plot_width / 2:.1f}" y="{bottom + 24}" '
                     f'text-anchor="middle">{escape(xlabel)}</text>')
    parts.append("</svg>")
    return "".join(parts)
