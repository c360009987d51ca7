"""`headlab report RUN`: a self-contained HTML file whose heatmaps, tables and plots carry the run's
numbers."""

from __future__ import annotations

import re
from html.parser import HTMLParser
from pathlib import Path
from typing import Literal

import numpy as np
import pytest

import headlab
from headlab.heads import ranked
from headlab.report import color, render_report, report_figures, write_report

from fixtures.cli import run as run_cli
from fixtures.figures import embedded, rows
from fixtures.specs import spec_text

STEPS = ("  - id: ind\n    detect: {kind: induction}\n"
         "  - id: prev\n    detect: {kind: previous_token}\n"
         "  - id: gen\n    generate: {max_new_tokens: 3, metrics: [exact_match, contains]}\n")


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


@pytest.fixture(scope="module")
def sweep_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("runs")
    return headlab.run(spec_text(STEPS, sweep="  task.length: [5, 9]\n", task="{kind: repeated_tokens, n: 3, length: 5}",
                                 out=str(out)))


def test_color_scale_endpoints_and_nan():
    assert color(0.0) == "#440154" and color(1.0) == "#fde725"
    assert color(5.0, 0, 10) == color(0.5) and color(-1) == color(0) and color(2) == color(1)
    assert color(float("nan")) == color(None) == "#dddddd"


def test_report_contents_match_the_run(sweep_run, tmp_path):
    html = render_report(sweep_run)
    doc = parse(html)
    # nothing external: one inline script (the figures' JavaScript), no links, no remote sources
    assert [a for t, a in doc.tags if t == "script" and a.get("type") != "application/json"] == [{"type": "module"}]
    assert not [t for t, _ in doc.tags if t in ("link", "iframe", "img")]
    assert not re.search(r"(src|href)=\"(https?:)?//", html)
    # the mean heatmap of each detect step carries the run's scores
    for step in ("ind", "prev"):
        section = html.split(f'id="step-{step}"')[1].split("</section>")[0]
        mean = sweep_run.results[step]["score"].mean("task.length")
        maps = [(name, spec) for name, spec in embedded(section) if name.startswith(f"{step}: score")]
        first_map = {(r["layer"], r["head"]): r["score"] for r in rows(maps[0][1])}
        assert len(first_map) == 8
        for (layer, head), v in first_map.items():
            assert v == pytest.approx(float(mean.sel(layer=layer, head=head)), rel=1e-6)
        # one map per sweep cell after the mean map, each with that cell's scores
        assert [name for name, _ in maps] == [f"{step}: score", f"{step}: score at task.length=5",
                                              f"{step}: score at task.length=9"]
        for (_, spec), length in zip(maps[1:], (5, 9), strict=True):
            cell = sweep_run.results[step]["score"].sel({"task.length": length})
            assert {(r["layer"], r["head"]): r["score"] for r in rows(spec)} == pytest.approx(
                {(lh[0], lh[1]): float(cell.sel(layer=lh[0], head=lh[1])) for lh in first_map})
        (best, score), *_ = ranked(mean)
        assert f"<td class=\"num\">{best[0]}</td><td class=\"num\">{best[1]}</td><td class=\"num\">{score:.4g}</td>" in section
        assert "score vs task.length" in section
    # metric table per sweep cell and sweep plot
    gen = html.split('id="step-gen"')[1].split("</section>")[0]
    ds = sweep_run.results["gen"]
    for length in (5, 9):
        em = float(ds["exact_match"].sel({"task.length": length}).mean())
        co = float(ds["contains"].sel({"task.length": length}).mean())
        n = int(ds["exact_match"].sel({"task.length": length}).notnull().sum())
        for name, mean in (("exact_match", em), ("contains", co)):
            assert f'<td>task.length={length}</td><td>{name}</td><td class="num">{mean:.4g}</td>' in gen
        assert f'<td class="num">{n}</td><td>0</td>' in gen
    (name, plot), = embedded(gen)
    assert name == "metric vs task.length"
    points = [r for r in rows(plot) if r["series"] == "contains"]
    assert [r["x"] for r in points] == [5, 9]
    assert [r["y"] for r in points] == pytest.approx([float(ds["contains"].sel({"task.length": v}).mean()) for v in (5, 9)])
    out0 = str(ds["output"].sel({"task.length": 9}).isel(example=0).values)
    assert out0 in "".join(parse(gen).text)
    assert "name: test" in html and "random-llama" in html


def test_write_report_default_path_and_cli(sweep_run, tmp_path):
    path = write_report(sweep_run)
    assert path == sweep_run.path.with_name(sweep_run.path.name + ".html") and path.stat().st_size > 1000
    assert headlab.open_run(sweep_run.path).status == "complete"  # the store is untouched
    out = tmp_path / "r" / "report.html"
    res = run_cli("report", str(sweep_run.path), "-o", str(out), "--examples", "1", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert out.is_file() and "report written to" in res.stdout
    assert "generations (first 1)" in out.read_text()
    res = run_cli("report", str(tmp_path), cwd=tmp_path)
    assert res.returncode == 2 and "no headlab run" in res.stderr and "Traceback" not in res.stderr


def test_report_of_run_without_sweep(tmp_path):
    run = headlab.run(spec_text("  - id: ind\n    detect: {kind: induction}\n", out=str(tmp_path)))
    html = render_report(run)
    (name, spec), = embedded(html)
    assert name == "ind: score" and "per sweep cell" not in html
    np.testing.assert_allclose(sorted(r["score"] for r in rows(spec)),
                               sorted(run.results["ind"]["score"].values.ravel()), rtol=1e-6)
    assert Path(write_report(run, tmp_path / "x.html")).is_file()
    assert [f.name for f in report_figures(run)] == ["ind: score"]
    folder = write_report(run, tmp_path / "figs", format="svg")
    (svg,) = folder.iterdir()
    assert svg.name == "01-ind-score.svg" and svg.read_text().startswith("<svg")
    from typer.testing import CliRunner

    from headlab.cli import app

    res = CliRunner().invoke(app, ["report", str(run.path), "--format", "png", "-o", str(tmp_path / "pngs")])
    assert res.exit_code == 0, res.output
    (png,) = (tmp_path / "pngs").iterdir()
    assert png.name == "01-ind-score.png" and png.read_bytes()[:4] == b"\x89PNG"


def test_values_section_lists_small_numeric_results():
    import xarray as xr

    from headlab.report import _values_section

    ds = xr.Dataset({"base": ((), 0.75), "top": (("k",), [0.0, 0.25]), "random": (("k", "draw"), [[0.5, 0.7], [0.6, 0.4]]),
                     "base_example": (("example",), [1.0, 0.5])},
                    coords={"k": [4, 8]}, attrs={"action": "detect", "method": "ablation",
                                                  "metrics": ["base", "top", "random"]})
    html = _values_section("ablation", ds)
    rows = re.findall(r"<tr><td>(\w+)</td><td>([^<]*)</td><td class=\"num\">([^<]+)</td></tr>", html)
    assert rows == [("base", "", "0.75"), ("top", "k=4", "0"), ("top", "k=8", "0.25"),
                    ("random", "k=4, draw=0", "0.5"), ("random", "k=4, draw=1", "0.7"),
                    ("random", "k=8, draw=0", "0.6"), ("random", "k=8, draw=1", "0.4")]


def test_summary_and_show_give_metrics_per_cell_never_a_mean_across_the_sweep(tmp_path):
    """A generate step swept over max_new_tokens: one summary row per cell, each the mean over that cell's
    examples only (the mean across sweep values was printed before)."""
    steps = "  - id: gen\n    generate: {max_new_tokens: 2, metrics: [word_count]}\n"

    class Words(headlab.ComponentConfig):
        """Words per output."""

        kind: Literal["word_count_report"] = "word_count_report"

    text = spec_text(steps.replace("word_count", "word_count_report"), sweep="  gen.max_new_tokens: [1, 3]\n",
                     out=str(tmp_path / "runs"))

    class Plugin:
        @headlab.hookimpl
        def headlab_register_metrics(self, register):
            register(Words, lambda config, examples, outputs: np.array([len(o.split()) for o in outputs], float))

    name = headlab.register_plugin(Plugin(), name="report-words", replace=True)
    try:
        run = headlab.run(text)
        info = run.summary()["gen"]
        words = run.results["gen"]["word_count_report"]
        assert info["kind"] == "generate" and info["metrics"] == {}
        got = {r["cell"]["gen.max_new_tokens"]: r["metrics"]["word_count_report"] for r in info["cells"]}
        assert got == {n: float(words.sel({"gen.max_new_tokens": n}).mean()) for n in (1, 3)}
        assert got[1] == 1.0 and got[3] == 3.0  # a random model without EOS: exactly max_new_tokens words
    finally:
        headlab.unregister_plugin(name)
