"""Contrastive decoding and CAD against reference loops written here: batch size 1, full recomputation
per step on eager-attention copies (expert and amateur; with and without the context), and the
formulas of docs/methods.md#contrastive-decoding and docs/methods.md#context-aware-decoding computed here."""

from __future__ import annotations

import math

import pytest
import torch

from headlab.context import Example
from headlab.generation import DecodeRequest, tokenize
from headlab.plugins.decoding.contrastive import (
    CAD,
    Contrastive,
    amateur_model,
    cad,
    contrastive,
    without_context,
)
from headlab.plugins.decoding.greedy import Greedy, greedy
from headlab.spec import ModelSpec

from fixtures.decoding import (
    AMATEUR,
    eager_twin,
    ids_of,
    one_thread,  # noqa: F401  (autouse)
    request_for,
    word_model,
)


def reference_contrastive(expert, amateur, ids, max_new, alpha=0.1, temperature=1.0, eos=2):
    seq, out = ids, []
    with torch.no_grad():
        for _ in range(max_new):
            le = expert(input_ids=seq).logits[0, -1].double().log_softmax(-1)
            la = (amateur(input_ids=seq).logits[0, -1].double() / temperature).log_softmax(-1)
            keep = le.exp() >= alpha * le.exp().max()
            nxt = int(torch.where(keep, le - la, -math.inf).argmax())
            if nxt == eos:
                break
            out.append(nxt)
            seq = torch.cat([seq, torch.tensor([[nxt]])], dim=1)
    return out


def reference_cad(model, ids_ctx, ids_plain, max_new, alpha=0.5, eos=2):
    out = []
    with torch.no_grad():
        for _ in range(max_new):
            lc = model(input_ids=ids_ctx).logits[0, -1].double()
            lp = model(input_ids=ids_plain).logits[0, -1].double()
            nxt = int(((1 + alpha) * lc - alpha * lp).argmax())
            if nxt == eos:
                break
            out.append(nxt)
            step = torch.tensor([[nxt]])
            ids_ctx, ids_plain = torch.cat([ids_ctx, step], 1), torch.cat([ids_plain, step], 1)
    return out


def context_examples() -> list[Example]:
    """Prompts ``<context> question : what is the capital of <x> ? answer :`` with the context marked."""
    rows = [("the capital of france is rome .", "france"), ("a b c . the capital of spain is vienna . d e", "spain"),
            ("the capital of italy is madrid , k l m n o p .", "italy")]
    out = []
    for ctx, country in rows:
        prompt = f"{ctx} question : what is the capital of {country} ? answer :"
        out.append(Example(prompt=prompt, spans={"context": [(0, len(ctx))]}))
    return out


@pytest.fixture(scope="module")
def lm():
    return word_model(4, False, seed=5)


def test_contrastive_equals_reference(lm):
    twin = eager_twin(lm)
    prompts = ["a b c d", "the capital of france is", "q r s t u v w"]
    for opts in ({}, {"alpha": 0.3, "amateur_temperature": 0.5}):
        cfg = Contrastive(amateur=AMATEUR, **opts)
        amateur = amateur_model(cfg.amateur, 0, "cpu")
        assert amateur_model(ModelSpec(**AMATEUR), 0, "cpu") is amateur  # loaded once, cached
        am_twin = eager_twin(amateur)
        batched = contrastive(cfg, request_for(lm, prompts, max_new=6))
        differs = False
        for i, p in enumerate(prompts):
            ref = reference_contrastive(twin, am_twin, ids_of(lm, p), 6, opts.get("alpha", 0.1),
                                        opts.get("amateur_temperature", 1.0))
            assert contrastive(cfg, request_for(lm, [p], max_new=6)).tokens[0] == ref
            assert batched.tokens[i] == ref
            differs |= greedy(Greedy(), request_for(lm, [p], max_new=6)).tokens[0] != ref
        assert differs


def test_cad_equals_reference(lm):
    twin = eager_twin(lm)
    examples = context_examples()
    for alpha in (0.5, 1.0):
        cfg = CAD(alpha=alpha)
        batched = cad(cfg, DecodeRequest(lm, tokenize(lm, examples), 8))
        differs = False
        for i, ex in enumerate(examples):
            plain = without_context(ex)
            assert "capital of" in plain and plain.startswith("question")
            ref = reference_cad(twin, ids_of(lm, ex.prompt), ids_of(lm, plain), 8, alpha)
            assert cad(cfg, DecodeRequest(lm, tokenize(lm, [ex]), 8)).tokens[0] == ref
            assert batched.tokens[i] == ref
            differs |= greedy(Greedy(), DecodeRequest(lm, tokenize(lm, [ex]), 8)).tokens[0] != ref
        assert differs


def test_cad_steering_applies_to_context_rows_only(lm):
    from headlab.instrument import Plan

    examples = context_examples()
    plan = Plan().scale_heads([(2, None)], 0.0)
    steered = greedy(Greedy(), DecodeRequest(lm, tokenize(lm, examples), 8, plan=plan))
    zero = cad(CAD(alpha=0.0), DecodeRequest(lm, tokenize(lm, examples), 8, plan=plan))
    assert zero.tokens == steered.tokens
    assert steered.tokens != greedy(Greedy(), DecodeRequest(lm, tokenize(lm, examples), 8)).tokens


def test_without_context_sources():
    from headlab.context import TaskContext
    from headlab.plugins.tasks.synthetic_tasks import Counterfact, build_counterfact

    for ex in build_counterfact(Counterfact(n=6), TaskContext(tokenizer=None, seed=0, vocab_size=0)):
        s, e = ex.spans["context"][0]
        plain = without_context(ex)
        assert ex.prompt[s:e] not in plain and plain.endswith("Answer:")
        assert ex.meta["context_answer"] not in plain
    ex = Example(prompt="Context: the sky is green.\nQuestion: what colour is the sky?\nAnswer:",
                 meta={"context": "the sky is green."})
    assert without_context(ex) == "Context: \nQuestion: what colour is the sky?\nAnswer:"
    with pytest.raises(ValueError, match="context"):
        without_context(Example(prompt="no context here"))
    with pytest.raises(ValueError, match="context"):
        without_context(ex, "span")
