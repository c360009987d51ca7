"""``headlab.forward``: one forward under a plan, equal to the model called by hand."""

from __future__ import annotations

import pytest
import torch

import headlab
from headlab.model import load_model
from headlab.spec import ModelSpec

from fixtures.specs import TINY_LLAMA


@pytest.fixture(scope="module")
def lm():
    return load_model(ModelSpec(config=dict(TINY_LLAMA)))


@pytest.fixture(scope="module")
def batch(lm):
    return headlab.tokenize(lm, [headlab.Example(prompt="", input_ids=[5, 9, 14, 3, 22, 7]),
                                 headlab.Example(prompt="", input_ids=[5, 9])])


def by_hand(lm, ids, mask):
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        return lm.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).logits


def test_a_left_padded_batch_equals_the_model_called_by_hand(lm, batch):
    assert batch.pad[1] > 0  # the second row is left-padded
    out, rec = headlab.forward(lm, batch)
    torch.testing.assert_close(out.logits, by_hand(lm, batch.input_ids, batch.attention_mask), rtol=0, atol=0)
    assert rec.as_dict() == {} and out.past_key_values is None
    ids_out, _ = headlab.forward(lm, batch.input_ids, attention_mask=batch.attention_mask)
    torch.testing.assert_close(ids_out.logits, out.logits, rtol=0, atol=0)
    # the padded row equals the same prompt alone, at its own positions
    alone, _ = headlab.forward(lm, headlab.tokenize(lm, [batch.examples[1]]))
    torch.testing.assert_close(out.logits[1, -1], alone.logits[0, -1], rtol=1e-5, atol=1e-5)


def test_copies_plan_probes_and_logits_to_keep(lm, batch):
    plan = headlab.Plan(probes=headlab.Probes(argmax=True)).mask_heads([(1, 0)], rows=[2, 3], mode="output")
    out, rec = headlab.forward(lm, batch, plan, copies=2, logits_to_keep=1)
    assert out.logits.shape[:2] == (4, 1)
    base, _ = headlab.forward(lm, batch)
    torch.testing.assert_close(out.logits[:2, -1], base.logits[:, -1], rtol=1e-5, atol=1e-5)  # copy 0 unedited
    masked, _ = headlab.forward(lm, batch, headlab.Plan().mask_heads([(1, 0)], mode="output"))
    torch.testing.assert_close(out.logits[2:, -1], masked.logits[:, -1], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(masked.logits[:, -1], base.logits[:, -1])
    assert rec.argmax.shape[:3] == (4, TINY_LLAMA["num_hidden_layers"], TINY_LLAMA["num_attention_heads"])


def test_no_gradient_unless_asked(lm, batch):
    out, _ = headlab.forward(lm, batch)
    assert not out.logits.requires_grad
    out, _ = headlab.forward(lm, batch, headlab.Plan().scale_heads([(0, 1)], 2.0), grad=True)
    out.logits[:, -1].sum().backward()
    grads = [p.grad for p in lm.model.parameters() if p.grad is not None]
    assert grads and any(g.abs().sum() > 0 for g in grads)
    lm.model.zero_grad(set_to_none=True)
