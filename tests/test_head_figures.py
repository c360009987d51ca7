"""The figures of head rankings (headlab.head_figures) in the report and the notebook: each layer's heads sorted by
accuracy with chance marked, a masking curve beside its controls, and a metric against one of two numeric sweep
keys with a line per value of the other. Each figure's Vega-Lite data is checked against the run's numbers."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import xarray as xr

import headlab
from headlab.head_figures import has_chance, is_masking_curve, masking_curve_chart, ranked_accuracy_chart
from headlab.report import render_report, report_figures
from headlab.widgets import HeadMap

from fixtures.figures import embedded, rows
from fixtures.specs import spec_text


def _layer(spec: dict) -> dict:
    return next(layer for layer in spec["layer"] if layer.get("mark", {}).get("type", layer.get("mark")) == "rect"
                and "color" in layer["encoding"] and "field" in layer["encoding"]["color"])


def _check_sorted_map(spec: dict, score: xr.DataArray, chance: float) -> None:
    """Per layer, the ranks carry the scores sorted from highest (np.sort), each cell names the head whose
    score it shows, and the colour scale is centred at chance."""
    data = rows(spec)
    for layer in score["layer"].values.tolist():
        cells = sorted((r for r in data if r["layer"] == layer), key=lambda r: r["rank"])
        got = np.array([np.nan if r["accuracy"] is None else r["accuracy"] for r in cells])
        want = np.sort(score.sel(layer=layer).values)[::-1]
        want = np.concatenate([want[np.isfinite(want)], want[~np.isfinite(want)]])
        np.testing.assert_array_equal(got, want)
        assert sorted(r["head"] for r in cells) == list(range(score.sizes["head"]))
        for r in cells:
            if r["accuracy"] is not None:
                assert r["accuracy"] == float(score.sel(layer=layer, head=r["head"]))
    scale = _layer(spec)["encoding"]["color"]["scale"]
    assert scale["domainMid"] == chance and np.mean(scale["domain"]) == pytest.approx(chance)


def test_sorted_accuracy_map_keeps_head_indices_ties_nan_and_centres_at_chance():
    values = np.array([[0.5, 0.75, 0.75, np.nan], [0.25, 1.0, 0.5, 0.6]])
    std = np.arange(8, dtype=float).reshape(2, 4) / 100
    ds = xr.Dataset({"score": (("layer", "head"), values), "accuracy_std": (("layer", "head"), std)},
                    coords={"layer": [0, 1], "head": [0, 1, 2, 3]}, attrs={"chance": 0.4})
    assert has_chance(ds) and not has_chance(ds.assign_attrs(chance="x"))
    spec = ranked_accuracy_chart(ds).to_dict()
    _check_sorted_map(spec, ds["score"], 0.4)
    data = rows(spec)
    layer0 = [(r["rank"], r["head"], r["accuracy"]) for r in data if r["layer"] == 0]
    assert layer0 == [(0, 1, 0.75), (1, 2, 0.75), (2, 0, 0.5), (3, 3, None)]  # a tie: the lower head first
    assert all(r["accuracy_std"] == std[r["layer"], r["head"]] for r in data)
    assert max(abs(d - 0.4) for d in _layer(spec)["encoding"]["color"]["scale"]["domain"]) == pytest.approx(0.6)


def test_masking_curve_chart_draws_the_three_curves_from_the_unmasked_metric_with_the_random_band():
    fraction = [0.25, 0.5, 1.0]
    random = np.array([[0.8, 0.4, 0.0], [0.6, 0.2, 0.0]])
    ds = xr.Dataset({"base": ((), 0.9), "metric": ("fraction", [0.9, 0.7, 0.0]), "reverse": ("fraction", [0.3, 0.1, 0.0]),
                     "random": (("draw", "fraction"), random), "random_mean": ("fraction", random.mean(0)),
                     "random_std": ("fraction", random.std(0, ddof=1))},
                    coords={"fraction": fraction, "draw": [0, 1]},
                    attrs={"config": json.dumps({"measure": {"generate": {"metrics": ["needle_recall"]}}})})
    assert is_masking_curve(ds) and not is_masking_curve(ds.drop_vars("random_std"))
    spec = masking_curve_chart(ds).to_dict()
    data = rows(spec)
    curves: dict[str, list[tuple[float, float]]] = {}
    for r in data:
        curves.setdefault(r["order"], []).append((r["x"], r["y"]))
    ranking, reverse, rand = curves.values()
    assert ranking == list(zip([0.0, *fraction], [0.9, 0.9, 0.7, 0.0], strict=True))
    assert reverse == list(zip([0.0, *fraction], [0.9, 0.3, 0.1, 0.0], strict=True))
    assert [y for _, y in rand] == pytest.approx([0.9, 0.7, 0.3, 0.0])
    band = [(r["low"], r["high"]) for r in data if "low" in r]
    spread = random.std(0, ddof=1)
    np.testing.assert_allclose(band, [(0.9, 0.9), *zip(random.mean(0) - spread, random.mean(0) + spread, strict=True)])
    wide = rows(masking_curve_chart(ds.assign(random_std=ds["random_std"] * 10)).to_dict())
    assert [r["low"] for r in wide if "low" in r] == pytest.approx([0.9, 0.0, 0.0, 0.0])  # never-negative metric
    assert {r["order"] for r in wide} >= {"random ranking (mean of 2, ±1 std cut at 0)"}
    line = next(layer for layer in spec["layer"] if layer["mark"]["type"] == "line")
    assert line["encoding"]["y"]["scale"]["zero"] is True and line["encoding"]["y"]["title"] == "needle_recall"


PROBE_STEPS = ("  - id: pr\n    detect: {kind: probe, label: truth, group: context, folds: 2, seed: 0}\n"
               "  - id: curve\n    prune_curve: {heads: {from: pr}, measure: {generate: {max_new_tokens: 1, "
               "metrics: [contains]}}, fractions: [0.5, 1.0], n_random: 2}\n")


@pytest.fixture(scope="module")
def probe_run(tmp_path_factory):
    """A probe step and a masking curve ranked by it, on 8 statements of specs/data/kv_membership.jsonl (the
    embedded model)."""
    out = tmp_path_factory.mktemp("runs")
    source = Path(__file__).resolve().parents[1] / "specs" / "data" / "kv_membership.jsonl"
    records = [json.loads(x) for x in source.read_text(encoding="utf-8").splitlines()[:8]]
    data = out / "statements.jsonl"
    data.write_text("".join(json.dumps({**r, "answer": r["text"].split()[-1]}) + "\n" for r in records),
                    encoding="utf-8")
    return headlab.run(f"name: figs\nmodel: headlab-tiny\noutput: {out}\n"
                       f'task: {{kind: jsonl, path: {data}, prompt: "{{{{ text }}}}", target: "{{{{ answer }}}}", '
                       f"meta: [truth, context]}}\nsteps:\n{PROBE_STEPS}")


def test_report_shows_the_sorted_accuracy_map_and_the_masking_curve_of_a_run(probe_run, tmp_path):
    pr, curve = probe_run.results["pr"], probe_run.results["curve"]
    page = render_report(probe_run)
    figures = dict(embedded(page))
    _check_sorted_map(figures["pr: accuracy sorted per layer"], pr["score"], pr.attrs["chance"])
    data = rows(figures["curve: masking curve"])
    by_order: dict[str, list[float]] = {}
    for r in data:
        by_order.setdefault(r["order"], []).append(r["y"])
    base = float(curve["base"])
    assert list(by_order.values()) == [[base, *curve[v].values.tolist()] for v in ("metric", "reverse", "random_mean")]
    assert "heads sorted by accuracy within each layer" in page and 'id="step-curve"' in page
    names = [f.name for f in report_figures(probe_run)]
    assert "pr: accuracy sorted per layer" in names and "curve: masking curve" in names
    # the notebook: HeadMap of the step draws the same figure
    hm = HeadMap.from_run(probe_run, "pr")
    assert hm.chance == pr.attrs["chance"]
    _check_sorted_map(hm.sorted_chart().to_dict(), pr["score"], pr.attrs["chance"])
    with pytest.raises(ValueError, match="chance"):
        HeadMap(pr["score"].values).sorted_chart()


def test_a_sweep_over_two_numeric_keys_plots_the_metric_against_one_with_a_line_per_value_of_the_other(tmp_path):
    steps = "  - id: gen\n    generate: {max_new_tokens: 2, metrics: [contains]}\n"
    run = headlab.run(spec_text(steps, task="{kind: repeated_tokens, n: 3, length: 5}",
                                sweep="  task.length: [5, 7, 9]\n  task.n: [2, 3]\n", out=str(tmp_path)))
    figures = dict(embedded(render_report(run)))
    spec = figures["contains vs task.length, a line per task.n"]
    field = "task\u2024n"  # dots in a field name would be read as nested fields
    assert next(layer for layer in spec["layer"] if "color" in layer.get("encoding", {}))["encoding"]["color"][
        "field"] == field
    got = {(r[field], r["x"]): r["y"] for r in rows(spec)}
    metric = run.results["gen"]["contains"]
    want = {(str(n), length): float(metric.sel({"task.length": length, "task.n": n}).mean())
            for n in (2, 3) for length in (5, 7, 9)}
    assert got == pytest.approx(want)
