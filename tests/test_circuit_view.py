"""The circuit figures (headlab.circuit_view's numbers, headlab.circuit_figures' Vega-Lite charts), in
``headlab report`` and in the widgets PatchingMap, DLABars and CircuitGraph: every check reads values, colours
and labels back from the figures' specifications (or the report's HTML) of a dataset built here, whose right
rendering is known."""

from __future__ import annotations

import json
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
from headlab.circuit_figures import atp_scatter, circuit_chart, graph_layout
from headlab.circuit_view import (
    Edge,
    atp_pairs,
    atp_vs_exact,
    circuit_edges,
    circuit_kind,
    circuit_of,
    dla_panels,
    dla_terms,
    head_map,
    parse_node,
    resid_map,
    token_labels,
    tokenizer_for,
)
from headlab.report import render_report

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


def test_dla_terms_heads_rest_and_total_sum():
    ds = dla_dataset()
    terms = dla_terms(ds)
    assert terms == [("L0H0", 0.5), ("L0H1", -0.25), ("L1H0", 2.0), ("L1H1", 0.125), ("rest", 1.5),
                     ("logit diff", 3.875)]
    assert sum(v for _, v in terms[:-1]) == pytest.approx(terms[-1][1])
    top = dla_terms(ds, max_heads=2)  # the two largest |score|, in layer order, then the others summed
    assert top[:3] == [("L0H0", 0.5), ("L1H0", 2.0), ("other heads (2)", -0.125)]


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


def resid_dataset() -> xr.Dataset:
    """Residual-stream patching, 2 layers x 3 tokens: the information moves from token 1 to token 2."""
    score = np.array([[0.0, 0.4, 0.6], [0.0, -0.1, 1.0]])
    return xr.Dataset({"score": (("layer", "token"), score),
                       "patched": (("layer", "token", "example"), np.zeros((2, 3, 2))),
                       "clean": (("example",), [2.0, 4.0]), "corrupt": (("example",), [-1.0, -3.0])},
                      coords={"layer": [0, 1], "token": [0, 1, 2]},
                      attrs={"method": "activation_patching", "unit": "resid", "metric": "logit_diff"})


def test_resid_patching_is_a_layer_by_token_map():
    ds = resid_dataset()
    assert circuit_kind(ds) == "patching"
    swept = xr.concat([ds["score"], ds["score"] + 1.0], dim="task.n").transpose("token", "task.n", "layer")
    m = resid_map(swept)
    assert m.dims == ("layer", "token")
    np.testing.assert_allclose(m.values, ds["score"].values + 0.5)
    with pytest.raises(ValueError, match="layer, token"):
        resid_map(patching_by_token()["score"])


def test_dla_panels_keep_the_heads_apart_from_the_totals():
    ds = dla_dataset()
    heads, totals = dla_panels(ds)
    assert heads == [("L0H0", 0.5), ("L0H1", -0.25), ("L1H0", 2.0), ("L1H1", 0.125)]
    assert dict(totals) == {"heads": 0.5 - 0.25 + 2.0 + 0.125, "rest": 1.5, "logit diff": 3.875}
    assert dict(totals)["heads"] + dict(totals)["rest"] == dict(totals)["logit diff"]
    heads, totals = dla_panels(ds, max_heads=2)  # the two largest, the sum of the others
    assert heads == [("L0H0", 0.5), ("L1H0", 2.0), ("other heads (2)", -0.125)]
    assert dict(totals)["heads"] == 2.375


def circuit_dataset() -> xr.Dataset:
    """Six edges, four in the circuit; the metrics per example."""
    src = ["emb", "emb", "a0.h1", "a0.h1", "a1.h0", "m0"]
    dst = ["a0.h1.q", "logits", "a1.h0.v", "logits", "logits", "logits"]
    score = [0.5, -0.05, -0.8, 0.02, 1.6, 0.3]
    member = [True, False, True, False, True, True]
    return xr.Dataset({"score": (("edge",), score), "in_circuit": (("edge",), member),
                       "clean": (("example",), [4.0, 6.0]), "corrupt": (("example",), [-2.0, 0.0]),
                       "circuit": (("example",), [3.0, 2.0])},
                      coords={"source": ("edge", src), "destination": ("edge", dst)},
                      attrs={"method": "edge_attribution", "circuit_selection": "top 4 by |score|"})


def test_circuit_of_is_the_selected_edges_with_faithfulness():
    ds = circuit_dataset()
    c = circuit_of(ds)
    assert [(e.source, e.destination, e.weight) for e in c.edges] == [
        ("a1.h0", "logits", 1.6), ("a0.h1", "a1.h0.v", -0.8), ("emb", "a0.h1.q", 0.5), ("m0", "logits", 0.3)]
    assert (c.clean, c.corrupt, c.circuit) == (5.0, -1.0, 2.5)
    assert c.faithfulness == pytest.approx(2.5 / 5.0)
    assert c.faithfulness_normalised == pytest.approx((2.5 + 1.0) / (5.0 + 1.0))
    assert c.selection == "top 4 by |score|"
    assert circuit_of(ds.drop_vars("in_circuit")) is None
    # with a sweep: scores averaged, an edge in any cell's circuit
    two = xr.concat([ds, ds.assign(in_circuit=("edge", [False, True, False, False, False, False]))], dim="task.n")
    assert {(e.source, e.destination) for e in circuit_of(two).edges} == {
        ("a1.h0", "logits"), ("a0.h1", "a1.h0.v"), ("emb", "a0.h1.q"), ("m0", "logits"), ("emb", "logits")}


def pair_step(method: str, score: np.ndarray, dims: tuple[str, ...], prompts: list[str], **attrs) -> xr.Dataset:
    coords = {d: np.arange(n) for d, n in zip(dims, score.shape, strict=True)}
    return xr.Dataset({"score": (dims, score), "clean": (("example",), np.ones(len(prompts))),
                       "corrupt": (("example",), np.zeros(len(prompts))),
                       "prompt": (("example",), np.array(prompts, dtype=object))},
                      coords=coords, attrs={"method": method, "unit": "z", "metric": "logit_diff",
                                            "direction": "denoise", "normalise": "means", **attrs})


def test_atp_pairs_by_reference_or_by_unit_metric_direction_and_prompts():
    rng = np.random.default_rng(0)
    s = rng.normal(size=(2, 3))
    prompts = ["a b", "c d"]
    results = {
        "patch": pair_step("activation_patching", s, ("layer", "head"), prompts),
        "patch_other": pair_step("activation_patching", s, ("layer", "head"), ["x y", "z w"]),
        "atp_ref": pair_step("attribution_patching", s, ("layer", "head"), prompts, reference_step="patch"),
        "atp_auto": pair_step("attribution_patching", s, ("layer", "head"), prompts),  # patch_other: other prompts
        "atp_noise": pair_step("attribution_patching", s, ("layer", "head"), prompts, direction="noise"),
        "atp_alone": pair_step("attribution_patching", s, ("layer", "head"), ["q r", "s t"]),
    }
    assert atp_pairs(results) == [("atp_ref", "patch"), ("atp_auto", "patch")]


def hand_spearman(a: np.ndarray, b: np.ndarray) -> float:
    """Pearson correlation of the average ranks (pandas), the textbook Spearman."""
    import pandas as pd

    ra, rb = pd.Series(a).rank(method="average").values, pd.Series(b).rank(method="average").values
    return float(np.corrcoef(ra, rb)[0, 1])


@pytest.mark.parametrize("direction", ["denoise", "noise"])
def test_atp_vs_exact_spearman_and_top_k_overlap(direction):
    rng = np.random.default_rng(1)
    exact = rng.normal(size=(3, 4, 5))
    exact[0, 0] = 0.0  # ties: a head whose every token is exactly zero in both
    atp = exact + rng.normal(scale=0.5, size=exact.shape)
    atp[0, 0] = 0.0
    atp[2, 3, 4] = np.nan  # a unit AtP left undefined is left out
    dims = ("layer", "head", "token")
    e = pair_step("activation_patching", exact, dims, ["p"], direction=direction)
    a = pair_step("attribution_patching", atp, dims, ["p"], direction=direction)
    c = atp_vs_exact(a, e, top_k=7, atp_step="atp", exact_step="patch")
    keep = np.isfinite(atp.ravel())
    ev, av = exact.ravel()[keep], atp.ravel()[keep]
    assert len(c.units) == keep.sum() == 59 and c.units[0] == "L0H0 t0" and c.units[-1] == "L2H3 t3"
    np.testing.assert_array_equal(c.exact, ev)
    np.testing.assert_array_equal(c.atp, av)
    assert c.spearman == pytest.approx(hand_spearman(ev, av), abs=1e-12)
    s0 = 1.0 if direction == "noise" else 0.0
    by_exact = sorted(range(len(ev)), key=lambda i: -abs(ev[i] - s0))[:7]
    by_atp = sorted(range(len(av)), key=lambda i: -abs(av[i] - s0))[:7]
    assert c.top_k_overlap == len(set(by_exact) & set(by_atp)) / 7
    assert (c.top_k, c.atp_step, c.exact_step) == (7, "atp", "patch")


# --- the report ---------------------------------------------------------------------------------------------

class Constructed(headlab.ComponentConfig):
    """A detector returning one of this test's datasets."""

    kind: Literal["constructed_circuit"] = "constructed_circuit"
    which: Literal["patching", "kv", "dla", "edges", "resid", "circuit"] = "patching"


def constructed(config: Constructed, ctx) -> xr.Dataset:
    if config.which == "patching":
        return patching_by_token()
    if config.which == "dla":
        return dla_dataset()
    if config.which == "resid":
        return resid_dataset()
    if config.which == "circuit":
        return circuit_dataset()
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
                        for w in ("patching", "kv", "dla", "edges", "resid", "circuit"))
        run = headlab.run(spec_text(steps, task="{kind: repeated_tokens, n: 2, length: 8}",  # 2 examples, as built
                                    out=str(tmp_path_factory.mktemp("runs"))))
        yield run, render_report(run)
    finally:
        headlab.unregister_plugin(name)


def section(html: str, step: str) -> str:
    return html.split(f'id="step-{step}"')[1].split("</section>")[0]


def figures_of(part: str) -> dict[str, list[dict]]:
    """The Vega-Lite specifications of a report part's figures, by their ``data-figure`` name."""
    out: dict[str, list[dict]] = {}
    for name, spec in re.findall(r'<div class="headlab-figure" data-figure="([^"]*)"><div class="chart"></div>'
                                 r'<script type="application/json">(.*?)</script></div>', part, flags=re.S):
        out.setdefault(name, []).append(json.loads(spec.replace("<\\/", "</")))
    return out


def rows_of(spec: dict) -> list[dict]:
    """The data rows of a figure's first layer that has inline data."""
    for layer in spec.get("layer", [spec]):
        values = layer.get("data", spec.get("data", {})).get("values")
        if values:
            return values
    return []


def colour_scale_of(spec: dict) -> dict:
    for layer in spec.get("layer", [spec]):
        colour = layer.get("encoding", {}).get("color", {})
        if "scale" in colour:
            return colour["scale"]
    raise AssertionError("no colour scale")


def cell_values(spec: dict) -> dict[tuple[str, str], float | None]:
    """A heatmap's cells by (row label, column label)."""
    value = next(k for k in rows_of(spec)[0] if not k.startswith("_") and k not in ("layer", "head", "kv_head",
                                                                                   "token", "query", "key"))
    return {(r["_ylabel"], r["_xlabel"]): r[value] for r in rows_of(spec)}


def test_report_patching_section_map_per_token_grid_and_metrics(constructed_report):
    _, html = constructed_report
    part = section(html, "patching")
    figs = figures_of(part)
    cells = cell_values(figs["patching: score"][0])
    assert len(cells) == 6 and cells[("1", "2")] == -0.8 and cells[("0", "1")] == 0.6
    scale = colour_scale_of(figs["patching: score"][0])  # signed: diverging, centred at 0
    assert scale["domainMid"] == 0 and scale["domain"] == [-0.8, 0.8]
    grid = cell_values(figs["patching: score by head and token"][0])
    # the strongest heads by magnitude, every token (labelled by index: this run's model has no tokenizer)
    assert [grid[("L1H2", str(t))] for t in range(4)] == [0.0, 0.3, 0.1, -0.8]
    assert [grid[("L0H1", str(t))] for t in range(4)] == [0.0, 0.1, 0.6, 0.2]
    assert '<td>clean (mean over examples)</td><td class="num">3</td>' in part
    assert '<td>corrupt (mean over examples)</td><td class="num">-2</td>' in part
    kv = section(html, "kv")
    cells = cell_values(figures_of(kv)["kv: score"][0])
    assert cells == {("0", "0"): 0.25, ("0", "1"): -0.5, ("1", "0"): 1.0, ("1", "1"): 0.0}
    assert "score per key/value head" in kv


def test_report_resid_section_is_a_layer_by_token_map(constructed_report):
    run, html = constructed_report
    part = section(html, "resid")
    grid = cell_values(figures_of(part)["resid: score by layer and token"][0])
    n = run.results["resid"].sizes["token"]  # the task's prompts are longer than the constructed score
    assert len(grid) == 2 * n
    for layer, row in enumerate(resid_dataset()["score"].values):
        assert [grid[(f"L{layer}", str(t))] for t in range(3)] == list(row)
        assert all(grid[(f"L{layer}", str(t))] is None for t in range(3, n))  # NaN: no such token
    assert colour_scale_of(figures_of(part)["resid: score by layer and token"][0])["domainMid"] == 0
    assert '<td>clean (mean over examples)</td><td class="num">3</td>' in part


def test_report_dla_section_heads_apart_from_the_totals(constructed_report):
    _, html = constructed_report
    figs = figures_of(section(html, "dla"))
    heads = {r["term"]: r["value"] for r in rows_of(figs["dla: heads"][0])}
    totals = {r["term"]: r["value"] for r in rows_of(figs["dla: totals"][0])}
    assert heads == {"L0H0": 0.5, "L0H1": -0.25, "L1H0": 2.0, "L1H1": 0.125}
    assert totals == {"heads": 2.375, "rest": 1.5, "logit diff": 3.875}
    cells = cell_values(figs["dla: score"][0])
    assert cells == {("0", "0"): 0.5, ("0", "1"): -0.25, ("1", "0"): 2.0, ("1", "1"): 0.125}


def link_rows(spec: dict) -> dict[tuple[str, str], dict]:
    rows = next(r for r in (rows_of({"layer": [layer]}) for layer in spec["layer"]) if r and "source" in r[0])
    return {(r["source"], r["destination"]): r for r in rows}


def test_report_edges_section_graph_table_and_faithfulness(constructed_report):
    _, html = constructed_report
    part = section(html, "edges")  # no circuit selected: the strongest edges
    links = link_rows(figures_of(part)["edges: circuit"][0])
    assert {k: r["score"] for k, r in links.items()} == {
        ("a1.h0", "logits"): 1.6, ("a0.h1", "a1.h0.v"): -0.8, ("emb", "a1.h0.q"): 0.4, (HOSTILE, "logits"): 0.3,
        ("a0.h1", "logits"): 0.2, ("emb", "m1"): -0.1, ("m1", "logits"): 0.05}
    rows = re.findall(r"<tr><td class=\"num\">(\d+)</td><td>([^<]*)</td><td>([^<]*)</td><td class=\"num\">([^<]+)</td>",
                      part)
    assert rows[0] == ("1", "a1.h0", "logits", "1.6") and rows[1] == ("2", "a0.h1", "a1.h0.v", "-0.8")
    assert '<td>faithfulness</td><td class="num">0.875</td>' in part
    part = section(html, "circuit")  # the circuit the step selected, with its faithfulness
    spec = figures_of(part)["circuit: circuit"][0]
    assert set(link_rows(spec)) == {(e.source, e.destination) for e in circuit_of(circuit_dataset()).edges}
    assert "faithfulness 0.5, normalised 0.583" in json.dumps(spec["title"])
    assert '<td>faithfulness_normalised</td><td class="num">0.5833</td>' in part


def test_graph_layout_and_the_circuit_chart_edges():
    edges = [Edge("emb", "a0.h1.q", 0.5), Edge("a0.h1", "a1.h0.v", -0.8), Edge("a0.h0", "logits", 0.1),
             Edge("a1.h0", "m1", 0.2)]
    where, labels = graph_layout(edges)
    assert labels == ["emb", "L0 attn", "L1 attn", "L1 mlp", "logits"]
    assert where == {"emb": (0.0, 0), "a0.h0": (-0.5, 1), "a0.h1": (0.5, 1), "a1.h0": (0.0, 2), "m1": (0.0, 3),
                     "logits": (0.0, 4)}
    links = link_rows(figures.figure_spec(circuit_chart(edges)))
    q, v = links[("emb", "a0.h1.q")], links[("a0.h1", "a1.h0.v")]
    assert (q["x"], q["y"], q["x2"], q["y2"]) == (0.0, 0, 0.25, 1)  # a query input enters left of the node
    assert (v["x"], v["y"], v["x2"], v["y2"]) == (0.5, 1, 0.25, 2)  # a value input right of it
    assert (q["sign"], v["sign"], v["size"]) == ("positive", "negative", 0.8)


def test_atp_scatter_points_and_title():
    e = pair_step("activation_patching", np.array([[0.5, 0.1], [0.0, -0.2]]), ("layer", "head"), ["p"])
    a = pair_step("attribution_patching", np.array([[0.3, 0.2], [0.05, -0.1]]), ("layer", "head"), ["p"])
    c = atp_vs_exact(a, e, top_k=2, atp_step="atp", exact_step="patch")
    spec = figures.figure_spec(atp_scatter(c, label_top=2))
    points = {r["unit"]: (r["_x"], r["_y"], r["label"]) for r in rows_of(spec)}
    assert points == {"L0H0": (0.5, 0.3, "L0H0"), "L0H1": (0.1, 0.2, ""), "L1H0": (0.0, 0.05, ""),
                      "L1H1": (-0.2, -0.1, "L1H1")}
    assert spec["title"]["text"] == ["atp against patch", "Spearman 1.000; top-2 overlap 0.50 (4 units)"]


def test_report_escapes_labels_and_attrs(constructed_report):
    _, html = constructed_report
    doc = parse(html)
    assert not [t for t, _ in doc.tags if t == "img"]
    assert all(a.get("type") in ("application/json", "module") for t, a in doc.tags if t == "script")
    outside = re.sub(r"<script[^>]*>.*?</script>", "", html, flags=re.S)  # figures' data are JSON, not markup
    assert HOSTILE not in outside and "onerror=" not in outside.replace("onerror=&quot;", "")
    assert not any("onerror" in a for _, attrs in doc.tags for a in attrs)
    assert outside.count("&lt;img src=x onerror=&quot;alert(1)&quot;&gt;") >= 2  # the table and the attrs
    assert "</script" not in "".join(re.findall(r'<script type="application/json">(.*?)</script>', html, re.S))


@pytest.mark.skipif(not (ROOT / "headlab/plugins/models/tiny/headlab-tiny/config.json").is_file(),
                    reason="the embedded model headlab-tiny is not built")
def test_report_of_a_real_pair_task_run_carries_its_numbers(tmp_path):
    spec = ("name: circ\nmodel: headlab-tiny\ntask: {kind: kv_swap, n: 3, num_pairs: 3}\nsteps:\n"
            "  - id: pos\n    detect: {kind: activation_patching, unit: z_position}\n"
            "  - id: resid\n    detect: {kind: activation_patching, unit: resid}\n"
            "  - id: patch\n    detect: {kind: activation_patching, unit: z}\n"
            "  - id: atp\n    detect: {kind: attribution_patching, unit: z, top_k: 5}\n"
            "  - id: dla\n    detect: {kind: direct_logit_attribution}\n")
    run = headlab.run(spec, out=tmp_path)
    html = render_report(run)
    pos, dla = run.results["pos"], run.results["dla"]
    figs = figures_of(section(html, "pos"))
    expected = head_map(pos["score"])
    cells = cell_values(figs["pos: score"][0])
    assert len(cells) == 32
    for (layer, head), v in cells.items():
        assert v == pytest.approx(float(expected.sel(layer=int(layer), head=int(head))), rel=1e-5, abs=1e-7)
    # token axes: example 0's tokens, written by the tokenizer here, "clean/corrupt" where its pair differs
    tokenizer = tokenizer_for("headlab-tiny")
    clean = tokenizer(str(pos["prompt"].values[0]))["input_ids"]
    corrupt = tokenizer(str(pos["corrupt_prompt"].values[0]))["input_ids"]
    words = ["<bos>", *tokenizer.tokenize(str(pos["prompt"].values[0]))]
    other = ["<bos>", *tokenizer.tokenize(str(pos["corrupt_prompt"].values[0]))]
    expected_labels = [a if a == b else f"{a}/{b}" for a, b in zip(words, other, strict=True)]
    expected_labels += [""] * (pos.sizes["token"] - len(clean))
    assert token_labels(pos, tokenizer) == expected_labels
    assert sum("/" in t for t in expected_labels) == sum(a != b for a, b in zip(clean, corrupt, strict=True)) == 1
    assert token_labels(pos) == [str(t) for t in range(pos.sizes["token"])]
    rows = rows_of(figs["pos: score by head and token"][0])
    assert len(rows) == 8 * pos.sizes["token"]
    for r in rows:
        layer, head = (int(x) for x in re.fullmatch(r"L(\d+)H(\d+)", r["_ylabel"]).groups())
        assert r["_xlabel"] == expected_labels[r["_x"]]
        v = float(pos["score"].sel(layer=layer, head=head, token=r["_x"]))
        assert r["score"] == pytest.approx(v, rel=1e-5, abs=1e-7)
    resid = run.results["resid"]["score"]
    rows = rows_of(figures_of(section(html, "resid"))["resid: score by layer and token"][0])
    assert len(rows) == resid.size
    for r in rows:
        assert r["_xlabel"] == expected_labels[r["_x"]] and r["_ylabel"] == f"L{r['_y']}"
        assert r["score"] == pytest.approx(float(resid.sel(layer=r["_y"], token=r["_x"])), rel=1e-5, abs=1e-7)
    # AtP against exact patching: the numbers the detector stored itself, and its scatter in the report
    assert atp_pairs(run.results) == [("atp", "patch")]
    c = atp_vs_exact(run.results["atp"], run.results["patch"], top_k=5)
    assert c.spearman == pytest.approx(run.results["atp"].attrs["spearman"], abs=1e-9)
    assert c.top_k_overlap == run.results["atp"].attrs["top_k_recall"]
    scatter = figures_of(section(html, "atp"))["atp: AtP against patch"][0]
    points = {r["unit"]: (r["_x"], r["_y"]) for r in rows_of(scatter)}
    assert len(points) == 32 and points["L3H1"] == (pytest.approx(float(run.results["patch"]["score"].sel(
        layer=3, head=1))), pytest.approx(float(run.results["atp"]["score"].sel(layer=3, head=1))))
    assert f"Spearman {c.spearman:.3f}" in scatter["title"]["text"][1]
    figs = figures_of(section(html, "dla"))
    totals = {r["term"]: r["value"] for r in rows_of(figs["dla: totals"][0])}
    heads = {r["term"]: r["value"] for r in rows_of(figs["dla: heads"][0])}
    assert totals["logit diff"] == pytest.approx(float(dla["logit_diff"].mean()), rel=1e-5)
    assert heads["L3H1"] == pytest.approx(float(dla["score"].sel(layer=3, head=1)), rel=1e-5)
    assert totals["heads"] + totals["rest"] == pytest.approx(totals["logit diff"], rel=1e-4)
    # the attention of each detect step's top heads on example 0's prompt (all steps share it: a head is drawn
    # once), as the model computes it
    from headlab.attention_patterns import head_patterns, run_model, top_heads

    drawn = {}
    for name, specs in figures_of(html).items():
        m = re.fullmatch(r"(\w+): attention L(\d+)H(\d+)", name)
        if m:
            drawn[(int(m[2]), int(m[3]))] = specs[0]
    for step in ("pos", "patch", "atp", "dla"):
        assert set(top_heads(run.results[step]["score"], 4)) <= set(drawn), step
    lm = run_model(run.attrs)
    expected = head_patterns(lm, str(dla["prompt"].values[0]), list(drawn))
    for spec, one in zip(drawn.values(), expected, strict=True):
        assert spec["title"]["text"] == f"L{int(one['layer'])}H{int(one['head'])}"
        got = {(r["_y"], r["_x"]): r["attention"] for r in rows_of(spec)}
        np.testing.assert_allclose([[got[(q, k)] for k in range(one.sizes["key"])] for q in range(one.sizes["query"])],
                                   one.values, atol=1e-5)  # float32, probed with other layers


# --- widgets -------------------------------------------------------------------------------------------------

widgets = pytest.importorskip("headlab.widgets", reason="needs the notebook extras")


def spec_of(chart) -> dict:
    return figures.figure_spec(chart)


def test_patching_map_click_shows_the_heads_scores_per_token():
    ds = patching_by_token()
    tokens = ["<bos>", "a", "b", ":"]
    pm = widgets.PatchingMap(ds, tokens=tokens)
    assert pm.headmap.values == [[0.0, 0.6, 0.0], [0.1, 0.0, -0.8]]  # peak per head
    assert "Click a head" in pm.panel.value and pm.chart is None
    pm.headmap.toggle(1, 2)  # what a click on the cell does
    grid = cell_values(spec_of(pm.chart))  # the report's token heatmap, the tokens' text on the token axis
    assert grid == {("L1H2", t): float(v) for t, v in zip(tokens, ds["score"].sel(layer=1, head=2).values,
                                                          strict=True)}
    assert colour_scale_of(spec_of(pm.chart))["domainMid"] == 0  # signed: diverging at 0
    pm.headmap.toggle(0, 1)
    grid = cell_values(spec_of(pm.chart))
    assert {row for row, _ in grid} == {"L0H1", "L1H2"}
    assert [grid[("L0H1", t)] for t in tokens] == list(ds["score"].sel(layer=0, head=1).values)
    shown = pm.figure.value  # the chart, rendered offline: a cell per head and token
    assert shown.startswith("<svg") and shown.count('aria-roledescription="rect mark"') == 8 and "http" not in \
        shown.replace('"http://www.w3.org/', "")
    np.testing.assert_array_equal(pm.position_scores(0, 1).values, [0.0, 0.1, 0.6, 0.2])
    untitled = widgets.PatchingMap(ds, selected=[(1, 0)])  # no tokens: the token index; NaN: an empty cell
    assert cell_values(spec_of(untitled.chart)) == {("L1H0", "0"): None, ("L1H0", "1"): None,
                                                    ("L1H0", "2"): 0.05, ("L1H0", "3"): 0.1}
    pm.headmap.clear()
    assert "Click a head" in pm.panel.value and pm.chart is None
    with pytest.raises(ValueError, match="3 token labels for 4 tokens"):
        widgets.PatchingMap(ds, tokens=["a", "b", "c"], selected=[(0, 0)])


def test_patching_map_without_tokens_and_for_kv_heads():
    ds = patching_by_token().isel(token=2).drop_vars("token")
    pm = widgets.PatchingMap(ds, selected=[(0, 1)])
    assert "L0H1</td><td class=\"num\">0.6</td>" in pm.panel.value and pm.chart is None
    assert "clean (mean)</td><td class=\"num\">3</td>" in pm.panel.value
    with pytest.raises(ValueError, match="no token dimension"):
        pm.position_scores(0, 1)
    kv = xr.Dataset({"score": (("layer", "kv_head"), [[0.25, -0.5]])}, attrs={"method": "activation_patching"})
    km = widgets.PatchingMap(kv, selected=[(0, 1)])
    assert km.headmap.values == [[0.25, -0.5]] and "L0KV1</td><td class=\"num\">-0.5" in km.panel.value
    with pytest.raises(ValueError, match="PatchingMap"):
        widgets.PatchingMap(xr.DataArray(np.zeros(3), dims="edge"))


def test_dla_bars_widget_and_circuit_graph_slider():
    ds = dla_dataset()
    bars = widgets.DLABars(ds)
    assert bars.terms == dla_terms(ds)
    heads, totals = (spec_of(c) for c in bars.charts)  # the report's two panels
    assert {r["term"]: r["value"] for r in rows_of(heads)} == {
        f"L{a}H{b}": float(ds["score"].sel(layer=a, head=b)) for a in (0, 1) for b in (0, 1)}
    assert {r["term"]: r["value"] for r in rows_of(totals)} == pytest.approx({
        "heads": float(ds["score"].sum()), "rest": float(ds["rest"].mean()), "logit diff": float(ds["logit_diff"].mean())})
    assert [view.chart for view in bars.children] == list(bars.charts)
    assert all(view.value.startswith("<svg") for view in bars.children)
    graph = widgets.CircuitGraph(edge_dataset(), top_k=2)
    assert graph.slider.max == 6 and graph.edges == circuit_edges(edge_dataset(), top_k=2)
    assert {k: r["score"] for k, r in link_rows(spec_of(graph.chart)).items()} == {
        ("a1.h0", "logits"): 1.6, ("a0.h1", "a1.h0.v"): -0.8}
    graph.slider.value = 5
    dense = edge_dataset()["score"]  # the five largest |score| of the dataset, from its own values
    finite = [(s, d, float(dense.sel(source=s, destination=d))) for s in dense["source"].values
              for d in dense["destination"].values if np.isfinite(dense.sel(source=s, destination=d))]
    strongest = sorted(finite, key=lambda e: -abs(e[2]))[:5]
    assert {k: r["score"] for k, r in link_rows(spec_of(graph.chart)).items()} == {(s, d): w for s, d, w in strongest}
    assert "the 5 strongest edges" in json.dumps(spec_of(graph.chart)["title"])
    assert math.isclose(widgets.CircuitGraph(edge_dataset(), threshold=0.3).slider.max, 3)


def test_the_browser_and_the_runner_show_each_step_in_its_figure(constructed_report):
    run, html = constructed_report
    views = widgets.run_views(run)
    assert [type(v).__name__ for v in views] == ["PatchingMap", "PatchingMap", "DLABars", "CircuitGraph",
                                                 "ChartView", "CircuitGraph"]
    patching, kv, dla, edges, resid, _ = views
    cells = cell_values(spec_of(resid.chart))  # the report's (layer x token) map, cell for cell
    assert [cells[("L1", str(t))] for t in range(3)] == list(resid_dataset()["score"].sel(layer=1).values)
    assert cells == cell_values(figures_of(section(html, "resid"))["resid: score by layer and token"][0])
    assert patching.by_token and kv.kv and not kv.by_token
    np.testing.assert_allclose(np.array(kv.headmap.values), [[0.25, -0.5], [1.0, 0.0]])
    assert dla.terms == widgets.DLABars(run.results["dla"]).terms
    report_dla = figures_of(section(html, "dla"))
    assert [rows_of(spec_of(c)) for c in dla.charts] == [rows_of(report_dla["dla: heads"][0]),
                                                         rows_of(report_dla["dla: totals"][0])]
    assert [(e.source, e.destination) for e in edges.edges] == \
        [(e.source, e.destination) for e in widgets.CircuitGraph(run.results["edges"]).edges]
    browser = widgets.RunBrowser(run.path.parent).select([run])
    _, figures, _ = browser.detail.children
    assert [type(v).__name__ for v in figures.children] == [type(v).__name__ for v in views]
    assert all(isinstance(a, type(b)) for a, b in zip(figures.children, views, strict=True))
    with pytest.raises(KeyError, match="no step 'nope'"):
        widgets.step_view(run, "nope")
