"""Attribution patching (AtP): a first-order estimate of activation patching from one backward pass.

Definition: docs/methods.md#attribution-patching. For a pair and head ``(l, h)``, with ``denoise`` (the
default) ``atp = sum over positions and head_dim of (z_clean - z_corrupt) * d metric / d z`` with the
gradient taken on the corrupted run; ``noise`` swaps the roles (``z_corrupt - z_clean``, gradient on the
clean run). ``atp`` estimates ``patched - target`` (the metric of the run patched with that head's source
value minus the unpatched run's), so the estimated patched metric is ``target + atp``, normalised like
``activation_patching`` (docs/methods.md#metrics-for-circuit-analysis): ``score`` is comparable to its score.
``unit: z_position`` keeps one term per token of the prompt (the sum over ``head_dim`` only). ``unit: kv``: per
``(layer, kv_head)``, ``sum over positions and head_dim of (k_source - k_target) . d metric / d k + (v_source -
v_target) . d metric / d v``, the keys as attention reads them (after the rotary embedding and any key norm),
the coordinate ``serves (kv_head, head)`` marking the query heads each one serves. ``unit: resid``: per
``(layer, token)``, ``(resid_source - resid_target) . d metric / d resid`` over ``d_model``, the residual stream
entering the decoder layer (layer 0: the embedding output). The units, dims and coordinates are
``activation_patching``'s.

Per chunk of pairs (``method: atp``): one forward without gradients over the source prompts records every
head's ``z`` (the input of each layer's attention output projection); one forward of the target prompts with
every head's ``z`` there kept in the autograd graph (``headlab.forward(..., grad=True)``; a replacement would cut
the paths through the later layers' heads) records the target's ``z`` and its metric, and one backward gives
``d metric / d z`` for all heads at once (``torch.autograd.grad`` with respect to those tensors only: no
parameter gets a gradient, none is computed). Both forwards run the last layer's output projection and MLP at
the last position only, and with ``logit_diff`` the output layer's rows of the answer and wrong tokens only.
The residual stream's gradient is taken the same way at each decoder layer's input (``resid``). A layer's keys
and values reach the metric only through that layer's head outputs, so their gradient (``kv``) is ``d metric /
d z`` pulled back through the layer's attention alone (:func:`_kv_pull_back`): one more forward of the target
prompts, every layer's keys and values replaced by leaves of their own values (:class:`headlab.ReplaceKV`; read
from the target forward's KV cache, or recorded by probes on the torch path where the cache drops positions)
and the layers above a layer's ``z`` reading a detached copy of it, stopped at the last layer's output
projection, and one backward through the attention only (one per GradDrop variant).
The shared prefix (the positions before the first one where some pair of the chunk differs, left padding
included) is run once, without gradients, into a KV cache that both forwards read, and they and the backward
cover the positions after it (with ``kv`` the pull-back forward too): there the source and target ``z``, keys,
values and residual stream are the same (each term is 0), and a later position does not change an earlier one,
so the estimates are those of runs over the whole prompts. Under three forwards' time per chunk (``kv``:
four). Where the model's KV cache is not made of plain growing layers (a sliding window) the whole prompts are
run; ``attrs["prefix"]`` (``shared_cache`` / ``recomputed``) and ``attrs["prefix_runs"]``
(the runs that skip it: ``source, target, gradients``; with ``atp_star`` ``gradients``, the gradient pass of
the plain and the GradDrop gradients, while the forwards recording both prompts' ``z``, keys and values and
the QK fix's forwards run the whole prompts; ``none``) say which path ran.

``reference: <step id>``: an ``activation_patching`` step of the same cell (same task, unit, metric and
direction); without it, the latest earlier ``activation_patching`` step of the cell with the same unit,
metric, direction, normalisation and score shape, when there is one (``attrs["reference_chosen"]``: ``spec``
or ``auto``; no attrs when there is none). The attrs then hold ``spearman`` (the Spearman rank correlation of the two scores over every
unit) and ``top_k_recall`` (the fraction of the reference's ``top_k`` units with the largest effect
``|score - s0|``, ``s0`` = 0 to denoise and 1 to noise, that are among AtP's ``top_k``).

``method: atp_star`` (docs/methods.md#atp-the-qk-fix-and-graddrop; Kramár et al. 2024) adds the paper's
two changes, each with its switch:

- ``grad_drop`` (GradDrop): the gradient is taken ``L`` more times, the ``l``-th time with the gradient through
  decoder layer ``l``'s write to the residual stream dropped (:class:`headlab.DropResidGrad`; one forward and
  one backward over ``L + 1`` copies of the target prompts); each unit's estimate is
  ``sign(AtP) * sum over l of |estimate with layer l dropped| / (L - 1)`` (the paper's estimate is the
  unsigned ``sum / (L - 1)``, its absolute value);
- ``qk_fix`` (the QK fix): the head's queries (``query``, per ``(layer, head)``) and the key/value head's keys
  (``key``, per ``(layer, kv_head)``) patched from the source run, with the attention probabilities computed
  exactly and only their downstream effect linearised: ``sum over queries t and keys s of (A'[t,s] - A[t,s]) *
  d metric / d A[t,s]``, which is ``sum over t of (z'[t] - z[t]) . d metric / d z[t]`` with ``z' = A' V``
  the head output under the patched probabilities (``d metric / d A[t,s] = d metric / d z[t] . v[s]``).
  ``z'`` comes from forwards with the keys and values of one layer replaced (:class:`headlab.ReplaceKV`):
  the source prompt with the target's keys and values (patched queries), the target prompt with the
  source's keys (patched keys; ``unit: z_position``: at one key position per row). Under GradDrop the same
  combination applies.

``unit: kv`` takes ``atp_star`` with GradDrop alone (``qk_fix: false``: the QK fix is defined for the query and
key patches of a head's output); ``unit: resid`` takes ``atp`` only (the residual stream entering a layer is
no node inside one layer, which GradDrop's ``L - 1`` assumes): the spec is refused otherwise.

Outputs: ``score (layer, head[, token])`` (``(layer, kv_head)`` for ``kv``, ``(layer, token)`` for
``resid``), ``atp (..., example)`` (NaN at a token an example does not have), ``clean (example)``,
``corrupt (example)``; with the QK fix also ``query`` / ``query_score`` ``(layer, head[, token][,
example])`` and ``key`` / ``key_score`` ``(layer, kv_head[, token][, example])``, normalised like ``score``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
import xarray as xr
from pydantic import Field, model_validator
from transformers import DynamicCache

from headlab import DropResidGrad, ReplaceKV, positions_from_mask
from headlab.plugin import (
    ComponentConfig,
    Example,
    LoadedModel,
    Plan,
    PositiveInt,
    Probes,
    StepContext,
    forward,
    hookimpl,
)
from headlab.plugins.detectors import activation_patching
from headlab.plugins.detectors.activation_patching import (
    CONVENTION,
    PER_EXAMPLE,
    Direction,
    Metric,
    Normalise,
    PairRuns,
    metric_of,
    normalised_score,
    pair_batch,
    pair_chunks,
    pair_inputs,
    pair_runs,
    prefix_reusable,
)
from headlab.plugins.detectors.head_gradients import by_head, head_outputs, out_projections
from headlab.resources import Estimate, EstimateContext

__all__ = ["AttributionPatching", "SharedPrefix", "attribution", "attribution_runs", "detect", "grad_drop",
           "key_patched_z", "query_patched_z", "run_prefix", "shared_prefix_length", "spearman", "target_gradients",
           "top_k_recall", "unit_activations"]


class AttributionPatching(ComponentConfig):
    """Attribution patching (AtP): the gradient estimate of each head's activation-patching effect."""

    kind: Literal["attribution_patching"] = "attribution_patching"
    metric: Metric = Field("logit_diff", description="logit[answer] - logit[wrong], or the answer's log-probability")
    direction: Direction = Field("denoise", description="denoise: clean z into the corrupted run; noise: the reverse")
    unit: Literal["z", "z_position", "kv", "resid"] = Field(
        "z", description="a head's z at every position, at one token, a key/value head's keys and values, or the "
        "residual stream entering a layer at one token")
    method: Literal["atp", "atp_star"] = Field(
        "atp", description="the estimate: atp (first order in z) or atp_star (Kramár et al. 2024: QK fix, GradDrop)")
    qk_fix: bool = Field(True, description="atp_star: estimate query and key patches with exact attention "
                         "probabilities (outputs query, key)")
    grad_drop: bool = Field(True, description="atp_star: combine L gradients, each with one layer's residual "
                            "write dropped")
    batch_size: PositiveInt = Field(32, description="atp_star, unit z_position: rows per forward of the "
                                    "per-token key patches")
    normalise: Normalise = Field("means", description="the score's ratio of example means, or the mean of ratios")
    pair_batch_size: PositiveInt = Field(8, description="pairs per forward and backward")
    reference: str | None = Field(None, description="the id of an activation_patching step to compare with "
                                  "(unset: the latest earlier one of the same unit, metric and direction, if any)")
    top_k: PositiveInt = Field(10, description="the units compared by top_k_recall")

    def estimate(self, ctx: EstimateContext) -> list[Estimate]:
        """Hidden states of the forward over the clean and corrupted prompts of a chunk, kept for the backward
        (under GradDrop: of the ``L + 1`` copies of the target prompts)."""
        rows = ctx.rows(2 * self.pair_batch_size)
        if self.method == "atp_star" and self.grad_drop:
            rows = max(rows, (ctx.geometry.n_layers + 1) * ctx.rows(self.pair_batch_size))
        out = [ctx.activations(ctx.task.tokens, rows)]
        pairs = ctx.rows(2 * self.pair_batch_size)
        if self.unit == "kv":
            out.append(ctx.kv_cache(ctx.task.tokens, pairs, "keys and values of every layer (unit kv)"))
        if self.unit == "resid":
            out.append(ctx.activations(ctx.task.tokens * ctx.geometry.n_layers, pairs,
                                       "residual stream of every layer (unit resid)"))
        return out

    @model_validator(mode="after")
    def _star_units(self) -> AttributionPatching:
        if self.method == "atp_star" and self.unit == "resid":
            raise ValueError("method atp_star is not defined for unit resid (the QK fix patches a head's queries and "
                             "keys; GradDrop's sum over L - 1 dropped layers needs a node inside one layer, and the "
                             "residual stream entering a layer is between layers): use method: atp")
        if self.method == "atp_star" and self.unit == "kv" and self.qk_fix:
            raise ValueError("unit kv with method atp_star needs qk_fix: false (the QK fix is defined for the query "
                             "and key patches of a head's output z; GradDrop applies to key/value heads)")
        return self


@dataclass
class SharedPrefix:
    """The positions ``0..length-1`` (of the padded batch) where every pair of a chunk has the same tokens in its
    clean and corrupted prompts, run once: ``kv`` each decoder layer's keys and values there (rows, kv_head,
    length, head_dim), ``z`` the heads' outputs there (rows, layer, head, length, head_dim), ``resid`` the
    residual stream entering each decoder layer there (rows, layer, length, d_model) when recorded, one row per
    pair."""

    length: int
    kv: list[tuple[torch.Tensor, torch.Tensor]]
    z: torch.Tensor
    resid: torch.Tensor | None = None

    def cache(self, lm, copies: int = 1):
        """A fresh KV cache holding the prefix's keys and values (``copies`` copy-major copies of the rows), for
        one forward over the positions after it."""
        model = lm.model if isinstance(lm, LoadedModel) else lm
        cache = DynamicCache(config=model.config)
        for layer, (k, v) in enumerate(self.kv):
            cache.update(k.repeat(copies, 1, 1, 1), v.repeat(copies, 1, 1, 1), layer)
        return cache


def shared_prefix_length(ids: torch.Tensor, n: int) -> int:
    """The number of positions before the first one where some pair's prompts differ (``ids`` (2n, T): the
    prompts patched from and into, pair ``e`` in rows ``e`` and ``n + e``; left padding is the same in both
    prompts of a pair), at most ``T - 1`` (the last position, where the metric is read, is never shared)."""
    differ = (ids[:n] != ids[n:]).any(0).nonzero()
    T = int(ids.shape[1])
    return min(int(differ[0, 0]) if differ.numel() else T, T - 1)


class _PrefixDone(Exception):
    """Raised by :func:`run_prefix`'s hook once the last layer's keys and values are in the cache."""


def run_prefix(lm, ids: torch.Tensor, mask: torch.Tensor, length: int, resid: bool = False) -> SharedPrefix:
    """One forward without gradients over the first ``length`` positions of ``ids`` (rows, T), recording the
    keys and values of every layer and the heads' outputs there (and the residual stream entering every layer
    with ``resid``); it stops at the last layer's output projection (nothing reads the residual stream after
    it, nor the logits)."""
    model = lm.model if isinstance(lm, LoadedModel) else lm
    cache = DynamicCache(config=model.config)

    def stop(module, args):
        raise _PrefixDone

    with head_outputs(lm) as (zs, _), _layer_inputs(lm, record=resid) as inputs:
        handle = out_projections(lm)[-1].register_forward_pre_hook(stop)  # after head_outputs' recording hook
        try:
            forward(lm, ids[:, :length], attention_mask=mask[:, :length], cache=cache, use_cache=True,
                    logits_to_keep=1)
        except _PrefixDone:
            pass
        finally:
            handle.remove()
    kv = [(layer.keys, layer.values) for layer in cache.layers]
    return SharedPrefix(length, kv, by_head(lm, torch.stack(zs, dim=1)),
                        torch.stack(inputs, dim=1) if resid else None)


@contextlib.contextmanager
def _layer_inputs(lm, record: bool = True, grad: bool = False) -> Iterator[list[torch.Tensor]]:
    """Inside the block, the residual stream entering each decoder layer (rows, position, d_model) of one
    forward, in layer order (nothing without ``record``): detached, or with ``grad`` the tensors the layers
    read, in the autograd graph (the first layer's input a leaf of the same values where it does not require
    grad), whose gradients are ``d output / d resid``."""
    inputs: list[torch.Tensor] = []

    def pre(module, args, kwargs):
        x = args[0] if args else kwargs["hidden_states"]
        if not grad:
            inputs.append(x.detach())
            return None
        if x.requires_grad:
            inputs.append(x)
            return None
        x = x.detach().requires_grad_()
        inputs.append(x)
        return ((x, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": x})

    handles = [layer.register_forward_pre_hook(pre, with_kwargs=True) for layer in lm.decoder_layers] if record else []
    try:
        yield inputs
    finally:
        for h in handles:
            h.remove()


def _keep_kv(lm, kwargs: dict, plan: Plan) -> None:
    """Make the forward of ``kwargs`` and ``plan`` keep every layer's keys and values as attention reads them
    for :func:`_kept_kv`: in its KV cache (a fresh one where it has none and the cache keeps every position),
    else recorded by the plan's probes on the torch path (differentiable, like the native one)."""
    if "cache" in kwargs:
        return
    if activation_patching.prefix_reusable(lm):  # the module's own: tests stub this module's name
        model = lm.model if isinstance(lm, LoadedModel) else lm
        kwargs.update(cache=DynamicCache(config=model.config), use_cache=True)
    else:
        plan.probes = Probes(kv_positions="all")
        plan.backend = "torch"


def _kept_kv(kwargs: dict, rec, n: int) -> torch.Tensor:
    """(row, layer, kv_head, position, 2 head_dim) the keys then the values along the last axis, kept by
    :func:`_keep_kv` in a forward of ``kwargs`` (``rec`` its recording), for its first ``n`` rows, detached."""
    if "cache" in kwargs:
        k = torch.stack([layer.keys[:n] for layer in kwargs["cache"].layers], dim=1)
        v = torch.stack([layer.values[:n] for layer in kwargs["cache"].layers], dim=1)
    else:
        k, v = rec.k[:n], rec.v[:n]
    return torch.cat([k, v], dim=-1).detach()


@contextlib.contextmanager
def _answer_head(lm, answer: torch.Tensor, wrong: torch.Tensor,
                 metric: str) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Inside the block, ``(answer, wrong)`` as indices into the logits of the model's forwards: for
    ``logit_diff`` with a linear output layer, that layer is replaced by its rows of the answer and wrong tokens
    (the logits the metric reads, and the model's own processing of them after the layer), restored after
    the block; otherwise the token ids themselves and the model unchanged."""
    model = lm.model if isinstance(lm, LoadedModel) else lm
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if metric != "logit_diff" or type(head) is not torch.nn.Linear or getattr(model, "lm_head", None) is not head:
        yield answer, wrong
        return
    tokens, index = torch.unique(torch.cat([answer, wrong]), return_inverse=True)
    rows = torch.nn.Linear(head.in_features, len(tokens), bias=head.bias is not None, device=head.weight.device,
                           dtype=head.weight.dtype)
    with torch.no_grad():
        rows.weight.copy_(head.weight[tokens.to(head.weight.device)])
        if head.bias is not None:
            rows.bias.copy_(head.bias[tokens.to(head.bias.device)])
    rows.requires_grad_(False)
    n = answer.shape[0]
    model.set_output_embeddings(rows)
    try:
        yield index[:n], index[n:]
    finally:
        model.set_output_embeddings(head)


def _suffix_kwargs(lm, mask: torch.Tensor, prefix: SharedPrefix | None, copies: int = 1) -> dict:
    """The forward keywords of a run over the positions after ``prefix`` (none without one): its KV cache and
    the suffix's position ids (``mask`` the full batch's attention mask, as the forward takes it)."""
    if prefix is None:
        return {}
    positions = positions_from_mask(mask)[:, prefix.length:]
    return {"cache": prefix.cache(lm, copies), "use_cache": True,
            "position_ids": positions.repeat(copies, 1) if copies > 1 else positions}


def _with_prefix(prefix: SharedPrefix | None, x: torch.Tensor, fill: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` (..., head, suffix positions, head_dim) with the prefix's positions in front: ``fill`` there
    (broadcast to ``x``'s leading dimensions), zeros when it is None."""
    if prefix is None:
        return x
    shape = (*x.shape[:-2], prefix.length, x.shape[-1])
    front = x.new_zeros(shape) if fill is None else fill.expand(shape)
    return torch.cat([front, x], dim=-2)


def _target_pass(lm, ids: torch.Tensor, mask: torch.Tensor, answer: torch.Tensor, wrong: torch.Tensor, metric: str,
                 drops: Sequence[int | None], last_only: bool = False, prefix: SharedPrefix | None = None,
                 unit: str = "z") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(gradients (variant, row, layer, unit, position, width), metric (row,), z (row, layer, head, position,
    head_dim), activations (row, layer, unit, position, width))`` of the prompts ``ids`` (:func:`unit_activations`'
    layout: ``z`` itself for the head units, the keys then the values per key/value head for ``kv``, one unit
    of the residual stream entering the layer for ``resid``): one forward over a copy of them per entry of
    ``drops`` and one backward (see :func:`target_gradients`); ``z``, the activations and the metric are the
    first copy's. ``last_only``: see
    :func:`~headlab.plugins.detectors.head_gradients.head_outputs`. ``prefix``: the forward runs the positions
    after it only, the prefix's keys and values
    from its cache; the gradient there is not computed (zeros), the activations there are the prefix's.
    ``kv``: the keys' and values' gradients are pulled back from the heads' by :func:`_kv_pull_back`."""
    n, k = ids.shape[0], len(drops)
    s = 0 if prefix is None else prefix.length
    plan = Plan()
    for c, layer in enumerate(drops):
        if layer is not None:
            plan.add(DropResidGrad(layer, rows=range(c * n, (c + 1) * n)))
    kwargs = _suffix_kwargs(lm, mask, prefix, k)
    if unit == "kv":
        _keep_kv(lm, kwargs, plan)
    with _answer_head(lm, answer, wrong, metric) as (a, w), \
            head_outputs(lm, grad=unit != "resid", last_only=last_only) as (zs, leaves), \
            _layer_inputs(lm, record=unit == "resid", grad=True) as inputs:
        out, rec = forward(lm, ids[:, s:], plan, copies=k, attention_mask=mask, grad=True, logits_to_keep=1,
                           **kwargs)
        device = out.logits.device
        m = metric_of(out.logits[:, -1], a.to(device).repeat(k), w.to(device).repeat(k), metric)
    wrt = inputs if unit == "resid" else leaves
    grads = torch.autograd.grad(m.sum(), wrt, allow_unused=True)
    g = torch.stack([torch.zeros_like(x) if d is None else d for x, d in zip(wrt, grads, strict=True)], dim=1)
    z = _with_prefix(prefix, by_head(lm, torch.stack([z[:n] for z in zs], dim=1)),
                     None if prefix is None else prefix.z)
    if unit == "resid":
        g = _with_prefix(prefix, g[:, :, None])
        acts = torch.stack([x[:n].detach() for x in inputs], dim=1)[:, :, None]
        acts = _with_prefix(prefix, acts, None if prefix is None else prefix.resid[:, :, None])
        return g.view(k, n, *g.shape[1:]), m[:n].detach(), z, acts
    g = _with_prefix(prefix, by_head(lm, g))
    g = g.view(k, n, *g.shape[1:])
    if unit == "kv":
        kv = _kept_kv(kwargs, rec, n)
        return _kv_pull_back(lm, ids, mask, kv, g, prefix), m[:n].detach(), z, kv
    return g, m[:n].detach(), z, z


def _kv_pull_back(lm, ids: torch.Tensor, mask: torch.Tensor, kv: torch.Tensor, g_z: torch.Tensor,
                  prefix: SharedPrefix | None = None) -> torch.Tensor:
    """(variant, row, layer, kv_head, position, 2 head_dim) ``d metric / d`` keys then values of the prompts
    ``ids`` whose keys and values are ``kv`` (row, layer, kv_head, position, 2 head_dim), from ``d metric / d z``
    ``g_z`` (variant, row, layer, head, position, head_dim), both total derivatives. A layer's keys and values
    reach the metric only through that layer's head outputs, so theirs is ``g_z`` pulled back through the
    layer's attention alone: one forward with every layer's keys and values replaced by leaves of their own
    values (:class:`headlab.ReplaceKV`) and each layer's ``z`` kept in the graph while the layers above it read
    a detached copy (the graph from a layer's ``z`` holds its own attention only), stopped at the last layer's
    output projection, then one backward per variant through the attention only. ``prefix``: the forward runs
    the positions after it (the gradient of the prefix's keys and values is not computed: zeros)."""
    L, K = lm.geometry.n_layers, lm.geometry.n_kv_heads
    s = 0 if prefix is None else prefix.length
    T, D = int(ids.shape[1]), kv.shape[-1] // 2
    leaves = [kv[:, layer, :, s:].detach().clone().requires_grad_() for layer in range(L)]
    plan = Plan().add(*[ReplaceKV([(layer, j) for j in range(K)], leaf[..., :D], leaf[..., D:],
                                  positions=range(s, T)) for layer, leaf in enumerate(leaves)])
    projections = out_projections(lm)
    zs: list[torch.Tensor] = []

    def pre(module, args):
        zs.append(args[0])
        if module is projections[-1]:
            raise _PrefixDone
        return (args[0].detach(), *args[1:])

    handles = [p.register_forward_pre_hook(pre) for p in projections]
    try:
        forward(lm, ids[:, s:], plan, attention_mask=mask, grad=True, logits_to_keep=1,
                **_suffix_kwargs(lm, mask, prefix))
    except _PrefixDone:
        pass
    finally:
        for h in handles:
            h.remove()
    variants = []
    for c in range(g_z.shape[0]):
        cotangents = [g_z[c, :, layer, :, s:].transpose(1, 2).flatten(-2).to(z.dtype) for layer, z in enumerate(zs)]
        grads = torch.autograd.grad(zs, leaves, grad_outputs=cotangents, retain_graph=c < g_z.shape[0] - 1,
                                    allow_unused=True)
        variants.append(torch.stack([torch.zeros_like(x) if d is None else d
                                     for x, d in zip(leaves, grads, strict=True)], dim=1))
    return _with_prefix(prefix, torch.stack(variants))


def unit_activations(runs: PairRuns, unit: str) -> torch.Tensor:
    """(2n, layer, unit, position, width) the activations a unit patches, for :func:`_terms`: ``z`` (head,
    head_dim) for ``z`` / ``z_position``; the keys then the values (kv_head, 2 head_dim) for ``kv``; the
    residual stream entering the layer (1, d_model) for ``resid``."""
    if unit == "kv":
        return torch.cat([runs.k, runs.v], dim=-1)
    if unit == "resid":
        return runs.resid[:, :, None]
    return runs.z


def target_gradients(lm, runs: PairRuns, metric: str, direction: str = "denoise",
                     drops: Sequence[int | None] = (None,), prefix: bool = False,
                     unit: str = "z") -> tuple[torch.Tensor, torch.Tensor]:
    """``(d metric / d z (variant, pair, layer, head, position, head_dim), target metric (pair,))`` on the target
    run of a chunk of pairs, one variant per entry of ``drops``: ``None`` the plain gradient, a layer index the
    gradient with that layer's residual write dropped (:class:`headlab.DropResidGrad`); every variant is a
    copy of the target rows in one forward and one backward. ``unit``: the gradients with respect to what
    it patches, in :func:`unit_activations`' layout (``kv``: the keys, after the rotary embedding, then the
    values, pulled back from ``d metric / d z`` by :func:`_kv_pull_back`; ``resid``: the residual stream
    entering each layer). ``prefix``: the positions before the first one where some pair's prompts differ
    (:func:`shared_prefix_length`) are run once without gradients into a KV cache and the forward and
    backward cover the positions after them; the gradient there is then 0 (the source and target activations
    are equal there, so every estimate's term is 0 either way; the gradients at the other positions are the
    same: a causal model's later positions do not change earlier ones)."""
    target = "corrupt" if direction == "denoise" else "clean"
    rows = runs.rows(target)
    ids, mask = runs.ids[rows], runs.mask[rows]
    length = shared_prefix_length(runs.ids, runs.n) if prefix else 0
    shared = run_prefix(lm, ids, mask, length, resid=unit == "resid") if length else None
    grads, m, _, _ = _target_pass(lm, ids, mask, runs.answer, runs.wrong, metric, drops, prefix=shared, unit=unit)
    return grads, m


def attribution_runs(lm, examples: list[Example], answer: list[int], wrong: list[int], metric: str,
                     direction: str = "denoise", prefix: bool = False,
                     unit: str = "z") -> tuple[PairRuns, torch.Tensor]:
    """``(runs, d metric / d z (1, pair, layer, head, position, head_dim))`` of a chunk of pairs (pair-task
    examples): the :class:`~headlab.plugins.detectors.activation_patching.PairRuns` of
    :func:`~headlab.plugins.detectors.activation_patching.pair_runs` (``z`` and the metric of both prompts; no
    keys, values or residual stream) and :func:`target_gradients`' plain gradient, from one forward without
    gradients over the source prompts and one forward and one backward over the target prompts (the same
    numbers as ``pair_runs`` then ``target_gradients``, in about two thirds of their time). ``unit``: the
    gradients with respect to what it patches (:func:`target_gradients`), and the runs hold the keys and values
    (``kv``) or the residual stream entering every layer (``resid``) of both prompts. ``prefix``: the
    positions before the first one where some pair's prompts differ are run once, without gradients, into a
    KV cache that both runs read (they cover the positions after it only); there the activations are that
    run's in both prompts (they are the same) and the gradient is 0 (as :func:`target_gradients` with
    ``prefix``)."""
    batch = pair_batch(lm, examples)
    n = len(examples)
    clean, corrupt = slice(0, n), slice(n, 2 * n)
    source, target = (clean, corrupt) if direction == "denoise" else (corrupt, clean)
    ids, mask = batch.input_ids, batch.attention_mask
    length = shared_prefix_length(ids, n) if prefix else 0
    shared = run_prefix(lm, ids[target], mask[target], length, resid=unit == "resid") if length else None
    a = torch.tensor(answer, device=ids.device)
    w = torch.tensor(wrong, device=ids.device)
    plan, kwargs = None, _suffix_kwargs(lm, mask[source], shared)
    if unit == "kv":
        plan = Plan()
        _keep_kv(lm, kwargs, plan)
    with _answer_head(lm, a, w, metric) as (a_index, w_index), head_outputs(lm, last_only=True) as (zs, _), \
            _layer_inputs(lm, record=unit == "resid") as inputs:
        out, rec = forward(lm, ids[source, length:], plan, attention_mask=mask[source], logits_to_keep=1, **kwargs)
    device = out.logits.device
    a, w = a.to(device), w.to(device)
    m_source = metric_of(out.logits[:, -1], a_index.to(device), w_index.to(device), metric)
    grads, m_target, z_target, acts = _target_pass(lm, ids[target], mask[target], a, w, metric, (None,),
                                                   last_only=True, prefix=shared, unit=unit)
    z_source = _with_prefix(shared, by_head(lm, torch.stack(zs, dim=1)), None if shared is None else shared.z)

    def both(src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        return torch.cat([src, tgt] if direction == "denoise" else [tgt, src])

    k = v = resid = None
    if unit == "kv":
        k, v = both(_kept_kv(kwargs, rec, n), acts).chunk(2, dim=-1)
    elif unit == "resid":
        resid_source = _with_prefix(shared, torch.stack(inputs, dim=1)[:, :, None],
                                    None if shared is None else shared.resid[:, :, None])
        resid = both(resid_source, acts)[:, :, 0]
    pair = [z_source, z_target] if direction == "denoise" else [z_target, z_source]
    # one (rows, layer, position, head * head_dim) block, viewed per head like its parts
    z = by_head(lm, torch.cat([t.transpose(2, 3).flatten(-2) for t in pair]))
    m = both(m_source, m_target)
    return PairRuns(ids, mask, z, m, a, w, [int(p) for p in batch.pad[:n]], k, v, resid), grads


def _terms(runs: PairRuns, direction: str, patched: torch.Tensor, grads: torch.Tensor,
           unit: str = "z") -> torch.Tensor:
    """(variant, pair, layer, unit, position) float64 ``(patched - target) . grad`` (0 at padding) for
    ``patched`` (pair, layer, unit, position, width) activations in :func:`unit_activations`' layout (head
    outputs by default) and ``grads`` from :func:`target_gradients`."""
    target = "corrupt" if direction == "denoise" else "clean"
    rows = runs.rows(target)
    delta = (patched - unit_activations(runs, unit)[rows]).double()
    real = runs.mask[rows].to(delta.device).bool()[:, None, None, :]  # (pair, 1, 1, position)
    return torch.where(real, (delta[None] * grads.double()).sum(-1), 0.0)


def attribution(lm, runs: PairRuns, metric: str, direction: str = "denoise") -> tuple[torch.Tensor, torch.Tensor]:
    """``(atp (pair, layer, head, position), target metric (pair,))`` in float64 for a chunk of pairs run by
    :func:`~headlab.plugins.detectors.activation_patching.pair_runs` (positions of the padded batch; 0 at
    padding)."""
    source = "clean" if direction == "denoise" else "corrupt"
    grads, m = target_gradients(lm, runs, metric, direction)
    return _terms(runs, direction, runs.z[runs.rows(source)], grads)[0], m


def grad_drop(plain: torch.Tensor, dropped: torch.Tensor) -> torch.Tensor:
    """GradDrop's estimate from the plain estimate (...) and the ``L`` estimates with one layer's residual write
    dropped (L, ...): ``sign(plain) * sum over l of |dropped[l]| / (L - 1)``."""
    L = dropped.shape[0]
    return torch.sign(plain) * dropped.abs().sum(0) / (L - 1)


def _layer_z(lm, ids: torch.Tensor, mask: torch.Tensor, layer: int, edits: list) -> torch.Tensor:
    """(rows, head, position, head_dim) head outputs of ``layer`` in a forward of ``ids`` under ``edits``."""
    plan = Plan(probes=Probes(z_positions="all", layers=[layer])).add(*edits)
    _, rec = forward(lm, ids, plan, attention_mask=mask, logits_to_keep=1)
    return rec.z[:, 0]


def query_patched_z(lm, runs: PairRuns, direction: str = "denoise") -> torch.Tensor:
    """(pair, layer, head, position, head_dim): each head's output with its queries from the source run and its
    keys and values from the target run (the source prompt with one layer's keys and values replaced by the
    target's; the queries of a layer depend only on the layers below). ``runs`` must hold the keys and
    values."""
    source, target = ("clean", "corrupt") if direction == "denoise" else ("corrupt", "clean")
    L, K = lm.geometry.n_layers, lm.geometry.n_kv_heads
    k_t, v_t = runs.k[runs.rows(target)], runs.v[runs.rows(target)]
    rows = runs.rows(source)
    return torch.stack([_layer_z(lm, runs.ids[rows], runs.mask[rows], layer,
                                 [ReplaceKV([(layer, j) for j in range(K)], k_t[:, layer], v_t[:, layer])])
                        for layer in range(L)], dim=1)


def key_patched_z(lm, runs: PairRuns, direction: str = "denoise") -> torch.Tensor:
    """(pair, layer, head, position, head_dim): each head's output on the target run with its key/value head's
    keys at every position from the source run (values and queries the target's)."""
    source, target = ("clean", "corrupt") if direction == "denoise" else ("corrupt", "clean")
    L, K = lm.geometry.n_layers, lm.geometry.n_kv_heads
    k_s = runs.k[runs.rows(source)]
    rows = runs.rows(target)
    return torch.stack([_layer_z(lm, runs.ids[rows], runs.mask[rows], layer,
                                 [ReplaceKV([(layer, j) for j in range(K)], k_s[:, layer], None)])
                        for layer in range(L)], dim=1)


def _key_terms_per_token(lm, runs: PairRuns, direction: str, grads: torch.Tensor, batch_size: int) -> torch.Tensor:
    """(variant, pair, layer, kv_head, position) float64: the QK-fix estimate of patching one key position of a
    key/value head (summed over the query heads it serves and every query); 0 before the first position where
    the pair's prompts differ (the keys are the same there) and at padding."""
    source, target = ("clean", "corrupt") if direction == "denoise" else ("corrupt", "clean")
    L, H, K = lm.geometry.n_layers, lm.geometry.n_heads, lm.geometry.n_kv_heads
    k_s = runs.k[runs.rows(source)]
    z_t = runs.z[runs.rows(target)]
    ids, mask = runs.ids[runs.rows(target)], runs.mask[runs.rows(target)]
    n, T = runs.n, ids.shape[1]
    out = torch.zeros(grads.shape[0], n, L, K, T, dtype=torch.float64)
    group = torch.arange(H) // (H // K)
    jobs = []
    for e in range(n):
        differ = (runs.ids[e] != runs.ids[n + e]).nonzero()
        first = int(differ[0, 0]) if differ.numel() else T
        jobs += [(e, s) for s in range(max(first, runs.pad[e]), T)]
    for layer in range(L):
        for start in range(0, len(jobs), batch_size):
            chunk = jobs[start:start + batch_size]
            edits = [ReplaceKV([(layer, j) for j in range(K)], k_s[e, layer, :, s:s + 1][None], None, rows=[r],
                               positions=[s]) for r, (e, s) in enumerate(chunk)]
            which = torch.tensor([e for e, _ in chunk])
            z = _layer_z(lm, ids[which.to(ids.device)], mask[which.to(mask.device)], layer, edits)
            delta = (z - z_t[which.to(z_t.device), layer]).double()  # (rows, H, T, D)
            real = mask[which.to(mask.device)].to(delta.device).bool()[:, None, :, None]
            per_head = (torch.where(real, delta, 0.0)[None] * grads[:, which.to(grads.device), layer].double()
                        ).sum((-1, -2)).cpu()  # (variant, rows, H)
            per_kv = torch.zeros(per_head.shape[0], len(chunk), K, dtype=torch.float64).index_add_(2, group, per_head)
            for r, (e, s) in enumerate(chunk):
                out[:, e, layer, :, s] = per_kv[:, r]
    return out


def _ranks(x: np.ndarray) -> np.ndarray:
    """Ranks from 0, ties sharing their mean rank."""
    order = np.argsort(x, kind="mergesort")
    ranks = np.empty(len(x))
    ranks[order] = np.arange(len(x))
    _, inverse, counts = np.unique(x, return_inverse=True, return_counts=True)
    return (np.bincount(inverse, weights=ranks) / counts)[inverse]


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    """The Spearman rank correlation of two arrays over the entries finite in both (NaN when constant)."""
    a, b = np.ravel(a), np.ravel(b)
    keep = np.isfinite(a) & np.isfinite(b)
    ra, rb = _ranks(a[keep]), _ranks(b[keep])
    ra, rb = ra - ra.mean(), rb - rb.mean()
    denom = float(np.sqrt((ra ** 2).sum() * (rb ** 2).sum()))
    return float((ra * rb).sum() / denom) if denom > 0 else float("nan")


def top_k_recall(reference: np.ndarray, estimate: np.ndarray, k: int) -> float:
    """The fraction of ``reference``'s ``k`` largest entries that are among ``estimate``'s ``k`` largest (both
    flattened, NaN last; ``k`` at most the number of entries)."""
    ref, est = np.ravel(reference), np.ravel(estimate)
    k = min(int(k), ref.size)
    top_ref = set(np.argsort(-np.nan_to_num(ref, nan=-np.inf), kind="mergesort")[:k].tolist())
    top_est = set(np.argsort(-np.nan_to_num(est, nan=-np.inf), kind="mergesort")[:k].tolist())
    return len(top_ref & top_est) / k


def _compare(config: AttributionPatching, ctx: StepContext, score: np.ndarray) -> dict:
    """The attrs comparing ``score`` with the reference step's (module docstring)."""
    where = f"{config.kind}: reference {config.reference!r}"
    ref = ctx.results.get(config.reference)
    if ref is None:
        raise ValueError(f"{where} is not an earlier step of this cell (earlier steps: "
                         f"{', '.join(ctx.results) or 'none'})")
    if ref.attrs.get("method") != "activation_patching":
        raise ValueError(f"{where} is a {ref.attrs.get('method', 'step')!r} result, not activation_patching")
    for key in ("unit", "metric", "direction"):
        if ref.attrs.get(key) != getattr(config, key):
            raise ValueError(f"{where} has {key} {ref.attrs.get(key)!r}, this step {getattr(config, key)!r}")
    ref_score = ref["score"].values
    if ref_score.shape != score.shape:  # a z_position reference over other prompt lengths
        raise ValueError(f"{where}: score of shape {ref_score.shape}, this step's {score.shape} (another task?)")
    s0 = 0.0 if config.direction == "denoise" else 1.0
    return {"reference_step": config.reference, "spearman": spearman(ref_score, score), "top_k": config.top_k,
            "top_k_recall": top_k_recall(np.abs(ref_score - s0), np.abs(score - s0), config.top_k)}


def _chunk_estimates(config: AttributionPatching, lm, runs: PairRuns, grads: torch.Tensor | None = None,
                     prefix: bool = False) -> dict[str, torch.Tensor]:
    """The per-pair estimates of a chunk as (pair, layer, head | kv_head, position) float64 (every position of
    the padded batch; ``unit: z`` sums them over positions before GradDrop's absolute values, so these are
    combined per unit by :func:`_combine`): ``atp`` always, ``query`` and ``key`` with the QK fix; each with
    a leading variant axis (plain gradient, then one per dropped layer). ``grads``: the gradients when computed
    already (:func:`attribution_runs`); ``prefix``: the gradients are taken over the positions after the shared
    prefix (:func:`target_gradients`)."""
    L, H, K = lm.geometry.n_layers, lm.geometry.n_heads, lm.geometry.n_kv_heads
    star = config.method == "atp_star"
    drops: list[int | None] = [None] + (list(range(L)) if star and config.grad_drop else [])
    if grads is None:
        grads, _ = target_gradients(lm, runs, config.metric, config.direction, drops, prefix=prefix, unit=config.unit)
    source = "clean" if config.direction == "denoise" else "corrupt"
    out = {"atp": _terms(runs, config.direction, unit_activations(runs, config.unit)[runs.rows(source)], grads,
                         config.unit)}
    if star and config.qk_fix:
        out["query"] = _terms(runs, config.direction, query_patched_z(lm, runs, config.direction), grads)
        if config.unit == "z":
            per_head = _terms(runs, config.direction, key_patched_z(lm, runs, config.direction), grads)
            group = (torch.arange(H) // (H // K)).to(per_head.device)
            out["key"] = torch.zeros(*per_head.shape[:2], L, K, per_head.shape[-1], dtype=torch.float64,
                                     device=per_head.device).index_add_(3, group, per_head)
        else:
            out["key"] = _key_terms_per_token(lm, runs, config.direction, grads, config.batch_size)
    return out


def _combine(config: AttributionPatching, terms: torch.Tensor) -> torch.Tensor:
    """One estimate per unit (pair, layer[, head | kv_head][, position]) from the per-position terms (variant,
    pair, layer, unit, position) of every gradient variant: summed over positions for ``unit: z`` and ``kv``,
    then GradDrop's combination when it ran (``resid``: the layer's one unit axis dropped)."""
    node = terms.sum(-1) if config.unit in ("z", "kv") else terms
    node = node[:, :, :, 0] if config.unit == "resid" else node
    if node.shape[0] == 1:
        return node[0]
    return grad_drop(node[0], node[1:])


def _unit_array(config: AttributionPatching, chunks: list[tuple[list[int], np.ndarray, list[int]]],
                n: int) -> np.ndarray:
    """(layer[, unit][, token], example) from the chunks' (pair, layer[, unit][, position]) estimates, tokens
    counted from each prompt's first one (NaN at a token an example does not have)."""
    if config.unit in ("z", "kv"):
        full = np.zeros((*chunks[0][1].shape[1:], n))
        for idx, est, _ in chunks:
            full[..., idx] = np.moveaxis(est, 0, -1)
        return full
    n_tokens = max(a.shape[-1] - p for _, a, pads in chunks for p in pads)
    full = np.full((*chunks[0][1].shape[1:-1], n_tokens, n), np.nan)
    for idx, est, pads in chunks:
        for j, (i, pad) in enumerate(zip(idx, pads, strict=True)):
            full[..., :est.shape[-1] - pad, i] = est[j, ..., pad:]
    return full


def detect(config: AttributionPatching, ctx: StepContext) -> xr.Dataset:
    """The ``attribution_patching`` detector over a pair task."""
    geo = ctx.model.geometry
    L, H, K = geo.n_layers, geo.n_heads, geo.n_kv_heads
    star = config.method == "atp_star"
    if star and config.grad_drop and L < 2:
        raise ValueError(f"{config.kind}: GradDrop divides by the number of layers minus one; this model has "
                         f"{L} layer (set grad_drop: false)")
    answer, wrong = pair_inputs(ctx.examples, config.kind)
    n = len(ctx.examples)
    clean, corrupt = np.zeros(n), np.zeros(n)
    chunks: dict[str, list] = {}
    prefix = prefix_reusable(ctx.model)
    for idx in ctx.progress(pair_chunks(n, config.pair_batch_size), "attribution patching"):
        args = ([ctx.examples[i] for i in idx], [answer[i] for i in idx], [wrong[i] for i in idx], config.metric)
        if star:
            runs, grads = pair_runs(ctx.model, *args, kv=config.qk_fix or config.unit == "kv"), None
        else:
            runs, grads = attribution_runs(ctx.model, *args, direction=config.direction, prefix=prefix,
                                           unit=config.unit)
        m = runs.metric.detach().cpu().numpy()
        clean[idx], corrupt[idx] = m[:len(idx)], m[len(idx):]
        for name, terms in _chunk_estimates(config, ctx.model, runs, grads, prefix=prefix).items():
            chunks.setdefault(name, []).append((idx, _combine(config, terms).cpu().numpy(), runs.pad))
    coords: dict = {"layer": np.arange(L)} if config.unit == "resid" else {"layer": np.arange(L), "head": np.arange(H)}
    token = ("token",) if config.unit in ("z_position", "resid") else ()
    target = corrupt if config.direction == "denoise" else clean
    data: dict = {}
    atp_dims = {"z": ("head",), "z_position": ("head",), "kv": ("kv_head",), "resid": ()}[config.unit]
    for name, unit_dims in (("atp", atp_dims), ("query", ("head",)), ("key", ("kv_head",))):
        if name not in chunks:
            continue
        est = _unit_array(config, chunks[name], n)
        dims = ("layer", *unit_dims, *token, "example")
        data["score" if name == "atp" else f"{name}_score"] = xr.DataArray(
            normalised_score(target + est, clean, corrupt, config.normalise, config.kind), dims=dims[:-1])
        data[name] = xr.DataArray(est, dims=dims)
        if token:
            coords["token"] = np.arange(est.shape[-2])
    if "key" in chunks or config.unit == "kv":
        coords["kv_head"] = np.arange(K)
        coords["serves"] = (("kv_head", "head"), np.arange(H)[None, :] // (H // K) == np.arange(K)[:, None])
    data["clean"] = xr.DataArray(clean, dims=("example",))
    data["corrupt"] = xr.DataArray(corrupt, dims=("example",))
    ds = xr.Dataset(data).assign_coords(coords)
    ds.attrs.update(method="attribution_patching", estimator=config.method, model=ctx.model.name,
                    metric=config.metric, direction=config.direction, unit=config.unit,
                    normalise=config.normalise, estimates="patched - target (target: corrupt to denoise, clean "
                    "to noise); score of target + atp",
                    convention=CONVENTION if config.normalise == "means" else PER_EXAMPLE,
                    position="last", reference="docs/methods.md#attribution-patching",
                    prefix="shared_cache" if prefix else "recomputed",
                    prefix_runs=("gradients" if star else "source, target, gradients") if prefix else "none")
    if star:
        ds.attrs.update(qk_fix=int(config.qk_fix), grad_drop=int(config.grad_drop),
                        reference="docs/methods.md#atp-the-qk-fix-and-graddrop")
    reference = config.reference if config.reference is not None else _latest_reference(config, ctx, ds["score"].shape)
    if reference is not None:
        ds.attrs.update(_compare(config.model_copy(update={"reference": reference}), ctx, ds["score"].values),
                        reference_chosen="spec" if config.reference is not None else "auto")
    return ds


def _latest_reference(config: AttributionPatching, ctx: StepContext, shape: tuple[int, ...]) -> str | None:
    """The id of the latest earlier step of the cell that :func:`_compare` accepts as ``config``'s reference
    and that normalises its score the same way, or ``None``."""
    for step, ds in reversed(list(ctx.results.items())):
        if (ds.attrs.get("method") == "activation_patching" and "score" in ds
                and all(ds.attrs.get(key) == getattr(config, key) for key in ("unit", "metric", "direction", "normalise"))
                and ds["score"].shape == shape):
            return step
    return None


@hookimpl
def headlab_register_detectors(register):
    register(AttributionPatching, detect)
