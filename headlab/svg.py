"""The hand-drawn SVG that remains where no plotting library draws the picture, on one colour scale.

Every chart (heatmaps, line, scatter and bar charts, the circuit figures) is a Vega-Lite figure of
:mod:`headlab.figures` / :mod:`headlab.circuit_figures`, in the report and in the notebook widgets alike. What is
left here, and why:

- the viridis palette (:func:`color`, :data:`PALETTE`, :data:`NAN_COLOR`) that hand-written JavaScript views
  share: the interactive :class:`headlab.widgets.HeadMap`, whose click-and-drag selection syncs with Python
  through an inline anywidget (altair's interactive widget loads its JavaScript from the network), and the
  attention views;
- the colour bar (:func:`colour_bar_svg`) of the attention over an image's patches
  (:mod:`headlab.image_attention`: a picture with a heat overlay, which the library does not draw);

A leaf: it imports nothing of headlab. :mod:`headlab.report` re-exports every name here.
"""

from __future__ import annotations

import math

__all__ = ["NAN_COLOR", "PALETTE", "color", "colour_bar_svg"]

# viridis at 9 stops (matplotlib's data, rounded): low -> high
PALETTE: tuple[tuple[int, int, int], ...] = (
    (68, 1, 84), (71, 44, 122), (59, 81, 139), (44, 113, 142), (33, 144, 141),
    (39, 173, 129), (92, 200, 99), (170, 220, 50), (253, 231, 37),
)
NAN_COLOR = "#dddddd"


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
