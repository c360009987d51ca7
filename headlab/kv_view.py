"""Metric vs KV cache: the trade-off of a run's steps with a KV policy, shared by ``headlab report`` and the
notebook widget :class:`headlab.widgets.KvTradeoff`.

- :func:`kv_points` gives one :class:`KvPoint` per step with a ``kv`` option and sweep cell: the policy, the
  bytes its caches held (``kv_bytes`` summed over layers), what full caches would have held, the true kept
  fraction and the mean of each of the step's metrics in that cell.
- :func:`kv_tradeoff_svg` draws one metric against the kept fraction or the KV bytes, one series per policy
  (the points of a series joined in order of x); :func:`kv_table_rows` lists the points.

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

from .results import Run
from .svg import scatter_svg

__all__ = ["KvPoint", "KvX", "kv_metrics", "kv_points", "kv_table_rows", "kv_tradeoff_svg"]

KvX = Literal["kept_fraction", "kv_bytes"]
"""What the x axis of :func:`kv_tradeoff_svg` shows: the true kept fraction, or the KV bytes held."""

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


def kv_tradeoff_svg(points: Sequence[KvPoint], metric: str, *, x: KvX = "kept_fraction", title: str | None = None,
                    width: int = 460, height: int = 280) -> str:
    """``metric`` against ``x`` (the kept fraction, on [0, 1], or the KV bytes held) as an inline SVG scatter
    plot, one series per policy; each point is titled by its step and cell (:attr:`KvPoint.label`). Points
    without ``metric`` are left out."""
    series: dict[str, list[tuple[float, float, str]]] = {}
    for p in points:
        if metric in p.metrics:
            value = p.kept_fraction if x == "kept_fraction" else float(p.kv_bytes)
            series.setdefault(p.policy, []).append((value, p.metrics[metric], p.label))
    xlim = (0.0, 1.05) if x == "kept_fraction" else None
    return scatter_svg(series, xlabel=_X_LABEL[x], ylabel=metric, xlim=xlim, width=width, height=height,
                       title=f"{metric} vs {_X_LABEL[x]}" if title is None else title)


def kv_table_rows(points: Sequence[KvPoint], metrics: Sequence[str] | None = None) -> tuple[list[str], list[list[Any]]]:
    """A header and one row per point: step, cell, policy, KV bytes, full bytes, kept fraction, metrics."""
    metrics = kv_metrics(points) if metrics is None else list(metrics)
    header = ["step", "cell", "policy", "KV bytes", "full KV bytes", "kept fraction", *metrics]
    rows = [[p.step, ", ".join(f"{k}={v}" for k, v in p.cell.items()) or "all", p.policy, p.kv_bytes,
             p.kv_bytes_full, p.kept_fraction, *[p.metrics.get(m, math.nan) for m in metrics]] for p in points]
    return header, rows
