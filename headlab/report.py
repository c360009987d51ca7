"""Static HTML reports of runs, for people who do not open notebooks.

``headlab report RUN`` (or :func:`write_report`) writes one self-contained HTML file: provenance, the
spec, a (layer x head) heatmap of every detect step's scores (averaged over sweep cells, and one per
cell when there is a sweep), top-head tables, metric tables per sweep cell, line plots of metrics and
top-head scores against numeric sweep keys, sample generations, per-task metrics with sample records
(``evaluate`` steps), the circuit analyses (:mod:`headlab.circuit_figures` on the numbers of
:mod:`headlab.circuit_view`: patching maps with the top heads' scores per token, residual-stream patching per
layer and token, token strings on token axes, AtP against exact patching, direct logit attribution with the
heads apart from the totals, the selected circuit as a graph with its faithfulness), the attention patterns
of each detect step's top heads on its first prompt (:mod:`headlab.attention_patterns`), the
KV-cache trade-off of the steps with a ``kv`` policy (:mod:`headlab.kv.view`: each metric against the kept
fraction and the KV bytes, one point per step and sweep cell, with a table of the bytes), and,
for steps on examples with images that stored a preview
(:func:`headlab.image_attention.attention_preview`), the first image with the top heads' attention over its patches.
Two figures follow the data a step stores (:mod:`headlab.head_figures`): a detect step whose scores are
accuracies with a ``chance`` attribute also gets each layer's heads sorted by accuracy, the colour centred at
chance; a step storing a masking curve (``metric``, ``reverse``, ``random_mean``, ``random_std`` over
``fraction``) gets the three curves on one chart; a labelled head cube ``(detector, layer, head)`` and a comparison of two get the
figures of :mod:`headlab.role_figures`. A sweep over two numeric keys also plots each metric against
one key with a line per value of the other.
A run with two or more generate, score or evaluate steps gets a comparison across steps: one bar chart per
metric with each step's mean, 95% interval and n (:mod:`headlab.summary`), steps grouped by task and controls
(random heads, random direction, random KV heads) marked, and the outputs side by side, a column per step.

The charts are Vega-Lite figures built by :mod:`headlab.figures` (Vega-Altair), the same objects the notebook
shows and ``headlab report --format svg|png`` exports; their JavaScript is inlined once per page, so the file
loads nothing from the network. The hand-drawn picture that remains (the attention over an image) comes from
:mod:`headlab.svg`, whose colour names are re-exported here.
"""

from __future__ import annotations

import functools
import itertools
import json
import math
from collections.abc import Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from html import escape
from pathlib import Path
from typing import Any, Literal

import numpy as np
import xarray as xr

from . import figures
from .attention_patterns import head_patterns, run_model, top_heads
from .circuit_figures import (
    atp_scatter,
    circuit_chart,
    dla_chart,
    head_map_chart,
    pattern_charts,
    token_chart,
)
from .circuit_view import (
    atp_pairs,
    atp_vs_exact,
    circuit_edges,
    circuit_kind,
    circuit_of,
    head_map,
    resid_map,
    token_labels,
    tokenizer_for,
)
from .context import IMAGE_MARKER
from .describe import StepDescription, describe_steps
from .head_figures import has_chance, is_masking_curve, masking_curve_chart, ranked_accuracy_chart
from .heads import ranked
from .image_attention import PREVIEW_ATTENTION, image_attention_svg, preview_of
from .kv.view import (
    kv_metrics,
    kv_points,
    kv_table_rows,
    kv_tradeoff_chart,
    needle_by_length_chart,
    needle_heatmap_chart,
    needle_steps,
)
from .results import Run, open_run
from .role_figures import cube_parts
from .roles import is_cube, is_cube_comparison
from .svg import NAN_COLOR, PALETTE, color, colour_bar_svg

__all__ = ["CSS", "NAN_COLOR", "PALETTE", "ReportFigure", "color", "colour_bar_svg", "render_report", "report_figures",
           "write_report"]


@dataclass(frozen=True)
class ReportFigure:
    """One figure of a report: a name saying what it shows (``"greedy: score"``) and the chart."""

    name: str
    chart: figures.Chart


_COLLECTED: ContextVar[list[ReportFigure] | None] = ContextVar("headlab_report_figures", default=None)


def _figure(chart: figures.Chart, name: str) -> str:
    collected = _COLLECTED.get()
    if collected is not None:
        collected.append(ReportFigure(name, chart))
    return figures.to_html_fragment(chart, name=name)


def _config(ds: xr.Dataset) -> dict[str, Any]:
    try:
        value = json.loads(str(ds.attrs.get("config", "{}")))
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _described(run: Run) -> dict[str, StepDescription]:
    """What each step of ``run`` did (:func:`headlab.describe_steps`); the spec is validated once per resolved
    config, not once per step header."""
    resolved = run.attrs.get("resolved")
    return _described_resolved(resolved) if isinstance(resolved, str) else describe_steps(run.spec_data)


@functools.lru_cache(maxsize=8)
def _described_resolved(resolved: str) -> dict[str, StepDescription]:
    return describe_steps(resolved)


def _step_title(run: Run, step: str) -> str:
    """The step id and what the step did (decoder and its options, steering, heads and where they come from,
    KV policy; ``control:`` first for a control), as ``headlab show`` says it."""
    d = _described(run).get(step)
    return f"{step}: {d.text}" if d is not None and d.text else step


def _is_control(run: Run, step: str) -> bool:
    """Whether the step is a control (it draws its heads, direction or KV heads at random)."""
    d = _described(run).get(step)
    return bool(d is not None and d.is_control)


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]], cls: str = "") -> str:
    def cell(v: Any) -> str:
        if isinstance(v, float):
            return f'<td class="num">{v:.4g}</td>'
        if isinstance(v, (int, np.integer)) and not isinstance(v, bool):
            return f'<td class="num">{v}</td>'
        return f"<td>{escape(str(v))}</td>"

    head = "".join(f"<th>{escape(str(h))}</th>" for h in header)
    head = f"<thead><tr>{head}</tr></thead>" if any(str(h) for h in header) else ""
    body = "".join("<tr>" + "".join(cell(v) for v in r) + "</tr>" for r in rows)
    return f'<table class="{cls}">{head}<tbody>{body}</tbody></table>'


def _sweep_dims(run: Run, da: xr.DataArray) -> list[str]:
    return [k for k in run.sweep if k in da.dims]


def _cells(run: Run, da: xr.DataArray) -> list[dict[str, Any]]:
    """Every combination of the sweep coordinates present on ``da`` (one empty dict without sweep)."""
    dims = _sweep_dims(run, da)
    if not dims:
        return [{}]
    grids = [[v.item() if hasattr(v, "item") else v for v in da[d].values] for d in dims]

    return [dict(zip(dims, combo, strict=True)) for combo in itertools.product(*grids)]


def _label(cell: Mapping[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in cell.items()) or "all"


def _plain(v: Any) -> Any:
    if isinstance(v, str):
        try:
            return json.loads(v)
        except ValueError:
            return v
    return v


def _detect_section(run: Run, step: str, ds: xr.Dataset) -> str:

    score = ds["score"]
    dims = _sweep_dims(run, score)
    mean = score.mean(dims) if dims else score
    top = ranked(mean)[:10]
    out = [f'<section class="step detect" id="step-{escape(step)}"><h2>{escape(step)}: detect '
           f'<code>{escape(str(ds.attrs.get("method", "")))}</code></h2>']
    title = "score (mean over sweep cells)" if dims else "score"
    out.append('<div class="row">' + _figure(figures.heatmap(mean, title=title, highlight=[h for h, _ in top[:5]]),
                                             f"{step}: score"))
    out.append(_table(["rank", "layer", "head", "score"],
                      [[i, h[0], h[1], s] for i, (h, s) in enumerate(top, 1)], "top") + "</div>")
    out.append(_ranked_accuracy(step, ds, dims))
    cells = _cells(run, score)
    if dims and len(cells) > 1:
        values = score.values.astype(float)
        finite = values[np.isfinite(values)]
        lo, hi = (float(finite.min()), float(finite.max())) if finite.size else (None, None)
        maps = [_figure(figures.heatmap(score.sel(c), title=_label(c), vmin=lo, vmax=hi, cell=12),
                        f"{step}: score at {_label(c)}") for c in cells[:24]]
        out.append('<h3>per sweep cell</h3><div class="row">' + "".join(maps) + "</div>")
        out.append(_sweep_plots(run, dims, cells, {f"L{h[0]}H{h[1]}": score.sel(layer=h[0], head=h[1])
                                                   for h, _ in top[:5]}, "score"))
    out.append("</section>")
    return "".join(out)


def _sweep_plots(run: Run, dims: list[str], cells: list[dict[str, Any]],
                 arrays: Mapping[str, xr.DataArray], ylabel: str, *, per_value: bool = False) -> str:
    """One line plot per sweep key: x = that key's values, one series per array (averaged over the
    other sweep keys); with ``per_value``, for two numeric sweep keys also one plot per array with a line per
    value of the other key (:func:`_sweep_plots_per_value`)."""
    plots = []
    for key in dims:
        keys = list(dict.fromkeys(c[key] for c in cells))
        others = [d for d in dims if d != key]
        series: dict[str, list[float]] = {}
        for name, da in arrays.items():
            ys = []
            for x in keys:
                v = da.sel({key: x})
                v = v.mean() if v.ndim else v
                ys.append(float(v))
            series[name] = ys
        title = f"{ylabel} vs {key}" + (f" (mean over {', '.join(others)})" if others else "")
        plots.append(_figure(figures.line_chart([_plain(x) for x in keys], series, x_title=key, y_title=ylabel,
                                                title=title, series_title="series"), title))
    if per_value:
        plots += _sweep_plots_per_value(dims, cells, arrays)
    return '<div class="row">' + "".join(plots) + "</div>"


def _numeric(values: Sequence[Any]) -> bool:
    return all(isinstance(_plain(v), (int, float)) and not isinstance(_plain(v), bool) for v in values)


def _sweep_plots_per_value(dims: list[str], cells: list[dict[str, Any]],
                           arrays: Mapping[str, xr.DataArray]) -> list[str]:
    """For a sweep over two numeric keys: per array, the array (mean over its other dims) against the key with
    more values (the later key on a tie), one line per value of the other key."""
    if len(dims) != 2:
        return []
    values = {d: list(dict.fromkeys(c[d] for c in cells)) for d in dims}
    if not all(_numeric(v) for v in values.values()):
        return []
    x, other = (dims[0], dims[1]) if len(values[dims[0]]) > len(values[dims[1]]) else (dims[1], dims[0])
    plots = []
    for name, da in arrays.items():
        series = {str(_plain(o)): [float(da.sel({x: xv, other: o}).mean()) for xv in values[x]]
                  for o in values[other]}
        title = f"{name} vs {x}, a line per {other}"
        legend = other.replace(".", "\u2024")  # a "." in a Vega-Lite field name reads as a nested field
        plots.append(_figure(figures.line_chart([_plain(v) for v in values[x]], series, x_title=x, y_title=name,
                                                title=title, series_title=legend), title))
    return plots


def _generate_section(run: Run, step: str, ds: xr.Dataset, n_examples: int) -> str:
    metrics = [m for m in ds.attrs.get("metrics", []) if m in ds]
    out = [f'<section class="step generate" id="step-{escape(step)}"><h2>{escape(_step_title(run, step))}</h2>']
    ref = ds["output"]
    cells = _cells(run, ref)
    dims = _sweep_dims(run, ref)
    if metrics:
        rows = []
        for r in run.summary().get(step, {}).get("cells", []):  # the numbers `headlab show` prints
            for m, value in r["metrics"].items():
                e = r["estimates"].get(m)  # None: a step-level value, not a mean over examples
                rows.append([_label(r["cell"]), m, value if math.isfinite(value) else "undefined",
                             e.interval_text(4) if e else "-", e.n if e else "-", e.dropped_text() if e else "-"])
        out.append("<h3>metrics (mean over the examples where defined, 95% interval)</h3>"
                   + _table(["cell", "metric", "mean", "95% interval", "n", "dropped"], rows, "metrics"))
        if dims and len(cells) > 1:
            means = {m: ds[m].mean("example") if "example" in ds[m].dims else ds[m] for m in metrics}
            out.append(_sweep_plots(run, dims, cells, means, "metric", per_value=True))
    prompts = ds["prompt"]
    head = ["example", "prompt", "target"] + [_label(c) for c in cells]
    rows = []
    for i in range(min(n_examples, ds.sizes.get("example", 0))):
        p = prompts.isel(example=i)
        p = p.values.flat[0] if p.ndim else p.values
        t = ds["target"].isel(example=i) if "target" in ds else None
        t = "" if t is None else (t.values.flat[0] if t.ndim else t.values)
        outs = []
        for c in cells:
            o = (ds["output"].sel(c) if c else ds["output"]).isel(example=i).values
            outs.append(str(o))
        short = str(p) if len(str(p)) <= 160 else "…" + str(p)[-160:]
        rows.append([i, short, str(t), *outs])
    out.append(f"<h3>generations (first {len(rows)})</h3>" + _table(head, rows, "generations"))
    out.append("</section>")
    return "".join(out)


def _task_section(run: Run, step: str, ds: xr.Dataset, n_examples: int) -> str:
    """Per-task metrics (a ``task`` dimension, e.g. an ``evaluate`` step) per sweep cell, and the first
    per-sample records (over ``example``)."""
    metrics = [m for m in ds.attrs.get("metrics", []) if m in ds and "task" in ds[m].dims]
    out = [f'<section class="step tasks" id="step-{escape(step)}"><h2>{escape(_step_title(run, step))}</h2>']
    cells = _cells(run, ds[metrics[0]])
    rows = []
    for c in cells:
        sub = ds.sel(c) if c else ds
        for t in sub["task"].values.tolist():
            values = [float(sub[m].sel(task=t)) for m in metrics]
            if any(math.isfinite(v) for v in values):
                rows.append([_label(c), str(t)] + [v if math.isfinite(v) else "" for v in values])
    out.append("<h3>metrics per task</h3>" + _table(["cell", "task", *metrics], rows, "metrics"))
    if "example" in ds.dims and "prompt" in ds:
        first = ds.isel({d: 0 for d in _sweep_dims(run, ds["prompt"])})
        names = [f"sample_{m}" for m in metrics if f"sample_{m}" in first]
        head = ["example", "task", "doc", "prompt", "target", "answer", *[n.removeprefix("sample_") for n in names]]
        body = []
        for i in range(min(n_examples, first.sizes["example"])):
            ex = first.isel(example=i)
            p = str(ex["prompt"].values)
            answer = str(ex["output"].values) if "output" in ex else ""
            if not answer and "logprob" in ex:
                lp = ex["logprob"].values.astype(float)
                if np.isfinite(lp).any():
                    answer = str(ex["choice_text"].values[int(np.nanargmax(lp))])
            body.append([i, str(ex["sample_task"].values) if "sample_task" in ex.coords else "",
                         int(ex["doc_id"].values) if "doc_id" in ex.coords else "",
                         p if len(p) <= 160 else "…" + p[-160:], str(ex["target"].values) if "target" in ex else "",
                         answer, *[float(ex[n].values) for n in names]])
        out.append(f"<h3>samples (first {len(body)})</h3>" + _table(head, body, "samples"))
    out.append("</section>")
    return "".join(out)


def _values_section(step: str, ds: xr.Dataset) -> str:
    """Small numeric variables of a step without head scores or generations (e.g. ``ablation``)."""
    out = [f'<section class="step values" id="step-{escape(step)}"><h2>{escape(step)}: '
           f'{escape(str(ds.attrs.get("action", "")))} <code>{escape(str(ds.attrs.get("method", "")))}</code></h2>']
    names = [str(n) for n in ds.attrs.get("metrics", [])] or [str(n) for n in ds.data_vars]
    rows = []
    for name in names:
        if name not in ds:
            continue
        da = ds[name]
        if da.dtype.kind not in "fiub" or da.size > 64 or "example" in da.dims or "token" in da.dims:
            continue
        if da.ndim == 0:
            rows.append([name, "", float(da)])
        else:
            for idx in np.ndindex(da.shape):
                label = ", ".join(f"{d}={_plain(da[d].values[i]) if d in da.coords else i}"
                                  for d, i in zip(da.dims, idx, strict=True))
                rows.append([name, label, float(da.values[idx])])
    out.append(_table(["variable", "at", "value"], rows, "values") if rows else "<p>(no small numeric results)</p>")
    out.append("</section>")
    return "".join(out)


def _ranked_accuracy(step: str, ds: xr.Dataset, dims: list[str]) -> str:
    """A map of accuracies with a chance level (:func:`headlab.head_figures.has_chance`): each layer's heads
    sorted by accuracy, the colour centred at chance (empty for other scores)."""
    if not has_chance(ds):
        return ""
    title = "accuracy per head, each layer sorted" + (" (mean over sweep cells)" if dims else "") + \
        f"; white: chance {float(ds.attrs['chance']):.3g}"
    return ('<h3>heads sorted by accuracy within each layer</h3><div class="row">'
            + _figure(ranked_accuracy_chart(ds, title=title), f"{step}: accuracy sorted per layer") + "</div>")


def _curve_section(run: Run, step: str, ds: xr.Dataset) -> str:
    """A masking curve with its controls (:func:`headlab.head_figures.is_masking_curve`): the three curves on
    one chart, then the values."""
    chart = masking_curve_chart(ds)
    section = _values_section(step, ds)
    head_end = section.index("</h2>") + len("</h2>")
    return (section[:head_end] + '<div class="row">' + _figure(chart, f"{step}: masking curve") + "</div>"
            + section[head_end:])


def _cube_section(run: Run, step: str, ds: xr.Dataset) -> str:
    """A labelled head cube or a comparison of two (:func:`headlab.role_figures.cube_parts`), first sweep cell."""
    dims = [d for d in run.sweep if d in ds.dims]
    out = [f'<section class="step cube" id="step-{escape(step)}"><h2>{escape(_step_title(run, step))}'
           + (" (first sweep cell)" if dims else "") + "</h2>"]
    for part in cube_parts(ds.isel({d: 0 for d in dims}), step):
        out.append(f"<h3>{escape(part.heading)}</h3>" if part.heading else "")
        out.append('<div class="row">' + _figure(part.chart, part.name) + "</div>" if part.chart is not None else "")
        out.append(_table(part.header, part.rows, "cube") if part.header else "")
        out.append(f'<p class="causal">{escape(part.text)}</p>' if part.text else "")
    return "".join(out) + "</section>"


def _mean_over_sweep(run: Run, da: xr.DataArray) -> xr.DataArray:
    dims = _sweep_dims(run, da)
    return da.mean(dims) if dims else da


def _step_header(step: str, ds: xr.Dataset, cls: str) -> str:
    return (f'<section class="step {cls}" id="step-{escape(step)}"><h2>{escape(step)}: detect '
            f'<code>{escape(str(ds.attrs.get("method", "")))}</code></h2>')


def _attrs_table(ds: xr.Dataset, keys: Sequence[str]) -> str:
    rows = [[k, ds.attrs[k] if isinstance(ds.attrs[k], float) else str(ds.attrs[k])] for k in keys if k in ds.attrs]
    return _table(["", ""], rows, "meta") if rows else ""


def _tokens(run: Run, ds: xr.Dataset) -> list[str]:
    """Token-axis labels of a per-token result: example 0's tokens (``clean/corrupt`` where its pair differs)."""
    tokenizer = tokenizer_for(str(run.attrs.get("model", "")), run.attrs.get("model_revision"))
    return token_labels(ds, tokenizer)


_TOKENS_NOTE = "tokens of example 0; clean/corrupted where its prompts differ"


def _resid_part(run: Run, step: str, ds: xr.Dataset) -> str:
    """A residual-stream patching result: the (layer x token) map with the tokens of one example."""
    score = resid_map(_mean_over_sweep(run, ds["score"]))
    title = ["residual stream patching: the stream entering each layer, patched at one token",
             _TOKENS_NOTE + (", mean over sweep cells" if _sweep_dims(run, ds["score"]) else "")]
    chart = token_chart(score.values, [f"L{int(v)}" for v in score["layer"].values], _tokens(run, ds),
                        title=title, row_title="layer")
    return _figure(chart, f"{step}: score by layer and token")


def _atp_part(run: Run, step: str, ds: xr.Dataset) -> str:
    """AtP against the exact patching of the same task, when both ran."""
    exact = dict(atp_pairs(run.results)).get(step)
    if exact is None:
        return ""
    top_k = int(ds.attrs.get("top_k", 10)) if isinstance(ds.attrs.get("top_k", 10), (int, float)) else 10
    c = atp_vs_exact(ds, run.results[exact], top_k=top_k, atp_step=step, exact_step=exact)
    return _figure(atp_scatter(c), f"{step}: AtP against {exact}")


def _patching_section(run: Run, step: str, ds: xr.Dataset) -> str:
    """An activation or attribution patching result: the (layer x head) map (a per-token score reduced to
    its peak), the top heads, their scores per token, the unpatched metrics and, for AtP, a scatter against
    the exact patching of the same task; residual-stream patching as a (layer x token) map."""
    out = [_step_header(step, ds, "detect patching")]
    if not {"head", "kv_head"} & set(ds["score"].dims):
        out.append(_resid_part(run, step, ds))
    else:
        out.append(_heads_part(run, step, ds))
    out.append(_atp_part(run, step, ds))
    metrics = [[f"{name} (mean over examples)", float(_mean_over_sweep(run, ds[name]).mean())]
               for name in ("clean", "corrupt") if name in ds]
    out.append('<div class="row">' + (_table(["metric", "value"], metrics, "metrics") if metrics else "")
               + _attrs_table(ds, ["metric", "direction", "unit", "normalise", "convention", "estimator",
                                   "reference_step", "spearman", "top_k", "top_k_recall"]) + "</div>")
    out.append("</section>")
    return "".join(out)


def _heads_part(run: Run, step: str, ds: xr.Dataset) -> str:
    """The (layer x head) map of a patching score, its top heads and, per token, the strongest heads' scores."""

    score = _mean_over_sweep(run, ds["score"])
    by_token = "token" in score.dims
    kv = "kv_head" in score.dims
    hm = head_map(score)
    what = "key/value head" if kv else "head"
    title = "score per " + what + (" (the per-token score of largest magnitude)" if by_token else "")
    if _sweep_dims(run, ds["score"]):
        title += ", mean over sweep cells"
    top = ranked(hm.rename(kv_head="head") if kv else hm)[:10]
    out = ['<div class="row">' + _figure(head_map_chart(hm, title=title, highlight=[h for h, _ in top[:5]]),
                                         f"{step}: score")]
    out.append(_table(["rank", "layer", what, "score"], [[i, h[0], h[1], v] for i, (h, v) in enumerate(top, 1)],
                      "top") + "</div>")
    if by_token:
        strongest = sorted(np.ndindex(hm.shape), key=lambda lh: (-abs(np.nan_to_num(hm.values[lh])), lh))[:8]
        layers, heads = hm["layer"].values, hm[hm.dims[1]].values
        picked = [(int(layers[a]), int(heads[b])) for a, b in strongest]
        per_token = score.transpose("layer", "head", "token")
        values = np.array([per_token.sel(layer=la, head=he).values for la, he in picked], dtype=float)
        chart = token_chart(values, [f"L{la}H{he}" for la, he in picked], _tokens(run, ds),
                            title=["the strongest heads per token", _TOKENS_NOTE], row_title="head")
        out.append(_figure(chart, f"{step}: score by head and token"))
    return "".join(out)


def _dla_section(run: Run, step: str, ds: xr.Dataset) -> str:
    """A direct logit attribution result: the (layer x head) map, the top heads, and the heads' terms apart from
    the totals they add up to (the heads' sum, the rest, the logit difference)."""

    score = _mean_over_sweep(run, ds["score"])
    top = ranked(score)[:10]
    mean = ds.assign(score=score)
    for name in ("rest", "logit_diff"):
        if name in ds:
            mean[name] = _mean_over_sweep(run, ds[name])
    out = [_step_header(step, ds, "detect dla")]
    out.append('<div class="row">' + _figure(head_map_chart(
        score, title="direct effect per head (mean over examples)", highlight=[h for h, _ in top[:5]]),
        f"{step}: score"))
    out.append(_table(["rank", "layer", "head", "score"], [[i, h[0], h[1], v] for i, (h, v) in enumerate(top, 1)],
                      "top") + "</div>")
    heads, totals = dla_chart(mean)
    out.append('<div class="row">' + _figure(heads, f"{step}: heads") + _figure(totals, f"{step}: totals")
               + "</div>")
    out.append("</section>")
    return "".join(out)


def _edges_section(run: Run, step: str, ds: xr.Dataset, top_k: int = 30) -> str:
    """An edge attribution result: its circuit (the ``in_circuit`` edges) as a graph with its faithfulness, or
    without a circuit the ``top_k`` edges of largest ``|score|``; their table."""
    mean = ds.assign(score=_mean_over_sweep(run, ds["score"]))
    circuit = circuit_of(mean)
    out = [_step_header(step, ds, "detect edges")]
    if circuit is not None:
        edges = circuit.edges
        chart = circuit_chart(circuit, title=f"the circuit: {len(edges)} edges")
    else:
        edges = circuit_edges(mean["score"], top_k=top_k)
        chart = circuit_chart(edges, title=f"the {len(edges)} edges of largest |score| (the step selected no circuit)")
    out.append(_figure(chart, f"{step}: circuit"))
    out.append('<div class="row">' + _table(["rank", "source", "destination", "score"],
                                            [[i, e.source, e.destination, e.weight] for i, e in enumerate(edges, 1)],
                                            "edges"))
    values: list[list[Any]] = []
    if circuit is not None:
        values = [["clean (mean over examples)", circuit.clean], ["corrupt (mean over examples)", circuit.corrupt],
                  ["circuit (mean over examples)", circuit.circuit], ["faithfulness", circuit.faithfulness],
                  ["faithfulness_normalised", circuit.faithfulness_normalised]]
    elif "faithfulness" in ds and ds["faithfulness"].dtype.kind in "fiu":
        values = [["faithfulness", float(_mean_over_sweep(run, ds["faithfulness"]).mean())]]
    elif isinstance(ds.attrs.get("faithfulness"), (int, float)):
        values = [["faithfulness", float(ds.attrs["faithfulness"])]]
    out.append((_table(["", ""], values, "metrics") if values else "")
               + _attrs_table(ds, ["metric", "method", "estimator", "circuit_selection", "steps", "top_k",
                                   "threshold"]) + "</div>")
    out.append("</section>")
    return "".join(out)


def _attention_figure(run: Run, step: str, ds: xr.Dataset, drawn: dict[str, set[tuple[int, int]]],
                      n_heads: int = 4) -> str:
    """The attention patterns of the step's ``n_heads`` top heads on its first example's prompt, when the run's
    model is on this machine and the prompt is short (:mod:`headlab.attention_patterns`); a head an earlier step
    drew on the same prompt (``drawn``: prompt -> heads, updated here) is named, not drawn again."""
    score = ds.get("score")
    if score is None or not {"layer", "head"} <= set(score.dims) or "prompt" not in ds or "image" in ds:
        return ""
    prompt = str(ds["prompt"].values.reshape(-1)[0])
    if not prompt or IMAGE_MARKER in prompt:
        return ""
    heads = top_heads(_mean_over_sweep(run, score), n_heads)
    lm = run_model(run.attrs)
    if lm is None or lm.tokenizer is None or lm.processor is not None:
        return ('<p class="note">attention patterns: not drawn, the run\'s text model (with its weights) is not '
                "on this machine.</p>")
    seen = drawn.setdefault(prompt, set())
    new = [h for h in heads if h not in seen]
    above = ", ".join(f"L{a}H{b}" for a, b in heads if (a, b) in seen)
    note = f'<p class="note">drawn above for the same prompt: {escape(above)}.</p>' if above else ""
    if not new:
        return f"<h3>attention of the top {len(heads)} heads on example 0's prompt</h3>{note}"
    try:
        patterns = head_patterns(lm, prompt, new)
    except ValueError as e:
        return f'<p class="note">attention patterns: not drawn, {escape(str(e))}.</p>'
    seen.update(new)
    charts = pattern_charts(patterns)
    return (f"<h3>attention of the top {len(heads)} heads on example 0's prompt (query x key)</h3>{note}"
            '<div class="row">' + "".join(_figure(c, f"{step}: attention L{int(la)}H{int(he)}") for c, la, he in
                                          zip(charts, patterns["layer"].values, patterns["head"].values, strict=True))
            + "</div>")


def _image_figure(run: Run, ds: xr.Dataset, n_heads: int = 3) -> str:
    """The stored image preview of a step (first example, first sweep cell) with the attention of its top
    heads over the patches: by the step's score for a detect step, else by the attention mass on the image."""

    found = preview_of(ds)
    if found is None:
        return ""
    image, att = found
    if "score" in ds and {"layer", "head"} <= set(ds["score"].dims):
        score = ds["score"]
        dims = _sweep_dims(run, score)
        score = score.mean(dims) if dims else score
        extra = [d for d in score.dims if d not in ("layer", "head")]
        score = score.mean(extra) if extra else score
        how = "top heads by score"
    else:
        score = att.sum(["patch_row", "patch_col"])
        how = "heads with the most attention on the image"
    layers = set(att["layer"].values.tolist()) if "layer" in att.coords else set(range(att.sizes["layer"]))
    top = [(h, s) for h, s in ranked(score) if h[0] in layers][:n_heads]
    q = ds[PREVIEW_ATTENTION].attrs.get("query")
    figs = []
    for (layer, head), s in top:
        vals = att.sel(layer=layer, head=head).values if "layer" in att.coords else att.values[layer, head]
        figs.append(image_attention_svg(image, vals, title=f"L{layer}H{head} ({s:.3g})", width=240))
    where = f" from token #{q}" if q is not None else ""
    return (f'<h3>attention over the image ({how}; first example, attention{where} to each patch)</h3>'
            f'<div class="row image-attention">{"".join(figs)}</div>')


CSS = """
body{font-family:-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:24px;color:#222;max-width:1200px}
h1{font-size:22px}h2{font-size:17px;border-bottom:1px solid #ddd;padding-bottom:4px;margin-top:28px}
h3{font-size:14px;color:#444}code,pre{background:#f5f5f5;border-radius:3px}
pre{padding:8px;overflow:auto;font-size:12px}
table{border-collapse:collapse;font-size:12px;margin:6px 12px 6px 0;vertical-align:top}
th,td{border:1px solid #ddd;padding:3px 6px;text-align:left;max-width:420px}td.num{text-align:right;font-variant-numeric:tabular-nums}
th{background:#fafafa}.row{display:flex;flex-wrap:wrap;gap:12px;align-items:flex-start}
.meta td:first-child{color:#666}
"""


def _kv_section(run: Run) -> str:
    """Metric vs KV cache across the steps with a ``kv`` policy and the sweep cells, and for needle tasks the
    metric by context length and the length x depth heatmap per step (empty without a KV policy)."""
    points = kv_points(run)
    if not points:
        return ""
    metrics = kv_metrics(points)
    out = ['<section class="kv" id="kv"><h2>KV cache: metrics vs kept KV</h2>']
    if metrics:
        out.append('<div class="row">' + "".join(
            _figure(kv_tradeoff_chart(points, m, x=x), f"kv: {m} vs {x}") for m in metrics
            for x in ("kept_fraction", "kv_bytes")) + "</div>")
    header, rows = kv_table_rows(points, metrics)
    header = [h.replace("KV bytes", "KV MiB") for h in header]
    rows = [[*r[:3], figures.mib(r[3]), figures.mib(r[4]), *r[5:]] for r in rows]
    out.append(_table(header, rows, "kv"))
    kv_steps = list(dict.fromkeys(p.step for p in points))
    needles = [s for s in needle_steps(run) if s in kv_steps]
    for m in metrics:
        with_m = [s for s in needles if m in run.results[s]]
        if not with_m:
            continue
        out.append(f"<h3>{escape(m)} by context length, and per context length and needle depth</h3>")
        out.append('<div class="row">' + _figure(needle_by_length_chart(run, with_m, m), f"kv: {m} by length")
                   + "</div>")
        out.append('<div class="row needle-maps">' + "".join(
            _figure(needle_heatmap_chart(run, s, m), f"kv: {s} {m} by length and depth") for s in with_m) + "</div>")
    out.append("</section>")
    return "".join(out)


_COMPARED = ("generate", "score", "evaluate")


def _compared_steps(run: Run, summary: Mapping[str, Any]) -> list[str]:
    return [step for step, ds in run.results.items() if str(ds.attrs.get("action", "")) in _COMPARED
            and summary.get(step, {}).get("cells")]


def _comparison_section(run: Run, n_examples: int) -> str:
    """One bar chart per metric with a bar per step (and sweep cell), its 95% interval and n, steps grouped by
    task and controls marked; then each task's outputs side by side (empty with fewer than two such steps)."""
    summary = run.summary()
    steps = _compared_steps(run, summary)
    if len(steps) < 2:
        return ""
    metrics: dict[str, list[dict[str, Any]]] = {}
    for step in steps:
        ds = run.results[step]
        control = _is_control(run, step)
        for r in summary[step]["cells"]:
            for m, e in r["estimates"].items():
                label = step + (f" ({_label(r['cell'])})" if r["cell"] else "") + (" [control]" if control else "")
                dropped = f", {e.dropped} dropped" if e.dropped else ""
                metrics.setdefault(m, []).append({
                    "step": label, "mean": e.mean, "low": e.low, "high": e.high, "n": f"n={e.n}{dropped}",
                    "task": str(ds.attrs.get("task", "")), "control": control, "what": _step_title(run, step)})
    out = ['<section class="comparison" id="comparison"><h2>comparison across steps</h2>',
           "<p>mean over the examples where the metric is defined, 95% interval (Wilson for proportions, bootstrap "
           "otherwise) and n; [control]: a step that draws its heads or direction at random</p>"]
    charts = []
    for m, rows in metrics.items():
        rows = sorted(rows, key=lambda r: [t["task"] for t in rows].index(r["task"]))  # group by task, stable
        finite = [v for r in rows for v in (r["mean"], r["low"], r["high"]) if math.isfinite(v)]
        ratio = bool(finite) and all(0.0 <= v <= 1.0 for v in finite)
        charts.append(_figure(figures.bar_chart(
            rows, category="step", value="mean", value_title=f"{m} (mean, 95% interval)", low="low", high="high",
            note="n", group="task" if len({r["task"] for r in rows}) > 1 else None, marked="control",
            value_domain=(0.0, 1.0) if ratio else None, title=f"{m} per step"), f"comparison: {m}"))
    out.append('<div class="row">' + "".join(charts) + "</div>")
    by_task: dict[str, list[str]] = {}
    for step in steps:
        if "output" in run.results[step] and "prompt" in run.results[step]:
            by_task.setdefault(str(run.results[step].attrs.get("task", "")), []).append(step)
    for task, group in by_task.items():
        if len(group) < 2:
            continue
        first = {s: run.results[s].isel({k: 0 for k in run.sweep if k in run.results[s].dims}) for s in group}
        n = min(n_examples, *(first[s].sizes.get("example", 0) for s in group))
        rows = []
        for i in range(n):
            p = str(first[group[0]]["prompt"].isel(example=i).values)
            t = str(first[group[0]]["target"].isel(example=i).values) if "target" in first[group[0]] else ""
            rows.append([i, p if len(p) <= 120 else "…" + p[-120:], t,
                         *[str(first[s]["output"].isel(example=i).values) for s in group]])
        out.append(f"<h3>outputs side by side ({escape(task)}, first {n}"
                   + (", first sweep cell" if run.sweep else "") + ")</h3>"
                   + _table(["example", "prompt", "target", *group], rows, "side-by-side"))
    out.append("</section>")
    return "".join(out)


def render_report(run: Run | str | Path, *, n_examples: int = 8) -> str:
    """The report of ``run`` as one self-contained HTML document."""
    run = run if isinstance(run, Run) else open_run(run)
    a = run.attrs
    meta_keys = ["status", "created", "finished", "model", "model_revision", "model_digest", "device", "dtype",
                 "n_layers", "n_heads", "seed", "headlab_version", "torch_version", "transformers_version", "host"]
    meta = [[k, str(a[k])] for k in meta_keys if k in a]
    meta.insert(1, ["cells", f"{run.cells_done}/{run.cells_total}"])
    meta[2:2] = [[f"partial cell {name}", f"kept steps {', '.join(info['steps'])} (shown with the finished cells); "
                  f"stopped in step '{info['failed_step']}': {info['error']}"]
                 for name, info in sorted(run.partial_cells.items())]
    if run.sweep:
        meta.append(["sweep", json.dumps(run.sweep)])
    parts = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
             f"<title>headlab report: {escape(run.name)}</title><style>{CSS}</style></head><body>",
             f"<h1>headlab report: {escape(run.name)}</h1>", _table(["", ""], meta, "meta")]
    results = run.results
    if results:
        parts.append("<p>steps: " + ", ".join(f'<a href="#step-{escape(s)}">{escape(s)}</a>' for s in results)
                     + "</p>")
    else:
        parts.append("<p>No finished cells yet.</p>")
    circuits = {"patching": _patching_section, "dla": _dla_section, "edges": _edges_section}
    drawn: dict[str, set[tuple[int, int]]] = {}  # prompt -> heads whose attention is drawn
    for step, ds in results.items():
        kind = circuit_kind(ds)
        if kind is not None:
            section = circuits[kind](run, step, ds)
        elif is_cube(ds) or is_cube_comparison(ds):
            section = _cube_section(run, step, ds)
        elif "score" in ds and {"layer", "head"} <= set(ds["score"].dims):
            section = _detect_section(run, step, ds)
        elif "output" in ds and ds.attrs.get("action", "generate") == "generate":
            section = _generate_section(run, step, ds, n_examples)
        elif "task" in ds.dims and any(m in ds and "task" in ds[m].dims for m in ds.attrs.get("metrics", [])):
            section = _task_section(run, step, ds, n_examples)
        elif is_masking_curve(ds):
            section = _curve_section(run, step, ds)
        else:
            section = _values_section(step, ds)
        figure = _image_figure(run, ds) + _attention_figure(run, step, ds, drawn)
        if figure:
            section = section.removesuffix("</section>") + figure + "</section>"
        parts.append(section)
    parts.append(_comparison_section(run, n_examples))
    parts.append(_kv_section(run))
    parts.append(f"<h2>spec</h2><pre>{escape(run.spec_text)}</pre>")
    parts.append(f'<p style="color:#888;font-size:11px">{escape(str(run.path))}</p>')
    if any(figures.FIGURE_CLASS in p for p in parts):
        parts.append(figures.page_script())
    parts.append("</body></html>")
    return "\n".join(parts)


def report_figures(run: Run | str | Path, *, n_examples: int = 8) -> list[ReportFigure]:
    """The figures of ``run``'s report, in page order: the chart objects the HTML embeds, for notebooks and
    export."""
    collected: list[ReportFigure] = []
    token = _COLLECTED.set(collected)
    try:
        render_report(run, n_examples=n_examples)
    finally:
        _COLLECTED.reset(token)
    return collected


def _file_name(index: int, name: str) -> str:
    slug = "".join(c if c.isalnum() or c in "-_" else "-" for c in name.lower()).strip("-")
    return f"{index:02d}-{'-'.join(p for p in slug.split('-') if p)[:80]}"


def write_report(run: Run | str | Path, output: str | Path | None = None, *, n_examples: int = 8,
                 format: Literal["html", "svg", "png"] = "html") -> Path:
    """Write the report of ``run`` and return the path written.

    ``html``: one self-contained page, by default ``<run directory>.html`` beside the run. ``svg`` / ``png``: the
    report's figures (:func:`report_figures`), one file each (``01-retrieval-score.svg``, ...), into the folder
    ``output`` (by default ``<run directory>.figures``), for papers.
    """
    run = run if isinstance(run, Run) else open_run(run)
    if format == "html":
        path = Path(output) if output is not None else run.path.with_name(run.path.name + ".html")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(render_report(run, n_examples=n_examples), encoding="utf-8")
        return path
    folder = Path(output) if output is not None else run.path.with_name(run.path.name + ".figures")
    folder.mkdir(parents=True, exist_ok=True)
    for i, fig in enumerate(report_figures(run, n_examples=n_examples), 1):
        figures.save(fig.chart, folder / f"{_file_name(i, fig.name)}.{format}", format=format)
    return folder
