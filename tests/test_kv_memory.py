"""Real memory under a KV policy (:func:`headlab.kv.kv_policy`): the peak memory of a long decode grows with the
bytes the cache keeps, not with a full cache's; a prefill never keeps the compressed heads' full-length keys
beyond the layer's forward; a prompt prefilled by chunks (``prefill_chunk``) gives the logits of one forward,
bounds the prefill's transient memory, and is refused where a policy needs the whole prompt in one forward
(prefill: full). Peak memory on a CPU is the peak of live tensor bytes (:class:`headlab.kv.KvUsage`),
deterministic: no wall clock."""

from __future__ import annotations

import weakref
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
import xarray as xr

import headlab
from headlab import component
from headlab.instrument import ATTN_IMPLEMENTATION, register
from headlab.kv import HeadMap, HeadwiseLayer, KvPolicyError, kv_policy

from fixtures.kv import left_padded as _batch
from fixtures.kv import positions as _positions
from fixtures.specs import spec_text

VOCAB = 97
CPU_PEAK = "cpu peak live tensor bytes"  # KvUsage.peak_memory_measure on a CPU
LAYERS, KV_HEADS, HEAD_DIM, ITEM = 4, 4, 16, 4  # float32
SINK, WINDOW = 2, 8


def _model(layers: int = LAYERS) -> transformers.PreTrainedModel:
    register()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
                                      num_attention_heads=8, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
                                      vocab_size=VOCAB, max_position_embeddings=1024)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation=ATTN_IMPLEMENTATION).eval()


def _kv(values: np.ndarray) -> xr.DataArray:
    return xr.DataArray(values, dims=("layer", "kv_head"), coords={"layer": np.arange(values.shape[0]),
                                                                   "kv_head": np.arange(values.shape[1])})


def _map(kind: str, layers: int = LAYERS, **kw) -> HeadMap:
    """``full`` (every KV head full) or ``streaming``: KV head 0 of each layer full (25%), the others sinks +
    window."""
    full = np.zeros((layers, KV_HEADS), dtype=bool)
    full[:, 0 if kind == "streaming" else slice(None)] = True
    return HeadMap(_kv(full), sink=SINK, window=WINDOW, **kw)


def _greedy(model, head_map: HeadMap, prompt: int, steps: int, prefill_chunk: int | None = None):
    """Greedy decoding of ``steps`` tokens after a ``prompt``-token batch of 2 under ``head_map``, keeping no
    earlier step's outputs and the prefill's logits of the last position only (what a long decode holds is the
    cache); the :class:`KvUsage`."""
    ids, mask = _batch([prompt, prompt])
    with torch.no_grad(), kv_policy(model, head_map, prefill_chunk=prefill_chunk, cpu_peak=True) as usage:
        out = model(input_ids=ids, attention_mask=mask, position_ids=_positions(mask), use_cache=True,
                    logits_to_keep=1)
        cache = out.cache
        for _ in range(steps):
            nxt = out.logits[:, -1].argmax(-1)
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
            out = model(input_ids=nxt[:, None], attention_mask=mask, position_ids=_positions(mask)[:, -1:],
                        cache=cache, use_cache=True)
            cache = out.cache
        del out, cache
    assert usage.peak_memory_measure == CPU_PEAK
    assert usage.peak_memory >= usage.nbytes  # the cache itself was alive at the end
    return usage


def _growth(model, kind: str, short: tuple[int, int], long: tuple[int, int], prefill_chunk: int | None = None):
    """(growth of the peak memory, growth of the kept bytes) from the (prompt, steps) ``short`` to ``long``."""
    a = _greedy(model, _map(kind), *short, prefill_chunk=prefill_chunk)
    b = _greedy(model, _map(kind), *long, prefill_chunk=prefill_chunk)
    return b.peak_memory - a.peak_memory, b.nbytes - a.nbytes


def test_the_peak_memory_of_a_long_decode_grows_with_the_kept_bytes():
    model = _model()
    short, long = (8, 32), (8, 160)
    full_peak, full_kept = _growth(model, "full", short, long)
    stream_peak, stream_kept = _growth(model, "streaming", short, long)
    tokens = long[1] - short[1]
    per_token = 2 * 2 * HEAD_DIM * ITEM  # two rows, a key and a value per KV head
    assert full_kept == LAYERS * KV_HEADS * tokens * per_token
    assert stream_kept == LAYERS * 1 * tokens * per_token  # only the full KV heads grow past sinks + window
    # each peak grows with what its cache keeps (a cache update holds one layer's old and new group at once) ...
    assert full_kept <= full_peak <= 1.2 * full_kept
    assert 0.9 * stream_kept <= stream_peak <= 1.2 * stream_kept
    # ... so the streaming cache's peak grows about a quarter as fast, as its kept bytes do: not a mask
    assert stream_peak < 0.35 * full_peak


def test_a_chunked_prefill_bounds_the_peak_memory_of_a_long_prompt():
    """Prompts of 16 and 144 tokens, each prefilled by 8-token chunks then decoded 8 tokens: the peak grows with
    the kept bytes (the full heads' keys of 128 more tokens) and not with the prompt's activations."""
    model = _model()
    stream_peak, stream_kept = _growth(model, "streaming", (16, 8), (144, 8), prefill_chunk=8)
    full_peak, full_kept = _growth(model, "full", (16, 8), (144, 8), prefill_chunk=8)
    assert stream_kept == LAYERS * 128 * 2 * 2 * HEAD_DIM * ITEM and full_kept == 4 * stream_kept
    assert 0.9 * stream_kept <= stream_peak <= 1.3 * stream_kept
    assert full_peak >= full_kept
    assert stream_peak < 0.3 * full_peak


def test_a_prefill_keeps_only_sinks_and_window_of_compressed_heads(monkeypatch):
    """After a prefill of 40 tokens the cache holds every position of the full KV head and ``sink + window``
    slots of the others (counted); the compressed heads' keys of the whole prompt, which a layer's attention
    reads, are freed before the next layer runs."""
    model = _model()
    ids, mask = _batch([40, 33])
    chunk_keys: dict[int, list[weakref.ref]] = {}
    update = HeadwiseLayer.update

    def recording(self, key_states, value_states, *args, **kwargs):
        out = update(self, key_states, value_states, *args, **kwargs)
        split = self.pending
        assert split.chunk_keys.shape[2] == 40
        refs = [weakref.ref(split.chunk_keys.untyped_storage()), weakref.ref(split.chunk_values.untyped_storage())]
        chunk_keys[id(self)] = refs
        return out

    alive_at: list[tuple[int, int]] = []

    def check(module, args):
        alive_at.append((module.self_attn.layer_idx, sum(r() is not None for refs in chunk_keys.values()
                                                         for r in refs)))

    monkeypatch.setattr(HeadwiseLayer, "update", recording)
    hooks = [layer.register_forward_pre_hook(check) for layer in model.model.layers]
    try:
        with torch.no_grad(), kv_policy(model, _map("streaming")):
            out = model(input_ids=ids, attention_mask=mask, position_ids=_positions(mask), use_cache=True)
    finally:
        for hook in hooks:
            hook.remove()
    assert alive_at == [(i, 0) for i in range(LAYERS)]  # no earlier layer's full-length compressed keys alive
    assert len(chunk_keys) == LAYERS and all(r() is None for refs in chunk_keys.values() for r in refs)
    for layer in out.cache.layers:
        assert layer.keys.shape == (2, 1, 40, HEAD_DIM)
        assert layer.slot_keys.shape == layer.slot_values.shape == (2, KV_HEADS - 1, SINK + WINDOW, HEAD_DIM)
        # the shorter row's slots hold its own sinks and its last `window` tokens
        assert sorted(layer.slot_pos[1].tolist()) == [0, 1, *range(33 - WINDOW, 33)]
    per_row = 2 * HEAD_DIM * ITEM * (40 + (KV_HEADS - 1) * (SINK + WINDOW))
    assert out.cache.nbytes() == LAYERS * 2 * per_row


@pytest.mark.parametrize("kind", ["streaming", "full"])
def test_a_chunked_prefill_equals_one_forward(kind):
    """A left-padded batch (the shorter row's first chunk all padding) prefilled by chunks of 6 tokens: the
    logits of every real position, the cache and the decoded steps as with one forward, to 1e-5."""
    model = _model(2)
    ids, mask = _batch([20, 13], seed=3)
    head_map = _map(kind, layers=2)

    def run(chunk):
        with torch.no_grad(), kv_policy(model, head_map, prefill_chunk=chunk):
            out = model(input_ids=ids, attention_mask=mask, position_ids=_positions(mask), use_cache=True,
                        output_hidden_states=True)
            logits, hidden, cache, steps, m = out.logits, out.hidden_states, out.cache, [], mask
            for _ in range(5):
                nxt = out.logits[:, -1].argmax(-1)
                m = torch.cat([m, torch.ones_like(m[:, :1])], 1)
                out = model(input_ids=nxt[:, None], attention_mask=m, position_ids=_positions(m)[:, -1:],
                            cache=cache, use_cache=True)
                cache = out.cache
                steps.append(out.logits[:, -1])
        return logits, hidden, cache, torch.stack(steps, 1)

    one, hidden_one, cache_one, steps_one = run(None)
    chunked, hidden_chunked, cache_chunked, steps_chunked = run(6)
    real = mask.bool()
    assert chunked.shape == one.shape
    torch.testing.assert_close(chunked[real], one[real], rtol=0, atol=1e-5)
    assert len(hidden_chunked) == len(hidden_one)
    for a, b in zip(hidden_chunked, hidden_one, strict=True):
        torch.testing.assert_close(a[real], b[real], rtol=0, atol=1e-5)
    torch.testing.assert_close(steps_chunked, steps_one, rtol=0, atol=1e-5)
    for a, b in zip(cache_chunked.layers, cache_one.layers, strict=True):
        assert a.keys.shape == b.keys.shape
        if kind == "streaming":
            assert torch.equal(a.slot_pos, b.slot_pos)
            torch.testing.assert_close(a.slot_keys, b.slot_keys, rtol=0, atol=1e-5)


def test_logits_to_keep_under_a_chunked_prefill():
    model = _model(2)
    ids, mask = _batch([15, 15])
    with torch.no_grad(), kv_policy(model, _map("streaming", layers=2)):
        one = model(input_ids=ids, attention_mask=mask, position_ids=_positions(mask), use_cache=True).logits
    for keep in (1, 4):  # 4 spans the last two chunks of 15 = 6 + 6 + 3 tokens
        with torch.no_grad(), kv_policy(model, _map("streaming", layers=2), prefill_chunk=6):
            got = model(input_ids=ids, attention_mask=mask, position_ids=_positions(mask), use_cache=True,
                        logits_to_keep=keep).logits
        torch.testing.assert_close(got, one[:, -keep:], rtol=0, atol=1e-5)
    with torch.no_grad(), kv_policy(model, _map("streaming", layers=2), prefill_chunk=6):  # input_ids by position
        got = model(ids, attention_mask=mask, position_ids=_positions(mask), use_cache=True).logits
    torch.testing.assert_close(got, one, rtol=0, atol=1e-5)


def test_chunked_prefill_refusals():
    model = _model(2)
    ids = torch.randint(1, VOCAB, (1, 9))
    with pytest.raises(KvPolicyError, match="the tensor argument `pixel_values` cannot be chunked"), \
            torch.no_grad(), kv_policy(model, _map("streaming", layers=2), prefill_chunk=4):
        model(input_ids=ids, pixel_values=torch.zeros(1, 3, 4, 4))
    assert "forward" not in model.__dict__  # the model's own forward again after the block
    with torch.no_grad(), kv_policy(model, _map("streaming", layers=2), prefill_chunk=4):
        assert model(input_ids=ids[:, :4]).logits.shape == (1, 4, VOCAB)  # no longer than a chunk: one forward
    with pytest.raises(KvPolicyError, match="positive number of tokens"):
        with kv_policy(model, _map("full", layers=2), prefill_chunk=0):
            pass
    # the spec: streaming, random, razor, headkv and full take prefill_chunk
    config = component("kv", "streaming").config.model_validate(
        {"kind": "streaming", "full_heads": [[0, 0]], "window": 8, "prefill_chunk": 16})
    assert config.prefill_chunk == 16
    assert component("kv", "full").config.model_validate({"kind": "full", "prefill_chunk": 3}).prefill_chunk == 3
    assert component("kv", "headkv").config.model_validate(
        {"kind": "headkv", "scores": {"from": "s"}, "budget": {"tokens_per_head": 8}, "prefill_chunk": 16}
    ).prefill_chunk == 16


def test_a_generate_step_prefilled_by_chunks(tmp_path):
    """A step's ``prefill_chunk`` changes neither its tokens nor its cache bytes; a step on a CPU reports its
    peak memory."""
    task = "{kind: repeated_tokens, n: 3, length: 8}"
    detect = "  - id: ind\n    detect: {kind: induction}\n"

    def gen(extra: str) -> str:
        kv = "{kind: streaming, full_heads: {from: ind, top: 1}, sink: 1, window: 3" + extra + "}"
        return detect + f"  - id: gen\n    generate:\n      max_new_tokens: 4\n      kv: {kv}\n"

    chunked = headlab.run(spec_text(gen(", prefill_chunk: 5, measure_peak: true"), task=task),
                          out=tmp_path / "a").results["gen"]
    plain = headlab.run(spec_text(gen(""), task=task), out=tmp_path / "b").results["gen"]
    assert np.array_equal(chunked["output_ids"].values, plain["output_ids"].values)
    assert np.array_equal(chunked["kv_bytes"].values, plain["kv_bytes"].values)
    assert chunked.attrs["kv_peak_memory_measure"] == CPU_PEAK
    assert chunked.attrs["kv_peak_memory"] >= int(chunked["kv_bytes"].sum()) > 0
    assert "kv_peak_memory" not in plain.attrs  # on a CPU the peak is measured only when asked for


CHECKPOINT = Path(__file__).parent.parent / "headlab" / "plugins" / "models" / "tiny" / "headlab-tiny" / "model.safetensors"


@pytest.mark.skipif(not CHECKPOINT.is_file(), reason="the embedded model headlab-tiny is not built")
def test_a_score_step_prefilled_by_chunks(tmp_path):
    """A scored row (prompt + choice, every position's logits read) fed by chunks scores as one forward."""
    def run(kv: dict, out: str):
        spec = {"name": "kv", "model": "headlab-tiny", "task": {"kind": "kv_swap", "n": 2},
                "steps": [{"id": "s", "score": {"kv": kv}}]}
        return headlab.run(spec, out=tmp_path / out).results["s"]

    kv = {"kind": "streaming", "sink": 1, "window": 2}
    plain, chunked = run(kv, "a"), run({**kv, "prefill_chunk": 3}, "b")
    np.testing.assert_allclose(chunked["logprob"].values, plain["logprob"].values, rtol=0, atol=1e-5)
    assert np.array_equal(chunked["kv_bytes"].values, plain["kv_bytes"].values)


def test_a_split_cache_forward_builds_no_dense_mask(monkeypatch):
    """Under a map with compressed heads in every layer the attention mask stays implicit (transformers'
    ``sdpa_mask`` is never called: no (chunk x cached positions) mask), in a left-padded chunked prefill and its
    decode steps alike; a map with a layer of only full KV heads (read by the plain attention) still gets
    transformers' mask. The logits are those of the dense-mask run."""
    import transformers.masking_utils as masking

    model = _model(2)
    ids, mask = _batch([20, 13], seed=3)
    built = []
    dense = masking.sdpa_mask

    def counting(*args, **kwargs):
        built.append(kwargs.get("q_length"))
        return dense(*args, **kwargs)

    def run(head_map):
        with torch.no_grad(), kv_policy(model, head_map, prefill_chunk=6):
            out = model(input_ids=ids, attention_mask=mask, position_ids=_positions(mask), use_cache=True)
            m = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
            step = model(input_ids=out.logits[:, -1].argmax(-1)[:, None], attention_mask=m,
                         position_ids=_positions(m)[:, -1:], cache=out.cache, use_cache=True)
        return out.logits, step.logits

    monkeypatch.setattr(masking, "sdpa_mask", counting)
    logits, step = run(_map("streaming", layers=2))
    assert built == []
    mixed = np.zeros((2, KV_HEADS), dtype=bool)
    mixed[0] = True  # layer 0: every KV head full
    mixed[1, 0] = True
    run(HeadMap(_kv(mixed), sink=SINK, window=WINDOW))
    assert built == [6, 6, 6, 2, 1]  # 20 tokens in chunks of 6, then a decode step
    # the same logits as with transformers' dense mask (the cache's implicit mask disabled)
    monkeypatch.setattr("headlab.instrument.masks.mask_stays_implicit", lambda *a, **k: False)
    dense_logits, dense_step = run(_map("streaming", layers=2))
    real = mask.bool()
    torch.testing.assert_close(logits[real], dense_logits[real], rtol=0, atol=1e-5)
    torch.testing.assert_close(step, dense_step, rtol=0, atol=1e-5)


def _chunked_prefill_peak(length: int, chunk: int) -> tuple[int, int]:
    """(peak of live tensor bytes, bytes kept) of a streaming prefill of two rows of ``length`` and ``length - 48``
    tokens (left-padded) by chunks of ``chunk`` tokens, the last position's logits only."""
    model = _model(2)
    ids, mask = _batch([length, length - 48], seed=2)
    with torch.no_grad(), kv_policy(model, _map("streaming", layers=2), prefill_chunk=chunk, cpu_peak=True) as usage:
        out = model(input_ids=ids, attention_mask=mask, position_ids=_positions(mask), use_cache=True,
                    logits_to_keep=1)
        del out
    return usage.peak_memory, usage.nbytes


def test_the_peak_of_a_chunked_prefill_is_the_kept_bytes_plus_one_chunk(monkeypatch):
    """A 4,096-token prompt prefilled by chunks of 128 with attention blocks of at most 2**16 mask entries: the
    peak of live tensor bytes is at most the bytes the cache keeps plus an allowance that does not grow with
    the prompt's length but with the chunk's and the blocks' (the chunk's activations, queries and keys; one
    attention block of each group) and one layer's full group (a cache update holds its old and new keys at
    once). With transformers' dense mask and SDPA's mask over every cached position back (the cache's implicit
    mask off, the full group in one SDPA call), the same prefill exceeds it."""
    from headlab.instrument import kv_split, masks

    length, chunk, rows, layers, hidden, inter, heads, block = 4096, 128, 2, 2, 64, 96, 8, 2**16
    monkeypatch.setattr(kv_split, "_BLOCK_ELEMS", block)
    peak, kept = _chunked_prefill_peak(length, chunk)
    assert kept == layers * rows * 2 * HEAD_DIM * ITEM * (length + (KV_HEADS - 1) * (SINK + WINDOW))
    per_token = ITEM * (4 * hidden + 3 * inter + 4 * heads * HEAD_DIM)  # hidden states, MLP, q/k/v/output
    allowance = rows * chunk * per_token + 2 * 8 * block + kept // layers
    assert peak <= kept + allowance
    monkeypatch.setattr(kv_split, "_BLOCK_ELEMS", 2**30)
    monkeypatch.setattr(masks, "mask_stays_implicit", lambda *args, **kwargs: False)
    dense_peak, dense_kept = _chunked_prefill_peak(length, chunk)
    assert dense_kept == kept
    assert dense_peak > kept + allowance  # 128 x 4,096 x 2 rows x (1 + 4) bytes of masks exceed the allowance


@pytest.mark.parametrize("window", [None, 5])
def test_the_full_group_by_query_blocks_equals_one_call(monkeypatch, window):
    """The full group's attention by query blocks of a few mask entries (each block over the keys it sees)
    gives the logits of one call, left-padded and chunked, causal (Llama) and with the model's sliding window
    (Mistral, whose window mask transformers still builds), to 1e-5."""
    from headlab.instrument import kv_split

    register()
    torch.manual_seed(0)
    common = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
                  num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, vocab_size=VOCAB, max_position_embeddings=1024)
    config = transformers.LlamaConfig(**common) if window is None else \
        transformers.MistralConfig(sliding_window=window, **common)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=ATTN_IMPLEMENTATION).eval()
    ids, mask = _batch([30, 21], seed=4)

    def run():
        with torch.no_grad(), kv_policy(model, _map("streaming", layers=2), prefill_chunk=7) as usage:
            out = model(input_ids=ids, attention_mask=mask, position_ids=_positions(mask), use_cache=True)
            m = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
            step = model(input_ids=out.logits[:, -1].argmax(-1)[:, None], attention_mask=m,
                         position_ids=_positions(m)[:, -1:], cache=out.cache, use_cache=True)
        assert any("full group: sdpa" in path for path in usage.paths)
        return out.logits, step.logits

    whole, whole_step = run()
    monkeypatch.setattr(kv_split, "_BLOCK_ELEMS", 2 * 30)  # a query or two per block
    blocked, blocked_step = run()
    real = mask.bool()
    torch.testing.assert_close(blocked[real], whole[real], rtol=0, atol=1e-5)
    torch.testing.assert_close(blocked_step, whole_step, rtol=0, atol=1e-5)
