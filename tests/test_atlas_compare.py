"""Comparing two atlases (headlab.plugins.atlas.compare; docs/atlas.md#compare): score and label differences
per head, the gained and lost heads, and Spearman's rho per detector computed here as the Pearson correlation of
average ranks (ties included); geometry checks."""

from __future__ import annotations

import json

import numpy as np
import xarray as xr

from headlab import Geometry
from headlab.plugins.atlas.compare import compare_cubes, comparison_lines, geometry_mismatch


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
