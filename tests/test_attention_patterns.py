"""headlab.attention_patterns: the chosen heads' attention on one prompt equals eager attention's
``softmax(QK^T / sqrt(d) + causal mask)`` (transformers' eager implementation with ``output_attentions``, the
same weights) on a tiny random Llama with grouped-query attention; the top heads by magnitude."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import xarray as xr

from headlab.attention_patterns import head_patterns, top_heads

from fixtures.detectors import build_models, tiny_config, word_tokenizer


@pytest.fixture(scope="module")
def models():
    tok = word_tokenizer()
    return build_models(tiny_config(len(tok)), seed=3, tokenizer=tok)


def test_head_patterns_equal_eager_softmax_qk(models):
    lm, by_impl = models
    prompt = "ant bee cat dog . ant bee cat ?"
    heads = [(1, 3), (0, 0), (1, 0), (0, 2)]
    att = head_patterns(lm, prompt, heads)
    ids = lm.tokenizer(prompt, return_tensors="pt")["input_ids"]
    n = ids.shape[1]
    with torch.no_grad():
        eager = by_impl["eager"](input_ids=ids, output_attentions=True).attentions  # per layer (1, H, n, n)
    assert att.dims == ("rank", "query", "key") and att.shape == (4, n, n)
    for rank, (layer, head) in enumerate(heads):
        assert (int(att["layer"][rank]), int(att["head"][rank])) == (layer, head)
        np.testing.assert_allclose(att.isel(rank=rank).values, eager[layer][0, head].numpy(), atol=1e-5)
    rows = att.values.sum(-1)
    np.testing.assert_allclose(rows, 1.0, atol=1e-5)
    assert np.all(np.triu(att.values[0], 1) == 0)  # causal: nothing above the diagonal
    words = ["<bos>", *prompt.split()]
    assert list(att["query_token"].values) == list(att["key_token"].values) == words
    # token ids give the same pattern
    same = head_patterns(lm, ids[0].tolist(), heads[:1])
    np.testing.assert_allclose(same.values[0], att.values[0], atol=1e-6)


def test_head_patterns_refuse_long_prompts_and_unknown_heads(models):
    lm, _ = models
    with pytest.raises(ValueError, match="10 tokens, more than max_tokens=8"):
        head_patterns(lm, "ant bee cat dog . ant bee cat ?", [(0, 0)], max_tokens=8)
    with pytest.raises(ValueError, match=r"head \(2, 0\) is not a head of this model \(2 layers x 4 heads\)"):
        head_patterns(lm, "ant bee", [(2, 0)])


def test_top_heads_by_magnitude():
    score = xr.DataArray([[0.1, -0.9, 0.3], [np.nan, 0.5, -0.2]], dims=("layer", "head"),
                         coords={"layer": [0, 1], "head": [0, 1, 2]})
    assert top_heads(score, 3) == [(0, 1), (1, 1), (0, 2)]
    assert top_heads(score, 6)[-1] == (1, 0)  # NaN last
    per_token = xr.concat([score * 0, score], dim="token").transpose("layer", "head", "token")
    assert top_heads(per_token, 2) == [(0, 1), (1, 1)]
    with pytest.raises(ValueError, match="layer, head"):
        top_heads(score.rename(head="kv_head"))
