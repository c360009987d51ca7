"""prune_curve (docs/methods.md#pruning-curve): on a model with one planted important head, the curve pruned by
gradient importance falls later than the reverse-order control; the metric at each fraction equals a run of the
eager model written here with the recorded mask's heads zeroed at the output projection's input; the random
control is seeded; recompute ranks again under the mask; min_per_layer keeps heads in every layer."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from headlab import Example, Plan, ReplaceZ, StepContext
from headlab.plugin_manager import get_manager
from headlab.plugins.actions.prune_curve import prune_curve, prune_curve_config, pruning_sequence
from headlab.plugins.detectors.head_importance import HeadImportance
from headlab.plugins.detectors.head_importance import detect as importance
from headlab.spec import SpecTypes

from fixtures.circuits import models

PLANTED = (1, 2)
PROMPTS = ["ant bee cat dog :", "fox gnu . hen", "cat cat dog eel fox gnu hen :", "bee ant", "jay ibis hen .",
           "dog : fox", "eel eel", "gnu hen jay : ant bee"]


def _planted():
    """A tiny Llama (2 layers x 4 heads, GQA) whose head ``PLANTED`` writes 20 times more than any other, and
    examples choosing between the model's two likeliest next tokens (the first one right)."""
    tok, lm, out = models("llama", seed=1)
    H, D = lm.geometry.n_heads, lm.geometry.head_dim
    with torch.no_grad():
        for model in out.values():
            for layer in range(lm.geometry.n_layers):
                o = model.model.layers[layer].self_attn.o_proj.weight
                for head in range(H):
                    o[:, head * D:(head + 1) * D] *= 1.0 if (layer, head) == PLANTED else 0.05
    examples = []
    for prompt in PROMPTS:
        with torch.no_grad():
            logits = out["eager"](input_ids=torch.tensor([tok(prompt).input_ids])).logits[0, -1]
        logits[:4] = -torch.inf  # no special token
        first, second = torch.topk(logits, 2).indices.tolist()
        choices = [" " + tok.convert_ids_to_tokens(first), " " + tok.convert_ids_to_tokens(second)]
        examples.append(Example(prompt=prompt, target=choices[0], choices=choices, label=0))
    return tok, lm, out, examples


def _accuracy(model, tok, examples, heads) -> float:
    """The fraction of examples whose right choice scores above the other with ``heads``' outputs zeroed."""
    D = model.config.hidden_size // model.config.num_attention_heads
    handles = []
    for layer in {h[0] for h in heads}:
        gone = [h for l_, h in heads if l_ == layer]

        def zero(module, args, gone=gone):
            z = args[0].clone()
            for head in gone:
                z[..., head * D:(head + 1) * D] = 0
            return (z, *args[1:])

        handles.append(model.model.layers[layer].self_attn.o_proj.register_forward_pre_hook(zero))
    try:
        right = []
        for ex in examples:
            with torch.no_grad():
                logp = torch.log_softmax(model(input_ids=torch.tensor([tok(ex.prompt).input_ids])).logits[0, -1], -1)
            a, b = (tok(ex.prompt + c).input_ids[-1] for c in ex.choices)
            right.append(float(logp[a] > logp[b]))
    finally:
        for h in handles:
            h.remove()
    return float(np.mean(right))


def _config(**over):
    types = SpecTypes(get_manager().registry)
    data = {"heads": {"from": "imp"}, "measure": {"score": {"metrics": ["accuracy"]}},
            "fractions": [0.25, 0.5, 0.75, 1.0], "n_random": 2, **over}
    return prune_curve_config(types).model_validate(data)


@pytest.fixture(scope="module")
def planted():
    tok, lm, out, examples = _planted()
    ctx = StepContext(model=lm, examples=examples, results={}, seed=0)
    imp = importance(HeadImportance(), ctx)
    ctx = StepContext(model=lm, examples=examples, results={"imp": imp}, seed=0)
    return tok, lm, out, examples, ctx, imp


def test_a_planted_head_makes_the_curve_fall_later_than_the_reverse_control(planted):
    tok, lm, out, examples, ctx, imp = planted
    ds = prune_curve(_config(), ctx)
    assert (int(ds["order_layer"][0]), int(ds["order_head"][0])) == PLANTED
    assert ds["base"] == 1.0
    metric, reverse = ds["metric"].values, ds["reverse"].values
    assert metric[0] == 1.0 and reverse[0] < 0.75  # the planted head goes first in the reverse order
    assert (metric[:-1] >= reverse[:-1]).all() and metric[:-1].sum() > reverse[:-1].sum()
    assert metric[-1] == reverse[-1]  # every head masked in both
    assert not ds["mask"].values[:-1, PLANTED[0], PLANTED[1]].any() and ds["mask"].values[-1].all()
    np.testing.assert_array_equal(ds["masked"].values, [2, 4, 6, 8])
    # the metric at each fraction: an independent run with the recorded mask
    for f, mask in enumerate(ds["mask"].values):
        heads = [(int(a), int(b)) for a, b in zip(*np.nonzero(mask), strict=True)]
        assert metric[f] == _accuracy(out["eager"], tok, examples, heads)
    # the random control is seeded: the same draws again, its spread over the draws
    again = prune_curve(_config(), ctx)
    np.testing.assert_array_equal(again["random"].values, ds["random"].values)
    np.testing.assert_allclose(ds["random_std"].values, ds["random"].values.std(0, ddof=1))
    assert ds["random"].dims == ("draw", "fraction")


def test_recompute_and_min_per_layer(planted):
    tok, lm, out, examples, ctx, imp = planted
    ds = prune_curve(_config(recompute=True, min_per_layer=1, n_random=1, fractions=[0.25, 0.5, 1.0]), ctx)
    assert (ds["mask"].values.sum(-1) <= 3).all()  # every layer keeps a head
    np.testing.assert_array_equal(ds["masked"].values, [2, 4, 6])
    # each step's mask holds the previous one plus the lowest-ranked heads under it
    masks = ds["mask"].values
    assert (masks[1] >= masks[0]).all() and (masks[2] >= masks[1]).all()
    second = [(int(a), int(b)) for a, b in zip(*np.nonzero(masks[0]), strict=True)]
    under = importance(HeadImportance(), ctx, mask=second)["score"].values
    under[masks[0]] = np.inf  # the masked heads are not candidates
    added = masks[1] & ~masks[0]
    assert under[added].max() <= np.sort(under[~masks[0]].ravel())[1]  # the two lowest unmasked heads
    assert masks[-1][PLANTED] == 0  # min_per_layer keeps the planted head, the last of its layer


def test_pruning_sequence_skips_a_full_layer():
    order = [(0, 0), (0, 1), (1, 0), (0, 2), (1, 1)]
    assert pruning_sequence(order, n_heads=3, min_per_layer=1) == [(0, 0), (0, 1), (1, 0), (1, 1)]


def _eager_means(model, tok, examples) -> torch.Tensor:
    """(layer, head, head_dim) every head's output averaged over every token of every prompt, each prompt run
    alone (no padding), read from the output projection's input."""
    H = model.config.num_attention_heads
    D = model.config.hidden_size // H
    layers = model.model.layers
    sums, count = torch.zeros(len(layers), H, D, dtype=torch.float64), 0
    handles = []
    for i, layer in enumerate(layers):
        def keep(module, args, i=i):
            sums[i] += args[0][0].double().reshape(-1, H, D).sum(0)

        handles.append(layer.self_attn.o_proj.register_forward_pre_hook(keep))
    try:
        for ex in examples:
            ids = tok(ex.prompt).input_ids
            with torch.no_grad():
                model(input_ids=torch.tensor([ids]))
            count += len(ids)
    finally:
        for h in handles:
            h.remove()
    return sums / count


def _eager_mc2(model, tok, examples, heads, means) -> float:
    """The mean over examples of the right choice's probability mass between the two choices, with ``heads``'
    outputs replaced by ``means`` at every position."""
    D = means.shape[-1]
    handles = []
    for layer in {h[0] for h in heads}:
        gone = [h for l_, h in heads if l_ == layer]

        def replace(module, args, layer=layer, gone=gone):
            z = args[0].clone()
            for head in gone:
                z[..., head * D:(head + 1) * D] = means[layer, head].to(z.dtype)
            return (z, *args[1:])

        handles.append(model.model.layers[layer].self_attn.o_proj.register_forward_pre_hook(replace))
    try:
        mass = []
        for ex in examples:
            with torch.no_grad():
                logp = torch.log_softmax(model(input_ids=torch.tensor([tok(ex.prompt).input_ids])).logits[0, -1], -1)
            a, b = (tok(ex.prompt + c).input_ids[-1] for c in ex.choices)
            mass.append(float(torch.sigmoid(logp[a] - logp[b])))
    finally:
        for h in handles:
            h.remove()
    return float(np.mean(mass))


def test_mean_ablation_equals_an_eager_run_with_the_tests_own_means(planted):
    """mode mean on a GQA Llama whose batches are left-padded (prompts of 2 to 8 words, batch_size 3): the
    recorded means equal the test's own (each prompt alone, so padding would show), and the metric at each
    fraction equals an eager run replacing the masked heads' z by those means at the output projection."""
    tok, lm, out, examples, ctx, imp = planted
    config = _config(mode="mean", n_random=1, fractions=[0.25, 0.5, 1.0], metric="mc2",
                     measure={"score": {"metrics": ["mc2"], "batch_size": 3}})
    ds = prune_curve(config, ctx)
    means = _eager_means(out["eager"], tok, examples)
    assert ds["z_mean"].dims == ("layer", "head", "head_dim")
    np.testing.assert_allclose(ds["z_mean"].values, means.numpy(), rtol=1e-4, atol=1e-6)
    assert np.isclose(float(ds["base"]), _eager_mc2(out["eager"], tok, examples, [], means), atol=1e-5)
    for name in ("metric", "reverse"):
        for f in range(len(ds["fraction"])):
            order = [(int(a), int(b)) for a, b in zip(ds["order_layer"].values, ds["order_head"].values,
                                                         strict=True)]
            order = order if name == "reverse" else order[::-1]
            heads = order[:int(ds["masked"][f])]
            assert np.isclose(float(ds[name][f]), _eager_mc2(out["eager"], tok, examples, heads, means), atol=1e-5)
    # not the zero ablation: the planted head's mean is far from 0, and every head masked gives another metric
    assert float(np.abs(ds["z_mean"].values[PLANTED]).max()) > 1e-3
    zero = prune_curve(_config(n_random=1, fractions=[1.0], metric="mc2", measure={"score": {"metrics": ["mc2"]}}),
                       ctx)
    assert not np.isclose(float(zero["metric"][-1]), float(ds["metric"][-1]), atol=1e-4)
    assert "z_mean" not in zero


def test_mean_ablation_on_a_task_without_examples(planted):
    tok, lm, out, examples, ctx, imp = planted
    empty = StepContext(model=lm, examples=[], results={"imp": imp}, seed=0)
    with pytest.raises(ValueError, match="mode mean averages z over the task's prompt tokens, and the task has no "
                                         "examples; give the task examples or use mode: output"):
        prune_curve(_config(mode="mean"), empty)


def test_recompute_under_mean_ablation(planted):
    """recompute with mode mean: the heads added at the second fraction are the two lowest of gradient importance
    with the first fraction's heads replaced by the test's own means, and the metric there equals the eager run."""
    tok, lm, out, examples, ctx, imp = planted
    config = _config(mode="mean", recompute=True, n_random=1, fractions=[0.25, 0.5], metric="mc2",
                     measure={"score": {"metrics": ["mc2"]}})
    ds = prune_curve(config, ctx)
    means = _eager_means(out["eager"], tok, examples)
    masks = ds["mask"].values
    first = [(int(a), int(b)) for a, b in zip(*np.nonzero(masks[0]), strict=True)]
    values = torch.stack([means[h] for h in first])[:, None, :]
    under = importance(HeadImportance(), ctx, plan=Plan().add(ReplaceZ(first, values, from_position=0)))
    under = under["score"].values
    under[masks[0]] = np.inf
    added = masks[1] & ~masks[0]
    assert (masks[1] >= masks[0]).all() and added.sum() == 2
    assert under[added].max() <= np.sort(under[~masks[0]].ravel())[1]
    second = [(int(a), int(b)) for a, b in zip(*np.nonzero(masks[1]), strict=True)]
    assert np.isclose(float(ds["metric"][1]), _eager_mc2(out["eager"], tok, examples, second, means), atol=1e-5)
