""":class:`ChartView`: one figure of :mod:`headlab.figures` as a notebook widget, the same chart object
``headlab report`` embeds, drawn offline: as the static SVG that ``vl-convert`` renders from it, with no
JavaScript to fetch (altair's own notebook renderers load Vega from a CDN)."""

from __future__ import annotations

import ipywidgets

from ..figures import Chart, to_svg

__all__ = ["ChartView"]


class ChartView(ipywidgets.HTML):
    """``ChartView(chart)`` shows ``chart`` (its SVG); :meth:`show` replaces it. ``chart`` is the figure shown,
    None when the view shows the HTML ``empty`` instead."""

    def __init__(self, chart: Chart | None = None, *, empty: str = "") -> None:
        super().__init__()
        self.add_class("headlab-chart")
        self.chart: Chart | None = None
        self.show(chart, empty=empty)

    def show(self, chart: Chart | None, *, empty: str = "") -> None:
        """Show ``chart``, or the HTML ``empty`` when it is None."""
        self.chart = chart
        self.value = to_svg(chart) if chart is not None else empty
