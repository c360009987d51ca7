"""Metric vs KV cache: the trade-off of a run's steps with a KV policy, shared by ``headlab report`` and the
notebook widget :class:`headlab.widgets.KvTradeoff`.

- :func:`kv_points` gives one :class:`KvPoint` per step with a ``kv`` option and sweep cell: the policy, the
  bytes its caches held (``kv_bytes`` summed over layers), what full caches would have held, the true kept
  fraction and the mean of each of the step's metrics in that cell.
- :func:`kv_tradeoff_chart` draws one metric against the kept fraction or the KV bytes (in MiB), one colour per
  policy (the points of a series joined in order of x), each point labelled with its step;
  :func:`kv_table_rows` lists the points.
- For needle tasks (examples with a ``context_length`` and a ``depth``), :func:`needle_by_length_chart` draws a
  metric by context length, one line per step, and :func:`needle_heatmap_chart` the standard needle heatmap
  (context length x depth) of one step.

Points come from the stored results only (``kv_bytes(layer)``, the ``kv_kept_fraction`` variable, the step's
metrics), so a report of a finished run and a widget in a notebook show the same numbers.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import xarray as xr

from .. import figures
from ..results import Run

__all__ = ["KvPoint", "KvX", "kv_metrics", "kv_points", "kv_table_rows", "kv_tradeoff_chart", "needle_by_length",
           "needle_by_length_chart", "needle_grid", "needle_heatmap_chart", "needle_steps"]

KvX = Literal["kept_fraction", "kv_bytes"]
"""What the x axis of :func:`kv_tradeoff_chart` shows: the true kept fraction, or the KV bytes held."""

_X_LABEL = {"kept_fraction": "kept fraction of the full KV cache", "kv_bytes": "KV bytes held"}


@dataclass(frozen=True)
class KvPoint:
    """One step with a KV policy in one sweep cell: its policy, bytes, kept fraction and metric means."""

    step: str
    policy: str
    cell: dict[str, Any]
    kv_bytes: int
    kv_bytes_full: int
    kept_fraction: float
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def label(self) -> str:
        """``step`` and the cell's sweep values (``gen (gen.kv.window=64)``)."""
        cell = ", ".join(f"{k}={v}" for k, v in self.cell.items())
        return f"{self.step} ({cell})" if cell else self.step


def _cells(run: Run, da: xr.DataArray) -> Iterator[dict[str, Any]]:
    keys = [k for k in run.sweep if k in da.dims]
    grids = [[v.item() if hasattr(v, "item") else v for v in da[k].values] for k in keys]
    for combo in itertools.product(*grids):
        yield dict(zip(keys, combo, strict=True))


def _mean(da: xr.DataArray) -> float:
    values = np.asarray(da.values, dtype=float)
    return float(np.nanmean(values)) if np.isfinite(values).any() else math.nan


def kv_points(run: Run) -> list[KvPoint]:
    """Every (step with a KV policy, sweep cell) of ``run`` that finished, in step order then sweep order.

    A step's metrics are those its attrs name (``metrics``), averaged over every dimension but the sweep keys
    (examples; tasks for an ``evaluate`` step). ``kv_bytes_full`` is the step's attr when the run has no sweep,
    else ``kv_bytes / kept_fraction`` of the cell.
    """
    points = []
    for step, ds in run.results.items():
        if "kv_kept_fraction" not in ds or "kv_bytes" not in ds:
            continue
        metrics = [str(m) for m in ds.attrs.get("metrics", []) if m in ds]
        for cell in _cells(run, ds["kv_kept_fraction"]):
            sub = ds.sel(cell) if cell else ds
            kept = float(sub["kv_kept_fraction"].values)
            held = np.asarray(sub["kv_bytes"].values, dtype=float)
            if not math.isfinite(kept) or not np.isfinite(held).all():  # a cell that did not run this step
                continue
            nbytes = int(held.sum())
            full = int(ds.attrs["kv_bytes_full"]) if not cell and "kv_bytes_full" in ds.attrs else \
                (round(nbytes / kept) if kept > 0 else 0)
            points.append(KvPoint(step=step, policy=str(ds.attrs.get("kv_policy", "")), cell=cell, kv_bytes=nbytes,
                                  kv_bytes_full=full, kept_fraction=kept,
                                  metrics={m: _mean(sub[m]) for m in metrics}))
    return points


def kv_metrics(points: Sequence[KvPoint]) -> list[str]:
    """The metric names of ``points``, in first-seen order."""
    return list(dict.fromkeys(m for p in points for m in p.metrics))


def _is_ratio(values: Sequence[float]) -> bool:
    finite = [v for v in values if math.isfinite(v)]
    return bool(finite) and all(0.0 <= v <= 1.0 for v in finite)


def kv_tradeoff_chart(points: Sequence[KvPoint], metric: str, *, x: KvX = "kept_fraction",
                      title: str | None = None) -> figures.Chart:
    """``metric`` against ``x`` (the kept fraction, on [0, 1], or the KV bytes held, in MiB from 0), one colour
    per policy, each point labelled with its step and cell (:attr:`KvPoint.label`). The y axis starts at 0
    when every value lies in [0, 1] (a ratio). Points without ``metric`` are left out."""
    rows = [{"label": p.label, "policy": p.policy, "x": p.kept_fraction if x == "kept_fraction" else p.kv_bytes,
             "y": p.metrics[metric], "kept fraction": f"{p.kept_fraction:.3f}",
             "KV MiB": f"{figures.mib(p.kv_bytes):.2f}"} for p in points if metric in p.metrics]
    return figures.scatter(rows, x="x", y="y", x_title=_X_LABEL[x], y_title=metric, series="policy",
                           connect=True, x_bytes=x == "kv_bytes", x_zero=True,
                           x_domain=(0.0, 1.0) if x == "kept_fraction" else None,
                           y_zero=_is_ratio([r["y"] for r in rows]), tooltip=["kept fraction", "KV MiB"],
                           title=f"{metric} vs {_X_LABEL[x]}" if title is None else title)


def needle_steps(run: Run) -> list[str]:
    """The steps of ``run`` whose examples carry a ``context_length`` and a ``depth`` (needle tasks) and store
    a metric per example."""
    return [step for step, ds in run.results.items()
            if {"context_length", "depth"} <= set(ds.coords) and "example" in ds.dims
            and any(m in ds and "example" in ds[m].dims for m in ds.attrs.get("metrics", []))]


def _first_cell(run: Run, ds: xr.Dataset) -> xr.Dataset:
    keys = [k for k in run.sweep if k in ds.dims]
    return ds.isel({k: 0 for k in keys}) if keys else ds


def needle_by_length(run: Run, step: str, metric: str) -> dict[int, float]:
    """``{context length: mean of metric}`` over the step's examples of each length (first sweep cell)."""
    ds = _first_cell(run, run.results[step])
    values = np.asarray(ds[metric].values, dtype=float)
    lengths = np.asarray(ds["context_length"].values)
    return {int(n): _mean(xr.DataArray(values[lengths == n])) for n in sorted(set(lengths.tolist()))}


def needle_grid(run: Run, step: str, metric: str) -> xr.DataArray:
    """The mean of ``metric`` per (``context_length``, ``depth``) of the step's examples (first sweep cell)."""
    ds = _first_cell(run, run.results[step])
    values = np.asarray(ds[metric].values, dtype=float)
    lengths, depths = np.asarray(ds["context_length"].values), np.asarray(ds["depth"].values, dtype=float)
    ls, ds_ = sorted(set(lengths.tolist())), sorted(set(depths.tolist()))
    grid = np.full((len(ls), len(ds_)), np.nan)
    for i, n in enumerate(ls):
        for j, d in enumerate(ds_):
            sel = values[(lengths == n) & (depths == d)]
            grid[i, j] = _mean(xr.DataArray(sel)) if sel.size else np.nan
    return xr.DataArray(grid, dims=("context_length", "depth"), coords={"context_length": ls, "depth": ds_},
                        name=metric)


def needle_by_length_chart(run: Run, steps: Sequence[str], metric: str) -> figures.Chart:
    """``metric`` by context length, one line per step in ``steps`` (needle tasks); y from 0 for a ratio."""
    curves = {step: needle_by_length(run, step, metric) for step in steps}
    lengths = sorted({n for c in curves.values() for n in c})
    series = {step: [c.get(n, math.nan) for n in lengths] for step, c in curves.items()}
    return figures.line_chart(lengths, series, x_title="context length (tokens)", y_title=metric,
                              series_title="step", y_zero=_is_ratio([v for s in series.values() for v in s]),
                              title=f"{metric} by context length")


def needle_heatmap_chart(run: Run, step: str, metric: str) -> figures.Chart:
    """The needle heatmap of ``step``: ``metric`` per context length (rows) and needle depth (columns, 0 = the
    start of the context), on a colour scale from 0 to 1 for a ratio."""
    grid = needle_grid(run, step, metric)
    ratio = _is_ratio(grid.values.ravel().tolist())
    return figures.heatmap(grid, x="depth", y="context_length", value=metric, x_title="needle depth",
                           y_title="context length", x_labels=[f"{d:.2g}" for d in grid["depth"].values],
                           vmin=0.0 if ratio else None, vmax=1.0 if ratio else None, cell=26,
                           title=f"{step}: {metric}")


def kv_table_rows(points: Sequence[KvPoint], metrics: Sequence[str] | None = None) -> tuple[list[str], list[list[Any]]]:
    """A header and one row per point: step, cell, policy, KV bytes, full bytes, kept fraction, metrics."""
    metrics = kv_metrics(points) if metrics is None else list(metrics)
    header = ["step", "cell", "policy", "KV bytes", "full KV bytes", "kept fraction", *metrics]
    rows = [[p.step, ", ".join(f"{k}={v}" for k, v in p.cell.items()) or "all", p.policy, p.kv_bytes,
             p.kv_bytes_full, p.kept_fraction, *[p.metrics.get(m, math.nan) for m in metrics]] for p in points]
    return header, rows
