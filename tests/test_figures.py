"""headlab.figures: the Vega-Lite charts carry the numbers they are given, pick the colour scale from the
data, draw bytes in MiB, and export to SVG, PNG and an offline HTML page."""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest
import xarray as xr

from headlab import figures


def layer_data(chart) -> list[list[dict]]:
    """The inline data rows of each layer of a chart's Vega-Lite spec."""
    spec = figures.figure_spec(chart)
    layers = spec.get("layer", [spec])
    return [layer.get("data", spec.get("data", {})).get("values", []) for layer in layers]


def colour_scale(chart) -> dict:
    spec = figures.figure_spec(chart)
    for layer in spec["layer"]:
        colour = layer.get("encoding", {}).get("color", {})
        if "scale" in colour:
            return colour["scale"]
    raise AssertionError("no colour scale")


def test_heatmap_cells_carry_every_value_at_its_coordinates():
    values = np.array([[0.25, np.nan, 1.5], [0.0, 2.0, 0.75]])
    da = xr.DataArray(values, dims=("layer", "head"), coords={"layer": [0, 1], "head": [0, 1, 2]})
    rows = layer_data(figures.heatmap(da.transpose("head", "layer"), title="t"))[0]  # transposed back
    assert len(rows) == 6
    for r in rows:
        expected = values[r["layer"], r["head"]]
        assert (r["score"] is None) if math.isnan(expected) else r["score"] == pytest.approx(expected)


def test_heatmap_scale_is_sequential_from_zero_for_non_negative_and_diverging_at_zero_for_signed():
    pos = np.array([[0.2, 0.9], [0.4, np.nan]])
    scale = colour_scale(figures.heatmap(pos))
    assert scale["scheme"] == figures.SEQUENTIAL_SCHEME and scale["domain"] == [0.0, 0.9]
    signed = np.array([[0.2, -0.7], [0.4, 0.1]])
    scale = colour_scale(figures.heatmap(signed))
    assert scale["scheme"] == figures.DIVERGING_SCHEME and scale["domainMid"] == 0
    assert scale["domain"] == [-0.7, 0.7]  # symmetric: equal |score| gets equal strength of colour
    assert figures.color_scale_kind(signed) == "diverging" and figures.color_scale_kind(pos) == "sequential"
    forced = colour_scale(figures.heatmap(pos, scale="diverging"))
    assert forced["scheme"] == figures.DIVERGING_SCHEME and forced["domain"] == [-0.9, 0.9]
    fixed = colour_scale(figures.heatmap(signed, scale="sequential", vmin=-1.0, vmax=2.0))
    assert fixed["domain"] == [-1.0, 2.0]


def test_heatmap_token_labels_keep_repeated_tokens_apart_and_outline_highlights():
    da = xr.DataArray(np.arange(6.0).reshape(2, 3), dims=("layer", "token"))
    chart = figures.heatmap(da, x="token", x_labels=["the", " cat", "the"], highlight=[(1, 2)])
    rows = layer_data(chart)[0]
    assert sorted((r["_x"], r["_xlabel"]) for r in rows if r["layer"] == 0) == [(0, "the"), (1, " cat"), (2, "the")]
    assert [(r["layer"], r["token"]) for r in rows if r["_marked"]] == [(1, 2)]
    spec = figures.figure_spec(chart)
    assert spec["layer"][-1]["mark"]["stroke"]  # the outline layer


def test_scatter_draws_bytes_in_mib_labels_each_point_and_leaves_out_non_finite():
    points = [{"bytes": 37_400_000, "recall": 0.6, "label": "full"},
              {"bytes": 3 * 2 ** 20, "recall": 0.68, "label": "stream"},
              {"bytes": 2 ** 20, "recall": math.nan, "label": "broken"}]
    chart = figures.scatter(points, x="bytes", y="recall", x_title="KV bytes held", y_title="recall",
                            x_bytes=True, x_zero=True, y_zero=True)
    rows = layer_data(chart)[0]
    assert [r["label"] for r in rows] == ["full", "stream"]
    assert [r["_x"] for r in rows] == pytest.approx([37_400_000 / 1048576, 3.0])
    spec = figures.figure_spec(chart)
    enc = spec["layer"][0]["encoding"]
    assert enc["x"]["title"] == "KV bytes held (MiB)" and enc["x"]["scale"]["zero"] is True
    assert spec["layer"][-1]["mark"]["type"] == "text" and spec["layer"][-1]["encoding"]["text"]["field"] == "label"


def test_scatter_moves_a_label_that_would_cover_another():
    points = [{"x": 0.5, "y": 0.5, "label": "first"}, {"x": 0.5, "y": 0.5, "label": "second"},
              {"x": 0.0, "y": 0.0, "label": "alone"}]
    chart = figures.scatter(points, x="x", y="y", x_title="x", y_title="y", x_domain=(0, 1), y_domain=(0, 1))
    offsets = {r["label"]: r["_dy"] for r in layer_data(chart)[0]}
    assert offsets["first"] == offsets["alone"] == 0 and offsets["second"] != 0
    texts = [layer for layer in figures.figure_spec(chart)["layer"] if layer["mark"]["type"] == "text"]
    assert sorted(layer["mark"]["dy"] for layer in texts) == sorted({-6 + v for v in offsets.values()})


def test_bar_chart_keeps_order_intervals_and_notes():
    rows = [{"step": "greedy", "mean": 0.659, "low": 0.56, "high": 0.74, "n": "n=91", "control": False},
            {"step": "decore_random", "mean": 0.444, "low": 0.35, "high": 0.55, "n": "n=90", "control": True}]
    chart = figures.bar_chart(rows, category="step", value="mean", value_title="context_memory", low="low",
                              high="high", note="n", marked="control", value_domain=(0, 1))
    data = layer_data(chart)[0]
    assert [(d["step"], d["_v"], d["_lo"], d["_hi"], d["n"]) for d in data] == \
        [(r["step"], r["mean"], r["low"], r["high"], r["n"]) for r in rows]
    spec = figures.figure_spec(chart)
    assert spec["layer"][0]["encoding"]["y"]["sort"] == ["greedy", "decore_random"]
    assert [layer["mark"]["type"] for layer in spec["layer"]] == ["bar", "rule", "tick", "tick", "text"]


def test_line_chart_orders_categories_and_keeps_intervals():
    chart = figures.line_chart(["b", "a"], {"s": [0.5, 0.25]}, x_title="k", y_title="v",
                               intervals={"s": [(0.4, 0.6), (0.2, 0.3)]}, y_zero=True)
    rows = layer_data(chart)[0]
    assert [(r["x"], r["y"], r["low"], r["high"]) for r in rows] == [("b", 0.5, 0.4, 0.6), ("a", 0.25, 0.2, 0.3)]
    spec = figures.figure_spec(chart)
    assert spec["layer"][1]["encoding"]["x"]["sort"] == ["b", "a"]
    assert spec["layer"][1]["encoding"]["y"]["scale"]["zero"] is True


def test_combine_puts_figures_side_by_side_with_their_own_scales(tmp_path):
    signed = figures.heatmap(np.array([[0.5, -1.0]]), title="signed")
    bars = figures.bar_chart([{"c": "a", "v": 2.0}], category="c", value="v", value_title="v")
    spec = figures.figure_spec(figures.combine([signed, bars]))
    assert [part.get("title", {}).get("text") for part in spec["hconcat"]] == ["signed", None]
    assert spec["resolve"]["scale"]["color"] == "independent" and "config" in spec
    assert all("config" not in part for part in spec["hconcat"])
    assert figures.save(figures.combine([signed, bars], direction="vertical"), tmp_path / "c.svg").read_text()


def test_save_writes_svg_png_and_an_offline_html_page(tmp_path):
    chart = figures.scatter([{"x": 2 ** 21, "y": 0.5, "label": "gen"}], x="x", y="y", x_title="KV bytes held",
                            y_title="recall", x_bytes=True)
    svg = figures.save(chart, tmp_path / "f.svg").read_text()
    assert svg.startswith("<svg") and "KV bytes held (MiB)" in svg and ">gen<" in svg
    assert figures.save(chart, tmp_path / "f.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    page = figures.save(chart, tmp_path / "f.html").read_text()
    assert page.count("vegaEmbed") >= 2 and page.count('<script type="module">') == 1
    assert not re.search(r"<script[^>]+src=", page) and not re.search(r"<link[^>]+href=\"?https?:", page)
    fragment = figures.to_html_fragment(chart, name="tradeoff")
    spec = json.loads(re.search(r'<script type="application/json">(.*)</script>', fragment).group(1))
    assert spec == figures.figure_spec(chart) and layer_data(chart)[0][0]["_x"] == 2.0
    with pytest.raises(ValueError, match="use svg, png or html"):
        figures.save(chart, tmp_path / "f.pdf")
