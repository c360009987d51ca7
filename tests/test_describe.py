"""What a step did, in words, from the spec alone (`headlab.describe_steps`): the example specs' steps, head
selections of every form, controls, and a run's resolved config giving the same words as its spec."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar, Literal

import pytest

import headlab
from headlab.describe import describe_steps

from fixtures.specs import spec_text

ROOT = Path(__file__).parent.parent

EXPECTED = {
    "decoding_counterfact": {
        "retrieval": "detect retrieval (max new tokens 16) on niah",
        "greedy": "generate greedy",
        "decore": "generate decore (heads from retrieval top 8, alpha entropy)",
        "decore_random": "control: generate decore (heads from retrieval top 8, random, alpha entropy)",
        "cad": "generate cad",
        "dola": "generate dola",
    },
    "kv_compression": {
        "retrieval": "detect retrieval (max new tokens 16) on niah (random offset false, seed 0)",
        "full": "generate, kv full",
        "streaming_top4_w64": "generate, kv streaming (full heads from retrieval top 4, window 64)",
        "razor_top4_w128": "generate, kv razor (full heads from retrieval top 4, window 128)",
        "headkv_f018": "generate, kv headkv (scores from retrieval, budget fraction 0.18)",
        "random_top4_w128": "control: generate, kv random (like from retrieval top 4, window 128)",
    },
    "pasta_emphasis": {
        "profile": "detect pasta_profile (tasks [emphasis (n 48, seed 1)], n examples 48, alpha 1e-05, top k 16)",
        "baseline": "generate greedy",
        "markers": "generate greedy on emphasis (emphasis markers)",
        "pasta": "generate, steer pasta (heads from profile top 4, alpha 0.0001)",
        "pasta_random": "control: generate, steer pasta (heads random like profile top 4, alpha 0.0001)",
    },
    "quickstart": {"previous": "detect previous_token", "induction": "detect induction (exclude bos)"},
    "retrieval_heads": {
        "ablation": "detect ablation (heads from retrieval score >= 0.1, k [1, 2, 4, all], draws 5, mode output, "
                    "mask prompt false, batch size 64) on niah (random offset true, seed 1)",
    },
    "vhr_shapes": {
        "vhd": "detect segment_divergence",
        "vhr_paper": "generate, steer vhr (layers reference)",
        "vhd_heads": "generate, steer head_scale (heads from vhd top 8, factor 1.5)",
        "random_heads_0": "generate, steer head_scale (8 listed heads, factor 1.5)",
        "layer_random_0": "generate, steer head_scale (8 listed heads in layers 0, 3, factor 1.5)",
        "pope_vhr": "generate, steer vhr (alpha 1.5, layers [0, 3]) on shapes (n 150, question presence, "
                    "negatives adversarial, seed 301)",
    },
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_the_example_specs_steps_in_words(name):
    loaded = headlab.load_spec(ROOT / "specs" / f"{name}.yaml")
    described = describe_steps(loaded.spec)
    assert list(described) == [s.id for s in loaded.spec.steps]  # every step, in order
    assert {k: described[k].text for k in EXPECTED[name]} == EXPECTED[name]
    for d in described.values():
        assert d.is_control == d.text.startswith("control: ")
    assert described == describe_steps(loaded.spec.model_dump_json(by_alias=True))  # a run's resolved config


def test_parts_of_a_description():
    spec = headlab.load_spec(ROOT / "specs" / "decoding_counterfact.yaml").spec
    d = describe_steps(spec)["decore_random"]
    assert (d.action, d.kind, d.is_control) == ("generate", "decore", True)
    assert d.options == ("heads from retrieval top 8", "random", "alpha entropy")
    assert d.heads == ("from retrieval top 8",) and d.steering == () and d.kv is None and d.task is None
    assert d.fields["decode"] == {"kind": "decore", "heads": {"from": "retrieval", "top": 8}, "random": True,
                                  "alpha": "entropy"}
    kv = describe_steps(headlab.load_spec(ROOT / "specs" / "kv_compression.yaml").spec)["headkv_f018"]
    assert kv.kind == "greedy" and kv.kv == "headkv (scores from retrieval, budget fraction 0.18)"
    assert kv.heads == ("from retrieval",) and not kv.is_control


STEPS = """\
  - id: ind
    detect: {kind: induction}
  - id: seeded
    generate: {steer: [{kind: head_scale, heads: {from: ind, top: 2, random: true, match_layers: true, seed: 3},
               factor: 2}], max_new_tokens: 2}
  - id: two
    generate: {steer: [{kind: head_scale, heads: [[0, 1], [1, 2]], factor: 0.5}], max_new_tokens: 2}
  - id: both
    generate:
      decode: {kind: decore, heads: {from: ind, threshold: 0.25}, alpha: 1}
      steer: [{kind: head_scale, heads: {"1": [0, 3]}, factor: 2}]
      max_new_tokens: 2
"""


def test_head_selections_and_controls_in_words():
    described = describe_steps(headlab.load_spec(spec_text(STEPS)).spec)
    assert {k: (d.text, d.is_control) for k, d in described.items()} == {
        "ind": ("detect induction", False),
        "seeded": ("control: generate, steer head_scale (heads random like ind top 2, per layer, seed 3, factor 2)",
                   True),
        "two": ("generate, steer head_scale (heads L0H1 L1H2, factor 0.5)", False),
        "both": ("generate decore (heads from ind score >= 0.25, alpha 1), steer head_scale (2 listed heads in "
                 "layer 1, factor 2)", False),
    }
    assert described["both"].heads == ("from ind score >= 0.25", "2 listed heads in layer 1")


def test_a_config_class_that_is_a_control_by_construction():
    from headlab.describe import is_control

    class Shuffled(headlab.ComponentConfig):
        kind: str = "shuffled"
        control: ClassVar[bool] = True

    class Steered(headlab.ComponentConfig):
        kind: str = "steered"
        direction: Literal["probe", "random"] = "probe"

    assert is_control(Shuffled()) and not is_control(headlab.ComponentConfig(kind="x"))
    assert is_control(Steered(direction="random")) and not is_control(Steered())  # a random direction
    assert describe_steps("{not json") == {}
