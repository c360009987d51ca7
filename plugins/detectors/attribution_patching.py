"""Attribution patching (AtP): a first-order estimate of activation patching from one backward pass.

Definition: docs/methods.md#attribution-patching. For a pair and head ``(l, h)``, with ``denoise`` (the
default) ``atp = sum over positions and head_dim of (z_clean - z_corrupt) * d metric / d z`` with the
gradient taken on the corrupted run; ``noise`` swaps the roles (``z_corrupt - z_clean``, gradient on the
clean run). ``atp`` estimates ``patched - target`` (the metric of the run patched with that head's source
value minus the unpatched run's), so the estimated patched metric is ``target + atp``, normalised like
``activation_patching`` (docs/methods.md#metrics-for-circuit-analysis): ``score`` is comparable to its score.
``unit: z_position`` keeps one term per token of the prompt (the sum over ``head_dim`` only).

Per chunk of pairs: one forward without gradients over the clean and corrupted prompts records every head's
``z`` (``Probes(z_positions="all")``); one forward of the target prompts with a leaf tensor of zeros added
to every head's ``z`` (:class:`headlab.AddZ`, ``headlab.forward(..., grad=True)``; a replacement would cut
the paths through the later layers' heads) and one backward give ``d metric / d z`` for all heads at once
(``torch.autograd.grad``: the model's parameters get no gradient).

``reference: <step id>``: an ``activation_patching`` step of the same cell (same task, unit, metric and
direction); the attrs then hold ``spearman`` (the Spearman rank correlation of the two scores over every
unit) and ``top_k_recall`` (the fraction of the reference's ``top_k`` units with the largest effect
``|score - s0|``, ``s0`` = 0 to denoise and 1 to noise, that are among AtP's ``top_k``).

Outputs: ``score (layer, head[, token])``, ``atp (layer, head[, token], example)`` (NaN at a token an
example does not have), ``clean (example)``, ``corrupt (example)``.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import torch
import xarray as xr
from pydantic import Field

from headlab import AddZ, ComponentConfig, Plan, StepContext, forward, hookimpl
from headlab.plugins.detectors.activation_patching import (
    CONVENTION,
    PER_EXAMPLE,
    Direction,
    Metric,
    Normalise,
    PairRuns,
    metric_of,
    normalised_score,
    pair_chunks,
    pair_inputs,
    pair_runs,
)
from headlab.resources import Estimate, EstimateContext
from headlab.spec import PositiveInt

__all__ = ["AttributionPatching", "attribution", "detect", "spearman", "top_k_recall"]


class AttributionPatching(ComponentConfig):
    """Attribution patching (AtP): the gradient estimate of each head's activation-patching effect."""

    kind: Literal["attribution_patching"] = "attribution_patching"
    metric: Metric = Field("logit_diff", description="logit[answer] - logit[wrong], or the answer's log-probability")
    direction: Direction = Field("denoise", description="denoise: clean z into the corrupted run; noise: the reverse")
    unit: Literal["z", "z_position"] = Field("z", description="a head's z at every position, or at one token")
    method: Literal["atp"] = Field("atp", description="the estimate: atp (first order in z)")
    normalise: Normalise = Field("means", description="the score's ratio of example means, or the mean of ratios")
    pair_batch_size: PositiveInt = Field(8, description="pairs per forward and backward")
    reference: str | None = Field(None, description="the id of an activation_patching step to compare with")
    top_k: PositiveInt = Field(10, description="the units compared by top_k_recall")

    def estimate(self, ctx: EstimateContext) -> list[Estimate]:
        """Hidden states of the forward over the clean and corrupted prompts of a chunk, kept for the backward."""
        return [ctx.activations(ctx.task.tokens, ctx.rows(2 * self.pair_batch_size))]


def attribution(lm, runs: PairRuns, metric: str, direction: str = "denoise") -> tuple[torch.Tensor, torch.Tensor]:
    """``(atp (pair, layer, head, position), target metric (pair,))`` in float64 for a chunk of pairs run by
    :func:`~headlab.plugins.detectors.activation_patching.pair_runs` (positions of the padded batch; 0 at
    padding)."""
    L, H = lm.geometry.n_layers, lm.geometry.n_heads
    source, target = ("clean", "corrupt") if direction == "denoise" else ("corrupt", "clean")
    z_target = runs.z[runs.rows(target)].detach()
    # zeros added to every head's z: the gradient on them is d metric / d z through every later layer
    leaves = [torch.zeros_like(z_target[:, layer], requires_grad=True) for layer in range(L)]
    plan = Plan().add(*(AddZ([(layer, h) for h in range(H)], leaves[layer]) for layer in range(L)))
    rows = runs.rows(target)
    out, _ = forward(lm, runs.ids[rows], plan, attention_mask=runs.mask[rows], grad=True, logits_to_keep=1)
    m = metric_of(out.logits[:, -1], runs.answer, runs.wrong, metric)
    grads = torch.autograd.grad(m.sum(), leaves)
    delta = (runs.z[runs.rows(source)] - z_target).double()
    real = runs.mask[rows].to(delta.device).bool()[:, None, :]  # (pair, 1, position)
    atp = torch.stack([torch.where(real, (delta[:, layer] * grads[layer].double()).sum(-1), 0.0)
                       for layer in range(L)], dim=1)
    return atp.detach(), m.detach()


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


def detect(config: AttributionPatching, ctx: StepContext) -> xr.Dataset:
    """The ``attribution_patching`` detector over a pair task."""
    geo = ctx.model.geometry
    L, H = geo.n_layers, geo.n_heads
    answer, wrong = pair_inputs(ctx.examples, config.kind)
    n = len(ctx.examples)
    clean, corrupt = np.zeros(n), np.zeros(n)
    per_position: list[tuple[list[int], np.ndarray, list[int]]] = []
    for idx in ctx.progress(pair_chunks(n, config.pair_batch_size), "attribution patching"):
        runs = pair_runs(ctx.model, [ctx.examples[i] for i in idx], [answer[i] for i in idx],
                         [wrong[i] for i in idx], config.metric)
        m = runs.metric.detach().cpu().numpy()
        clean[idx], corrupt[idx] = m[:len(idx)], m[len(idx):]
        atp, _ = attribution(ctx.model, runs, config.metric, config.direction)
        per_position.append((idx, atp.cpu().numpy(), runs.pad))
    coords = {"layer": np.arange(L), "head": np.arange(H)}
    if config.unit == "z":
        atp_all = np.zeros((L, H, n))
        for idx, atp, _ in per_position:
            atp_all[:, :, idx] = atp.sum(-1).transpose(1, 2, 0)
        dims: tuple[str, ...] = ("layer", "head", "example")
    else:
        n_tokens = max(a.shape[-1] - p for _, a, pads in per_position for p in pads)
        atp_all = np.full((L, H, n_tokens, n), np.nan)
        for idx, atp, pads in per_position:
            for j, (i, pad) in enumerate(zip(idx, pads, strict=True)):
                atp_all[:, :, :atp.shape[-1] - pad, i] = atp[j, :, :, pad:]
        dims = ("layer", "head", "token", "example")
        coords["token"] = np.arange(n_tokens)
    target = corrupt if config.direction == "denoise" else clean
    score = normalised_score(target + atp_all, clean, corrupt, config.normalise, config.kind)
    ds = xr.Dataset({
        "score": xr.DataArray(score, dims=dims[:-1], coords=coords),
        "atp": xr.DataArray(atp_all, dims=dims, coords=coords),
        "clean": xr.DataArray(clean, dims=("example",)),
        "corrupt": xr.DataArray(corrupt, dims=("example",)),
    })
    ds.attrs.update(method="attribution_patching", estimator=config.method, model=ctx.model.name,
                    metric=config.metric, direction=config.direction, unit=config.unit,
                    normalise=config.normalise, estimates="patched - target (target: corrupt to denoise, clean "
                    "to noise); score of target + atp",
                    convention=CONVENTION if config.normalise == "means" else PER_EXAMPLE,
                    position="last", reference="docs/methods.md#attribution-patching")
    if config.reference is not None:
        ds.attrs.update(_compare(config, ctx, score))
    return ds


@hookimpl
def headlab_register_detectors(register):
    register(AttributionPatching, detect)
