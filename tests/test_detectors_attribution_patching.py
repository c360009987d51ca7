"""attribution_patching (docs/methods.md#attribution-patching): each head's estimate equals the derivative of the
patched metric along ``z_source - z_target``, by central finite differences of runs patched with
``z_target + t (z_source - z_target)`` on a float64 model; and the comparison with an activation_patching step."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from headlab import Example, Plan, StepContext, forward, tokenize
from headlab.plugins.detectors import attribution_patching
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
from headlab.plugins.tasks.pairs import pair_example

from fixtures.circuits import ARCHS, models, pair_examples
from fixtures.circuits import attention_queries as _attention_queries
from fixtures.detectors import build_models, tiny_config, word_tokenizer


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
                         [(arch, "logit_diff", "denoise") for arch in ARCHS] + [("llama", "logprob", "noise"),
                                                                                 ("gemma2", "logit_diff", "denoise")])
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
    assert ds.attrs["reference_chosen"] == "spec"
    # without reference: the latest earlier activation_patching step that matches, found by itself
    noise = patch(ActivationPatching(direction="noise"), StepContext(model=lm, examples=examples, results={}, seed=0))
    other = patch(ActivationPatching(unit="z_position"), StepContext(model=lm, examples=examples, results={}, seed=0))
    cell = {"patch": exact, "noise": noise, "other": other, "atp": ds}
    auto = detect(AttributionPatching(top_k=3), StepContext(model=lm, examples=examples, results=cell, seed=0))
    assert auto.attrs["reference_step"] == "patch" and auto.attrs["reference_chosen"] == "auto"
    assert auto.attrs["spearman"] == ds.attrs["spearman"] and auto.attrs["top_k_recall"] == ds.attrs["top_k_recall"]
    auto = detect(AttributionPatching(top_k=3, direction="noise"), StepContext(model=lm, examples=examples,
                                                                               results=cell, seed=0))
    want = stats.spearmanr(noise["score"].values.ravel(), auto["score"].values.ravel()).statistic
    assert auto.attrs["reference_step"] == "noise" and auto.attrs["spearman"] == pytest.approx(want, abs=1e-12)
    alone = detect(AttributionPatching(normalise="per_example"), ctx)  # no earlier step normalises so: no comparison
    assert "spearman" not in alone.attrs and "reference_step" not in alone.attrs


def test_rank_statistics():
    stats = pytest.importorskip("scipy.stats")
    a = np.array([3.0, 1.0, 2.0, 2.0, np.nan, 5.0])
    b = np.array([1.0, 0.5, 4.0, 4.0, 2.0, 9.0])
    keep = np.isfinite(a)
    assert spearman(a, b) == pytest.approx(stats.spearmanr(a[keep], b[keep]).statistic, abs=1e-12)
    assert top_k_recall(np.array([5.0, 4.0, 0.0, 1.0]), np.array([5.0, 0.0, 4.0, 1.0]), 2) == 0.5
    assert top_k_recall(np.array([1.0, 2.0]), np.array([2.0, 1.0]), 5) == 1.0


@pytest.mark.parametrize(("arch", "method", "direction", "unit"),
                         [("llama", "atp", "denoise", "z"), ("gpt2", "atp", "noise", "z_position"),
                          ("qwen2", "atp_star", "denoise", "z"), ("llama", "atp_star", "noise", "z_position")])
def test_the_shared_prefix_runs_once_and_the_estimates_equal_runs_of_the_whole_prompts(arch, method, direction, unit,
                                                                                       monkeypatch):
    """The positions before the first one where some pair of the chunk differs run once, without gradients, into a
    KV cache; the source and target runs (atp) and the gradient pass (both) run the positions after it only, and
    every estimate equals that of runs over the whole prompts (float64)."""
    tok, lm, _ = models(arch)
    lm.model.double()
    examples = pair_examples(tok)
    ctx = StepContext(model=lm, examples=examples, results={}, seed=0)
    config = AttributionPatching(method=method, direction=direction, unit=unit, qk_fix=False, pair_batch_size=3)
    results, queries = {}, {}
    for prefix in (True, False):
        if not prefix:
            monkeypatch.setattr(attribution_patching, "prefix_reusable", lambda lm: False)
        seen, handles = _attention_queries(lm)
        try:
            results[prefix] = detect(config, ctx)
        finally:
            for h in handles:
                h.remove()
        queries[prefix] = seen
    fast, full = results[True], results[False]
    assert fast.attrs["prefix"] == "shared_cache" and full.attrs["prefix"] == "recomputed"
    assert fast.attrs["prefix_runs"] == ("gradients" if method == "atp_star" else "source, target, gradients")
    for name in ("atp", "score", "clean", "corrupt"):
        scale = np.nanmax(np.abs(full[name].values))
        assert scale > 1e-3
        np.testing.assert_allclose(fast[name].values, full[name].values, rtol=1e-9, atol=1e-12 * scale)
    runs = pair_runs(lm, examples, [0] * 3, [1] * 3, "logit_diff")
    n, T, L = 3, runs.ids.shape[1], lm.geometry.n_layers
    shared = min(int((runs.ids[e] != runs.ids[n + e]).nonzero()[0, 0]) for e in range(n))
    assert 0 < shared < T - 1
    copies = L + 1 if method == "atp_star" else 1  # GradDrop: the target prompts once more per dropped layer
    for ly in range(L):
        if method == "atp":  # prefix once, then the source and the target prompts after it
            assert queries[False][ly] == 2 * n * T
            assert queries[True][ly] == n * shared + 2 * n * (T - shared)
        else:  # both prompts (pair_runs), then the gradient pass
            assert queries[False][ly] == 2 * n * T + copies * n * T
            assert queries[True][ly] == 2 * n * T + n * shared + copies * n * (T - shared)


def test_no_parameter_gradient_is_computed_and_the_output_layer_is_not_run_for_logit_diff():
    """The backward reaches the heads' outputs only (a parameter's gradient hook never fires); with ``logit_diff``
    the model's output layer over the whole vocabulary never runs (its rows of the answer tokens do), and the
    metrics equal those of the whole output layer."""
    tok, lm, _ = models("llama")
    examples = pair_examples(tok)
    fired, calls = [], []
    params = [p for p in lm.model.parameters() if p.requires_grad]
    assert params
    handles = [p.register_hook(lambda g: fired.append(g.shape)) for p in params]
    handles.append(lm.model.get_output_embeddings().register_forward_hook(lambda m, a, out: calls.append(out.shape)))
    ctx = StepContext(model=lm, examples=examples, results={}, seed=0)
    try:
        ds = detect(AttributionPatching(), ctx)
        assert fired == [] and calls == []
        ds_logprob = detect(AttributionPatching(metric="logprob"), ctx)
        assert fired == [] and len(calls) == 2  # the source and the target runs: the whole vocabulary is needed
    finally:
        for h in handles:
            h.remove()
    answer = [ex.meta["answer_id"] for ex in examples]
    wrong = [ex.meta["wrong_id"] for ex in examples]
    for metric, got in (("logit_diff", ds), ("logprob", ds_logprob)):
        ref = pair_runs(lm, examples, answer, wrong, metric).metric.numpy()
        np.testing.assert_allclose(np.concatenate([got["clean"].values, got["corrupt"].values]), ref, rtol=1e-5,
                                   atol=1e-5)


def test_a_sliding_window_model_runs_the_whole_prompts():
    """Where the model's KV cache is not made of plain growing layers (Mistral with a sliding window) the prefix
    is recomputed (attrs), and the metrics equal a plain forward's."""
    tok = word_tokenizer()
    lm, _ = build_models(tiny_config(len(tok), model_type="mistral", sliding_window=4, initializer_range=0.2),
                         tokenizer=tok)
    examples = pair_examples(tok)
    ds = detect(AttributionPatching(), StepContext(model=lm, examples=examples, results={}, seed=0))
    assert ds.attrs["prefix"] == "recomputed" and ds.attrs["prefix_runs"] == "none"
    answer = [ex.meta["answer_id"] for ex in examples]
    wrong = [ex.meta["wrong_id"] for ex in examples]
    ref = pair_runs(lm, examples, answer, wrong, "logit_diff").metric.numpy()
    np.testing.assert_allclose(np.concatenate([ds["clean"].values, ds["corrupt"].values]), ref, rtol=1e-5, atol=1e-5)
    assert np.isfinite(ds["score"].values).all()


def test_a_shared_prefix_that_is_all_padding_for_a_short_pair(monkeypatch):
    """A pair whose left padding covers the whole shared prefix (its prompts differ later than the prefix, which
    another pair ends): the estimates still equal runs of the whole prompts (float64)."""
    tok, lm, _ = models("llama")
    lm.model.double()
    examples = [pair_example(tok, "cat cat dog eel fox gnu hen : cat", "cat dog dog eel fox gnu hen : cat", "dog",
                             "hen", "long"),
                pair_example(tok, "fox gnu . hen", "fox ibis . hen", "jay", "fox", "short")]
    batch = tokenize(lm, examples)
    ids = torch.cat([batch.input_ids, tokenize(lm, [Example(prompt=ex.meta["corrupt_prompt"]) for ex in examples])
                     .input_ids])
    shared = attribution_patching.shared_prefix_length(ids, 2)
    assert 0 < shared <= batch.pad[1]
    ctx = StepContext(model=lm, examples=examples, results={}, seed=0)
    fast = detect(AttributionPatching(unit="z_position"), ctx)
    monkeypatch.setattr(attribution_patching, "prefix_reusable", lambda lm: False)
    full = detect(AttributionPatching(unit="z_position"), ctx)
    assert fast.attrs["prefix"] == "shared_cache" and full.attrs["prefix"] == "recomputed"
    scale = np.nanmax(np.abs(full["atp"].values))
    np.testing.assert_allclose(fast["atp"].values, full["atp"].values, rtol=1e-9, atol=1e-12 * scale)
