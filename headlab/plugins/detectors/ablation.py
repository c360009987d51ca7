"""The causal check: mask the top-k detected heads vs k random heads and measure a task metric.

Definition: docs/methods.md#causal-check-by-ablation, with the masks of
docs/methods.md#head-masking-and-scaling. The heads come from any head selection, in rank order
(``{from: retrieval, threshold: 0.1}``, ``{from: retrieval, top: 16}``, ``{file: heads.json}``, an
explicit list); for every ``k`` the first ``k`` of them are masked, and for every random draw ``k``
heads drawn at random are masked instead (drawn from the heads outside those top ``k``; with
``match_layers`` the same number per layer as the top ``k``). Every condition decodes the task's
examples greedily and scores the outputs with a metric plugin (default ``needle_recall``).

With ``mask_prompt: false`` the prompt minus its last token is prefilled unmasked and the masks act from
the last prompt token on (the masked branch of DeCoRe's reference code): the heads are removed from the
computation of the answer, not from the reading of the context.

All conditions of an example run as rows of one batched forward with per-row edits
(:meth:`headlab.instrument.Plan.mask_heads` with ``rows``): the unmasked base, each top-``k`` mask and
each random draw are different rows of the same batch.

Outputs: ``base`` and ``base_example (example)``; ``top (k)``, ``top_example (k, example)``;
``random (k, draw)``, ``random_example (k, draw, example)``; the generated texts ``output_base``,
``output_top``, ``output_random``; the masked heads ``top_layer/top_head (rank)`` and
``random_layer/random_head (k, draw, slot)`` (-1 pads slots beyond ``k``).
"""

from __future__ import annotations

from typing import Any, Literal

import numpy as np
import xarray as xr
from pydantic import Field, model_validator

from headlab import Geometry, component, draw_like
from headlab.masking import ablate, metric_config
from headlab.plugin import (
    ComponentConfig,
    HeadSelection,
    NonEmptyStr,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveInt,
    Seed,
    StepContext,
    hookimpl,
)
from headlab.resources import Estimate, EstimateContext

__all__ = ["Ablation", "ablate", "detect", "draw_random_heads"]

Head = tuple[int, int]


class Ablation(ComponentConfig):
    """Causal check: a metric with the top-k heads masked vs k random heads (several draws)."""

    kind: Literal["ablation"] = "ablation"
    heads: HeadSelection = Field(description="ranked heads to mask, e.g. {from: retrieval, threshold: 0.1}")
    k: list[PositiveInt | Literal["all"]] = Field(default_factory=lambda: ["all"],
                                          description="numbers of heads to mask; 'all' = every selected head")
    draws: NonNegativeInt = Field(3, description="random draws per k")
    match_layers: bool = Field(False, description="random heads: as many per layer as the top k")
    exclude_selected: bool = Field(True, description="random heads are drawn from heads outside the top k")
    mode: Literal["query", "score", "output"] = Field(
        "query", description="mask: zero the query (reference), the scores, or the head output")
    mask_prompt: bool = Field(True, description="mask during the prompt too; false: prefill the prompt minus its "
                              "last token unmasked, mask from the last prompt token on (DeCoRe's reference)")
    metric: str | dict[str, Any] = Field("needle_recall", description="metric kind, or {kind, ...options}")
    max_new_tokens: PositiveInt = 16
    stop: list[NonEmptyStr] = Field(default_factory=list, description="stop strings (non-empty)")
    batch_size: PositiveInt = Field(32, description="rows per forward (every condition of batch_size // conditions "
                            "examples)")
    length_slack: NonNegativeFloat = Field(0.125, description="a batch holds prompts at most this fraction longer "
                                "than its shortest (left padding costs compute)")
    seed: Seed = Field(0, description="offset added to the run seed for the random draws")

    def estimate(self, ctx: EstimateContext) -> list[Estimate]:
        """The KV cache of a batch (every condition) decoding ``max_new_tokens`` after the longest prompt (resource guard)."""
        return [ctx.kv_cache(ctx.task.tokens + self.max_new_tokens, ctx.rows(self.batch_size))]

    @model_validator(mode="after")
    def _check(self) -> Ablation:
        if not self.k or any(k != "all" and k < 1 for k in self.k):
            raise ValueError("k: a list of positive head counts (or 'all')")
        metric_config(self.metric)
        return self


def draw_random_heads(top: list[Head], geometry: Geometry, rng: np.random.Generator, *,
                      match_layers: bool = False, exclude: bool = True) -> list[Head]:
    """``len(top)`` heads of the model drawn without replacement (per layer as in ``top`` with
    ``match_layers``; outside ``top`` with ``exclude``)."""
    every = [(layer, h) for layer in range(geometry.n_layers) for h in range(geometry.n_heads)]
    return draw_like(top, every, rng, match_layers=match_layers, exclude=exclude)


def detect(config: Ablation, ctx: StepContext) -> xr.Dataset:
    """The ``ablation`` step (see the module docstring)."""
    geo = ctx.model.geometry
    ranked_heads = ctx.heads(config.heads)
    if not ranked_heads:
        raise ValueError("ablation: the head selection is empty (no head passed the threshold?)")
    ks = list(dict.fromkeys(len(ranked_heads) if k == "all" else int(k) for k in config.k))
    if max(ks) > len(ranked_heads):
        raise ValueError(f"ablation: k={max(ks)} but the selection has {len(ranked_heads)} heads")
    rng = np.random.default_rng(ctx.seed + config.seed)
    draws = [[draw_random_heads(ranked_heads[:k], geo, rng, match_layers=config.match_layers,
                                exclude=config.exclude_selected) for _ in range(config.draws)] for k in ks]
    conditions: list[list[Head]] = [[]] + [ranked_heads[:k] for k in ks] + [d for per_k in draws for d in per_k]
    outputs = ablate(ctx.model, ctx.examples, conditions, mode=config.mode, max_new_tokens=config.max_new_tokens,
                     stop=config.stop, batch_size=config.batch_size, mask_prompt=config.mask_prompt,
                     length_slack=config.length_slack,
                     progress=ctx.progress)
    mcfg = metric_config(config.metric)
    compute = component("metrics", mcfg.kind).impl
    values = [np.asarray(compute(mcfg, ctx.examples, out), dtype=float) for out in outputs]
    n_ex, n_k, n_d = len(ctx.examples), len(ks), config.draws
    top_v = np.stack(values[1: 1 + n_k]) if n_k else np.zeros((0, n_ex))
    rand_v = np.stack(values[1 + n_k:]).reshape(n_k, n_d, n_ex) if n_d else np.zeros((n_k, 0, n_ex))
    out_arr = np.array(outputs, dtype=object)
    slots = max(ks)
    r_layer = np.full((n_k, n_d, slots), -1, dtype=np.int64)
    r_head = np.full((n_k, n_d, slots), -1, dtype=np.int64)
    for a, per_k in enumerate(draws):
        for d, heads in enumerate(per_k):
            r_layer[a, d, : len(heads)] = [x for x, _ in heads]
            r_head[a, d, : len(heads)] = [h for _, h in heads]
    coords = {"k": ks, "draw": np.arange(n_d)}
    ds = xr.Dataset(
        {
            "base": ((), float(np.nanmean(values[0]))),
            "base_example": ("example", values[0]),
            "top": ("k", np.nanmean(top_v, axis=-1)),
            "top_example": (("k", "example"), top_v),
            "random": (("k", "draw"), np.nanmean(rand_v, axis=-1) if n_d else np.zeros((n_k, 0))),
            "random_example": (("k", "draw", "example"), rand_v),
            "output_base": ("example", out_arr[0]),
            "output_top": (("k", "example"), out_arr[1: 1 + n_k].reshape(n_k, n_ex)),
            "output_random": (("k", "draw", "example"), out_arr[1 + n_k:].reshape(n_k, n_d, n_ex)),
            "top_layer": ("rank", np.array([x for x, _ in ranked_heads], dtype=np.int64)),
            "top_head": ("rank", np.array([h for _, h in ranked_heads], dtype=np.int64)),
            "random_layer": (("k", "draw", "slot"), r_layer),
            "random_head": (("k", "draw", "slot"), r_head),
        },
        coords=coords,
    )
    ds.attrs.update(method="ablation", metric=mcfg.kind, mode=config.mode, mask_prompt=config.mask_prompt,
                    metrics=["base", "top", "random"], summary_dims=["k"],
                    match_layers=config.match_layers, model=ctx.model.name,
                    reference="docs/methods.md#causal-check-by-ablation")
    return ds


@hookimpl
def headlab_register_detectors(register):
    register(Ablation, detect)
