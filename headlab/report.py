"""Static HTML reports of runs, for people who do not open notebooks.

``headlab report RUN`` (or :func:`write_report`) writes one self-contained HTML file: provenance, the
spec, a (layer x head) heatmap of every detect step's scores (averaged over sweep cells, and one per
cell when there is a sweep), top-head tables, metric tables per sweep cell, line plots of metrics and
top-head scores against numeric sweep keys, sample generations, per-task metrics with sample records
(``evaluate`` steps), the circuit analyses (:mod:`headlab.circuit_view`: patching maps with the top heads'
scores per token, direct logit attribution as signed bars, edge attribution as a graph of the circuit), the
KV-cache trade-off of the steps with a ``kv`` policy (:mod:`headlab.kv_view`: each metric against the kept
fraction and the KV bytes, one point per step and sweep cell, with a table of the bytes), and,
for steps on examples with images that stored a preview
(:func:`headlab.image_attention.attention_preview`), the first image with the top heads' attention over its patches. Everything is inline (CSS and
SVG); the file loads nothing from the network and needs no JavaScript.

The colour scale (:func:`color`) and the SVG figures are defined in :mod:`headlab.svg`, shared with the
notebook widgets so a head looks the same in a report and in a :class:`headlab.widgets.HeadMap`; they are
re-exported here.
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
from .figures import FIGURE_CLASS, page_script, to_html_fragment
from .image_attention import PREVIEW_ATTENTION, image_attention_svg, preview_of
from .kv_view import kv_metrics, kv_points, kv_table_rows, kv_tradeoff_svg
from .results import Run, open_run
from .svg import (
    NAN_COLOR,
    PALETTE,
    SIGN_COLORS,
    bar_chart_svg,
    color,
    colour_bar_svg,
    finite_range,
    grid_svg,
    heatmap_svg,
    line_plot_svg,
    scatter_svg,
    sign_color,
    text_color,
)

__all__ = ["CSS", "NAN_COLOR", "PALETTE", "SIGN_COLORS", "bar_chart_svg", "color", "colour_bar_svg", "grid_svg",
           "heatmap_svg", "line_plot_svg", "render_report", "scatter_svg", "sign_color", "text_color", "write_report"]


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
        lo, hi = finite_range(score.values.astype(float))
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
        for r in run.summary().get(step, {}).get("cells", []):  # the numbers `headlab show` prints
            for m, value in r["metrics"].items():
                e = r["estimates"].get(m)  # None: a step-level value, not a mean over examples
                rows.append([_label(r["cell"]), m, value if math.isfinite(value) else "undefined",
                             e.interval_text(4) if e else "-", e.n if e else "-", e.dropped_text() if e else "-"])
        out.append("<h3>metrics (mean over the examples where defined, 95% interval)</h3>"
                   + _table(["cell", "metric", "mean", "95% interval", "n", "dropped"], rows, "metrics"))
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


def _resid_part(run: Run, ds: xr.Dataset) -> str:
    """A residual-stream patching result: the (layer x token) map with the tokens of one example."""
    score = resid_map(_mean_over_sweep(run, ds["score"]))
    title = ["residual stream patching: the stream entering each layer, patched at one token",
             _TOKENS_NOTE + (", mean over sweep cells" if _sweep_dims(run, ds["score"]) else "")]
    chart = token_chart(score.values, [f"L{int(v)}" for v in score["layer"].values], _tokens(run, ds),
                        title=title, row_title="layer")
    return to_html_fragment(chart, name="resid-map")


def _atp_part(run: Run, step: str, ds: xr.Dataset) -> str:
    """AtP against the exact patching of the same task, when both ran."""
    exact = dict(atp_pairs(run.results)).get(step)
    if exact is None:
        return ""
    top_k = int(ds.attrs.get("top_k", 10)) if isinstance(ds.attrs.get("top_k", 10), (int, float)) else 10
    c = atp_vs_exact(ds, run.results[exact], top_k=top_k, atp_step=step, exact_step=exact)
    return to_html_fragment(atp_scatter(c), name="atp-vs-exact")


def _patching_section(run: Run, step: str, ds: xr.Dataset) -> str:
    """An activation or attribution patching result: the (layer x head) map (a per-token score reduced to
    its peak), the top heads, their scores per token, the unpatched metrics and, for AtP, a scatter against
    the exact patching of the same task; residual-stream patching as a (layer x token) map."""
    out = [_step_header(step, ds, "detect patching")]
    if not {"head", "kv_head"} & set(ds["score"].dims):
        out.append(_resid_part(run, ds))
    else:
        out.append(_heads_part(run, ds))
    out.append(_atp_part(run, step, ds))
    metrics = [[f"{name} (mean over examples)", float(_mean_over_sweep(run, ds[name]).mean())]
               for name in ("clean", "corrupt") if name in ds]
    out.append('<div class="row">' + (_table(["metric", "value"], metrics, "metrics") if metrics else "")
               + _attrs_table(ds, ["metric", "direction", "unit", "normalise", "convention", "estimator",
                                   "reference_step", "spearman", "top_k", "top_k_recall"]) + "</div>")
    out.append("</section>")
    return "".join(out)


def _heads_part(run: Run, ds: xr.Dataset) -> str:
    """The (layer x head) map of a patching score, its top heads and, per token, the strongest heads' scores."""
    from .heads import ranked

    score = _mean_over_sweep(run, ds["score"])
    by_token = "token" in score.dims
    kv = "kv_head" in score.dims
    hm = head_map(score)
    what = "key/value head" if kv else "head"
    title = "score per " + what + (" (the per-token score of largest magnitude)" if by_token else "")
    if _sweep_dims(run, ds["score"]):
        title += ", mean over sweep cells"
    top = ranked(hm.rename(kv_head="head") if kv else hm)[:10]
    out = ['<div class="row">' + to_html_fragment(head_map_chart(hm, title=title, highlight=[h for h, _ in top[:5]]),
                                                  name="patching-map")]
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
        out.append(to_html_fragment(chart, name="patching-tokens"))
    return "".join(out)


def _dla_section(run: Run, step: str, ds: xr.Dataset) -> str:
    """A direct logit attribution result: the (layer x head) map, the top heads, and the heads' terms apart from
    the totals they add up to (the heads' sum, the rest, the logit difference)."""
    from .heads import ranked

    score = _mean_over_sweep(run, ds["score"])
    top = ranked(score)[:10]
    mean = ds.assign(score=score)
    for name in ("rest", "logit_diff"):
        if name in ds:
            mean[name] = _mean_over_sweep(run, ds[name])
    out = [_step_header(step, ds, "detect dla")]
    out.append('<div class="row">' + to_html_fragment(head_map_chart(
        score, title="direct effect per head (mean over examples)", highlight=[h for h, _ in top[:5]]),
        name="dla-map"))
    out.append(_table(["rank", "layer", "head", "score"], [[i, h[0], h[1], v] for i, (h, v) in enumerate(top, 1)],
                      "top") + "</div>")
    heads, totals = dla_chart(mean)
    out.append('<div class="row">' + to_html_fragment(heads, name="dla-heads")
               + to_html_fragment(totals, name="dla-totals") + "</div>")
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
    out.append(to_html_fragment(chart, name="circuit"))
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


def _attention_figure(run: Run, step: str, ds: xr.Dataset, n_heads: int = 4) -> str:
    """The attention patterns of the step's ``n_heads`` top heads on its first example's prompt, when the run's
    model is on this machine and the prompt is short (:mod:`headlab.attention_patterns`)."""
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
    try:
        patterns = head_patterns(lm, prompt, heads)
    except ValueError as e:
        return f'<p class="note">attention patterns: not drawn, {escape(str(e))}.</p>'
    charts = pattern_charts(patterns)
    return (f"<h3>attention of the top {len(heads)} heads on example 0's prompt (query x key)</h3>"
            '<div class="row">' + "".join(to_html_fragment(c, name="attention-pattern") for c in charts) + "</div>")


def _image_figure(run: Run, ds: xr.Dataset, n_heads: int = 3) -> str:
    """The stored image preview of a step (first example, first sweep cell) with the attention of its top
    heads over the patches: by the step's score for a detect step, else by the attention mass on the image."""
    from .heads import ranked

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
    """Metric vs KV cache across the steps with a ``kv`` policy and the sweep cells (empty without one)."""
    points = kv_points(run)
    if not points:
        return ""
    metrics = kv_metrics(points)
    out = ['<section class="kv" id="kv"><h2>KV cache: metrics vs kept KV</h2>']
    if metrics:
        out.append('<div class="row">' + "".join(kv_tradeoff_svg(points, m, x=x) for m in metrics
                                                 for x in ("kept_fraction", "kv_bytes")) + "</div>")
    header, rows = kv_table_rows(points, metrics)
    out.append(_table(header, rows, "kv") + "</section>")
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
    for step, ds in results.items():
        kind = circuit_kind(ds)
        if kind is not None:
            section = circuits[kind](run, step, ds)
        elif "score" in ds and {"layer", "head"} <= set(ds["score"].dims):
            section = _detect_section(run, step, ds)
        elif "output" in ds and ds.attrs.get("action", "generate") == "generate":
            section = _generate_section(run, step, ds, n_examples)
        elif "task" in ds.dims and any(m in ds and "task" in ds[m].dims for m in ds.attrs.get("metrics", [])):
            section = _task_section(run, step, ds, n_examples)
        else:
            section = _values_section(step, ds)
        figure = _image_figure(run, ds) + _attention_figure(run, step, ds)
        if figure:
            section = section.removesuffix("</section>") + figure + "</section>"
        parts.append(section)
    parts.append(_kv_section(run))
    parts.append(f"<h2>spec</h2><pre>{escape(run.spec_text)}</pre>")
    if any(f'class="{FIGURE_CLASS}"' in part for part in parts):
        parts.append(page_script())  # the Vega-Lite figures' JavaScript, inlined once
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
