"""The runner and the zarr store: results, provenance, sweeps, interruption and resume."""

from __future__ import annotations

import json

import numpy as np
import pytest
import xarray as xr

import headlab

from fixtures.cli import run as run_cli
from fixtures.specs import spec_text

STEPS = """  - id: prev
    detect: {kind: previous_token}
  - id: ind
    detect: {kind: induction, exclude_bos: true}
"""


def test_run_writes_a_store_that_xarray_reads(tmp_path):
    run = headlab.run(spec_text(STEPS), out=tmp_path)
    assert run.status == "complete" and run.cells_done == run.cells_total == 1
    score = run.results["ind"]["score"]
    assert score.dims == ("layer", "head") and score.shape == (2, 4)
    assert run.results["ind"]["example_score"].dims == ("example", "layer", "head")
    direct = xr.open_zarr(str(run.path), group="cells/c0000/ind", consolidated=False)
    np.testing.assert_allclose(direct["score"].values, score.values)
    # examples are stored with their token ids so every number traces back to its input
    ds = run.results["prev"]
    assert ds["input_ids"].dims == ("example", "token") and ds.sizes["example"] == 4
    ids = ds["input_ids"].values
    assert (ids[:, -16:-8] == ids[:, -8:]).all()  # the random segment is repeated
    reopened = headlab.open_run(run.path)
    xr.testing.assert_identical(reopened.results["ind"], run.results["ind"])


def test_provenance_attributes(tmp_path):
    run = headlab.run(spec_text(STEPS), out=tmp_path)
    attrs = run.attrs
    for key in ("spec_text", "resolved", "headlab_version", "torch_version", "transformers_version",
                "model", "model_digest", "device", "dtype", "seed", "created", "finished"):
        assert key in attrs, key
    assert attrs["model_digest"].startswith("sha256:")
    assert "previous_token" in attrs["spec_text"]
    assert json.loads(attrs["resolved"])["steps"][0]["id"] == "prev"


def test_sweep_becomes_dimensions(tmp_path):
    sweep = "  task.length: [4, 6]\n  ind.error_measure: [mul, abs]\n"
    run = headlab.run(spec_text(STEPS, sweep=sweep), out=tmp_path)
    score = run.results["ind"]["score"]
    assert set(score.dims) == {"layer", "head", "task.length", "ind.error_measure"}
    assert list(score["task.length"].values) == [4, 6]
    one = headlab.run(spec_text(STEPS).replace("length: 8", "length: 6").replace(
        "{kind: induction, exclude_bos: true}", "{kind: induction, exclude_bos: true, error_measure: abs}"),
        out=tmp_path)
    np.testing.assert_allclose(score.sel({"task.length": 6, "ind.error_measure": "abs"}).values,
                               one.results["ind"]["score"].values)


def test_cells_of_different_sizes_combine_with_typed_padding(tmp_path):
    """A sweep over the number of examples: every step's cells combine (strings padded with "", integers with
    -1, floats with NaN), and show/report read the run."""
    steps = "  - id: gen\n    generate: {max_new_tokens: 2, metrics: [exact_match]}\n" + STEPS
    run = headlab.run(spec_text(steps, sweep="  task.n: [2, 3]\n"), out=tmp_path)
    gen = run.results["gen"]
    assert gen.sizes["example"] == 3 and gen["output"].dims == ("task.n", "example")
    assert list(gen["output"].sel({"task.n": 2}).values[2:]) == [""]  # the missing third example
    assert all(isinstance(o, str) and o for o in gen["output"].sel({"task.n": 3}).values)
    assert (gen["input_ids"].sel({"task.n": 2}).values[2] == -1).all()
    assert np.isnan(gen["exact_match"].sel({"task.n": 2}).values[2])
    assert run.results["ind"]["example_score"].sizes["example"] == 3
    rows = run.summary()["gen"]["cells"]
    assert [r["cell"] for r in rows] == [{"task.n": 2}, {"task.n": 3}]
    from headlab.report import render_report

    assert "gen" in render_report(run)


def test_interrupt_then_resume_equals_uninterrupted(tmp_path):
    text = spec_text(STEPS, sweep="  task.length: [3, 4, 5, 6]\n")
    full = headlab.run(text, out=tmp_path / "full")

    class Stop(Exception):
        pass

    def stop_after_two(cell):
        if cell.index == 1:
            raise Stop

    with pytest.raises(Stop):
        headlab.run(text, out=tmp_path / "part", on_cell=stop_after_two)
    (partial_path,) = (tmp_path / "part").iterdir()
    partial = headlab.open_run(partial_path)
    assert partial.status == "interrupted" and partial.cells_done == 2
    assert partial.results["ind"].sizes["task.length"] == 2  # finished cells are usable
    seen = []
    resumed = headlab.run(None, resume=partial_path, on_cell=lambda c: seen.append(c.index))
    assert seen == [2, 3]  # finished cells are not redone
    assert resumed.status == "complete"
    for step in ("prev", "ind"):
        xr.testing.assert_allclose(resumed.results[step], full.results[step])


def test_generate_step_outputs_and_metrics(tmp_path):
    steps = """  - id: gen
    generate:
      max_new_tokens: 3
      metrics: [exact_match, contains]
"""
    run = headlab.run(spec_text(steps), out=tmp_path)
    ds = run.results["gen"]
    assert ds["output"].dims == ("example",) and ds.sizes["example"] == 4
    assert set(ds.attrs["metrics"]) == {"exact_match", "contains"}
    # targets are empty for repeated_tokens: contains("") is 1, exact match of a non-empty output is 0
    assert ds["contains"].values.tolist() == [1.0] * 4
    summary = run.summary()["gen"]
    assert summary["metrics"]["contains"] == 1.0 and summary["kind"] == "generate"
    # the generated token ids are stored too (no tokenizer here: the output text is the ids joined)
    assert ds["output_ids"].dims == ("example", "step")
    for ids, text in zip(ds["output_ids"].values, ds["output"].values, strict=True):
        assert " ".join(str(i) for i in ids if i >= 0) == text


def test_list_runs(tmp_path):
    headlab.run(spec_text(STEPS), out=tmp_path)
    headlab.run(spec_text(STEPS), out=tmp_path)
    runs = headlab.list_runs(tmp_path)
    assert len(runs) == 2 and all(r.status == "complete" for r in runs)
    assert "headlab run" in runs[0]._repr_html_()


def test_one_malformed_or_newer_run_hides_no_other(tmp_path):
    import shutil

    good = headlab.run(spec_text(STEPS), out=tmp_path).path
    for name, change in [("bad", {"cells_total": "many", "sweep": [1, 2], "created": {"x": 1}}),
                         ("newer", {"format": "headlab-run/2"})]:
        shutil.copytree(good, tmp_path / name)
        meta = json.loads((tmp_path / name / "zarr.json").read_text())
        meta["attributes"].update(change)
        (tmp_path / name / "zarr.json").write_text(json.dumps(meta))
    runs = {r.path.name: r for r in headlab.list_runs(tmp_path)}
    assert runs[good.name].status == "complete"
    assert runs["bad"].status.startswith("damaged: ")
    assert runs["newer"].status == "newer format (headlab-run/2): upgrade headlab"
    with pytest.raises(headlab.results.RunFormatTooNew, match="format headlab-run/2, newer than this headlab"):
        headlab.open_run(tmp_path / "newer")
    listing = run_cli("runs", str(tmp_path), cwd=tmp_path)
    assert listing.returncode == 0 and good.name in listing.stdout and "newer format" in listing.stdout
    shown = run_cli("show", str(tmp_path / "newer"), cwd=tmp_path)
    assert shown.returncode == 2 and "upgrade headlab to read it" in shown.stderr and "Traceback" not in shown.stderr


def test_generate_stores_the_strategy_diagnostics(tmp_path):
    """DeCoRe's masked heads (here drawn at random) and per-step alpha, DoLa's chosen layers: stored with the
    outputs over named dimensions; alpha at step 0 equals the entropy of the model's next-token
    distribution, computed here from a plain forward of each prompt."""
    import torch

    from headlab.model import load_model
    from headlab.spec import ModelSpec

    from fixtures.specs import TINY_LLAMA

    steps = """  - id: decore
    generate:
      max_new_tokens: 4
      batch_size: 3
      decode: {kind: decore, heads: [[1, 0], [1, 2]], random: true, alpha: entropy}
  - id: dola
    generate:
      max_new_tokens: 4
      decode: {kind: dola, layers: [0, 1]}
"""
    run = headlab.run(spec_text(steps), out=tmp_path)
    ds = run.results["decore"]
    heads = ds["decode_heads"]
    assert heads.dims == ("layer", "head") and int(heads.sum()) == 2
    assert not bool(heads.sel(layer=1, head=0)) and not bool(heads.sel(layer=1, head=2))  # random: others
    assert ds["alpha"].dims == ("example", "step") and ds["alpha"].shape == (4, 4)
    lm = load_model(ModelSpec(config=TINY_LLAMA, device="cpu"))
    ids = ds["input_ids"].values
    for i in range(ids.shape[0]):
        row = torch.tensor(ids[i][ids[i] >= 0])[None]
        with torch.no_grad():
            p = lm.model(input_ids=row).logits[0, -1].double().softmax(-1)
        h = float(-(p * torch.log(p + 1e-12)).sum())
        assert abs(float(ds["alpha"][i, 0]) - h) < 1e-4
    dola = run.results["dola"]
    assert dola["premature_layer"].dtype == np.int64 and set(np.unique(dola["premature_layer"])) <= {0, 1, -1}
    assert dola.attrs["decode_candidate_layers"] == [0, 1]


def test_decode_info_pads_rows_after_their_last_token():
    from headlab.generation import decode_info
    from headlab.model import Geometry

    geo = Geometry(n_layers=2, n_heads=3, n_kv_heads=3, head_dim=4)
    parts = [({"alpha": [[0.1, 0.2], [0.3, 0.4], [0.5, 0.6]], "layer": [[1, 1], [0, 1], [1, 0]],
               "heads": [(1, 2)], "cands": [0, 1]}, [0, 3]),
             ({"alpha": [[0.7]], "layer": [[0]], "heads": [(1, 2)], "cands": [0, 1]}, [1])]
    arrays, attrs = decode_info(parts, geo)
    np.testing.assert_allclose(arrays["alpha"].values, [[0.1, np.nan, np.nan], [0.2, 0.4, 0.6],
                                                        [0.7, np.nan, np.nan]])
    assert arrays["layer"].values.tolist() == [[1, -1, -1], [1, 1, 0], [0, -1, -1]]
    assert arrays["decode_heads"].values.tolist() == [[False] * 3, [False, False, True]]
    assert attrs == {"decode_cands": [0, 1]}
