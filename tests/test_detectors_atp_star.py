"""attribution_patching with ``method: atp_star`` (docs/methods.md#atp-the-qk-fix-and-graddrop) against references
written here on an eager copy of the model, one unpadded prompt at a time:

- the QK fix: an attention function of the test's own records each layer's queries, keys and values and
  computes the attention probabilities ``A`` itself; ``d metric / d A`` comes from autograd on them, and the
  patched probabilities from a softmax by hand with the source run's queries (or keys, or one key);
- GradDrop: a hand loop of one backward per layer, the layer's write detached by a forward hook
  (``input + (output - input).detach()``), each head's output made differentiable by a zero leaf added to the
  output projection's input, combined as ``sign(AtP) * sum_l |AtP_l| / (L - 1)``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from headlab import StepContext
from headlab.plugins.detectors.attribution_patching import AttributionPatching, detect, grad_drop

from fixtures.circuits import ARCHS, config, models, pair_examples, randomise_norms
from fixtures.detectors import build_models, word_tokenizer

CAPTURE = "headlab_test_capture"


def _register_capture(store: dict):
    """An attention implementation that records (query, key, value, probabilities) per layer in ``store`` and
    computes a causal softmax attention over one unpadded prompt by hand."""
    from transformers import AttentionInterface

    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        H, K = query.shape[1], key.shape[1]
        k = key.repeat_interleave(H // K, dim=1)
        v = value.repeat_interleave(H // K, dim=1)
        T = query.shape[2]
        causal = torch.full((T, T), float("-inf"), dtype=query.dtype).triu(1)
        probs = torch.softmax(query @ k.transpose(-1, -2) * scaling + causal, dim=-1)
        store[module.layer_idx] = (query, key, value, probs, scaling)
        return (probs @ v).transpose(1, 2).contiguous(), probs

    AttentionInterface.register(CAPTURE, attention)


def _metric(logits, a: int, w: int, metric: str):
    x = logits.double()
    return x[a] - x[w] if metric == "logit_diff" else torch.log_softmax(x, -1)[a]


def _softmax(logits):
    return torch.softmax(logits, dim=-1)


def qk_reference(model, tok, examples, L: int, H: int, K: int, metric: str, direction: str, drop=None,
                 layers=None):
    """{query, key}: (L, H | K, E) and per token (L, H | K, T, E) QK-fix estimates ``sum (A' - A) dm/dA``;
    ``drop``: ``dm/dA`` with that decoder layer's write detached (``layers``: the decoder layers)."""
    store: dict = {}
    _register_capture(store)
    model.set_attn_implementation(CAPTURE)
    T_max = max(len(tok(ex.prompt).input_ids) for ex in examples)
    E = len(examples)
    out = {"query": np.zeros((L, H, E)), "key": np.zeros((L, K, E)),
           "query_token": np.full((L, H, T_max, E), np.nan), "key_token": np.full((L, K, T_max, E), np.nan)}
    group = H // K
    for e, ex in enumerate(examples):
        a, w = ex.meta["answer_id"], ex.meta["wrong_id"]
        clean, corrupt = tok(ex.prompt).input_ids, tok(ex.meta["corrupt_prompt"]).input_ids
        source, target = (clean, corrupt) if direction == "denoise" else (corrupt, clean)
        with torch.no_grad():
            model(input_ids=torch.tensor([source]))
        src = {ly: tuple(t.detach() for t in store[ly][:2]) for ly in range(L)}
        handles = []
        if drop is not None:
            def post(module, args, kwargs, out):
                inp = args[0] if args else kwargs["hidden_states"]
                return inp + (out - inp).detach()
            handles.append(layers[drop].register_forward_hook(post, with_kwargs=True))
        try:
            m = _metric(model(input_ids=torch.tensor([target])).logits[0, -1], a, w, metric)
        finally:
            for handle in handles:
                handle.remove()
        tgt = {ly: store[ly] for ly in range(L)}
        grads = torch.autograd.grad(m, [tgt[ly][3] for ly in range(L)], allow_unused=True)
        grads = [torch.zeros_like(tgt[ly][3]) if g is None else g for ly, g in enumerate(grads)]
        T = len(target)
        causal = torch.full((T, T), float("-inf")).triu(1)
        for ly in range(L):
            q_t, k_t, _, probs, scale = tgt[ly]
            q_s, k_s = src[ly]
            q_t, k_t, probs = q_t[0].detach(), k_t[0].detach(), probs[0].detach()
            q_s, k_s, G = q_s[0], k_s[0], grads[ly][0]
            for h in range(H):
                j = h // group
                dq = _softmax(q_s[h] @ k_t[j].T * scale + causal) - probs[h]
                out["query"][ly, h, e] = float((dq * G[h]).sum())
                out["query_token"][ly, h, :T, e] = (dq * G[h]).sum(-1).numpy()
                dk = _softmax(q_t[h] @ k_s[j].T * scale + causal) - probs[h]
                out["key"][ly, j, e] += float((dk * G[h]).sum())
                logits = q_t[h] @ k_t[j].T * scale + causal
                for s in range(T):
                    one = logits.clone()
                    one[s:, s] = q_t[h, s:] @ k_s[j, s] * scale  # only the queries that see key s
                    total = float(((_softmax(one) - probs[h]) * G[h]).sum())
                    prev = out["key_token"][ly, j, s, e]
                    out["key_token"][ly, j, s, e] = total if np.isnan(prev) else prev + total
    return out


@pytest.mark.parametrize(("arch", "metric", "direction"),
                         [(arch, "logit_diff", "denoise") for arch in ARCHS] + [("llama", "logprob", "noise")])
def test_qk_fix_equals_the_exact_attention_probability_change(arch, metric, direction):
    tok, lm, eager = models(arch)
    lm.model.double()
    ref_model = eager["eager"].double()
    examples = pair_examples(tok)  # one left-padded chunk of three lengths
    geo = lm.geometry
    ctx = StepContext(model=lm, examples=examples, results={}, seed=0)
    common = dict(method="atp_star", grad_drop=False, metric=metric, direction=direction, batch_size=7)
    ds = detect(AttributionPatching(**common), ctx)
    per_token = detect(AttributionPatching(unit="z_position", **common), ctx)
    want = qk_reference(ref_model, tok, examples, geo.n_layers, geo.n_heads, geo.n_kv_heads, metric, direction)
    for name, got in (("query", ds["query"]), ("key", ds["key"]),
                      ("query_token", per_token["query"]), ("key_token", per_token["key"])):
        ref = want[name]
        scale = np.nanmax(np.abs(ref))
        assert scale > 1e-3, name
        assert np.array_equal(np.isnan(got.values), np.isnan(ref)), name
        np.testing.assert_allclose(got.values, ref, rtol=1e-4, atol=1e-5 * scale, err_msg=name)
    assert ds["key"].dims == ("layer", "kv_head", "example") and ds["query"].dims == ("layer", "head", "example")
    assert per_token["key"].dims == ("layer", "kv_head", "token", "example")
    # without GradDrop the z estimate is plain AtP, and the scores normalise target + estimate
    plain = detect(AttributionPatching(metric=metric, direction=direction), ctx)
    np.testing.assert_allclose(ds["atp"].values, plain["atp"].values, rtol=1e-12)
    target = ds["corrupt"] if direction == "denoise" else ds["clean"]
    for name in ("query", "key"):
        score = ((target + ds[name]).mean("example") - ds["corrupt"].mean()) / (ds["clean"].mean()
                                                                             - ds["corrupt"].mean())
        np.testing.assert_allclose(ds[f"{name}_score"].values, score.values, rtol=1e-12)
    # the exact probabilities differ from the linear estimate (d metric / d query . delta query): a saturated
    # softmax is where AtP fails, so the fix must not be a rewrite of it
    assert np.abs(ds["query"].values - ds["atp"].values).max() > 1e-3


def _three_layers(arch: str):
    tok = word_tokenizer()
    cfg = config(arch, len(tok))
    cfg["n_layer" if arch == "gpt2" else "num_hidden_layers"] = 3
    lm, out = build_models(cfg, seed=1, tokenizer=tok)
    randomise_norms(out, 1)
    return tok, lm, out


def _decoder_layers(model, arch: str):
    return model.transformer.h if arch == "gpt2" else model.model.layers


def _o_proj(model, arch: str, layer: int):
    return model.transformer.h[layer].attn.c_proj if arch == "gpt2" else model.model.layers[layer].self_attn.o_proj


def _run(model, arch, ids, L, H, drop=None, grad=False):
    """(metric function input logits, {layer: o_proj input (T, H, D)}, {layer: zero leaf}) of one prompt,
    decoder layer ``drop``'s write detached."""
    seen, leaves, handles = {}, {}, []
    for ly in range(L):
        def pre(module, args, ly=ly):
            x = args[0]
            seen[ly] = x[0].detach().view(x.shape[1], H, -1)
            if grad:
                leaves[ly] = torch.zeros_like(x, requires_grad=True)
                x = x + leaves[ly]
            return (x,)
        handles.append(_o_proj(model, arch, ly).register_forward_pre_hook(pre))
    if drop is not None:
        def post(module, args, kwargs, out):
            inp = args[0] if args else kwargs["hidden_states"]
            return inp + (out - inp).detach()
        handles.append(_decoder_layers(model, arch)[drop].register_forward_hook(post, with_kwargs=True))
    try:
        with torch.set_grad_enabled(grad):
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
    finally:
        for h in handles:
            h.remove()
    return logits, seen, leaves


def graddrop_reference(model, arch, tok, examples, L: int, H: int, metric: str):
    """(L, H, E) and (L, H, T, E) GradDrop estimates from a hand loop over the dropped layers (denoise)."""
    T_max = max(len(tok(ex.prompt).input_ids) for ex in examples)
    whole, per_token = np.zeros((L, H, len(examples))), np.full((L, H, T_max, len(examples)), np.nan)
    for e, ex in enumerate(examples):
        a, w = ex.meta["answer_id"], ex.meta["wrong_id"]
        clean, corrupt = tok(ex.prompt).input_ids, tok(ex.meta["corrupt_prompt"]).input_ids
        _, z_clean, _ = _run(model, arch, clean, L, H)
        estimates = []
        for drop in [None, *range(L)]:
            logits, z_corrupt, leaves = _run(model, arch, corrupt, L, H, drop=drop, grad=True)
            grads = torch.autograd.grad(_metric(logits, a, w, metric), [leaves[ly] for ly in range(L)],
                                        allow_unused=True)  # nothing inside the dropped layer is used
            grads = [torch.zeros_like(leaves[ly]) if g is None else g for ly, g in enumerate(grads)]
            terms = torch.stack([((z_clean[ly] - z_corrupt[ly]).double()
                                  * grads[ly][0].view(len(corrupt), H, -1).double()).sum(-1).T
                                 for ly in range(L)])  # (L, H, T)
            estimates.append(terms)
        plain, dropped = estimates[0], torch.stack(estimates[1:])
        node = torch.sign(plain.sum(-1)) * dropped.sum(-1).abs().sum(0) / (L - 1)
        whole[:, :, e] = node.numpy()
        per_token[:, :, :len(corrupt), e] = (torch.sign(plain) * dropped.abs().sum(0) / (L - 1)).numpy()
    return whole, per_token


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_graddrop_equals_a_hand_loop_over_the_dropped_layers(arch):
    tok, lm, eager = _three_layers(arch)
    lm.model.double()
    examples = pair_examples(tok)
    L, H = lm.geometry.n_layers, lm.geometry.n_heads
    ctx = StepContext(model=lm, examples=examples, results={}, seed=0)
    ds = detect(AttributionPatching(method="atp_star", qk_fix=False), ctx)
    per_token = detect(AttributionPatching(method="atp_star", qk_fix=False, unit="z_position"), ctx)
    whole, tokens = graddrop_reference(eager["eager"].double(), arch, tok, examples, L, H, "logit_diff")
    scale = np.abs(whole).max()
    assert scale > 1e-2
    # the RMS norms compute in float32 even in a float64 model
    np.testing.assert_allclose(ds["atp"].values, whole, rtol=1e-5, atol=1e-6 * scale)
    assert np.array_equal(np.isnan(per_token["atp"].values), np.isnan(tokens))
    np.testing.assert_allclose(per_token["atp"].values, tokens, rtol=1e-5, atol=1e-6 * scale)
    assert "query" not in ds and ds.attrs["grad_drop"] == 1 and ds.attrs["qk_fix"] == 0
    # GradDrop differs from plain AtP below the last layer (the heads of the last layer have only their
    # direct path: there it is AtP itself)
    plain = detect(AttributionPatching(), ctx)["atp"].values
    np.testing.assert_allclose(ds["atp"].values[L - 1], plain[L - 1], rtol=1e-9)
    assert np.abs(ds["atp"].values[:L - 1] - plain[:L - 1]).max() > 1e-3


def test_graddrop_combination_and_its_errors():
    plain = torch.tensor([2.0, -1.0, 0.5])
    dropped = torch.tensor([[1.0, 3.0, -2.0], [-3.0, 1.0, 0.0], [0.0, -2.0, 1.0]])  # L = 3
    torch.testing.assert_close(grad_drop(plain, dropped), torch.tensor([2.0, -3.0, 1.5]))
    tok = word_tokenizer()
    cfg = config("llama", len(tok))
    cfg["num_hidden_layers"] = 1
    lm, _ = build_models(cfg, tokenizer=tok)
    ctx = StepContext(model=lm, examples=pair_examples(tok), results={}, seed=0)
    with pytest.raises(ValueError, match=r"attribution_patching: GradDrop divides by the number of layers minus "
                                         r"one; this model has 1 layer \(set grad_drop: false\)"):
        detect(AttributionPatching(method="atp_star"), ctx)
    ds = detect(AttributionPatching(method="atp_star", grad_drop=False), ctx)
    assert set(ds.data_vars) >= {"score", "atp", "query", "query_score", "key", "key_score"}


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_qk_fix_under_graddrop_combines_the_exact_estimates_of_every_dropped_gradient(arch):
    tok, lm, eager = _three_layers(arch)
    lm.model.double()
    ref_model = eager["eager"].double()
    examples = pair_examples(tok)
    geo = lm.geometry
    L, H, K = geo.n_layers, geo.n_heads, geo.n_kv_heads
    ctx = StepContext(model=lm, examples=examples, results={}, seed=0)
    ds = detect(AttributionPatching(method="atp_star"), ctx)
    per_token = detect(AttributionPatching(method="atp_star", unit="z_position"), ctx)
    layers = _decoder_layers(ref_model, arch)
    variants = [qk_reference(ref_model, tok, examples, L, H, K, "logit_diff", "denoise", drop, layers)
                for drop in [None, *range(L)]]
    for name, got in (("query", ds["query"]), ("key", ds["key"]),
                      ("query_token", per_token["query"]), ("key_token", per_token["key"])):
        plain = variants[0][name]
        dropped = np.stack([v[name] for v in variants[1:]])
        want = np.sign(plain) * np.abs(dropped).sum(0) / (L - 1)
        scale = np.nanmax(np.abs(want))
        assert scale > 1e-3, name
        np.testing.assert_allclose(got.values, want, rtol=1e-4, atol=1e-5 * scale, err_msg=name)
        assert np.nanmax(np.abs(want - plain)) > 1e-4, name  # the dropped gradients change the estimate
