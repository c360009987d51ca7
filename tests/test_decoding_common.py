"""Tests of the pieces the decoding strategies share: repetition penalty, plan expansion, the loop's options
(the shared helpers of the decoding tests are in tests/fixtures/decoding.py)."""

from __future__ import annotations

import pytest
import torch

from headlab.context import Example
from headlab.generation import PromptSplit, Rows, decode_loop, tokenize
from headlab.instrument import Plan, instrument
from headlab.model import LoadedModel

from fixtures.decoding import (
    one_thread,  # noqa: F401  (autouse)
    random_prompts,
    request_for,
    word_model,
)


@pytest.fixture(scope="module")
def lm() -> LoadedModel:
    return word_model()


# --------------------------------------------------------------------------- tests
def test_repetition_penalty_matches_transformers_and_ignores_padding():
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    from headlab.decoding import repetition_penalty

    g = torch.Generator().manual_seed(0)
    scores = torch.randn(3, 20, generator=g)
    ids = torch.randint(0, 20, (3, 7), generator=g)
    ref = RepetitionPenaltyLogitsProcessor(1.3)(ids, scores.clone())
    ours = repetition_penalty(scores, ids, torch.ones_like(ids), 1.3)
    torch.testing.assert_close(ours, ref)
    # a left-padded row is penalised like the same tokens without padding (the pad id is not penalised)
    pad = next(v for v in range(20) if not bool((ids == v).any()))
    padded = torch.cat([torch.full((3, 2), pad), ids], dim=1)
    mask = torch.cat([torch.zeros(3, 2, dtype=torch.long), torch.ones_like(ids)], dim=1)
    torch.testing.assert_close(repetition_penalty(scores, padded, mask, 1.3), ref)
    assert not torch.equal(repetition_penalty(scores, padded, torch.ones_like(padded), 1.3), ref)


def test_seen_tokens_equal_penalty_over_the_growing_sequence():
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    from headlab.decoding import SeenTokens

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 30, (2, 6), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    ids[1, :2] = 0  # padding: not counted
    seen = SeenTokens(ids, mask, 30)
    generated = torch.empty((2, 0), dtype=torch.long)
    for _ in range(5):
        scores = torch.randn(2, 30, generator=g)
        ours = seen.penalise(scores, generated, 1.5)
        for r in range(2):
            seq = torch.cat([ids[r, mask[r].bool()], generated[r]])[None]
            torch.testing.assert_close(ours[r], RepetitionPenaltyLogitsProcessor(1.5)(seq, scores[r: r + 1].clone())[0])
        generated = torch.cat([generated, torch.randint(0, 30, (2, 1), generator=g)], dim=1)


def test_tiled_plan_mirror_and_copy0(lm):
    batch = tokenize(lm, [Example(prompt=p) for p in random_prompts(3, seed=1)])
    B = batch.size
    plan = Plan().mask_heads([(1, 0), (2, 3)], rows=[1]).scale_heads([(0, 2)], 0.5)
    plan.bias_keys([(3, 1)], [[(1, 3)], [(2, 4)], [(0, 2)]], -2.0)
    pos = (batch.attention_mask.cumsum(-1) - 1).clamp(min=0)

    def logits(p, ids, mask, position):
        with torch.no_grad(), instrument(lm.model, p):
            return lm.model(input_ids=ids, attention_mask=mask, position_ids=position).logits

    edited = logits(plan, batch.input_ids, batch.attention_mask, pos)
    plain = logits(Plan(), batch.input_ids, batch.attention_mask, pos)
    assert (edited - plain).abs().max() > 1e-3
    two = (batch.input_ids.repeat(2, 1), batch.attention_mask.repeat(2, 1), pos.repeat(2, 1))
    mirrored = logits(plan.tile(2, B, mirror=True), *two)
    torch.testing.assert_close(mirrored[:B], edited, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(mirrored[B:], edited, atol=1e-5, rtol=1e-5)
    first = logits(plan.tile(2, B, mirror=False), *two)
    torch.testing.assert_close(first[:B], edited, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(first[B:], plain, atol=1e-5, rtol=1e-5)
    # per-row output scales on every head and callbacks follow the same rule
    scales = torch.rand(B, 4, 4, generator=torch.Generator().manual_seed(3))
    dense = Plan()
    for row, layer, head in torch.ones_like(scales).nonzero().tolist():
        dense.scale_heads([(layer, head)], float(scales[row, layer, head]), rows=[row])
    dense.on_layer(lambda layer, z, ctx: torch.full((z.shape[0], z.shape[1]), 0.7) if layer == 2 else None)
    ref = logits(dense, batch.input_ids, batch.attention_mask, pos)
    out = logits(dense.tile(2, B, mirror=True), *two)
    torch.testing.assert_close(out[B:], ref, atol=1e-5, rtol=1e-5)
    out = logits(dense.tile(2, B, mirror=False), *two)
    torch.testing.assert_close(out[:B], ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[B:], plain, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mirror", [True, False])
def test_tiled_callbacks_attend_on_copy0(lm, mirror):
    """A callback that recomputes its layer with extra key biases (VHR's ``ctx.attend``) behaves on copy 0 of
    a tiled plan as on the batch alone: VHR's choice and the logits of copy 0 (and of the mirrored
    copy) equal VHR on the batch."""
    from headlab.plugins.steering.vhr import add_vhr

    batch = tokenize(lm, [Example(prompt=p) for p in random_prompts(3, seed=6, lo=6, hi=9)])
    B = batch.size
    segments = [[(batch.pad[r] + 1, batch.pad[r] + 4)] for r in range(B)]
    pos = (batch.attention_mask.cumsum(-1) - 1).clamp(min=0)

    def run(plan, k):
        with torch.no_grad(), instrument(lm.model, plan):
            return lm.model(input_ids=batch.input_ids.repeat(k, 1), attention_mask=batch.attention_mask.repeat(k, 1),
                            position_ids=pos.repeat(k, 1)).logits

    alone = Plan()
    state = add_vhr(alone, segments, None, 3.0)
    ref = run(alone, 1)
    plain = run(Plan(), 1)
    assert (ref - plain).abs().max() > 1e-3
    single = Plan()
    state2 = add_vhr(single, segments, None, 3.0)
    out = run(single.tile(2, B, mirror=mirror), 2)
    for layer in state.selected:
        assert torch.equal(state2.selected[layer], state.selected[layer])
    torch.testing.assert_close(out[:B], ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[B:], ref if mirror else plain, atol=1e-5, rtol=1e-5)


def test_decode_loop_copies_and_split_prompt_keep_greedy(lm):
    req = request_for(lm, random_prompts(3, seed=2), max_new=6)
    B = req.batch.size

    def greedy(out, _):
        return out.logits[:B, -1].argmax(-1)

    plain = decode_loop(req, greedy)
    rows = Rows(req.batch.input_ids.repeat(3, 1), req.batch.attention_mask.repeat(3, 1))
    calls = []
    copies = decode_loop(req, greedy, rows=rows, split=PromptSplit(then=lambda: calls.append(1)))
    assert copies.tokens == plain.tokens and calls == [1]
    assert len({tuple(t) for t in plain.tokens}) > 1  # the model is not degenerate
    with pytest.raises(ValueError, match="multiple"):
        decode_loop(req, greedy, rows=Rows(rows.input_ids[:4], rows.attention_mask[:4]))


def test_sampling_selection_is_seeded(lm):
    from headlab.plugins.decoding.decore import DeCoRe, decore

    """A sample depends on the request's seed and nothing else: the same seed gives the same tokens, every
    other seed other tokens, and none of them is the greedy decode."""
    cfg = DeCoRe(heads=[[1, 0]], do_sample=True, temperature=1.5, top_k=10)
    samples = {}
    for seed in (5, 6, 7):
        req = request_for(lm, random_prompts(2, seed=3), max_new=8, seed=seed)
        samples[seed] = decore(cfg, req).tokens
        assert decore(cfg, req).tokens == samples[seed], seed
    assert len({tuple(map(tuple, t)) for t in samples.values()}) == 3, samples
    greedy_req = request_for(lm, random_prompts(2, seed=3), max_new=8, seed=5)
    greedy = decore(DeCoRe(heads=[[1, 0]]), greedy_req).tokens
    assert greedy not in samples.values()


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_prefill_per_row_equals_the_batched_prefill(arch):
    """Rows prefilled one by one without their padding, caches stacked left-padded == one batched prefill:
    the next step's logits agree (mistral's sliding-window cache falls back to the batched prefill)."""
    from headlab.generation import prefill

    extra = {"model_type": "mistral", "sliding_window": 4} if arch == "mistral" else {}
    lm = word_model(2, seed=3, **extra)
    batch = tokenize(lm, [Example(prompt=p) for p in random_prompts(4, seed=9, lo=3, hi=9)])
    ids, mask = batch.input_ids, batch.attention_mask
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    assert int((mask == 0).sum()) > 0  # the rows really are padded
    nxt = torch.tensor([[5], [6], [7], [8]])
    step_mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
    outs = []
    with torch.no_grad():
        for per_row in (False, True):
            cache = prefill(lm.model, ids, mask, pos, per_row=per_row)
            outs.append(lm.model(input_ids=nxt, attention_mask=step_mask, position_ids=pos[:, -1:] + 1,
                                 cache=cache, use_cache=True).logits)
            if arch == "llama":
                assert cache.layers[0].keys.shape[:3] == (4, 2, ids.shape[1] + 1)  # prompt + the step
    torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=0)
    assert (outs[0][0] - outs[0][1]).abs().max() > 1e-3
