"""The spec DSL: validation, located one-line errors, sweeps, overrides, JSON Schema."""

from __future__ import annotations

import pytest

import headlab
from headlab.spec import SpecError, format_path, set_path

from fixtures.specs import spec_text

STEPS = """  - id: ind
    detect:
      kind: induction
      exclude_bos: true
  - id: gen
    generate:
      max_new_tokens: 4
      metrics: [exact_match]
"""
BASE = spec_text(STEPS)


def error_of(text: str) -> SpecError:
    with pytest.raises(SpecError) as info:
        headlab.load_spec(text)
    return info.value


def test_valid_spec_loads_with_defaults():
    loaded = headlab.load_spec(BASE)
    spec = loaded.spec
    assert [s.id for s in spec.steps] == ["ind", "gen"]
    assert spec.steps[0].detect.kind == "induction" and spec.steps[0].detect.exclude_bos is True
    assert spec.steps[1].generate.decode.kind == "greedy"
    assert spec.steps[1].generate.metrics[0].kind == "exact_match"
    assert spec.output == "./headlab-runs" and spec.seed == 0
    assert len(loaded.cells) == 1


def test_model_string_and_default_model():
    spec = headlab.load_spec(BASE.replace(BASE.splitlines()[1], "model: some/model-id")).spec
    assert spec.model.id == "some/model-id" and spec.model.trust_remote_code is False
    no_model = "\n".join(line for line in BASE.splitlines() if not line.startswith("model:"))
    assert headlab.load_spec(no_model).spec.model.id == "headlab-tiny"


@pytest.mark.parametrize("mutate, where, message", [
    (lambda t: t.replace("exclude_bos", "exclude_bso"), "<spec>:8:7: steps[0].detect.exclude_bso",
     "did you mean 'exclude_bos'"),
    (lambda t: t.replace("exclude_bos: true", "exclude_bos: maybe"), "<spec>:8:7: steps[0].detect.exclude_bos",
     "valid boolean"),
    (lambda t: t.replace("kind: induction", "kind: inductoin"), "<spec>:6:5: steps[0].detect",
     "unknown detector kind 'inductoin' (did you mean 'induction'?)"),
    (lambda t: t.replace("n: 4,", "n: [4,"), "<spec>:3:", "expected ',' or ']'"),
    (lambda t: t.replace("name: test\n", "name: test\nname: again\n"), "<spec>:2:1", 'duplicate key "name"'),
    (lambda t: t.replace("name: test", "nmae: test"), "<spec>:1:1: nmae", "did you mean 'name'"),
    (lambda t: t.replace("[exact_match]", "[exact_mtch]"), "<spec>:12:17: steps[1].generate.metrics[0]",
     "unknown metric kind"),
    (lambda t: t + "sweep:\n  gen.decode.temprature: [1]\n", "<spec>:14:3: sweep.gen.decode.temprature",
     "unknown key 'temprature'"),
    (lambda t: t + "sweep:\n  nostep.x: [1]\n", "<spec>:14:3: sweep.nostep.x", "bad sweep path"),
    (lambda t: t + "sweep:\n  task.n: [1, abc]\n", "<spec>:14:3: sweep.task.n", "valid integer"),
    (lambda t: t.replace("name: test", "name: !!python/object/apply:os.system [ls]"), "<spec>:1:1: name",
     "not allowed"),
    (lambda t: t.replace("max_new_tokens: 4", "max_new_tokens: -4"),
     "<spec>:11:7: steps[1].generate.max_new_tokens", "greater than or equal to 1"),
    (lambda t: t.replace("  - id: gen\n", "  - id: ind\n"), "<spec>:4:1: steps", "duplicate step id 'ind'"),
])
def test_malformed_specs_give_one_located_line(mutate, where, message):
    err = str(error_of(mutate(BASE)))
    assert "\n" not in err
    assert err.startswith(where), err
    assert message in err, err


def test_bad_reference_to_step_id_is_located():
    steer = "      steer: [{kind: head_mask, heads: {from: %s, top: 2}}]\n"
    assert headlab.load_spec(BASE + steer % "ind")
    err = str(error_of(BASE + steer % "indd"))
    assert err.startswith("<spec>:13:41: steps[1].generate.steer[0].heads.from"), err
    assert "'indd' is no step" in err and "did you mean 'ind'" in err
    later = BASE + steer % "gen"
    assert "'gen' is a later step" in str(error_of(later))


def test_spec_file_errors_name_the_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(BASE.replace("exclude_bos", "exclude_bso"))
    assert str(error_of(path)).startswith(f"{path}:8:7:")
    assert "no such spec file" in str(error_of(tmp_path / "missing.yaml"))


def test_sweep_expands_grid_and_applies_values():
    text = BASE + "sweep:\n  task.length: [4, 6]\n  ind.error_measure: [mul, abs]\n"
    loaded = headlab.load_spec(text)
    cells = loaded.cells
    assert [c.as_dict() for c in cells] == [
        {"task.length": 4, "ind.error_measure": "mul"}, {"task.length": 4, "ind.error_measure": "abs"},
        {"task.length": 6, "ind.error_measure": "mul"}, {"task.length": 6, "ind.error_measure": "abs"}]
    spec = loaded.for_cell(cells[3])
    assert spec.task.length == 6 and spec.steps[0].detect.error_measure == "abs"


def test_set_path_and_overrides():
    data = headlab.load_spec(BASE).data
    assert set_path(data, "gen.max_new_tokens", 9)["steps"][1]["generate"]["max_new_tokens"] == 9
    assert set_path(data, "seed", 3)["seed"] == 3
    assert "seed" not in data  # set_path copies: the original data is untouched
    loaded = headlab.load_spec(BASE).with_overrides({"task.n": 2, "gen.decode.kind": "sample"})
    assert loaded.spec.task.n == 2 and loaded.spec.steps[1].generate.decode.kind == "sample"
    with pytest.raises(SpecError, match="neither a top-level key nor a step id"):
        headlab.load_spec(BASE).with_overrides({"bogus.x": 1})


def test_format_path():
    assert format_path(["steps", 0, "detect", "kind"]) == "steps[0].detect.kind"


def test_json_schema_has_every_kind():
    schema = headlab.json_schema()
    text = str(schema)
    for kind in ("induction", "previous_token", "duplicate_token", "repeated_tokens", "greedy", "exact_match"):
        assert kind in text
    assert schema["title"] == "headlab spec"
    assert "steps" in schema["properties"]


def test_every_example_spec_validates():
    from pathlib import Path

    specs = sorted((Path(__file__).parent.parent / "specs").glob("*.yaml"))
    assert specs
    for path in specs:
        headlab.load_spec(path)


def test_published_schema_is_current():
    """docs/spec.schema.json (used by the specs' yaml-language-server modeline) matches the code."""
    import json
    from pathlib import Path

    from headlab.plugin_manager import Manager

    published = json.loads((Path(__file__).parent.parent / "docs" / "spec.schema.json").read_text())
    current = headlab.json_schema(Manager(entry_points=False).registry)
    assert published == json.loads(json.dumps(current)), "run: HEADLAB_PLUGINS=none headlab schema -o docs/spec.schema.json"
