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

from fixtures.circuits import ARCHS, POST_NORM_ARCHS, eps, gain, models, pair_examples, randomise_norms
from fixtures.detectors import build_models, tiny_config, word_tokenizer


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


# --------------------------------------------------------------------------- rest, from its own definition
def _models_with_random_biases(arch: str):
    """``models(arch)`` in float64 with every bias outside the norms random (transformers initialises them to
    zero, where a missing bias term would go unseen); Llama with attention and MLP biases (``o_proj.bias``).
    The reference reads the same transformers model unpadded, one example at a time (the eager attention of
    transformers takes its softmax in float32, 1e-6 off in float64)."""
    if arch == "llama_bias":
        tok = word_tokenizer()
        lm, out = build_models(tiny_config(len(tok), initializer_range=0.2, attention_bias=True, mlp_bias=True),
                               tokenizer=tok)
        randomise_norms(out)
    else:
        tok, lm, out = models(arch)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in lm.model.named_parameters():
            if name.endswith("bias") and "norm" not in name and ".ln_" not in name:
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
    lm.model.double()
    return tok, lm


def rest_reference(model, ids: list[int], answer: int, wrong: int) -> tuple[float, float]:
    """``(rest, logit_diff)`` of one example, float64, from the definition: at the last position, the direct
    paths other than the heads' ``z W_O`` (the embeddings, each MLP's output and each attention output
    projection's bias; on a post-norm model each through its own norm, the attention norm's scale frozen at the
    layer's attention output), each through the final norm's linear part with its scale frozen at the final
    residual and dotted with ``W_U[answer] - W_U[wrong]``, plus the final norm's bias and the unembedding's bias
    terms. The residual stream's summands are read by forward hooks and asserted to add up to the final residual."""
    gpt2 = model.config.model_type == "gpt2"
    base = model.transformer if gpt2 else model.model
    blocks = base.h if gpt2 else base.layers
    post_norm = hasattr(blocks[0], "post_feedforward_layernorm")
    seen: dict = {}

    def keep(key, pre: bool = False):
        def hook(module, args, out=None):
            t = args[0] if pre else (out[0] if isinstance(out, tuple) else out)
            seen[key] = t[0, -1].detach().double()
        return hook

    hooks = [blocks[0].register_forward_pre_hook(keep("emb", pre=True))]
    if gpt2:
        hooks += [base.wte.register_forward_hook(keep("wte")), base.wpe.register_forward_hook(keep("wpe"))]
    for i, block in enumerate(blocks):
        attn = block.attn if gpt2 else block.self_attn
        if post_norm:  # the summands are the norms' outputs; the attention norm's input sets its frozen scale
            hooks += [block.post_attention_layernorm.register_forward_pre_hook(keep(("attn_in", i), pre=True)),
                      block.post_attention_layernorm.register_forward_hook(keep(("attn", i))),
                      block.post_feedforward_layernorm.register_forward_hook(keep(("mlp", i)))]
        else:
            hooks += [attn.register_forward_hook(keep(("attn", i))), block.mlp.register_forward_hook(keep(("mlp", i)))]
    norm = base.ln_f if gpt2 else base.norm
    hooks += [norm.register_forward_pre_hook(keep("x", pre=True)), norm.register_forward_hook(keep("y"))]
    try:
        with torch.no_grad():
            model(input_ids=torch.tensor([ids]))
    finally:
        for h in hooks:
            h.remove()
    L = len(blocks)
    x = seen["x"]
    summands = seen["emb"] + sum(seen[("attn", i)] + seen[("mlp", i)] for i in range(L))
    torch.testing.assert_close(summands, x, atol=1e-9, rtol=0)  # nothing else enters the residual stream
    if gpt2:
        torch.testing.assert_close(seen["wte"] + seen["wpe"], seen["emb"], atol=1e-12, rtol=0)

    def centred(c):
        return c - c.mean() if gpt2 else c

    scale = torch.sqrt((centred(x) ** 2).mean() + eps(norm))

    def final_linear(c):
        return centred(c) / scale * gain(norm)

    W_U = model.lm_head.weight.detach().double()
    direction = W_U[answer] - W_U[wrong]
    parts = [seen["emb"]] + [seen[("mlp", i)] for i in range(L)]
    for i, block in enumerate(blocks):
        out_proj = block.attn.c_proj if gpt2 else block.self_attn.o_proj
        if out_proj.bias is None:
            continue
        b = out_proj.bias.detach().double()
        if post_norm:
            post = block.post_attention_layernorm
            b = b / torch.sqrt((seen[("attn_in", i)] ** 2).mean() + eps(post)) * gain(post)
        parts.append(b)
    rest = sum(float(final_linear(c) @ direction) for c in parts)
    if getattr(norm, "bias", None) is not None:
        rest += float(norm.bias.detach().double() @ direction)
    if model.lm_head.bias is not None:
        rest += float(model.lm_head.bias[answer] - model.lm_head.bias[wrong])
    diff = float(seen["y"] @ direction)
    if model.lm_head.bias is not None:
        diff += float(model.lm_head.bias[answer] - model.lm_head.bias[wrong])
    return rest, diff


@pytest.mark.parametrize("arch", ["gpt2", "llama_bias", *ARCHS[:2], *POST_NORM_ARCHS])
def test_rest_equals_the_embeddings_mlps_and_biases_through_the_frozen_final_norm(arch):
    """``rest`` is computed by the detector as ``logit_diff`` minus the head terms; here it is built from its
    own definition (float64 models) and compared to 1e-6."""
    tok, lm = _models_with_random_biases(arch)
    examples = pair_examples(tok)
    ds = detect(DirectLogitAttribution(batch_size=3), StepContext(model=lm, examples=examples, results={}, seed=0))
    # gemma2's and olmo2's RMS norms compute in float32 whatever the model's dtype: 1e-7 relative rounding
    tol = 1e-5 if arch in POST_NORM_ARCHS else 1e-6
    for i, ex in enumerate(examples):
        rest, diff = rest_reference(lm.model, tok(ex.prompt).input_ids, ex.meta["answer_id"], ex.meta["wrong_id"])
        assert float(ds["logit_diff"][i]) == pytest.approx(diff, abs=tol)
        assert float(ds["rest"][i]) == pytest.approx(rest, abs=tol)
        assert abs(rest) > 1e-2
