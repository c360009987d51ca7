"""``headlab.kv.HeadwiseCache``: the keys each KV head holds after prefill and decode (counted, and equal to
a dense reference's keys at the expected positions), the byte accounting, the ``full`` map against
transformers' ``DynamicCache``, left padding, the ring buffer, and the GQA layout."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers
import xarray as xr
from transformers import DynamicCache

from headlab.geometry import Geometry
from headlab.kv import HeadMap, HeadwiseCache, KvPolicyError, kv_heads

D = 8


def _map(full: list[list[bool]], sink: int, window: int | None) -> HeadMap:
    arr = np.array(full, dtype=bool)
    da = xr.DataArray(arr, dims=("layer", "kv_head"),
                      coords={"layer": np.arange(arr.shape[0]), "kv_head": np.arange(arr.shape[1])})
    return HeadMap(da, sink=sink, window=window)


def _expected_positions(n: int, sink: int, window: int) -> list[int]:
    """The own positions a compressed head keeps after a row of ``n`` real tokens."""
    return sorted({p for p in range(n) if p < sink or p >= n - window})


def _feed(cache, dense: list[torch.Tensor], chunks: list[int]):
    """Update every layer with consecutive chunks of the dense ``[batch, heads, seq, dim]`` keys (values are
    the keys + 1000, so a value mix-up shows); yields the number of tokens fed after each chunk."""
    start = 0
    for q in chunks:
        for layer, keys in enumerate(dense):
            cache.update(keys[:, :, start:start + q], keys[:, :, start:start + q] + 1000, layer)
        start += q
        yield start


def _check_layer(cache: HeadwiseCache, layer: int, keys: torch.Tensor, seen: int, pad: list[int], sink: int,
                 window: int) -> None:
    full_heads = cache.full_heads(layer).tolist()
    comp_heads = cache.compressed_heads(layer).tolist()
    if full_heads:
        fk, fv = cache.full_group(layer)
        torch.testing.assert_close(fk, keys[:, full_heads, :seen], rtol=0, atol=0)
        torch.testing.assert_close(fv, keys[:, full_heads, :seen] + 1000, rtol=0, atol=0)
    if not comp_heads:
        return
    ck, cv, pos = cache.compressed(layer)
    assert ck.shape[1] == len(comp_heads)
    for row, p in enumerate(pad):
        n = max(0, seen - p)
        valid = (pos[row] >= 0).nonzero().flatten()
        held = pos[row, valid].tolist()
        expected = _expected_positions(n, sink, window)
        assert sorted(held) == expected, (layer, row, seen)
        assert len(held) == len(set(held)) == min(n, sink + window)
        for slot, own in zip(valid.tolist(), held, strict=True):
            torch.testing.assert_close(ck[row, :, slot], keys[row, comp_heads, own + p], rtol=0, atol=0)
            torch.testing.assert_close(cv[row, :, slot], keys[row, comp_heads, own + p] + 1000, rtol=0, atol=0)


def _bounded_bytes(longest: int, sink: int, window: int) -> int:
    return min(sink, longest) + min(window, max(0, longest - sink))


@pytest.mark.parametrize("chunks", [[9, 1, 1, 1, 1, 1, 1, 1], [4, 3, 2, 1, 5, 1], [16]])
def test_cache_holds_exactly_the_expected_keys_and_bytes(chunks):
    torch.manual_seed(0)
    sink, window, pad = 2, 3, [0, 3, 5]
    head_map = _map([[True, False, False, True], [False, False, False, False], [True, True, True, True]],
                    sink, window)
    total = sum(chunks)
    dense = [torch.randn(len(pad), 4, total, D) for _ in range(3)]
    cache = HeadwiseCache(head_map, pad)
    for seen in _feed(cache, dense, chunks):
        assert cache.get_seq_length() == seen
        for layer in range(3):
            _check_layer(cache, layer, dense[layer], seen, pad, sink, window)
            n_full = int(head_map.kv_full[layer].sum())
            slots = _bounded_bytes(seen - min(pad), sink, window)
            assert cache.nbytes(layer) == 2 * len(pad) * (n_full * seen + (4 - n_full) * slots) * D * 4
            assert cache.full_nbytes(layer) == 2 * len(pad) * 4 * seen * D * 4
    assert cache.nbytes() == sum(cache.nbytes(layer) for layer in range(3))
    assert cache.layer_nbytes().values.tolist() == [cache.nbytes(layer) for layer in range(3)]
    assert cache.kept_fraction() == pytest.approx(cache.nbytes() / cache.full_nbytes())
    assert cache.kept_fraction() < 1.0


def test_full_map_equals_dynamic_cache_tensors_and_bytes():
    torch.manual_seed(1)
    head_map = _map([[True, True], [True, True]], 0, None)
    dense = [torch.randn(2, 2, 7, D) for _ in range(2)]
    ours, theirs = HeadwiseCache(head_map), DynamicCache()
    start = 0
    for q in (5, 1, 1):
        for layer in range(2):
            k, v = dense[layer][:, :, start:start + q], dense[layer][:, :, start:start + q] * 2
            a = ours.update(k, v, layer)
            b = theirs.update(k, v, layer)
            torch.testing.assert_close(a[0], b[0], rtol=0, atol=0)
            torch.testing.assert_close(a[1], b[1], rtol=0, atol=0)
        start += q
    for layer in range(2):
        assert ours.layers[layer].keys.equal(theirs.layers[layer].keys)
        assert ours.layers[layer].values.equal(theirs.layers[layer].values)
        held = theirs.layers[layer].keys.nbytes + theirs.layers[layer].values.nbytes
        assert ours.nbytes(layer) == ours.full_nbytes(layer) == held
    assert ours.get_seq_length() == theirs.get_seq_length() == 7
    assert ours.kept_fraction() == 1.0


def test_full_map_in_a_model_gives_identical_logits_and_cache():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=97, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(config).eval()
    ids = torch.randint(0, 97, (2, 6))
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    geometry = Geometry(2, 4, 2, 16)
    with torch.no_grad():
        ours = HeadwiseCache.from_attention_mask(HeadMap.full(geometry), mask)
        out_a = model(input_ids=ids, attention_mask=mask, cache=ours, use_cache=True)
        out_b = model(input_ids=ids, attention_mask=mask, use_cache=True)
        torch.testing.assert_close(out_a.logits, out_b.logits, rtol=0, atol=0)
        step = torch.randint(0, 97, (2, 1))
        mask2 = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], dim=1)
        next_a = model(input_ids=step, attention_mask=mask2, cache=out_a.cache, use_cache=True)
        next_b = model(input_ids=step, attention_mask=mask2, cache=out_b.cache, use_cache=True)
        torch.testing.assert_close(next_a.logits, next_b.logits, rtol=0, atol=0)
    assert next_a.cache is ours
    for layer in range(2):
        assert ours.layers[layer].keys.equal(next_b.cache.layers[layer].keys)
        assert ours.layers[layer].keys.shape == (2, 2, 7, 16)


def test_left_padded_rows_keep_their_own_first_real_tokens_as_sinks():
    torch.manual_seed(2)
    sink, window, pad = 3, 2, [4, 0]
    cache = HeadwiseCache.from_attention_mask(_map([[False, True]], sink, window),
                                              torch.tensor([[0] * 4 + [1] * 8, [1] * 12]))
    assert cache.layers[0].pad.tolist() == pad
    keys = torch.randn(2, 2, 12, D)
    cache.update(keys, keys + 1000, 0)
    ck, _, pos = cache.compressed(0)
    sinks = pos[:, :sink]
    assert sinks.tolist() == [[0, 1, 2], [0, 1, 2]]
    torch.testing.assert_close(ck[0, 0, :sink], keys[0, 0, 4:7], rtol=0, atol=0)  # not the padding at 0..3
    torch.testing.assert_close(ck[1, 0, :sink], keys[1, 0, 0:3], rtol=0, atol=0)
    assert sorted(pos[0, sink:].tolist()) == [6, 7]  # row 0 has 8 real tokens
    assert sorted(pos[1, sink:].tolist()) == [10, 11]


def test_a_row_shorter_than_the_sinks_leaves_empty_slots():
    cache = HeadwiseCache(_map([[False]], 4, 2), [5, 0])
    keys = torch.randn(2, 1, 7, D)
    cache.update(keys, keys, 0)
    _, _, pos = cache.compressed(0)
    assert pos[0].tolist() == [0, 1, -1, -1, -1, -1]  # 2 real tokens
    assert pos[1].tolist()[:4] == [0, 1, 2, 3] and sorted(pos[1].tolist()[4:]) == [5, 6]


def test_ring_buffer_wraps_slot_by_position():
    sink, window = 1, 4
    cache = HeadwiseCache(_map([[False]], sink, window))
    keys = torch.randn(1, 1, 40, D)
    cache.update(keys[:, :, :10], keys[:, :, :10], 0)  # a prefill longer than the window writes its last 4 only
    ring = cache.layers[0].ring_pos[0].tolist()
    assert ring == [9, 6, 7, 8]  # slot (p - sink) % window
    for t in range(10, 40):
        cache.update(keys[:, :, t:t + 1], keys[:, :, t:t + 1], 0)
        ring = cache.layers[0].ring_pos[0].tolist()
        assert all((p - sink) % window == s for s, p in enumerate(ring))
        assert sorted(ring) == list(range(t - window + 1, t + 1))
        assert cache.layers[0].ring_keys[0, 0, (t - sink) % window].equal(keys[0, 0, t])
    assert cache.layers[0].ring_keys.shape[2] == window  # never grew past the window
    assert cache.nbytes() == 2 * (sink + window) * D * 4


def test_gqa_layout_full_heads_follow_the_query_heads():
    geometry = Geometry(2, 8, 2, D)  # 4 query heads per KV head
    full = kv_heads([(0, 5), (1, 0), (1, 1), (1, 2), (1, 3)], {}, geometry, gqa="all")
    cache = HeadwiseCache(HeadMap(full, sink=1, window=2))
    assert full.values.tolist() == [[False, False], [True, False]]
    assert cache.full_heads(1).tolist() == [0] and cache.compressed_heads(1).tolist() == [1]
    assert cache.compressed_heads(0).tolist() == [0, 1]
    keys = torch.randn(1, 2, 5, D)
    for layer in range(2):
        cache.update(keys, keys, layer)
    assert cache.full_group(1)[0].equal(keys[:, :1])
    assert cache.compressed(1)[0].shape == (1, 1, 3, D)
    with pytest.raises(KvPolicyError, match="2 KV heads, this layer's keys have 3"):
        HeadwiseCache(HeadMap(full, sink=1, window=2)).update(torch.randn(1, 3, 2, D), torch.randn(1, 3, 2, D), 0)


def test_rows_can_be_selected_and_reordered():
    cache = HeadwiseCache(_map([[True, False]], 1, 2), [2, 0])
    keys = torch.randn(2, 2, 6, D)
    cache.update(keys, keys, 0)
    cache.reorder_cache(torch.tensor([1, 0]))
    assert cache.layers[0].pad.tolist() == [0, 2]
    assert cache.full_group(0)[0][0].equal(keys[1, :1])
    cache.update(keys[:, :, :1], keys[:, :, :1], 0)
    _, _, pos = cache.compressed(0)
    assert sorted(pos[0].tolist()) == [0, 5, 6] and sorted(pos[1].tolist()) == [0, 3, 4]


def test_refusals():
    with pytest.raises(KvPolicyError, match="left padding"):
        HeadwiseCache.from_attention_mask(_map([[False]], 1, 1), torch.tensor([[1, 1, 0]]))
    with pytest.raises(KvPolicyError, match="negative"):
        HeadwiseCache(_map([[False]], 1, 1), [-1])
    cache = HeadwiseCache(_map([[False]], 1, 1), [0, 0, 0])
    with pytest.raises(KvPolicyError, match="3 padding lengths for a batch of 2"):
        cache.update(torch.randn(2, 1, 2, D), torch.randn(2, 1, 2, D), 0)
    cache = HeadwiseCache(_map([[False]], 1, 1))
    cache.update(torch.randn(1, 1, 2, D), torch.randn(1, 1, 2, D), 0)
    with pytest.raises(KvPolicyError, match="cannot be cropped"):
        cache.crop(-1)
    with pytest.raises(KvPolicyError, match="needs a window"):
        _map([[False]], 1, None)


def test_rows_can_be_repeated_and_selected():
    cache = HeadwiseCache(_map([[True, False]], 1, 2), [1, 0])
    keys = torch.randn(2, 2, 5, D)
    cache.update(keys, keys, 0)
    cache.batch_repeat_interleave(2)
    assert cache.layers[0].pad.tolist() == [1, 1, 0, 0]
    assert cache.compressed(0)[0].shape[0] == cache.full_group(0)[0].shape[0] == 4
    cache.batch_select_indices(torch.tensor([2]))
    assert cache.layers[0].pad.tolist() == [0]
    ck, _, pos = cache.compressed(0)
    assert pos[0, 0] == 0 and ck[0, 0, 0].equal(keys[1, 1, 0])
    assert cache.full_group(0)[0].equal(keys[1:, :1])


def test_a_window_covering_the_row_keeps_every_token():
    cache = HeadwiseCache(_map([[False]], 2, 8))
    keys = torch.randn(1, 1, 10, D)
    cache.update(keys[:, :, :7], keys[:, :, :7], 0)
    for t in range(7, 10):
        cache.update(keys[:, :, t:t + 1], keys[:, :, t:t + 1], 0)
    ck, _, pos = cache.compressed(0)
    order = pos[0].argsort()
    assert pos[0, order].tolist() == list(range(10))
    assert ck[0, 0, order].equal(keys[0, 0])
    assert cache.nbytes() == cache.full_nbytes()
