"""``RunBrowser`` and ``Compare``: runs of a store, metric tables across cells and runs, generations
side by side with their differences highlighted.

The tables are plain pandas DataFrames (:func:`metric_table`, :func:`top_heads_table`,
:func:`generation_table`), so they are usable without widgets; the widgets lay them out.
"""

from __future__ import annotations

import difflib
import html
import json
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import ipywidgets as w
import pandas as pd
import xarray as xr

from ..heads import ranked
from ..results import Run, list_runs, open_run
from ..summary import metric_estimate
from .views import figure_box, run_views

__all__ = ["Compare", "RunBrowser", "diff_html", "generation_columns", "generation_table", "generations_html",
           "metric_table", "side_by_side", "top_heads_table"]


def _as_run(run: Run | str | Path) -> Run:
    return run if isinstance(run, Run) else open_run(run)


def _label_value(v: Any) -> Any:
    if isinstance(v, str):
        try:
            return json.loads(v)
        except ValueError:
            return v
    return v.item() if hasattr(v, "item") else v


def _cells_of(run: Run, da: xr.DataArray) -> list[dict[str, Any]]:
    dims = [k for k in run.sweep if k in da.dims]
    if not dims:
        return [{}]
    stacked = da.stack(_cell=dims) if len(dims) > 1 else None
    if stacked is not None:
        return [dict(zip(dims, t, strict=True)) for t in stacked["_cell"].values]
    return [{dims[0]: v} for v in da[dims[0]].values]


def _is_detect(ds: xr.Dataset) -> bool:
    return "score" in ds and {"layer", "head"} <= set(ds["score"].dims)


def _is_generate(ds: xr.Dataset) -> bool:
    """A generate step's dataset (``output`` per example); detect steps that also decode are not."""
    action = ds.attrs.get("action")
    return "output" in ds and (action == "generate" or (action is None and not _is_detect(ds)))


def metric_table(runs: Iterable[Run | str | Path], steps: Sequence[str] | None = None) -> pd.DataFrame:
    """One row per (run, generate step, sweep cell), one column per metric (mean over the examples where it
    is defined) with ``{metric}_n``, ``{metric}_dropped`` (undefined values) and the 95% interval
    ``{metric}_low``/``{metric}_high`` (:func:`headlab.estimate`).

    Sweep keys become columns too, so cells of one run and runs of different specs line up.
    """
    rows = []
    for run in map(_as_run, runs):
        for step, ds in run.results.items():
            if not _is_generate(ds) or (steps is not None and step not in steps):
                continue
            metrics = [m for m in ds.attrs.get("metrics", []) if m in ds]
            for cell in _cells_of(run, ds["output"]):
                sub = ds.sel(cell) if cell else ds
                row: dict[str, Any] = {"run": run.path.name, "step": step, "decode": ds.attrs.get("decode", ""),
                                       "steer": ",".join(ds.attrs.get("steer", []))}
                row.update({k: _label_value(v) for k, v in cell.items()})
                for m in metrics:  # the numbers `headlab show` and the report print
                    e = metric_estimate(sub[m], m)
                    row.update({m: e.mean, f"{m}_n": e.n, f"{m}_dropped": e.dropped, f"{m}_low": e.low,
                                f"{m}_high": e.high})
                row["n"] = int(sub.sizes.get("example", 0))
                rows.append(row)
    return pd.DataFrame(rows)


def top_heads_table(runs: Iterable[Run | str | Path], k: int = 5) -> pd.DataFrame:
    """One row per (run, detect step, sweep cell): the ``k`` top heads and their scores."""
    rows = []
    for run in map(_as_run, runs):
        for step, ds in run.results.items():
            if not _is_detect(ds):
                continue
            score = ds["score"]
            for cell in _cells_of(run, score):
                sub = score.sel(cell) if cell else score
                extra = [d for d in sub.dims if d not in ("layer", "head")]
                sub = sub.mean(extra) if extra else sub
                row: dict[str, Any] = {"run": run.path.name, "step": step, "method": ds.attrs.get("method", "")}
                row.update({kk: _label_value(v) for kk, v in cell.items()})
                for i, ((layer, head), s) in enumerate(ranked(sub)[:k], 1):
                    row[f"#{i}"] = f"L{layer}H{head} {s:.3f}"
                rows.append(row)
    return pd.DataFrame(rows)


def generation_columns(runs: Iterable[Run | str | Path], steps: Sequence[str] | None = None
                       ) -> list[tuple[str, Run, str, dict[str, Any]]]:
    """Every (label, run, step, cell) that produced generations, in order."""
    out = []
    runs = list(map(_as_run, runs))
    for run in runs:
        for step, ds in run.results.items():
            if not _is_generate(ds) or (steps is not None and step not in steps):
                continue
            for cell in _cells_of(run, ds["output"]):
                label = step if len(runs) == 1 else f"{run.path.name}/{step}"
                extra = ", ".join(f"{k}={_label_value(v)}" for k, v in cell.items())
                out.append((f"{label} [{extra}]" if extra else label, run, step, cell))
    return out


def generation_table(runs: Iterable[Run | str | Path], steps: Sequence[str] | None = None,
                     examples: Sequence[int] | None = None) -> pd.DataFrame:
    """Generations side by side: one row per example (with its prompt and target), one column per
    (run, generate step, sweep cell)."""
    cols = generation_columns(runs, steps)
    if not cols:
        return pd.DataFrame()
    first = cols[0][1].results[cols[0][2]]
    n = first.sizes.get("example", 0)
    idx = list(range(n)) if examples is None else list(examples)
    data: dict[str, list[Any]] = {"prompt": [], "target": []}
    for i in idx:
        p = first["prompt"].isel(example=i)
        t = first["target"].isel(example=i) if "target" in first else None
        data["prompt"].append(str(p.values.flat[0]))
        data["target"].append("" if t is None else str(t.values.flat[0]))
    for label, run, step, cell in cols:
        ds = run.results[step]
        out = ds["output"].sel(cell) if cell else ds["output"]
        data[label] = [str(out.isel(example=i).values) if i < out.sizes["example"] else "" for i in idx]
    return pd.DataFrame(data, index=pd.Index(idx, name="example"))


_WORD = re.compile(r"\s+|\w+|[^\w\s]")


def diff_html(reference: str, text: str) -> str:
    """``text`` as HTML with the words that differ from ``reference`` wrapped in ``<mark class="hl-diff">``
    (inserted or changed) and deletions shown as ``<del class="hl-del">``."""
    a, b = _WORD.findall(reference), _WORD.findall(text)
    out = []
    for op, i1, i2, j1, j2 in difflib.SequenceMatcher(a=a, b=b, autojunk=False).get_opcodes():
        seg = html.escape("".join(b[j1:j2]))
        if op == "equal":
            out.append(seg)
        elif op in ("replace", "insert"):
            out.append(f'<mark class="hl-diff">{seg}</mark>')
        if op in ("replace", "delete") and i2 > i1 and "".join(a[i1:i2]).strip():
            out.append(f'<del class="hl-del">{html.escape("".join(a[i1:i2]))}</del>')
    return "".join(out)


_TABLE_CSS = """<style>
.headlab-compare table{border-collapse:collapse;font-size:12px}
.headlab-compare th,.headlab-compare td{border:1px solid #ddd;padding:3px 6px;text-align:left;vertical-align:top;max-width:360px}
.headlab-compare mark.hl-diff{background:#ffe08a}
.headlab-compare del.hl-del{color:#b00;background:#fde2e2}
.headlab-compare .hl-prompt{color:#555;font-size:11px;white-space:pre-wrap}
</style>"""


def generations_html(table: pd.DataFrame, *, prompt_chars: int = 200) -> str:
    """The side-by-side table as HTML, every column diffed against the first generation column."""
    if table.empty:
        return "<p>no generations</p>"
    gen_cols = [c for c in table.columns if c not in ("prompt", "target")]
    head = "".join(f"<th>{html.escape(str(c))}</th>" for c in ["example", "prompt", "target", *gen_cols])
    body = []
    for idx, row in table.iterrows():
        ref = str(row[gen_cols[0]])
        prompt = str(row["prompt"])
        prompt = prompt if len(prompt) <= prompt_chars else "…" + prompt[-prompt_chars:]
        cells = [f"<td>{idx}</td>", f'<td class="hl-prompt">{html.escape(prompt)}</td>',
                 f"<td>{html.escape(str(row['target']))}</td>"]
        for k, c in enumerate(gen_cols):
            text = str(row[c])
            same = text == ref
            content = html.escape(text) if k == 0 or same else diff_html(ref, text)
            cells.append(f'<td class="{"hl-same" if same else "hl-differs"}">{content}</td>')
        body.append("<tr>" + "".join(cells) + "</tr>")
    return f'<table class="hl-generations"><tr>{head}</tr>{"".join(body)}</table>'


def _df_html(df: pd.DataFrame, cls: str) -> str:
    if df.empty:
        return "<p>(none)</p>"
    return df.to_html(index=False, classes=cls, float_format=lambda x: f"{x:.4f}", border=0)


class Compare(w.VBox):
    """Runs side by side: metric tables across runs and sweep cells, top heads per detect step, and
    generations of every generate step (several strategies) with differences from the first column
    highlighted. ``Compare([run_a, run_b])`` or ``Compare([run])`` for the steps of one run."""

    def __init__(self, runs: Iterable[Run | str | Path], *, steps: Sequence[str] | None = None,
                 n_examples: int = 8) -> None:
        self.runs = [_as_run(r) for r in runs]
        self.steps = steps
        self.n_examples = n_examples
        self.metrics = metric_table(self.runs, steps)
        self.heads = top_heads_table(self.runs)
        n = max((ds.sizes.get("example", 0) for r in self.runs for ds in r.results.values() if _is_generate(ds)),
                default=0)
        self.example_start = w.IntSlider(value=0, min=0, max=max(0, n - 1), description="from example")
        self.example_start.observe(lambda _: self._update_generations(), names="value")
        self.metrics_html = w.HTML(_TABLE_CSS + '<div class="headlab-compare"><h4>metrics</h4>'
                                   + _df_html(self.metrics, "hl-metrics") + "</div>")
        self.heads_html = w.HTML('<div class="headlab-compare"><h4>top heads</h4>'
                                 + _df_html(self.heads, "hl-heads") + "</div>")
        self.generations_html = w.HTML()
        self._update_generations()
        children: list[w.Widget] = []
        if not self.metrics.empty:
            children.append(self.metrics_html)
        if not self.heads.empty:
            children.append(self.heads_html)
        if n:
            children += [self.example_start, self.generations_html]
        super().__init__(children)
        self.add_class("headlab-compare-widget")

    def generations(self, examples: Sequence[int] | None = None) -> pd.DataFrame:
        """The side-by-side generation table (see :func:`generation_table`)."""
        return generation_table(self.runs, self.steps, examples)

    def _update_generations(self) -> None:
        start = int(self.example_start.value)
        n = self.example_start.max + 1
        table = self.generations(range(start, min(n, start + self.n_examples))) if n else pd.DataFrame()
        self.generations_html.value = (_TABLE_CSS + '<div class="headlab-compare"><h4>generations</h4>'
                                       + generations_html(table) + "</div>")


class RunBrowser(w.VBox):
    """The runs of a store directory: a table to pick from, the picked runs' summaries and head maps,
    and a :class:`Compare` of them. ``RunBrowser("./headlab-runs")``."""

    def __init__(self, directory: str | Path = "./headlab-runs") -> None:
        self.directory = Path(directory)
        self.picker = w.SelectMultiple(description="runs", layout=w.Layout(width="95%", height="120px"))
        self.refresh_button = w.Button(description="refresh", icon="refresh")
        self.refresh_button.on_click(lambda _: self.refresh())
        self.table = w.HTML()
        self.detail = w.VBox()
        self.picker.observe(lambda _: self.show(), names="value")
        super().__init__([w.HBox([self.refresh_button]), self.table, self.picker, self.detail])
        self.add_class("headlab-run-browser")
        self.refresh()

    @property
    def runs(self) -> list[Run]:
        return self._runs

    def refresh(self) -> None:
        """Re-read the store directory."""
        self._runs = list_runs(self.directory)
        rows = [{"run": r.path.name, "name": r.name, "status": r.status, "cells": f"{r.cells_done}/{r.cells_total}",
                 "created": r.attrs.get("created", ""), "model": r.attrs.get("model", ""),
                 "steps": ", ".join(r.steps)} for r in self._runs]
        self.table.value = _TABLE_CSS + '<div class="headlab-compare">' + _df_html(pd.DataFrame(rows), "hl-runs") \
            + "</div>"
        self.picker.options = [(f"{r.path.name} ({r.status})", str(r.path)) for r in self._runs]

    def select(self, runs: Iterable[Run | str | Path]) -> RunBrowser:
        """Pick runs by object or path (as clicking in the list does)."""
        self.picker.value = tuple(str(_as_run(r).path) for r in runs)
        return self

    def show(self) -> None:
        """Show the picked runs: the first one's summary and figures (:func:`headlab.widgets.run_views`: a head map,
        patching map, DLA bars or circuit graph per detect step, the KV trade-off), and a comparison."""

        picked = [open_run(p) for p in self.picker.value]
        if not picked:
            self.detail.children = []
            return
        first = picked[0]
        summary = w.HTML(first._repr_html_())
        self.compare = Compare(picked)
        self.detail.children = [summary, figure_box(run_views(first)), self.compare]


def side_by_side(table: pd.DataFrame, *, prompt_chars: int = 200) -> w.HTML:
    """A widget showing generations side by side: ``table`` has columns ``prompt``, ``target`` and one
    per generation (as :func:`generation_table` returns); differences from the first generation column
    are highlighted."""
    out = w.HTML(_TABLE_CSS + '<div class="headlab-compare">' + generations_html(table, prompt_chars=prompt_chars)
                 + "</div>")
    out.add_class("headlab-side-by-side")
    return out
