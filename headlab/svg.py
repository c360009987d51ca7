"""The hand-drawn SVG that remains where no plotting library draws the picture, on one colour scale.

Charts (heatmaps, line, scatter and bar charts) are Vega-Lite figures of :mod:`headlab.figures`. What is left
here: the viridis palette (:func:`color`, :data:`PALETTE`) that hand-written JavaScript views share (the
interactive :class:`headlab.widgets.HeadMap`, whose click-and-drag selection syncs with Python through an
inline anywidget, and the attention views), the colour bar of the attention over an image's patches
(:mod:`headlab.image_attention`: a picture with a heat overlay), and the circuit views' labelled grid
(:func:`grid_svg`) and signed bars (:func:`bar_chart_svg`, :data:`SIGN_COLORS`) that
:mod:`headlab.circuit_view` still draws until it moves to :mod:`headlab.figures`.

A leaf: it imports nothing of headlab. :mod:`headlab.report` re-exports every name here but
:func:`finite_range`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from html import escape

import numpy as np

__all__ = ["NAN_COLOR", "PALETTE", "SIGN_COLORS", "bar_chart_svg", "color", "colour_bar_svg", "finite_range",
           "grid_svg", "sign_color", "text_color"]

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
