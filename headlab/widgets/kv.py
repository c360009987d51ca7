"""The KV-cache trade-off of a run as a widget: :class:`KvTradeoff` draws a metric of the steps with a ``kv``
policy against the kept fraction of the full KV cache or the KV bytes held, one point per step and sweep cell
(:func:`headlab.kv.view.kv_tradeoff_chart`, the same Vega-Lite figure as ``headlab report``'s, shown
offline as SVG by :class:`headlab.widgets.chart.ChartView`), with the points' table below."""

from __future__ import annotations

from html import escape

import ipywidgets

from ..figures import Chart
from ..kv.view import KvPoint, KvX, kv_metrics, kv_points, kv_table_rows, kv_tradeoff_chart
from ..results import Run, open_run
from .chart import ChartView

__all__ = ["KvTradeoff"]


def _table_html(header: list[str], rows: list[list[object]]) -> str:
    def cell(v: object) -> str:
        if isinstance(v, float):
            return f'<td class="num">{v:.4g}</td>'
        if isinstance(v, int):
            return f'<td class="num">{v}</td>'
        return f"<td>{escape(str(v))}</td>"

    head = "".join(f"<th>{escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(cell(v) for v in r) + "</tr>" for r in rows)
    return f'<table class="hl-kv"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


class KvTradeoff(ipywidgets.VBox):
    """``KvTradeoff(run)``: a metric vs the kept KV fraction (or bytes) across the run's steps with a KV policy
    and its sweep cells, a metric picker, an x-axis toggle and the table of the points.

    ``run`` is a :class:`headlab.Run` or its path; a run without a step with a ``kv`` option raises
    ``ValueError``. ``metric`` picks the metric shown first (default: the first the steps store).
    """

    def __init__(self, run: Run | str, *, metric: str | None = None, x: KvX = "kept_fraction") -> None:
        run = run if isinstance(run, Run) else open_run(run)
        self.points: list[KvPoint] = kv_points(run)
        if not self.points:
            raise ValueError(f"KvTradeoff: run {run.name!r} has no finished step with a kv policy")
        self.metrics = kv_metrics(self.points)
        if metric is not None and metric not in self.metrics:
            raise ValueError(f"KvTradeoff: no step with a kv policy stores metric {metric!r} "
                             f"(metrics: {', '.join(self.metrics) or 'none'})")
        self.metric_picker = ipywidgets.Dropdown(options=self.metrics, description="metric",
                                                 value=metric or (self.metrics[0] if self.metrics else None),
                                                 disabled=not self.metrics)
        self.x_picker = ipywidgets.ToggleButtons(options=[("kept fraction", "kept_fraction"), ("KV bytes", "kv_bytes")],
                                                 value=x, description="x")
        self.figure = ChartView()
        self.chart: Chart | None = None  # the figure shown
        header, rows = kv_table_rows(self.points, self.metrics)
        self.table = ipywidgets.HTML(_table_html(header, rows))
        super().__init__([ipywidgets.HBox([self.metric_picker, self.x_picker]), self.figure, self.table])
        self.add_class("headlab-kv")
        self.metric_picker.observe(lambda _: self._draw(), names="value")
        self.x_picker.observe(lambda _: self._draw(), names="value")
        self._draw()

    @property
    def metric(self) -> str | None:
        """The metric shown."""
        return self.metric_picker.value

    @property
    def x(self) -> KvX:
        """What the x axis shows: ``kept_fraction`` or ``kv_bytes``."""
        return self.x_picker.value

    def _draw(self) -> None:
        if self.metric is None:
            self.chart = None
            self.figure.show(None, empty="<p>(the steps with a kv policy store no metric)</p>")
            return
        self.chart = kv_tradeoff_chart(self.points, self.metric, x=self.x)
        self.figure.show(self.chart)
