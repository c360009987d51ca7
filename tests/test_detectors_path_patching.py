"""path_patching (docs/methods.md#path-patching) against a hand-written two-pass reference on an eager copy of
the model, one unpadded prompt at a time: pass 1 overwrites every layer's output-projection input with the
target run's head outputs (the sender's slice with the source run's) and records the receivers' query, key or
value projections; pass 2 reruns the target prompt with only those projection slices overwritten."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from headlab import StepContext
from headlab.plugins.detectors.activation_patching import ActivationPatching
from headlab.plugins.detectors.activation_patching import detect as activation_patching
from headlab.plugins.detectors.path_patching import PathPatching, Receivers, detect

from fixtures.circuits import models, pair_examples


def _attn(model, arch: str, layer: int):
    return model.transformer.h[layer].attn if arch == "gpt2" else model.model.layers[layer].self_attn


def _projection_hooks(model, arch: str, layer: int, edit):
    """Forward hooks writing ``edit(name, output)`` over the query, key and value projections of ``layer``
    (``name`` q, k or v; gpt2: the thirds of ``c_attn``)."""
    attn = _attn(model, arch, layer)
    if arch == "gpt2":
        d = attn.embed_dim

        def hook(module, args, out):
            q, k, v = out.split(d, dim=-1)
            return torch.cat([edit("q", q), edit("k", k), edit("v", v)], dim=-1)
        return [attn.c_attn.register_forward_hook(hook)]
    return [getattr(attn, f"{name}_proj").register_forward_hook(lambda m, a, out, name=name: edit(name, out))
            for name in ("q", "k", "v")]


def _o_proj(model, arch: str, layer: int):
    return _attn(model, arch, layer).c_proj if arch == "gpt2" else _attn(model, arch, layer).o_proj


def _metric(logits, a: int, w: int, metric: str) -> float:
    x = logits.double()
    return float(x[a] - x[w]) if metric == "logit_diff" else float(torch.log_softmax(x, -1)[a])


def _run(model, arch, ids, L, z_inputs=None, record=None, replace=None):
    """Last-position logits and {layer: o_proj input (T, H*D)}; ``z_inputs`` {layer: tensor} overwrites the
    o_proj inputs, ``record`` {(layer, name): None} is filled with projection outputs, ``replace`` {(layer,
    name): (slice, tensor)} overwrites a slice of them."""
    seen, handles = {}, []
    for ly in range(L):
        def pre(module, args, ly=ly):
            x = args[0] if z_inputs is None else z_inputs[ly][None]
            seen[ly] = x[0].detach()
            return (x,)
        handles.append(_o_proj(model, arch, ly).register_forward_pre_hook(pre))
        names = {name for (layer, name) in list(record or {}) + list(replace or {}) if layer == ly}
        if names:
            def edit(name, out, ly=ly):
                if record is not None and (ly, name) in record:
                    record[(ly, name)] = out.detach()
                if replace is not None and (ly, name) in replace:
                    cut, values = replace[(ly, name)]
                    out = out.clone()
                    out[..., cut] = values[..., cut]
                return out
            handles += _projection_hooks(model, arch, ly, edit)
    try:
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
    finally:
        for h in handles:
            h.remove()
    return logits, seen


def reference(model, arch, tok, examples, L, H, D, receivers, metric, direction):
    """(layer, head, example) path-patched metrics (every head a sender, one at a time)."""
    out = np.zeros((L, H, len(examples)))
    for e, ex in enumerate(examples):
        a, w = ex.meta["answer_id"], ex.meta["wrong_id"]
        clean, corrupt = tok(ex.prompt).input_ids, tok(ex.meta["corrupt_prompt"]).input_ids
        source, target = (clean, corrupt) if direction == "denoise" else (corrupt, clean)
        _, z_source = _run(model, arch, source, L)
        _, z_target = _run(model, arch, target, L)
        for layer in range(L):
            for head in range(H):
                frozen = {ly: z_target[ly].clone() for ly in range(L)}
                frozen[layer][:, head * D:(head + 1) * D] = z_source[layer][:, head * D:(head + 1) * D]
                if receivers is None:
                    logits, _ = _run(model, arch, target, L, z_inputs=frozen)
                else:
                    name = receivers.input
                    record = {(ly, name): None for ly, _ in receivers.heads}
                    _run(model, arch, target, L, z_inputs=frozen, record=record)
                    replace = {}
                    for ly, h in receivers.heads:  # several receivers of one layer share a projection
                        cut = torch.zeros(record[(ly, name)].shape[-1], dtype=torch.bool)
                        if (ly, name) in replace:
                            cut = replace[(ly, name)][0]
                        cut[h * D:(h + 1) * D] = True
                        replace[(ly, name)] = (cut, record[(ly, name)])
                    logits, _ = _run(model, arch, target, L, replace=replace)
                out[layer, head, e] = _metric(logits, a, w, metric)
    return out


RECEIVERS = [None, Receivers(heads=[(1, 0), (1, 3)], input="q"), Receivers(heads=[(1, 1)], input="k"),
             Receivers(heads=[(1, 0)], input="v")]
CASES = [(arch, r, "logit_diff", "denoise") for arch in ("llama", "gpt2") for r in RECEIVERS]
CASES += [("qwen2", RECEIVERS[1], "logprob", "noise"), ("llama", None, "logprob", "noise")]


@pytest.mark.parametrize(("arch", "receivers", "metric", "direction"), CASES)
def test_path_patching_equals_the_two_pass_hook_reference(arch, receivers, metric, direction):
    tok, lm, eager = models(arch)
    examples = pair_examples(tok)  # one left-padded chunk of three lengths
    geo = lm.geometry
    L, H, D = geo.n_layers, geo.n_heads, geo.head_dim
    config = PathPatching(receivers="logits" if receivers is None else receivers, metric=metric,
                          direction=direction, batch_size=5, pair_batch_size=3)
    ds = detect(config, StepContext(model=lm, examples=examples, results={}, seed=0))
    want = reference(eager["eager"], arch, tok, examples, L, H, D, receivers, metric, direction)
    np.testing.assert_allclose(ds["patched"].values, want, atol=1e-5, rtol=0)
    target = ds["corrupt"].values if direction == "denoise" else ds["clean"].values
    assert np.abs(ds["patched"].values - target).max() > 1e-2  # some path carries an effect
    if receivers is not None:  # a sender in the receivers' layer or above has no path to them
        np.testing.assert_allclose(ds["patched"].values[1], np.broadcast_to(target, (H, len(examples))), atol=1e-5)
    mean = lambda x: x.mean(-1)  # noqa: E731
    score = (mean(want) - mean(ds["corrupt"].values)) / (mean(ds["clean"].values) - mean(ds["corrupt"].values))
    np.testing.assert_allclose(ds["score"].values, score, rtol=1e-4, atol=1e-4)
    assert ds.attrs["mlps"] == "recomputed"


def test_paths_to_the_logits_from_the_last_layer_are_activation_patching():
    """A last-layer head has only its direct path (through the last MLP, recomputed in both methods)."""
    tok, lm, _ = models("llama")
    ctx = StepContext(model=lm, examples=pair_examples(tok), results={}, seed=0)
    paths = detect(PathPatching(), ctx)
    exact = activation_patching(ActivationPatching(), ctx)
    L = lm.geometry.n_layers
    np.testing.assert_allclose(paths["patched"].values[L - 1], exact["patched"].values[L - 1], atol=1e-5)
    assert np.abs(paths["patched"].values[0] - exact["patched"].values[0]).max() > 1e-3  # layer 0: not only direct


def test_senders_and_receivers_are_checked():
    tok, lm, _ = models("llama")
    ctx = StepContext(model=lm, examples=pair_examples(tok), results={}, seed=0)
    some = detect(PathPatching(senders=[(0, 1), (1, 2)]), ctx)
    assert np.isnan(some["score"].values).sum() == 6 and not np.isnan(some["score"].values[0, 1])
    full = detect(PathPatching(), ctx)
    np.testing.assert_allclose(some["patched"].values[1, 2], full["patched"].values[1, 2], atol=1e-6)
    with pytest.raises(ValueError, match=r"path_patching: sender \[2, 0\] is not a head of this model \(2 layers "
                                         r"x 4 heads\)"):
        detect(PathPatching(senders=[(2, 0)]), ctx)
    with pytest.raises(ValueError, match=r"receiver \[1, 2\] is not one of this model's key/value heads \(2 "
                                         r"layers x 2; input k\)"):
        detect(PathPatching(receivers={"heads": [(1, 2)], "input": "k"}), ctx)
