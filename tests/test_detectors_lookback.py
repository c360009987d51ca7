"""lookback (docs/methods.md#lookback-ratio) against the reference computation written out here: batch-1
greedy decoding with eager attention and ``output_attentions``, the last attention row of each step,
``mean(A[:C]) / (mean(A[:C]) + mean(A[C:]))``; and the classifier helpers against explicit loops and a
direct scikit-learn fit."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch
import xarray as xr

import headlab

from fixtures.detectors import WORDS, build_models, save_tokenizer, tiny_config, word_tokenizer

MAX_NEW = 6


def reference_lookback(eager, ids: list[int], C: int, max_new: int, eos: int = 2) -> np.ndarray:
    """(tokens, layer, head) lookback ratios, as Lookback Lens' step01 computes them (batch 1)."""
    out = []
    inp = torch.tensor([ids])
    with torch.no_grad():
        o = eager(input_ids=inp, use_cache=True, output_attentions=True)
        for _ in range(max_new):
            rows = torch.stack([a[0, :, -1] for a in o.attentions]).double()  # (layer, head, keys)
            ctx = rows[..., :C].mean(-1)
            new = rows[..., C:].mean(-1) if rows.shape[-1] > C else torch.zeros_like(ctx)
            out.append((ctx / (ctx + new)).numpy())
            token = o.logits[0, -1].argmax()
            if int(token) == eos:
                break
            o = eager(input_ids=token.view(1, 1), cache=o.cache, use_cache=True, output_attentions=True)
    return np.stack(out)


@pytest.fixture(scope="module")
def setup():
    tok = word_tokenizer()
    lm, models = build_models(tiny_config(len(tok), initializer_range=0.1), seed=2, tokenizer=tok)
    return tok, lm, models


def _records(n=5, seed=0):
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        doc = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 10)))
        out.append({"doc": doc, "q": " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 3)))})
    return out


@pytest.mark.parametrize("option", ["tail", "span", "whole"])
def test_lookback_ratios_equal_eager_reference(tmp_path, setup, option):
    tok, _, models = setup
    records = _records()
    path = tmp_path / "lb.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in records))
    cfg = tiny_config(len(tok), initializer_range=0.1, tokenizer=save_tokenizer(tok, tmp_path / "tok"))
    extra = {"tail": "prompt_tail: 2", "span": "context: context", "whole": "prompt_tail: 0"}[option]
    spec = (f"name: t\nseed: 2\nmodel: {{config: {json.dumps(cfg)}}}\n"
            f"task: {{kind: jsonl, path: {path}, prompt: '<c>{{{{ doc }}}}</c> Q {{{{ q }}}} A :', "
            f"span_tags: {{context: c}}}}\n"
            f"steps:\n  - id: lb\n    detect: {{kind: lookback, max_new_tokens: {MAX_NEW}, batch_size: 3, length_slack: 10, {extra}}}\n")
    ds = headlab.run(spec, out=tmp_path / "runs").results["lb"]
    lr = ds["lookback_ratio"].transpose("example", "step", "layer", "head").values
    lengths = []
    for i, r in enumerate(records):
        prompt = f"{r['doc']} Q {r['q']} A :"
        assert str(ds["prompt"].values[i]) == prompt
        ids = tok(prompt)["input_ids"]
        C = {"tail": len(ids) - 2, "span": 1 + len(r["doc"].split()), "whole": len(ids)}[option]
        ref = reference_lookback(models["eager"], ids, C, MAX_NEW)
        n = ref.shape[0]
        lengths.append(n)
        np.testing.assert_allclose(lr[i, :n], ref, atol=1e-5, rtol=0)
        assert np.isnan(lr[i, n:]).all()
        assert int(ds["n_tokens"].values[i]) == n
        np.testing.assert_allclose(ds["features"].values[i], ref.mean(0), atol=1e-5)
        if option == "whole":
            assert (ref[0] == 1).all()  # no new key yet: all of a head's attention is on the context
    assert max(lengths) > 1
    assert 0.01 < np.nanmin(lr) and np.nanmax(lr[:, 1:]) < 0.999


def test_window_features_match_reference_loop():
    from headlab.plugins.detectors.lookback import window_features

    rng = np.random.default_rng(0)
    arr = rng.random((3, 7, 2, 3))
    arr[1, 4:] = np.nan  # example 1 produced 4 tokens
    arr[2, 2:] = np.nan  # example 2 produced 2 (< window): no window
    got = window_features(xr.DataArray(arr, dims=("example", "step", "layer", "head")), size=3)
    expect = []
    for ex, n in ((arr[0], 7), (arr[1], 4), (arr[2], 2)):
        for j in range(3 - 1, n):  # Lookback Lens convert_to_token_level
            expect.append(ex[j - 3 + 1: j + 1].mean(0))
    np.testing.assert_allclose(got, np.stack(expect))


def test_classifier_matches_sklearn_on_flattened_features():
    from sklearn.linear_model import LogisticRegression

    from headlab.plugins.detectors.lookback import LookbackClassifier

    rng = np.random.default_rng(1)
    x = rng.random((40, 2, 3))
    y = (x[:, 1, 2] + 0.3 * x[:, 0, 0] > 0.6).astype(int)
    clf = LookbackClassifier().fit(xr.DataArray(x, dims=("example", "layer", "head")), y)
    ref = LogisticRegression(max_iter=1000).fit(x.reshape(40, 6), y)
    np.testing.assert_allclose(clf.predict_proba(x), ref.predict_proba(x.reshape(40, 6))[:, 1], atol=1e-10)
    # layer-major flattening: the weight of (layer 1, head 2) is the largest
    assert int(np.argmax(clf.weights)) == 1 * 3 + 2
    ds = xr.Dataset({"features": (("example", "layer", "head"), x)})
    assert clf.apply(ds).shape == (40,)
    with pytest.raises(ValueError, match="NaN"):
        clf.predict_proba(np.full((1, 2, 3), np.nan))
