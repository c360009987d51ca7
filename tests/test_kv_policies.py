"""The KV policies (``full``, ``streaming``, ``random``: the ``kv`` component category) and their head maps:
GQA rules, budgets in KV heads, the seeded random control, DuoAttention's head file, kept fractions, and a
window that covers the whole context."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
import xarray as xr
from pydantic import ValidationError

from headlab import component
from headlab.dims import head_array
from headlab.geometry import Geometry
from headlab.kv import DuoHeadsFile, HeadMap, KvPolicyError, kv_heads, read_duo_heads
from headlab.spec import HeadsFile, HeadsFrom

GEO = Geometry(n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8)  # query heads 2j, 2j+1 share KV head j

# KV head (0, 0): scores 0.9, 0.0 (max 0.9, min 0.0, mean 0.45)
# KV head (0, 1): 0.5, 0.5 (max 0.5, min 0.5, mean 0.5)
# KV head (1, 0): 0.6, 0.4 (max 0.6, min 0.4, mean 0.5 -> ties (0, 1) by mean, later)
# KV head (1, 1): 0.1, 0.2
SCORES = np.array([[0.9, 0.0, 0.5, 0.5], [0.6, 0.4, 0.1, 0.2]])
RESULTS = {"ret": xr.Dataset({"score": head_array(SCORES)})}


def _ctx(seed: int = 0, results=RESULTS, geometry=GEO):
    return SimpleNamespace(model=SimpleNamespace(geometry=geometry), results=results, seed=seed)


def _compile(kind: str, seed: int = 0, **config) -> HeadMap:
    comp = component("kv", kind)
    return comp.impl(comp.config.model_validate({"kind": kind, **config}), _ctx(seed))


def _on(full: xr.DataArray) -> list[tuple[int, int]]:
    return [(int(a), int(b)) for a, b in zip(*np.nonzero(full.values), strict=True)]


@pytest.mark.parametrize(("rule", "top", "expected"), [
    ("any", 1, [(0, 0)]), ("all", 1, [(0, 1)]), ("mean", 1, [(0, 1)]),
    ("any", 2, [(0, 0), (1, 0)]), ("all", 2, [(0, 1), (1, 0)]), ("mean", 2, [(0, 1), (1, 0)]),
])
def test_scores_rank_kv_heads_by_the_gqa_rule(rule, top, expected):
    hm = _compile("streaming", full_heads={"from": "ret", "top": top}, window=4, gqa=rule)
    assert _on(hm.kv_full) == expected
    assert hm.n_full == top  # budgets count KV heads


@pytest.mark.parametrize(("rule", "expected"), [("any", [(0, 0), (0, 1), (1, 0)]), ("all", [(0, 1)]),
                                                ("mean", [(0, 1), (1, 0)])])
def test_threshold_applies_to_the_aggregate(rule, expected):
    full = kv_heads(HeadsFrom.model_validate({"from": "ret", "threshold": 0.5}), RESULTS, GEO, gqa=rule)
    assert _on(full) == expected


@pytest.mark.parametrize(("rule", "expected"), [("any", [(0, 1), (1, 0)]), ("all", [(1, 0)]),
                                                ("mean", [(0, 1), (1, 0)])])
def test_a_list_of_query_heads_maps_to_kv_heads(rule, expected):
    full = kv_heads([(0, 3), (1, 0), (1, 1)], {}, GEO, gqa=rule)
    assert _on(full) == expected
    layers = kv_heads({"1": [0, 1]}, {}, GEO, gqa=rule)
    assert _on(layers) == [(1, 0)]


def test_retrieval_json_file_ranks_kv_heads_and_a_pasta_file_is_a_set(tmp_path):
    path = tmp_path / "heads.json"
    path.write_text(json.dumps({f"{ly}-{h}": [float(SCORES[ly, h])] for ly in range(2) for h in range(4)}))
    assert _on(kv_heads(HeadsFile(file=str(path), top=1), {}, GEO, gqa="any")) == [(0, 0)]
    assert _on(kv_heads(HeadsFile(file=str(path), top=1), {}, GEO, gqa="all")) == [(0, 1)]
    pasta = tmp_path / "pasta.json"
    pasta.write_text(json.dumps({"0": [1]}))
    assert _on(kv_heads(HeadsFile(file=str(pasta)), {}, GEO)) == [(0, 0)]
    spec_form = _compile("streaming", full_heads={"file": str(path), "top": 2}, window=4, gqa="mean")
    assert _on(spec_form.kv_full) == [(0, 1), (1, 0)]  # a .json file is a head list, ranked like `from`
    with pytest.raises(KvPolicyError, match="`top` needs scores"):
        kv_heads(HeadsFile(file=str(pasta), top=1), {}, GEO)


def test_selection_errors_are_located():
    with pytest.raises(KvPolicyError, match="step 'nope': the step has no result"):
        kv_heads(HeadsFrom.model_validate({"from": "nope", "top": 1}), RESULTS, GEO)
    with pytest.raises(KvPolicyError, match="top 5 is more than this model's 4 KV heads"):
        kv_heads(HeadsFrom.model_validate({"from": "ret", "top": 5}), RESULTS, GEO)
    with pytest.raises(KvPolicyError, match="outside this model"):
        kv_heads([(2, 0)], {}, GEO)
    other = {"ret": xr.Dataset({"score": head_array(np.zeros((3, 4)))})}
    with pytest.raises(KvPolicyError, match="3 layers x 4 heads, this model has 2 x 4"):
        kv_heads(HeadsFrom.model_validate({"from": "ret", "top": 1}), other, GEO)


def test_random_control_is_seeded_and_draws_the_same_count():
    big = Geometry(n_layers=4, n_heads=8, n_kv_heads=4, head_dim=8)
    scores = {"ret": xr.Dataset({"score": head_array(np.arange(32.0).reshape(4, 8))})}
    like = {"from": "ret", "top": 5}

    def draw(seed, offset=0, **extra):
        comp = component("kv", "random")
        config = comp.config.model_validate({"kind": "random", "like": like, "window": 8, "seed": offset, **extra})
        return comp.impl(config, _ctx(seed, scores, big))

    selected = kv_heads(HeadsFrom.model_validate(like), scores, big)
    a, b = draw(3), draw(3)
    assert a.kv_full.equals(b.kv_full)
    assert a.n_full == int(selected.sum()) == 5
    draws = {tuple(map(tuple, _on(draw(s).kv_full))) for s in range(6)}
    assert len(draws) > 1  # the seed matters
    assert not draw(3, offset=1).kv_full.equals(a.kv_full) or not draw(3, offset=2).kv_full.equals(a.kv_full)
    excluded = draw(3, exclude=True)
    assert excluded.n_full == 5 and not bool((excluded.kv_full & selected).any())
    matched = draw(4, match_layers=True)
    assert matched.kv_full.sum("kv_head").values.tolist() == selected.sum("kv_head").values.tolist()
    counted = component("kv", "random")
    hm = counted.impl(counted.config.model_validate({"kind": "random", "n_full": 3, "window": 8}), _ctx(0, {}, big))
    assert hm.n_full == 3 and hm.attrs["policy"] == "random"
    with pytest.raises(ValidationError, match="exactly one of `like`"):
        counted.config.model_validate({"kind": "random", "window": 8})


def test_duo_attention_tsv_file(tmp_path):
    binary = tmp_path / "full_attention_heads.tsv"
    binary.write_text("1\t0\n0\t1\n")
    assert _on(kv_heads(DuoHeadsFile(file=str(binary)), {}, GEO)) == [(0, 0), (1, 1)]
    gates = tmp_path / "gates.tsv"
    gates.write_text("0.9\t0.2\n0.55\t0.7\n")
    assert read_duo_heads(gates, GEO).values.tolist() == [[0.9, 0.2], [0.55, 0.7]]
    assert _on(kv_heads(DuoHeadsFile(file=str(gates)), {}, GEO)) == [(0, 0), (1, 0), (1, 1)]
    assert _on(kv_heads(DuoHeadsFile(file=str(gates), top=2), {}, GEO)) == [(0, 0), (1, 1)]
    assert _on(kv_heads(DuoHeadsFile(file=str(gates), threshold=0.8), {}, GEO)) == [(0, 0)]
    # the spec form: {file: ....tsv} is DuoAttention's format, {file: ....json} a head list
    hm = _compile("streaming", full_heads={"file": str(gates), "top": 1}, window=4)
    assert _on(hm.kv_full) == [(0, 0)]


@pytest.mark.parametrize(("text", "message"), [
    ("1\t0\n0\n", "line 2: 1 values, the first line has 2"),
    ("1\t0\nx\t1\n", "line 2: not tab-separated numbers"),
    ("1\t0\n", "1 layers x 2 KV heads, this model has 2 x 2"),
    ("1\t0\t1\n0\t1\t1\n", "2 layers x 3 KV heads, this model has 2 x 2"),
    ("1\tnan\n0\t1\n", "line 1: a value is not finite"),
    ("\n\n", "empty"),
])
def test_a_malformed_tsv_file_is_a_clear_error(tmp_path, text, message):
    path = tmp_path / "bad.tsv"
    path.write_text(text)
    with pytest.raises(KvPolicyError, match=message) as info:
        kv_heads(DuoHeadsFile(file=str(path)), {}, GEO)
    assert str(path) in str(info.value)
    with pytest.raises(KvPolicyError, match="does not exist"):
        read_duo_heads(tmp_path / "missing.tsv")


def test_full_policy_and_kept_fraction():
    full = _compile("full")
    assert full.is_full and full.window is None and full.kept_fraction(100) == 1.0
    assert full.to_dataarray(100).attrs["kept_fraction"] == 1.0
    assert component("kv", "full").default
    hm = _compile("streaming", full_heads={"from": "ret", "top": 1}, sink=4, window=12)
    # 1 of 4 KV heads keeps 100 tokens, the other 3 keep 4 + 12
    assert hm.kept_fraction(100) == pytest.approx((100 + 3 * 16) / 400)
    assert hm.kept_tokens(100).values.tolist() == [[100, 16], [16, 16]]
    da = hm.to_dataarray(100)
    assert da.name == "kv_full" and da.dims == ("layer", "kv_head") and da.dtype == bool
    assert da.attrs["policy"] == "streaming" and da.attrs["sink"] == 4 and da.attrs["window"] == 12
    assert da.attrs["full_kv_heads"] == 1 and da.attrs["kept_fraction"] == pytest.approx(0.37)
    nothing = _compile("streaming", window=12)  # no full_heads: StreamingLLM's cache everywhere
    assert nothing.n_full == 0 and nothing.kept_fraction(100) == pytest.approx(0.16)


def test_a_window_covering_the_context_behaves_as_full():
    hm = _compile("streaming", full_heads={"from": "ret", "top": 1}, sink=4, window=60)
    assert hm.for_length(100) is hm
    covered = hm.for_length(64)
    assert covered.is_full and covered.kept_fraction(64) == 1.0
    assert covered.attrs["effective"] == "full" and "window 60 >= context 64" in covered.attrs["note"]
    assert covered.to_dataarray(64).attrs["requested_full_kv_heads"] == 1
    assert hm.kept_fraction(64) == 1.0  # the formula agrees: nothing is dropped


def test_head_map_checks():
    ok = xr.DataArray(np.ones((2, 2), dtype=bool), dims=("layer", "kv_head"))
    with pytest.raises(KvPolicyError, match="dims"):
        HeadMap(ok.rename({"kv_head": "head"}))
    with pytest.raises(KvPolicyError, match="boolean"):
        HeadMap(ok.astype(int))
    with pytest.raises(KvPolicyError, match="at least the query's own token"):
        HeadMap(ok, window=0)
    with pytest.raises(ValidationError):
        component("kv", "streaming").config.model_validate({"kind": "streaming", "window": 0})
