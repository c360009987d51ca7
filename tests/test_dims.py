"""The vocabulary of dimension names (``headlab.DIMENSIONS``): every built-in result names its dims from it.

One spec on the embedded model runs every built-in detector, a ``generate`` step per built-in decoder
(with every built-in steering method) and a ``score`` step; every variable and coordinate of every step's
stored result must have its dims in the vocabulary or be a sweep key.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import xarray as xr

import headlab
from headlab.dims import DIMENSIONS, head_array, unknown_dims
from headlab.instrument import DIMS
from headlab.plugin_manager import get_manager

ROOT = Path(__file__).resolve().parents[1]
CHECKPOINT = ROOT / "headlab" / "plugins" / "models" / "tiny" / "headlab-tiny" / "config.json"

REPEATED = {"kind": "repeated_tokens", "n": 2, "length": 5}
NIAH = {"kind": "niah", "context_lengths": [48], "depths": [0.5], "needles": 2}
COUNTERFACT = {"kind": "counterfact", "n": 2}
KV_SWAP = {"kind": "kv_swap", "n": 2}
EMPHASIS = {"kind": "emphasis", "n": 2}
REPEATED_PAIRS = {"kind": "repeated_pairs", "n": 2, "length": 4}

DETECT = {
    "previous_token": ({}, REPEATED),
    "duplicate_token": ({}, REPEATED),
    "induction": ({}, REPEATED),
    "pattern": ({"pattern": "induction"}, REPEATED),
    "retrieval": ({"max_new_tokens": 3}, NIAH),
    "ablation": ({"heads": [[0, 1], [1, 2], [2, 3]], "k": [1, "all"], "draws": 1, "max_new_tokens": 2}, NIAH),
    "segment_divergence": ({"span": "context"}, COUNTERFACT),
    "lookback": ({"context": "context", "max_new_tokens": 3}, COUNTERFACT),
    "pasta_profile": ({"heads": [[0, 1], [3, 2]], "n_examples": 2}, EMPHASIS),
    "direct_logit_attribution": ({}, KV_SWAP),
    "attention_sink": ({}, REPEATED),
    "successor": ({}, REPEATED),
    "copy_suppression": ({}, REPEATED),
    "composition": ({"baseline_samples": 10}, REPEATED),
    "activation_patching": ({"unit": "z_position"}, KV_SWAP),
    "attribution_patching": ({"unit": "z_position"}, KV_SWAP),
    "edge_attribution": ({"method": "eap_ig", "ig_steps": 2, "circuit": {"top": 20}}, KV_SWAP),
    "path_patching": ({"receivers": {"heads": [[1, 0]], "input": "q"}}, REPEATED_PAIRS),
    "probe": ({"label": "truth", "folds": 2, "classifier": "nearest_mean"}, "labelled"),  # a jsonl file, below
    "head_importance": ({}, COUNTERFACT),
    "ships": ({"per_prompt": True}, REPEATED),
}
DECODE = {
    "greedy": {},
    "sample": {"temperature": 0.7},
    "dola": {"layers": [0, 2]},
    "decore": {"heads": [[1, 0], [2, 3]], "alpha": "entropy"},
    "contrastive": {"amateur": "headlab-tiny"},
    "cad": {"alpha": 0.5},
}
STEER = {
    "pasta": ({"heads": [[1, 2]]}, EMPHASIS),
    "vhr": ({"segment": "context"}, COUNTERFACT),
    "head_mask": ({"heads": [[0, 1]]}, COUNTERFACT),
    "head_scale": ({"heads": [[0, 1]], "factor": 0.5}, COUNTERFACT),
    "iti": ({"probe": "probe", "heads": {"from": "probe", "top": 2}}, COUNTERFACT),  # the `probe` detect step
}


def builtin_kinds(category: str) -> set[str]:
    return {kind for kind, comp in get_manager().components[category].items()
            if comp.impl.__module__.startswith("headlab.plugins.")}


def test_the_vocabulary_is_documented():
    assert headlab.DIMENSIONS is DIMENSIONS
    assert {"example", "layer", "head", "token", "step", "query", "key"} <= set(DIMENSIONS)
    assert all(isinstance(v, str) and v for v in DIMENSIONS.values())
    assert all("." not in name for name in DIMENSIONS)  # dotted names are sweep keys
    for name, dims in DIMS.items():  # the instrumentation's arrays
        assert set(dims) <= set(DIMENSIONS), name


def test_head_array_and_unknown_dims():
    da = head_array(np.arange(24.0).reshape(2, 3, 4), "example", name="s")
    assert da.dims == ("example", "layer", "head") and da.name == "s"
    assert da["layer"].values.tolist() == [0, 1, 2] and da["head"].values.tolist() == [0, 1, 2, 3]
    assert "example" not in da.coords
    with pytest.raises(ValueError, match="3-d"):
        head_array(np.zeros((2, 3, 4)))
    ds = xr.Dataset({"a": (("example", "gen_token"), np.zeros((1, 2))), "b": ("task.length", [1])})
    assert unknown_dims(ds) == ["gen_token", "task.length"]
    assert unknown_dims(ds, allowed=["task.length"]) == ["gen_token"]
    assert unknown_dims(ds["b"], allowed=["task.length"]) == []


@pytest.mark.skipif(not CHECKPOINT.is_file(), reason="the embedded model headlab-tiny is not built")
def test_every_builtin_result_uses_the_vocabulary(tmp_path):
    # the spec covers every built-in detector, decoder and steering method (a new one must be added here)
    assert set(DETECT) == builtin_kinds("detectors")
    assert set(DECODE) == builtin_kinds("decoders")
    assert set(STEER) == builtin_kinds("steering")
    mc = tmp_path / "mc.jsonl"
    mc.write_text("\n".join(json.dumps(r) for r in [
        {"q": "the capital of france is", "a": "paris", "b": "rome", "ans": 0},
        {"q": "the capital of italy is", "a": "paris", "b": "rome", "ans": 1}]) + "\n")
    labelled = tmp_path / "labelled.jsonl"
    labelled.write_text("".join(json.dumps({"text": t, "truth": i % 2 == 0}) + "\n"
                                for i, t in enumerate(["red cat", "blue dog", "a red bird", "the blue cat"])))
    labelled_task = {"kind": "jsonl", "path": str(labelled), "prompt": "{{ text }}", "meta": ["truth"]}
    steps = [{"id": kind, "task": labelled_task if task == "labelled" else task, "detect": {"kind": kind, **opts}}
             for kind, (opts, task) in DETECT.items()]
    steps += [{"id": f"gen_{kind}", "task": COUNTERFACT,
               "generate": {"max_new_tokens": 2, "decode": {"kind": kind, **opts}, "metrics": ["context_memory"]}}
              for kind, opts in DECODE.items()]
    steps += [{"id": f"steer_{kind}", "task": task,
               "generate": {"max_new_tokens": 2, "steer": [{"kind": kind, **opts}], "metrics": ["contains"]}}
              for kind, (opts, task) in STEER.items()]
    steps.append({"id": "sav", "task": labelled_task, "sav": {"probe": "probe", "heads": {"from": "probe", "top": 3}}})
    steps.append({"id": "score", "task": {"kind": "jsonl", "path": str(mc), "prompt": "{{ q }}",
                                          "choices": ["{{ a }}", "{{ b }}"], "label": "ans"},
                  "score": {"decode": {"kind": "dola", "layers": [0, 2]}}})
    spec = {"name": "dims", "model": "headlab-tiny", "task": REPEATED, "seed": 0, "steps": steps,
            "sweep": {"seed": [0]}}
    run = headlab.run(spec, out=tmp_path / "runs")
    assert set(run.results) == {s["id"] for s in steps}
    for step, ds in run.results.items():
        assert "seed" in ds.dims, step
        bad = unknown_dims(ds, allowed=run.sweep)
        assert not bad, f"step {step}: dims {bad} are not in headlab.DIMENSIONS"
        # and the datasets as the plugins returned them, before the store (one cell, no sweep dim)
        cell = run.cell("c0000", step)
        assert not unknown_dims(cell), step
    # the renamed generated-token axis, and the step-indexed diagnostics of the decoders
    assert set(run.results["lookback"]["lookback_ratio"].dims) == {"seed", "example", "step", "layer", "head"}
    assert "step" in run.results["gen_decore"]["alpha"].dims
    assert "step" in run.results["gen_dola"]["premature_layer"].dims
    assert set(run.results["score"]["logprob"].dims) == {"seed", "example", "choice"}
