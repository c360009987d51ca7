"""The ``iti`` errors of issue 35 through the command line, as a user types them (``headlab run spec.yaml``): ``iti``
naming a step that is not a probe, ``sigma_from`` with another model's geometry, and an ``alpha`` whose step
``alpha * sigma`` overflows the model's dtype are each one located line on stderr, exit 2, no traceback.

Probe datasets of a chosen geometry and scale come from a detector registered in this process (``stored_probe``,
the contract of the ``probe`` detector: ``score``, ``direction``, ``probe_direction``, ``sigma``): a probe of
another model is what a third-party detector reading stored probes could hand over."""

from __future__ import annotations

import json
from typing import Literal

import numpy as np
import pytest
import xarray as xr

import headlab
from headlab import ComponentConfig, hookimpl

from fixtures.cli import cli, error_line

LLAMA = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 811, "max_position_embeddings": 256,
         "tokenizer": "headlab-tiny"}
STEP = "error: step 'gen' (steering 'iti', plugin headlab.plugins.steering.iti): ValueError: "


class StoredProbe(ComponentConfig):
    """A probe dataset of a given geometry and sigma scale."""

    kind: Literal["stored_probe"] = "stored_probe"
    layers: int = 2
    heads: int = 4
    head_dim: int = 16
    sigma: float = 1.0


def stored_probe(config: StoredProbe, ctx) -> xr.Dataset:
    rng = np.random.default_rng(0)
    shape = (config.layers, config.heads, config.head_dim)
    unit = rng.standard_normal(shape)
    unit /= np.linalg.norm(unit, axis=-1, keepdims=True)
    return xr.Dataset({"score": (("layer", "head"), rng.uniform(size=shape[:2])),
                       "direction": (("layer", "head", "head_dim"), unit),
                       "probe_direction": (("layer", "head", "head_dim"), unit),
                       "sigma": (("layer", "head"), np.full(shape[:2], config.sigma))}, attrs={"method": "probe"})


class Plugin:
    @hookimpl
    def headlab_register_detectors(self, register):
        register(StoredProbe, stored_probe)


@pytest.fixture(autouse=True)
def plugin():
    name = headlab.register_plugin(Plugin(), name="iti-errors-stored-probe", replace=True)
    yield
    headlab.unregister_plugin(name)


def run_cli(folder, capfd, monkeypatch, steps: str) -> tuple[int, str]:
    """``headlab run spec.yaml`` in ``folder`` with ``steps`` on a tiny random GQA Llama: (exit code, error line)."""
    (folder / "spec.yaml").write_text(f"name: iti\nmodel: {{config: {json.dumps(LLAMA)}}}\n"
                                      "task: {kind: repeated_tokens, n: 2, length: 4}\nsteps:\n" + steps)
    monkeypatch.chdir(folder)
    code, err = cli(["run", "spec.yaml", "--out", "runs"], capfd)
    return code, error_line(err)


GEN = "  - id: gen\n    generate: {max_new_tokens: 1, steer: [{kind: iti, %s}]}\n"


def test_iti_naming_a_step_that_is_not_a_probe(tmp_path, capfd, monkeypatch):
    steps = "  - id: prev\n    detect: {kind: previous_token}\n" + GEN % "probe: prev, heads: {from: prev, top: 2}"
    code, line = run_cli(tmp_path, capfd, monkeypatch, steps)
    assert code == 2
    assert line == (STEP + "iti: probe: step 'prev' is a 'previous_token' step: it has no direction or sigma; name "
                    "a probe step (detect: {kind: probe})")


def test_sigma_from_a_probe_of_another_models_geometry(tmp_path, capfd, monkeypatch):
    steps = ("  - id: pr\n    detect: {kind: stored_probe}\n  - id: other\n    detect: {kind: stored_probe, head_dim: 32}\n"
             + GEN % "probe: pr, heads: [[0, 1]], sigma_from: other")
    code, line = run_cli(tmp_path, capfd, monkeypatch, steps)
    assert code == 2
    assert line == (STEP + "iti: sigma_from: step 'other' has another model's geometry (2 layers x 4 heads, head_dim "
                    "32); this model has 2 x 4, head_dim 16: take it from a probe step on this model")


def test_an_alpha_that_overflows_the_dtype(tmp_path, capfd, monkeypatch):
    steps = "  - id: pr\n    detect: {kind: stored_probe, sigma: 100.0}\n" + GEN % "probe: pr, heads: [[1, 2]], alpha: 1e37"
    code, line = run_cli(tmp_path, capfd, monkeypatch, steps)
    assert code == 2
    assert line == (STEP + "iti: alpha 1e+37 times sigma 100 of head (1, 2) is 1e+39, beyond the model's float32 "
                    "range; lower alpha")
