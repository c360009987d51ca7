"""The ``prune_curve`` action: mask the lowest-ranked heads in steps and measure a metric after each step,
beside the same curve for the reverse ranking and for seeded random rankings.

Definition: docs/methods.md#pruning-curve (Michel et al. 2019; HF bertology's ``prune_heads``). The ranking is
any earlier step's ``score`` (``heads: {from: step}``, highest first). At each fraction ``f`` of ``fractions``
the first ``max(1, round(f * L * H))`` heads of the pruning order are masked (the ranking reversed: the least
important first), skipping a head whose layer already has all but ``min_per_layer`` of its heads masked; the
``measure`` step (one ``generate``, ``score`` or ``evaluate`` action config) then runs with a ``head_mask`` of
those heads added to its ``steer`` list, and its metric is recorded (the mean of the metric's per-example
values; ``metric`` names it, default the step's first metric). The controls run the same procedure with the
ranking reversed (the most important heads masked first) and with ``n_random`` random rankings (seeded by the
run seed plus ``seed`` plus the draw).

``mode``: ``output`` (default; ``z`` zeroed, as HF's ``head_mask``), ``query`` (the query zeroed: uniform
attention) or ``mean`` (mean ablation: ``z`` replaced by the head's mean ``z`` at every position), the masks of
docs/methods.md#head-masking-and-scaling. Under ``mean`` the means are taken once, before any curve, on the unmasked
model: ``z_mean[l, h]`` is the average of ``z[l, h, t]`` over every prompt token ``t`` of every example of the task
(each token weighs the same; left padding excluded; a BOS token the tokenizer adds is a prompt token), from
forwards over the prompts alone in batches of the measure step's ``batch_size``. ``recompute: true`` (HF's
iterative variant) ranks again under the current mask before each step, by running the ranking step's
``head_importance`` detector (its config) on this step's examples with the masked heads masked the same way; the
masked heads are ranked last.

Outputs: ``base`` (the unmasked metric), ``metric (fraction)``, ``reverse (fraction)``, ``random (draw,
fraction)`` with ``random_mean`` and ``random_std (fraction)``, ``masked (fraction)`` (heads masked),
``mask (fraction, layer, head)`` (the heads masked at each fraction), ``order_layer`` / ``order_head (rank)``
(the ranking, most important first; under ``recompute`` the first step's); under ``mode: mean`` also ``z_mean
(layer, head, head_dim)``, which a later step's ``head_mask {mode: mean, means_from: <this step>}`` reads.
``headlab show`` lists the three curves, one row per fraction.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Literal

import numpy as np
import torch
import xarray as xr
from pydantic import Field, field_validator, model_validator

from headlab import ReplaceZ, component
from headlab.plugin import (
    NonNegativeInt,
    Plan,
    PositiveInt,
    Probes,
    Seed,
    StepContext,
    StrictModel,
    forward,
    hookimpl,
    tokenize,
)
from headlab.resources import Estimate, EstimateContext
from headlab.spec import SpecTypes

from .evaluate import evaluate, evaluate_config
from .generate import generate, generate_config
from .score import score, score_config

Head = tuple[int, int]
MEASURES = {"generate": generate, "score": score, "evaluate": evaluate}
DEFAULT_FRACTIONS = [round(0.05 * i, 2) for i in range(1, 21)]


class Ranking(StrictModel):
    """The heads' ranking: an earlier step's ``score``, highest first."""

    from_: str = Field(alias="from", description="id of an earlier step whose result has a `score`")


def prune_curve_config(types: SpecTypes) -> type[StrictModel]:
    """The config of a prune_curve step: the ranking, the measuring step, the fractions and the controls."""
    Generate, Score, Evaluate = generate_config(types), score_config(types), evaluate_config(types)

    class Measure(StrictModel):
        """One generate, score or evaluate action config."""

        generate: Generate | None = None
        score: Score | None = None
        evaluate: Evaluate | None = None

        @model_validator(mode="after")
        def _one(self) -> Any:
            given = [name for name in MEASURES if getattr(self, name) is not None]
            if len(given) != 1:
                raise ValueError(f"give exactly one of generate, score or evaluate (got {', '.join(given) or 'none'})")
            return self

        def action(self) -> tuple[str, Any]:
            """The measuring action's name and config."""
            name = next(n for n in MEASURES if getattr(self, n) is not None)
            return name, getattr(self, name)

    class PruneCurve(StrictModel):
        """Mask the lowest-ranked heads in steps of ``fractions`` and measure a metric after each, with the
        reverse ranking and seeded random rankings as controls."""

        heads: Ranking = Field(description="the ranking: {from: step}, that step's score highest first")
        measure: Measure = Field(description="the measuring step: {generate: {...}}, {score: {...}} or "
                                 "{evaluate: {...}}")
        metric: str | None = Field(None, description="the measure step's metric to record (default: its first)")
        fractions: list[float] = Field(default_factory=lambda: list(DEFAULT_FRACTIONS),
                                       description="fractions of all heads masked, each in (0, 1]")
        mode: Literal["output", "query", "mean"] = Field(
            "output", description="output: zero z (HF head_mask); query: zero the query (uniform attention); mean: z "
            "replaced by its mean over the task's prompt tokens (mean ablation)")
        min_per_layer: NonNegativeInt = Field(0, description="heads every layer keeps unmasked")
        n_random: PositiveInt = Field(3, description="random rankings (the control's draws)")
        seed: Seed = Field(0, description="offset added to the run seed for the random rankings")
        recompute: bool = Field(False, description="rank again under the current mask before each step (the "
                                "ranking step must be head_importance)")

        def estimate(self, ctx: EstimateContext) -> list[Estimate]:
            """The measuring step's estimate (resource guard): each point of a curve runs that step."""
            _, action = self.measure.action()
            return action.estimate(ctx) if hasattr(action, "estimate") else []

        def preflight(self) -> None:
            """The measuring step's checks before a run (an evaluate step's lm-eval tasks)."""
            name, action = self.measure.action()
            if hasattr(action, "preflight"):
                try:
                    action.preflight()
                except ValueError as e:
                    e.path = ("measure", name, *tuple(getattr(e, "path", ()) or ()))
                    raise

        @field_validator("fractions")
        @classmethod
        def _fractions(cls, value: list[float]) -> list[float]:
            if not value:
                raise ValueError("give at least one fraction")
            bad = [f for f in value if not 0 < f <= 1]
            if bad:
                raise ValueError(f"fraction {bad[0]} is outside (0, 1]: a fraction of the heads masked, e.g. "
                                 "[0.25, 0.5, 1.0]")
            return sorted(set(value))

    return PruneCurve


def ranking(score: xr.DataArray) -> list[Head]:
    """The heads of a ``(layer, head)`` score, highest first (NaN last; ties by layer, then head)."""
    values = np.nan_to_num(score.transpose("layer", "head").values.astype(float), nan=-np.inf)
    return [(int(layer), int(head)) for layer, head in sorted(np.ndindex(values.shape),
                                                              key=lambda lh: (-values[lh], lh))]


def pruning_sequence(order: list[Head], n_heads: int, min_per_layer: int) -> list[Head]:
    """The heads in the order they are masked: ``order`` (first masked first) without the heads that would leave
    their layer fewer than ``min_per_layer`` unmasked heads."""
    out, per_layer = [], {}
    for layer, head in order:
        if per_layer.get(layer, 0) < n_heads - min_per_layer:
            out.append((layer, head))
            per_layer[layer] = per_layer.get(layer, 0) + 1
    return out


def masked_count(fraction: float, total: int, maskable: int) -> int:
    """How many heads a fraction of ``total`` masks (at least one, at most ``maskable``)."""
    return min(maskable, max(1, round(fraction * total)))


def mean_z(ctx: StepContext, batch_size: int) -> np.ndarray:
    """``(layer, head, head_dim)`` each head's ``z`` averaged over every prompt token of the task's examples
    (padding excluded), from forwards of the unmasked model over the prompts in batches of ``batch_size``."""
    geo = ctx.model.geometry
    if not ctx.examples:
        raise ValueError("prune_curve: mode mean averages z over the task's prompt tokens, and the task has no "
                         "examples; give the task examples or use mode: output")
    total = torch.zeros(geo.n_layers, geo.n_heads, geo.head_dim, dtype=torch.float64)
    count = 0
    n = len(ctx.examples)
    chunks = [ctx.examples[j:j + batch_size] for j in range(0, n, batch_size)]
    for chunk in ctx.progress(chunks, "mean z"):
        batch = tokenize(ctx.model, chunk)
        _, rec = forward(ctx.model, batch, Plan(probes=Probes(z_positions="all")), logits_to_keep=1)
        z = rec.z.double()  # (row, layer, head, position, head_dim)
        real = batch.attention_mask.to(z.device).bool()
        total += (z * real[:, None, None, :, None]).sum((0, 3)).cpu()
        count += int(real.sum())
    if count == 0:
        raise ValueError("prune_curve: mode mean averages z over the task's prompt tokens, and its prompts have no "
                         "tokens; give the examples prompts or use mode: output")
    return (total / count).numpy()


def _means_key(ctx: StepContext) -> str:
    """The result id under which the step's own ``z_mean`` is visible to its measuring runs."""
    return ctx.step_id or "prune_curve"


def _mask_step(config: Any, ctx: StepContext, heads: list[Head]) -> Any:
    """The ``head_mask`` steering config masking ``heads`` in ``config.mode`` (``mean``: reading this step's
    ``z_mean``)."""
    head_mask = component("steering", "head_mask").config
    if config.mode != "mean":
        return head_mask(heads=[list(h) for h in heads], mode=config.mode)
    return head_mask(heads=[list(h) for h in heads], mode="mean", means_from=_means_key(ctx))


def _measure(config: Any, ctx: StepContext, heads: list[Head]) -> float:
    """The measure step's metric with ``heads`` masked (none: the unmasked model)."""
    name, action = config.measure.action()
    if heads:
        mask = _mask_step(config, ctx, heads)
        action = action.model_copy(update={"steer": [*action.steer, mask]})
    ds = MEASURES[name](action, ctx)
    metric = config.metric or next(iter(ds.attrs.get("metrics") or []), None)
    if metric is None or metric not in ds:
        have = list(ds.attrs.get("metrics") or [])
        raise ValueError(f"prune_curve: the {name} step has no metric {metric!r} (its metrics: "
                         f"{', '.join(have) or 'none'}); give the measure step a metric")
    return float(np.nanmean(np.asarray(ds[metric].values, dtype=float)))


def _rerank(config: Any, ctx: StepContext, source: xr.Dataset, masked: list[Head]) -> list[Head]:
    """The heads ranked again by the ranking step's ``head_importance`` with ``masked`` masked (those last)."""
    detector = component("detectors", "head_importance")
    settings = json.loads(source.attrs["config"]) if isinstance(source.attrs.get("config"), str) else {}
    settings = settings.get("detect", settings)
    cfg = detector.config.model_validate({k: v for k, v in settings.items() if k in detector.config.model_fields})
    if config.mode == "mean":
        means = ctx.results[_means_key(ctx)]["z_mean"].values
        values = torch.as_tensor(np.stack([means[h] for h in masked]))[:, None, :]
        ds = detector.impl(cfg, ctx, plan=Plan().add(ReplaceZ(masked, values, from_position=0)))
    else:
        ds = detector.impl(cfg, ctx, mask=masked, mode=config.mode)
    order = ranking(ds["score"])
    done = set(masked)
    return [h for h in order if h not in done] + list(masked)


def _curve(config: Any, ctx: StepContext, order: list[Head], total: int, maskable: int, H: int,
           source: xr.Dataset | None = None) -> tuple[list[float], list[list[Head]]]:
    """The metric and the masked heads at each fraction, masking ``order`` from its end (the lowest first);
    with ``source`` (recompute) the heads still unmasked are ranked again under the mask before each step."""
    values, masks = [], []
    masked: list[Head] = []
    sequence = pruning_sequence(order[::-1], H, config.min_per_layer)
    for fraction in config.fractions:
        n = masked_count(fraction, total, maskable)
        if source is not None and masked:
            again = [h for h in _rerank(config, ctx, source, masked)[::-1] if h not in set(masked)]
            sequence = pruning_sequence(masked + again, H, config.min_per_layer)
        masked = sequence[:n]
        values.append(_measure(config, ctx, masked))
        masks.append(masked)
    return values, masks


def prune_curve(config: Any, ctx: StepContext) -> xr.Dataset:
    """The ``prune_curve`` action."""
    geo = ctx.model.geometry
    L, H = geo.n_layers, geo.n_heads
    if config.min_per_layer > H:
        raise ValueError(f"prune_curve: min_per_layer {config.min_per_layer} is more than a layer's {H} heads; give "
                         f"0 .. {H}")
    step = config.heads.from_
    if step not in ctx.results or "score" not in ctx.results[step]:
        raise ValueError(f"prune_curve: step '{step}' has no `score` in this cell to rank heads by")
    source = ctx.results[step]
    if config.recompute and source.attrs.get("method") != "head_importance":
        raise ValueError(f"prune_curve: recompute ranks again with the ranking step's detector, which must be "
                         f"head_importance (step '{step}' is {source.attrs.get('method', 'another action')!r})")
    order = ranking(source["score"])
    total, maskable = L * H, L * (H - config.min_per_layer)
    if maskable == 0:
        raise ValueError(f"prune_curve: min_per_layer {config.min_per_layer} keeps every head; nothing to mask")
    means = None
    if config.mode == "mean":
        name, action = config.measure.action()
        means = mean_z(ctx, int(getattr(action, "batch_size", None) or 8))
        held = xr.Dataset({"z_mean": (("layer", "head", "head_dim"), means)})
        ctx = dataclasses.replace(ctx, results={**ctx.results, _means_key(ctx): held})
    rng = np.random.default_rng(ctx.seed + config.seed)
    randoms = [[order[i] for i in rng.permutation(total)] for _ in range(config.n_random)]
    base = _measure(config, ctx, [])
    runs = [("metric", order, config.recompute), ("reverse", order[::-1], False)]
    runs += [(f"random{d}", r, False) for d, r in enumerate(randoms)]
    curves, masks = {}, {}
    for name, heads, again in ctx.progress(runs, "pruning curves"):
        curves[name], masks[name] = _curve(config, ctx, heads, total, maskable, H, source if again else None)
    F = len(config.fractions)
    random = np.array([curves[f"random{d}"] for d in range(config.n_random)])
    mask = np.zeros((F, L, H), dtype=bool)
    for i, heads in enumerate(masks["metric"]):
        for layer, head in heads:
            mask[i, layer, head] = True
    ds = xr.Dataset({
        "base": ((), base),
        "metric": ("fraction", np.array(curves["metric"])),
        "reverse": ("fraction", np.array(curves["reverse"])),
        "random": (("draw", "fraction"), random),
        "random_mean": ("fraction", random.mean(0)),
        "random_std": ("fraction", random.std(0, ddof=1) if config.n_random > 1 else np.zeros(F)),
        "masked": ("fraction", np.array([len(m) for m in masks["metric"]])),
        "mask": (("fraction", "layer", "head"), mask),
        "order_layer": ("rank", np.array([h[0] for h in order])),
        "order_head": ("rank", np.array([h[1] for h in order])),
    }, coords={"fraction": np.array(config.fractions), "draw": np.arange(config.n_random), "layer": np.arange(L),
               "head": np.arange(H), "rank": np.arange(total)})
    if means is not None:
        ds["z_mean"] = (("layer", "head", "head_dim"), means)
    name, _ = config.measure.action()
    ds.attrs.update(method="prune_curve", ranking=step, measure=name, mode=config.mode,
                    min_per_layer=config.min_per_layer, recompute=int(config.recompute),
                    reference="docs/methods.md#pruning-curve",
                    metrics=["metric", "reverse", "random_mean"], summary_dims=["fraction"])
    return ds


@hookimpl
def headlab_register_actions(register):
    register("prune_curve", prune_curve_config, prune_curve,
             description="mask the lowest-ranked heads in steps and measure a metric, with reverse and random controls")
