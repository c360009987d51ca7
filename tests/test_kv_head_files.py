"""Head files as KV policy inputs: HeadKV's (and the retrieval-head) JSON score file ``{"<layer>-<head>":
[scores]}`` as a ``full_heads`` selection (``top``, ``threshold``, a budget's ranking) and as ``headkv``'s
scores, DuoAttention's ``.tsv`` as ``headkv``'s scores, and the errors of a bad file."""

from __future__ import annotations

import json
import random
from types import SimpleNamespace

import numpy as np
import pytest

from headlab import component
from headlab.geometry import Geometry
from headlab.kv import KvPolicyError, ScoresFile, kv_heads, read_head_scores

GEO = Geometry(n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8)
# KV head (0,0): 0.9/0.0, (0,1): 0.5/0.5, (1,0): 0.6/0.4, (1,1): 0.1/0.2
SCORES = np.array([[0.9, 0.0, 0.5, 0.5], [0.6, 0.4, 0.1, 0.2]])


def _headkv_file(tmp_path, scores=SCORES, drop=()) -> str:
    """A file as HeadKV publishes them: one single-score list per head, keys shuffled, pretty-printed."""
    items = [(f"{ly}-{h}", [float(scores[ly, h])]) for ly in range(scores.shape[0]) for h in range(scores.shape[1])
             if f"{ly}-{h}" not in drop]
    random.Random(0).shuffle(items)
    path = tmp_path / "Model_retrieval_reasoning_heads.json"
    path.write_text(json.dumps(dict(items), indent=4))
    return str(path)


def _compile(kind: str, **config):
    comp = component("kv", kind)
    ctx = SimpleNamespace(model=SimpleNamespace(geometry=GEO, dtype="float32"), results={}, seed=0)
    return comp.impl(comp.config.model_validate({"kind": kind, **config}), ctx)


def _on(full) -> list[tuple[int, int]]:
    return [(int(a), int(b)) for a, b in zip(*np.nonzero(full.values), strict=True)]


def test_read_head_scores(tmp_path):
    path = _headkv_file(tmp_path)
    scores = read_head_scores(path, GEO)
    assert scores.dims == ("layer", "head") and scores.values.tolist() == SCORES.tolist()
    several = tmp_path / "several.json"
    several.write_text(json.dumps({"0-1": [0.2, 0.4], "1-0": 0.5}))  # a list is averaged; a number is one score
    got = read_head_scores(several, GEO).values
    assert got[0, 1] == pytest.approx(0.3) and got[1, 0] == 0.5 and np.isnan(got[0, 0])
    assert read_head_scores(several).shape == (2, 2)  # without a geometry: as large as the file says


@pytest.mark.parametrize(("text", "message"), [
    ("{", "line 1 column 2: not JSON"),
    ('{"0": [1, 2]}', "not a head-score file"),
    ('[0, 1]', "not a head-score file"),
    ('{"a-b": [1]}', "a key is not"),
    ('{"0-9": [1]}', "head 0-9 is outside this model"),
    ('{"0-1": [NaN]}', "the score of head 0-1 is not finite"),
])
def test_a_bad_score_file_is_one_located_error(tmp_path, text, message):
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(KvPolicyError, match=message) as info:
        read_head_scores(path, GEO)
    assert str(path) in str(info.value) and "\n" not in str(info.value)
    with pytest.raises(KvPolicyError, match="does not exist"):
        read_head_scores(tmp_path / "missing.json")


def test_a_headkv_file_as_full_heads(tmp_path):
    path = _headkv_file(tmp_path)
    assert _on(_compile("streaming", full_heads={"file": path, "top": 2}, window=4).kv_full) == [(0, 0), (1, 0)]
    # a threshold on the aggregate: any -> 0.9, 0.5, 0.6, 0.2; mean -> 0.45, 0.5, 0.5, 0.15
    config = component("kv", "streaming").config.model_validate(
        {"kind": "streaming", "full_heads": {"file": path, "threshold": 0.55}, "window": 4})
    assert isinstance(config.full_heads, ScoresFile)
    assert _on(_compile("streaming", full_heads={"file": path, "threshold": 0.55}, window=4).kv_full) == [(0, 0), (1, 0)]
    mean = _compile("streaming", full_heads={"file": path, "threshold": 0.5}, window=4, gqa="mean")
    assert _on(mean.kv_full) == [(0, 1), (1, 0)]
    # a file that lacks a head: that head is never full (its KV head ranks by the other query head under any)
    partial = _headkv_file(tmp_path, drop={"0-0"})
    assert _on(_compile("streaming", full_heads={"file": partial, "top": 1}, window=4).kv_full) == [(1, 0)]
    with pytest.raises(KvPolicyError, match="give `threshold`"):
        kv_heads(ScoresFile(file=path), {}, GEO)


def test_score_files_as_headkv_scores(tmp_path):
    # gqa mean of the file's scores: 0.45, 0.5, 0.5, 0.15 -> HeadKV's split of 32 tokens + the window of 8
    hm = _compile("headkv", scores={"file": _headkv_file(tmp_path)}, budget={"tokens_per_head": 40})
    assert hm.budget_dataarray().values.tolist() == [[43, 45], [45, 27]]
    # DuoAttention's gates are KV-head scores already: 0.45, 0.5, 0.5, 0.15 written per KV head give the same
    gates = tmp_path / "full_attention_heads.tsv"
    gates.write_text("0.45\t0.5\n0.5\t0.15\n")
    by_tsv = _compile("headkv", scores={"file": str(gates)}, budget={"tokens_per_head": 40})
    assert by_tsv.budget_dataarray().values.tolist() == [[43, 45], [45, 27]]
    pasta = tmp_path / "pasta.json"
    pasta.write_text(json.dumps({"0": [1]}))
    with pytest.raises(KvPolicyError, match="not a head-score file"):
        _compile("headkv", scores={"file": str(pasta)}, budget={"tokens_per_head": 40})
