"""Comparing two atlases (headlab.plugins.atlas.compare; docs/atlas.md#compare): score and label differences
per head, the gained and lost heads, and Spearman's rho per detector computed here as the Pearson correlation of
average ranks (ties included); geometry checks; and ``headlab atlas A --compare B`` as typed, where B is A with one
head's query rows zeroed and another head's o_proj slice zeroed."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import xarray as xr

from headlab import Geometry
from headlab.plugins.atlas.compare import compare_cubes, comparison_lines, geometry_mismatch

from fixtures.cli import command, error_line
from fixtures.detectors import tiny_config, word_tokenizer


def _cube(score: np.ndarray, label: np.ndarray, detectors: list[str]) -> xr.Dataset:
    dims = ("detector", "layer", "head")
    return xr.Dataset({"score": (dims, score), "label": (dims, label)},
                      coords={"detector": detectors, "layer": np.arange(score.shape[1]),
                              "head": np.arange(score.shape[2])}, attrs={"model": "m"})


def _spearman(x: np.ndarray, y: np.ndarray) -> float:
    def ranks(v):  # average ranks of ties
        order = v.argsort(kind="stable")
        r = np.empty(len(v))
        r[order] = np.arange(1, len(v) + 1)
        for value in np.unique(v):
            r[v == value] = r[v == value].mean()
        return r

    return float(np.corrcoef(ranks(x), ranks(y))[0, 1])


def test_differences_labels_and_rank_correlation():
    rng = np.random.default_rng(0)
    sa = rng.random((3, 3, 4))
    sb = sa + 0.1 * rng.standard_normal(sa.shape)
    sb[1] = np.round(rng.random((3, 4)), 1)  # ties
    sb[2] = 0.5  # constant: no correlation
    la, lb = sa > 0.6, sb > 0.6
    a = _cube(sa, la, ["previous_token", "induction", "successor"])
    b = _cube(np.concatenate([sb, sb[:1]]), np.concatenate([lb, lb[:1]]),
              ["previous_token", "induction", "successor", "retrieval"])
    ds = compare_cubes(a, b, model_b="tuned")
    np.testing.assert_allclose(ds["score_diff"].values, sb - sa, rtol=0, atol=0)
    np.testing.assert_array_equal(ds["label_change"].values, lb.astype(int) - la.astype(int))
    for i in range(2):
        np.testing.assert_allclose(float(ds["rank_correlation"][i]), _spearman(sa[i].ravel(), sb[i].ravel()),
                                   rtol=1e-12)
    assert np.isnan(float(ds["rank_correlation"][2]))
    assert ds["score_diff"].dims == ("detector", "layer", "head")
    gained, lost = json.loads(ds.attrs["gained"]), json.loads(ds.attrs["lost"])
    for i, d in enumerate(ds["detector"].values):
        assert gained[d] == [f"L{x}H{h}" for x, h in zip(*np.nonzero(lb[i] & ~la[i]), strict=True)]
        assert lost[d] == [f"L{x}H{h}" for x, h in zip(*np.nonzero(la[i] & ~lb[i]), strict=True)]
    assert json.loads(ds.attrs["compare_only"]) == {"retrieval": "B"}
    assert ds.attrs["compare_model"] == "tuned"
    lines = comparison_lines(ds)
    assert lines[2].startswith("successor") and "n/a" in lines[2]
    assert f"{float(ds['rank_correlation'][0]):+.2f}" in lines[0]


def test_geometry_mismatch_names_what_differs():
    g = Geometry(4, 8, 8, 16)
    assert geometry_mismatch(g, Geometry(4, 8, 8, 16)) is None
    assert geometry_mismatch(g, Geometry(2, 8, 4, 16)) == "layers 4 vs 2, key/value heads 8 vs 4"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """headlab-tiny saved as checkpoint A; B: A with L1H5's query rows zeroed (uniform attention) and L2H0's
    slice of o_proj zeroed (its output removed)."""
    from headlab import component
    from headlab.spec import ModelSpec

    root = tmp_path_factory.mktemp("atlas-compare")
    lm = component("models", "headlab-tiny").impl(ModelSpec(id="headlab-tiny", device="cpu"))
    d = lm.geometry.head_dim
    paths = {name: root / name for name in ("A", "B")}
    lm.model.save_pretrained(paths["A"])
    lm.tokenizer.save_pretrained(paths["A"])
    with torch.no_grad():
        lm.model.model.layers[1].self_attn.q_proj.weight[5 * d: 6 * d] = 0
        lm.model.model.layers[2].self_attn.o_proj.weight[:, 0: d] = 0
    lm.model.save_pretrained(paths["B"])
    lm.tokenizer.save_pretrained(paths["B"])
    return {k: str(v) for k, v in paths.items()}


@pytest.mark.slow
def test_compare_from_the_command_line_finds_the_edited_heads(checkpoints, tmp_path, capfd):
    import headlab

    code, out, err = command(["atlas", checkpoints["A"], "--compare", checkpoints["B"], "--out", str(tmp_path),
                              "--detectors", "previous_token,copying", "--n", "4", "--tokens", "32"], capfd)
    assert code == 0, err
    run = headlab.open_run(next(tmp_path.iterdir()))
    ds = run.results["atlas"]
    assert ds["score_diff"].dims == ("detector", "layer", "head")
    np.testing.assert_allclose(ds["score_diff"].values, ds["score_b"].values - ds["score"].values)
    lost = json.loads(ds.attrs["lost"])
    # the head whose query was zeroed attends uniformly: no longer a previous-token head
    assert ds["label"].sel(detector="previous_token", layer=1, head=5)
    assert "L1H5" in lost["previous_token"]
    assert int(ds["label_change"].sel(detector="previous_token", layer=1, head=5)) == -1
    # the head whose output was removed has no OV circuit left: its copying score is the only one that moved
    copying = ds["score_diff"].sel(detector="copying").values
    assert "L2H0" in lost["copying"]
    moved = np.argwhere(~(np.abs(np.nan_to_num(copying, nan=1.0)) < 1e-6))
    assert moved.tolist() == [[2, 0]]
    assert float(ds["rank_correlation"].sel(detector="copying")) > 0.9
    assert f"compared with {checkpoints['B']}" in out and "lost: L1H5" in out


def test_compare_refuses_another_geometry_in_one_located_line(tmp_path, capfd):
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = word_tokenizer()
    paths = {}
    for layers in (4, 2):
        cfg = tiny_config(len(tok), num_hidden_layers=layers)
        cfg.pop("model_type")
        paths[layers] = tmp_path / f"llama{layers}"
        LlamaForCausalLM(LlamaConfig(**cfg)).save_pretrained(paths[layers])
        tok.save_pretrained(paths[layers])
    code, _, err = command(["atlas", str(paths[4]), "--compare", str(paths[2]), "--out", str(tmp_path),
                            "--detectors", "previous_token", "--n", "2", "--tokens", "16", "--null", "none"], capfd)
    assert code == 2
    line = error_line(err)
    assert "step 'atlas'" in line and "compare:" in line and "layers 4 vs 2" in line
    code, _, err = command(["atlas", str(paths[4]), "--compare", str(tmp_path / "nowhere"), "--out",
                            str(tmp_path), "--n", "2", "--null", "none"], capfd)
    assert code == 2 and "neither a registered model" in error_line(err)
