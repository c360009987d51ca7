"""The query probe (``Probes(q_positions=...)``, ``Recording.q``) and the query replacement edit (``ReplaceQ`` /
``Plan.patch_q``) on tiny random Llama (GQA), Qwen2 and GPT-2 models in a left-padded batch, against an eager
copy of the model run through an attention function of the test's own that records, or overwrites, the
queries it is given before transformers' SDPA attention."""

from __future__ import annotations

import pytest
import torch

from headlab import Plan, Probes, ReplaceQ, forward

from fixtures.circuits import ARCHS, models

NAME = "headlab_test_queries"


def _reference_model(eager, edit):
    """The eager model with an attention implementation calling ``edit(layer, query) -> query`` first."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    def attention(module, query, key, value, attention_mask, **kwargs):
        return sdpa_attention_forward(module, edit(module.layer_idx, query), key, value, attention_mask, **kwargs)

    AttentionInterface.register(NAME, attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    eager.set_attn_implementation(NAME)
    return eager


def _batch(vocab: int):
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(4, vocab, (2, 9), generator=g)
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, :3] = 0
    ids[1, :3] = 0
    return ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)


@pytest.mark.parametrize("arch", ARCHS)
def test_recorded_queries_are_the_ones_attention_reads(arch):
    tok, lm, eager = models(arch)
    ids, mask, pos = _batch(len(tok))
    seen: dict = {}
    model = _reference_model(eager["eager"], lambda layer, q: seen.setdefault(layer, q))
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, position_ids=pos)
    _, rec = forward(lm, ids, Plan(probes=Probes(q_positions="all")), attention_mask=mask)
    want = torch.stack([seen[ly] for ly in range(lm.geometry.n_layers)], 1)  # (B, L, H, T, D)
    real = mask.bool()[:, None, None, :, None]
    assert rec.q.shape == want.shape and rec.q_positions == list(range(9))
    torch.testing.assert_close(torch.where(real, rec.q, 0.0), torch.where(real, want, 0.0), atol=1e-5, rtol=0)
    assert rec.to_xarray("q").dims == ("example", "layer", "head", "position", "head_dim")
    _, some = forward(lm, ids, Plan(probes=Probes(q_positions=[2, 7], layers=[1])), attention_mask=mask)
    torch.testing.assert_close(some.q[:, 0], rec.q[:, 1, :, [2, 7]])


@pytest.mark.parametrize("arch", ARCHS)
def test_replaced_queries_equal_an_overwrite_before_attention(arch):
    tok, lm, eager = models(arch)
    ids, mask, pos = _batch(len(tok))
    D = lm.geometry.head_dim
    values = torch.randn(1, 1, 2, D, generator=torch.Generator().manual_seed(6))

    def overwrite(layer, q):
        if layer == 1:
            q = q.clone()
            q[0, 2, [4, 6]] = values[0, 0]
        return q

    model = _reference_model(eager["eager"], overwrite)
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    plan = Plan(probes=Probes(q_positions="all")).add(ReplaceQ([(1, 2)], values, rows=[0], positions=[4, 6]))
    got, rec = forward(lm, ids, plan, attention_mask=mask)
    real = mask.bool()
    torch.testing.assert_close(got.logits[real], want[real], atol=1e-5, rtol=0)
    torch.testing.assert_close(rec.q[0, 1, 2, [4, 6]], values[0, 0])  # the recording reads the replacement
    plain, _ = forward(lm, ids, None, attention_mask=mask)
    assert (plain.logits[0, 6:] - got.logits[0, 6:]).abs().max() > 1e-3
    torch.testing.assert_close(plain.logits[1], got.logits[1])  # row 1 untouched
    with pytest.raises(ValueError, match=r"ReplaceQ needs explicit \(layer, head\) pairs"):
        ReplaceQ([(1, None)], values)
    tiled = Plan().patch_q([(0, 1)], torch.arange(2.0)[:, None, None, None].expand(2, 1, 1, D), positions=[0])
    tiled = tiled.tile(2, 2)
    assert tiled.edits[0].rows == [0, 2, 1, 3] and tiled.edits[0].values[:, 0, 0, 0].tolist() == [0, 0, 1, 1]
