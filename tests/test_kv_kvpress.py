"""``headlab.kv.to_kvpress``: a head map exported as a kvpress press (the optional ``kvpress`` extra).

kvpress 0.5 pins transformers < 5.3, so these tests run only where kvpress is importable: in a virtual
environment of its own (docs/kv.md says how to make one) they check that the press's streaming mask, sink and
recent sizes are the head map's, and that after a prefill through kvpress's own hooks the keys kvpress hides
from the first generated token are exactly those the head map drops. Without kvpress they are skipped, and
one test checks that the export then says how to install it. A ``headkv`` map becomes a press that keeps
each KV head's SnapKV selection; its first generated token is checked against the same kind of dense
reference."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch
import xarray as xr

from headlab.kv import HeadBudgetMap, HeadMap, KvBudget, KvPolicyError, to_kvpress

HAS_KVPRESS = importlib.util.find_spec("kvpress") is not None
needs_kvpress = pytest.mark.skipif(not HAS_KVPRESS, reason="kvpress is not installed (the `kvpress` extra, in its "
                                                           "own environment: docs/kv.md)")


def _map(full: list[list[bool]], sink: int = 2, window: int = 5) -> HeadMap:
    arr = np.array(full, dtype=bool)
    return HeadMap(xr.DataArray(arr, dims=("layer", "kv_head")), sink=sink, window=window, attrs={"policy": "test"})


def _tiny_llama(layers: int = 2, kv_heads: int = 2):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=128,
                         attn_implementation="sdpa")
    return LlamaForCausalLM(config).eval()


@pytest.mark.skipif(HAS_KVPRESS, reason="kvpress is installed here")
def test_without_kvpress_the_export_says_how_to_install_it():
    with pytest.raises(KvPolicyError, match=r"kvpress is not importable .*pip install 'headlab\[kvpress\]'"):
        to_kvpress(_map([[True, False], [False, True]]))


def test_maps_kvpress_cannot_express_are_refused_first():
    with pytest.raises(KvPolicyError, match="window 1: kvpress keeps `window - 1`"):
        to_kvpress(_map([[True, False]], window=1))
    pending = HeadMap.budgeted(xr.DataArray(np.array([[1.0, 0.0]]), dims=("layer", "kv_head")),
                               KvBudget(fraction=0.9), sink=2, window=5)
    with pytest.raises(KvPolicyError, match="give the context length"):
        to_kvpress(pending)
    pending_headkv = HeadBudgetMap.allocate(xr.DataArray(np.ones((1, 2)), dims=("layer", "kv_head")),
                                            KvBudget(fraction=0.5))
    with pytest.raises(KvPolicyError, match="give the context length"):
        to_kvpress(pending_headkv)


@needs_kvpress
def test_the_press_carries_the_head_map():
    import kvpress

    hm = _map([[True, False], [False, True]], sink=2, window=5)
    press = to_kvpress(hm)
    assert isinstance(press, kvpress.DuoAttentionPress)
    model = _tiny_llama()
    press.post_init_from_model(model)
    assert press.streaming_mask.tolist() == [[False, True], [True, False]]  # the compressed KV heads
    assert (press.sink_size, press.recent_size) == (2, 4)
    assert press.head_compression_ratio == 0.5
    # a pending budget is exported at a length: at 100 tokens 0.58 keeps two of four KV heads (ranked 3, 2)
    priority = xr.DataArray(np.array([[3.0, 0.0], [2.0, 1.0]]), dims=("layer", "kv_head"))
    budgeted = HeadMap.budgeted(priority, KvBudget(fraction=0.58), sink=4, window=12)
    exported = to_kvpress(budgeted, length=100)
    exported.post_init_from_model(model)
    assert exported.streaming_mask.tolist() == [[False, True], [False, True]]
    with pytest.raises(KvPolicyError, match="this model 3 x 2"):
        to_kvpress(_map([[True, False]] * 2)).post_init_from_model(_tiny_llama(layers=3))


@needs_kvpress
@pytest.mark.parametrize("offloaded", [False, True], ids=["in-memory", "embedding-on-disk"])
def test_after_a_prefill_kvpress_hides_what_the_head_map_drops(tmp_path, offloaded):
    from transformers import DynamicCache

    hm = _map([[True, False], [False, True]], sink=2, window=5)
    press = to_kvpress(hm)
    model = _tiny_llama()
    if offloaded:  # accelerate puts the embedding on disk: `model.device`, its first parameter's, is meta
        from accelerate import dispatch_model

        model = dispatch_model(model, {"model.embed_tokens": "disk", "model.layers": "cpu", "model.norm": "cpu",
                                       "model.rotary_emb": "cpu", "lm_head": "cpu"}, offload_dir=str(tmp_path))
        assert model.device.type == "meta"
    seq = 20
    ids = torch.randint(0, 64, (1, seq), generator=torch.Generator().manual_seed(1))
    cache = DynamicCache()
    with torch.no_grad(), press(model):
        out = model(input_ids=ids, past_key_values=cache, use_cache=True)
    # the first generated token (position 20) under the head map: a compressed KV head sees k < 2 or
    # 20 - k < 5, i.e. prompt keys 0, 1, 16..19 (and itself); kvpress hides the other prompt keys of that head
    for layer, attn in enumerate(model.model.layers):
        batch, heads, positions = attn.self_attn.masked_key_indices
        hidden = sorted(zip(heads.tolist(), positions.tolist(), strict=True))
        expected = sorted((h, p) for h in range(2) if not hm.kv_full.values[layer, h]
                          for p in range(seq) if not (p < hm.sink or seq - p < hm.window))
        assert hidden == expected and set(batch.tolist()) == {0}
    with torch.no_grad():
        step = model(input_ids=out.logits[:, -1:].argmax(-1), past_key_values=cache, use_cache=True)
    assert torch.isfinite(step.logits).all()


@needs_kvpress
def test_the_first_generated_token_equals_a_dense_head_mask_reference():
    from transformers import AttentionInterface, DynamicCache

    hm = _map([[True, False], [False, True]], sink=2, window=5)
    full = hm.kv_full.values
    seq = 20

    def reference(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        # full causal attention, except that the query at position `seq` of a compressed KV head's query heads
        # sees only the head map's keys: k < sink or seq - k < window
        group = query.shape[1] // key.shape[1]
        k, v = key.repeat_interleave(group, 1), value.repeat_interleave(group, 1)
        n_q, n_k = query.shape[2], key.shape[2]
        q_pos, k_pos = torch.arange(n_k - n_q, n_k)[:, None], torch.arange(n_k)[None, :]
        allowed = (k_pos <= q_pos).expand(query.shape[1], n_q, n_k).clone()
        for head in range(query.shape[1]):
            if not full[module.layer_idx, head // group]:
                allowed[head] &= (q_pos != seq) | (k_pos < hm.sink) | (seq - k_pos < hm.window)
        scores = (query @ k.transpose(-1, -2)) * (scaling or query.shape[-1] ** -0.5)
        weights = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
        return (weights @ v).transpose(1, 2).contiguous(), weights

    AttentionInterface.register("headlab_kv_reference", reference)
    model, dense = _tiny_llama(), _tiny_llama()
    dense.set_attn_implementation("headlab_kv_reference")
    ids = torch.randint(0, 64, (1, seq), generator=torch.Generator().manual_seed(2))
    cache = DynamicCache()
    with torch.no_grad():
        with to_kvpress(hm)(model):
            prefill = model(input_ids=ids, past_key_values=cache, use_cache=True)
        token = prefill.logits[:, -1:].argmax(-1)
        step = model(input_ids=token, past_key_values=cache, use_cache=True).logits[:, -1]
        expected = dense(input_ids=torch.cat([ids, token], dim=1)).logits[:, -1]
    torch.testing.assert_close(step, expected, atol=1e-5, rtol=1e-5)
    # the reference differs from the unmasked model: the mask matters here
    with torch.no_grad():
        unmasked = _tiny_llama()(input_ids=torch.cat([ids, token], dim=1)).logits[:, -1]
    assert (unmasked - expected).abs().max() > 1e-4


def _headkv_map(budgets: list[list[int]], window: int = 4, kernel: int = 3) -> HeadBudgetMap:
    arr = np.array(budgets)
    return HeadBudgetMap(xr.DataArray(np.zeros(arr.shape, dtype=bool), dims=("layer", "kv_head")),
                         kv_budget=xr.DataArray(arr, dims=("layer", "kv_head")), observation_window=window,
                         kernel_size=kernel, attrs={"policy": "headkv"})


@needs_kvpress
def test_a_headkv_press_keeps_the_selection_of_each_kv_head():
    from transformers import AttentionInterface, DynamicCache

    from headlab.kv import snapkv_keep

    budgets, window, seq = [[10, 13], [12, 6]], 4, 20
    hm = _headkv_map(budgets, window=window)
    press = to_kvpress(hm)
    assert type(press).__name__ == "HeadKVPress" and press.kv_budget.tolist() == budgets
    kept_by_layer: dict[int, list[torch.Tensor]] = {}

    def reference(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        # full causal attention, except that the query at position `seq` sees, per KV head, the keys that
        # snapkv_keep selects from the prompt's keys and last `window` queries (and itself)
        group = query.shape[1] // key.shape[1]
        n_q, n_k = query.shape[2], key.shape[2]
        q_pos, k_pos = torch.arange(n_k - n_q, n_k)[:, None], torch.arange(n_k)[None, :]
        allowed = (k_pos <= q_pos).expand(query.shape[1], n_q, n_k).clone()
        if n_k == seq + 1:
            kept = snapkv_keep(key[:, :, :seq], query[:, :, seq - window: seq], budgets[module.layer_idx],
                               kernel_size=3, scaling=scaling)
            kept_by_layer[module.layer_idx] = kept
            for head in range(query.shape[1]):
                row = torch.zeros(n_k, dtype=torch.bool)
                row[kept[head // group][0]] = True
                row[seq] = True
                allowed[head, -1] &= row
        k, v = key.repeat_interleave(group, 1), value.repeat_interleave(group, 1)
        scores = (query @ k.transpose(-1, -2)) * (scaling or query.shape[-1] ** -0.5)
        weights = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
        return (weights @ v).transpose(1, 2).contiguous(), weights

    AttentionInterface.register("headlab_headkv_reference", reference)
    model, dense = _tiny_llama(), _tiny_llama()
    dense.set_attn_implementation("headlab_headkv_reference")
    ids = torch.randint(0, 64, (1, seq), generator=torch.Generator().manual_seed(3))
    cache = DynamicCache()
    with torch.no_grad():
        with press(model):
            prefill = model(input_ids=ids, past_key_values=cache, use_cache=True)
        token = prefill.logits[:, -1:].argmax(-1)
        step = model(input_ids=token, past_key_values=cache, use_cache=True).logits[:, -1]
        expected = dense(input_ids=torch.cat([ids, token], dim=1)).logits[:, -1]
    # kvpress hides, per KV head, every prompt key but the selection
    for layer, attn in enumerate(model.model.layers):
        _, heads, positions = attn.self_attn.masked_key_indices
        for head in range(2):
            hidden = set(positions[heads == head].tolist())
            assert hidden == set(range(seq)) - set(kept_by_layer[layer][head][0].tolist())
            assert len(hidden) == seq - budgets[layer][head]
    torch.testing.assert_close(step, expected, atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        unmasked = _tiny_llama()(input_ids=torch.cat([ids, token], dim=1)).logits[:, -1]
    assert (unmasked - expected).abs().max() > 1e-4
