"""The ``headkv`` runtime (:class:`headlab.kv.HeadBudgetLayer`): the prefill attends every head causally, then
each compressed KV head keeps its SnapKV selection and every generated token. Checked against a dense-mask
eager reference written here, whose kept positions come from the definition (the last window's attention,
averaged over the window's queries and the KV head's query heads, max-pooled, the top ``budget - window``
before the window plus the window), on tiny random Llama and Qwen2 models with GQA, batched with left padding;
a batch equals its rows one by one; the cache holds exactly the budgeted keys and its bytes the formula; a
generate step with ``kv: {kind: headkv}`` through the runner stores what its caches held. A prompt prefilled by
chunks (``prefill_chunk``) keeps the same keys and gives the same cache, logits and tokens as one forward."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
import xarray as xr
from transformers import AttentionInterface

import headlab
from headlab.geometry import Geometry
from headlab.instrument import ATTN_IMPLEMENTATION, register
from headlab.kv import (
    HeadBudgetLayer,
    HeadBudgetMap,
    HeadwiseCache,
    KvBudget,
    ScoresFrom,
    kv_head_scores,
    kv_policy,
    token_bytes,
)

from fixtures.kv import greedy_decode as _decode
from fixtures.kv import greedy_recompute
from fixtures.kv import left_padded as _batch
from fixtures.kv import positions as _positions
from fixtures.specs import TINY_LLAMA, spec_text

VOCAB = 97
WINDOW, KERNEL = 4, 3
_REF: dict = {}


def _definition_keep(query, key, pad, budgets, scaling):
    """Kept padded indices per (row, KV head) from the definition, one row and head at a time in float64."""
    B, H, N, D = query.shape
    n_kv = key.shape[1]
    g = H // n_kv
    out = {}
    for b in range(B):
        p = int(pad[b])
        for j in range(n_kv):
            real = list(range(p, N))
            if budgets[j] >= len(real):
                out[b, j] = set(real)
                continue
            score = torch.zeros(N, dtype=torch.float64)
            for h in range(j * g, (j + 1) * g):
                for qi in range(N - WINDOW, N):
                    if qi < p:
                        continue  # a padding query adds nothing
                    logits = (query[b, h, qi].double() @ key[b, j, p:qi + 1].double().T) * scaling
                    score[p:qi + 1] += logits.softmax(-1)
            before = N - WINDOW
            pooled = [max(score[max(0, i - KERNEL // 2):min(before, i + KERNEL // 2 + 1)].tolist())
                      for i in range(before)]
            ranked = sorted((i for i in range(p, before)), key=lambda i: (-pooled[i], i))
            out[b, j] = set(ranked[: budgets[j] - WINDOW]) | set(range(max(p, before), N))
    return out


def _reference_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Eager attention with one dense mask per head: the prompt's queries causal over every real key (the
    prefill); a generated token's queries, for a compressed KV head, over its kept prompt keys and the
    generated tokens up to their own."""
    layer = module.layer_idx
    B, H, N, D = query.shape
    g = H // key.shape[1]
    scale = scaling if scaling is not None else D**-0.5
    pad, prompt, budgets = _REF["pad"], _REF["prompt"], _REF["budgets"][layer]
    if layer not in _REF["kept"]:  # the prefill pass: select from the definition
        assert N == prompt
        _REF["kept"][layer] = _definition_keep(query, key, pad, budgets, scale)
    kept = _REF["kept"][layer]
    idx = torch.arange(N)
    causal = (idx[None, None, :] <= idx[None, :, None]) & (idx[None, None, :] >= pad[:, None, None])  # (B, N, N)
    mask = causal[:, None].repeat(1, H, 1, 1)
    for b in range(B):
        for j in range(key.shape[1]):
            if _REF["full"][layer][j]:
                continue
            allowed = torch.zeros(N, dtype=torch.bool)
            allowed[sorted(kept[b, j])] = True
            allowed[prompt:] = True
            rows = mask[b, j * g:(j + 1) * g, prompt:]
            rows &= allowed[None, None, :]
    mask |= torch.eye(N, dtype=torch.bool)[None, None] & (idx[None, :] < pad[:, None])[:, None, :, None]
    k, v = key.repeat_interleave(g, 1).float(), value.repeat_interleave(g, 1).float()
    s = (query.float() @ k.transpose(-1, -2)) * scale
    a = s.masked_fill(~mask, -torch.inf).softmax(-1)
    return (a @ v).to(query.dtype).transpose(1, 2).contiguous(), None


AttentionInterface.register("kv_headkv_reference", _reference_attention)


def _config(kind: str) -> transformers.PretrainedConfig:
    common = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
                  num_key_value_heads=4, vocab_size=VOCAB, max_position_embeddings=128)
    if kind == "llama":
        return transformers.LlamaConfig(**common)
    return transformers.Qwen2Config(**common, use_sliding_window=False)


def _models(kind: str):
    register()
    torch.manual_seed(0)
    ours = transformers.AutoModelForCausalLM.from_config(_config(kind), attn_implementation=ATTN_IMPLEMENTATION).eval()
    ref = transformers.AutoModelForCausalLM.from_config(_config(kind), attn_implementation="kv_headkv_reference")
    ref.load_state_dict(ours.state_dict())
    return ours, ref.eval()


def _kv(values) -> xr.DataArray:
    arr = np.asarray(values)
    return xr.DataArray(arr, dims=("layer", "kv_head"),
                        coords={"layer": np.arange(arr.shape[0]), "kv_head": np.arange(arr.shape[1])})


# layer 0: budgets below, inside and above the rows' lengths (10..20); layer 1: one KV head full at 20
BUDGETS = [[6, 10, 25, 14], [12, 4, 7, 30]]
LENGTHS = [14, 9, 20, 17]


def _map(budgets=BUDGETS, length: int = max(LENGTHS)) -> HeadBudgetMap:
    hm = HeadBudgetMap(_kv(np.zeros(np.shape(budgets), dtype=bool)), kv_budget=_kv(np.asarray(budgets)),
                       observation_window=WINDOW, kernel_size=KERNEL)
    return hm.for_length(length)


def _reference(model, ids, mask, steps: int, head_map: HeadBudgetMap):
    _REF.update(pad=(mask == 0).sum(-1), prompt=ids.shape[1], kept={}, full=head_map.kv_full.values,
                budgets=head_map.kv_budget.values.tolist())
    return (*greedy_recompute(model, ids, mask, steps), dict(_REF["kept"]))


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_headkv_equals_the_dense_mask_reference(kind):
    ours, ref = _models(kind)
    ids, mask = _batch(LENGTHS)
    head_map = _map()
    assert head_map.kv_full.values.tolist() == [[False, False, True, False], [False, False, False, True]]
    steps = 6
    p, s, tok, cache, usage = _decode(ours, ids, mask, steps, head_map)
    rp, rs, rtok, kept = _reference(ref, ids, mask, steps, head_map)
    torch.testing.assert_close(p[mask.bool()], rp[mask.bool()], atol=1e-5, rtol=1e-5)  # the prefill: full
    torch.testing.assert_close(s, rs, atol=1e-5, rtol=1e-5)
    assert torch.equal(tok, rtok)
    for layer_idx, layer in enumerate(cache.layers):
        assert isinstance(layer, HeadBudgetLayer)
        for i, head in enumerate(layer.compressed_heads.tolist()):
            _, _, pos = layer.head_cache(i)
            for b in range(len(LENGTHS)):
                prompt = {int(x) for x in pos[b] if 0 <= x < ids.shape[1]}
                assert prompt == kept[layer_idx][b, head]
                assert sorted(int(x) for x in pos[b] if x >= ids.shape[1]) == list(range(ids.shape[1],
                                                                                          ids.shape[1] + steps))
        assert "compressed group" in " ".join(layer.attention_paths)
        assert "headkv prefill" in " ".join(layer.attention_paths)
    # the selection really dropped keys the window attends to less, and not the same ones for every head
    assert kept[0][0, 0] != kept[0][0, 1] and len(kept[0][0, 0]) == 6 and len(kept[0][1, 3]) == 9
    assert usage.nbytes == cache.nbytes() < usage.full_nbytes


@pytest.mark.parametrize("budgets", [BUDGETS, [[6, 5, 7, 8], [5, 6, 9, 4]]], ids=["mixed", "all-compressed"])
def test_the_cache_holds_exactly_the_budgeted_keys_and_its_bytes_the_formula(budgets):
    ours, _ = _models("llama")
    ids, mask = _batch(LENGTHS)
    head_map = _map(budgets)
    steps = 3
    *_, cache, usage = _decode(ours, ids, mask, steps, head_map)
    real = torch.tensor(LENGTHS)
    item = 4 * 2 * 8  # float32 key and value of head_dim 8
    total = 0
    for layer_idx, layer in enumerate(cache.layers):
        budget = torch.tensor(budgets[layer_idx])
        full = torch.tensor(head_map.kv_full.values[layer_idx])
        expected = torch.where(full[None, :], real[:, None], torch.minimum(budget[None, :], real[:, None])) + steps
        counted = layer.kept_keys_per_head()
        assert torch.equal(counted.cpu(), expected)
        for i, head in enumerate(layer.compressed_heads.tolist()):  # the slots are exactly the kept keys
            k, v, pos = layer.head_cache(i)
            assert torch.equal((pos >= 0).sum(1), expected[:, head])
            assert k.shape[2] == int(expected[:, head].max())
        # bytes: the full heads' every padded position; each compressed head its longest row's keys
        n_full = int(full.sum())
        comp = [int(min(budgets[layer_idx][j], max(LENGTHS))) + steps for j in range(4) if not full[j]]
        layer_bytes = len(LENGTHS) * (n_full * (max(LENGTHS) + steps) + sum(comp)) * item
        assert layer.nbytes() == cache.nbytes(layer_idx) == layer_bytes
        assert layer.full_nbytes() == len(LENGTHS) * 4 * (max(LENGTHS) + steps) * item
        total += layer_bytes
    assert cache.nbytes() == usage.nbytes == total
    assert cache.layer_nbytes().values.tolist() == usage.to_dataarray().values.tolist()
    assert usage.kept_fraction() == pytest.approx(total / usage.full_nbytes)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_per_head_edits_on_the_kernel_paths(backend):
    """A plan's per-head edits apply in the prefill and on each compressed head after it; the torch and Triton
    kernels (interpreted on a CPU) agree with SDPA's result of the same edits, and the path is recorded."""
    if backend == "triton":
        pytest.importorskip("triton")
    from headlab.instrument import OutputScale, Plan, QueryScale, instrument

    ours, _ = _models("llama")
    ids, mask = _batch([12, 9])
    head_map = _map(length=12)
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
    torch.testing.assert_close(got[:, :-1][mask.bool()], sdpa[:, :-1][mask.bool()], rtol=0, atol=1e-5)
    assert (got[:, -1] - base[:, -1]).abs().max() > 1e-3  # the edits changed the outputs
    assert rec.backends[0][0] == backend and "kv split cache" in rec.backends[0][1]
    assert any(f"compressed group: {backend}" in p for p in usage.paths)
    assert any(f"every head: {backend}" in p for p in usage.paths)


def test_a_batch_equals_its_rows_one_by_one():
    ours, _ = _models("qwen2")
    ids, mask = _batch(LENGTHS, seed=3)
    head_map = _map()
    p, s, tok, cache, _ = _decode(ours, ids, mask, 5, head_map)
    for r, length in enumerate(LENGTHS):
        row_ids = ids[r:r + 1, ids.shape[1] - length:]
        row_map = _map(length=length)
        rp, rs, rtok, rcache, _ = _decode(ours, row_ids, torch.ones_like(row_ids), 5, row_map)
        torch.testing.assert_close(p[r, ids.shape[1] - length:], rp[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(s[r], rs[0], atol=1e-5, rtol=1e-5)
        assert torch.equal(tok[r], rtok[0])
        pad = ids.shape[1] - length
        for layer, row_layer in zip(cache.layers, rcache.layers, strict=True):
            kept = layer.kept_keys_per_head()[r]
            assert torch.equal(kept, row_layer.kept_keys_per_head()[0])
            for i, head in enumerate(layer.compressed_heads.tolist()):
                _, _, pos = layer.head_cache(i)
                own = sorted(int(x) - pad for x in pos[r] if x >= 0)
                if row_layer.full_heads.numel() and head in row_layer.full_heads.tolist():
                    assert own == list(range(length + 5))  # a budget covering this row keeps it whole
                    continue
                j = row_layer.compressed_heads.tolist().index(head)
                assert own == sorted(int(x) for x in row_layer.head_cache(j)[2][0] if x >= 0)


def test_a_chunk_after_the_prefill_keeps_every_new_token():
    ours, _ = _models("llama")
    ids, mask = _batch(LENGTHS, seed=5)
    head_map = _map()
    more = torch.randint(1, VOCAB, (len(LENGTHS), 3), generator=torch.Generator().manual_seed(7))
    with torch.no_grad(), kv_policy(ours, head_map):
        out = ours(input_ids=ids, attention_mask=mask, position_ids=_positions(mask), use_cache=True)
        full_mask = torch.cat([mask, torch.ones_like(more)], 1)
        chunk = ours(input_ids=more, attention_mask=full_mask, position_ids=_positions(full_mask)[:, -3:],
                     cache=out.cache, use_cache=True)
    # one token at a time gives the same logits as the chunk
    with torch.no_grad(), kv_policy(ours, head_map):
        out = ours(input_ids=ids, attention_mask=mask, position_ids=_positions(mask), use_cache=True)
        cache, step_mask, steps = out.cache, mask, []
        for t in range(3):
            step_mask = torch.cat([step_mask, torch.ones_like(mask[:, :1])], 1)
            step = ours(input_ids=more[:, t:t + 1], attention_mask=step_mask,
                        position_ids=_positions(step_mask)[:, -1:], cache=cache, use_cache=True)
            cache = step.cache
            steps.append(step.logits[:, -1])
    torch.testing.assert_close(chunk.logits, torch.stack(steps, 1), atol=1e-5, rtol=1e-5)
    assert torch.equal(chunk.cache.layers[0].kept_keys_per_head(), cache.layers[0].kept_keys_per_head())


# W = 4: chunks of 1 and 3 are shorter than the window (the prompt of 20 ends with a chunk of 2 under 3), and
# the row of 9 tokens (11 padding) has its first chunks all padding under 3, 5 and 7
CHUNKS = [1, 3, 5, 7]


@pytest.mark.parametrize(("kind", "budgets"), [("llama", BUDGETS), ("qwen2", [[6, 10, 25, 14], [30, 30, 30, 30]])],
                         ids=["llama-mixed", "qwen2-a-full-layer"])
def test_a_chunked_prefill_equals_one_forward_and_the_reference(kind, budgets, monkeypatch):
    """A left-padded GQA batch prefilled by chunks: every chunk attends every head over the earlier prompt keys,
    the selection runs at the prompt's last chunk over its last W queries (kept across chunks, never more than
    W of them): the kept positions per KV head, the cache's contents and bytes, the prompt logits and the decoded
    tokens are those of one forward (1e-5) and of the dense-mask reference. A map with a layer of only full
    heads runs every forward with transformers' dense mask, the other one without."""
    ours, ref = _models(kind)
    ids, mask = _batch(LENGTHS)
    head_map = _map(budgets)
    steps = 4
    one_p, one_s, one_tok, one_cache, one_usage = _decode(ours, ids, mask, steps, head_map)
    _, ref_s, ref_tok, kept = _reference(ref, ids, mask, steps, head_map)
    assert torch.equal(one_tok, ref_tok)
    real, prompt = mask.bool(), ids.shape[1]
    held: list[tuple[int, int, bool]] = []
    observe = HeadBudgetLayer.observe

    def recording(self, queries):
        observe(self, queries)
        held.append((self.seen, self.window_queries.shape[2], self.implicit_mask))

    monkeypatch.setattr(HeadBudgetLayer, "observe", recording)
    for chunk in CHUNKS:
        assert not mask[:, :chunk].any(dim=1).all()  # a row's first chunk is all padding
        held.clear()
        p, s, tok, cache, usage = _decode(ours, ids, mask, steps, head_map, prefill_chunk=chunk)
        torch.testing.assert_close(p[real], one_p[real], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(s, one_s, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(s, ref_s, atol=1e-5, rtol=1e-5)
        assert torch.equal(tok, one_tok)
        # one observation per chunk before the last, in every layer with compressed heads, bounded by the window
        chunks = -(-prompt // chunk)
        compressed_layers = sum(1 for layer in cache.layers if layer.n_compressed)
        assert len(held) == (chunks - 1) * compressed_layers
        assert all(n == min(WINDOW, seen) for seen, n, _ in held)
        implicit = all(layer.n_compressed for layer in cache.layers)  # else transformers' dense mask
        assert implicit is (kind == "llama")
        assert all(mask_left_implicit is implicit for *_, mask_left_implicit in held)
        for layer_idx, (layer, whole) in enumerate(zip(cache.layers, one_cache.layers, strict=True)):
            assert isinstance(layer, HeadBudgetLayer) and layer.window_queries is None
            torch.testing.assert_close(layer.keys, whole.keys, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(layer.values, whole.values, atol=1e-5, rtol=1e-5)
            assert torch.equal(layer.kept_keys_per_head(), whole.kept_keys_per_head())
            assert layer.nbytes() == whole.nbytes()
            for i, head in enumerate(layer.compressed_heads.tolist()):
                k, v, pos = layer.head_cache(i)
                wk, wv, wpos = whole.head_cache(i)
                assert torch.equal(pos, wpos)
                torch.testing.assert_close(k, wk, atol=1e-5, rtol=1e-5)
                torch.testing.assert_close(v, wv, atol=1e-5, rtol=1e-5)
                for b in range(len(LENGTHS)):
                    assert {int(x) for x in pos[b] if 0 <= x < prompt} == kept[layer_idx][b, head]
            if layer.n_compressed:
                paths = " ".join(layer.attention_paths)
                assert "headkv prefill chunk" in paths and "then SnapKV selection" in paths
        assert cache.nbytes() == one_cache.nbytes() == usage.nbytes == one_usage.nbytes
        assert usage.full_nbytes == one_usage.full_nbytes and usage.nbytes < usage.full_nbytes


def test_a_prompt_length_is_given_before_the_cache_stores_and_a_chunk_ends_inside_it():
    ours, _ = _models("llama")
    ids, mask = _batch([10, 7])
    head_map = _map(length=10)
    cache = HeadwiseCache.from_attention_mask(head_map, mask)
    cache.set_prompt_length(6)
    with pytest.raises(headlab.kv.KvPolicyError, match="a chunk of 10 tokens after 0 ends past the prompt's 6"), \
            torch.no_grad(), kv_policy(ours, head_map):
        ours(input_ids=ids, attention_mask=mask, position_ids=_positions(mask), cache=cache, use_cache=True)
    cache = HeadwiseCache.from_attention_mask(head_map, mask)
    with torch.no_grad(), kv_policy(ours, head_map):
        ours(input_ids=ids, attention_mask=mask, position_ids=_positions(mask), cache=cache, use_cache=True)
    with pytest.raises(headlab.kv.KvPolicyError, match="before the cache stores any token"):
        cache.set_prompt_length(10)
    with pytest.raises(headlab.kv.KvPolicyError, match="positive number of tokens"):
        HeadwiseCache(head_map).set_prompt_length(0)


def test_rows_can_be_selected_and_reordered():
    ours, _ = _models("llama")
    ids, mask = _batch(LENGTHS)
    *_, cache, _ = _decode(ours, ids, mask, 2, _map())
    before = [(layer.kept_keys_per_head().clone(), [layer.head_cache(i) for i in range(layer.n_compressed)])
              for layer in cache.layers]
    cache.batch_select_indices(torch.tensor([2, 0]))
    for layer, (kept, heads) in zip(cache.layers, before, strict=True):
        assert torch.equal(layer.kept_keys_per_head(), kept[[2, 0]])
        for i, (k, v, pos) in enumerate(heads):
            nk, nv, npos = layer.head_cache(i)
            assert torch.equal(nk, k[[2, 0]]) and torch.equal(nv, v[[2, 0]]) and torch.equal(npos, pos[[2, 0]])
    assert cache.layers[0].pad.tolist() == [0, 6]


def test_headwise_cache_takes_a_budget_map():
    cache = HeadwiseCache(_map(), pad=[0, 1])
    assert all(isinstance(layer, HeadBudgetLayer) for layer in cache.layers)
    assert cache.layers[1].full_heads.tolist() == [3] and cache.layers[0].compressed_budgets == [6, 10, 14]


TASK = "{kind: repeated_tokens, n: 3, length: 8}"
HEAD_DIM, ITEM, N_KV = 16, 4, 2  # TINY_LLAMA: hidden 64 over 4 heads, float32, 2 KV heads


def test_a_generate_step_with_headkv_stores_what_its_caches_held(tmp_path):
    kv = "{kind: headkv, scores: {from: ind}, budget: {tokens_per_head: 8}, observation_window: 3}"
    steps = "  - id: ind\n    detect: {kind: induction}\n  - id: gen\n    generate:\n      max_new_tokens: 4\n" \
            f"      kv: {kv}\n"
    run = headlab.run(spec_text(steps, task=TASK), out=tmp_path / "runs")
    ds = run.results["gen"]
    assert ds.attrs["kv_policy"] == "headkv" and "headkv prefill" in ds.attrs["kv_attention"]
    rows = ds.sizes["example"]
    full_bytes = int(ds.attrs["kv_bytes_full"])
    per_layer_full = full_bytes // TINY_LLAMA["num_hidden_layers"]
    seen = per_layer_full // (2 * rows * N_KV * HEAD_DIM * ITEM)  # positions every row's cache went through
    assert per_layer_full == 2 * rows * N_KV * seen * HEAD_DIM * ITEM
    geometry = Geometry(n_layers=TINY_LLAMA["num_hidden_layers"], n_heads=4, n_kv_heads=N_KV, head_dim=HEAD_DIM)
    scores = kv_head_scores(ScoresFrom(**{"from": "ind"}), run.results, geometry, gqa="mean")
    hm = HeadBudgetMap.allocate(scores, KvBudget(tokens_per_head=8), observation_window=3,
                                token_bytes=token_bytes(geometry, "float32"))
    budgets = hm.kv_budget.values
    prompt = seen - 3  # generate feeds back every new token but the last
    assert (budgets < prompt).any()
    for layer in range(TINY_LLAMA["num_hidden_layers"]):
        kept = np.minimum(budgets[layer], prompt) + 3
        assert int(ds["kv_bytes"].sel(layer=layer)) == 2 * rows * int(kept.sum()) * HEAD_DIM * ITEM
    kept = int(ds["kv_bytes"].sum()) / full_bytes
    assert ds.attrs["kv_kept_fraction"] == pytest.approx(kept) and kept < 1
    assert float(ds["kv_kept_fraction"]) == pytest.approx(kept)
    assert ds["kv_full"].values.tolist() == (budgets >= prompt + 4).tolist()


def test_a_generate_step_with_headkv_prefilled_by_chunks(tmp_path):
    """``prefill_chunk`` (2 and 5: below and above the observation window of 3) changes neither the tokens nor the
    bytes a headkv step's caches held."""
    def gen(extra: str) -> str:
        kv = "{kind: headkv, scores: {from: ind}, budget: {tokens_per_head: 8}, observation_window: 3" + extra + "}"
        return "  - id: ind\n    detect: {kind: induction}\n  - id: gen\n    generate:\n      max_new_tokens: 4\n" \
            f"      kv: {kv}\n"

    plain = headlab.run(spec_text(gen(""), task=TASK), out=tmp_path / "plain").results["gen"]
    assert 0 < plain.attrs["kv_kept_fraction"] < 1
    for chunk in (2, 5):
        ds = headlab.run(spec_text(gen(f", prefill_chunk: {chunk}"), task=TASK), out=tmp_path / f"c{chunk}").results["gen"]
        assert np.array_equal(ds["output_ids"].values, plain["output_ids"].values)
        assert np.array_equal(ds["kv_bytes"].values, plain["kv_bytes"].values)
        assert ds.attrs["kv_bytes_full"] == plain.attrs["kv_bytes_full"]
        assert ds.attrs["kv_kept_fraction"] == plain.attrs["kv_kept_fraction"]
        assert "headkv prefill chunk" in ds.attrs["kv_attention"]
        assert "headkv prefill chunk" not in plain.attrs["kv_attention"]


CHECKPOINT = Path(__file__).parent.parent / "headlab" / "plugins" / "models" / "tiny" / "headlab-tiny" / "model.safetensors"


@pytest.mark.skipif(not CHECKPOINT.is_file(), reason="the embedded model headlab-tiny is not built")
def test_a_score_step_under_headkv_scores_as_full(tmp_path):
    # a score step is one prefill per batch: headkv attends every head in full there, so the scores are full's
    heads = tmp_path / "heads.json"
    heads.write_text(json.dumps({f"{layer}-{head}": [0.1 + layer + 0.3 * head] for layer in range(4)
                                 for head in range(8)}))  # headlab-tiny: 4 layers x 8 heads

    def run(score: dict, out: str):
        spec = {"name": "kv", "model": "headlab-tiny", "task": {"kind": "kv_swap", "n": 2},
                "steps": [{"id": "s", "score": score}]}
        return headlab.run(spec, out=tmp_path / out).results["s"]

    kv = {"kind": "headkv", "scores": {"file": str(heads)}, "budget": {"tokens_per_head": 4},
          "observation_window": 2}
    ds, plain = run({"kv": kv}, "a"), run({}, "b")
    np.testing.assert_allclose(ds["logprob"].values, plain["logprob"].values, rtol=0, atol=1e-5)
    assert 0 < ds.attrs["kv_kept_fraction"] < 1 and "headkv prefill" in ds.attrs["kv_attention"]
