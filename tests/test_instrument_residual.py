"""The per-layer residual edits: ``ReplaceResid`` (``Plan.patch_resid``) against an eager copy of the model whose
decoder layer gets a forward pre-hook overwriting its input hidden states, and ``DropResidGrad``
(``Plan.drop_resid_grad``) against a hook that detaches the layer's write (``input + (output - input).detach()``),
on tiny random Llama (GQA), Qwen2 and GPT-2 models in a left-padded batch."""

from __future__ import annotations

import pytest
import torch

from headlab import AddZ, DropResidGrad, Plan, ReplaceResid, forward

from fixtures.circuits import ARCHS, models

PAD = 2


def _layers(model, arch: str):
    return model.transformer.h if arch == "gpt2" else model.model.layers


def _o_proj(model, arch: str, layer: int):
    return model.transformer.h[layer].attn.c_proj if arch == "gpt2" else model.model.layers[layer].self_attn.o_proj


def _batch(vocab: int, n: int = 8):
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(4, vocab, (2, n), generator=g)
    mask = torch.ones(2, n, dtype=torch.long)
    mask[1, :PAD] = 0
    ids[1, :PAD] = 0
    return ids, mask


def _positions(mask):
    return (mask.cumsum(-1) - 1).clamp(min=0)


@pytest.mark.parametrize("arch", ARCHS)
def test_replace_resid_equals_a_decoder_layer_pre_hook(arch):
    tok, lm, eager = models(arch)
    model = eager["eager"]
    ids, mask = _batch(len(tok))
    d = lm.model.config.hidden_size
    values = torch.randn(2, 2, d, generator=torch.Generator().manual_seed(4))
    layer, positions = 1, [3, 6]
    plan = Plan().add(ReplaceResid(layer, values[:1], rows=[0], positions=positions),
                      ReplaceResid(layer, values[1:, :1], rows=[1], positions=positions[:1]))
    got, _ = forward(lm, ids, plan, attention_mask=mask)

    def hook(module, args, kwargs):
        hidden = (args[0] if args else kwargs["hidden_states"]).clone()
        hidden[0, positions] = values[0]
        hidden[1, positions[:1]] = values[1, :1]
        return ((hidden, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": hidden})

    handle = _layers(model, arch)[layer].register_forward_pre_hook(hook, with_kwargs=True)
    try:
        with torch.no_grad():
            want = model(input_ids=ids, attention_mask=mask, position_ids=_positions(mask)).logits
    finally:
        handle.remove()
    real = mask.bool()
    torch.testing.assert_close(got.logits[real], want[real], atol=1e-5, rtol=0)
    plain, _ = forward(lm, ids, None, attention_mask=mask)
    assert (plain.logits[real] - got.logits[real]).abs().max() > 1e-2  # the replacement changed something


def _head_grads(lm, ids, mask, plan_edits, answer: int):
    """d logit[answer] at the last position / d z of every head of every layer (a leaf of zeros added)."""
    L, H, D = lm.geometry.n_layers, lm.geometry.n_heads, lm.geometry.head_dim
    leaves = [torch.zeros(ids.shape[0], H, ids.shape[1], D, requires_grad=True) for _ in range(L)]
    plan = Plan().add(*(AddZ([(ly, h) for h in range(H)], leaves[ly]) for ly in range(L)), *plan_edits)
    out, _ = forward(lm, ids, plan, attention_mask=mask, grad=True)
    grads = torch.autograd.grad(out.logits[:, -1, answer].sum(), leaves)
    return torch.stack(grads, 1)  # (B, L, H, T, D)


def _reference_grads(model, arch, ids, mask, drop_layer: int | None, drop_rows: list[int], answer: int, H: int):
    """The same gradients from the eager model: a leaf of zeros added to every o_proj input, ``drop_layer``'s
    write detached."""
    L = len(_layers(model, arch))
    leaves: dict = {}
    handles = []
    for layer in range(L):
        def pre(module, args, layer=layer):
            leaves[layer] = torch.zeros_like(args[0], requires_grad=True)
            return (args[0] + leaves[layer],)
        handles.append(_o_proj(model, arch, layer).register_forward_pre_hook(pre))
    if drop_layer is not None:
        def post(module, args, kwargs, out):
            inp = args[0] if args else kwargs["hidden_states"]
            dropped = inp + (out - inp).detach()
            rows = torch.zeros(out.shape[0], dtype=torch.bool)
            rows[drop_rows] = True
            return torch.where(rows[:, None, None], dropped, out)
        handles.append(_layers(model, arch)[drop_layer].register_forward_hook(post, with_kwargs=True))
    try:
        logits = model(input_ids=ids, attention_mask=mask, position_ids=_positions(mask)).logits
        grads = torch.autograd.grad(logits[:, -1, answer].sum(), [leaves[ly] for ly in range(L)])
    finally:
        for h in handles:
            h.remove()
    B, T = ids.shape
    return torch.stack([g.view(B, T, H, -1).transpose(1, 2) for g in grads], 1)


@pytest.mark.parametrize("arch", ARCHS)
def test_drop_resid_grad_equals_a_detached_layer_write(arch):
    tok, lm, eager = models(arch)
    ids, mask = _batch(len(tok))
    H, answer = lm.geometry.n_heads, 7
    plain = _head_grads(lm, ids, mask, [], answer)
    dropped = _head_grads(lm, ids, mask, [DropResidGrad(1, rows=[0])], answer)
    want = _reference_grads(eager["eager"], arch, ids, mask, 1, [0], answer, H)
    real = mask.bool()[:, None, None, :]
    torch.testing.assert_close(torch.where(real[..., None], dropped, 0.0), torch.where(real[..., None], want, 0.0),
                               atol=1e-5, rtol=1e-4)
    # row 0: nothing inside the dropped layer 1 gets a gradient; row 1 (not dropped) keeps the plain gradient
    assert dropped[0, 1].abs().max() == 0 and plain[0, 1].abs().max() > 1e-3
    torch.testing.assert_close(dropped[1], plain[1], atol=1e-6, rtol=0)
    assert (dropped[0, 0] - plain[0, 0]).abs().max() > 1e-4  # layer 0 lost its paths through layer 1
    # the forward is unchanged
    a, _ = forward(lm, ids, Plan().drop_resid_grad(1), attention_mask=mask)
    b, _ = forward(lm, ids, None, attention_mask=mask)
    assert torch.equal(a.logits, b.logits)


def test_residual_edits_are_checked():
    tok, lm, _ = models("llama")
    ids, mask = _batch(len(tok))
    with pytest.raises(ValueError, match=r"residual edit layers \[5\] out of range \(model has 2\)"):
        forward(lm, ids, Plan().drop_resid_grad(5), attention_mask=mask)
    with pytest.raises(ValueError, match=r"ReplaceResid: values have hidden size 3"):
        forward(lm, ids, Plan().patch_resid(0, torch.zeros(1, 3), positions=[1]), attention_mask=mask)
    with pytest.raises(ValueError, match=r"ReplaceResid: positions must be >= 0"):
        ReplaceResid(0, torch.zeros(4), positions=[-1])
    tiled = Plan().patch_resid(0, torch.arange(2.0)[:, None, None].expand(2, 1, 4), positions=[0]).tile(2, 2)
    assert tiled.edits[0].rows == [0, 2, 1, 3]
    assert tiled.edits[0].values[:, 0, 0].tolist() == [0.0, 0.0, 1.0, 1.0]
