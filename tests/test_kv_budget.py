"""KV budgets of ``streaming`` and ``random``: a kept fraction of the full cache, a byte size or a mean of
tokens per KV head, met at a context length by the largest number of full KV heads that fits (ranked by the
selection's scores), with the true kept fraction reported, and a budget below sinks + window refused.

Every expected number is computed by hand in the comments from this geometry: 2 layers x 2 KV heads (N = 4
KV heads, 4 query heads sharing them by pairs), sink 4 + window 12 (a compressed KV head keeps c = 16 tokens
of a 100-token row), so n full KV heads keep ``n * 100 + (4 - n) * 16`` tokens of the full 400.
"""

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
from headlab.kv import HeadMap, KvBudget, KvPolicyError, ScoresFrom, kv_priority, token_bytes

GEO = Geometry(n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8)
# KV-head priorities under gqa=any (max of each pair): (0,0) 0.9, (0,1) 0.5, (1,0) 0.6, (1,1) 0.2
SCORES = np.array([[0.9, 0.0, 0.5, 0.5], [0.6, 0.4, 0.1, 0.2]])
RESULTS = {"ret": xr.Dataset({"score": head_array(SCORES)})}


def _ctx(seed: int = 0, dtype: str = "float16"):
    return SimpleNamespace(model=SimpleNamespace(geometry=GEO, dtype=dtype), results=RESULTS, seed=seed)


def _compile(kind: str, seed: int = 0, **config) -> HeadMap:
    comp = component("kv", kind)
    return comp.impl(comp.config.model_validate({"kind": kind, "sink": 4, "window": 12, **config}), _ctx(seed))


def _on(full: xr.DataArray) -> list[tuple[int, int]]:
    return [(int(a), int(b)) for a, b in zip(*np.nonzero(full.values), strict=True)]


@pytest.mark.parametrize(("fraction", "n_full", "kept"), [
    (0.16, 0, 0.16),    # 4 * 16 = 64 tokens = 0.16 of 400: nothing more fits
    (0.3699, 0, 0.16),  # 147.96 tokens: one full head would need 64 + 84 = 148
    (0.37, 1, 0.37),    # 148 tokens: exactly one full head (100 + 3 * 16)
    (0.5, 1, 0.37),     # 200 tokens: two would need 232
    (0.58, 2, 0.58),    # 232 tokens: two full heads (200 + 2 * 16)
    (0.99, 3, 0.79),    # 396 tokens: three full heads keep 316; four would need 400
    (1.0, 4, 1.0),
])
def test_a_fraction_budget_keeps_the_most_full_kv_heads_that_fit(fraction, n_full, kept):
    hm = _compile("streaming", full_heads={"from": "ret"}, budget={"fraction": fraction})
    assert hm.pending and hm.n_full == 0
    at = hm.for_length(100)
    assert not at.pending and at.n_full == n_full
    assert at.kept_fraction(100) == pytest.approx(kept)
    assert hm.kept_fraction(100) == pytest.approx(kept)  # a pending map reports the same, resolved at the length
    ranked = [(0, 0), (1, 0), (0, 1), (1, 1)]  # 0.9, 0.6, 0.5, 0.2
    assert _on(at.kv_full) == sorted(ranked[:n_full])
    da = hm.to_dataarray(100)
    assert da.attrs["kept_fraction"] == pytest.approx(kept) and da.attrs["budget"] == f"fraction {fraction:g}"
    assert da.attrs["budget_length"] == 100 and da.attrs["full_kv_heads"] == n_full
    assert da.attrs["budget_fraction"] == pytest.approx(fraction)


def test_bytes_and_tokens_per_head_budgets():
    # float16, head_dim 8: a token's key and value in one KV head take 2 * 8 * 2 = 32 bytes
    assert token_bytes(GEO, "float16") == 32 and token_bytes(GEO, "float32") == 64
    one = _compile("streaming", full_heads={"from": "ret"}, budget={"bytes": 148 * 32})
    assert one.for_length(100).n_full == 1
    assert _compile("streaming", full_heads={"from": "ret"}, budget={"bytes": 148 * 32 - 1}).for_length(100).n_full == 0
    # 62 tokens per KV head = 248 tokens: at 100 tokens two full heads (232) fit, three (316) do not; at 200
    # tokens one full head (200 + 3 * 16 = 248) fits exactly
    per_head = _compile("streaming", full_heads={"from": "ret"}, budget={"tokens_per_head": 62})
    assert per_head.for_length(100).n_full == 2 and per_head.for_length(200).n_full == 1
    assert per_head.for_length(200).kept_fraction(200) == pytest.approx((200 + 3 * 16) / 800)
    with pytest.raises(KvPolicyError, match="dtype 'float7' is not a torch dtype"):
        token_bytes(GEO, "float7")


def test_a_generation_meets_the_budget_at_its_end():
    # a 60-token prompt and 40 new tokens: the cache holds 100 tokens at the end, where 0.58 fits two heads
    hm = _compile("streaming", full_heads={"from": "ret"}, budget={"fraction": 0.58})
    assert hm.for_length(60, new_tokens=40).kv_full.equals(hm.for_length(100).kv_full)
    assert hm.for_length(60).n_full == 1  # the prompt alone: 139.2 tokens of 240 fit one (60 + 3 * 16 = 108)
    # sink + window covering the prompt but not the generation: not full
    plain = _compile("streaming", full_heads={"from": "ret", "top": 1})
    assert plain.for_length(10).is_full and not plain.for_length(10, new_tokens=10).is_full


def test_a_budget_with_a_length_is_resolved_at_compile_time():
    hm = _compile("streaming", full_heads={"from": "ret"}, budget={"fraction": 0.58, "length": 100})
    assert not hm.pending and _on(hm.kv_full) == [(0, 0), (1, 0)]
    # at another length the map stays and the kept fraction is what it is: (2 * 50 + 2 * 16) / 200
    assert hm.kept_fraction(50) == pytest.approx(0.66)
    assert hm.to_dataarray(50).attrs["budget_length"] == 100


def test_a_budget_below_sinks_and_window_is_one_located_error():
    hm = _compile("streaming", full_heads={"from": "ret"}, budget={"fraction": 0.15})
    with pytest.raises(KvPolicyError) as info:
        hm.for_length(100)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("budget fraction 0.15 at 100 tokens per row: 15 tokens per KV head, below sink 4 + "
                              "window 12")
    assert "the least this policy keeps is fraction 0.16, 2048 bytes" in message  # 64 tokens x 32 bytes
    with pytest.raises(KvPolicyError, match="below sink 4"):
        _compile("streaming", full_heads={"from": "ret"}, budget={"fraction": 0.15, "length": 100})
    # a window covering the context: nothing can be dropped, so only a whole cache meets the budget
    with pytest.raises(KvPolicyError, match="at 16 tokens per row"):
        hm.for_length(16)
    whole = _compile("streaming", full_heads={"from": "ret"}, budget={"fraction": 1.0}).for_length(16)
    assert whole.is_full and whole.kept_fraction(16) == 1.0
    with pytest.raises(KvPolicyError, match="give the length"):
        hm.to_dataarray()


def test_the_selection_bounds_the_candidates():
    # top 1: two would fit, one is offered
    capped = _compile("streaming", full_heads={"from": "ret", "top": 1}, budget={"fraction": 0.58}).for_length(100)
    assert _on(capped.kv_full) == [(0, 0)] and capped.attrs["budget_full_kv_heads"] == 2
    assert "ranks only 1" in capped.attrs["note"] and capped.kept_fraction(100) == pytest.approx(0.37)
    # threshold 0.55 under any: (0,0) 0.9 and (1,0) 0.6 are candidates; three would fit at 0.99
    above = _compile("streaming", full_heads={"from": "ret", "threshold": 0.55}, budget={"fraction": 0.99})
    assert _on(above.for_length(100).kv_full) == [(0, 0), (1, 0)]
    # gqa all ranks by the lowest score of each pair: (0,1) 0.5, (1,0) 0.4, (1,1) 0.1, (0,0) 0.0
    lowest = _compile("streaming", full_heads={"from": "ret"}, budget={"fraction": 0.58}, gqa="all")
    assert _on(lowest.for_length(100).kv_full) == [(0, 1), (1, 0)]
    # a list of heads has no scores: its KV heads are candidates of equal rank, by layer then KV head
    listed = _compile("streaming", full_heads=[[1, 3], [0, 2], [1, 0]], budget={"fraction": 0.58})
    assert _on(listed.for_length(100).kv_full) == [(0, 1), (1, 0)]


def test_head_files_rank_heads_under_a_budget(tmp_path):
    gates = tmp_path / "full_attention_heads.tsv"
    gates.write_text("0.1\t0.7\n0.9\t0.3\n")
    # no explicit top or threshold: every KV head ranked by its gate, 0.9 (1,0) then 0.7 (0,1)
    hm = _compile("streaming", full_heads={"file": str(gates)}, budget={"fraction": 0.58})
    assert _on(hm.for_length(100).kv_full) == [(0, 1), (1, 0)]
    # an explicit threshold bounds the candidates: 0.8 leaves (1,0)
    cut = _compile("streaming", full_heads={"file": str(gates), "threshold": 0.8}, budget={"fraction": 0.58})
    assert _on(cut.for_length(100).kv_full) == [(1, 0)]
    scored = tmp_path / "heads.json"
    scored.write_text(json.dumps({f"{ly}-{h}": [float(SCORES[ly, h])] for ly in range(2) for h in range(4)}))
    by_file = _compile("streaming", full_heads={"file": str(scored)}, budget={"fraction": 0.58})
    assert _on(by_file.for_length(100).kv_full) == [(0, 0), (1, 0)]


def test_random_control_under_the_same_budget():
    streaming = _compile("streaming", full_heads={"from": "ret"}, budget={"fraction": 0.58}).for_length(100)
    draws = [_compile("random", seed=s, budget={"fraction": 0.58}) for s in range(8)]
    resolved = [d.for_length(100) for d in draws]
    assert all(r.n_full == streaming.n_full == 2 for r in resolved)
    assert all(r.attrs["policy"] == "random" for r in resolved)
    assert len({tuple(_on(r.kv_full)) for r in resolved}) > 1  # the seed matters
    again = _compile("random", seed=3, budget={"fraction": 0.58}).for_length(100)
    assert again.kv_full.equals(resolved[3].kv_full)
    # one random order per draw: a looser budget adds heads to the same draw
    looser = _compile("random", seed=3, budget={"fraction": 0.99}).for_length(100)
    assert looser.n_full == 3 and set(_on(resolved[3].kv_full)) < set(_on(looser.kv_full))
    comp = component("kv", "random")
    with pytest.raises(ValidationError, match="exactly one of `like` .*, `n_full` and `budget`"):
        comp.config.model_validate({"kind": "random", "n_full": 1, "budget": {"fraction": 0.5}, "window": 8})


def test_budget_configs_are_checked():
    streaming = component("kv", "streaming").config
    with pytest.raises(ValidationError, match="ranks heads for a `budget`"):
        streaming.model_validate({"kind": "streaming", "full_heads": {"from": "ret"}, "window": 8})
    with pytest.raises(ValidationError, match="a `budget` ranks KV heads by `full_heads`"):
        streaming.model_validate({"kind": "streaming", "window": 8, "budget": {"fraction": 0.3}})
    with pytest.raises(ValidationError, match=r"like \{from: step\} without `top` or `threshold`"):
        component("kv", "random").config.model_validate({"kind": "random", "like": {"from": "ret"}, "window": 8})
    with pytest.raises(ValidationError, match="exactly one of `fraction`, `bytes` and `tokens_per_head`"):
        KvBudget.model_validate({"fraction": 0.3, "bytes": 100})
    with pytest.raises(ValidationError, match="exactly one of"):
        KvBudget.model_validate({"length": 100})
    for bad in ({"fraction": 0}, {"fraction": 1.5}, {"bytes": 0}, {"tokens_per_head": -1}, {"fraction": 0.5, "length": 0}):
        with pytest.raises(ValidationError):
            KvBudget.model_validate(bad)
    with pytest.raises(KvPolicyError, match="ranks KV heads by `full_heads`"):
        kv_priority(None, RESULTS, GEO)
    with pytest.raises(KvPolicyError, match="step 'nope': the step has no result"):
        kv_priority(ScoresFrom.model_validate({"from": "nope"}), RESULTS, GEO)
