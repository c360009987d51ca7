"""Metric vs KV cache in ``headlab report`` and the ``KvTradeoff`` widget: the points of a constructed run's
steps with a ``kv`` policy (one per step and sweep cell) carry the run's kept fractions, bytes and metric
means, and the scatter plot draws them where its axes say."""

from __future__ import annotations

import math
from html.parser import HTMLParser

import numpy as np
import pytest

import headlab
from headlab.kv_view import kv_metrics, kv_points, kv_table_rows, kv_tradeoff_svg
from headlab.report import render_report, scatter_svg

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


class Tags(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict[str, str | None]]] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))


def circles(svg: str) -> list[dict[str, str | None]]:
    p = Tags()
    p.feed(svg)
    return [a for t, a in p.tags if t == "circle" and "data-x" in a]


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


def test_the_scatter_plot_places_every_point_on_its_axes(sweep_run):
    points = kv_points(sweep_run)
    svg = kv_tradeoff_svg(points, "rouge_l")
    drawn = circles(svg)
    assert [(c["data-series"], c["data-label"]) for c in drawn] == [
        ("streaming", "gen (gen.kv.window=6)"), ("streaming", "gen (gen.kv.window=12)"),
        *[("random", f"ctl (gen.kv.window={w})") for w in (6, 12)],  # equal x: in sweep order
        ("full", "base (gen.kv.window=6)"), ("full", "base (gen.kv.window=12)")]
    by_label = {p.label: p for p in points}
    for c in drawn:
        p = by_label[c["data-label"]]
        assert float(c["data-x"]) == pytest.approx(p.kept_fraction, rel=1e-5)
        assert float(c["data-y"]) == pytest.approx(p.metrics["rouge_l"], rel=1e-5)
    # x on [0, 1.05] over the plot's 396 pixels from x=52: a point's cx is where its kept fraction is
    for c in drawn:
        assert float(c["cx"]) == pytest.approx(52 + float(c["data-x"]) / 1.05 * 396, abs=0.1)
    by_bytes = circles(kv_tradeoff_svg(points, "contains", x="kv_bytes"))
    assert sorted(float(c["data-x"]) for c in by_bytes) == pytest.approx(sorted(p.kv_bytes for p in points))
    assert "contains vs KV bytes held" in kv_tradeoff_svg(points, "contains", x="kv_bytes")


def test_scatter_joins_a_series_in_order_of_x_and_drops_non_finite_points():
    svg = scatter_svg({"a": [(0.5, 1.0, "p"), (0.0, 0.0, "q"), (1.0, math.nan, "r")], "b": [(1.0, 0.5, "s")]},
                      xlim=(0.0, 1.0), ylim=(0.0, 1.0), width=152, height=150)
    drawn = circles(svg)
    assert [(c["data-label"], c["data-x"], c["data-y"]) for c in drawn] == [("q", "0", "0"), ("p", "0.5", "1"),
                                                                           ("s", "1", "0.5")]
    # plot area: x 52..140 (88 px), y 10..110 (100 px, no title)
    assert [(float(c["cx"]), float(c["cy"])) for c in drawn] == [(52.0, 110.0), (96.0, 10.0), (140.0, 60.0)]
    assert 'points="52.0,110.0 96.0,10.0"' in svg  # series a joined from low x to high x


def test_the_report_has_the_kv_section(sweep_run):
    html = render_report(sweep_run)
    section = html.split('id="kv"')[1].split("</section>")[0]
    points = kv_points(sweep_run)
    drawn = circles(section)
    assert len(drawn) == 2 * 2 * len(points)  # rouge_l and contains, each vs kept fraction and vs bytes
    for p in points:
        row = (f"<td>{p.step}</td><td>{', '.join(f'{k}={v}' for k, v in p.cell.items())}</td><td>{p.policy}</td>"
               f'<td class="num">{p.kv_bytes}</td><td class="num">{p.kv_bytes_full}</td>'
               f'<td class="num">{p.kept_fraction:.4g}</td>')
        assert row in section
    assert "rouge_l vs kept fraction of the full KV cache" in section


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
    ys = sorted(float(c["data-y"]) for c in circles(w.figure.value))
    assert ys == pytest.approx(sorted(p.metrics["rouge_l"] for p in points), rel=1e-5)
    w.metric_picker.value = "contains"
    w.x_picker.value = "kv_bytes"
    drawn = circles(w.figure.value)
    assert sorted((int(c["data-x"]), float(c["data-y"])) for c in drawn) == \
        sorted((p.kv_bytes, p.metrics["contains"]) for p in points)
    assert f'<td class="num">{points[0].kv_bytes}</td>' in w.table.value
    with pytest.raises(ValueError, match="no step with a kv policy stores metric 'exact_match'"):
        KvTradeoff(sweep_run, metric="exact_match")
    np.testing.assert_equal(len(circles(w.figure.value)), len(points))


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
