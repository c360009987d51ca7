"""DeCoRe against a reference-style loop written here: batch size 1, two separate forwards per token on
an eager-attention copy of the model, each with its own KV cache, the retrieval heads masked by forward
hooks that zero their slice of ``q_proj``'s output (query masking), and
``(1 + alpha) log p_base - alpha log p_masked`` with the entropy alpha computed here."""

from __future__ import annotations

import copy
import json
import math

import numpy as np
import pytest
import torch

from headlab.plugin_manager import get_manager
from headlab.plugins.decoding.decore import DeCoRe, decore, resolve_heads
from headlab.plugins.decoding.greedy import Greedy, greedy

from fixtures.decoding import (
    eager_twin,
    ids_of,
    masked_queries,
    one_thread,  # noqa: F401  (autouse)
    random_prompts,
    request_for,
    word_model,
)

HEADS = [(0, 1), (1, 3), (2, 0), (3, 2)]
UPPER = [(2, 0), (2, 3), (3, 2), (3, 1)]  # first masked layer 2: layers 0-1 run once for both copies


def scorer(kind: str):
    """The registered scorer of a decoder kind (the ``score`` action's route to it)."""
    return get_manager().get("decoders", kind).score


def entropy(logits: torch.Tensor) -> float:
    p = torch.softmax(logits.double(), -1)
    return float(-(p * torch.log(p + 1e-12)).sum())


def reference_decore(twin, ids, heads, max_new, *, alpha="entropy", cap=None, scale=False, prefix="reference",
                     eos=2):
    """Two forwards per token, batch size 1, two caches (the reference's structure)."""
    out_tokens, alphas = [], []
    with torch.no_grad():
        if prefix == "reference":  # prefix prefilled unmasked once; the masked branch starts from a copy
            pre = twin(input_ids=ids[:, :-1], use_cache=True)
            base_cache, masked_cache = pre.cache, copy.deepcopy(pre.cache)
            base = twin(input_ids=ids[:, -1:], cache=base_cache, use_cache=True)
            with masked_queries(twin, heads):
                masked = twin(input_ids=ids[:, -1:], cache=masked_cache, use_cache=True)
        else:
            base = twin(input_ids=ids, use_cache=True)
            with masked_queries(twin, heads):
                masked = twin(input_ids=ids, use_cache=True)
        for _ in range(max_new):
            lb, lm_ = base.logits[0, -1].double(), masked.logits[0, -1].double()
            if alpha == "entropy":
                a = entropy(lb)
                if scale:
                    a /= math.log(lb.shape[-1])
                if cap is not None:
                    a = min(a, cap)
            else:
                a = float(alpha)
            alphas.append(a)
            nxt = int(((1 + a) * lb.log_softmax(-1) - a * lm_.log_softmax(-1)).argmax())
            if nxt == eos:
                break
            out_tokens.append(nxt)
            step = torch.tensor([[nxt]])
            base = twin(input_ids=step, cache=base.cache, use_cache=True)
            with masked_queries(twin, heads):
                masked = twin(input_ids=step, cache=masked.cache, use_cache=True)
    return out_tokens, alphas


@pytest.fixture(scope="module")
def model():
    lm = word_model(4, False, seed=21)
    return lm, eager_twin(lm)


@pytest.mark.parametrize("heads", [HEADS, UPPER], ids=["from-layer-0", "from-layer-2"])
@pytest.mark.parametrize("opts", [
    {"alpha": "entropy"},
    {"alpha": "entropy", "alpha_cap": 1.5},
    {"alpha": "entropy", "scale_alpha": True},
    {"alpha": 0.5},
    {"alpha": "entropy", "prefix": "masked"},
    {"alpha": 1.0, "prefix": "masked"},
])
def test_decore_equals_two_forward_reference(model, opts, heads):
    lm, twin = model
    prompts = random_prompts(3, seed=31)
    cfg = DeCoRe(heads=[list(h) for h in heads], **opts)
    batched = decore(cfg, request_for(lm, prompts, max_new=10))
    ref_kw = {"alpha": opts["alpha"], "cap": opts.get("alpha_cap"), "scale": opts.get("scale_alpha", False),
              "prefix": opts.get("prefix", "reference")}
    differs = False
    for i, prompt in enumerate(prompts):
        ref, alphas = reference_decore(twin, ids_of(lm, prompt), heads, 10, **ref_kw)
        alone = decore(cfg, request_for(lm, [prompt], max_new=10))
        assert alone.tokens[0] == ref
        assert batched.tokens[i] == ref  # one batched forward of base + masked rows == batch of one
        np.testing.assert_allclose([a[0] for a in alone.info["alpha"]][: len(alphas)], alphas[: len(alone.info["alpha"])],
                                   rtol=1e-4, atol=1e-5)
        differs |= greedy(Greedy(), request_for(lm, [prompt], max_new=10)).tokens[0] != ref
    assert differs


def test_reference_prefix_differs_from_fully_masked_prompt(model):
    lm, twin = model
    ids = ids_of(lm, random_prompts(1, seed=40, lo=8, hi=8)[0])
    _, a_ref = reference_decore(twin, ids, HEADS, 3, alpha=1.0)
    with torch.no_grad():
        pre = twin(input_ids=ids[:, :-1], use_cache=True)
        with masked_queries(twin, HEADS):
            quirk = twin(input_ids=ids[:, -1:], cache=pre.cache, use_cache=True).logits[0, -1]
            full = twin(input_ids=ids).logits[0, -1]
    assert (quirk - full).abs().max() > 1e-3  # the two prefix behaviours are really different


def test_random_heads_and_head_sources(model, tmp_path):
    lm, _ = model
    req = request_for(lm, random_prompts(2, seed=3), max_new=6, seed=7)
    chosen = resolve_heads(DeCoRe(heads=[list(h) for h in HEADS], random=True), req)
    again = resolve_heads(DeCoRe(heads=[list(h) for h in HEADS], random=True), req)
    other = resolve_heads(DeCoRe(heads=[list(h) for h in HEADS], random=True, random_seed=1), req)
    assert chosen == again and chosen != other
    assert len(chosen) == len(HEADS) and not set(chosen) & set(HEADS)
    # the reference's retrieval-head JSON ranks heads by mean score
    path = tmp_path / "heads.json"
    scores = {f"{layer}-{head}": [0.0] for layer in range(4) for head in range(4)}
    for rank, (layer, head) in enumerate(HEADS):
        scores[f"{layer}-{head}"] = [1.0 - 0.1 * rank, 0.9 - 0.1 * rank]
    path.write_text(json.dumps(scores))
    from_file = decore(DeCoRe(heads={"file": str(path), "top": 4}), req)
    explicit = decore(DeCoRe(heads=[list(h) for h in HEADS]), req)
    assert from_file.tokens == explicit.tokens and sorted(from_file.info["heads"]) == sorted(HEADS)
    rnd = decore(DeCoRe(heads=[list(h) for h in HEADS], random=True), req)
    assert sorted(rnd.info["heads"]) == chosen


def test_no_heads_is_greedy(model):
    lm, _ = model
    req = request_for(lm, random_prompts(3, seed=8), max_new=8)
    assert decore(DeCoRe(heads=[], alpha=0.5), req).tokens == greedy(Greedy(), req).tokens


def test_steering_applies_to_both_copies(model):
    """A steering plan on the request: DeCoRe's base rows equal the steered model, so with alpha 0 the
    output is steered greedy, and the masked copy is steered too (against a steered reference)."""
    from headlab.instrument import Plan

    lm, twin = model
    prompts = random_prompts(2, seed=17)
    plan = Plan().scale_heads([(1, None)], 0.0)
    steered_greedy = greedy(Greedy(), request_for(lm, prompts, max_new=8, plan=plan))
    assert steered_greedy.tokens != greedy(Greedy(), request_for(lm, prompts, max_new=8)).tokens
    zero = decore(DeCoRe(heads=[list(h) for h in HEADS], alpha=0.0), request_for(lm, prompts, max_new=8, plan=plan))
    assert zero.tokens == steered_greedy.tokens
    # layer 1 fully ablated in both branches: hook o_proj input of layer 1 to zero in the reference
    handle = twin.model.layers[1].self_attn.o_proj.register_forward_pre_hook(lambda m, a: (torch.zeros_like(a[0]),))
    try:
        for i, prompt in enumerate(prompts):
            ref, _ = reference_decore(twin, ids_of(lm, prompt), HEADS, 8, alpha=1.0)
            ours = decore(DeCoRe(heads=[list(h) for h in HEADS], alpha=1.0),
                          request_for(lm, prompts, max_new=8, plan=plan))
            assert ours.tokens[i] == ref
    finally:
        handle.remove()


class BatchSizes:
    """Records the batch sizes each decoder layer computes on (the input of its first norm)."""

    def __init__(self, lm):
        self.layers = [layer.input_layernorm for layer in lm.model.model.layers]
        self.seen: dict[int, set[int]] = {i: set() for i in range(len(self.layers))}

    def __enter__(self):
        self.handles = [m.register_forward_pre_hook(lambda _m, a, i=i: self.seen[i].add(a[0].shape[0]))
                        for i, m in enumerate(self.layers)]
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()


@pytest.mark.parametrize("prefix", ["reference", "masked"])
def test_shared_trunk_runs_the_layers_below_the_first_masked_head_once(model, prefix):
    lm, _ = model
    prompts = random_prompts(3, seed=5)
    on, off = (DeCoRe(heads=[list(h) for h in UPPER], alpha="entropy", prefix=prefix, share_trunk=s)
               for s in (True, False))
    with BatchSizes(lm) as shared:
        a = decore(on, request_for(lm, prompts, max_new=8))
    with BatchSizes(lm) as full:
        b = decore(off, request_for(lm, prompts, max_new=8))
    # the reference prefix (all but the last prompt token) is unmasked in both copies: prefilled once
    upper = {3, 6} if prefix == "reference" else {6}
    assert shared.seen == {0: {3}, 1: {3}, 2: upper, 3: upper}
    assert full.seen == {0: {6}, 1: {6}, 2: {6}, 3: {6}}
    assert a.tokens == b.tokens
    np.testing.assert_allclose(a.info["alpha"], b.info["alpha"], rtol=1e-5, atol=1e-6)


def test_shared_trunk_with_steering_below_the_masked_layers(model):
    """A mirrored steering plan on layer 1 runs once in the shared trunk and still steers both copies."""
    from headlab.instrument import Plan

    lm, twin = model
    prompts = random_prompts(2, seed=19)
    plan = Plan().scale_heads([(1, None)], 0.0)
    handle = twin.model.layers[1].self_attn.o_proj.register_forward_pre_hook(lambda m, a: (torch.zeros_like(a[0]),))
    try:
        ours = decore(DeCoRe(heads=[list(h) for h in UPPER], alpha=1.0), request_for(lm, prompts, max_new=8, plan=plan))
        for i, prompt in enumerate(prompts):
            ref, _ = reference_decore(twin, ids_of(lm, prompt), UPPER, 8, alpha=1.0)
            assert ours.tokens[i] == ref
    finally:
        handle.remove()


def test_score_with_shared_trunk_equals_full_rows(model):
    from headlab.context import Example
    from headlab.generation import ScoreRequest, continuation_batch

    lm, _ = model
    words = random_prompts(3, seed=12)
    pairs = [(Example(prompt=p), " " + random_prompts(1, seed=50 + i, lo=2, hi=4)[0]) for i, p in enumerate(words)]
    batch, n_tokens = continuation_batch(lm, pairs)
    req = ScoreRequest(lm, batch, n_tokens, [p for p, _ in pairs], [c for _, c in pairs])
    on = scorer("decore")(DeCoRe(heads=[list(h) for h in UPPER], alpha="entropy"), req)
    off = scorer("decore")(DeCoRe(heads=[list(h) for h in UPPER], alpha="entropy", share_trunk=False), req)
    np.testing.assert_allclose(on.logprobs, off.logprobs, rtol=1e-5, atol=1e-5)
