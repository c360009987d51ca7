"""Metric vs KV cache in ``headlab report`` and the ``KvTradeoff`` widget: the points of a constructed run's
steps with a ``kv`` policy (one per step and sweep cell) carry the run's kept fractions, bytes and metric
means, the scatter chart carries them (bytes in MiB, each point labelled with its step), and needle tasks get
recall by context length and the length x depth heatmap."""

from __future__ import annotations

import numpy as np
import pytest

import headlab
from headlab import figures
from headlab.kv.view import (
    kv_metrics,
    kv_points,
    kv_table_rows,
    kv_tradeoff_chart,
    needle_by_length_chart,
    needle_heatmap_chart,
    needle_steps,
)
from headlab.report import render_report

from fixtures.figures import embedded, rows

STEPS = ("  - id: ind\n    task: {kind: repeated_tokens, n: 3, length: 8}\n    detect: {kind: induction}\n"
         "  - id: gen\n    generate:\n      max_new_tokens: 4\n      metrics: [rouge_l, contains]\n"
         "      kv: {kind: streaming, full_heads: {from: ind, top: 1}, sink: 1, window: 8}\n"
         "  - id: ctl\n    generate:\n      max_new_tokens: 4\n      metrics: [rouge_l, contains]\n"
         "      kv: {kind: random, n_full: 1, sink: 1, window: 8}\n"
         "  - id: base\n    generate:\n      max_new_tokens: 4\n      metrics: [rouge_l, contains]\n"
         "      kv: {kind: full}\n"
         "  - id: plain\n    generate: {max_new_tokens: 4, metrics: [rouge_l]}\n")
TASK = "{kind: kv_retrieval, n: 4, num_pairs: 8}"


def spec_text(steps: str, *, task: str, out: str, sweep: str = "") -> str:
    """A spec on the embedded model (its tokenizer gives the metrics text to score)."""
    return (f"name: kv-report\nmodel: headlab-tiny\ntask: {task}\nsteps:\n{steps}output: {out}\n"
            + (f"sweep:\n{sweep}" if sweep else ""))


def drawn(chart) -> list[dict]:
    """The points of a trade-off chart: label, policy, x and y as the chart places them."""
    return rows(figures.figure_spec(chart))


@pytest.fixture(scope="module")
def sweep_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("runs")
    return headlab.run(spec_text(STEPS, task=TASK, sweep="  gen.kv.window: [6, 12]\n", out=str(out)))


def test_one_point_per_kv_step_and_sweep_cell_with_the_runs_numbers(sweep_run):
    points = kv_points(sweep_run)
    assert [(p.step, p.cell) for p in points] == [(s, {"gen.kv.window": w}) for s in ("gen", "ctl", "base")
                                                  for w in (6, 12)]  # `plain` has no kv policy: no point
    for p in points:
        ds = sweep_run.results[p.step].sel(p.cell)
        assert p.policy == {"gen": "streaming", "ctl": "random", "base": "full"}[p.step]
        assert p.kept_fraction == float(ds["kv_kept_fraction"]) and p.kv_bytes == int(ds["kv_bytes"].sum())
        assert p.kv_bytes_full == pytest.approx(p.kv_bytes / p.kept_fraction, abs=1)
        assert p.metrics == {m: pytest.approx(float(ds[m].mean())) for m in ("rouge_l", "contains")}
    gen6, gen12 = points[:2]
    assert gen6.kept_fraction < gen12.kept_fraction < 1 and gen6.kv_bytes < gen12.kv_bytes
    assert gen6.kv_bytes_full == gen12.kv_bytes_full  # the same tokens: the same full cache
    assert points[4].kept_fraction == points[5].kept_fraction == 1.0
    assert points[4].kv_bytes == points[4].kv_bytes_full
    assert kv_metrics(points) == ["rouge_l", "contains"]
    header, rows = kv_table_rows(points)
    assert header[:6] == ["step", "cell", "policy", "KV bytes", "full KV bytes", "kept fraction"]
    assert rows[1][:6] == ["gen", "gen.kv.window=12", "streaming", gen12.kv_bytes, gen12.kv_bytes_full,
                           gen12.kept_fraction]


def test_the_tradeoff_chart_places_every_point_on_its_axes_labelled_by_its_step(sweep_run):
    points = kv_points(sweep_run)
    chart = kv_tradeoff_chart(points, "rouge_l")
    assert [(c["policy"], c["label"]) for c in drawn(chart)] == [
        ("streaming", "gen (gen.kv.window=6)"), ("streaming", "gen (gen.kv.window=12)"),
        *[("random", f"ctl (gen.kv.window={w})") for w in (6, 12)], ("full", "base (gen.kv.window=6)"),
        ("full", "base (gen.kv.window=12)")]
    by_label = {p.label: p for p in points}
    for c in drawn(chart):
        assert c["_x"] == pytest.approx(by_label[c["label"]].kept_fraction, rel=1e-9)
        assert c["_y"] == pytest.approx(by_label[c["label"]].metrics["rouge_l"], rel=1e-9)
    spec = figures.figure_spec(chart)
    x = spec["layer"][0]["encoding"]["x"]
    assert x["scale"]["domain"] == [0.0, 1.0] and x["title"] == "kept fraction of the full KV cache"
    assert spec["layer"][-1]["mark"]["type"] == "text" and spec["layer"][-1]["encoding"]["text"]["field"] == "label"
    by_bytes = kv_tradeoff_chart(points, "contains", x="kv_bytes")
    assert sorted(c["_x"] for c in drawn(by_bytes)) == pytest.approx(sorted(p.kv_bytes / 2 ** 20 for p in points))
    x = figures.figure_spec(by_bytes)["layer"][0]["encoding"]["x"]
    assert x["title"] == "KV bytes held (MiB)" and x["scale"]["zero"] is True
    y = figures.figure_spec(by_bytes)["layer"][0]["encoding"]["y"]
    assert y["scale"]["zero"] is True  # contains is a ratio: its axis starts at 0


def test_the_report_has_the_kv_section(sweep_run):
    html = render_report(sweep_run)
    section = html.split('id="kv"')[1].split("</section>")[0]
    points = kv_points(sweep_run)
    charts = embedded(section)
    assert [name for name, _ in charts] == [f"kv: {m} vs {x}" for m in ("rouge_l", "contains")
                                            for x in ("kept_fraction", "kv_bytes")]
    assert all(len(rows(spec)) == len(points) for _, spec in charts)
    for p in points:
        row = (f"<td>{p.step}</td><td>{', '.join(f'{k}={v}' for k, v in p.cell.items())}</td><td>{p.policy}</td>"
               f'<td class="num">{p.kv_bytes / 2 ** 20:.4g}</td><td class="num">{p.kv_bytes_full / 2 ** 20:.4g}</td>'
               f'<td class="num">{p.kept_fraction:.4g}</td>')
        assert row in section
    assert "<th>KV MiB</th>" in section and "needle" not in section  # kv_retrieval has no lengths or depths


def test_needle_figures_average_over_the_examples_of_each_length_and_depth():
    import xarray as xr

    recall = np.array([1, 0, 1, 1, 0, 0, 1, np.nan])
    lengths = np.array([100, 100, 100, 100, 200, 200, 200, 200])
    depths = np.array([0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 1.0])

    class FakeRun:  # the two things the needle figures read of a run
        sweep: dict = {}
        results = {s: xr.Dataset({"needle_recall": ("example", recall if s == "a" else 1 - np.nan_to_num(recall))},
                                 coords={"context_length": ("example", lengths), "depth": ("example", depths)},
                                 attrs={"metrics": ["needle_recall"]}) for s in ("a", "b")}

    run = FakeRun()
    assert needle_steps(run) == ["a", "b"]
    spec = figures.figure_spec(needle_by_length_chart(run, ["a", "b"], "needle_recall"))
    got = {(r["step"], r["x"]): r["y"] for r in rows(spec)}
    # independent: per length the mean over its defined values
    assert got == pytest.approx({("a", 100): 3 / 4, ("a", 200): 1 / 3, ("b", 100): 1 / 4, ("b", 200): 3 / 4})
    assert spec["layer"][-1]["encoding"]["y"]["scale"]["zero"] is True
    grid = {(r["context_length"], r["depth"]): r["needle_recall"]
            for r in rows(figures.figure_spec(needle_heatmap_chart(run, "a", "needle_recall")))}
    assert grid == {(100, 0.0): 0.5, (100, 1.0): 1.0, (200, 0.0): 0.0, (200, 1.0): 1.0}


def test_a_run_without_kv_policies_has_no_kv_section(tmp_path):
    run = headlab.run(spec_text("  - id: plain\n    generate: {max_new_tokens: 2, metrics: [contains]}\n",
                                task=TASK, out=str(tmp_path)))
    assert kv_points(run) == [] and 'id="kv"' not in render_report(run)


def test_the_widget_draws_the_picked_metric_and_axis(sweep_run):
    pytest.importorskip("anywidget")
    from headlab.widgets import KvTradeoff

    w = KvTradeoff(sweep_run.path)
    points = kv_points(sweep_run)
    assert w.metric == "rouge_l" and w.x == "kept_fraction"
    ys = sorted(c["_y"] for c in drawn(w.chart))
    assert ys == pytest.approx(sorted(p.metrics["rouge_l"] for p in points), rel=1e-9)
    w.metric_picker.value = "contains"
    w.x_picker.value = "kv_bytes"
    assert sorted((c["_x"], c["_y"]) for c in drawn(w.chart)) == \
        sorted((p.kv_bytes / 2 ** 20, p.metrics["contains"]) for p in points)
    assert figures.figure_spec(w.chart) == figures.figure_spec(kv_tradeoff_chart(points, "contains", x="kv_bytes"))
    assert f'<td class="num">{points[0].kv_bytes}</td>' in w.table.value
    with pytest.raises(ValueError, match="no step with a kv policy stores metric 'exact_match'"):
        KvTradeoff(sweep_run, metric="exact_match")


def test_the_browser_adds_the_kv_tradeoff_after_the_steps(sweep_run):
    pytest.importorskip("anywidget")
    from headlab.widgets import HeadMap, KvTradeoff, RunBrowser, run_views, step_view

    views = run_views(sweep_run)
    assert [step for step in sweep_run.results if step_view(sweep_run, step) is not None] == ["ind"]
    heads, tradeoff = views  # the detect step's map, then the trade-off (generate steps take no figure)
    assert isinstance(heads, HeadMap) and isinstance(tradeoff, KvTradeoff)
    assert len(tradeoff.points) == len(kv_points(sweep_run))
    _, figures, _ = RunBrowser(sweep_run.path.parent).select([sweep_run]).detail.children
    assert len(figures.children) == 2 and isinstance(figures.children[0], HeadMap)
    assert isinstance(figures.children[1], KvTradeoff)
