"""``headlab.start_at_layer``: a forward that resumes at a layer from the residual stream a run recorded there
equals the whole forward, with an edit on that layer, with left padding, and over a suffix of the positions
whose prefix's keys and values come from a cache; the skipped layers run nothing and are restored after."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers

from headlab import Plan, forward, positions_from_mask, start_at_layer
from headlab import instrument as ins

ins.register()

V, N, PAD = 97, 12, 3


def _model(arch: str):
    common = dict(vocab_size=V, max_position_embeddings=64)
    if arch == "gpt2":
        cfg = transformers.GPT2Config(n_embd=64, n_layer=3, n_head=4, **common)
    else:
        cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                                       num_attention_heads=4, num_key_value_heads=2, **common)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="headlab").eval()


def _batch():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, V, (2, N), generator=g)
    mask = torch.ones(2, N, dtype=torch.long)
    mask[1, :PAD] = 0
    return ids, mask


def _inputs_and_caches(model, ids, mask):
    """The input hidden states of every decoder layer and the model's KV cache, from one forward."""
    layers = ins.decoder_layers(model)
    seen: list[torch.Tensor] = []
    handles = [m.register_forward_pre_hook(lambda mod, args, kw: seen.append(args[0] if args else kw["hidden_states"]),
                                           with_kwargs=True) for m in layers]
    try:
        out, _ = forward(model, ids, attention_mask=mask, use_cache=True)
    finally:
        for h in handles:
            h.remove()
    return seen, out


def _calls(model):
    """Counts of each attention module's calls (forward hooks), and their handles."""
    counts: dict[int, int] = {}
    handles = [attn.register_forward_hook(lambda mod, a, o, i=i: counts.__setitem__(i, counts.get(i, 0) + 1))
               for i, attn in enumerate(layer.self_attn if hasattr(layer, "self_attn") else layer.attn
                                        for layer in ins.decoder_layers(model))]
    return counts, handles


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_a_forward_started_at_a_layer_equals_the_whole_forward(arch):
    model = _model(arch)
    ids, mask = _batch()
    hidden, full = _inputs_and_caches(model, ids, mask)
    D = model.config.hidden_size // 4
    values = torch.randn(2, 1, N, D, generator=torch.Generator().manual_seed(1))
    for layer in (1, 2):
        plan = Plan().patch_z([(layer, 1)], values)
        want, _ = forward(model, ids, plan, attention_mask=mask)
        counts, handles = _calls(model)
        try:
            with start_at_layer(model, layer, hidden[layer]):
                got, _ = forward(model, ids, plan, attention_mask=mask)
        finally:
            for h in handles:
                h.remove()
        assert sorted(counts) == list(range(layer, 3))  # the layers below did not run
        real = mask.bool()
        torch.testing.assert_close(got.logits[real], want.logits[real], atol=1e-5, rtol=0)
        assert (want.logits - full.logits)[real].abs().max() > 1e-3  # the edit matters
    again, _ = forward(model, ids, attention_mask=mask)  # the skipped layers are restored
    torch.testing.assert_close(again.logits, full.logits, atol=0, rtol=0)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_a_suffix_started_at_a_layer_with_the_prefix_cached_equals_the_whole_forward(arch):
    """Positions ``s..`` from layer 2 with the keys and values of ``0..s-1`` from the full run's cache."""
    model = _model(arch)
    ids, mask = _batch()
    hidden, full = _inputs_and_caches(model, ids, mask)
    s, layer = 7, 2
    cache = transformers.DynamicCache(config=model.config)
    for ly in (0, layer):
        cache.update(full.cache.layers[ly].keys[:, :, :s], full.cache.layers[ly].values[:, :, :s], ly)
    with start_at_layer(model, layer, hidden[layer][:, s:]):
        got, _ = forward(model, ids[:, s:], attention_mask=mask, cache=cache, use_cache=True,
                         position_ids=positions_from_mask(mask)[:, s:])
    torch.testing.assert_close(got.logits, full.logits[:, s:], atol=1e-5, rtol=0)


def test_start_at_layer_refuses_a_layer_or_hidden_states_that_do_not_fit():
    model = _model("llama")
    ids, mask = _batch()
    with pytest.raises(ValueError, match=r"layer must be in 0\.\.2"), start_at_layer(model, 3, torch.zeros(2, N, 64)):
        pass
    with pytest.raises(ValueError, match=r"shape \(2, 5, 64\).*\(2, 12, 64\)"):
        with start_at_layer(model, 1, torch.zeros(2, 5, 64)):
            forward(model, ids, attention_mask=mask)
    out, _ = forward(model, ids, attention_mask=mask)  # restored after the error
    assert torch.isfinite(out.logits).all()
