"""ships (docs/methods.md#ships): the batched detector equals the reference's loop, written here on the eager
model: for every head, that head's rows of the query projection (and its bias) multiplied by epsilon, one
forward per head at batch 1, and ``KL(p || q)`` of the last position with 1e-12 in both logs; under GQA (Llama),
with a query bias (Qwen2) and under multi-head attention (GPT-2); ``output`` mode against a zeroed slice of the
output projection's input."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from headlab import Example, StepContext
from headlab.plugins.detectors.ships import Ships, detect

from fixtures.circuits import ARCHS, models

PROMPTS = ["ant bee cat dog : ant", "fox gnu . hen jay", "cat cat dog eel fox gnu hen : cat"]


def _kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    p = torch.softmax(p_logits.double(), -1)
    q = torch.softmax(q_logits.double(), -1)
    return float((p * torch.log((p + 1e-12) / (q + 1e-12))).sum())


def _query_rows(model, arch: str, layer: int, head: int, d_head: int):
    """The (weight, bias) slices of ``head``'s query in the eager model (gpt2: columns of ``c_attn``)."""
    sl = slice(head * d_head, (head + 1) * d_head)
    if arch == "gpt2":
        attn = model.transformer.h[layer].attn.c_attn
        return [(attn.weight, (slice(None), sl)), (attn.bias, (sl,))]
    q = model.model.layers[layer].self_attn.q_proj
    parts = [(q.weight, (sl,))]
    if q.bias is not None:
        parts.append((q.bias, (sl,)))
    return parts


def _reference(model, arch, tok, L, H, d_head, epsilon=1e-4, mode="query"):
    """(prompt, layer, head) the reference loop: one forward per head at batch 1."""
    out = np.zeros((len(PROMPTS), L, H))
    with torch.no_grad():
        for e, prompt in enumerate(PROMPTS):
            ids = torch.tensor([tok(prompt).input_ids])
            base = model(input_ids=ids).logits[0, -1]
            for layer in range(L):
                for head in range(H):
                    if mode == "query":
                        parts = _query_rows(model, arch, layer, head, d_head)
                        saved = [p[index].clone() for p, index in parts]
                        for p, index in parts:
                            p[index] *= epsilon
                        try:
                            logits = model(input_ids=ids).logits[0, -1]
                        finally:
                            for (p, index), s in zip(parts, saved, strict=True):
                                p[index] = s
                    else:
                        proj = (model.transformer.h[layer].attn.c_proj if arch == "gpt2"
                                else model.model.layers[layer].self_attn.o_proj)

                        def zero(module, args, head=head):
                            z = args[0].clone()
                            z[..., head * d_head:(head + 1) * d_head] = 0
                            return (z, *args[1:])

                        handle = proj.register_forward_pre_hook(zero)
                        try:
                            logits = model(input_ids=ids).logits[0, -1]
                        finally:
                            handle.remove()
                    out[e, layer, head] = _kl(base, logits)
    return out


@pytest.mark.parametrize("arch", ARCHS)
def test_ships_equals_the_reference_loop(arch):
    tok, lm, out = models(arch)
    for model in out.values():
        model.double()
    geo = lm.geometry
    ctx = StepContext(model=lm, examples=[Example(prompt=p) for p in PROMPTS], results={}, seed=0)
    ds = detect(Ships(batch_size=3, per_prompt=True), ctx)  # 9 rows per prompt: 3 forwards
    want = _reference(out["eager"], arch, tok, geo.n_layers, geo.n_heads, geo.head_dim)
    assert want.min() > 0
    np.testing.assert_allclose(ds["kl"].values, want, rtol=1e-5)
    np.testing.assert_allclose(ds["score"].values, want.mean(0), rtol=1e-5)
    assert ds["kl"].dims == ("example", "layer", "head") and ds["score"].dims == ("layer", "head")


def test_output_mode_and_no_per_prompt_values():
    tok, lm, out = models("llama")
    for model in out.values():
        model.double()
    geo = lm.geometry
    ctx = StepContext(model=lm, examples=[Example(prompt=p) for p in PROMPTS], results={}, seed=0)
    ds = detect(Ships(mode="output"), ctx)
    want = _reference(out["eager"], "llama", tok, geo.n_layers, geo.n_heads, geo.head_dim, mode="output")
    np.testing.assert_allclose(ds["score"].values, want.mean(0), rtol=1e-5)
    assert "kl" not in ds and ds.attrs["mode"] == "output"
