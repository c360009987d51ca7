"""head_importance (docs/methods.md#gradient-head-importance): ``raw`` equals central finite differences, in
float64, of a scale ``xi`` on each head's output ``z`` (the input of the output projection of a copy of the model
under transformers' SDPA attention, hooked here), at every position (per example, per batch) or at one position (per token), for each ``abs`` convention,
on Llama with GQA, Qwen2 and GPT-2, over a left-padded batch; the normalisations; the logit-difference metric."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from headlab import Example, StepContext, forward, tokenize
from headlab.plugins.detectors.head_importance import HeadImportance, detect

from fixtures.circuits import ARCHS, models, pair_examples

# prompts of different lengths and targets of one or two tokens: the batches are left-padded
ITEMS = [("ant bee cat dog : ant", " bee"), ("fox gnu . hen", " jay fox"), ("cat cat dog eel fox gnu hen : cat", " dog"),
         ("bee ant", " cat cat")]


def _exact_norms(model) -> None:
    """Make every RMS norm of ``model`` compute in the model's dtype (transformers' compute in float32, whose
    rounding would swamp the finite differences of a float64 model)."""
    for module in model.modules():
        if type(module).__name__.endswith("RMSNorm"):
            def fwd(x, module=module):
                var = x.pow(2).mean(-1, keepdim=True)
                return module.weight * (x * torch.rsqrt(var + module.variance_epsilon))
            module.forward = fwd


def _out_projection(model, arch: str, layer: int):
    return model.transformer.h[layer].attn.c_proj if arch == "gpt2" else model.model.layers[layer].self_attn.o_proj


def _loss(model, ids: list[int], n_target: int, rows: int) -> torch.Tensor:
    """Mean cross-entropy of the last ``n_target`` tokens, for ``rows`` copies of one unpadded sequence."""
    x = torch.tensor([ids] * rows)
    logits = model(input_ids=x).logits.double()
    logp = torch.log_softmax(logits[:, -n_target - 1:-1], dim=-1)
    return -logp.gather(-1, x[:, -n_target:, None])[..., 0].mean(-1)


def _finite_differences(model, arch, tok, items, n_heads, n_layers, eps=1e-4):
    """(example, layer, head) d L / d xi with z[h] scaled by xi at every position, and (example, layer, head,
    position) with z[h, t] scaled at position t only; each example alone (no padding)."""
    whole, per_token = [], []
    for prompt, target in items:
        ids = tok(prompt + target).input_ids
        n_target = len(ids) - len(tok(prompt).input_ids)
        T = len(ids)
        w_e = np.zeros((n_layers, n_heads))
        t_e = np.zeros((n_layers, n_heads, T))
        for layer in range(n_layers):
            for head in range(n_heads):
                # rows: +eps, -eps at every position, then +eps, -eps at each position t
                scale = torch.ones(2 + 2 * T, T, dtype=torch.float64)
                scale[0], scale[1] = 1 + eps, 1 - eps
                for t in range(T):
                    scale[2 + 2 * t, t], scale[3 + 2 * t, t] = 1 + eps, 1 - eps

                def pre(module, args, head=head, scale=scale):
                    z = args[0].clone()
                    d = z.shape[-1] // n_heads
                    z[..., head * d:(head + 1) * d] *= scale[:, :, None]
                    return (z, *args[1:])

                handle = _out_projection(model, arch, layer).register_forward_pre_hook(pre)
                try:
                    with torch.no_grad():
                        loss = _loss(model, ids, n_target, len(scale)).numpy()
                finally:
                    handle.remove()
                w_e[layer, head] = (loss[0] - loss[1]) / (2 * eps)
                t_e[layer, head] = (loss[2::2] - loss[3::2]) / (2 * eps)
        whole.append(w_e)
        per_token.append(t_e)
    return np.stack(whole), per_token


@pytest.mark.parametrize("arch", ARCHS)
def test_raw_equals_finite_differences_of_a_scale_on_z(arch):
    tok, lm, out = models(arch)
    # the reference copy runs SDPA, whose float64 softmax is float64 (the eager attention's is float32)
    reference = out["eager"]
    reference.set_attn_implementation("sdpa")
    for model in (lm.model, reference):
        _exact_norms(model.double())
    examples = [Example(prompt=p, target=t) for p, t in ITEMS]
    ctx = StepContext(model=lm, examples=examples, results={}, seed=0)
    L, H = lm.geometry.n_layers, lm.geometry.n_heads
    whole, per_token = _finite_differences(reference, arch, tok, ITEMS, H, L)
    assert np.abs(whole).max() > 1e-3
    want = {"per_example": np.abs(whole).mean(0),
            "per_token": np.mean([np.abs(t).sum(-1) for t in per_token], axis=0),
            # batches of 3 examples: [0, 1, 2] (left-padded) and [3]
            "per_batch": (np.abs(whole[:3].sum(0)) + np.abs(whole[3])) / 4}
    for convention, expected in want.items():
        ds = detect(HeadImportance(abs=convention, normalize="none", batch_size=3), ctx)
        raw = ds["raw"].values
        np.testing.assert_allclose(raw, expected, rtol=1e-4, atol=1e-9 * np.abs(expected).max(), err_msg=convention)
        np.testing.assert_array_equal(ds["score"].values, raw)
    assert ds["raw"].dims == ("layer", "head") and ds.attrs["abs"] == "per_batch"
    # each example's loss, as the reference copy computes it alone
    with torch.no_grad():
        losses = [_loss(reference, tok(p + t).input_ids, len(tok(p + t).input_ids) - len(tok(p).input_ids),
                        1).item() for p, t in ITEMS]
    np.testing.assert_allclose(ds["loss"].values, losses, rtol=1e-10)


def test_normalisations_and_the_model_is_left_as_it_was():
    tok, lm, _ = models("llama")
    examples = [Example(prompt=p, target=t) for p, t in ITEMS]
    ctx = StepContext(model=lm, examples=examples, results={}, seed=0)
    batch = tokenize(lm, examples)
    before = forward(lm, batch)[0].logits
    l2 = detect(HeadImportance(), ctx)
    # no parameter gets a gradient and no hook stays behind
    assert all(p.grad is None for p in lm.model.parameters())
    assert torch.equal(forward(lm, batch)[0].logits, before)
    raw = l2["raw"].values
    by_layer = raw / np.sqrt((raw ** 2).sum(-1, keepdims=True))
    np.testing.assert_allclose(l2["score"].values, by_layer, rtol=1e-12)
    minmax = detect(HeadImportance(normalize="global_minmax"), ctx)["score"].values
    np.testing.assert_allclose(minmax, (by_layer - by_layer.min()) / (by_layer.max() - by_layer.min()), rtol=1e-9)
    assert minmax.min() == 0 and minmax.max() == 1


def test_logit_difference_metric_equals_the_gradient_of_the_eager_model():
    """``metric: logit_diff`` on a pair task: per example, ``z . d(logit[answer] - logit[wrong]) / d z`` at the
    last prompt position, from autograd through the eager model's output projection inputs (one prompt alone)."""
    tok, lm, out = models("qwen2")
    examples = pair_examples(tok)
    ctx = StepContext(model=lm, examples=examples, results={}, seed=0)
    ds = detect(HeadImportance(metric="logit_diff", normalize="none"), ctx)
    model, L, H = out["eager"], lm.geometry.n_layers, lm.geometry.n_heads
    want = np.zeros((len(examples), L, H))
    for e, ex in enumerate(examples):
        zs = []

        def keep(module, args, zs=zs):
            zs.append(args[0])

        handles = [_out_projection(model, "qwen2", layer).register_forward_pre_hook(keep) for layer in range(L)]
        try:
            logits = model(input_ids=torch.tensor([tok(ex.prompt).input_ids])).logits[0, -1]
        finally:
            for h in handles:
                h.remove()
        m = logits[ex.meta["answer_id"]] - logits[ex.meta["wrong_id"]]
        grads = torch.autograd.grad(m, zs)
        for layer, (z, g) in enumerate(zip(zs, grads, strict=True)):
            want[e, layer] = (z * g).detach().view(*z.shape[:-1], H, -1).sum((0, 1, 3)).numpy()
    np.testing.assert_allclose(ds["raw"].values, np.abs(want).mean(0), rtol=1e-4, atol=1e-6 * np.abs(want).max())
