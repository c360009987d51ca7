"""Attention over the headwise KV cache (:func:`headlab.kv.kv_policy`): a streaming policy against a dense-mask
eager reference written here (each compressed KV head's query heads see the row's sinks and window, full
heads see every earlier token), on tiny random Llama, Qwen2 and Mistral models with GQA, batched with left
padding, prefill and decode; a window covering the prompt equals ``full``; a batch equals its rows one by
one; the cache holds the expected keys, and its bytes the formula."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
import transformers
import xarray as xr
from transformers import AttentionInterface

from headlab.instrument import ATTN_IMPLEMENTATION, register
from headlab.kv import HeadMap, HeadwiseCache, KvPolicyError, kv_policy

from fixtures.kv import assert_batch_equals_rows, greedy_recompute
from fixtures.kv import greedy_decode as _decode
from fixtures.kv import left_padded as _batch
from fixtures.kv import positions as _positions

VOCAB = 97
_REF: dict = {}


def _reference_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Eager attention with one dense mask per head: causal, left padding excluded, and for the query heads of a
    compressed KV head only keys at own positions ``< sink`` or within ``window`` of the query."""
    full, sink, window, pad = _REF["full"][module.layer_idx], _REF["sink"], _REF["window"], _REF["pad"]
    B, H, N, D = query.shape
    g = H // key.shape[1]
    k, v = key.repeat_interleave(g, 1).float(), value.repeat_interleave(g, 1).float()
    own = torch.arange(N)[None, :] - pad[:, None]  # (B, N) own positions
    d = own[:, :, None] - own[:, None, :]
    causal = (own[:, None, :] >= 0) & (d >= 0)
    model_window = kwargs.get("sliding_window")
    if model_window:  # the model's own sliding window (Mistral) applies to every head
        causal = causal & (d < model_window)
    bounded = causal & ((own[:, None, :] < sink) | (d < window))
    per_head = torch.tensor([bool(full[h // g]) for h in range(H)])
    mask = torch.where(per_head[None, :, None, None], causal[:, None], bounded[:, None])
    mask |= torch.eye(N, dtype=torch.bool)[None, None] & (own < 0)[:, None, :, None]  # padding queries: no NaN
    s = (query.float() @ k.transpose(-1, -2)) * (scaling if scaling is not None else D**-0.5)
    a = s.masked_fill(~mask, -torch.inf).softmax(-1)
    return (a @ v).to(query.dtype).transpose(1, 2).contiguous(), None


AttentionInterface.register("kv_reference", _reference_attention)


def _config(kind: str, sliding_window: int | None = None) -> transformers.PretrainedConfig:
    common = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
                  num_key_value_heads=4, vocab_size=VOCAB, max_position_embeddings=128)
    if kind == "llama":
        return transformers.LlamaConfig(**common)
    if kind == "qwen2":
        return transformers.Qwen2Config(**common, use_sliding_window=False)
    return transformers.MistralConfig(**common, sliding_window=sliding_window)


def _models(kind: str, sliding_window: int | None = None):
    register()
    torch.manual_seed(0)
    ours = transformers.AutoModelForCausalLM.from_config(_config(kind, sliding_window),
                                                         attn_implementation=ATTN_IMPLEMENTATION).eval()
    ref = transformers.AutoModelForCausalLM.from_config(_config(kind, sliding_window),
                                                        attn_implementation="kv_reference").eval()
    ref.load_state_dict(ours.state_dict())
    return ours, ref


def _map(full: list[list[bool]], sink: int, window: int) -> HeadMap:
    arr = np.array(full, dtype=bool)
    return HeadMap(xr.DataArray(arr, dims=("layer", "kv_head"), coords={"layer": np.arange(arr.shape[0]),
                                                                        "kv_head": np.arange(arr.shape[1])}),
                   sink=sink, window=window)


def _reference(model, ids, mask, steps: int, head_map: HeadMap):
    """The same greedy decoding without a cache: every step recomputes the whole row under the dense masks."""
    pad = (mask == 0).sum(-1)
    _REF.update(full=head_map.kv_full.values, sink=head_map.sink, window=head_map.window, pad=pad)
    return greedy_recompute(model, ids, mask, steps)


def _real(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return logits[mask.bool()]


FULL = [[True, False, False, True], [False, False, True, False]]


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize(("sink", "window"), [(2, 3), (0, 4), (3, 1)])
def test_streaming_equals_the_dense_mask_reference(kind, sink, window):
    ours, ref = _models(kind)
    ids, mask = _batch([11, 7, 13])
    head_map = _map(FULL, sink, window)
    p_ours, s_ours, t_ours, cache, usage = _decode(ours, ids, mask, 8, head_map)
    p_ref, s_ref, t_ref = _reference(ref, ids, mask, 8, head_map)
    torch.testing.assert_close(_real(p_ours, mask), _real(p_ref, mask), rtol=0, atol=1e-5)
    torch.testing.assert_close(s_ours, s_ref, rtol=0, atol=1e-5)
    assert t_ours.equal(t_ref)
    assert isinstance(cache, HeadwiseCache)
    # the reference differs from a full cache: the policy really dropped keys
    p_full = _decode(ours, ids, mask, 0, None)[0]
    assert (_real(p_full, mask) - _real(p_ours, mask)).abs().max() > 1e-3
    assert usage.caches == 1 and any("compressed group" in p for p in usage.paths)


def test_a_model_sliding_window_applies_to_both_groups():
    """Mistral with its own sliding window (6): the full heads see the model's window, the compressed heads
    the policy's sinks and window within it."""
    ours, ref = _models("mistral", sliding_window=6)
    ids, mask = _batch([11, 8])
    head_map = _map(FULL, 2, 3)
    p_ours, s_ours, t_ours, _, _ = _decode(ours, ids, mask, 5, head_map)
    p_ref, s_ref, t_ref = _reference(ref, ids, mask, 5, head_map)
    torch.testing.assert_close(_real(p_ours, mask), _real(p_ref, mask), rtol=0, atol=1e-5)
    torch.testing.assert_close(s_ours, s_ref, rtol=0, atol=1e-5)
    assert t_ours.equal(t_ref)


def test_small_query_blocks_give_the_same_result(monkeypatch):
    """A prefill split into many query blocks (each against its own window slice) equals the reference."""
    import headlab.instrument.kv_split as split

    monkeypatch.setattr(split, "_BLOCK_ELEMS", 600)  # blocks of a few queries
    ours, ref = _models("llama")
    ids, mask = _batch([13, 9, 4])
    head_map = _map(FULL, 2, 3)
    p_ours = _decode(ours, ids, mask, 0, head_map)[0]
    p_ref = _reference(ref, ids, mask, 0, head_map)[0]
    torch.testing.assert_close(_real(p_ours, mask), _real(p_ref, mask), rtol=0, atol=1e-5)


def test_all_heads_compressed_and_a_chunked_prefill():
    """No full head at all, and a prompt fed in two chunks (the second chunk reads the bounded group stored
    before it plus its own keys)."""
    ours, ref = _models("llama")
    ids, mask = _batch([12, 9], seed=3)
    head_map = _map([[False] * 4, [False] * 4], 2, 3)
    with torch.no_grad(), kv_policy(ours, head_map):
        first = ours(input_ids=ids[:, :7], attention_mask=mask[:, :7], position_ids=_positions(mask)[:, :7],
                     use_cache=True)
        second = ours(input_ids=ids[:, 7:], attention_mask=mask, position_ids=_positions(mask)[:, 7:],
                      cache=first.cache, use_cache=True)
    p_ref = _reference(ref, ids, mask, 0, head_map)[0]
    got = torch.cat([first.logits, second.logits], 1)
    torch.testing.assert_close(_real(got, mask), _real(p_ref, mask), rtol=0, atol=1e-5)


@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_a_window_covering_the_context_equals_full(kind):
    ours, _ = _models(kind)
    ids, mask = _batch([10, 6])
    steps = 6
    head_map = _map(FULL, 4, ids.shape[1] + steps)  # no compressed head ever drops a token
    p_ours, s_ours, t_ours, cache, usage = _decode(ours, ids, mask, steps, head_map)
    p_full, s_full, t_full, plain, _ = _decode(ours, ids, mask, steps, None)
    torch.testing.assert_close(_real(p_ours, mask), _real(p_full, mask), rtol=0, atol=1e-5)
    torch.testing.assert_close(s_ours, s_full, rtol=0, atol=1e-5)
    assert t_ours.equal(t_full)
    assert cache.nbytes() == cache.full_nbytes() == usage.nbytes
    # and the map made full for that context is today's cache: identical logits, the model's own cache
    effective = head_map.for_length(ids.shape[1] + steps)
    assert effective.is_full and effective.attrs["effective"] == "full"
    p_eff, s_eff, t_eff, own, usage_eff = _decode(ours, ids, mask, steps, effective)
    torch.testing.assert_close(p_eff, p_full, rtol=0, atol=0)
    torch.testing.assert_close(s_eff, s_full, rtol=0, atol=0)
    assert type(own) is type(plain) and not isinstance(own, HeadwiseCache)
    assert usage_eff.kept_fraction() == 1.0
    held = sum(layer.keys.nbytes + layer.values.nbytes for layer in plain.layers)
    assert usage_eff.nbytes == usage_eff.full_nbytes == held


def test_a_batch_equals_its_rows_one_by_one():
    ours, _ = _models("qwen2")
    assert_batch_equals_rows(ours, [9, 14, 5, 12], 6, _map(FULL, 2, 4), seed=5)


def test_the_cache_holds_the_expected_keys_and_bytes():
    ours, _ = _models("llama")
    lengths = [11, 7, 13]
    ids, mask = _batch(lengths)
    sink, window, steps = 2, 3, 5
    head_map = _map(FULL, sink, window)
    *_, cache, usage = _decode(ours, ids, mask, steps, head_map)
    seen = ids.shape[1] + steps
    longest = max(lengths) + steps
    head_dim, item = 64 // 8, 4
    for layer in range(2):
        n_full = sum(FULL[layer])
        _, _, pos = cache.compressed(layer)
        for r, length in enumerate(lengths):
            n = length + steps
            held = sorted(pos[r][pos[r] >= 0].tolist())
            assert held == sorted({p for p in range(n) if p < sink or p >= n - window})  # counted, per row
        assert cache.full_group(layer)[0].shape == (3, n_full, seen, head_dim)
        slots = min(sink, longest) + min(window, longest - sink)
        expected = 2 * 3 * (n_full * seen + (4 - n_full) * slots) * head_dim * item
        assert cache.nbytes(layer) == expected == int(usage.layer_bytes[layer])
        assert int(usage.layer_full_bytes[layer]) == 2 * 3 * 4 * seen * head_dim * item
    assert usage.kept_fraction() == pytest.approx(cache.nbytes() / cache.full_nbytes())
    assert usage.to_dataarray().dims == ("layer",)


def test_refusals():
    torch.manual_seed(0)
    config = _config("llama")
    sdpa = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    with pytest.raises(KvPolicyError, match="needs headlab's attention"), kv_policy(sdpa, _map(FULL, 1, 2)):
        pass
    ours, _ = _models("llama")
    ids, mask = _batch([5, 5])
    with pytest.raises(KvPolicyError, match="cannot continue a DynamicCache"), torch.no_grad():
        plain = ours(input_ids=ids, attention_mask=mask, use_cache=True).cache
        with kv_policy(ours, _map(FULL, 1, 2)):
            ours(input_ids=ids[:, -1:], attention_mask=torch.cat([mask, mask[:, :1]], 1), cache=plain)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_per_head_edits_on_the_kernel_paths(backend):
    """A plan's per-head edits apply on both groups; the torch and Triton kernels (interpreted on a CPU) read
    the split cache and agree with SDPA's result of the same edits, and the path is recorded."""
    if backend == "triton":
        pytest.importorskip("triton")
    from headlab.instrument import OutputScale, Plan, QueryScale, instrument

    ours, _ = _models("llama")
    ids, mask = _batch([9, 6])
    head_map = _map(FULL, 2, 3)
    edits = [OutputScale(heads=[(0, 1), (0, 2), (1, 4)], factor=0.5), QueryScale(heads=[(0, 0), (1, 5)], factor=0.0)]

    def run(requested: str | None):
        plan = Plan(edits=edits, backend=requested) if requested else None
        with torch.no_grad(), kv_policy(ours, head_map) as usage:
            ctx = instrument(ours, plan) if plan is not None else contextlib.nullcontext()
            with ctx as rec:
                out = ours(input_ids=ids, attention_mask=mask, position_ids=_positions(mask), use_cache=True)
                mask2 = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
                nxt = ours(input_ids=out.logits[:, -1:].argmax(-1), attention_mask=mask2, cache=out.cache,
                           position_ids=_positions(mask2)[:, -1:], use_cache=True)
        return torch.cat([out.logits, nxt.logits], 1), rec, usage

    base, _, _ = run(None)
    sdpa, _, _ = run("auto")
    got, rec, usage = run(backend)
    torch.testing.assert_close(got[:, -1], sdpa[:, -1], rtol=0, atol=1e-5)
    torch.testing.assert_close(_real(got[:, :-1], mask), _real(sdpa[:, :-1], mask), rtol=0, atol=1e-5)
    assert (got - base).abs().max() > 1e-3  # the edits changed the outputs
    assert rec.backends[0][0] == backend and "kv split cache" in rec.backends[0][1]
    assert any(f"compressed group: {backend}" in p for p in usage.paths)


def test_key_span_biases_and_probes_are_refused():
    from headlab.instrument import Plan, Probes, instrument

    ours, _ = _models("llama")
    ids, mask = _batch([5, 5])
    with pytest.raises(KvPolicyError, match="attention probes cannot run"), torch.no_grad(), \
            kv_policy(ours, _map(FULL, 1, 2)), instrument(ours, Plan(probes=Probes(argmax=True))):
        ours(input_ids=ids, attention_mask=mask)
