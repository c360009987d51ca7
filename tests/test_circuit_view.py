"""The circuit figures (headlab.circuit_view and the bar/grid SVG), in ``headlab report`` and in the widgets
PatchingMap, DLABars and CircuitGraph: every check reads values, colours and labels back from the rendered
SVG/HTML of a dataset built here, whose right rendering is known."""

from __future__ import annotations

import math
import re
from html.parser import HTMLParser
from pathlib import Path
from typing import Literal

import numpy as np
import pytest
import xarray as xr

import headlab
from headlab import figures
from headlab.circuit_view import (
    Edge,
    circuit_edges,
    circuit_graph_svg,
    circuit_kind,
    dla_bars_svg,
    dla_terms,
    head_map,
    parse_node,
    position_grid_svg,
)
from headlab.report import render_report
from headlab.svg import SIGN_COLORS, bar_chart_svg, color, grid_svg

from fixtures.figures import embedded, rows
from fixtures.specs import spec_text

ROOT = Path(__file__).resolve().parent.parent
HOSTILE = '<img src=x onerror="alert(1)">'


class Collect(HTMLParser):
    """Every start tag with its attributes, and the text."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict[str, str | None]]] = []
        self.text: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))

    def handle_data(self, data):
        self.text.append(data)


def parse(html: str) -> Collect:
    c = Collect()
    c.feed(html)
    return c


def tags(html: str, name: str, key: str) -> list[dict[str, str | None]]:
    return [a for t, a in parse(html).tags if t == name and key in a]


# --- datasets of each kind, built here -------------------------------------------------------------------

def patching_by_token() -> xr.Dataset:
    """2 layers x 3 heads x 4 tokens; head (1, 2) peaks at token 3 with -0.8, (0, 1) at token 2 with 0.6."""
    score = np.zeros((2, 3, 4))
    score[0, 1] = [0.0, 0.1, 0.6, 0.2]
    score[1, 2] = [0.0, 0.3, 0.1, -0.8]
    score[1, 0] = [np.nan, np.nan, 0.05, 0.1]
    return xr.Dataset({"score": (("layer", "head", "token"), score),
                       "patched": (("layer", "head", "token", "example"), np.zeros((2, 3, 4, 2))),
                       "clean": (("example",), [2.0, 4.0]), "corrupt": (("example",), [-1.0, -3.0])},
                      coords={"layer": [0, 1], "head": [0, 1, 2], "token": [0, 1, 2, 3]},
                      attrs={"method": "activation_patching", "unit": "z_position", "metric": "logit_diff"})


def dla_dataset() -> xr.Dataset:
    score = np.array([[0.5, -0.25], [2.0, 0.125]])
    return xr.Dataset({"score": (("layer", "head"), score),
                       "dla": (("example", "layer", "head"), np.stack([score, score])),
                       "rest": (("example",), [1.0, 2.0]), "logit_diff": (("example",), [3.375, 4.375])},
                      coords={"layer": [0, 1], "head": [0, 1]}, attrs={"method": "direct_logit_attribution"})


def edge_dataset(hostile: bool = False) -> xr.Dataset:
    """A dense (source, destination) score over labelled nodes; NaN where there is no edge."""
    sources = ["emb", "a0.h1", "a1.h0", "m1"] + ([HOSTILE] if hostile else [])
    destinations = ["a1.h0.q", "a1.h0.v", "m1", "logits"]
    score = np.full((len(sources), len(destinations)), np.nan)
    score[0, 0], score[0, 2] = 0.4, -0.1   # emb -> a1.h0.q, emb -> m1
    score[1, 1], score[1, 3] = -0.8, 0.2   # a0.h1 -> a1.h0.v, a0.h1 -> logits
    score[2, 3], score[3, 3] = 1.6, 0.05   # a1.h0 -> logits, m1 -> logits
    if hostile:
        score[4, 3] = 0.3
    return xr.Dataset({"score": (("source", "destination"), score), "faithfulness": ((), 0.875)},
                      coords={"source": sources, "destination": destinations},
                      attrs={"method": "edge_attribution", "metric": "logit_diff"})


# --- SVG primitives ---------------------------------------------------------------------------------------

def test_bar_chart_bars_carry_values_signs_and_proportional_lengths():
    svg = bar_chart_svg(["up", "down", "<b>x</b>", "none"], [0.5, -0.25, 1.0, float("nan")], title="t")
    bars = {a["data-label"]: a for a in tags(svg, "rect", "data-label")}
    assert set(bars) == {"up", "down", "<b>x</b>"}  # the label is escaped, parsed back to its text; NaN: no bar
    assert "<b>" not in svg
    assert [bars[k]["data-value"] for k in ("up", "down", "<b>x</b>")] == ["0.5", "-0.25", "1"]
    assert bars["up"]["fill"] == SIGN_COLORS["positive"] and bars["down"]["fill"] == SIGN_COLORS["negative"]
    width = {k: float(a["width"]) for k, a in bars.items()}
    assert width["up"] == pytest.approx(2 * width["down"], abs=0.11)
    assert width["<b>x</b>"] == pytest.approx(2 * width["up"], abs=0.11)
    zero = float(bars["up"]["x"])  # positive bars start at zero, negative ones end there
    assert float(bars["down"]["x"]) + width["down"] == pytest.approx(zero, abs=0.11)


def test_grid_cells_carry_labels_values_and_colours():
    values = np.array([[0.0, 1.0, np.nan], [0.5, 0.25, 2.0]])
    svg = grid_svg(values, ["L0H1", "<r>"], ["a", "b", "c"], title="g")
    cells = {(a["data-row"], a["data-col"]): a for a in tags(svg, "rect", "data-row")}
    assert len(cells) == 6 and "<r>" not in svg.replace("&lt;r&gt;", "")
    assert cells[("L0H1", "b")]["data-value"] == "1" and cells[("L0H1", "b")]["fill"] == color(1.0, 0.0, 2.0)
    assert cells[("<r>", "a")]["fill"] == color(0.5, 0.0, 2.0) and cells[("L0H1", "c")]["data-value"] == "nan"


# --- circuit_view ------------------------------------------------------------------------------------------

def test_circuit_kind_by_variables_and_attrs():
    assert circuit_kind(patching_by_token()) == "patching"
    assert circuit_kind(dla_dataset()) == "dla"
    assert circuit_kind(edge_dataset()) == "edges"
    unnamed = patching_by_token()
    unnamed.attrs = {}
    assert circuit_kind(unnamed) == "patching"  # clean, corrupt and patched say so without the attrs
    plain = xr.Dataset({"score": (("layer", "head"), np.zeros((2, 2)))})
    assert circuit_kind(plain) is None and circuit_kind(xr.Dataset({"x": ((), 1.0)})) is None


def test_head_map_reduces_tokens_by_peak_sum_or_mean():
    score = patching_by_token()["score"]
    peak = head_map(score)
    assert peak.dims == ("layer", "head")
    assert float(peak.sel(layer=0, head=1)) == 0.6 and float(peak.sel(layer=1, head=2)) == -0.8
    assert float(peak.sel(layer=1, head=0)) == 0.1  # NaN tokens skipped
    assert float(head_map(score, "sum").sel(layer=1, head=2)) == pytest.approx(-0.4)
    assert float(head_map(score, "mean").sel(layer=0, head=1)) == pytest.approx(0.225)
    kv = xr.DataArray(np.arange(4.0).reshape(2, 2), dims=("layer", "kv_head"))
    assert head_map(kv).dims == ("layer", "kv_head")


def test_position_grid_rows_are_the_heads_scores_per_token():
    score = patching_by_token()["score"]
    svg = position_grid_svg(score, [(1, 2), (0, 1)], tokens=["<bos>", "a", "b", ":"])
    cells = {(a["data-row"], a["data-col"]): float(a["data-value"]) for a in tags(svg, "rect", "data-row")}
    assert [cells[("L1H2", t)] for t in ("<bos>", "a", "b", ":")] == [0.0, 0.3, 0.1, -0.8]
    assert [cells[("L0H1", t)] for t in ("<bos>", "a", "b", ":")] == [0.0, 0.1, 0.6, 0.2]
    assert "<bos>" not in svg  # escaped
    with pytest.raises(ValueError, match="3 token labels for 4 tokens"):
        position_grid_svg(score, [(0, 0)], tokens=["a", "b", "c"])


def test_dla_terms_heads_rest_and_total_sum():
    ds = dla_dataset()
    terms = dla_terms(ds)
    assert terms == [("L0H0", 0.5), ("L0H1", -0.25), ("L1H0", 2.0), ("L1H1", 0.125), ("rest", 1.5),
                     ("logit diff", 3.875)]
    assert sum(v for _, v in terms[:-1]) == pytest.approx(terms[-1][1])
    top = dla_terms(ds, max_heads=2)  # the two largest |score|, in layer order, then the others summed
    assert top[:3] == [("L0H0", 0.5), ("L1H0", 2.0), ("other heads (2)", -0.125)]
    bars = {a["data-label"]: float(a["data-value"]) for a in tags(dla_bars_svg(ds), "rect", "data-label")}
    assert bars == dict(terms)


def test_parse_node_names():
    assert parse_node("a3.h1.q") == (parse_node("a3.h1")[0], "q")
    node, port = parse_node("a3.h1.k")
    assert (node.name, node.kind, node.layer, node.index, port) == ("a3.h1", "head", 3, 1, "k")
    assert parse_node("a2.kv0.v")[0].name == "a2.kv0" and parse_node("a2.kv0.v")[1] == "v"
    assert parse_node("m2")[0].kind == "mlp" and parse_node("m2")[0].layer == 2
    assert parse_node("emb")[0].kind == "emb" and parse_node("logits")[0].kind == "logits"
    assert parse_node("resid_pre")[0].kind == "other"


def test_circuit_edges_dense_and_sparse_top_k_and_threshold():
    ds = edge_dataset()
    edges = circuit_edges(ds, top_k=None)
    assert edges == [Edge("a1.h0", "logits", 1.6), Edge("a0.h1", "a1.h0.v", -0.8), Edge("emb", "a1.h0.q", 0.4),
                     Edge("a0.h1", "logits", 0.2), Edge("emb", "m1", -0.1), Edge("m1", "logits", 0.05)]
    assert circuit_edges(ds, top_k=2) == edges[:2]
    assert circuit_edges(ds, top_k=None, threshold=0.2) == edges[:4]
    flat = ds["score"].stack(edge=("source", "destination")).dropna("edge")
    sparse = xr.DataArray(flat.values, dims="edge", coords={
        "source": ("edge", [s for s, _ in flat["edge"].values]),
        "destination": ("edge", [d for _, d in flat["edge"].values])})
    assert circuit_kind(xr.Dataset({"score": sparse})) == "edges"
    assert circuit_edges(sparse, top_k=None) == edges
    with pytest.raises(ValueError, match="source and destination"):
        circuit_edges(xr.DataArray([1.0], dims="edge"))


def test_circuit_graph_layout_edges_and_colours():
    edges = circuit_edges(edge_dataset(), top_k=None)
    svg = circuit_graph_svg(edges)
    boxes = {}
    for g in re.findall(r'<g class="node" data-node="([^"]+)" data-kind="(\w+)"><rect x="([\d.]+)" y="([\d.]+)"', svg):
        boxes[g[0]] = (g[1], float(g[2]), float(g[3]))
    assert set(boxes) == {"emb", "a0.h1", "a1.h0", "m1", "logits"}  # ports q, v join their head's node
    y = {name: b[2] for name, b in boxes.items()}
    # by layer, bottom to top: embeddings, layer 0's heads, layer 1's heads, layer 1's MLP, logits
    assert y["emb"] > y["a0.h1"] > y["a1.h0"] > y["m1"] > y["logits"]
    paths = {(a["data-source"], a["data-destination"]): a for a in tags(svg, "path", "data-source")}
    assert len(paths) == 6
    assert paths[("a1.h0", "logits")]["stroke"] == SIGN_COLORS["positive"]
    assert paths[("a0.h1", "a1.h0.v")]["stroke"] == SIGN_COLORS["negative"]
    assert paths[("a0.h1", "a1.h0.v")]["data-port"] == "v" and paths[("emb", "a1.h0.q")]["data-port"] == "q"
    width = {k: float(a["stroke-width"]) for k, a in paths.items()}
    assert width[("a1.h0", "logits")] == pytest.approx(6.0)  # 1 + 5 |w| / max |w|
    assert width[("a0.h1", "a1.h0.v")] == pytest.approx(1 + 5 * 0.8 / 1.6)
    assert float(paths[("a0.h1", "a1.h0.v")]["data-weight"]) == -0.8

    def ends(a):
        nums = [float(v) for v in re.findall(r"-?[\d.]+", a["d"])]
        return (nums[0], nums[1]), (nums[-2], nums[-1])

    # an edge leaves the top of its source's box and enters the bottom of its destination's, at its port
    (x1, y1), (x2, y2) = ends(paths[("a0.h1", "a1.h0.v")])
    (_, hx, hy), (_, sx, sy) = boxes["a1.h0"], boxes["a0.h1"]
    assert (x1, y1) == (pytest.approx(sx + 26), pytest.approx(sy)) and y2 == pytest.approx(hy + 20)
    qx, _ = ends(paths[("emb", "a1.h0.q")])[1]
    assert qx < hx + 26 < x2  # q enters left of the box's middle, v right of it


# --- the report ---------------------------------------------------------------------------------------------

class Constructed(headlab.ComponentConfig):
    """A detector returning one of this test's datasets."""

    kind: Literal["constructed_circuit"] = "constructed_circuit"
    which: Literal["patching", "kv", "dla", "edges"] = "patching"


def constructed(config: Constructed, ctx) -> xr.Dataset:
    if config.which == "patching":
        return patching_by_token()
    if config.which == "dla":
        return dla_dataset()
    if config.which == "kv":
        score = np.array([[0.25, -0.5], [1.0, 0.0]])
        return xr.Dataset({"score": (("layer", "kv_head"), score), "patched": (("layer", "kv_head", "example"),
                                                                              np.zeros((2, 2, 2))),
                           "clean": (("example",), [1.0, 1.0]), "corrupt": (("example",), [0.0, 0.0])},
                          coords={"layer": [0, 1], "kv_head": [0, 1]},
                          attrs={"method": "activation_patching", "unit": "kv", "convention": HOSTILE})
    return edge_dataset(hostile=True)


class ConstructedPlugin:
    @headlab.hookimpl
    def headlab_register_detectors(self, register):
        register(Constructed, constructed)


@pytest.fixture(scope="module")
def constructed_report(tmp_path_factory):
    name = headlab.register_plugin(ConstructedPlugin(), name="constructed-circuits", replace=True)
    try:
        steps = "".join(f"  - id: {w}\n    detect: {{kind: constructed_circuit, which: {w}}}\n"
                        for w in ("patching", "kv", "dla", "edges"))
        run = headlab.run(spec_text(steps, task="{kind: repeated_tokens, n: 2, length: 8}",  # 2 examples, as built
                                    out=str(tmp_path_factory.mktemp("runs"))))
        yield run, render_report(run)
    finally:
        headlab.unregister_plugin(name)


def section(html: str, step: str) -> str:
    return html.split(f'id="step-{step}"')[1].split("</section>")[0]


def test_report_patching_section_map_per_token_grid_and_metrics(constructed_report):
    _, html = constructed_report
    part = section(html, "patching")
    (name, spec), = [(n, f) for n, f in embedded(part) if n == "patching: score"]
    cells = {(r["layer"], r["head"]): r["score"] for r in rows(spec)}
    assert len(cells) == 6 and cells[(1, 2)] == -0.8 and cells[(0, 1)] == 0.6
    scale = next(layer["encoding"]["color"]["scale"] for layer in spec["layer"]
                 if "scale" in layer.get("encoding", {}).get("color", {}))
    assert scale["scheme"] == figures.DIVERGING_SCHEME and scale["domain"] == [-0.8, 0.8]  # signed: centred at 0
    grid = {(a["data-row"], a["data-col"]): float(a["data-value"]) for a in tags(part, "rect", "data-row")}
    # the strongest heads by magnitude, every token
    assert [grid[("L1H2", str(t))] for t in range(4)] == [0.0, 0.3, 0.1, -0.8]
    assert [grid[("L0H1", str(t))] for t in range(4)] == [0.0, 0.1, 0.6, 0.2]
    assert '<td>clean (mean over examples)</td><td class="num">3</td>' in part
    assert '<td>corrupt (mean over examples)</td><td class="num">-2</td>' in part
    kv = section(html, "kv")
    cells = {(r["layer"], r["head"]): r["score"] for r in rows(embedded(kv)[0][1])}
    assert cells == {(0, 0): 0.25, (0, 1): -0.5, (1, 0): 1.0, (1, 1): 0.0}
    assert "score per key/value head" in kv


def test_report_dla_section_bars(constructed_report):
    _, html = constructed_report
    part = section(html, "dla")
    bars = {a["data-label"]: float(a["data-value"]) for a in tags(part, "rect", "data-label")}
    assert bars == dict(dla_terms(dla_dataset()))
    assert bars["rest"] == 1.5 and bars["logit diff"] == 3.875
    cells = {(r["layer"], r["head"]): r["score"] for r in rows(embedded(part)[0][1])}
    assert cells == {(0, 0): 0.5, (0, 1): -0.25, (1, 0): 2.0, (1, 1): 0.125}


def test_report_edges_section_graph_table_and_faithfulness(constructed_report):
    _, html = constructed_report
    part = section(html, "edges")
    paths = {(a["data-source"], a["data-destination"]): float(a["data-weight"]) for a in tags(part, "path", "data-source")}
    assert paths[("a1.h0", "logits")] == 1.6 and paths[("a0.h1", "a1.h0.v")] == -0.8 and len(paths) == 7
    assert paths[(HOSTILE, "logits")] == 0.3  # the hostile label is data, drawn as text
    rows = re.findall(r"<tr><td class=\"num\">(\d+)</td><td>([^<]*)</td><td>([^<]*)</td><td class=\"num\">([^<]+)</td>",
                      part)
    assert rows[0] == ("1", "a1.h0", "logits", "1.6") and rows[1] == ("2", "a0.h1", "a1.h0.v", "-0.8")
    assert '<td>faithfulness</td><td class="num">0.875</td>' in part


def test_report_escapes_labels_and_attrs(constructed_report):
    _, html = constructed_report
    doc = parse(html)
    assert not [t for t, _ in doc.tags if t == "img"]
    assert {a.get("type") for t, a in doc.tags if t == "script"} <= {"module", "application/json"}
    assert HOSTILE not in html
    # outside the scripts (the charts' inlined JavaScript, their JSON specs with <, > and & escaped)
    markup = re.sub(r"<script\b.*?</script>", "", html, flags=re.S)
    assert "onerror=" not in markup.replace("onerror=&quot;", "")
    assert all("<" not in spec and ">" not in spec
               for spec in re.findall(r'<script type="application/json">(.*?)</script>', html, flags=re.S))
    assert not any("onerror" in a for _, attrs in doc.tags for a in attrs)
    assert html.count("&lt;img src=x onerror=&quot;alert(1)&quot;&gt;") >= 3  # node, edge title, table, attrs


@pytest.mark.skipif(not (ROOT / "headlab/plugins/models/tiny/headlab-tiny/config.json").is_file(),
                    reason="the embedded model headlab-tiny is not built")
def test_report_of_a_real_pair_task_run_carries_its_numbers(tmp_path):
    spec = ("name: circ\nmodel: headlab-tiny\ntask: {kind: kv_swap, n: 3, num_pairs: 3}\nsteps:\n"
            "  - id: pos\n    detect: {kind: activation_patching, unit: z_position}\n"
            "  - id: dla\n    detect: {kind: direct_logit_attribution}\n")
    run = headlab.run(spec, out=tmp_path)
    html = render_report(run)
    pos, dla = run.results["pos"], run.results["dla"]
    cells = {(r["layer"], r["head"]): r["score"] for r in rows(embedded(section(html, "pos"))[0][1])}
    expected = head_map(pos["score"])
    for (layer, head), v in cells.items():
        assert v == pytest.approx(float(expected.sel(layer=layer, head=head)), rel=1e-3, abs=1e-6)
    grid = tags(section(html, "pos"), "rect", "data-row")
    assert len(grid) == 8 * pos.sizes["token"]
    for a in grid:
        layer, head = (int(x) for x in re.fullmatch(r"L(\d+)H(\d+)", a["data-row"]).groups())
        v = float(pos["score"].sel(layer=layer, head=head, token=int(a["data-col"])))
        assert float(a["data-value"]) == pytest.approx(v, rel=1e-3, abs=1e-6)
    bars = {a["data-label"]: float(a["data-value"]) for a in tags(section(html, "dla"), "rect", "data-label")}
    assert bars["logit diff"] == pytest.approx(float(dla["logit_diff"].mean()), rel=1e-3)
    assert bars["L3H1"] == pytest.approx(float(dla["score"].sel(layer=3, head=1)), rel=1e-3)
    assert sum(v for k, v in bars.items() if k != "logit diff") == pytest.approx(bars["logit diff"], rel=1e-3)


# --- widgets -------------------------------------------------------------------------------------------------

widgets = pytest.importorskip("headlab.widgets", reason="needs the notebook extras")


def test_patching_map_click_shows_the_heads_scores_per_token():
    pm = widgets.PatchingMap(patching_by_token(), tokens=["<bos>", "a", "b", ":"])
    assert pm.headmap.values == [[0.0, 0.6, 0.0], [0.1, 0.0, -0.8]]  # peak per head
    assert "Click a head" in pm.panel.value and not tags(pm.panel.value, "rect", "data-row")
    pm.headmap.toggle(1, 2)  # what a click on the cell does
    grid = {(a["data-row"], a["data-col"]): float(a["data-value"]) for a in tags(pm.panel.value, "rect", "data-row")}
    assert grid == {("L1H2", "<bos>"): 0.0, ("L1H2", "a"): 0.3, ("L1H2", "b"): 0.1, ("L1H2", ":"): -0.8}
    pm.headmap.toggle(0, 1)
    rows = {a["data-row"] for a in tags(pm.panel.value, "rect", "data-row")}
    assert rows == {"L0H1", "L1H2"}
    np.testing.assert_array_equal(pm.position_scores(0, 1).values, [0.0, 0.1, 0.6, 0.2])
    pm.headmap.clear()
    assert "Click a head" in pm.panel.value


def test_patching_map_without_tokens_and_for_kv_heads():
    ds = patching_by_token().isel(token=2).drop_vars("token")
    pm = widgets.PatchingMap(ds, selected=[(0, 1)])
    assert "L0H1</td><td class=\"num\">0.6</td>" in pm.panel.value
    assert "clean (mean)</td><td class=\"num\">3</td>" in pm.panel.value
    with pytest.raises(ValueError, match="no token dimension"):
        pm.position_scores(0, 1)
    kv = xr.Dataset({"score": (("layer", "kv_head"), [[0.25, -0.5]])}, attrs={"method": "activation_patching"})
    km = widgets.PatchingMap(kv, selected=[(0, 1)])
    assert km.headmap.values == [[0.25, -0.5]] and "L0KV1</td><td class=\"num\">-0.5" in km.panel.value
    with pytest.raises(ValueError, match="PatchingMap"):
        widgets.PatchingMap(xr.DataArray(np.zeros(3), dims="edge"))


def test_dla_bars_widget_and_circuit_graph_slider():
    bars = widgets.DLABars(dla_dataset())
    assert bars.terms == dla_terms(dla_dataset())
    assert {a["data-label"]: float(a["data-value"]) for a in tags(bars.value, "rect", "data-label")} == dict(bars.terms)
    graph = widgets.CircuitGraph(edge_dataset(), top_k=2)
    assert graph.slider.max == 6 and graph.edges == circuit_edges(edge_dataset(), top_k=2)
    drawn = {(a["data-source"], a["data-destination"]) for a in tags(graph.figure.value, "path", "data-source")}
    assert drawn == {("a1.h0", "logits"), ("a0.h1", "a1.h0.v")}
    graph.slider.value = 5
    drawn = [float(a["data-weight"]) for a in tags(graph.figure.value, "path", "data-source")]
    assert drawn == [1.6, -0.8, 0.4, 0.2, -0.1]
    assert math.isclose(widgets.CircuitGraph(edge_dataset(), threshold=0.3).slider.max, 3)


def test_the_browser_and_the_runner_show_each_step_in_its_figure(constructed_report):
    run, _ = constructed_report
    views = widgets.run_views(run)
    assert [type(v).__name__ for v in views] == ["PatchingMap", "PatchingMap", "DLABars", "CircuitGraph"]
    patching, kv, dla, edges = views
    assert patching.by_token and kv.kv and not kv.by_token
    np.testing.assert_allclose(np.array(kv.headmap.values), [[0.25, -0.5], [1.0, 0.0]])
    assert dla.terms == widgets.DLABars(run.results["dla"]).terms
    assert [(e.source, e.destination) for e in edges.edges] == \
        [(e.source, e.destination) for e in widgets.CircuitGraph(run.results["edges"]).edges]
    browser = widgets.RunBrowser(run.path.parent).select([run])
    _, figures, _ = browser.detail.children
    assert [type(v).__name__ for v in figures.children] == [type(v).__name__ for v in views]
    assert all(isinstance(a, type(b)) for a, b in zip(figures.children, views, strict=True))
    with pytest.raises(KeyError, match="no step 'nope'"):
        widgets.step_view(run, "nope")
