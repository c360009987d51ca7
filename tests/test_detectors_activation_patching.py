"""activation_patching (docs/methods.md#activation-patching) against a TransformerLens-style reference written
here: an eager copy of the model, one unpadded prompt at a time, the clean run's head outputs read by a forward
pre-hook on the output projection, then one forward per patched head (and position) with a pre-hook that
overwrites that head's slice of the projection's input."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from headlab import Example, Plan, StepContext, forward
from headlab.plugins.detectors.activation_patching import (
    ActivationPatching,
    detect,
    metric_of,
    pair_runs,
)

from fixtures.circuits import ARCHS, kv_projection_hooks, models, pair_examples
from fixtures.circuits import attention_queries as _attention_queries


def _o_proj(model, arch: str, layer: int):
    return model.transformer.h[layer].attn.c_proj if arch == "gpt2" else model.model.layers[layer].self_attn.o_proj


def _metric(logits: torch.Tensor, answer: int, wrong: int, metric: str) -> float:
    x = logits.double()
    if metric == "logit_diff":
        return float(x[answer] - x[wrong])
    return float(torch.log_softmax(x, -1)[answer])


def _run(model, arch: str, ids: list[int], patch=None):
    """(last-position logits, {layer: o_proj input (T, H*D)}) of one prompt; ``patch = (layer, head, values
    (T', D), positions)`` overwrites that head's slice at those positions."""
    L = len(model.transformer.h if arch == "gpt2" else model.model.layers)
    seen: dict = {}
    hooks = []
    for layer in range(L):
        def hook(module, args, layer=layer):
            x = args[0]
            if patch is not None and patch[0] == layer:
                _, head, values, positions = patch
                D = values.shape[-1]
                x = x.clone()
                x[0, positions, head * D:(head + 1) * D] = values
            seen[layer] = x[0].detach()
            return (x,)
        hooks.append(_o_proj(model, arch, layer).register_forward_pre_hook(hook))
    try:
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
    finally:
        for h in hooks:
            h.remove()
    return logits, seen


def reference(model, arch: str, tok, examples, L: int, H: int, unit: str, metric: str, direction: str):
    """(clean (E,), corrupt (E,), patched (L, H[, token], E) with NaN where an example lacks the token)."""
    E = len(examples)
    T = max(len(tok(ex.prompt).input_ids) for ex in examples)
    patched = np.full((L, H, E) if unit == "z" else (L, H, T, E), np.nan)
    clean, corrupt = np.zeros(E), np.zeros(E)
    for e, ex in enumerate(examples):
        a, w = ex.meta["answer_id"], ex.meta["wrong_id"]
        ids_clean, ids_corrupt = tok(ex.prompt).input_ids, tok(ex.meta["corrupt_prompt"]).input_ids
        logits_clean, z_clean = _run(model, arch, ids_clean)
        logits_corrupt, z_corrupt = _run(model, arch, ids_corrupt)
        clean[e], corrupt[e] = _metric(logits_clean, a, w, metric), _metric(logits_corrupt, a, w, metric)
        source, target = (z_clean, ids_corrupt) if direction == "denoise" else (z_corrupt, ids_clean)
        n = len(target)
        for layer in range(L):
            for head in range(H):
                z = source[layer].view(n, H, -1)[:, head]
                if unit == "z":
                    logits, _ = _run(model, arch, target, (layer, head, z, list(range(n))))
                    patched[layer, head, e] = _metric(logits, a, w, metric)
                else:
                    for p in range(n):
                        logits, _ = _run(model, arch, target, (layer, head, z[p:p + 1], [p]))
                        patched[layer, head, p, e] = _metric(logits, a, w, metric)
    return clean, corrupt, patched


def kv_reference(model, arch: str, tok, examples, L: int, K: int, D: int, metric: str):
    """(layer, kv_head, example) metrics of the corrupted prompts with one key/value head's projections at
    every position overwritten by the clean prompt's (the rotary embedding then gives the clean keys)."""
    patched = np.zeros((L, K, len(examples)))
    for e, ex in enumerate(examples):
        a, w = ex.meta["answer_id"], ex.meta["wrong_id"]
        clean_ids = torch.tensor([tok(ex.prompt).input_ids])
        corrupt_ids = torch.tensor([tok(ex.meta["corrupt_prompt"]).input_ids])
        for layer in range(L):
            seen: dict = {}
            handles = kv_projection_hooks(model, arch, layer, lambda name, out, seen=seen: seen.setdefault(name, out.detach()))
            try:
                with torch.no_grad():
                    model(input_ids=clean_ids)
            finally:
                for h in handles:
                    h.remove()
            for kvh in range(K):
                def overwrite(name, out, kvh=kvh, seen=seen):
                    out = out.clone()
                    out[..., kvh * D:(kvh + 1) * D] = seen[name][..., kvh * D:(kvh + 1) * D]
                    return out
                handles = kv_projection_hooks(model, arch, layer, overwrite)
                try:
                    with torch.no_grad():
                        logits = model(input_ids=corrupt_ids).logits[0, -1]
                finally:
                    for h in handles:
                        h.remove()
                patched[layer, kvh, e] = _metric(logits, a, w, metric)
    return patched


@pytest.mark.parametrize("arch", ARCHS)
def test_kv_patching_equals_the_projection_hook_reference(arch):
    tok, lm, eager = models(arch)
    examples = pair_examples(tok)
    geo = lm.geometry
    ctx = StepContext(model=lm, examples=examples, results={}, seed=0)
    ds = detect(ActivationPatching(unit="kv", batch_size=4, pair_batch_size=3), ctx)
    want = kv_reference(eager["eager"], arch, tok, examples, geo.n_layers, geo.n_kv_heads, geo.head_dim,
                        "logit_diff")
    np.testing.assert_allclose(ds["patched"].values, want, atol=1e-5, rtol=0)
    assert np.abs(ds["patched"].values - ds["corrupt"].values).max() > 1e-2
    assert ds["score"].dims == ("layer", "kv_head") and ds.sizes["kv_head"] == geo.n_kv_heads
    group = geo.n_heads // geo.n_kv_heads
    serves = ds["serves"].values
    assert serves.shape == (geo.n_kv_heads, geo.n_heads) and serves.sum(1).tolist() == [group] * geo.n_kv_heads
    assert all(serves[h // group, h] for h in range(geo.n_heads))


def _score(clean, corrupt, patched):
    valid = ~np.isnan(patched)
    mean_p = np.nansum(patched, -1) / valid.sum(-1)
    mean_c = (np.where(valid, clean, 0).sum(-1)) / valid.sum(-1)
    mean_k = (np.where(valid, corrupt, 0).sum(-1)) / valid.sum(-1)
    return (mean_p - mean_k) / (mean_c - mean_k)


CASES = [(arch, unit, "logit_diff", "denoise") for arch in ARCHS for unit in ("z", "z_position")]
CASES += [("llama", "z", "logprob", "noise"), ("gpt2", "z_position", "logprob", "noise")]


@pytest.mark.parametrize(("arch", "unit", "metric", "direction"), CASES)
def test_patching_equals_the_hook_reference(arch, unit, metric, direction):
    tok, lm, eager = models(arch)
    examples = pair_examples(tok)  # three lengths: one left-padded chunk
    L, H = lm.geometry.n_layers, lm.geometry.n_heads
    ctx = StepContext(model=lm, examples=examples, results={}, seed=0)
    config = ActivationPatching(unit=unit, metric=metric, direction=direction, batch_size=5, pair_batch_size=3)
    ds = detect(config, ctx)
    clean, corrupt, patched = reference(eager["eager"], arch, tok, examples, L, H, unit, metric, direction)
    np.testing.assert_allclose(ds["clean"].values, clean, atol=1e-5, rtol=0)
    np.testing.assert_allclose(ds["corrupt"].values, corrupt, atol=1e-5, rtol=0)
    assert np.array_equal(np.isnan(ds["patched"].values), np.isnan(patched))
    np.testing.assert_allclose(ds["patched"].values, patched, atol=1e-5, rtol=0)
    np.testing.assert_allclose(ds["score"].values, _score(clean, corrupt, patched), atol=1e-4, rtol=1e-4)
    assert np.nanmax(np.abs(ds["patched"].values - corrupt if direction == "denoise" else
                            ds["patched"].values - clean)) > 1e-2  # some patch changes the metric
    want_dims = ("layer", "head") if unit == "z" else ("layer", "head", "token")
    assert ds["score"].dims == want_dims and ds["patched"].dims == (*want_dims, "example")
    assert ds.attrs["convention"].startswith("(mean patched - mean corrupt)")
    assert ds.attrs["direction"] == direction and ds.attrs["metric"] == metric


def test_chunks_of_pairs_and_rows_do_not_change_the_result():
    tok, lm, _ = models("qwen2")
    ctx = StepContext(model=lm, examples=pair_examples(tok), results={}, seed=0)
    one = detect(ActivationPatching(batch_size=64, pair_batch_size=8), ctx)
    many = detect(ActivationPatching(batch_size=3, pair_batch_size=1), ctx)  # unpadded chunks of one pair
    np.testing.assert_allclose(many["patched"].values, one["patched"].values, atol=1e-5, rtol=0)
    per_layer = lm.geometry.n_heads * len(ctx.examples)  # a layer's rows: every head of every pair
    assert per_layer < 64 and one.attrs["rows_per_forward"] == per_layer and many.attrs["rows_per_forward"] == 3


def test_auto_batch_size_fills_a_quarter_of_the_memory_budget_with_rows(monkeypatch):
    tok, lm, _ = models("llama")
    ctx = StepContext(model=lm, examples=pair_examples(tok), results={}, seed=0)
    fixed = detect(ActivationPatching(batch_size=64), ctx)
    cfg = lm.model.config
    T = max(len(tok(ex.prompt)["input_ids"]) for ex in ctx.examples)  # the chunk's padded length
    g = lm.geometry
    width = torch.finfo(lm.model.dtype).bits // 8
    row = T * (4 * cfg.hidden_size + (g.n_heads + 2 * g.n_kv_heads) * g.head_dim + 3 * cfg.intermediate_size
               + g.n_layers * 2 * g.n_kv_heads * g.head_dim) * width + 2 * cfg.vocab_size * 4
    for rows in (1, 5):
        monkeypatch.setenv("HEADLAB_MEMORY_LIMIT", str(4 * rows * row + 3))
        auto = detect(ActivationPatching(batch_size="auto"), ctx)
        assert auto.attrs["rows_per_forward"] == rows and auto.attrs["batch_size"] == "auto"
        np.testing.assert_allclose(auto["patched"].values, fixed["patched"].values, atol=1e-5, rtol=0)
    monkeypatch.setenv("HEADLAB_MEMORY_LIMIT", "none")  # no limit: every row of a layer in one forward
    auto = detect(ActivationPatching(batch_size="auto"), ctx)
    assert auto.attrs["rows_per_forward"] == g.n_heads * len(ctx.examples) > 5


@pytest.mark.parametrize("arch", ARCHS)
def test_patching_every_head_with_clean_values_reproduces_the_clean_metric(arch):
    tok, lm, _ = models(arch)
    examples = pair_examples(tok)
    answer = [ex.meta["answer_id"] for ex in examples]
    wrong = [ex.meta["wrong_id"] for ex in examples]
    runs = pair_runs(lm, examples, answer, wrong, "logit_diff")
    n = runs.n
    plan = Plan()
    for layer in range(lm.geometry.n_layers):
        plan.patch_z([(layer, h) for h in range(lm.geometry.n_heads)], runs.z[:n, layer])
    out, _ = forward(lm, runs.ids[n:], plan, attention_mask=runs.mask[n:], logits_to_keep=1)
    got = metric_of(out.logits[:, -1], runs.answer, runs.wrong, "logit_diff")
    torch.testing.assert_close(got, runs.metric[:n], atol=1e-5, rtol=0)
    assert (runs.metric[n:] - runs.metric[:n]).abs().max() > 1e-2


def test_per_example_normalisation_is_the_mean_of_the_ratios():
    tok, lm, _ = models("llama")
    ctx = StepContext(model=lm, examples=pair_examples(tok), results={}, seed=0)
    ds = detect(ActivationPatching(normalise="per_example"), ctx)
    ratio = (ds["patched"] - ds["corrupt"]) / (ds["clean"] - ds["corrupt"])
    np.testing.assert_allclose(ds["score"].values, ratio.mean("example").values, rtol=1e-12)
    assert ds.attrs["convention"].startswith("mean over examples of")


def test_equal_clean_and_corrupt_metrics_and_non_pairs_are_refused():
    tok, lm, _ = models("llama")
    same = []
    for ex in pair_examples(tok):
        meta = {**ex.meta, "corrupt_prompt": ex.prompt}
        same.append(Example(prompt=ex.prompt, target=ex.target, choices=ex.choices, label=ex.label, meta=meta))
    ctx = StepContext(model=lm, examples=same, results={}, seed=0)
    with pytest.raises(ValueError, match=r"activation_patching: the mean metric is the same on the clean and the "
                                         r"corrupted prompts .*undefined"):
        detect(ActivationPatching(), ctx)
    with pytest.raises(ValueError, match=r"activation_patching: example 0 has the same metric"):
        detect(ActivationPatching(normalise="per_example"), ctx)
    no_corrupt = [Example(prompt=ex.prompt, meta={"answer_id": 5, "wrong_id": 6}) for ex in same]
    with pytest.raises(ValueError, match=r"example 0 has no corrupted prompt"):
        detect(ActivationPatching(), StepContext(model=lm, examples=no_corrupt, results={}, seed=0))


def _decoder_layers(model, arch: str):
    return model.transformer.h if arch == "gpt2" else model.model.layers


def resid_reference(model, arch: str, tok, examples, L: int, metric: str, direction: str) -> np.ndarray:
    """(layer, token, example) metrics of the target prompt (corrupted to denoise) with the input of one decoder
    layer at one token overwritten by the source prompt's, by a forward pre-hook on that layer."""
    T = max(len(tok(ex.prompt).input_ids) for ex in examples)
    patched = np.full((L, T, len(examples)), np.nan)
    layers = _decoder_layers(model, arch)

    def run(ids, layer=None, position=None, value=None):
        seen: dict = {}
        handles = []
        for ly in range(L):
            def pre(module, args, kwargs, ly=ly):
                hidden = args[0] if args else kwargs["hidden_states"]
                if ly == layer:
                    hidden = hidden.clone()
                    hidden[0, position] = value
                seen[ly] = hidden[0].detach()
                return ((hidden, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": hidden})
            handles.append(layers[ly].register_forward_pre_hook(pre, with_kwargs=True))
        try:
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
        finally:
            for h in handles:
                h.remove()
        return logits, seen

    for e, ex in enumerate(examples):
        a, w = ex.meta["answer_id"], ex.meta["wrong_id"]
        ids_clean, ids_corrupt = tok(ex.prompt).input_ids, tok(ex.meta["corrupt_prompt"]).input_ids
        source, target = (ids_clean, ids_corrupt) if direction == "denoise" else (ids_corrupt, ids_clean)
        _, seen = run(source)
        for layer in range(L):
            for p in range(len(target)):
                logits, _ = run(target, layer, p, seen[layer][p])
                patched[layer, p, e] = _metric(logits, a, w, metric)
    return patched


@pytest.mark.parametrize(("arch", "metric", "direction"),
                         [(arch, "logit_diff", "denoise") for arch in ARCHS] + [("qwen2", "logprob", "noise")])
def test_resid_patching_equals_the_decoder_layer_pre_hook_reference(arch, metric, direction):
    tok, lm, eager = models(arch)
    examples = pair_examples(tok)  # three lengths: one left-padded chunk
    L = lm.geometry.n_layers
    ctx = StepContext(model=lm, examples=examples, results={}, seed=0)
    ds = detect(ActivationPatching(unit="resid", metric=metric, direction=direction, batch_size=7,
                                   pair_batch_size=3), ctx)
    want = resid_reference(eager["eager"], arch, tok, examples, L, metric, direction)
    assert ds["patched"].dims == ("layer", "token", "example") and ds["score"].dims == ("layer", "token")
    assert np.array_equal(np.isnan(ds["patched"].values), np.isnan(want))
    np.testing.assert_allclose(ds["patched"].values, want, atol=1e-5, rtol=0)
    clean, corrupt = ds["clean"].values, ds["corrupt"].values
    np.testing.assert_allclose(ds["score"].values, _score(clean, corrupt, want), atol=1e-4, rtol=1e-4)
    # entering layer 0 the residual stream is the token's embedding: a token both prompts share changes nothing
    target = corrupt if direction == "denoise" else clean
    for e, ex in enumerate(examples):
        same = np.array(tok(ex.prompt).input_ids) == np.array(tok(ex.meta["corrupt_prompt"]).input_ids)
        np.testing.assert_allclose(ds["patched"].values[0, :len(same), e][same], target[e], atol=1e-5)
        assert np.abs(ds["patched"].values[0, :len(same), e][~same] - target[e]).max() > 1e-3


@pytest.mark.parametrize(("arch", "unit", "direction"), [("llama", "z", "denoise"), ("llama", "z_position", "noise"),
                                                         ("llama", "kv", "denoise"), ("gpt2", "z", "noise"),
                                                         ("gpt2", "kv", "noise"), ("llama", "resid", "denoise")])
def test_patched_forwards_started_at_the_patched_layer_equal_the_whole_model(arch, unit, direction):
    """``resume``: each patched forward runs the layers from the patched one over the positions from the first
    one the pair's prompts differ at; the metrics equal those of forwards of the whole model."""
    tok, lm, _ = models(arch)
    examples = pair_examples(tok)
    ctx = StepContext(model=lm, examples=examples, results={}, seed=0)
    geo = lm.geometry
    L, n = geo.n_layers, len(examples)
    queries, results = {}, {}
    for resume in (True, False):
        seen, handles = _attention_queries(lm)
        try:
            results[resume] = detect(ActivationPatching(unit=unit, direction=direction, resume=resume, batch_size=64,
                                                        pair_batch_size=n), ctx)
        finally:
            for h in handles:
                h.remove()
        queries[resume] = seen
    fast, full = results[True], results[False]
    np.testing.assert_allclose(fast["patched"].values, full["patched"].values, atol=1e-5, rtol=0)
    np.testing.assert_allclose(fast["score"].values, full["score"].values, atol=1e-4, rtol=1e-4)
    assert (fast.attrs["start"], fast.attrs["prefix"]) == ("patched_layer", "target_cache")
    assert (full.attrs["start"], full.attrs["prefix"]) == ("embeddings", "recomputed")
    if unit in ("z_position", "resid"):
        assert all(queries[True][ly] < queries[False][ly] for ly in range(L))
        return
    # one forward per layer (batch_size covers a layer's rows): the shared prefix of the chunk is not run
    runs = pair_runs(lm, examples, [0] * n, [1] * n, "logit_diff")
    T = runs.ids.shape[1]
    shared = min(int((runs.ids[e] != runs.ids[n + e]).nonzero()[0, 0]) for e in range(n))
    per_layer = n * (geo.n_heads if unit == "z" else geo.n_kv_heads)
    assert 0 < shared < T
    for ly in range(L):
        assert queries[False][ly] == 2 * n * T + L * per_layer * T
        assert queries[True][ly] == 2 * n * T + (ly + 1) * per_layer * (T - shared)


def test_a_sliding_window_model_starts_at_the_patched_layer_and_recomputes_the_prefix():
    tok, lm, _ = models("gemma2")
    ctx = StepContext(model=lm, examples=pair_examples(tok), results={}, seed=0)
    fast = detect(ActivationPatching(batch_size=64, pair_batch_size=3), ctx)
    full = detect(ActivationPatching(batch_size=64, pair_batch_size=3, resume=False), ctx)
    np.testing.assert_allclose(fast["patched"].values, full["patched"].values, atol=1e-5, rtol=0)
    assert (fast.attrs["start"], fast.attrs["prefix"]) == ("patched_layer", "recomputed")
