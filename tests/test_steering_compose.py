"""Several steering methods in one generate step: they compose on different heads (or different edit
kinds), and two methods editing the same head the same way are rejected with a clear message."""

from __future__ import annotations

import json

import pytest

import headlab
from headlab import instrument as ins
from headlab.generation import tokenize
from headlab.instrument import SteeringConflictError
from headlab.plugins.steering import heads as HS
from headlab.plugins.steering import pasta as P
from headlab.plugins.steering import vhr as V
from headlab.plugins.steering.common import claims

from fixtures.steering import (
    bias_matrix,
    build_tokenizer,
    eager_pasta,
    emphasis_examples,
    headlab_generate,
    hf_generate,
    hooked,
    loaded,
    run_spec,
    step_ctx,
    tiny,
)


def _batch(mh):
    return tokenize(loaded(mh), emphasis_examples(3, seed=7))


def test_pasta_and_masks_compose_and_equal_naive_hooks():
    """PASTA on (0, 1), (1, 2) + output ablation of (1, 0) + PASTA-steered (0, 1) also output-scaled:
    one plan == an eager model carrying all the naive hooks at once."""
    mh, me = tiny("headlab"), tiny("eager")
    batch = _batch(mh)
    ctx = step_ctx(mh, batch.examples)
    plan = ins.Plan()
    P.steer(P.Pasta(heads=[[0, 1], [1, 2]], alpha=0.01), ctx, batch, plan)
    HS.steer_mask(HS.HeadMask(heads=[[1, 0]], mode="output"), ctx, batch, plan)
    HS.steer_scale(HS.HeadScale(heads=[[0, 1]], factor=1.5), ctx, batch, plan)  # same head, other kind
    ours = headlab_generate(mh, batch, plan, 6)
    bias = bias_matrix(build_tokenizer(), batch, 0.01, "exclude")
    with eager_pasta(me, [(0, 1), (1, 2)], bias), hooked(me, [(1, 0)], "o", 0.0), hooked(me, [(0, 1)], "o", 1.5):
        ref = hf_generate(me, batch, 6).tolist()
    assert ours == ref
    assert set(claims(plan)) == {(0, 1, "key_bias"), (1, 2, "key_bias"), (1, 0, "out_scale"), (0, 1, "out_scale")}


def test_two_pasta_on_different_heads_equal_one():
    mh = tiny("headlab")
    batch = _batch(mh)
    ctx = step_ctx(mh, batch.examples)
    a, b = ins.Plan(), ins.Plan()
    P.steer(P.Pasta(heads=[[0, 1]]), ctx, batch, a)
    P.steer(P.Pasta(heads=[[1, 3]]), ctx, batch, a)
    P.steer(P.Pasta(heads=[[0, 1], [1, 3]]), ctx, batch, b)
    assert headlab_generate(mh, batch, a, 5) == headlab_generate(mh, batch, b, 5)


@pytest.mark.parametrize("first,second,msg", [
    (P.Pasta(heads=[[0, 1], [1, 1]]), P.Pasta(heads=[[1, 1]], alpha=0.1), r"'pasta' and 'pasta'.*\(1, 1\)"),
    (HS.HeadScale(heads=[[1, 2]], factor=2), HS.HeadMask(heads=[[1, 2]], mode="output"),
     r"'head_scale' and 'head_mask'.*output scale.*\(1, 2\)"),
    (HS.HeadMask(heads=[[0, 0]], mode="query"), HS.HeadScale(heads=[[0, 0]], factor=0.5, target="queries"),
     r"query scale.*\(0, 0\)"),
    (HS.HeadScale(heads=[[1, 0]], factor=2, target="values"), HS.HeadMask(heads=[[1, 1]], mode="output"),
     r"\(1, 1\)"),  # values scaling claims the whole GQA group
    (V.Vhr(layers=[1], segment="emphasis"), HS.HeadScale(heads=[[1, 3]], factor=2), r"'vhr' and 'head_scale'"),
])
def test_conflicts_are_rejected(first, second, msg):
    mh = tiny("headlab")
    batch = _batch(mh)
    ctx = step_ctx(mh, batch.examples)
    plan = ins.Plan()
    impl = {"pasta": P.steer, "head_scale": HS.steer_scale, "head_mask": HS.steer_mask, "vhr": V.steer}
    impl[first.kind](first, ctx, batch, plan)
    with pytest.raises(SteeringConflictError, match=msg):
        impl[second.kind](second, ctx, batch, plan)


def test_compatible_pairs_are_accepted():
    mh = tiny("headlab")
    batch = _batch(mh)
    ctx = step_ctx(mh, batch.examples)
    plan = ins.Plan()
    V.steer(V.Vhr(layers=[1], segment="emphasis"), ctx, batch, plan)
    HS.steer_scale(HS.HeadScale(heads=[[0, 3]], factor=2), ctx, batch, plan)  # other layer
    P.steer(P.Pasta(heads=[[1, 3]]), ctx, batch, plan)  # same head as VHR, other edit kind
    HS.steer_mask(HS.HeadMask(heads=[[1, 3]], mode="score"), ctx, batch, plan)
    assert len(headlab_generate(mh, batch, plan, 3)) == 3


def test_claims_on_disjoint_rows_compose():
    plan = ins.Plan()
    a, b = P.Pasta(heads=[[0, 0]]), P.Pasta(heads=[[0, 0]])
    plan.bias_keys([(0, 0)], [(1, 2)], -1.0, rows=[0, 1], owner=a)
    plan.bias_keys([(0, 0)], [(1, 2)], -1.0, rows=[2], owner=a)  # the same method may add again
    plan.bias_keys([(0, 0)], [(1, 2)], -1.0, rows=[3], owner=b)
    with pytest.raises(SteeringConflictError):
        plan.bias_keys([(0, 0)], [(1, 2)], -1.0, rows=[1], owner=b)
    with pytest.raises(SteeringConflictError):
        plan.bias_keys([(0, 0)], [(1, 2)], -1.0, owner=P.Pasta(heads=[[0, 0]]))  # all rows
    with pytest.raises(TypeError, match="typed edits"):
        plan.add(("key_bias", [(0, 0)]))
    assert len(plan.edits) == 3


def test_conflict_in_a_spec_is_a_clear_error(tmp_path):
    steps = """  - id: both
    generate: {max_new_tokens: 2, steer: [{kind: pasta, heads: [[0, 1]]}, {kind: pasta, heads: {"0": [1, 2]}}]}
"""
    with pytest.raises(headlab.StepError, match=r"steering conflict: 'pasta' and 'pasta'.*\(0, 1\)") as err:
        run_spec(tmp_path, steps, n=2)
    assert isinstance(err.value.cause, SteeringConflictError) and err.value.step == "both"
    ok = """  - id: both
    generate: {max_new_tokens: 2, steer: [{kind: pasta, heads: [[0, 1]]}, {kind: head_mask, heads: [[0, 1]]}]}
"""
    res = run_spec(tmp_path, ok, n=2)
    assert json.loads(res["both"].attrs["config"])["steer"][1]["kind"] == "head_mask"
