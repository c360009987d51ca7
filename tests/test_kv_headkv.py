"""The ``headkv`` policy: HeadKV's budget split (against hand computations), its per-KV-head budgets on the
head map, and the SnapKV-style selection of each KV head's keys (against an explicit per-head top-k written
here, under GQA, batched with left padding, and row by row against batch 1)."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import xarray as xr
from pydantic import ValidationError

from headlab import component
from headlab.dims import head_array
from headlab.geometry import Geometry
from headlab.kv import HeadBudgetMap, HeadMap, KvPolicyError, headkv_allocation, snapkv_keep

GEO = Geometry(n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8)
# query-head scores; KV head j of a layer serves query heads 2j, 2j+1
SCORES = np.array([[0.9, 0.0, 0.5, 0.5], [0.6, 0.4, 0.1, 0.2]])
RESULTS = {"ret": xr.Dataset({"score": head_array(SCORES)})}


def _compile(**config) -> HeadMap:
    comp = component("kv", "headkv")
    ctx = SimpleNamespace(model=SimpleNamespace(geometry=GEO, dtype="float32"), results=RESULTS, seed=0)
    return comp.impl(comp.config.model_validate({"kind": "headkv", **config}), ctx)


def test_allocation_equals_a_hand_computation():
    # KV-head scores 0.45, 0.5, 0.5, 0.15 (sum 1.6) -> shares 0.28125, 0.3125, 0.3125, 0.09375.
    # base 32, beta 1.5: each head gives floor(32 / 1.5) = 21 to the pool (4 * 21 = 84) and keeps 11:
    # 0.28125 * 84 + 11 = 34.625 -> 35; 0.3125 * 84 + 11 = 37.25 -> 37; 0.09375 * 84 + 11 = 18.875 -> 19
    kv_scores = np.array([[0.45, 0.5], [0.5, 0.15]])
    assert headkv_allocation(kv_scores, 32, 1.5).tolist() == [[35, 37], [37, 19]]
    # temp 2: shares of 0.2025, 0.25, 0.25, 0.0225 (sum 0.725) = 0.27931, 0.34483, 0.34483, 0.03103
    # -> 23.46 + 11 -> 34; 28.97 + 11 -> 40; 2.61 + 11 -> 14 (128 = 4 * 32 in all)
    assert headkv_allocation(kv_scores, 32, 1.5, temp=2.0).tolist() == [[34, 40], [40, 14]]
    # beta 1: the whole budget is pooled (no minimum): 0.28125 * 128 = 36, 0.3125 * 128 = 40, 0.09375 * 128 = 12
    assert headkv_allocation(kv_scores, 32, 1.0).tolist() == [[36, 40], [40, 12]]
    # beta 10: floor(3.2) = 3 pooled, 29 kept: 0.28125 * 12 + 29 = 32.375 -> 32; 3.75 + 29 -> 33; 1.125 + 29 -> 30
    assert headkv_allocation(kv_scores, 32, 10.0).tolist() == [[32, 33], [33, 30]]
    # rounding is half to even, as torch.round in HeadKV's code: base 5, beta 1, a pool of 10 shared 1 : 3
    # gives 2.5 -> 2 and 7.5 -> 8; shares 1 : 1 : 2 of a pool of 6 give 1.5 -> 2, 1.5 -> 2, 3
    assert headkv_allocation(np.array([1.0, 3.0]), 5, 1.0).tolist() == [2, 8]
    assert headkv_allocation(np.array([1.0, 1.0, 2.0]), 2, 1.0).tolist() == [2, 2, 3]
    for bad, message in [(np.array([1.0, -0.1]), "negative"), (np.array([0.0, 0.0]), "every score is 0"),
                         (np.array([1.0, np.nan]), "missing or not finite")]:
        with pytest.raises(KvPolicyError, match=message):
            headkv_allocation(bad, 8)
    with pytest.raises(KvPolicyError, match="beta 0.5 < 1"):
        headkv_allocation(kv_scores, 8, 0.5)


def test_the_policy_carries_per_kv_head_budgets():
    # tokens_per_head 40 with the window of 8: base 32 -> [[35, 37], [37, 19]] + 8 under gqa mean
    hm = _compile(scores={"from": "ret"}, budget={"tokens_per_head": 40})
    assert isinstance(hm, HeadBudgetMap) and not hm.pending
    assert hm.budget_dataarray().values.tolist() == [[43, 45], [45, 27]]
    np.testing.assert_allclose(hm.importance.values, [[0.28125, 0.3125], [0.3125, 0.09375]])
    assert hm.attrs["policy"] == "headkv" and hm.attrs["budget_tokens_per_head"] == 40
    # a prompt of 100 tokens: 160 of 400 tokens kept; 10 tokens generated later go to every head
    assert hm.kept_tokens(100).values.tolist() == [[43, 45], [45, 27]]
    assert hm.kept_fraction(100) == pytest.approx(160 / 400)
    assert hm.kept_fraction(100, new_tokens=10) == pytest.approx(200 / 440)
    # a prompt of 44 tokens: the two KV heads with 45 keep everything and are full
    short = hm.for_length(44)
    assert short.kv_full.values.tolist() == [[False, True], [True, False]]
    assert hm.for_length(44, new_tokens=100).kv_full.equals(short.kv_full)  # HeadKV compresses the prompt
    assert short.kept_tokens(44).values.tolist() == [[43, 44], [44, 27]]
    da = hm.to_dataarray(100)
    assert da.attrs["observation_window"] == 8 and da.attrs["kernel_size"] == 7 and da.attrs["pooling"] == "max"
    assert da.attrs["beta"] == 1.5 and da.attrs["kept_fraction"] == pytest.approx(0.4)
    # a prompt no longer than every budget: the plain full map
    covered = hm.for_length(27)
    assert type(covered) is HeadMap and covered.is_full and covered.attrs["effective"] == "full"
    # gqa any (the highest score of each pair): 0.9, 0.5, 0.6, 0.2 (sum 2.2) -> shares x 84 + 11:
    # 34.36 + 11 -> 45; 19.09 + 11 -> 30; 22.91 + 11 -> 34; 7.64 + 11 -> 19 (sum 128)
    hm_any = _compile(scores={"from": "ret"}, budget={"tokens_per_head": 40}, gqa="any")
    assert hm_any.budget_dataarray().values.tolist() == [[45 + 8, 30 + 8], [34 + 8, 19 + 8]]


def test_a_fraction_budget_waits_for_the_length():
    hm = _compile(scores={"from": "ret"}, budget={"fraction": 0.4})
    assert hm.pending
    # 0.4 of 4 heads x 100 tokens = 160 tokens, 40 per KV head: the same split as above
    assert hm.budget_dataarray(100).values.tolist() == [[43, 45], [45, 27]]
    assert hm.kept_fraction(100) == pytest.approx(0.4)
    assert hm.to_dataarray(100).attrs["budget_length"] == 100
    with pytest.raises(KvPolicyError, match="give the length"):
        hm.budget_dataarray()
    # bytes: float32, head_dim 8 -> 64 bytes per token and KV head; 4 * 40 * 64 bytes = 40 tokens per KV head
    by_bytes = _compile(scores={"from": "ret"}, budget={"bytes": 4 * 40 * 64})
    assert by_bytes.budget_dataarray().values.tolist() == [[43, 45], [45, 27]]


def test_headkv_errors_are_located():
    with pytest.raises(KvPolicyError, match=r"budget 7 tokens per KV head: 7 tokens per KV head, below the "
                                            r"observation window 8"):
        _compile(scores={"from": "ret"}, budget={"tokens_per_head": 7})
    with pytest.raises(KvPolicyError, match=r"budget fraction 0.05 at 100 tokens per row: 5 tokens per KV head"):
        _compile(scores={"from": "ret"}, budget={"fraction": 0.05}).for_length(100)
    with pytest.raises(KvPolicyError, match="step 'nope': the step has no result"):
        _compile(scores={"from": "nope"}, budget={"tokens_per_head": 40})
    negative = {"ret": xr.Dataset({"score": head_array(SCORES - 0.5)})}
    comp = component("kv", "headkv")
    config = comp.config.model_validate({"kind": "headkv", "scores": {"from": "ret"}, "budget": {"tokens_per_head": 40}})
    with pytest.raises(KvPolicyError, match="headkv scores: .*a score is negative"):
        comp.impl(config, SimpleNamespace(model=SimpleNamespace(geometry=GEO), results=negative, seed=0))
    for bad, message in [({"kernel_size": 4}, "odd width"), ({"beta": 0.9}, "greater than or equal to 1"),
                         ({"scores": {"file": "h.json", "threshold": 0.1}}, "headkv weighs every head"),
                         ({"budget": {"fraction": 0.3, "tokens_per_head": 8}}, "exactly one of")]:
        with pytest.raises(ValidationError, match=message):
            comp.config.model_validate({"kind": "headkv", "scores": {"from": "ret"},
                                        "budget": {"tokens_per_head": 40}, **bad})


def test_scores_from_a_headkv_json_file(tmp_path):
    # HeadKV's own files: {"<layer>-<head>": [score]}, keys in any order, pretty-printed or on one line
    path = tmp_path / "Model_retrieval_reasoning_heads.json"
    entries = {f"{ly}-{h}": [float(SCORES[ly, h])] for ly in range(2) for h in range(4)}
    path.write_text(json.dumps(dict(reversed(list(entries.items()))), indent=4))
    hm = _compile(scores={"file": str(path)}, budget={"tokens_per_head": 40})
    assert hm.budget_dataarray().values.tolist() == [[43, 45], [45, 27]]  # as from the step's scores
    partial = tmp_path / "partial.json"
    partial.write_text(json.dumps({k: v for k, v in entries.items() if k != "1-3"}))
    with pytest.raises(KvPolicyError, match="missing or not finite"):
        _compile(scores={"file": str(partial)}, budget={"tokens_per_head": 40})


# --- the SnapKV-style selection --------------------------------------------------------------------------


def _reference_keep(keys: torch.Tensor, queries: torch.Tensor, budget: int, kernel: int, pooling: str) -> list[int]:
    """One row, one KV head, no padding, written out: ``keys`` [n, d] of the KV head, ``queries`` [g, W, d] of
    its query heads (the last W positions). The positions kept, ascending."""
    n, d = keys.shape
    g, w, _ = queries.shape
    score = [0.0] * n
    for head in range(g):
        for i in range(w):
            pos = n - w + i
            logits = [float(queries[head, i] @ keys[j]) / math.sqrt(d) for j in range(pos + 1)]
            top = max(logits)
            weights = [math.exp(x - top) for x in logits]
            total = sum(weights)
            for j in range(pos + 1):
                score[j] += weights[j] / total / (g * w)
    prefix = n - w
    pooled = []
    for j in range(prefix):
        near = [score[m] for m in range(j - kernel // 2, j + kernel // 2 + 1) if 0 <= m < prefix]
        pooled.append(max(near) if pooling == "max" else sum(near) / kernel)
    best = sorted(range(prefix), key=lambda j: (-pooled[j], j))[: max(0, budget - w)]
    return sorted(set(best) | set(range(prefix, n)))


def _layer(seed: int, batch: int, n_kv: int, group: int, seq: int, window: int, dim: int = 8):
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(batch, n_kv, seq, dim, generator=gen) * 2
    queries = torch.randn(batch, n_kv * group, window, dim, generator=gen) * 2
    return keys, queries


@pytest.mark.parametrize(("pooling", "kernel"), [("max", 7), ("avg", 7), ("max", 3), ("avg", 1)])
def test_selection_equals_an_explicit_per_head_top_k(pooling, kernel):
    seq, window, budgets, pads = 24, 4, [10, 7, 30], [0, 3, 9, 17]
    keys, queries = _layer(1, len(pads), n_kv=3, group=2, seq=seq, window=window)
    kept = snapkv_keep(keys, queries, budgets, kernel_size=kernel, pooling=pooling, pad=pads)
    assert len(kept) == 3
    for head, budget in enumerate(budgets):
        longest = max(min(budget, seq - p) for p in pads)
        assert kept[head].shape == (len(pads), longest) and kept[head].dtype == torch.long
        for row, pad in enumerate(pads):
            expected = _reference_keep(keys[row, head, pad:], queries[row, 2 * head: 2 * head + 2], budget, kernel,
                                       pooling)
            got = [int(x) - pad for x in kept[head][row] if x >= 0]
            assert got == expected, (head, row)
            assert len(got) == min(budget, seq - pad)  # a row with at most `budget` tokens keeps them all
            assert (kept[head][row][: longest - len(got)] == -1).all()  # fewer kept: -1 first


def test_selection_of_a_padded_batch_equals_batch_one():
    seq, window, budgets, pads = 32, 8, [12, 20], [0, 5, 11, 2]
    keys, queries = _layer(2, len(pads), n_kv=2, group=4, seq=seq, window=window, dim=16)
    batched = snapkv_keep(keys, queries, budgets, pad=pads)
    for row, pad in enumerate(pads):
        alone = snapkv_keep(keys[row: row + 1, :, pad:], queries[row: row + 1], budgets)
        for head in range(2):
            got = batched[head][row]
            assert (got[got >= 0] - pad).tolist() == alone[head][0].tolist()


def test_selection_keeps_the_keys_the_window_attends_to():
    # one KV head, 16 keys: key 3 is the window's query itself, every other key orthogonal to it
    dim, seq, window = 4, 16, 2
    keys = torch.zeros(1, 1, seq, dim)
    keys[0, 0, :, 1] = 1.0
    keys[0, 0, 3] = torch.tensor([10.0, 0, 0, 0])
    queries = torch.tensor([10.0, 0, 0, 0]).expand(1, 1, window, dim).clone()
    kept = snapkv_keep(keys, queries, [window + 1], kernel_size=1)
    assert kept[0].tolist() == [[3, 14, 15]]
    # with max pooling of width 5, keys 1..5 tie at key 3's score: the earliest wins
    assert snapkv_keep(keys, queries, [window + 1], kernel_size=5)[0].tolist() == [[1, 14, 15]]


def test_a_row_shorter_than_the_window_keeps_its_tokens():
    keys, queries = _layer(4, 2, n_kv=1, group=2, seq=12, window=4)
    kept = snapkv_keep(keys, queries, [6], pad=[0, 9])
    assert kept[0][1].tolist() == [-1, -1, -1, 9, 10, 11]
    assert kept[0][0].tolist() == snapkv_keep(keys[:1], queries[:1], [6])[0][0].tolist()


def test_selection_input_errors():
    keys, queries = _layer(3, 1, n_kv=2, group=2, seq=10, window=4)
    with pytest.raises(KvPolicyError, match="below the observation window of 4"):
        snapkv_keep(keys, queries, [3, 8])
    with pytest.raises(KvPolicyError, match="1 budgets for 2 KV heads"):
        snapkv_keep(keys, queries, [8])
    with pytest.raises(KvPolicyError, match="do not fit"):
        snapkv_keep(keys, queries[:, :3], [8, 8])
    with pytest.raises(KvPolicyError, match="odd pooling width"):
        snapkv_keep(keys, queries, [8, 8], kernel_size=2)
