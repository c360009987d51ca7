"""Validation closes the gaps by construction (issue 15): every numeric field of every built-in config is
bounded, floats are finite, stop strings non-empty; values that used to be accepted and then gave silent
garbage (zero lengths, NaN factors, an empty stop string, ``top`` past the model's heads) are refused with
the key named."""

from __future__ import annotations

import json

import pytest
from pydantic import BaseModel

import headlab
from headlab.plugin_manager import CATEGORIES, get_manager
from headlab.spec import (
    MAX_INT,
    FiniteFloat,
    NonEmptyStr,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    Probability,
    Seed,
    SpecTypes,
    StrictModel,
)

from fixtures.specs import spec_error, spec_text

STEPS = "  - id: ind\n    detect: {kind: induction}\n"


def walk_numbers(node, path):
    if isinstance(node, dict):
        if node.get("type") in ("integer", "number"):
            yield path, node
        for key, value in node.items():
            yield from walk_numbers(value, [*path, key])
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from walk_numbers(value, [*path, i])


def test_every_integer_of_the_spec_schema_is_bounded_both_ways():
    """Every count, length, index and seed of every installed kind has a minimum and a maximum."""
    loose = [(".".join(map(str, p)), n) for p, n in walk_numbers(headlab.json_schema(), [])
             if n["type"] == "integer" and not (("minimum" in n or "exclusiveMinimum" in n)
                                                 and ("maximum" in n or "exclusiveMaximum" in n))]
    assert not loose, loose


def builtin_configs() -> list[type[BaseModel]]:
    """Every config model of the built-in plugins, the actions' built from their builders included."""
    registry = get_manager().registry
    types = SpecTypes(registry)
    out = []
    for category, spec in CATEGORIES.items():
        for comp in registry.components[category].values():
            if not comp.plugin.startswith("headlab."):
                continue
            if spec.style == "config":
                out.append(comp.config)
            elif spec.style == "action":
                out.append(types.action(comp.kind))
    return out


def nested_models(model: type[BaseModel], seen: set) -> set:
    import typing

    if model in seen:
        return seen
    seen.add(model)

    def visit(tp):
        if isinstance(tp, type) and issubclass(tp, BaseModel):
            nested_models(tp, seen)
        for arg in typing.get_args(tp):
            visit(arg)

    for field in model.model_fields.values():
        visit(field.annotation)
    return seen


def test_every_builtin_config_refuses_nan_and_infinity():
    configs = builtin_configs()
    assert len(configs) >= 25
    models: set = set()
    for config in configs:
        if isinstance(config, type):
            nested_models(config, models)
        else:  # the detect action's config: the union of detectors
            import typing

            stack = [config]
            while stack:
                tp = stack.pop()
                if isinstance(tp, type) and issubclass(tp, BaseModel):
                    nested_models(tp, models)
                stack.extend(typing.get_args(tp))
    lax = sorted(m.__name__ for m in models if m.model_config.get("allow_inf_nan", True))
    assert not lax, f"these config models accept NaN/inf floats: {lax}"


def test_third_party_configs_inherit_finite_floats():
    class Mine(headlab.ComponentConfig):
        kind: str = "mine"
        weight: float = 1.0

    for bad in (float("nan"), float("inf"), -float("inf")):
        with pytest.raises(ValueError, match="finite number"):
            Mine(weight=bad)


@pytest.mark.parametrize("annotated, good, bad", [
    (PositiveInt, [1, MAX_INT], [0, -1, MAX_INT + 1]),
    (NonNegativeInt, [0, 5], [-1, MAX_INT + 1]),
    (Seed, [0, 2**32 - 1], [-1, 2**32, 10**30]),
    (FiniteFloat, [-3.4e38, 0.0, 3.4e38], [float("nan"), float("inf"), 1e39, -1e300]),
    (PositiveFloat, [1e-9, 3.4e38], [0.0, -1.0, float("inf"), float("nan"), 1e39]),
    (NonNegativeFloat, [0.0], [-1e-9, float("inf")]),
    (Probability, [0.0, 1.0], [-0.1, 1.1, float("nan")]),
    (NonEmptyStr, ["x"], [""]),
])
def test_shared_types(annotated, good, bad):
    from pydantic import TypeAdapter

    adapter = TypeAdapter(annotated)
    for value in good:
        adapter.validate_python(value)
    for value in bad:
        with pytest.raises(ValueError):
            adapter.validate_python(value)


GEN = "  - id: g\n    generate: {steer: [%s]}\n"


@pytest.mark.parametrize("steps, where", [
    # NaN/inf factors and alphas gave empty outputs
    (GEN % "{kind: head_scale, heads: [[0, 1]], factor: .nan}", "steps[1].generate.steer[0].factor"),
    (GEN % "{kind: head_scale, heads: [[0, 1]], factor: .inf}", "steps[1].generate.steer[0].factor"),
    (GEN % "{kind: pasta, heads: [[0, 1]], alpha: .nan}", "steps[1].generate.steer[0].alpha"),
    (GEN % "{kind: vhr, alpha: .inf}", "steps[1].generate.steer[0].alpha"),
    ("  - id: g\n    generate: {decode: {kind: decore, heads: [[0, 1]], alpha: .inf}}\n", "steps[1].generate.decode.alpha"),
    ("  - id: g\n    generate: {decode: {kind: cad, alpha: .nan}}\n", "steps[1].generate.decode.alpha"),
    ("  - id: g\n    generate: {decode: {kind: dola, repetition_penalty: .inf}}\n",
     "steps[1].generate.decode.repetition_penalty"),
    ("  - id: g\n    generate: {decode: {kind: sample, temperature: .nan}}\n", "steps[1].generate.decode.temperature"),
    # NaN thresholds selected nothing
    (GEN % "{kind: pasta, heads: {from: ind, threshold: .nan}}", "steps[1].generate.steer[0].heads.threshold"),
    ("  - id: r\n    detect: {kind: retrieval, threshold: .nan}\n", "steps[1].detect.threshold"),
    ("  - id: g\n    generate: {metrics: [{kind: needle_recall, threshold: .nan}]}\n",
     "steps[1].generate.metrics[0].threshold"),
])
def test_nan_and_infinite_numbers_are_refused(steps, where):
    err = spec_error(spec_text(STEPS + steps))
    assert f"{where}: Input should be a finite number" in err or (where in err and "finite" in err), err


@pytest.mark.parametrize("steps, where", [
    ("  - id: g\n    generate: {stop: ['']}\n", "steps[1].generate.stop[0]"),  # emptied every output
    ("  - id: r\n    detect: {kind: retrieval, stop: ['']}\n", "steps[1].detect.stop[0]"),
    ("  - id: r\n    detect: {kind: lookback, stop: ['\\n', '']}\n", "steps[1].detect.stop[1]"),
])
def test_empty_stop_strings_are_refused(steps, where):
    assert f"{where}: String should have at least 1 character" in spec_error(spec_text(STEPS + steps))


@pytest.mark.parametrize("task, where", [
    ("{kind: repeated_tokens, n: 0}", "task.n"),
    ("{kind: niah, context_lengths: [0]}", "task.context_lengths[0]"),
    ("{kind: niah, context_lengths: {lo: 0, hi: 10, n: 2}}", "task.context_lengths.lo"),
    ("{kind: niah, depths: [0.5, 1.5]}", "task.depths[1]"),
    ("{kind: niah, distractors: -1}", "task.distractors"),
    ("{kind: kv_retrieval, num_pairs: [4, 0]}", "task.num_pairs[1]"),
    ("{kind: kv_retrieval, value_len: [0, 2]}", "task.value_len[0]"),
    ("{kind: counterfact, filler_sentences: [-1, 2]}", "task.filler_sentences[0]"),
    ("{kind: counterfact, filler_sentences: [3, 1]}", "task.filler_sentences"),
    ("{kind: emphasis, seed: -5}", "task.seed"),
])
def test_task_counts_and_lengths_are_positive(task, where):
    err = spec_error(spec_text(STEPS, task=task))
    assert f": {where}: " in err, err


@pytest.mark.parametrize("steps, where", [
    ("  - id: g\n    generate: {max_new_tokens: 0}\n", "steps[1].generate.max_new_tokens"),
    ("  - id: g\n    generate: {batch_size: 0}\n", "steps[1].generate.batch_size"),
    ("  - id: a\n    detect: {kind: ablation, heads: {from: ind, top: 2}, k: [0]}\n", "steps[1].detect.k[0]"),
    ("  - id: a\n    detect: {kind: ablation, heads: {from: ind, top: 2}, draws: -1}\n", "steps[1].detect.draws"),
    ("  - id: a\n    detect: {kind: lookback, prompt_tail: -1}\n", "steps[1].detect.prompt_tail"),
    ("  - id: g\n    generate: {decode: {kind: dola, layers: [-1]}}\n", "steps[1].generate.decode.layers[0]"),
    ("  - id: g\n    generate: {decode: {kind: dola, layers: []}}\n", "steps[1].generate.decode.layers"),
    (GEN % "{kind: head_mask, heads: [[0, -1]]}", "steps[1].generate.steer[0].heads[0][1]"),
    (GEN % "{kind: vhr, segment_token_id: -2}", "steps[1].generate.steer[0].segment_token_id"),
    (GEN % "{kind: pasta, heads: [0], span: ''}", "steps[1].generate.steer[0].span"),
])
def test_step_counts_are_positive(steps, where):
    err = spec_error(spec_text(STEPS + steps))
    assert f": {where}: " in err, err


def test_limits_memory_accepts_sizes():
    loaded = headlab.load_spec(spec_text(STEPS) + "limits: {memory: 1.5GiB}\n")
    assert loaded.spec.limits.memory == int(1.5 * 2**30)
    assert headlab.load_spec(spec_text(STEPS) + "limits: {memory: 512MB}\n").spec.limits.memory == 512 * 10**6
    assert "limits.memory: 'lots' is not a size" in spec_error(spec_text(STEPS) + "limits: {memory: lots}\n")
    assert "cannot be swept" in spec_error(spec_text(STEPS, sweep="  limits.memory: [1GB, 2GB]\n"))


def test_strict_model_is_the_base_of_every_spec_model():
    assert StrictModel.model_config["allow_inf_nan"] is False
    assert json.dumps(headlab.json_schema())  # the schema still builds with the annotated types
