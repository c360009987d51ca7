"""The atlas's pictures and exports (docs/atlas.md): the exports read back equal to the cube (retrieval-head JSON
per detector, head cards as CSV and JSON, read here with json and csv), the report of an atlas run shows the
cube's figures with the cube's values, and ``headlab atlas-export`` writes a run's exports (bad input: one
located line, exit 2)."""

from __future__ import annotations

import csv
import json
import math

import numpy as np
import pytest

import headlab
from headlab.cli import main
from headlab.heads import read_heads_file
from headlab.plugins.atlas.export import CSV_NAME, JSON_NAME, write_exports
from headlab.report import render_report
from headlab.widgets import AtlasMap, hover_lines, step_view

from fixtures.figures import embedded
from fixtures.role_cubes import make_cube
from fixtures.specs import TINY_LLAMA


def _number(text: str) -> float:
    return float(text) if text != "" else math.nan


def test_exports_read_back_equal_to_the_cube(tmp_path):
    cube = make_cube(3, 5)
    paths = write_exports(cube, tmp_path / "out")
    names = list(cube["detector"].values)
    assert sorted(p.name for p in paths) == sorted([*(f"heads-{n}.json" for n in names), CSV_NAME, JSON_NAME])
    score, label, rank = cube["score"].values, cube["label"].values, cube["rank"].values
    for d, name in enumerate(names):
        text = (tmp_path / "out" / f"heads-{name}.json").read_text()
        assert text.count("\n") == 1  # one line: the reference reads it with json.loads(file.readline())
        data = json.loads(text.splitlines()[0])
        want = {f"{la}-{he}": [score[d, la, he]] for la in range(3) for he in range(5) if np.isfinite(score[d, la, he])}
        assert data == want
        order = sorted(want, key=lambda k: -want[k][0])[:4]  # what the reference's readers do: rank by mean
        assert read_heads_file(tmp_path / "out" / f"heads-{name}.json", top=4) == [
            tuple(int(x) for x in k.split("-")) for k in order]
    assert "1-2" not in json.loads((tmp_path / "out" / f"heads-{names[0]}.json").read_text())  # the NaN score

    with (tmp_path / "out" / CSV_NAME).open(newline="") as f:
        table = list(csv.DictReader(f))
    cards = json.loads((tmp_path / "out" / JSON_NAME).read_text())
    assert len(table) == len(cards) == 15
    for row, card in zip(table, cards, strict=True):
        la, he = int(row["layer"]), int(row["head"])
        assert (card["layer"], card["head"]) == (la, he)
        roles = [n for d, n in enumerate(names) if label[d, la, he]]
        assert row["roles"] == ";".join(roles) and card["roles"] == roles
        for d, name in enumerate(names):
            t = float(cube["threshold"].values[d])
            s = score[d, la, he]
            entry = card["detectors"][name]
            np.testing.assert_equal(_number(row[f"{name}:score"]), s)
            assert entry["score"] == (None if np.isnan(s) else s)
            assert row[f"{name}:label"] == ("true" if label[d, la, he] else "false") and entry["label"] == label[d, la, he]
            assert int(row[f"{name}:rank"]) == entry["rank"] == rank[d, la, he]
            assert float(row[f"{name}:threshold"]) == entry["threshold"] == t
            if np.isnan(s):
                assert row[f"{name}:margin"] == "" and entry["margin"] is None
            else:
                assert float(row[f"{name}:margin"]) == pytest.approx(s - t) and entry["margin"] == pytest.approx(s - t)


@pytest.fixture(scope="module")
def atlas_run(tmp_path_factory):
    spec = {"name": "atlas", "model": {"config": dict(TINY_LLAMA)},
            "task": {"kind": "repeated_tokens", "n": 2, "length": 4},
            "steps": [{"id": "atlas", "atlas": {"detectors": ["previous_token", "induction", "attention_sink"],
                                                "tokens": 8, "n": 2, "null": "none"}}]}
    return headlab.run(spec, out=str(tmp_path_factory.mktemp("atlas")))


def test_the_report_of_an_atlas_run_shows_the_cube(atlas_run):
    cube = atlas_run.results["atlas"]
    page = render_report(atlas_run)
    figs = dict(embedded(page))
    assert {"atlas: roles", "atlas: score per detector"} <= set(figs)
    panels = figs["atlas: score per detector"]["data"]["values"]
    assert len(panels) == cube["score"].size
    for r in panels:
        one = cube.sel(detector=r["detector"], layer=r["layer"], head=r["head"])
        assert r["score"] == pytest.approx(float(one["score"])) and r["label"] == bool(one["label"])
    roles = figs["atlas: roles"]["data"]["values"]
    for (la, he), rs in {(r["layer"], r["head"]): r["roles"] for r in roles}.items():
        want = [str(n) for n in cube["detector"].values if bool(cube["label"].sel(detector=n, layer=la, head=he))]
        assert rs == (", ".join(want) or "none")
    assert "top 5 heads per role" in page and 'id="step-atlas"' in page
    view = step_view(atlas_run, "atlas")  # the notebook's figure of the same step
    assert isinstance(view, AtlasMap) and view.tips[1][2] == hover_lines(cube, 1, 2)


def test_atlas_export_command(atlas_run, tmp_path, capsys):
    main(["atlas-export", str(atlas_run.path), "--out", str(tmp_path / "x")])
    printed = capsys.readouterr().out.split()
    cube = atlas_run.results["atlas"]
    assert sorted(printed) == sorted(str(tmp_path / "x" / n) for n in [
        *(f"heads-{d}.json" for d in cube["detector"].values), CSV_NAME, JSON_NAME])
    data = json.loads((tmp_path / "x" / "heads-induction.json").read_text())
    assert data == {f"{la}-{he}": [float(cube["score"].sel(detector="induction", layer=la, head=he))]
                    for la in cube["layer"].values for he in cube["head"].values}
    with pytest.raises(SystemExit) as e:
        main(["atlas-export", str(atlas_run.path), "--out", str(tmp_path / "y"), "--step", "nope"])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and "Traceback" not in err
    assert [line for line in err.splitlines() if line.startswith("error:")] == [
        f"error: RUN {atlas_run.path}: no step 'nope' with a head cube (score and label over detector, layer, "
        "head); its steps: atlas"]
