"""A run's summary as rows, one or more per step: what the step did (:mod:`headlab.describe`), its headline
number, the n it averages over and the 95% interval (:mod:`headlab.summary`). ``headlab show`` prints them as
one table; every step of the run has a row, and a step with no number to summarise says so.

The numbers are those of :meth:`headlab.Run.summary`, which the report prints too.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .describe import StepDescription, describe_steps
from .summary import Estimate

__all__ = ["SummaryRow", "detector_text", "head_label", "summary_rows"]


@dataclass(frozen=True)
class SummaryRow:
    """One row of a run's summary: ``step`` and what it did (``what``, ``is_control``), a ``metric`` and its
    ``value`` (text), the ``estimate`` behind a mean over examples (its n, drops and interval), and ``note``
    where the step has no number to summarise."""

    step: str
    what: str
    is_control: bool
    metric: str = ""
    value: str = ""
    estimate: Estimate | None = None
    cell: dict[str, Any] = field(default_factory=dict)
    note: str | None = None

    @property
    def n(self) -> str:
        """``n``; ``n/total`` where examples were dropped as undefined; ``-`` for a value that is no mean over
        examples."""
        e = self.estimate
        if e is None:
            return "-"
        return f"{e.n}/{e.total}" if e.dropped else str(e.n)

    def interval(self, digits: int = 3) -> str:
        """The 95% interval, ``-`` where there is none."""
        return self.estimate.interval_text(digits) if self.estimate is not None else "-"


def head_label(layer: int, head: int, unit: str = "head") -> str:
    """``L1H5``, or ``L1KV0`` for a key/value head."""
    return f"L{layer}KV{head}" if unit == "kv_head" else f"L{layer}H{head}"


def detector_text(row: Mapping[str, Any], unit: str = "head", digits: int = 3) -> str:
    """One detector of a labelled cube in words (a row of :func:`headlab.display.run_summary`'s ``detectors``):
    ``induction: top head L3H1, 4/32 labelled (threshold 0.25), causal: supported``; the parts the cube lacks are
    left out."""
    parts = [f"{row['detector']}: top head {head_label(row['top'][0]['layer'], row['top'][0]['head'], unit)}"
             if row["top"] else f"{row['detector']}: no head"]
    labelled, threshold = row.get("labelled"), row.get("threshold")
    if labelled is not None:
        count = str(labelled) if isinstance(labelled, int) else f"{labelled:.{digits}g}"
        thr = f" (threshold {_number(threshold, digits)})" if threshold is not None else " (no threshold)"
        parts.append(f"{count}/{row['heads']} labelled{thr}")
    elif threshold is not None:
        parts.append(f"threshold {_number(threshold, digits)}")
    if row.get("causal"):
        parts.append(f"causal: {row['causal']}")
    return ", ".join(parts)


def _number(value: float, digits: int) -> str:
    return f"{value:.{digits}f}" if math.isfinite(value) else "undefined"


def _cell_text(cell: Mapping[str, Any]) -> str:
    return " ".join(f"{str(k).rsplit('.', 1)[-1]}={v}" for k, v in cell.items())


def _no_figure(run: Any, step: str) -> str:
    ds = run.results.get(step)
    if ds is None:
        return "no result stored (the step failed or has not run)"
    if "score" in ds:
        dims = " x ".join(str(d) for d in ds["score"].dims if d not in run.sweep)
        return f"no summary figure: its score is over {dims or 'no dimension'} (see `headlab report`)"
    return "no summary figure: it stores no score and no metric (see `headlab report`)"


def summary_rows(run: Any, digits: int = 3) -> list[SummaryRow]:
    """The rows of ``run``'s summary (a :class:`headlab.Run`), every step of the run in its order: a detect
    step's top head (the per-token peak of a per-token score; per detector for a labelled cube, with its heads
    labelled, threshold and causal status, :func:`detector_text`), each metric's mean with its n and interval per
    sweep cell, per-task values, the KV policy's kept fraction; a note for a step with none of them."""
    summary = run.summary()
    described = describe_steps(run.attrs.get("resolved") or run.spec_data)
    rows: list[SummaryRow] = []
    for step in [*run.steps, *(s for s in summary if s not in run.steps)]:
        d = described.get(step) or StepDescription(step=step, text=str(summary.get(step, {}).get("kind", "")),
                                                   is_control=False, action="")
        base = {"step": step, "what": d.text, "is_control": d.is_control}
        info = summary.get(step, {})
        mine: list[SummaryRow] = []
        if info.get("top"):
            t = info["top"][0]
            label = head_label(t["layer"], t["head"], info.get("unit", "head"))
            metric = f"top head {label}" + (" (token peak)" if info.get("token_peak") else "")
            mine.append(SummaryRow(**base, metric=metric, value=_number(t["score"], digits)))
        for r in info.get("detectors", []):
            mine.append(SummaryRow(**base, metric=detector_text(r, info.get("unit", "head"), digits),
                                   value=_number(r["top"][0]["score"], digits) if r["top"] else "undefined"))
        for r in info.get("cells", []):
            where = _cell_text(r["cell"])
            for m, value in r["metrics"].items():
                e = r["estimates"].get(m)
                mine.append(SummaryRow(**base, metric=f"{where}: {m}" if where else m, value=_number(value, digits),
                                       estimate=e, cell=dict(r["cell"])))
        for r in info.get("tasks", []):
            where = _cell_text(r["cell"])
            for m, value in r["metrics"].items():
                label = f"{r['task']} {m}"
                mine.append(SummaryRow(**base, metric=f"{where}: {label}" if where else label,
                                       value=_number(value, digits), cell=dict(r["cell"])))
        for r in info.get("kv", []):
            where = _cell_text(r["cell"])
            label = "kv kept"
            mine.append(SummaryRow(**base, metric=f"{where}: {label}" if where else label,
                                   value=_number(r["kept_fraction"], digits), cell=dict(r["cell"])))
        rows += mine or [SummaryRow(**base, note=_no_figure(run, step))]
    return rows
