"""The ``razor`` KV policy: streaming heads plus a compensation token per compressed KV head, against a
reference that computes each query's token by hand (the mean of the keys and values at own positions
``sink <= k <= q - window``, appended to the query's visible keys), on a tiny GQA Llama batched with left
padding, prefill and decode; the cache's running sums and bytes."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
import transformers
import xarray as xr
from transformers import AttentionInterface

from headlab import component
from headlab.geometry import Geometry
from headlab.instrument import ATTN_IMPLEMENTATION, register
from headlab.instrument.kv_split import split_attention
from headlab.kv import HeadMap, HeadwiseCache, KvPolicyError, kv_policy, split_call

from fixtures.kv import VOCAB, left_padded

_REF: dict = {}


def _razor_reference(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Eager attention where the query heads of a compressed KV head see the sinks, the window and, once a
    token was dropped, one more key: the mean of the dropped keys (with the mean of their values)."""
    full, sink, window, pad = _REF["full"][module.layer_idx], _REF["sink"], _REF["window"], _REF["pad"]
    B, H, N, D = query.shape
    g = H // key.shape[1]
    k, v, q = key.repeat_interleave(g, 1).float(), value.repeat_interleave(g, 1).float(), query.float()
    scale = scaling if scaling is not None else D**-0.5
    out = torch.zeros(B, H, N, v.shape[-1])
    for b in range(B):
        for i in range(N):
            own_q = i - int(pad[b])
            if own_q < 0:
                continue
            for h in range(H):
                keys = [j for j in range(N) if 0 <= j - int(pad[b]) <= own_q]
                if not full[h // g]:
                    keys_own = [(j, j - int(pad[b])) for j in keys]
                    dropped = [j for j, o in keys_own if o >= sink and own_q - o >= window]
                    keys = [j for j, o in keys_own if o < sink or own_q - o < window]
                else:
                    dropped = []
                kk, vv = k[b, h, keys], v[b, h, keys]
                if dropped:
                    kk = torch.cat([kk, k[b, h, dropped].mean(0, keepdim=True)])
                    vv = torch.cat([vv, v[b, h, dropped].mean(0, keepdim=True)])
                out[b, h, i] = ((q[b, h, i] @ kk.T) * scale).softmax(-1) @ vv
    return out.to(query.dtype).transpose(1, 2).contiguous(), None


AttentionInterface.register("kv_razor_reference", _razor_reference)


def _config() -> transformers.LlamaConfig:
    return transformers.LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64)


def _models():
    register()
    torch.manual_seed(0)
    ours = transformers.AutoModelForCausalLM.from_config(_config(), attn_implementation=ATTN_IMPLEMENTATION).eval()
    ref = transformers.AutoModelForCausalLM.from_config(_config(), attn_implementation="kv_razor_reference").eval()
    ref.load_state_dict(ours.state_dict())
    return ours, ref


def _map(full: list[list[bool]], sink: int, window: int) -> HeadMap:
    arr = np.array(full, dtype=bool)
    da = xr.DataArray(arr, dims=("layer", "kv_head"), coords={"layer": np.arange(2), "kv_head": np.arange(2)})
    return HeadMap(da, sink=sink, window=window, compensate=True)


def _positions(mask: torch.Tensor) -> torch.Tensor:
    return (mask.cumsum(-1) - 1).clamp(min=0)


@pytest.mark.parametrize(("sink", "window", "full"), [(2, 3, [[True, False], [False, False]]),
                                                      (0, 2, [[False, False], [False, True]])])
def test_razor_equals_the_hand_reference(sink, window, full):
    ours, ref = _models()
    g = torch.Generator().manual_seed(2)
    lengths, steps = [10, 6, 12], 6
    n = max(lengths)
    ids = torch.zeros(3, n, dtype=torch.long)
    mask = torch.zeros(3, n, dtype=torch.long)
    for r, length in enumerate(lengths):
        ids[r, n - length:] = torch.randint(1, VOCAB, (length,), generator=g)
        mask[r, n - length:] = 1
    head_map = _map(full, sink, window)
    _REF.update(full=head_map.kv_full.values, sink=sink, window=window, pad=(mask == 0).sum(-1))
    with torch.no_grad():
        with kv_policy(ours, head_map) as usage:
            out = ours(input_ids=ids, attention_mask=mask, position_ids=_positions(mask), use_cache=True)
            got_prompt, got_steps, tokens, cache, m = out.logits, [], [], out.cache, mask
            for _ in range(steps):
                nxt = out.logits[:, -1:].argmax(-1)
                tokens.append(nxt)
                m = torch.cat([m, torch.ones_like(m[:, :1])], 1)
                out = ours(input_ids=nxt, attention_mask=m, position_ids=_positions(m)[:, -1:], cache=cache,
                           use_cache=True)
                got_steps.append(out.logits[:, -1])
        r_ids, r_mask = ids, mask
        ref_prompt = ref(input_ids=ids, attention_mask=mask, position_ids=_positions(mask)).logits
        ref_steps = []
        for _ in range(steps):
            logits = ref(input_ids=r_ids, attention_mask=r_mask, position_ids=_positions(r_mask)).logits
            r_ids = torch.cat([r_ids, logits[:, -1:].argmax(-1)], 1)
            r_mask = torch.cat([r_mask, torch.ones_like(r_mask[:, :1])], 1)
            ref_steps.append(ref(input_ids=r_ids, attention_mask=r_mask, position_ids=_positions(r_mask)).logits[:, -1])
    real = mask.bool()
    torch.testing.assert_close(got_prompt[real], ref_prompt[real], rtol=0, atol=1e-5)
    torch.testing.assert_close(torch.stack(got_steps, 1), torch.stack(ref_steps, 1), rtol=0, atol=1e-5)
    assert torch.equal(torch.cat(tokens, 1), r_ids[:, n:])  # token for token
    assert any("compensation token" in p for p in usage.paths)
    # the running sums are the sums of exactly the dropped keys; the bytes count the compensation token
    assert isinstance(cache, HeadwiseCache)
    seen = n + steps
    for layer in range(2):
        lay = cache.layers[layer]
        _, _, count = lay.compensation()
        assert count.tolist() == [max(0, length + steps - sink - window) for length in lengths]
        n_full, n_comp = sum(full[layer]), 2 - sum(full[layer])
        slots = min(sink, max(lengths) + steps) + min(window, max(lengths) + steps - sink)
        assert cache.nbytes(layer) == 2 * 3 * (n_full * seen + n_comp * (slots + 1)) * 8 * 4


def test_running_sums_hold_the_dropped_keys():
    sink, window = 1, 3
    cache = HeadwiseCache(_map([[False, False], [False, False]], sink, window), [2, 0])
    keys = torch.randn(2, 2, 12, 8)
    cache.update(keys[:, :, :7], keys[:, :, :7] + 100, 0)
    for t in range(7, 12):
        cache.update(keys[:, :, t:t + 1], keys[:, :, t:t + 1] + 100, 0)
        layer = cache.layers[0]
        mk, mv, count = layer.compensation()
        for row, pad in enumerate([2, 0]):
            own = t + 1 - pad
            dropped = [p + pad for p in range(own) if sink <= p < own - window]
            assert count[row] == len(dropped)
            torch.testing.assert_close(mk[row, :, 0], keys[row, :, dropped].mean(1), rtol=0, atol=1e-6)
            torch.testing.assert_close(mv[row, :, 0], keys[row, :, dropped].mean(1) + 100, rtol=1e-6, atol=1e-5)


def test_the_razor_component_and_refusals():
    comp = component("kv", "razor")
    config = comp.config.model_validate({"kind": "razor", "full_heads": [[0, 1]], "sink": 2, "window": 4})
    ctx = SimpleNamespace(model=SimpleNamespace(geometry=Geometry(2, 4, 2, 8)), results={}, seed=0)
    head_map = comp.impl(config, ctx)
    assert head_map.compensate and head_map.kv_full.values.tolist() == [[True, False], [False, False]]
    assert int(head_map.kept_tokens(10).values[1, 0]) == 2 + 4 + 1  # sinks, window, compensation token
    assert int(head_map.kept_tokens(6).values[1, 0]) == 6  # nothing dropped, no token
    assert head_map.to_dataarray(10).attrs["compensate"] is True
    assert comp.config.model_validate({"kind": "razor", "window": 4, "prefill_chunk": 8}).prefill_chunk == 8
    with pytest.raises(KvPolicyError, match="compensation token"):
        HeadMap(head_map.kv_full, sink=2, window=4, compensate=True, prefill="full")


def _snapshot(cache: HeadwiseCache) -> list[dict[str, torch.Tensor]]:
    """Copies of every layer's groups, slot positions and compensation sums and count."""
    out = []
    for layer in cache.layers:
        out.append({"keys": layer.keys.clone(), "values": layer.values.clone(), "slot_keys": layer.slot_keys.clone(),
                    "slot_values": layer.slot_values.clone(), "slot_pos": layer.slot_pos.clone(),
                    "comp_keys": layer.comp_keys.clone(), "comp_values": layer.comp_values.clone(),
                    "count": layer.compensation()[2].clone()})
    return out


def _prompt_then_decode(model, head_map: HeadMap, ids, mask, steps: int, chunks: int | list[int] | None):
    """The prompt's logits, the cache after it (a snapshot), the greedy tokens and step logits of ``steps``
    decode steps and the final cache, the usage. ``chunks``: None (one forward), an int (``prefill_chunk``) or
    the sizes of the forwards the prompt is fed in by hand (into a cache laid out for the whole mask)."""
    chunk = chunks if isinstance(chunks, int) else None
    with torch.no_grad(), kv_policy(model, head_map, prefill_chunk=chunk) as usage:
        pos = _positions(mask)
        if isinstance(chunks, list):
            cache, logits, a = HeadwiseCache.from_attention_mask(head_map, mask), [], 0
            for size in chunks:
                b = a + size
                out = model(input_ids=ids[:, a:b], attention_mask=mask[:, :b], position_ids=pos[:, a:b], cache=cache,
                            use_cache=True)
                logits.append(out.logits)
                a = b
            assert a == ids.shape[1]
            prompt = torch.cat(logits, 1)
        else:
            out = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True)
            prompt = out.logits
        cache, m, tokens, step_logits = out.cache, mask, [], []
        after_prompt = _snapshot(cache)
        for _ in range(steps):
            nxt = out.logits[:, -1:].argmax(-1)
            tokens.append(nxt)
            m = torch.cat([m, torch.ones_like(m[:, :1])], 1)
            out = model(input_ids=nxt, attention_mask=m, position_ids=_positions(m)[:, -1:], cache=cache,
                        use_cache=True)
            step_logits.append(out.logits[:, -1])
    return prompt, after_prompt, torch.cat(tokens, 1), torch.stack(step_logits, 1), _snapshot(cache), usage


def _assert_same_cache(got: list[dict], want: list[dict]) -> None:
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a["slot_pos"], b["slot_pos"]) and torch.equal(a["count"], b["count"])
        for name in ("keys", "values", "slot_keys", "slot_values", "comp_keys", "comp_values"):
            assert a[name].shape == b[name].shape, name
            torch.testing.assert_close(a[name], b[name], rtol=0, atol=1e-5, msg=name)


# (sink, window, full KV heads, prompt fed by): prefill_chunk sizes below, at and above the window, and forwards
# of irregular sizes by hand (several tokens and single tokens after earlier ones); the rows are 14, 7 and 16
# tokens left-padded to 16, so the 7-token row's first chunks are all padding
CHUNKED = [
    (2, 3, [[True, False], [False, False]], 2),
    (2, 3, [[True, False], [False, False]], 5),
    (2, 3, [[True, False], [False, False]], 1),
    (0, 2, [[False, False], [False, True]], 3),
    (1, 6, [[False, False], [False, False]], 4),
    (1, 6, [[False, False], [True, False]], 7),
    (2, 3, [[False, False], [False, False]], [5, 1, 4, 2, 4]),
    (1, 6, [[False, True], [False, False]], [9, 3, 1, 3]),
]


@pytest.mark.parametrize(("sink", "window", "full", "chunks"), CHUNKED)
def test_a_prompt_fed_in_chunks_equals_one_forward_and_the_reference(sink, window, full, chunks):
    """razor over a prompt fed in several forwards: the logits of every real position, the cache after the
    prompt (groups, sinks, ring, compensation sums and count) and after decoding, and the decoded tokens and
    logits are those of the one-forward prefill to 1e-5, and the prompt's logits those of the hand reference."""
    ours, ref = _models()
    ids, mask = left_padded([14, 7, 16], seed=5)
    head_map = _map(full, sink, window)
    one = _prompt_then_decode(ours, head_map, ids, mask, 5, None)
    got = _prompt_then_decode(ours, head_map, ids, mask, 5, chunks)
    real = mask.bool()
    torch.testing.assert_close(got[0][real], one[0][real], rtol=0, atol=1e-5)
    _assert_same_cache(got[1], one[1])
    assert torch.equal(got[2], one[2])  # token for token
    torch.testing.assert_close(got[3], one[3], rtol=0, atol=1e-5)
    _assert_same_cache(got[4], one[4])
    # tokens were dropped before and inside later chunks: the sums hold every dropped key, counted per row
    for layer in got[1]:
        assert layer["count"].tolist() == [max(0, n - sink - window) for n in (14, 7, 16)]
    if chunks == 1:  # every forward a single token: the decode path, the layer's running mean
        assert not any("compensation token from" in p for p in got[5].paths)
    else:
        assert any("compressed group: torch" in p and "compensation token from the cache's sums and ring" in p
                   for p in got[5].paths)
    _REF.update(full=head_map.kv_full.values, sink=sink, window=window, pad=(mask == 0).sum(-1))
    with torch.no_grad():
        want = ref(input_ids=ids, attention_mask=mask, position_ids=_positions(mask)).logits
    torch.testing.assert_close(got[0][real], want[real], rtol=0, atol=1e-5)


def test_a_chunk_after_earlier_tokens_uses_the_cache_sums_and_ring():
    """The compensation token of a chunk's queries after earlier tokens, on the cache alone: a chunk attends
    as a reference over the whole row would (the running sums, the ring tokens that leave each query's window
    and the chunk's own prefix), without any earlier prompt key beyond the cache."""
    sink, window = 1, 3
    head_map = _map([[False, False], [False, False]], sink, window)
    cache = HeadwiseCache(head_map, [3, 0])
    g = torch.Generator().manual_seed(7)
    n, first = 14, 8
    keys, values = torch.randn(2, 2, n, 8, generator=g), torch.randn(2, 2, n, 8, generator=g)
    query = torch.randn(2, 4, n - first, 8, generator=g)
    cache.update(keys[:, :, :first], values[:, :, :first], 0)
    cache.layers[0].pending = None  # the first chunk's attention is not the point here
    full_keys, _ = cache.update(keys[:, :, first:], values[:, :, first:], 0)
    split = split_call(full_keys)
    assert split is not None and split.prior_comp is not None
    out = split_attention(torch.nn.Module(), query, full_keys, full_keys, None, None, {}, split, None, None)
    for row, pad in enumerate([3, 0]):
        for i in range(n - first):
            own = first + i - pad
            seen = [p for p in range(own + 1) if p < sink or own - p < window]
            dropped = [p for p in range(own + 1) if sink <= p <= own - window]
            for h in range(4):
                kv = h // 2
                kk, vv = keys[row, kv, [p + pad for p in seen]], values[row, kv, [p + pad for p in seen]]
                if dropped:
                    kk = torch.cat([kk, keys[row, kv, [p + pad for p in dropped]].mean(0, keepdim=True)])
                    vv = torch.cat([vv, values[row, kv, [p + pad for p in dropped]].mean(0, keepdim=True)])
                want = ((query[row, h, i] @ kk.T) * 8**-0.5).softmax(-1) @ vv
                torch.testing.assert_close(out[row, h, i], want, rtol=0, atol=1e-5)


def test_a_generate_step_with_razor_prefilled_by_chunks(tmp_path):
    """A razor ``generate`` step with ``prefill_chunk`` decodes the tokens of the step without it and holds the
    same cache bytes; its attention path says the chunks after the first took the cache's sums and ring."""
    import headlab

    from fixtures.specs import spec_text

    def gen(extra: str) -> str:
        kv = "{kind: razor, full_heads: {from: ind, top: 1}, sink: 1, window: 3" + extra + "}"
        return ("  - id: ind\n    detect: {kind: induction}\n"
                f"  - id: gen\n    generate:\n      max_new_tokens: 4\n      kv: {kv}\n")

    task = "{kind: repeated_tokens, n: 3, length: 8}"
    chunked = headlab.run(spec_text(gen(", prefill_chunk: 5"), task=task), out=tmp_path / "a").results["gen"]
    plain = headlab.run(spec_text(gen(""), task=task), out=tmp_path / "b").results["gen"]
    assert chunked.attrs["kv_policy"] == "razor" and 0 < chunked.attrs["kv_kept_fraction"] < 1
    assert np.array_equal(chunked["output_ids"].values, plain["output_ids"].values)
    assert np.array_equal(chunked["kv_bytes"].values, plain["kv_bytes"].values)
    assert "from the cache's sums and ring" in chunked.attrs["kv_attention"]
    assert "from the cache's sums and ring" not in plain.attrs["kv_attention"]
