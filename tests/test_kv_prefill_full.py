"""``prefill: full`` of the ``streaming`` and ``random`` KV policies (kvpress's and DuoAttention's deployment): in a
row's first forward every head attends causally over the whole prompt, the cache then keeps only the sinks and
window of compressed heads, and decode runs under the bounded mask. Against a dense-mask eager reference written
here, on tiny random Llama and Qwen2 models with GQA, batched with left padding; the cache holds the bounded
prefill's layout and bytes; the prefill keeps one layer's full keys and values alive at a time; a window covering
the context equals ``full``; chunked prefills are refused. ``question_tokens`` (kvpress's context/question split):
the prompt but its last tokens prefilled in full, those tokens then attending the compressed cache, against the
same reference with those queries bounded; in a generate step; its refusals."""

from __future__ import annotations

import weakref
from dataclasses import replace

import numpy as np
import pytest
import torch
import transformers
import xarray as xr
from transformers import AttentionInterface

import headlab
from headlab import component
from headlab.instrument import ATTN_IMPLEMENTATION, register
from headlab.kv import HeadBudgetMap, HeadMap, HeadwiseCache, HeadwiseLayer, KvPolicyError, kv_policy

from fixtures.kv import assert_batch_equals_rows, greedy_recompute
from fixtures.kv import greedy_decode as _decode
from fixtures.kv import left_padded as _batch
from fixtures.kv import positions as _positions
from fixtures.specs import spec_error, spec_text

VOCAB = 97
HEAD_DIM, ITEM = 8, 4  # 64 hidden / 8 query heads, float32
FULL = [[True, False, False, True], [False, False, True, False]]
_REF: dict = {}


def _reference_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Eager attention with one dense mask per head over a left-padded batch whose prompt fills the first
    ``_REF["prompt"]`` padded positions: every query of the prompt sees every earlier real token (all heads); a
    later (generated) query of a compressed KV head's query heads sees only own positions ``< sink`` or within
    ``window``, one of a full KV head every earlier real token."""
    full, sink, window, pad, prompt = (_REF["full"][module.layer_idx], _REF["sink"], _REF["window"], _REF["pad"],
                                       _REF["prompt"])
    B, H, N, D = query.shape
    g = H // key.shape[1]
    k, v = key.repeat_interleave(g, 1).float(), value.repeat_interleave(g, 1).float()
    own = torch.arange(N)[None, :] - pad[:, None]
    d = own[:, :, None] - own[:, None, :]
    causal = (own[:, None, :] >= 0) & (d >= 0)
    in_prompt = (torch.arange(N) < prompt)[None, :, None]  # (1, N queries, 1)
    bounded = causal & (in_prompt | (own[:, None, :] < sink) | (d < window))
    per_head = torch.tensor([bool(full[h // g]) for h in range(H)])
    mask = torch.where(per_head[None, :, None, None], causal[:, None], bounded[:, None])
    mask |= torch.eye(N, dtype=torch.bool)[None, None] & (own < 0)[:, None, :, None]  # padding queries: no NaN
    s = (query.float() @ k.transpose(-1, -2)) * (scaling if scaling is not None else D**-0.5)
    a = s.masked_fill(~mask, -torch.inf).softmax(-1)
    return (a @ v).to(query.dtype).transpose(1, 2).contiguous(), None


AttentionInterface.register("kv_prefill_reference", _reference_attention)


def _config(kind: str, layers: int = 2) -> transformers.PretrainedConfig:
    common = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=layers, num_attention_heads=8,
                  num_key_value_heads=4, vocab_size=VOCAB, max_position_embeddings=1024)
    if kind == "llama":
        return transformers.LlamaConfig(**common)
    return transformers.Qwen2Config(**common, use_sliding_window=False)


def _models(kind: str, layers: int = 2):
    register()
    torch.manual_seed(0)
    ours = transformers.AutoModelForCausalLM.from_config(_config(kind, layers),
                                                         attn_implementation=ATTN_IMPLEMENTATION).eval()
    ref = transformers.AutoModelForCausalLM.from_config(_config(kind, layers),
                                                        attn_implementation="kv_prefill_reference").eval()
    ref.load_state_dict(ours.state_dict())
    return ours, ref


def _kv(values) -> xr.DataArray:
    arr = np.array(values, dtype=bool)
    return xr.DataArray(arr, dims=("layer", "kv_head"), coords={"layer": np.arange(arr.shape[0]),
                                                                "kv_head": np.arange(arr.shape[1])})


def _map(full, sink: int, window: int, prefill: str = "full") -> HeadMap:
    return HeadMap(_kv(full), sink=sink, window=window, prefill=prefill)


def _reference(model, ids, mask, steps: int, head_map: HeadMap, question: int = 0):
    """The same greedy decoding without a cache: every step recomputes the whole row under the dense masks (the
    prompt's queries full, the generated ones bounded for compressed heads; with ``question``, the prompt's last
    ``question`` queries bounded too, as generated ones)."""
    _REF.update(full=head_map.kv_full.values, sink=head_map.sink, window=head_map.window,
                pad=(mask == 0).sum(-1), prompt=ids.shape[1] - question)
    return greedy_recompute(model, ids, mask, steps)


def _real(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return logits[mask.bool()]


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize(("sink", "window"), [(2, 3), (0, 4)])
def test_a_full_prefill_equals_the_dense_mask_reference(kind, sink, window):
    ours, ref = _models(kind)
    ids, mask = _batch([11, 7, 13])
    head_map = _map(FULL, sink, window)
    p_ours, s_ours, t_ours, cache, usage = _decode(ours, ids, mask, 8, head_map)
    p_ref, s_ref, t_ref = _reference(ref, ids, mask, 8, head_map)
    torch.testing.assert_close(_real(p_ours, mask), _real(p_ref, mask), rtol=0, atol=1e-5)
    torch.testing.assert_close(s_ours, s_ref, rtol=0, atol=1e-5)
    assert t_ours.equal(t_ref)
    assert isinstance(cache, HeadwiseCache)
    # the prefill is full's; decoding is not (keys were dropped), nor the bounded prefill's decode
    p_full, s_full, *_ = _decode(ours, ids, mask, 8, None)
    torch.testing.assert_close(_real(p_ours, mask), _real(p_full, mask), rtol=0, atol=1e-5)
    assert (s_full - s_ours).abs().max() > 1e-3
    s_bounded = _decode(ours, ids, mask, 8, _map(FULL, sink, window, "bounded"))[1]
    assert (s_bounded - s_ours).abs().max() > 1e-3
    assert any("full prefill" in p for p in usage.paths) and any("sinks + ring buffer" in p for p in usage.paths)


def test_a_layer_of_only_full_heads_and_the_dense_mask():
    """Layer 0 all full (the model's own layer; transformers' dense mask is built for every forward): the other
    layer's full prefill reads that mask, and the run equals the reference."""
    ours, ref = _models("llama")
    ids, mask = _batch([12, 8, 10], seed=4)
    head_map = _map([[True] * 4, [False, True, False, False]], 1, 3)
    p_ours, s_ours, t_ours, _, _ = _decode(ours, ids, mask, 6, head_map)
    p_ref, s_ref, t_ref = _reference(ref, ids, mask, 6, head_map)
    torch.testing.assert_close(_real(p_ours, mask), _real(p_ref, mask), rtol=0, atol=1e-5)
    torch.testing.assert_close(s_ours, s_ref, rtol=0, atol=1e-5)
    assert t_ours.equal(t_ref)


def test_a_batch_of_three_equals_its_rows_one_by_one():
    ours, _ = _models("qwen2")
    assert_batch_equals_rows(ours, [9, 14, 5], 6, _map(FULL, 2, 4), seed=5)


def test_the_cache_holds_the_bounded_prefills_layout_and_bytes():
    """The same keys per KV head (counted) and the same bytes per layer as a bounded prefill, by the formula."""
    ours, _ = _models("llama")
    lengths = [11, 7, 13]
    ids, mask = _batch(lengths)
    sink, window, steps = 2, 3, 5
    *_, cache, usage = _decode(ours, ids, mask, steps, _map(FULL, sink, window))
    *_, bounded, bounded_usage = _decode(ours, ids, mask, steps, _map(FULL, sink, window, "bounded"))
    seen, longest = ids.shape[1] + steps, max(lengths) + steps
    for layer in range(2):
        n_full = sum(FULL[layer])
        pos = cache.compressed(layer)[2]
        for r, length in enumerate(lengths):
            n = length + steps
            assert sorted(pos[r][pos[r] >= 0].tolist()) == [p for p in range(n) if p < sink or p >= n - window]
        assert torch.equal(pos, bounded.compressed(layer)[2])
        assert cache.full_group(layer)[0].shape == (3, n_full, seen, HEAD_DIM)
        slots = min(sink, longest) + min(window, longest - sink)
        expected = 2 * 3 * (n_full * seen + (4 - n_full) * slots) * HEAD_DIM * ITEM
        assert cache.nbytes(layer) == bounded.nbytes(layer) == expected == int(usage.layer_bytes[layer])
    assert np.array_equal(usage.layer_bytes, bounded_usage.layer_bytes)
    assert usage.full_nbytes == bounded_usage.full_nbytes


def test_a_window_covering_the_context_equals_full():
    ours, _ = _models("llama")
    ids, mask = _batch([10, 6])
    steps = 6
    head_map = _map(FULL, 4, ids.shape[1] + steps)  # no compressed head ever drops a token
    p_ours, s_ours, t_ours, cache, _ = _decode(ours, ids, mask, steps, head_map)
    p_full, s_full, t_full, _, _ = _decode(ours, ids, mask, steps, None)
    assert isinstance(cache, HeadwiseCache) and cache.nbytes() == cache.full_nbytes()
    torch.testing.assert_close(_real(p_ours, mask), _real(p_full, mask), rtol=0, atol=1e-5)
    torch.testing.assert_close(s_ours, s_full, rtol=0, atol=1e-5)
    assert t_ours.equal(t_full)


LAYERS, KV_HEADS, SINK, WINDOW = 4, 4, 2, 8


def _prefill_peak(layers: int, prefill: str, length: int):
    """(live peak, bytes kept, cache) of a prefill of two left-padded rows (``length`` and ``length - 24``
    tokens) on a ``layers``-layer Llama, KV head 0 full in every layer, the last position's logits only."""
    model, _ = _models("llama", layers=layers)
    full = np.zeros((layers, KV_HEADS), dtype=bool)
    full[:, 0] = True
    ids, mask = _batch([length, length - 24], seed=2)
    with torch.no_grad(), kv_policy(model, _map(full, SINK, WINDOW, prefill), cpu_peak=True) as usage:
        out = model(input_ids=ids, attention_mask=mask, position_ids=_positions(mask), use_cache=True,
                    logits_to_keep=1)
        cache = out.cache
        del out
    return usage.peak_memory, usage.nbytes, cache


def test_the_prefill_holds_one_layers_full_keys_at_a_time(monkeypatch):
    """Every layer's attention reads all its KV heads' keys of the prompt, and those are freed before the next
    layer starts (no earlier layer's are alive); the cache keeps the bounded prefill's bytes; and the live peak
    of a deeper model grows by its kept bytes only: holding every layer's full keys and values would add one
    layer's worth per layer."""
    length = 256
    fresh: dict[int, list[weakref.ref]] = {}
    update = HeadwiseLayer.update

    def recording(self, key_states, value_states, *args, **kwargs):
        out = update(self, key_states, value_states, *args, **kwargs)
        if self.pending is not None and self.pending.prefill:
            assert out[0] is key_states and key_states.shape[1] == KV_HEADS
            fresh[id(self)] = [weakref.ref(key_states.untyped_storage()),
                               weakref.ref(value_states.untyped_storage())]
        return out

    alive_at: list[tuple[int, int]] = []

    def check(module, args):
        alive_at.append((module.self_attn.layer_idx, sum(r() is not None for refs in fresh.values() for r in refs)))

    monkeypatch.setattr(HeadwiseLayer, "update", recording)
    model, _ = _models("llama", layers=LAYERS)
    full = np.zeros((LAYERS, KV_HEADS), dtype=bool)
    full[:, 0] = True
    ids, mask = _batch([length, length - 24], seed=2)
    hooks = [layer.register_forward_pre_hook(check) for layer in model.model.layers]
    try:
        with torch.no_grad(), kv_policy(model, _map(full, SINK, WINDOW)):
            model(input_ids=ids, attention_mask=mask, position_ids=_positions(mask), use_cache=True, logits_to_keep=1)
    finally:
        for hook in hooks:
            hook.remove()
    monkeypatch.setattr(HeadwiseLayer, "update", update)
    assert alive_at == [(i, 0) for i in range(LAYERS)]
    assert len(fresh) == LAYERS and all(r() is None for refs in fresh.values() for r in refs)

    peak, kept, cache = _prefill_peak(LAYERS, "full", length)
    _, bounded_kept, bounded = _prefill_peak(LAYERS, "bounded", length)
    assert kept == bounded_kept == LAYERS * 2 * 2 * HEAD_DIM * ITEM * (length + (KV_HEADS - 1) * (SINK + WINDOW))
    for a, b in zip(cache.layers, bounded.layers, strict=True):
        assert a.keys.shape == b.keys.shape and a.slot_keys.shape == b.slot_keys.shape
    shallow_peak, shallow_kept, _ = _prefill_peak(2, "full", length)
    one_layer = 2 * 2 * KV_HEADS * length * HEAD_DIM * ITEM  # keys and values of every KV head, two rows
    grown, grown_kept = peak - shallow_peak, kept - shallow_kept
    assert grown_kept <= grown < grown_kept + one_layer // 4  # not + (LAYERS - 2) * one_layer


def test_chunked_and_piecewise_prefills_are_refused():
    ours, _ = _models("llama")
    head_map = _map(FULL, 2, 3)
    with pytest.raises(KvPolicyError, match="prefill: full: a chunked prefill is not supported"):
        with kv_policy(ours, head_map, prefill_chunk=4):
            pass
    ids, mask = _batch([12, 9])
    with pytest.raises(KvPolicyError, match="the first forward must be the whole prompt"), torch.no_grad(), \
            kv_policy(ours, head_map):
        first = ours(input_ids=ids[:, :7], attention_mask=mask[:, :7], position_ids=_positions(mask)[:, :7])
        ours(input_ids=ids[:, 7:], attention_mask=mask, position_ids=_positions(mask)[:, 7:], cache=first.cache)
    with kv_policy(ours, replace(HeadMap.full(headlab.Geometry(2, 8, 4, HEAD_DIM)), prefill="full"), prefill_chunk=4):
        pass  # every head full: nothing to refuse
    with pytest.raises(KvPolicyError, match="compensation token"):
        replace(head_map, compensate=True)
    with pytest.raises(KvPolicyError, match="'bounded' or 'full'"):
        replace(head_map, prefill="whole")
    for kind, extra in (("streaming", {"full_heads": [[0, 0]]}), ("random", {"n_full": 1})):
        config = component("kv", kind).config
        assert config.model_validate({"kind": kind, "window": 8, **extra}).prefill == "bounded"
        with pytest.raises(ValueError, match="prefill: full attends every head over the whole prompt"):
            config.model_validate({"kind": kind, "window": 8, "prefill": "full", "prefill_chunk": 16, **extra})
    error = spec_error(spec_text("  - id: gen\n    generate:\n      kv: {kind: streaming, window: 3, prefill: full, "
                                 "prefill_chunk: 5}\n"))
    assert "prefill: full attends every head over the whole prompt" in error and "gen" in error


def test_a_generate_step_records_its_prefill(tmp_path):
    """``prefill: full`` in a spec: the head map's attrs and the step's ``kv_attention`` say which prefill ran;
    the bytes are those of the bounded prefill; a budget keeps the option (``random`` as well)."""
    task = "{kind: repeated_tokens, n: 3, length: 8}"
    detect = "  - id: ind\n    detect: {kind: induction}\n"

    def gen(kv: str) -> str:
        return detect + f"  - id: gen\n    generate:\n      max_new_tokens: 4\n      kv: {kv}\n"

    def run(kv: str, out: str):
        return headlab.run(spec_text(gen(kv), task=task), out=tmp_path / out).results["gen"]

    base = "kind: streaming, full_heads: {from: ind, top: 1}, sink: 1, window: 3"
    full, bounded = run("{" + base + ", prefill: full}", "a"), run("{" + base + "}", "b")
    assert full["kv_full"].attrs["prefill"] == "full" and bounded["kv_full"].attrs["prefill"] == "bounded"
    assert "full prefill" in full.attrs["kv_attention"] and "full prefill" not in bounded.attrs["kv_attention"]
    assert np.array_equal(full["kv_bytes"].values, bounded["kv_bytes"].values)
    budgeted = run("{kind: streaming, full_heads: {from: ind}, sink: 1, window: 3, prefill: full, "
                   "budget: {fraction: 0.6}}", "c")
    assert budgeted["kv_full"].attrs["prefill"] == "full" and "full prefill" in budgeted.attrs["kv_attention"]
    control = run("{kind: random, like: {from: ind, top: 1}, sink: 1, window: 3, prefill: full}", "d")
    assert control["kv_full"].attrs["prefill"] == "full" and "full prefill" in control.attrs["kv_attention"]


# --- question_tokens: kvpress's context/question split -----------------------------------------------------


@pytest.mark.parametrize("question", [1, 3])
@pytest.mark.parametrize(("kind", "sink", "window"), [("llama", 2, 3), ("qwen2", 0, 2)])
def test_question_tokens_equal_the_dense_mask_reference(kind, sink, window, question):
    """The prompt but its last ``question`` tokens prefilled with every head causal, then those tokens and the
    decode steps with compressed heads on their sinks + window (full heads causal): the reference's dense masks
    with the bounded queries starting ``question`` tokens before the prompt's end."""
    ours, ref = _models(kind)
    ids, mask = _batch([11, 7, 13])
    head_map = _map(FULL, sink, window)
    p_ours, s_ours, t_ours, cache, usage = _decode(ours, ids, mask, 8, head_map, question_tokens=question)
    p_ref, s_ref, t_ref = _reference(ref, ids, mask, 8, head_map, question)
    torch.testing.assert_close(_real(p_ours, mask), _real(p_ref, mask), rtol=0, atol=1e-5)
    torch.testing.assert_close(s_ours, s_ref, rtol=0, atol=1e-5)
    assert t_ours.equal(t_ref)
    # the context's logits are the whole prompt's full prefill's; the question's are not
    p_whole, _, _, whole_cache, whole_usage = _decode(ours, ids, mask, 8, head_map)
    torch.testing.assert_close(p_ours[:, :-question], p_whole[:, :-question], rtol=0, atol=1e-5)
    assert (p_ours[:, -question:] - p_whole[:, -question:]).abs().max() > 1e-3
    # the same cache layout and bytes
    assert np.array_equal(usage.layer_bytes, whole_usage.layer_bytes)
    for layer in range(2):
        assert torch.equal(cache.compressed(layer)[2], whole_cache.compressed(layer)[2])
    question_path = "sinks + ring buffer" if question == 1 else "sinks + window by query blocks"
    assert any("full prefill" in p for p in usage.paths) and any(question_path in p for p in usage.paths)


def test_question_tokens_keep_logits_to_keep_and_the_cache():
    """One forward as ``headlab.generation.prefill`` runs it (last position's logits only): the split forward
    returns that position's logits, and the cache it returns decodes on."""
    ours, _ = _models("llama")
    ids, mask = _batch([10, 12], seed=3)
    head_map = _map(FULL, 1, 4)
    with torch.no_grad(), kv_policy(ours, head_map, question_tokens=2):
        out = ours(input_ids=ids, attention_mask=mask, position_ids=_positions(mask), logits_to_keep=1)
    p_ours = _decode(ours, ids, mask, 0, head_map, question_tokens=2)[0]
    assert out.logits.shape == (2, 1, VOCAB)
    torch.testing.assert_close(out.logits[:, 0], p_ours[:, -1], rtol=0, atol=1e-5)
    assert isinstance(out.cache, HeadwiseCache) and out.cache.get_seq_length() == ids.shape[1]


def test_question_tokens_under_a_full_map_split_nothing():
    """Every head full (a window covering the context): the model's own cache, one forward, today's logits."""
    ours, _ = _models("llama")
    ids, mask = _batch([9, 6], seed=2)
    full = HeadMap.full(headlab.Geometry(2, 8, 4, HEAD_DIM))
    calls = []
    hook = ours.model.register_forward_pre_hook(lambda module, args: calls.append(1))
    try:
        p_q, s_q, t_q, *_ = _decode(ours, ids, mask, 3, full, question_tokens=2)
    finally:
        hook.remove()
    p_plain, s_plain, t_plain, *_ = _decode(ours, ids, mask, 3, None)
    assert len(calls) == 4  # the prompt in one forward, then three steps
    assert torch.equal(p_q, p_plain) and torch.equal(s_q, s_plain) and t_q.equal(t_plain)


def test_question_tokens_refusals():
    ours, _ = _models("llama")
    head_map = _map(FULL, 2, 3)
    with pytest.raises(KvPolicyError, match="question_tokens 2: the question is fed after a full prefill's"):
        with kv_policy(ours, _map(FULL, 2, 3, "bounded"), question_tokens=2):
            pass
    for bad in (-1, True, 1.5):
        with pytest.raises(KvPolicyError, match="question_tokens must be a number of tokens"):
            with kv_policy(ours, head_map, question_tokens=bad):
                pass
    headkv = HeadBudgetMap(_kv(np.zeros((2, 4), dtype=bool)),
                           kv_budget=xr.DataArray(np.full((2, 4), 6), dims=("layer", "kv_head")))
    with pytest.raises(KvPolicyError, match="headkv: question_tokens is not supported"):
        with kv_policy(ours, headkv, question_tokens=1):
            pass
    ids, mask = _batch([12, 3])
    with pytest.raises(KvPolicyError, match="question_tokens 3: row 1 of the batch has 3 tokens"), \
            torch.no_grad(), kv_policy(ours, head_map, question_tokens=3):
        ours(input_ids=ids, attention_mask=mask, position_ids=_positions(mask))
    with pytest.raises(KvPolicyError, match="positional arguments"), torch.no_grad(), \
            kv_policy(ours, head_map, question_tokens=1):
        ours(ids, mask)
    ids, mask = _batch([12, 9])
    with pytest.raises(KvPolicyError, match="the first forward must be the whole prompt"), torch.no_grad(), \
            kv_policy(ours, head_map, question_tokens=2):  # a later forward longer than the question
        first = ours(input_ids=ids[:, :7], attention_mask=mask[:, :7], position_ids=_positions(mask)[:, :7])
        ours(input_ids=ids[:, 7:10], attention_mask=mask[:, :10], position_ids=_positions(mask)[:, 7:10],
             cache=first.cache)
    for kind, extra in (("streaming", {"full_heads": [[0, 0]]}), ("random", {"n_full": 1})):
        config = component("kv", kind).config
        assert config.model_validate({"kind": kind, "window": 8, **extra}).question_tokens == 0
        assert config.model_validate({"kind": kind, "window": 8, "prefill": "full", "question_tokens": 2,
                                      **extra}).question_tokens == 2
        with pytest.raises(ValueError, match="question_tokens 2: the question is fed after a full prefill's"):
            config.model_validate({"kind": kind, "window": 8, "question_tokens": 2, **extra})
        with pytest.raises(ValueError, match="greater than or equal to 0"):
            config.model_validate({"kind": kind, "window": 8, "prefill": "full", "question_tokens": -1, **extra})
    kv = "{kind: streaming, window: 3, prefill: full, question_tokens: 1}"
    error = spec_error(spec_text(f"  - id: sc\n    score: {{kv: {kv}}}\n"))
    assert "steps[0].score" in error and "give it on a generate step" in error
    error = spec_error(spec_text("  - id: gen\n    generate:\n      kv: {kind: streaming, window: 3, "
                                 "question_tokens: 1}\n"))
    assert "steps[0].generate.kv" in error and "give prefill: full" in error


def test_a_generate_step_with_question_tokens(tmp_path):
    """``question_tokens`` in a spec: recorded on ``kv_full``, the bytes of the whole prompt's full prefill, the
    question read by the compressed heads' bounded path; 0 (the default) is the whole prompt's full prefill; a
    prompt no longer than the question is one located error naming the example."""
    task = "{kind: repeated_tokens, n: 3, length: 8}"
    detect = "  - id: ind\n    detect: {kind: induction}\n"

    def run(kv: str, out: str):
        steps = detect + f"  - id: gen\n    generate:\n      max_new_tokens: 4\n      kv: {kv}\n"
        return headlab.run(spec_text(steps, task=task), out=tmp_path / out).results["gen"]

    base = "kind: streaming, full_heads: {from: ind, top: 1}, sink: 1, window: 3, prefill: full"
    split, whole, zero = (run("{" + base + q + "}", out) for q, out in
                          ((", question_tokens: 2", "a"), ("", "b"), (", question_tokens: 0", "c")))
    assert split["kv_full"].attrs["question_tokens"] == 2 and "question_tokens" not in whole["kv_full"].attrs
    assert "sinks + window by query blocks" in split.attrs["kv_attention"]
    assert "sinks + window by query blocks" not in whole.attrs["kv_attention"]
    assert np.array_equal(split["kv_bytes"].values, whole["kv_bytes"].values)
    assert np.array_equal(zero["output_ids"].values, whole["output_ids"].values)
    assert zero.attrs["kv_attention"] == whole.attrs["kv_attention"] and "question_tokens" not in zero["kv_full"].attrs
    control = run("{kind: random, like: {from: ind, top: 1}, sink: 1, window: 3, prefill: full, question_tokens: 1}",
                  "d")
    assert control["kv_full"].attrs["question_tokens"] == 1
    with pytest.raises(KvPolicyError, match=r"kv question_tokens 500: example 0 has \d+ prompt tokens") as info:
        run("{" + base + ", question_tokens: 500}", "e")
    assert "gen" in str(info.value)
