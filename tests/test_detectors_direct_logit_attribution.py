"""direct_logit_attribution (docs/methods.md#direct-logit-attribution) against an explicit computation: an eager
copy of the model, one unpadded example at a time, the heads' outputs read by a forward pre-hook on the output
projection and the final residual by one on the final norm; each head's term written out from the projection
weights, the norm's weight and eps (TransformerLens' apply_ln: the scale of the actual residual, frozen; gemma2
and olmo2 also through the attention output's own norm, its scale frozen the same way)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from headlab import StepContext
from headlab.plugins.detectors.direct_logit_attribution import DirectLogitAttribution, detect

from fixtures.circuits import ARCHS, POST_NORM_ARCHS, eps, gain, models, pair_examples


def reference(model, arch: str, ids: list[int], answer: int, wrong: int, n_heads: int):
    """(per-head terms (layer, head), logit[answer] - logit[wrong] before any final soft-capping) of one
    example, float64."""
    captured: dict = {}
    hooks = []
    base = model.transformer if arch == "gpt2" else model.model
    blocks = base.h if arch == "gpt2" else base.layers
    for i, block in enumerate(blocks):
        out_proj = block.attn.c_proj if arch == "gpt2" else block.self_attn.o_proj
        hooks.append(out_proj.register_forward_pre_hook(
            lambda m, args, i=i: captured.__setitem__(i, args[0][0, -1].detach().double())))
        if arch in POST_NORM_ARCHS:
            hooks.append(block.post_attention_layernorm.register_forward_pre_hook(
                lambda m, args, i=i: captured.__setitem__(("post", i), args[0][0, -1].detach().double())))
    norm = base.ln_f if arch == "gpt2" else base.norm
    hooks.append(norm.register_forward_pre_hook(lambda m, args: captured.__setitem__("x", args[0][0, -1].double())))
    hooks.append(norm.register_forward_hook(lambda m, args, out: captured.__setitem__("y", out[0, -1].double())))
    try:
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1].double()
    finally:
        for h in hooks:
            h.remove()
    x = captured["x"]
    if arch == "gpt2":
        scale = torch.sqrt(((x - x.mean()) ** 2).mean() + norm.eps)
    else:
        scale = torch.sqrt((x ** 2).mean() + eps(norm))
    W_U = model.lm_head.weight.detach().double()
    direction = W_U[answer] - W_U[wrong]
    pre_cap = captured["y"] @ direction
    if arch != "gemma2":  # the model's own logits (gemma2 soft-caps them)
        assert float(logits[answer] - logits[wrong]) == pytest.approx(float(pre_cap), abs=1e-4)
    terms = np.zeros((len(blocks), n_heads))
    for layer, block in enumerate(blocks):
        z = captured[layer].view(n_heads, -1)
        d = z.shape[-1]
        for h in range(n_heads):
            if arch == "gpt2":  # Conv1D stores (in, out)
                c = z[h] @ block.attn.c_proj.weight[h * d:(h + 1) * d].detach().double()
                c = c - c.mean()
            else:  # nn.Linear stores (out, in)
                c = block.self_attn.o_proj.weight[:, h * d:(h + 1) * d].detach().double() @ z[h]
            if arch in POST_NORM_ARCHS:
                a, post = captured[("post", layer)], block.post_attention_layernorm
                c = c / torch.sqrt((a ** 2).mean() + eps(post)) * gain(post)
            terms[layer, h] = float((c / scale * gain(norm)) @ direction)
    return terms, float(pre_cap)


@pytest.mark.parametrize("arch", ARCHS + POST_NORM_ARCHS)
def test_head_terms_equal_the_explicit_computation_and_sum_with_the_rest_to_the_logit_difference(arch):
    tok, lm, eager = models(arch)
    examples = pair_examples(tok)
    ctx = StepContext(model=lm, examples=examples, results={}, seed=0)
    ds = detect(DirectLogitAttribution(batch_size=3), ctx)  # one left-padded batch of three lengths
    H = lm.geometry.n_heads
    for i, ex in enumerate(examples):
        ids = tok(ex.prompt).input_ids
        terms, diff = reference(eager["eager"], arch, ids, ex.meta["answer_id"], ex.meta["wrong_id"], H)
        np.testing.assert_allclose(ds["dla"].isel(example=i).values, terms, atol=1e-5, rtol=1e-5)
        assert float(ds["logit_diff"][i]) == pytest.approx(diff, abs=1e-4)
        total = float(ds["dla"].isel(example=i).sum()) + float(ds["rest"][i])
        assert total == pytest.approx(diff, abs=1e-4)
        assert abs(float(ds["rest"][i])) > 1e-3  # the embeddings and MLPs contribute: rest is not empty
    np.testing.assert_allclose(ds["score"].values, ds["dla"].mean("example").values)
    assert ds["score"].dims == ("layer", "head")
    assert ds.attrs["reference"] == "docs/methods.md#direct-logit-attribution"
    assert ds.attrs["final_norm"] == ("layer_norm" if arch == "gpt2" else "rms_norm")


def test_examples_without_answer_tokens_are_refused():
    from headlab import Example

    tok, lm, _ = models("llama")
    ctx = StepContext(model=lm, examples=[Example(prompt="ant bee")], results={}, seed=0)
    with pytest.raises(ValueError, match="example 0 has no answer_id / wrong_id.*use a pair task"):
        detect(DirectLogitAttribution(), ctx)
