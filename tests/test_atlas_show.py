"""An atlas run (a cube with its causal check and a comparison) read back by ``headlab show``, the run summary,
the notebook's run block and the report: one row per detector whose top head, score, threshold, heads labelled
and causal status equal the stored cube's, computed here; the report's roles grid, top-heads table, causal chart
and change grid carry the cube's numbers."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

import headlab
from headlab.cli import app
from headlab.display import run_html
from headlab.report import render_report

from fixtures.detectors import build_models, tiny_config, word_tokenizer
from fixtures.figures import embedded, rows

DETECTORS = ["previous_token", "induction", "attention_sink"]


@pytest.fixture(scope="module")
def atlas_run(tmp_path_factory):
    """One run of an ``atlas`` step on a saved tiny random GQA Llama A (2 layers, 4 heads), with the causal check
    and ``compare`` against B, A with head L0H1's query rows zeroed (uniform attention)."""
    root = tmp_path_factory.mktemp("atlas-show")
    tok = word_tokenizer()
    lm, _ = build_models(tiny_config(len(tok), hidden_size=32, initializer_range=0.2), seed=0, tokenizer=tok,
                         impls=("headlab",))
    paths = {name: root / name for name in ("A", "B")}
    lm.model.save_pretrained(paths["A"])
    tok.save_pretrained(paths["A"])
    with torch.no_grad():
        lm.model.model.layers[0].self_attn.q_proj.weight[8:16] = 0
    lm.model.save_pretrained(paths["B"])
    tok.save_pretrained(paths["B"])
    spec = {"name": "atlas", "model": {"path": str(paths["A"])}, "seed": 0,
            "task": {"kind": "repeated_tokens", "n": 2, "length": 4},
            "steps": [{"id": "atlas", "atlas": {"detectors": DETECTORS, "tokens": 12, "n": 2, "null": "none",
                                                "causal": {"k": 1, "draws": 2, "batch_size": 4},
                                                "compare": str(paths["B"])}}]}
    return headlab.run(spec, out=str(root / "runs"))


def expected(cube) -> dict[str, dict]:
    """Per detector, from the stored cube: the top head (highest score, ties by layer then head), its score, the
    threshold, how many heads it labels and the causal check's status."""
    out = {}
    for d in DETECTORS:
        score = cube["score"].sel(detector=d).transpose("layer", "head").values
        flat = np.where(np.isnan(score), -np.inf, score)
        layer, head = min(np.ndindex(flat.shape), key=lambda lh: (-flat[lh], lh))
        out[d] = {"top": f"L{layer}H{head}", "score": float(score[layer, head]),
                  "threshold": float(cube["threshold"].sel(detector=d)),
                  "labelled": int(cube["label"].sel(detector=d).sum()), "heads": score.size,
                  "causal": str(cube["causal_status"].sel(detector=d).values)}
    return out


def test_the_summary_has_a_row_per_detector_with_the_cubes_numbers(atlas_run):
    cube = atlas_run.results["atlas"]
    want = expected(cube)
    assert {"causal_status", "score_diff"} <= set(cube.data_vars)
    assert len({w["top"] for w in want.values()} | {round(w["score"], 6) for w in want.values()}) > 2
    info = atlas_run.summary()["atlas"]
    assert "top" not in info  # no mean over detectors
    assert [r["detector"] for r in info["detectors"]] == DETECTORS
    for r in info["detectors"]:
        w = want[r["detector"]]
        t = r["top"][0]
        assert f"L{t['layer']}H{t['head']}" == w["top"] and t["score"] == pytest.approx(w["score"], abs=1e-12)
        assert r["threshold"] == pytest.approx(w["threshold"]) and r["labelled"] == w["labelled"]
        assert r["heads"] == w["heads"] and r["causal"] == w["causal"]
    rows = headlab.summary_rows(atlas_run)
    assert [r.step for r in rows] == ["atlas"] * len(DETECTORS)
    for r, d in zip(rows, DETECTORS, strict=True):
        w = want[d]
        assert r.metric == (f"{d}: top head {w['top']}, {w['labelled']}/{w['heads']} labelled (threshold "
                            f"{w['threshold']:.3f}), causal: {w['causal']}")
        assert r.value == f"{w['score']:.3f}" and r.note is None
    html = run_html(atlas_run)
    for d in DETECTORS:
        assert f"{d} {want[d]['top']} {want[d]['score']:.3f}" in html


def test_headlab_show_prints_a_row_per_detector_and_a_table_with_steps(atlas_run):
    want = expected(atlas_run.results["atlas"])
    res = CliRunner().invoke(app, ["show", str(atlas_run.path), "--steps"], env={"COLUMNS": "240"})
    assert res.exit_code == 0, res.output
    text = res.output
    for d, w in want.items():
        line = next(x for x in text.splitlines() if f"{d}: top head" in x)
        assert line.rstrip().endswith(f"{w['score']:.3f}") and f"causal: {w['causal']}" in line
        row = next(x for x in text.splitlines() if f"{w['top']} {w['score']:.4f}" in x)  # the per-detector table
        assert d in row and f"{w['labelled']}/{w['heads']}" in row and f"{w['threshold']:.4g}" in row, row
    narrow = CliRunner().invoke(app, ["show", str(atlas_run.path)], env={"COLUMNS": "80"}).output
    assert max(len(x) for x in narrow.splitlines()) <= 80 and narrow.count("top head") == len(DETECTORS), narrow


def test_the_report_shows_the_grid_top_heads_causal_chart_and_change_grid(atlas_run):
    cube = atlas_run.results["atlas"]
    page = render_report(atlas_run)
    figs = dict(embedded(page))
    assert {"atlas: roles", "atlas: score per detector", "atlas: causal check", "atlas: changes"} <= set(figs)
    assert "top 5 heads per role" in page and "heads that gained or lost a role" in page
    bars = {b["bar"]: b for b in rows(figs["atlas: causal check"])}
    measured = [d for d in DETECTORS if np.isfinite(float(cube["effect"].sel(detector=d)))]
    assert measured
    for d in measured:
        c = cube.sel(detector=d)
        assert bars[f"{d}: top 1 labelled"]["value"] == pytest.approx(float(c["effect"]))
        assert bars[f"{d}: random"]["value"] == pytest.approx(float(c["control_effect"].mean()))
        verdict = "supported" if bool(c["supported"]) else "NOT supported"
        assert bars[f"{d}: top 1 labelled"]["note"] == verdict
    changes = rows(figs["atlas: changes"])
    assert len(changes) == cube["score_diff"].size
    for r in changes:
        one = cube.sel(detector=r["detector"], layer=r["layer"], head=r["head"])
        b_minus_a = float(one["score_b"]) - float(one["score"])
        assert r["score_diff"] == pytest.approx(b_minus_a, abs=1e-9)
        assert r["label_change"] == int(bool(one["label_b"])) - int(bool(one["label"]))
    moved = {(r["layer"], r["head"]) for r in changes if abs(r["score_diff"]) > 1e-6}
    assert moved and {la for la, _ in moved} <= {0, 1} and (0, 1) in moved  # the edited head's scores moved
    lost = json.loads(cube.attrs["lost"])
    for d in DETECTORS:
        if lost[d]:
            assert ", ".join(lost[d]) in page
