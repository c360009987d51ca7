"""attribution_patching (docs/methods.md#attribution-patching): each head's estimate equals the derivative of the
patched metric along ``z_source - z_target``, by central finite differences of runs patched with
``z_target + t (z_source - z_target)`` on a float64 model; and the comparison with an activation_patching step."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import headlab
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
from fixtures.specs import spec_error, spec_text


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


@pytest.mark.parametrize(("method", "unit"), [("atp", "z"), ("atp_star", "z"), ("atp", "kv"), ("atp", "resid"),
                                             ("atp_star", "kv")])
def test_the_model_is_left_as_it_was(method, unit):
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
    config = AttributionPatching(method=method, unit=unit, qk_fix=unit == "z")
    detect(config, StepContext(model=lm, examples=examples, results={}, seed=0))
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
    # a logit difference near 0 carries the float32 rounding of logits of several units (1 ulp at 4 is 5e-7)
    atol = 1e-6 * max(1.0, ref.metric.abs().max().item())
    np.testing.assert_allclose(runs.metric.numpy(), ref.metric.numpy(), rtol=1e-5, atol=atol)
    target = runs.rows("corrupt" if direction == "denoise" else "clean")
    np.testing.assert_allclose(runs.metric[target].numpy(), ref_metric.numpy(), rtol=1e-5, atol=atol)
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


def _unit_finite_differences(lm, examples, unit: str, metric: str, direction: str, eps: float = 3e-3) -> np.ndarray:
    """``d metric / dt`` at 0 of the target run with one unit set to ``target + t (source - target)``: for ``kv``
    (layer, kv_head, example) the keys (as attention reads them) and values of one key/value head at every
    position (``Plan.patch_kv``), for ``resid`` (layer, token, example) the residual stream entering one layer at
    one token (``Plan.patch_resid``; NaN at a token an example does not have). Five-point differences: the float32
    norms' rounding stays near 3e-5 of the scale while the truncation error drops below it."""
    answer = [ex.meta["answer_id"] for ex in examples]
    wrong = [ex.meta["wrong_id"] for ex in examples]
    runs = pair_runs(lm, examples, answer, wrong, metric, kv=True, resid=True)
    n, L, K, T = runs.n, lm.geometry.n_layers, lm.geometry.n_kv_heads, runs.ids.shape[1]
    src, tgt = (slice(0, n), slice(n, 2 * n)) if direction == "denoise" else (slice(n, 2 * n), slice(0, n))

    def derivative(plan_at) -> np.ndarray:
        values = []
        for t in (eps, -eps, 2 * eps, -2 * eps):
            res, _ = forward(lm, runs.ids[tgt], plan_at(t), attention_mask=runs.mask[tgt], logits_to_keep=1)
            values.append(metric_of(res.logits[:, -1], runs.answer, runs.wrong, metric).numpy())
        return (8 * (values[0] - values[1]) - (values[2] - values[3])) / (12 * eps)

    def moved(x: torch.Tensor, t: float) -> torch.Tensor:
        return x[tgt] + t * (x[src] - x[tgt])

    def kv_plan(layer: int, j: int):
        return lambda t: Plan().patch_kv([(layer, j)], moved(runs.k[:, layer, j], t)[:, None],
                                         moved(runs.v[:, layer, j], t)[:, None])

    def resid_plan(layer: int, p: int):
        return lambda t: Plan().patch_resid(layer, moved(runs.resid[:, layer, p], t)[:, None], positions=[p])

    if unit == "kv":
        out = np.zeros((L, K, n))
        for layer in range(L):
            for j in range(K):
                out[layer, j] = derivative(kv_plan(layer, j))
        return out
    out = np.full((L, T - min(runs.pad), n), np.nan)
    for layer in range(L):
        for p in range(T):
            d = derivative(resid_plan(layer, p))
            for e in range(n):
                if p >= runs.pad[e]:
                    out[layer, p - runs.pad[e], e] = d[e]
    return out


@pytest.mark.parametrize(("arch", "unit", "metric", "direction"),
                         [("llama", "kv", "logit_diff", "denoise"), ("llama", "kv", "logprob", "noise"),
                          ("qwen2", "kv", "logit_diff", "noise"), ("gpt2", "kv", "logit_diff", "denoise"),
                          ("llama", "resid", "logit_diff", "denoise"), ("llama", "resid", "logprob", "noise"),
                          ("gpt2", "resid", "logit_diff", "noise"), ("qwen2", "resid", "logit_diff", "denoise")])
def test_kv_and_resid_atp_equal_finite_differences_of_the_patched_metric(arch, unit, metric, direction):
    """Llama with grouped-query attention (4 heads, 2 key/value heads), Qwen2 and GPT-2, float64, one left-padded
    chunk of pairs of different lengths: each unit's estimate equals the derivative of the patched metric along
    source minus target; the dims, coordinates and score follow activation_patching's for the unit."""
    tok, lm, _ = models(arch)
    lm.model.double()
    examples = pair_examples(tok)
    ctx = StepContext(model=lm, examples=examples, results={}, seed=0)
    ds = detect(AttributionPatching(unit=unit, metric=metric, direction=direction), ctx)
    fd = _unit_finite_differences(lm, examples, unit, metric, direction)
    atp = ds["atp"].values
    assert atp.shape == fd.shape
    assert np.array_equal(np.isnan(atp), np.isnan(fd))
    scale = np.nanmax(np.abs(fd))
    assert scale > 1e-2
    np.testing.assert_allclose(np.nan_to_num(atp), np.nan_to_num(fd), rtol=1e-3, atol=1e-4 * scale)
    target = ds["corrupt"] if direction == "denoise" else ds["clean"]
    valid = ds["atp"].notnull()  # a token's score is over the examples that have it
    clean, corrupt = ds["clean"].where(valid).mean("example"), ds["corrupt"].where(valid).mean("example")
    want = ((target + ds["atp"]).mean("example") - corrupt) / (clean - corrupt)
    np.testing.assert_allclose(ds["score"].values, want.values, rtol=1e-12)
    exact = patch(ActivationPatching(unit=unit, metric=metric, direction=direction), ctx)
    assert ds["score"].dims == exact["score"].dims and ds["atp"].dims == exact["patched"].dims
    assert ds["score"].shape == exact["score"].shape
    assert set(ds.coords) == set(exact.coords)
    H, K = lm.geometry.n_heads, lm.geometry.n_kv_heads
    if unit == "kv":
        assert ds["atp"].dims == ("layer", "kv_head", "example") and K == (2 if arch != "gpt2" else H)
        serves = ds.coords["serves"]
        assert serves.dims == ("kv_head", "head") and serves.values.sum() == H
        for j in range(K):
            assert serves.values[j].nonzero()[0].tolist() == list(range(j * (H // K), (j + 1) * (H // K)))
        np.testing.assert_array_equal(serves.values, exact.coords["serves"].values)
    else:
        assert ds["atp"].dims == ("layer", "token", "example")
        lengths = [len(tok(ex.prompt).input_ids) for ex in examples]
        for e, length in enumerate(lengths):
            assert np.isnan(atp[:, length:, e]).all() and not np.isnan(atp[:, :length, e]).any()


KV_LEAVES = "headlab_test_kv_leaves"


def _kv_reference(model, tok, examples, L: int, K: int, metric: str, direction: str, drop: int | None = None):
    """(layer, kv_head, example) ``sum (source - target) . d metric / d (keys, values)`` at the target run, one
    unpadded prompt at a time on the eager model: an attention function of the test's own adds zero leaves to
    the keys (after the rotary embedding) and values it reads and computes a causal softmax attention by hand;
    ``drop``: the gradient with that decoder layer's write detached (``input + (output - input).detach()``)."""
    from transformers import AttentionInterface

    store: dict = {}

    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        dk, dv = torch.zeros_like(key, requires_grad=True), torch.zeros_like(value, requires_grad=True)
        store[module.layer_idx] = (key.detach(), value.detach(), dk, dv)
        group = query.shape[1] // key.shape[1]
        k, v = (key + dk).repeat_interleave(group, dim=1), (value + dv).repeat_interleave(group, dim=1)
        T = query.shape[2]
        causal = torch.full((T, T), float("-inf"), dtype=query.dtype).triu(1)
        probs = torch.softmax(query @ k.transpose(-1, -2) * scaling + causal, dim=-1)
        return (probs @ v).transpose(1, 2).contiguous(), None

    AttentionInterface.register(KV_LEAVES, attention)
    model.set_attn_implementation(KV_LEAVES)
    layers = model.model.layers if hasattr(model, "model") else model.transformer.h
    out = np.zeros((L, K, len(examples)))
    try:
        for e, ex in enumerate(examples):
            clean, corrupt = tok(ex.prompt).input_ids, tok(ex.meta["corrupt_prompt"]).input_ids
            source, target = (clean, corrupt) if direction == "denoise" else (corrupt, clean)
            with torch.no_grad():
                model(input_ids=torch.tensor([source]))
            src = {ly: store[ly][:2] for ly in range(L)}
            handles = [] if drop is None else [layers[drop].register_forward_hook(
                lambda m, args, kwargs, o: (args[0] if args else kwargs["hidden_states"]) + (
                    o - (args[0] if args else kwargs["hidden_states"])).detach(), with_kwargs=True)]
            try:
                logits = model(input_ids=torch.tensor([target])).logits[0, -1].double()
            finally:
                for h in handles:
                    h.remove()
            a, w = ex.meta["answer_id"], ex.meta["wrong_id"]
            m = logits[a] - logits[w] if metric == "logit_diff" else torch.log_softmax(logits, -1)[a]
            leaves = [t for ly in range(L) for t in store[ly][2:]]
            grads = torch.autograd.grad(m, leaves, allow_unused=True)
            for ly in range(L):
                gk, gv = (torch.zeros_like(leaves[2 * ly + i]) if g is None else g
                          for i, g in enumerate(grads[2 * ly:2 * ly + 2]))
                k_t, v_t = store[ly][:2]
                k_s, v_s = src[ly]
                out[ly, :, e] = (((k_s - k_t) * gk).sum((0, 2, 3)) + ((v_s - v_t) * gv).sum((0, 2, 3))).numpy()
    finally:
        model.set_attn_implementation("eager")
    return out


@pytest.mark.parametrize(("arch", "direction"), [("llama", "denoise"), ("llama", "noise"), ("qwen2", "denoise")])
def test_kv_atp_and_graddrop_equal_a_hand_written_backward(arch, direction):
    """unit kv against zero leaves on the keys and values an eager attention of the test's own reads: the plain
    estimate, and ``method: atp_star`` with ``qk_fix: false`` (GradDrop: one backward per dropped layer, combined
    as ``sign(AtP) * sum_l |AtP_l| / (L - 1)``), in a left-padded chunk (float64)."""
    tok, lm, out = models(arch)
    lm.model.double()
    eager = out["eager"]
    examples = pair_examples(tok)
    L, K = lm.geometry.n_layers, lm.geometry.n_kv_heads
    ctx = StepContext(model=lm, examples=examples, results={}, seed=0)
    plain = _kv_reference(eager, tok, examples, L, K, "logit_diff", direction)
    dropped = np.stack([_kv_reference(eager, tok, examples, L, K, "logit_diff", direction, drop=ly) for ly in range(L)])
    assert np.abs(dropped - plain).max() > 1e-3 * np.abs(plain).max()  # dropping a layer changes the gradient
    scale = np.abs(plain).max()
    ds = detect(AttributionPatching(unit="kv", direction=direction), ctx)
    np.testing.assert_allclose(ds["atp"].values, plain, rtol=1e-4, atol=1e-6 * scale)  # float32 norms
    star = detect(AttributionPatching(unit="kv", direction=direction, method="atp_star", qk_fix=False), ctx)
    want = np.sign(plain) * np.abs(dropped).sum(0) / (L - 1)
    np.testing.assert_allclose(star["atp"].values, want, rtol=1e-4, atol=1e-6 * scale)
    assert star.attrs["grad_drop"] == 1 and star.attrs["qk_fix"] == 0 and "key" not in star
    assert star["score"].dims == ("layer", "kv_head")


def test_atp_star_refuses_units_it_does_not_define():
    """One located line from the spec, naming the option and the fix."""
    steps = "  - id: atp\n    detect: {{kind: attribution_patching, method: atp_star, {}}}\n"
    task = "{kind: kv_swap, n: 2}"
    msg = spec_error(spec_text(steps.format("unit: kv"), task=task))
    assert msg.endswith("steps[0].detect: unit kv with method atp_star needs qk_fix: false (the QK fix is defined for "
                        "the query and key patches of a head's output z; GradDrop applies to key/value heads)"), msg
    msg = spec_error(spec_text(steps.format("unit: resid, qk_fix: false"), task=task))
    assert "steps[0].detect: method atp_star is not defined for unit resid (" in msg and msg.endswith(
        "): use method: atp"), msg
    for ok in ("unit: kv, qk_fix: false", "unit: z"):
        headlab.load_spec(spec_text(steps.format(ok), task=task))
    headlab.load_spec(spec_text("  - id: atp\n    detect: {kind: attribution_patching, unit: resid}\n", task=task))


@pytest.mark.parametrize(("arch", "unit", "method", "direction"),
                         [("llama", "kv", "atp", "denoise"), ("qwen2", "kv", "atp", "noise"),
                          ("llama", "kv", "atp_star", "noise"), ("gpt2", "resid", "atp", "denoise"),
                          ("llama", "resid", "atp", "noise")])
def test_kv_and_resid_with_the_shared_prefix_equal_runs_of_the_whole_prompts(arch, unit, method, direction,
                                                                             monkeypatch):
    """The shared prefix holds for both units (their source and target values are equal before the first
    differing token, and later positions do not change earlier ones): the estimates equal those of runs over
    the whole prompts (float64). The runs after the prefix: the source and target forwards and, for
    kv, the forward pulling the gradients back through each layer's attention."""
    tok, lm, _ = models(arch)
    lm.model.double()
    examples = pair_examples(tok)
    ctx = StepContext(model=lm, examples=examples, results={}, seed=0)
    config = AttributionPatching(unit=unit, method=method, direction=direction, qk_fix=False)
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
    assert fast.attrs["unit"] == unit and full.attrs["prefix_runs"] == "none"
    for name in ("atp", "score", "clean", "corrupt"):
        scale = np.nanmax(np.abs(full[name].values))
        assert scale > 1e-3
        np.testing.assert_allclose(fast[name].values, full[name].values, rtol=1e-9, atol=1e-12 * scale)
    runs = pair_runs(lm, examples, [0] * 3, [1] * 3, "logit_diff")
    n, T, L = 3, runs.ids.shape[1], lm.geometry.n_layers
    shared = min(int((runs.ids[e] != runs.ids[n + e]).nonzero()[0, 0]) for e in range(n))
    assert 0 < shared < T - 1
    pull_back = 1 if unit == "kv" else 0
    for ly in range(L):
        if method == "atp":  # prefix once, the source and the target prompts after it (and the pull-back)
            assert queries[False][ly] == (2 + pull_back) * n * T
            assert queries[True][ly] == n * shared + (2 + pull_back) * n * (T - shared)
        else:  # both prompts (pair_runs), then the gradient pass over L + 1 copies, then the pull-back
            assert queries[False][ly] == 2 * n * T + (L + 1 + pull_back) * n * T
            assert queries[True][ly] == 2 * n * T + n * shared + (L + 1 + pull_back) * n * (T - shared)


def test_kv_and_resid_compare_with_exact_patching_of_the_same_unit():
    """``reference`` (given, or the latest earlier activation_patching step of the same unit, metric, direction
    and normalisation) compares kv and resid scores with the exact ones: Spearman and top-k recall."""
    stats = pytest.importorskip("scipy.stats")
    tok, lm, _ = models("llama")
    examples = pair_examples(tok)
    fresh = StepContext(model=lm, examples=examples, results={}, seed=0)
    exact = {unit: patch(ActivationPatching(unit=unit), fresh) for unit in ("z", "kv", "resid")}
    cell = {f"patch_{unit}": ds for unit, ds in exact.items()}
    ctx = StepContext(model=lm, examples=examples, results=cell, seed=0)
    for unit in ("kv", "resid"):
        ref = exact[unit]["score"].values
        given = detect(AttributionPatching(unit=unit, reference=f"patch_{unit}", top_k=3), ctx)
        auto = detect(AttributionPatching(unit=unit, top_k=3), ctx)
        assert given.attrs["reference_chosen"] == "spec" and auto.attrs["reference_chosen"] == "auto"
        assert auto.attrs["reference_step"] == f"patch_{unit}"
        est = given["score"].values
        keep = np.isfinite(ref) & np.isfinite(est)
        assert keep.sum() >= 4
        want = stats.spearmanr(ref[keep], est[keep]).statistic
        assert given.attrs["spearman"] == pytest.approx(want, abs=1e-12) == auto.attrs["spearman"]
        top = [set(np.argsort(-np.nan_to_num(np.abs(x.ravel()), nan=-np.inf), kind="mergesort")[:3].tolist())
               for x in (ref, est)]
        assert given.attrs["top_k_recall"] == pytest.approx(len(top[0] & top[1]) / 3)
        other = "resid" if unit == "kv" else "kv"
        with pytest.raises(ValueError, match=rf"reference 'patch_{other}' has unit '{other}', this step '{unit}'"):
            detect(AttributionPatching(unit=unit, reference=f"patch_{other}"), ctx)


@pytest.mark.parametrize("unit", ["kv", "resid"])
def test_kv_and_resid_on_a_sliding_window_model(unit):
    """Mistral with a sliding window shorter than the prompts (its cache drops keys, so the prompts run whole and
    the target's keys and values are recorded by probes): the estimates equal finite differences (float64)."""
    tok = word_tokenizer()
    lm, _ = build_models(tiny_config(len(tok), model_type="mistral", sliding_window=4, initializer_range=0.2),
                         tokenizer=tok)
    lm.model.double()
    examples = pair_examples(tok)
    ds = detect(AttributionPatching(unit=unit), StepContext(model=lm, examples=examples, results={}, seed=0))
    assert ds.attrs["prefix"] == "recomputed"
    fd = _unit_finite_differences(lm, examples, unit, "logit_diff", "denoise")
    scale = np.nanmax(np.abs(fd))
    assert scale > 1e-2
    np.testing.assert_allclose(np.nan_to_num(ds["atp"].values), np.nan_to_num(fd), rtol=1e-3, atol=1e-4 * scale)
