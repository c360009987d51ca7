"""The reports of the example specs in headless chromium (done-when of issue 39): no console errors, nothing
fetched, the expected figures drawn and non-empty, every axis titled and no tick label outside its figure's
box (bounding boxes measured in the browser); and decoding_counterfact's one chart comparing its five
strategies, each bar with the step's n and interval, checked against numbers computed here.

The runs are small versions of the specs (:mod:`fixtures.report_runs`: the same steps on fewer, shorter
examples); the reports of the specs as typed are rendered the same way in the slow set
(tests/test_example_specs.py, :func:`fixtures.figures.assert_renders`).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

import headlab
from headlab.report import render_report

from fixtures.figures import CHROMIUM, assert_renders, embedded, rows
from fixtures.report_runs import REPORT_FIGURES, reduced_spec

STRATEGIES = ["greedy", "decore", "decore_random", "cad", "dola"]


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    """``name -> (run, report path)``, each run made once per module, on first use."""
    out = tmp_path_factory.mktemp("report-runs")
    made: dict[str, tuple[headlab.Run, Path]] = {}

    def get(name: str) -> tuple[headlab.Run, Path]:
        if name not in made:
            run = headlab.run(reduced_spec(name, out))
            path = out / f"{name}.html"
            path.write_text(render_report(run), encoding="utf-8")
            made[name] = (run, path)
        return made[name]

    return get


def wilson(k: int, n: int, z: float = 1.959963984540054) -> tuple[float, float]:
    """Wilson's score interval, from its formula."""
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return centre - half, centre + half


def test_decoding_counterfact_has_one_chart_comparing_the_five_strategies_with_n(reports):
    run, path = reports("decoding_counterfact")
    page = path.read_text()
    charts = [(name, spec) for name, spec in embedded(page) if name.startswith("comparison:")]
    assert [name for name, _ in charts] == ["comparison: context_memory"]
    bars = rows(charts[0][1])
    assert [b["step"] for b in bars] == ["greedy", "decore", "decore_random [control]", "cad", "dola"]
    for bar, step in zip(bars, STRATEGIES, strict=True):
        values = run.results[step]["context_memory"].values.astype(float)
        defined = values[~np.isnan(values)]
        n, k = defined.size, int(defined.sum())
        assert bar["_v"] == pytest.approx(k / n) and (bar["_lo"], bar["_hi"]) == pytest.approx(wilson(k, n))
        dropped = values.size - n
        assert bar["n"] == f"n={n}" + (f", {dropped} dropped" if dropped else "")
        assert bar["control"] is (step == "decore_random")
    # the outputs side by side: one prompt per row, a column per strategy
    table = page.split("outputs side by side")[1].split("</table>")[0]
    assert "".join(f"<th>{s}</th>" for s in STRATEGIES) in table
    first = str(run.results["cad"]["output"].isel(example=0).values)
    assert f"<td>{first}</td>" in table or first == ""
    # step headers say what each step did
    assert "decore_random: control: generate decore (heads from retrieval top 8, random, alpha entropy)" in page


@pytest.mark.skipif(not Path(CHROMIUM).is_file(), reason=f"{CHROMIUM} is missing (.ci/setup-test installs it)")
@pytest.mark.parametrize("name", list(REPORT_FIGURES))
def test_report_renders_in_chromium(name, reports, tmp_path):
    pytest.importorskip("playwright.sync_api", reason="needs the notebook extras (playwright)")
    _, path = reports(name)
    assert_renders(path, REPORT_FIGURES[name], tmp_path / "profile")


def test_kv_compression_marks_the_random_policy_as_a_control_and_titles_steps_by_their_config(reports):
    run, path = reports("kv_compression")
    page = path.read_text()
    (_, spec), = [(n, s) for n, s in embedded(page) if n == "comparison: needle_recall"]
    marked = {b["step"]: b["control"] for b in rows(spec)}
    assert marked == {"full": False, "streaming_top4_w64": False, "razor_top4_w128": False, "headkv_f030": False,
                      "random_top4_w128 [control]": True}
    assert "streaming_top4_w64: generate, kv streaming (full heads from retrieval top 4, window 64)" in page
    assert "headkv_f030: generate, kv headkv (scores from retrieval, budget fraction 0.3)" in page


@pytest.mark.slow
@pytest.mark.skipif(not Path(CHROMIUM).is_file(), reason=f"{CHROMIUM} is missing (.ci/setup-test installs it)")
def test_atlas_figures_render_in_chromium(tmp_path):
    """The report of an atlas run (a tiny random GQA Llama), and a page of every figure of a head cube with a
    causal check and a comparison (synthetic, 32 x 32 heads), drawn in chromium with no problem."""
    pytest.importorskip("playwright.sync_api", reason="needs the notebook extras (playwright)")
    from headlab import figures
    from headlab.role_figures import cube_parts

    from fixtures.role_cubes import DETECTORS, make_comparison, make_cube
    from fixtures.specs import TINY_LLAMA

    spec = {"name": "atlas", "model": {"config": dict(TINY_LLAMA)},
            "task": {"kind": "repeated_tokens", "n": 2, "length": 4},
            "steps": [{"id": "atlas", "atlas": {"detectors": ["previous_token", "induction", "attention_sink"],
                                                "tokens": 8, "n": 2, "null": "none"}}]}
    run = headlab.run(spec, out=str(tmp_path / "runs"))
    path = tmp_path / "atlas.html"
    path.write_text(render_report(run), encoding="utf-8")
    assert_renders(path, ["atlas: roles", "atlas: score per detector"], tmp_path / "profile")

    cube = make_cube(32, 32, DETECTORS, seed=4)
    parts = [p for p in cube_parts(cube.merge(make_comparison(cube)), "cube") if p.chart is not None]
    page = tmp_path / "cube.html"
    page.write_text("<!DOCTYPE html><html><head><meta charset='utf-8'></head><body>" + "".join(
        figures.to_html_fragment(p.chart, name=p.name) for p in parts) + figures.page_script() + "</body></html>",
                    encoding="utf-8")
    assert_renders(page, [p.name for p in parts], tmp_path / "profile2")
