"""VHR (plugins/steering/vhr.py) against a naive implementation written here.

The naive VHR (tests/fixtures/vision.py) runs on an eager model with forward hooks only: a pre-hook on each
attention module, at the first forward, recomputes that layer's queries, keys and values from the hidden
states it receives (q/k/v projections, RoPE), computes the last position's head outputs with and without the
segment in float64, applies the outlier filter of docs/methods.md#vhr (mean + sample std per layer, both VHD and TA) and
the above-median selection with numpy, and stores the per-row scales; a pre-hook on ``o_proj`` multiplies
the selected heads' slices by alpha on every call (prefill and decode). Checked on text spans (tiny Llama,
emphasis spans) and on a tiny LLaVA (CLIP vision tower + Llama) with image tokens.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import transformers

from headlab import instrument as ins
from headlab.generation import tokenize
from headlab.plugins.steering import vhr as V

from fixtures.steering import emphasis_examples, loaded, step_ctx, tiny
from fixtures.vision import naive_select, naive_vhr


def generate(model, ids, am, n_new, **kw):
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=am, max_new_tokens=n_new, min_new_tokens=n_new,
                             do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True,
                             **kw)
    return out.sequences[:, ids.shape[1]:], torch.stack(out.logits, 1)


# --------------------------------------------------------------------------- text spans
@pytest.mark.parametrize("layers,outlier_filter", [("all", True), ([1], True), ("all", False)])
def test_vhr_on_text_spans_matches_naive(layers, outlier_filter):
    mh, me = tiny("headlab", layers=3, heads=8, kv=4), tiny("eager", layers=3, heads=8, kv=4)
    exs = emphasis_examples(4, seed=2)
    batch = tokenize(loaded(mh), exs)
    plan = ins.Plan()
    cfg = V.Vhr(segment="emphasis", layers=layers, outlier_filter=outlier_filter)
    report = V.steer(cfg, step_ctx(mh, exs), batch, plan)
    segs = batch.spans("emphasis")
    want_layers = range(3) if layers == "all" else layers
    plan2 = ins.Plan()
    st = V.add_vhr(plan2, segs, None if layers == "all" else layers, 2.0, outlier_filter)
    with ins.instrument(mh, plan2):
        ours, ours_logits = generate(mh, batch.input_ids, batch.attention_mask, 5)
    with naive_vhr(me, segs, want_layers, 2.0, outlier_filter) as rec:
        ref, ref_logits = generate(me, batch.input_ids, batch.attention_mask, 5)
    assert sorted(st.selected) == sorted(rec) == list(want_layers)
    for layer in want_layers:
        assert np.array_equal(st.selected[layer].cpu().numpy(), rec[layer]), layer
    assert torch.equal(ours, ref)
    torch.testing.assert_close(ours_logits, ref_logits, atol=2e-4, rtol=0)
    # the plugin's plan (through steer) generates the same
    with ins.instrument(mh, plan):
        via_steer, _ = generate(mh, batch.input_ids, batch.attention_mask, 5)
    assert torch.equal(via_steer, ours)
    # its report (what a generate step stores) is the naive choice, over named dimensions
    arrays = report()
    assert arrays["vhr_selected"].dims == ("example", "layer", "head")
    for layer in range(3):
        got = arrays["vhr_selected"].sel(layer=layer).values
        assert np.array_equal(got, rec[layer]) if layer in want_layers else not got.any()
        assert np.isnan(arrays["vhr_vhd"].sel(layer=layer).values).all() == (layer not in want_layers)
    # and reinforcement changes the computation
    _, plain_logits = generate(me, batch.input_ids, batch.attention_mask, 5)
    assert not torch.allclose(plain_logits, ref_logits, atol=1e-3)


def test_heads_stay_fixed_after_the_first_step():
    """Decode steps reuse the first step's scales: VHR == the same scales given statically."""
    mh = tiny("headlab", layers=3, heads=8, kv=4)
    exs = emphasis_examples(3, seed=4)
    batch = tokenize(loaded(mh), exs)
    plan = ins.Plan()
    st = V.add_vhr(plan, batch.spans("emphasis"), None, 3.0)
    with ins.instrument(mh, plan):
        ours, lg = generate(mh, batch.input_ids, batch.attention_mask, 4)
    dense = torch.ones(batch.size, 3, 8)
    for layer, sel in st.selected.items():
        dense[:, layer] = torch.where(sel, 3.0, 1.0)
    assert 0 < int(dense.ne(1).sum()) < dense.numel()
    fixed = ins.Plan()
    for row, layer, head in dense.ne(1).nonzero().tolist():
        fixed.scale_heads([(layer, head)], float(dense[row, layer, head]), rows=[row])
    with ins.instrument(mh, fixed):
        static, lg2 = generate(mh, batch.input_ids, batch.attention_mask, 4)
    assert torch.equal(ours, static)
    torch.testing.assert_close(lg, lg2, atol=1e-4, rtol=0)


def test_rows_without_segment_are_not_steered():
    mh = tiny("headlab", layers=3, heads=8, kv=4)
    exs = emphasis_examples(2, seed=1)
    batch = tokenize(loaded(mh), exs)
    segs = batch.spans("emphasis")
    plan = ins.Plan()
    st = V.add_vhr(plan, [segs[0], []], None)
    with ins.instrument(mh, plan), torch.no_grad():
        out = mh(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    with torch.no_grad():
        plain = mh(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    real = batch.attention_mask[1].bool()
    torch.testing.assert_close(out[1][real], plain[1][real], atol=2e-5, rtol=0)
    assert all(not bool(s[1].any()) for s in st.selected.values())
    assert all(bool(s[0].any()) for s in st.selected.values())


# --------------------------------------------------------------------------- tiny LLaVA with image tokens
IMG = 811  # image token id (outside the text vocabulary of the tiny LLaVA below)


def tiny_llava(impl: str):
    vc = transformers.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                       num_attention_heads=2, image_size=16, patch_size=4, projection_dim=32)
    tc = transformers.LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=8,
                                  num_key_value_heads=4, vocab_size=IMG + 2, max_position_embeddings=128,
                                  initializer_range=0.25)
    cfg = transformers.LlavaConfig(vision_config=vc, text_config=tc, image_token_index=IMG,
                                   vision_feature_layer=-1, vision_feature_select_strategy="default")
    torch.manual_seed(0)
    cls = transformers.LlavaForConditionalGeneration
    base = cls._from_config(copy.deepcopy(cfg), attn_implementation="eager").eval()
    m = cls._from_config(copy.deepcopy(cfg), attn_implementation=impl).eval()
    m.load_state_dict(base.state_dict())
    m.generation_config.eos_token_id = None
    return m


def test_vhr_on_tiny_llava_image_tokens():
    mh, me = tiny_llava("headlab"), tiny_llava("eager")
    n_img = (16 // 4) ** 2
    g = torch.Generator().manual_seed(0)
    B, n = 2, 10 + n_img
    ids = torch.randint(4, 800, (B, n), generator=g)
    am = torch.ones(B, n, dtype=torch.long)
    ids[:, 0] = 1
    ids[0, 2:2 + n_img] = IMG
    am[1, :3], ids[1, :3] = 0, 0  # left padding, then BOS and the image block
    ids[1, 3] = 1
    ids[1, 5:5 + n_img] = IMG
    pix = torch.randn(B, 3, 16, 16, generator=g)
    segs = [V.token_runs(ids[r].tolist(), IMG) for r in range(B)]
    assert segs == [[(2, 2 + n_img)], [(5, 5 + n_img)]]
    layers = V.reference_layers(3)
    plan = ins.Plan()
    st = V.add_vhr(plan, segs, layers)
    with ins.instrument(mh, plan):
        ours, ours_logits = generate(mh, ids, am, 4, pixel_values=pix)
    with naive_vhr(me, segs, layers) as rec:
        ref, ref_logits = generate(me, ids, am, 4, pixel_values=pix)
    for layer in layers:
        assert np.array_equal(st.selected[layer].numpy(), rec[layer])
    assert torch.equal(ours, ref)
    torch.testing.assert_close(ours_logits, ref_logits, atol=2e-4, rtol=0)
    _, plain_logits = generate(me, ids, am, 4, pixel_values=pix)
    assert not torch.allclose(plain_logits, ref_logits, atol=1e-3)


# --------------------------------------------------------------------------- pieces
def test_selection_rule_matches_loops():
    rng = np.random.default_rng(0)
    for trial in range(50):
        H = int(rng.integers(4, 17))
        vhd = rng.gamma(2.0, 1.0, size=(3, H))
        ta = rng.gamma(2.0, 1.0, size=(3, H))
        if trial % 3 == 0:  # plant outliers in both statistics
            vhd[:, 0] += 20
            ta[:, 0] += 20
        got = V.vhr_select(torch.tensor(vhd), torch.tensor(ta)).numpy()
        for b in range(3):
            assert np.array_equal(got[b], naive_select(vhd[b], ta[b])), (trial, b)
    # an outlier in VHD alone is kept (the filter needs both)
    vhd = torch.tensor([[1.0, 2.0, 3.0, 100.0]])
    assert V.vhr_select(vhd, torch.tensor([[1.0, 1.0, 1.0, 1.0]])).tolist() == [[False, False, True, True]]
    assert V.vhr_select(vhd, torch.tensor([[1.0, 1.0, 1.0, 100.0]])).tolist() == [[False, True, True, False]]


def test_reference_layers_and_token_runs():
    assert V.reference_layers(32) == [1, *range(18, 32)]
    assert V.reference_layers(3) == [0, 1, 2]
    assert V.token_runs([5, 7, 7, 1, 7], 7) == [(1, 3), (4, 5)]
    assert V.token_runs([1, 2], 7) == []


def test_vhr_steer_errors():
    mh = tiny("headlab", layers=3, heads=8, kv=4)
    exs = emphasis_examples(2)
    batch = tokenize(loaded(mh), exs)
    with pytest.raises(ValueError, match="no row of the batch has a 'image' segment"):
        V.steer(V.Vhr(), step_ctx(mh, exs), batch, ins.Plan())
    with pytest.raises(ValueError, match="outside this model"):
        V.steer(V.Vhr(segment="emphasis", layers=[5]), step_ctx(mh, exs), batch, ins.Plan())


def test_generate_step_stores_the_heads_vhr_chose(tmp_path):
    """A spec's generate step with VHR (embedded model, emphasis spans as the segment): ``vhr_selected`` over
    (example, layer, head) for every example of every batch, equal to VHR run on each batch directly."""
    import headlab
    from headlab.model import load_model
    from headlab.plugins.tasks.synthetic_tasks import Emphasis
    from headlab.runner import build_examples
    from headlab.spec import ModelSpec

    spec = {"name": "vhr", "model": "headlab-tiny", "task": {"kind": "emphasis", "n": 5}, "seed": 0,
            "steps": [{"id": "gen", "generate": {"max_new_tokens": 2, "batch_size": 3,
                                                 "steer": [{"kind": "vhr", "segment": "emphasis"}]}}]}
    ds = headlab.run(spec, out=tmp_path).results["gen"]
    sel = ds["vhr_selected"]
    assert sel.dims == ("example", "layer", "head") and sel.shape == (5, 4, 8)
    lm = load_model(ModelSpec(id="headlab-tiny", device="cpu"))
    exs = build_examples(Emphasis(n=5), lm, 0)
    for start in (0, 3):
        batch = tokenize(lm, exs[start:start + 3])
        plan = ins.Plan()
        state = V.add_vhr(plan, batch.spans("emphasis"), None)
        with ins.instrument(lm.model, plan), torch.no_grad():
            lm.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask)
        for layer in range(4):
            assert np.array_equal(sel.values[start:start + 3, layer], state.selected[layer].numpy())
    assert 0 < int(sel.sum()) < sel.size
