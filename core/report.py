"""Static HTML reports of runs, for people who do not open notebooks.

``headlab report RUN`` (or :func:`write_report`) writes one self-contained HTML file: provenance, the
spec, a (layer x head) heatmap of every detect step's scores (averaged over sweep cells, and one per
cell when there is a sweep), top-head tables, metric tables per sweep cell, line plots of metrics and
top-head scores against numeric sweep keys, sample generations, and per-task metrics with sample records
(``evaluate`` steps). Everything is inline (CSS and
SVG); the file loads nothing from the network and needs no JavaScript.

The colour scale (:func:`color`) is shared with the notebook widgets so a head looks the same in a
report and in a :class:`headlab.widgets.HeadMap`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from html import escape
from pathlib import Path
from typing import Any

import numpy as np
import xarray as xr

from .results import Run, open_run

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


def text_color(background: str) -> str:
    """Black or white, whichever reads better on ``background`` (``#rrggbb``)."""
    r, g, b = (int(background[i: i + 2], 16) for i in (1, 3, 5))
    return "#000000" if 0.299 * r + 0.587 * g + 0.114 * b > 140 else "#ffffff"


def _finite_range(values: np.ndarray) -> tuple[float, float]:
    finite = values[np.isfinite(values)]
    if finite.size == 0:
        return 0.0, 1.0
    lo, hi = float(finite.min()), float(finite.max())
    return (lo, hi) if hi > lo else (lo, lo + 1.0)


def heatmap_svg(values: np.ndarray | xr.DataArray, *, title: str = "", cell: int = 18,
                vmin: float | None = None, vmax: float | None = None,
                highlight: Sequence[tuple[int, int]] = ()) -> str:
    """A (layer x head) heatmap as inline SVG; each cell has a ``<title>`` with its value.

    ``values`` is ``(layer, head)`` (an xarray DataArray is transposed to that order). Cells in
    ``highlight`` are outlined.
    """
    if isinstance(values, xr.DataArray):
        values = values.transpose("layer", "head").values
    arr = np.asarray(values, dtype=float)
    n_layers, n_heads = arr.shape
    lo, hi = _finite_range(arr)
    vmin = lo if vmin is None else vmin
    vmax = hi if vmax is None else vmax
    left, top = 34, 22 if title else 8
    width = max(left + n_heads * cell + 70, left + 7 * len(title) + 8)
    height = top + n_layers * cell + 22
    marked = {(int(a), int(b)) for a, b in highlight}
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" class="heatmap" width="{width}" height="{height}" '
             f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="10">']
    if title:
        parts.append(f'<text x="{left}" y="13" font-size="12" font-weight="bold">{escape(title)}</text>')
    for layer in range(n_layers):
        y = top + layer * cell
        parts.append(f'<text x="{left - 4}" y="{y + cell * 0.7:.1f}" text-anchor="end">L{layer}</text>')
        for head in range(n_heads):
            v = arr[layer, head]
            x = left + head * cell
            label = "nan" if not math.isfinite(v) else f"{v:.4g}"
            stroke = ' stroke="#e4002b" stroke-width="2"' if (layer, head) in marked else ""
            parts.append(f'<rect x="{x}" y="{y}" width="{cell - 1}" height="{cell - 1}" '
                         f'fill="{color(v, vmin, vmax)}" data-layer="{layer}" data-head="{head}" '
                         f'data-value="{label}"{stroke}><title>layer {layer}, head {head}: {label}</title></rect>')
    base = top + n_layers * cell + 12
    for head in range(n_heads):
        if n_heads <= 16 or head % max(1, n_heads // 16) == 0:
            parts.append(f'<text x="{left + head * cell + cell / 2:.1f}" y="{base}" '
                         f'text-anchor="middle">{head}</text>')
    # colour bar
    bx = left + n_heads * cell + 14
    steps = 20
    bar_h = max(n_layers * cell, 40)
    for i in range(steps):
        v = vmax - (vmax - vmin) * i / (steps - 1)
        parts.append(f'<rect x="{bx}" y="{top + i * bar_h / steps:.1f}" width="10" '
                     f'height="{bar_h / steps + 0.5:.1f}" fill="{color(v, vmin, vmax)}"/>')
    parts.append(f'<text x="{bx + 13}" y="{top + 8}">{vmax:.3g}</text>')
    parts.append(f'<text x="{bx + 13}" y="{top + bar_h}">{vmin:.3g}</text>')
    parts.append("</svg>")
    return "".join(parts)


def line_plot_svg(xs: Sequence[Any], series: Mapping[str, Sequence[float]], *, xlabel: str = "",
                  ylabel: str = "", title: str = "", width: int = 420, height: int = 240) -> str:
    """A line plot as inline SVG: one polyline (with point markers and a legend entry) per series.

    Numeric ``xs`` are placed proportionally; other values evenly, labelled by their text.
    """
    numeric = all(isinstance(x, (int, float, np.number)) and not isinstance(x, bool) for x in xs)
    n = len(xs)
    pos = [float(x) for x in xs] if numeric else list(range(n))
    x0, x1 = (min(pos), max(pos)) if pos else (0.0, 1.0)
    if x1 == x0:
        x0, x1 = x0 - 1, x1 + 1
    all_y = np.array([v for ys in series.values() for v in ys if v is not None and math.isfinite(v)], dtype=float)
    y0, y1 = _finite_range(all_y) if all_y.size else (0.0, 1.0)
    pad = (y1 - y0) * 0.08
    y0, y1 = y0 - pad, y1 + pad
    ml, mr, mt, mb = 52, 12, 24 if title else 10, 40
    pw, ph = width - ml - mr, height - mt - mb

    def sx(v: float) -> float:
        return ml + (v - x0) / (x1 - x0) * pw

    def sy(v: float) -> float:
        return mt + (1 - (v - y0) / (y1 - y0)) * ph

    colors = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f"]
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" class="lineplot" width="{width}" height="{height + 16 * len(series)}" '
             f'font-family="sans-serif" font-size="10">']
    if title:
        parts.append(f'<text x="{ml}" y="14" font-size="12" font-weight="bold">{escape(title)}</text>')
    parts.append(f'<rect x="{ml}" y="{mt}" width="{pw}" height="{ph}" fill="none" stroke="#999"/>')
    for i in range(5):
        v = y0 + (y1 - y0) * i / 4
        parts.append(f'<text x="{ml - 4}" y="{sy(v) + 3:.1f}" text-anchor="end">{v:.3g}</text>')
        parts.append(f'<line x1="{ml}" x2="{ml + pw}" y1="{sy(v):.1f}" y2="{sy(v):.1f}" stroke="#eee"/>')
    for x, p in zip(xs, pos, strict=True):
        parts.append(f'<text x="{sx(p):.1f}" y="{mt + ph + 13}" text-anchor="middle">{escape(str(x))}</text>')
    parts.append(f'<text x="{ml + pw / 2}" y="{mt + ph + 28}" text-anchor="middle">{escape(xlabel)}</text>')
    parts.append(f'<text x="12" y="{mt + ph / 2}" text-anchor="middle" transform="rotate(-90 12 {mt + ph / 2})">'
                 f'{escape(ylabel)}</text>')
    for k, (name, ys) in enumerate(series.items()):
        c = colors[k % len(colors)]
        pts = [(sx(p), sy(float(y))) for p, y in zip(pos, ys, strict=True) if y is not None and math.isfinite(y)]
        if len(pts) > 1:
            parts.append(f'<polyline fill="none" stroke="{c}" stroke-width="2" points="'
                         + " ".join(f"{a:.1f},{b:.1f}" for a, b in pts) + '"/>')
        for (a, b), y in zip(pts, [y for y in ys if y is not None and math.isfinite(y)], strict=True):
            parts.append(f'<circle cx="{a:.1f}" cy="{b:.1f}" r="3" fill="{c}" data-series="{escape(name)}" '
                         f'data-y="{float(y):.6g}"><title>{escape(name)}: {float(y):.4g}</title></circle>')
        ly = height + 4 + 16 * k
        parts.append(f'<line x1="{ml}" x2="{ml + 18}" y1="{ly}" y2="{ly}" stroke="{c}" stroke-width="2"/>')
        parts.append(f'<text x="{ml + 24}" y="{ly + 3}">{escape(name)}</text>')
    parts.append("</svg>")
    return "".join(parts)


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
    import itertools

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
    from .heads import ranked

    score = ds["score"]
    dims = _sweep_dims(run, score)
    mean = score.mean(dims) if dims else score
    top = ranked(mean)[:10]
    out = [f'<section class="step detect" id="step-{escape(step)}"><h2>{escape(step)}: detect '
           f'<code>{escape(str(ds.attrs.get("method", "")))}</code></h2>']
    title = "score (mean over sweep cells)" if dims else "score"
    out.append('<div class="row">' + heatmap_svg(mean, title=title, highlight=[h for h, _ in top[:5]]))
    out.append(_table(["rank", "layer", "head", "score"],
                      [[i, h[0], h[1], s] for i, (h, s) in enumerate(top, 1)], "top") + "</div>")
    cells = _cells(run, score)
    if dims and len(cells) > 1:
        lo, hi = _finite_range(score.values.astype(float))
        maps = [heatmap_svg(score.sel(c), title=_label(c), vmin=lo, vmax=hi, cell=12) for c in cells[:24]]
        out.append('<h3>per sweep cell</h3><div class="row">' + "".join(maps) + "</div>")
        out.append(_sweep_plots(run, dims, cells, {f"L{h[0]}H{h[1]}": score.sel(layer=h[0], head=h[1])
                                                   for h, _ in top[:5]}, "score"))
    out.append("</section>")
    return "".join(out)


def _sweep_plots(run: Run, dims: list[str], cells: list[dict[str, Any]],
                 arrays: Mapping[str, xr.DataArray], ylabel: str) -> str:
    """One line plot per sweep key: x = that key's values, one series per array (averaged over the
    other sweep keys)."""
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
        plots.append(line_plot_svg([_plain(x) for x in keys], series, xlabel=key, ylabel=ylabel, title=title))
    return '<div class="row">' + "".join(plots) + "</div>"


def _generate_section(run: Run, step: str, ds: xr.Dataset, n_examples: int) -> str:
    metrics = [m for m in ds.attrs.get("metrics", []) if m in ds]
    out = [f'<section class="step generate" id="step-{escape(step)}"><h2>{escape(step)}: generate '
           f'<code>{escape(str(ds.attrs.get("decode", "")))}</code>'
           + (f' steered by <code>{escape(", ".join(ds.attrs.get("steer", [])))}</code>' if ds.attrs.get("steer") else "")
           + "</h2>"]
    ref = ds["output"]
    cells = _cells(run, ref)
    dims = _sweep_dims(run, ref)
    if metrics:
        rows = []
        for c in cells:
            sub = ds.sel(c) if c else ds
            rows.append([_label(c)] + [float(np.nanmean(sub[m].values.astype(float))) for m in metrics])
        out.append("<h3>metrics (mean over examples)</h3>" + _table(["cell", *metrics], rows, "metrics"))
        if dims and len(cells) > 1:
            means = {m: ds[m].mean("example") if "example" in ds[m].dims else ds[m] for m in metrics}
            out.append(_sweep_plots(run, dims, cells, means, "metric"))
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
    out = [f'<section class="step tasks" id="step-{escape(step)}"><h2>{escape(step)}: '
           f'{escape(str(ds.attrs.get("action", "")))} <code>{escape(str(ds.attrs.get("decode", "")))}</code>'
           + (f' steered by <code>{escape(", ".join(ds.attrs.get("steer", [])))}</code>' if ds.attrs.get("steer") else "")
           + "</h2>"]
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


def render_report(run: Run | str | Path, *, n_examples: int = 8) -> str:
    """The report of ``run`` as one self-contained HTML document."""
    run = run if isinstance(run, Run) else open_run(run)
    a = run.attrs
    meta_keys = ["status", "created", "finished", "model", "model_revision", "model_digest", "device", "dtype",
                 "n_layers", "n_heads", "seed", "headlab_version", "torch_version", "transformers_version", "host"]
    meta = [[k, str(a[k])] for k in meta_keys if k in a]
    meta.insert(1, ["cells", f"{run.cells_done}/{run.cells_total}"])
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
    for step, ds in results.items():
        if "score" in ds and {"layer", "head"} <= set(ds["score"].dims):
            parts.append(_detect_section(run, step, ds))
        elif "output" in ds and ds.attrs.get("action", "generate") == "generate":
            parts.append(_generate_section(run, step, ds, n_examples))
        elif "task" in ds.dims and any(m in ds and "task" in ds[m].dims for m in ds.attrs.get("metrics", [])):
            parts.append(_task_section(run, step, ds, n_examples))
        else:
            parts.append(_values_section(step, ds))
    parts.append(f"<h2>spec</h2><pre>{escape(run.spec_text)}</pre>")
    parts.append(f'<p style="color:#888;font-size:11px">{escape(str(run.path))}</p></body></html>')
    return "\n".join(parts)


def write_report(run: Run | str | Path, output: str | Path | None = None, *, n_examples: int = 8) -> Path:
    """Write the HTML report of ``run``; the default path is ``<run directory>.html`` beside the run.

    Returns the path written.
    """
    run = run if isinstance(run, Run) else open_run(run)
    path = Path(output) if output is not None else run.path.with_name(run.path.name + ".html")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_report(run, n_examples=n_examples), encoding="utf-8")
    return path
