"""Direct logit attribution: each head's direct contribution to the answer-minus-wrong logit.

Definition: docs/methods.md#direct-logit-attribution. At the last position of each (clean) prompt, head
``(l, h)`` writes ``c[l,h] = z[l,h] W_O[h]`` into the residual stream; its direct contribution to
``logit_diff = logit[answer] - logit[wrong]`` is ``norm_lin(c[l,h]) · (W_U[:, answer] - W_U[:, wrong])``,
where ``norm_lin`` is the final norm's linear part with its scale frozen at the actual final residual
``x`` of the run (TransformerLens' ``apply_ln``): ``c / s(x) * g`` for RMS norms,
``(c - mean(c)) / s(x) * g`` for LayerNorm (:mod:`headlab.plugins.detectors.norms`). Where the architecture
normalises the attention output before the residual stream (gemma2, olmo2: ``post_attention_layernorm``),
``c[l,h]`` first goes through that norm the same way, its scale frozen at the layer's attention output.

``logit_diff`` is computed from the final norm's output at ``x`` and the unembedding (with its bias, before
gemma2's final soft-capping), so ``sum over heads + rest = logit_diff`` where ``rest`` holds every other
direct path: the embeddings, the MLPs, the attention output biases and the final norm's bias.

The examples need ``meta["answer_id"]`` and ``meta["wrong_id"]`` (the pair tasks ``pairs``, ``kv_swap``,
``ioi_pairs`` set them). One forward per batch records ``z`` at the last position
(``Probes(z_positions="last")``) and the final residual (a forward pre-hook on the final norm).

Outputs: ``score (layer, head)`` (mean over examples), ``dla (example, layer, head)``, ``rest (example)``,
``logit_diff (example)``.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import torch
import xarray as xr

from headlab.plugin import (
    ComponentConfig,
    Plan,
    PositiveInt,
    Probes,
    StepContext,
    forward,
    head_array,
    hookimpl,
    tokenize,
)
from headlab.plugins.detectors.norms import affine_norm
from headlab.plugins.detectors.ov_circuit import attention_output_norm
from headlab.resources import Estimate, EstimateContext

__all__ = ["DirectLogitAttribution", "answer_ids", "detect", "direct_logit_attribution"]


class DirectLogitAttribution(ComponentConfig):
    """Each head's direct contribution to logit[answer] - logit[wrong] at the last position."""

    kind: Literal["direct_logit_attribution"] = "direct_logit_attribution"
    batch_size: PositiveInt = 8

    def estimate(self, ctx: EstimateContext) -> list[Estimate]:
        """Hidden states of a batch's forward over the longest prompt (resource guard)."""
        return [ctx.activations(ctx.task.tokens, ctx.rows(self.batch_size))]


def answer_ids(examples: list, method: str) -> tuple[list[int], list[int]]:
    """The answer and wrong-answer token ids of pair-task examples (``meta["answer_id"]``,
    ``meta["wrong_id"]``); an error naming the first example without them."""
    for i, ex in enumerate(examples):
        if "answer_id" not in ex.meta or "wrong_id" not in ex.meta:
            raise ValueError(f"{method}: example {i} has no answer_id / wrong_id in its meta; use a pair task "
                             "(kind pairs, kv_swap or ioi_pairs)")
    return [int(ex.meta["answer_id"]) for ex in examples], [int(ex.meta["wrong_id"]) for ex in examples]


def direct_logit_attribution(lm, batch, answer: list[int], wrong: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dla (batch, layer, head), logit_diff (batch,))`` in float64 for one left-padded batch of prompts
    (:func:`headlab.tokenize`), ``answer`` / ``wrong`` token ids per row."""
    norm_module = lm.final_norm
    captured: list[torch.Tensor] = []
    post_inputs: dict[int, torch.Tensor] = {}
    handles = [norm_module.register_forward_pre_hook(lambda m, args: captured.append(args[0][:, -1].detach()))]
    for layer in range(lm.geometry.n_layers):
        post = attention_output_norm(lm, layer)
        if post is not None:
            handles.append(post.register_forward_pre_hook(
                lambda m, args, layer=layer: post_inputs.__setitem__(layer, args[0][:, -1].detach())))
    try:
        _, rec = forward(lm, batch, Plan(probes=Probes(z_positions="last")), logits_to_keep=1)
    finally:
        for handle in handles:
            handle.remove()
    posts = [attention_output_norm(lm, layer) for layer in post_inputs]
    with torch.no_grad(), lm.weights_loaded(norm_module, *posts):
        return _terms(lm, norm_module, captured[-1], post_inputs, rec, answer, wrong)


def _terms(lm, norm_module, x_last: torch.Tensor, post_inputs: dict[int, torch.Tensor], rec, answer: list[int],
           wrong: list[int]):
    x = x_last.double()  # (B, d_model): the final residual at the last position
    z = rec.z[:, :, :, -1].double()  # (B, L, H, D)
    W_U = lm.unembedding
    d_model = int(W_U.shape[0])
    rule = affine_norm(norm_module, d_model)
    a = torch.tensor(answer, device=W_U.device)
    w = torch.tensor(wrong, device=W_U.device)
    direction = (W_U[:, a] - W_U[:, w]).double().T  # (B, d_model)
    scale = rule.scale(x)  # (B, 1), frozen
    logit_diff = (norm_module(x_last).double() * direction).sum(-1)
    bias = lm.unembedding_bias
    if bias is not None:
        logit_diff = logit_diff + (bias[a] - bias[w]).double()
    per_layer = []
    for i, layer in enumerate(rec.layers):
        W_O = lm.head_weights(layer).W_O.double()  # (H, D, d_model)
        c = torch.einsum("bhd,hdm->bhm", z[:, i], W_O)
        if layer in post_inputs:  # gemma2 / olmo2: the attention output's own norm, its scale frozen too
            post = affine_norm(attention_output_norm(lm, layer), d_model)
            c = post.linear(c, post.scale(post_inputs[layer].double())[:, None])
        per_layer.append((rule.linear(c, scale[:, None]) * direction[:, None]).sum(-1))
    return torch.stack(per_layer, dim=1), logit_diff


def detect(config: DirectLogitAttribution, ctx: StepContext) -> xr.Dataset:
    """The ``direct_logit_attribution`` detector over a pair task's (clean) prompts."""
    geo = ctx.model.geometry
    answer, wrong = answer_ids(ctx.examples, config.kind)
    n = len(ctx.examples)
    dla = np.zeros((n, geo.n_layers, geo.n_heads))
    diff = np.zeros(n)
    chunks = [list(range(j, min(j + config.batch_size, n))) for j in range(0, n, config.batch_size)]
    for idx in ctx.progress(chunks, "direct logit attribution"):
        batch = tokenize(ctx.model, [ctx.examples[i] for i in idx])
        d, ld = direct_logit_attribution(ctx.model, batch, [answer[i] for i in idx], [wrong[i] for i in idx])
        dla[idx] = d.cpu().numpy()
        diff[idx] = ld.cpu().numpy()
    per = head_array(dla, "example")
    ds = xr.Dataset({
        "score": per.mean("example"),
        "dla": per,
        "rest": xr.DataArray(diff - dla.sum(axis=(1, 2)), dims=("example",)),
        "logit_diff": xr.DataArray(diff, dims=("example",)),
    })
    norm = "layer_norm" if isinstance(ctx.model.final_norm, torch.nn.LayerNorm) else "rms_norm"
    ds.attrs.update(method="direct_logit_attribution", model=ctx.model.name, position="last",
                    metric="logit[answer] - logit[wrong]", final_norm=norm, reference="docs/methods.md#direct-logit-attribution")
    return ds


@hookimpl
def headlab_register_detectors(register):
    register(DirectLogitAttribution, detect)
