"""A run for display: the summary its tables print (``headlab show``, the report, the notebook) and its HTML.

:func:`run_summary` gives the headline numbers of each step of a :class:`headlab.Run` (top heads of a
detect step, per detector for a labelled cube; per sweep cell, the means of a step's metrics with their estimates; per task for ``evaluate``;
the kept fraction of a KV policy); :func:`run_html` is the block a notebook shows for a run
(``Run._repr_html_``). ``Run.summary()`` is :func:`run_summary` of the run.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping
from html import escape
from typing import Any, Protocol

import numpy as np
import xarray as xr

from .heads import ranked
from .summary import head_scores, metric_estimate

__all__ = ["RunView", "run_html", "run_summary"]


class RunView(Protocol):
    """What display reads of a run (:class:`headlab.Run` has it): its results per step, sweep, name, status,
    cells and attributes."""

    @property
    def results(self) -> Mapping[str, xr.Dataset]: ...
    @property
    def sweep(self) -> Mapping[str, list[Any]]: ...
    @property
    def name(self) -> str: ...
    @property
    def status(self) -> str: ...
    @property
    def cells_done(self) -> int: ...
    @property
    def cells_total(self) -> int: ...
    @property
    def attrs(self) -> Mapping[str, Any]: ...


def run_summary(run: RunView) -> dict[str, Any]:
    """Top heads per detect step (:func:`~headlab.summary.head_scores`: a per-token score's peak, averaged over
    the sweep; ``unit``: ``head``, or ``kv_head`` for a score per key/value head); a score over ``(detector, layer,
    head)`` (a labelled cube, :mod:`headlab.roles`) gets ``detectors`` instead of ``top``, one entry per detector
    (:func:`_detector_rows`: its top heads, threshold, heads labelled, causal status); per other step its ``kind`` (the
    action) and, never averaged across sweep values, its metrics: ``cells``, one row per sweep cell
    (``[{"cell": {sweep key: value}, "metrics": {name: mean over the cell's examples}}]``; a metric's
    step-level aggregate, stored without the ``example`` dimension, as it is), and
    ``metrics``, the same means when the run has one cell; for per-task metrics (``evaluate``), one row
    per sweep cell and task (``tasks``: ``[{"cell": {...}, "task": name, "metrics": {...}}]``); a step with a
    KV policy adds ``kv``: ``[{"cell": {...}, "policy": kind, "kept_fraction": f}]``."""
    out: dict[str, Any] = {}
    for step, ds in run.results.items():
        dims = set(ds["score"].dims) if "score" in ds else set()
        if {"layer", "head", "detector"} <= dims:  # a labelled cube: one entry per detector, never their mean
            out[step] = {"kind": "detect", "method": ds.attrs.get("method", ""), "unit": "head",
                         "token_peak": "token" in dims, "detectors": _detector_rows(ds)}
        elif "layer" in dims and dims & {"head", "kv_head"}:
            score = head_scores(ds["score"])  # a per-token score: its peak; sweep keys: averaged
            unit = "head" if "head" in score.dims else "kv_head"
            out[step] = {"kind": "detect", "method": ds.attrs.get("method", ""), "unit": unit,
                         "token_peak": "token" in dims,
                         "top": [{"layer": h[0], "head": h[1], "score": s}
                                 for h, s in ranked(score.rename({unit: "head"}))[:10]]}
        else:
            metrics = [m for m in ds.attrs.get("metrics", []) if m in ds]
            kind = str(ds.attrs.get("action", "generate"))
            by_task = [m for m in metrics if "task" in ds[m].dims]
            if by_task:  # per-task metrics (evaluate): one row per sweep cell and task, never averaged
                out[step] = {"kind": kind, "metrics": {}, "tasks": _task_rows(run, ds, by_task)}
                continue
            cells = _cell_rows(run, ds, metrics)
            out[step] = {"kind": kind, "cells": cells,
                         "metrics": cells[0]["metrics"] if len(cells) == 1 else {}}
        if "kv_kept_fraction" in ds:  # a step with a KV policy: the true kept fraction per sweep cell
            out[step]["kv"] = [{"cell": cell, "policy": str(ds.attrs.get("kv_policy", "")),
                                "kept_fraction": float(sub["kv_kept_fraction"].values)}
                               for cell, sub in _sweep_cells(run, ds)]
    return out


def _detector_value(ds: xr.Dataset, name: str, detector: str) -> float | None:
    """A per-detector number of ``ds`` (a variable over ``detector`` and sweep keys, averaged over them), None
    where ``ds`` has none or it is NaN."""
    if name not in ds or "detector" not in ds[name].dims or ds[name].dtype.kind not in "biuf":
        return None
    value = float(ds[name].sel(detector=detector).astype(float).mean())
    return value if np.isfinite(value) else None


def _detector_text(ds: xr.Dataset, name: str, detector: str) -> str | None:
    """A per-detector string of ``ds`` (its first sweep cell), None where ``ds`` has none."""
    if name not in ds or "detector" not in ds[name].dims:
        return None
    return str(ds[name].sel(detector=detector).values.reshape(-1)[0])


def _detector_rows(ds: xr.Dataset) -> list[dict[str, Any]]:
    """One entry per detector of a score over ``(detector, layer, head)``: ``top`` heads (as a plain head score's),
    ``heads`` (how many), and where ``ds`` holds them, ``threshold``, ``labelled`` (heads whose ``label`` is set;
    sweep cells averaged) and the causal check's ``causal`` status (``causal_status``, else ``supported``)."""
    rows = []
    for d in ds["detector"].values:
        detector = str(d)
        score = head_scores(ds["score"].sel(detector=d))
        row: dict[str, Any] = {"detector": detector, "heads": int(score.size),
                               "top": [{"layer": h[0], "head": h[1], "score": s} for h, s in ranked(score)[:10]],
                               "threshold": _detector_value(ds, "threshold", detector), "labelled": None,
                               "causal": _detector_text(ds, "causal_status", detector)}
        if "label" in ds and {"detector", "layer", "head"} <= set(ds["label"].dims):
            label = ds["label"].sel(detector=d).astype(float)
            extra = [x for x in label.dims if x not in ("layer", "head")]
            count = label.sum(["layer", "head"])
            row["labelled"] = float(count.mean(extra)) if extra else int(count)
        if row["causal"] is None and "supported" in ds and "detector" in ds["supported"].dims:
            row["causal"] = "supported" if bool(ds["supported"].sel(detector=d).any()) else "not supported"
        rows.append(row)
    return rows


def _sweep_cells(run: RunView, ds: xr.Dataset) -> Iterator[tuple[dict[str, Any], xr.Dataset]]:
    """``(cell, sub)`` for every sweep cell of ``ds``: ``{sweep key: value}`` and the dataset at it."""
    keys = [k for k in run.sweep if k in ds.dims]
    grids = [[v.item() if hasattr(v, "item") else v for v in ds[k].values] for k in keys]
    for combo in itertools.product(*grids):
        cell = dict(zip(keys, combo, strict=True))
        yield cell, (ds.sel(cell) if cell else ds)


def _cell_rows(run: RunView, ds: xr.Dataset, metrics: list[str]) -> list[dict[str, Any]]:
    """``[{"cell": {sweep key: value}, "metrics": {name: mean over the cell's examples}, "estimates": {name:
    Estimate}}]`` (:func:`metric_estimate`: the mean with its n, drops and interval; for metrics over
    ``example`` only, a step-level value has none); a step whose attrs name
    ``summary_dims`` (the ablation's ``k``) has one row per value of those too."""
    rows = []
    for cell, sub in _sweep_cells(run, ds):
        dims = [d for d in sub.attrs.get("summary_dims", ds.attrs.get("summary_dims", [])) if d in sub.dims]
        grids = [[v.item() if hasattr(v, "item") else v for v in sub[d].values] for d in dims]
        for combo in itertools.product(*grids):
            at = dict(zip(dims, combo, strict=True))
            values = {m: sub[m].sel({d: v for d, v in at.items() if d in sub[m].dims}) for m in metrics}
            real = _real_examples(sub)
            if real is not None:  # a sweep over the task's size pads smaller cells: not examples, not drops
                values = {m: v.isel(example=real) if "example" in v.dims else v for m, v in values.items()}
            estimates = {m: metric_estimate(v, m) for m, v in values.items() if "example" in v.dims}
            rows.append({"cell": {**cell, **at},
                         "metrics": {m: estimates[m].mean if m in estimates else float(np.nanmean(v.values))
                                     for m, v in values.items()},
                         "estimates": estimates})
    return rows


def _task_rows(run: RunView, ds: xr.Dataset, metrics: list[str]) -> list[dict[str, Any]]:
    """``[{"cell": {sweep key: value}, "task": name, "metrics": {name: value}}]`` for per-task metrics."""
    rows = []
    for cell, sub in _sweep_cells(run, ds):
        for t in sub["task"].values.tolist():
            values = {m: float(sub[m].sel(task=t)) for m in metrics}
            if any(np.isfinite(v) for v in values.values()):
                rows.append({"cell": cell, "task": str(t),
                             "metrics": {m: v for m, v in values.items() if np.isfinite(v)}})
    return rows


def run_html(run: RunView) -> str:
    """The run as an HTML block for a notebook: its name, status, cells and model, and one row per step with
    its summary (:func:`run_summary`)."""
    rows = []
    for step, info in run_summary(run).items():
        if "detectors" in info:
            top = "; ".join(f"{r['detector']} L{r['top'][0]['layer']}H{r['top'][0]['head']} {r['top'][0]['score']:.3f}"
                            for r in info["detectors"] if r["top"])
            rows.append(f"<tr><td>{escape(step)}</td><td>detect {escape(info['method'])}</td><td>{escape(top)}</td></tr>")
        elif "top" in info:
            top = ", ".join(f"L{t['layer']}H{t['head']} {t['score']:.3f}" for t in info["top"][:5])
            rows.append(f"<tr><td>{escape(step)}</td><td>detect {escape(info['method'])}</td><td>{top}</td></tr>")
        else:
            ms = "; ".join(", ".join(f"{k} {v:.3f}" for k, v in r["metrics"].items())
                           + (f" ({', '.join(f'{a}={b}' for a, b in r['cell'].items())})" if r["cell"] else "")
                           for r in info.get("cells", []))
            ms += "; ".join(
                ", ".join(f"{c}={v}" for c, v in r["cell"].items()) + (" " if r["cell"] else "") + f"{r['task']}: "
                + ", ".join(f"{k} {v:.3f}" for k, v in r["metrics"].items()) for r in info.get("tasks", []))
            rows.append(f"<tr><td>{escape(step)}</td><td>{escape(info['kind'])}</td><td>{escape(ms)}</td></tr>")
    return (f"<div><b>headlab run</b> {escape(run.name)} &middot; {escape(run.status)} &middot; "
            f"{run.cells_done}/{run.cells_total} cells &middot; model {escape(str(run.attrs.get('model')))}"
            f"<table><tr><th>step</th><th>action</th><th>summary</th></tr>{''.join(rows)}</table></div>")


def _real_examples(ds: xr.Dataset) -> np.ndarray | None:
    """The indices of ``ds``'s examples that are examples of its cell, not the padding :class:`headlab.Run` adds
    where a sweep's cells have different numbers of examples (no token of ``input_ids``, or an empty ``prompt``);
    None when ``ds`` says neither."""
    if "example" not in ds.dims:
        return None
    if "input_ids" in ds and set(ds["input_ids"].dims) == {"example", "token"}:
        return np.flatnonzero((ds["input_ids"] >= 0).any("token").values)
    if "prompt" in ds and ds["prompt"].dims == ("example",) and ds["prompt"].dtype.kind in "OUT":
        return np.flatnonzero(ds["prompt"].values.astype(str) != "")
    return None
