"""head_mask and head_scale (plugins/steering/heads.py) against forward hooks on an eager model.

Independent references: zeroing / scaling a head's slice of the ``q_proj`` output (query masking and
scaling; with RoPE, scaling before the rotation equals scaling after), of the ``v_proj`` output (value
scaling of one key/value head, which every query head of its GQA group reads), and of the ``o_proj`` input
(output ablation and scaling; mean ablation writes the step's means there, prompt and decode step alike).
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from headlab import instrument as ins
from headlab.plugins.steering import heads as HS

from fixtures.steering import hooked, step_ctx, tiny

G = 2  # query heads per kv head (4 / 2)


def batch(B=3, n=14, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, 800, (B, n), generator=g)
    am = torch.ones(B, n, dtype=torch.long)
    am[1, :3] = 0
    am[2, :6] = 0
    ids[am == 0] = 0
    ids[:, 0] = torch.where(am[:, 0].bool(), 1, 0)
    return ids, am


def logits(model, ids, am, plan=None):
    with torch.no_grad(), (ins.instrument(model, plan) if plan is not None else contextlib.nullcontext()):
        return model(input_ids=ids, attention_mask=am, position_ids=(am.cumsum(-1) - 1).clamp(min=0)).logits


HEADS = [(0, 1), (1, 0), (1, 3)]


@pytest.mark.parametrize("config,where,factor", [
    (HS.HeadMask(heads=[list(h) for h in HEADS], mode="query"), "q", 0.0),
    (HS.HeadMask(heads=[list(h) for h in HEADS], mode="score"), "q", 0.0),
    (HS.HeadMask(heads=[list(h) for h in HEADS], mode="output"), "o", 0.0),
    (HS.HeadScale(heads=[list(h) for h in HEADS], factor=2.5, target="output"), "o", 2.5),
    (HS.HeadScale(heads=[list(h) for h in HEADS], factor=0.3, target="queries"), "q", 0.3),
], ids=["mask-query", "mask-score", "mask-output", "scale-output", "scale-queries"])
def test_mask_and_scale_equal_hooks(config, where, factor):
    ids, am = batch()
    mh, me = tiny("headlab"), tiny("eager")
    plan = ins.Plan()
    impl = HS.steer_mask if isinstance(config, HS.HeadMask) else HS.steer_scale
    impl(config, step_ctx(mh), None, plan)
    got = logits(mh, ids, am, plan)
    with hooked(me, HEADS, where, factor):
        want = logits(me, ids, am)
    real = am.bool()
    torch.testing.assert_close(got[real], want[real], atol=3e-5, rtol=0)
    assert not torch.allclose(got[real], logits(me, ids, am)[real], atol=1e-3)


def test_value_scaling_is_the_kv_group():
    """target: values on query head h == scaling the kv head h // G in v_proj (every head of the group)."""
    ids, am = batch(seed=2)
    mh, me = tiny("headlab"), tiny("eager")
    plan = ins.Plan()
    HS.steer_scale(HS.HeadScale(heads=[[0, 1], [1, 2]], factor=3.0, target="values"), step_ctx(mh), None, plan)
    got = logits(mh, ids, am, plan)
    kv_heads = [(0, 1 // G), (1, 2 // G)]  # v_proj slices are per kv head
    with hooked(me, kv_heads, "v", 3.0):
        want = logits(me, ids, am)
    real = am.bool()
    torch.testing.assert_close(got[real], want[real], atol=3e-5, rtol=0)
    # and it differs from scaling only the named query heads' outputs
    only = ins.Plan()
    HS.steer_scale(HS.HeadScale(heads=[[0, 1], [1, 2]], factor=3.0), step_ctx(mh), None, only)
    assert not torch.allclose(logits(mh, ids, am, only)[real], want[real], atol=1e-3)
    assert HS.kv_group([(0, 1), (1, 2)], 4, 2) == [(0, 0), (0, 1), (1, 2), (1, 3)]
    assert HS.kv_group([(0, 1)], 4, 4) == [(0, 1)]


def test_mask_from_a_detect_step_with_random_control():
    """heads: {from: step, top: k} and its random control resolve through ctx.heads; the control is the
    draw of the step's seed (k heads of the ranked pool, without replacement), not the top k."""
    import dataclasses

    import numpy as np
    import xarray as xr

    from headlab.spec import HeadsFrom

    score = xr.DataArray(np.arange(8.0).reshape(2, 4), dims=("layer", "head"))
    mh = tiny("headlab")
    ctx = step_ctx(mh, results={"det": xr.Dataset({"score": score})})
    plan = ins.Plan()
    HS.steer_mask(HS.HeadMask(heads=HeadsFrom.model_validate({"from": "det", "top": 2})), ctx, None, plan)
    assert plan.edits[0].heads == [(1, 3), (1, 2)]
    pool = [(1, 3), (1, 2), (1, 1), (1, 0), (0, 3), (0, 2), (0, 1), (0, 0)]  # by score, highest first
    random_mask = HS.HeadMask(heads=HeadsFrom.model_validate({"from": "det", "top": 2, "random": True}))
    draws = []
    for seed in range(4):
        rnd = ins.Plan()
        HS.steer_mask(random_mask, dataclasses.replace(ctx, seed=seed), None, rnd)
        idx = np.random.default_rng(seed).choice(len(pool), size=2, replace=False)
        assert rnd.edits[0].heads == sorted(pool[i] for i in idx), seed
        draws.append(tuple(rnd.edits[0].heads))
    assert draws[0] == ((0, 0), (0, 2))  # step_ctx's seed 0: two heads the top-2 selection does not hold
    assert len(set(draws)) == 4


def test_random_control_matched_per_layer_and_reseeded():
    """heads: {from, top, random: true, match_layers, seed}: the draw keeps the selection's count per layer,
    and a seed offset gives another draw, reproducibly; without them the draw is the cell rng's first."""
    import numpy as np
    import xarray as xr

    from headlab.heads import select_heads
    from headlab.spec import HeadsFrom

    score = xr.DataArray(np.arange(32.0).reshape(4, 8), dims=("layer", "head"))
    score[0, 0] = 100.0  # top 3 heads: (0, 0), (3, 7), (3, 6)
    results = {"det": xr.Dataset({"score": score})}
    all_heads = [(ly, h) for ly in range(4) for h in range(8)]

    def pick(**kw):
        sel = HeadsFrom.model_validate({"from": "det", "top": 3, **kw})
        return select_heads(sel, results, rng=np.random.default_rng(7))

    assert sorted(pick()) == [(0, 0), (3, 6), (3, 7)]
    plain = pick(random=True)
    idx = np.random.default_rng(7).choice(32, size=3, replace=False)
    ranked = sorted(all_heads, key=lambda x: -float(score[x]))  # the pool in the order of the score
    assert plain == sorted(ranked[i] for i in idx)
    draws = [pick(random=True, match_layers=True, seed=k) for k in range(6)]
    for d in draws:
        assert sorted(ly for ly, _ in d) == [0, 3, 3] and len(set(d)) == 3
    assert len({tuple(d) for d in draws}) > 1
    assert pick(random=True, match_layers=True, seed=2) == draws[2]
    assert len({tuple(pick(random=True, seed=k)) for k in range(4)}) > 1
    with pytest.raises(ValueError, match="random: true"):
        HeadsFrom.model_validate({"from": "det", "top": 3, "match_layers": True})


def test_mean_mask_writes_the_means_at_every_position_and_decode_step():
    """mode mean: the masked heads' slices of the o_proj input are the step's z_mean on every (left-padded)
    prompt position and on a decode step under the KV cache, as an eager o_proj pre-hook writing them."""
    import xarray as xr

    ids, am = batch(seed=3)
    mh, me = tiny("headlab"), tiny("eager")
    Dh = mh.config.hidden_size // mh.config.num_attention_heads
    means = torch.randn(2, 4, Dh, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    held = xr.Dataset({"z_mean": (("layer", "head", "head_dim"), means.numpy())})
    plan = ins.Plan()
    config = HS.HeadMask(heads=[list(h) for h in HEADS], mode="mean", means_from="curve")
    HS.steer_mask(config, step_ctx(mh, results={"curve": held}), None, plan)

    def write(mod, args, layer):
        z = args[0].clone()
        for ly, h in HEADS:
            if ly == layer:
                z[..., h * Dh:(h + 1) * Dh] = means[ly, h].to(z.dtype)
        return (z, *args[1:])

    def run(model, plan=None):
        pos = (am.cumsum(-1) - 1).clamp(min=0)
        with torch.no_grad(), (ins.instrument(model, plan) if plan is not None else contextlib.nullcontext()):
            out = model(input_ids=ids, attention_mask=am, position_ids=pos, use_cache=True)
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            am2 = torch.cat([am, torch.ones_like(nxt)], 1)
            step = model(input_ids=nxt, attention_mask=am2, position_ids=pos[:, -1:] + 1,
                         cache=out.cache, use_cache=True)
        return out.logits, step.logits[:, -1]

    got, got_step = run(mh, plan)
    handles = [me.model.layers[ly].self_attn.o_proj.register_forward_pre_hook(
        lambda mod, args, ly=ly: write(mod, args, ly)) for ly in {ly for ly, _ in HEADS}]
    try:
        want, want_step = run(me)
    finally:
        for h in handles:
            h.remove()
    real = am.bool()
    torch.testing.assert_close(got[real], want[real], atol=3e-5, rtol=0)
    torch.testing.assert_close(got_step, want_step, atol=3e-5, rtol=0)
    zero = ins.Plan()
    HS.steer_mask(HS.HeadMask(heads=[list(h) for h in HEADS], mode="output"), step_ctx(mh), None, zero)
    assert not torch.allclose(run(mh, zero)[1], want_step, atol=1e-3)
