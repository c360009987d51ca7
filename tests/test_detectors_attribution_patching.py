"""attribution_patching (docs/methods.md#attribution-patching): each head's estimate equals the derivative of the
patched metric along ``z_source - z_target``, by central finite differences of runs patched with
``z_target + t (z_source - z_target)`` on a float64 model; and the comparison with an activation_patching step."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from headlab import Plan, StepContext, forward, tokenize
from headlab.plugins.detectors.activation_patching import ActivationPatching, metric_of, pair_runs
from headlab.plugins.detectors.activation_patching import detect as patch
from headlab.plugins.detectors.attribution_patching import (
    AttributionPatching,
    attribution_runs,
    detect,
    spearman,
    target_gradients,
    top_k_recall,
)

from fixtures.circuits import ARCHS, models, pair_examples


def _finite_differences(lm, examples, metric: str, direction: str, eps: float = 3e-3) -> np.ndarray:
    """(layer, head, example) d metric / dt of the target run with one head's z = z_t + t (z_s - z_t), at 0."""
    answer = [ex.meta["answer_id"] for ex in examples]
    wrong = [ex.meta["wrong_id"] for ex in examples]
    runs = pair_runs(lm, examples, answer, wrong, metric)
    n, L, H = runs.n, lm.geometry.n_layers, lm.geometry.n_heads
    src, tgt = (slice(0, n), slice(n, 2 * n)) if direction == "denoise" else (slice(n, 2 * n), slice(0, n))
    out = np.zeros((L, H, n))
    for layer in range(L):
        for head in range(H):
            z_t, z_s = runs.z[tgt, layer, head], runs.z[src, layer, head]
            values = []
            for t in (eps, -eps):
                plan = Plan().patch_z([(layer, head)], (z_t + t * (z_s - z_t))[:, None])
                res, _ = forward(lm, runs.ids[tgt], plan, attention_mask=runs.mask[tgt], logits_to_keep=1)
                values.append(metric_of(res.logits[:, -1], runs.answer, runs.wrong, metric).numpy())
            out[layer, head] = (values[0] - values[1]) / (2 * eps)
    return out


@pytest.mark.parametrize(("arch", "metric", "direction"),
                         [(arch, "logit_diff", "denoise") for arch in ARCHS] + [("llama", "logprob", "noise")])
def test_atp_equals_finite_differences_of_the_patched_metric(arch, metric, direction):
    tok, lm, _ = models(arch)
    lm.model.double()
    examples = pair_examples(tok)  # one left-padded chunk
    ctx = StepContext(model=lm, examples=examples, results={}, seed=0)
    ds = detect(AttributionPatching(metric=metric, direction=direction), ctx)
    fd = _finite_differences(lm, examples, metric, direction)
    atp = ds["atp"].values
    scale = np.abs(fd).max()
    assert scale > 1e-2
    # the RMS norms compute in float32 even in a float64 model: steps of 3e-3 balance that noise and the
    # truncation error of the differences (both near 3e-5 of the scale)
    np.testing.assert_allclose(atp, fd, rtol=1e-3, atol=1e-4 * scale)
    target = ds["corrupt"] if direction == "denoise" else ds["clean"]
    want = ((target + ds["atp"]).mean("example") - ds["corrupt"].mean()) / (ds["clean"].mean() - ds["corrupt"].mean())
    np.testing.assert_allclose(ds["score"].values, want.values, rtol=1e-12)
    # per token: the terms of each head add up to its all-positions estimate
    per_token = detect(AttributionPatching(metric=metric, direction=direction, unit="z_position"), ctx)
    np.testing.assert_allclose(per_token["atp"].sum("token").values, atp, rtol=1e-9, atol=1e-12)
    lengths = [len(tok(ex.prompt).input_ids) for ex in examples]
    for e, n in enumerate(lengths):
        assert np.isnan(per_token["atp"].values[:, :, n:, e]).all()
        assert not np.isnan(per_token["atp"].values[:, :, :n, e]).any()


@pytest.mark.parametrize("method", ["atp", "atp_star"])
def test_the_model_is_left_as_it_was(method):
    """No parameter gets a gradient, every parameter keeps its requires_grad flag, and no hook stays behind: a
    forward after the detector gives the logits of every position that it gave before."""
    tok, lm, _ = models("qwen2")
    params = list(lm.model.parameters())
    for i, p in enumerate(params):
        p.requires_grad_(i % 3 != 0)
    flags = [p.requires_grad for p in params]
    examples = pair_examples(tok)
    batch = tokenize(lm, examples)
    before = forward(lm, batch)[0].logits
    detect(AttributionPatching(method=method), StepContext(model=lm, examples=examples, results={}, seed=0))
    assert [p.requires_grad for p in params] == flags
    assert all(p.grad is None for p in params)
    assert torch.equal(forward(lm, batch)[0].logits, before)


@pytest.mark.parametrize(("arch", "direction"),
                         [(arch, "denoise") for arch in (*ARCHS, "olmo2")] + [("llama", "noise")])
def test_attribution_runs_equal_pair_runs_then_target_gradients(arch, direction):
    tok, lm, _ = models(arch)
    examples = pair_examples(tok)
    answer = [ex.meta["answer_id"] for ex in examples]
    wrong = [ex.meta["wrong_id"] for ex in examples]
    runs, grads = attribution_runs(lm, examples, answer, wrong, "logit_diff", direction)
    ref = pair_runs(lm, examples, answer, wrong, "logit_diff")
    ref_grads, ref_metric = target_gradients(lm, ref, "logit_diff", direction)
    assert torch.equal(runs.ids, ref.ids) and torch.equal(runs.mask, ref.mask) and runs.pad == ref.pad
    np.testing.assert_allclose(runs.z.numpy(), ref.z.numpy(), rtol=1e-5, atol=1e-6 * ref.z.abs().max().item())
    np.testing.assert_allclose(runs.metric.numpy(), ref.metric.numpy(), rtol=1e-5, atol=1e-6)
    target = runs.rows("corrupt" if direction == "denoise" else "clean")
    np.testing.assert_allclose(runs.metric[target].numpy(), ref_metric.numpy(), rtol=1e-5, atol=1e-6)
    assert grads.shape == ref_grads.shape
    scale = ref_grads.abs().max().item()
    assert scale > 0
    np.testing.assert_allclose(grads.numpy(), ref_grads.numpy(), rtol=1e-4, atol=1e-5 * scale)


def test_comparison_with_an_activation_patching_step():
    tok, lm, _ = models("llama")
    examples = pair_examples(tok)
    exact = patch(ActivationPatching(), StepContext(model=lm, examples=examples, results={}, seed=0))
    ctx = StepContext(model=lm, examples=examples, results={"patch": exact}, seed=0)
    ds = detect(AttributionPatching(reference="patch", top_k=3), ctx)
    stats = pytest.importorskip("scipy.stats")
    want = stats.spearmanr(exact["score"].values.ravel(), ds["score"].values.ravel()).statistic
    assert ds.attrs["spearman"] == pytest.approx(want, abs=1e-12)
    top = lambda s: set(np.argsort(-np.abs(s.values.ravel()))[:3].tolist())  # noqa: E731
    assert ds.attrs["top_k_recall"] == pytest.approx(len(top(exact["score"]) & top(ds["score"])) / 3)
    assert ds.attrs["reference_step"] == "patch" and ds.attrs["top_k"] == 3
    with pytest.raises(ValueError, match=r"reference 'nope' is not an earlier step of this cell \(earlier steps: patch\)"):
        detect(AttributionPatching(reference="nope"), ctx)
    with pytest.raises(ValueError, match=r"reference 'patch' has direction 'denoise', this step 'noise'"):
        detect(AttributionPatching(reference="patch", direction="noise"), ctx)


def test_rank_statistics():
    stats = pytest.importorskip("scipy.stats")
    a = np.array([3.0, 1.0, 2.0, 2.0, np.nan, 5.0])
    b = np.array([1.0, 0.5, 4.0, 4.0, 2.0, 9.0])
    keep = np.isfinite(a)
    assert spearman(a, b) == pytest.approx(stats.spearmanr(a[keep], b[keep]).statistic, abs=1e-12)
    assert top_k_recall(np.array([5.0, 4.0, 0.0, 1.0]), np.array([5.0, 0.0, 4.0, 1.0]), 2) == 0.5
    assert top_k_recall(np.array([1.0, 2.0]), np.array([2.0, 1.0]), 5) == 1.0
