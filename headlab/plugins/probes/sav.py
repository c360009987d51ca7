"""The ``sav`` action: classify a task's examples by a majority vote of heads (sparse attention vectors).

Definition: docs/methods.md#sparse-attention-vectors (SAVs, Mitra et al. 2024). An earlier ``probe`` step
(``classifier: nearest_mean``) holds each head's class means ``class_mean[c, l, h]`` over its examples and its
held-out accuracy ``score[l, h]`` (on its folds, not on the examples that built the means). Here every selected
head ``(l, h)`` votes for ``argmax_c cos(z[l,h], class_mean[c,l,h])``, ``z`` read at the probe's position of
each example of this step's task; the class with the most votes wins, a tie going to the tied class voted by the
highest-ranked head (rank: the probe's score, ties by layer then head).

``sav: {probe: pr, heads: {from: pr, top: 20}}``; without ``heads``, every head votes. One forward per batch
records ``z`` of every head.

Outputs: ``votes (example, class)``, ``prediction (example)`` (the winning class's value), ``head_vote
(example, rank)`` (the class index each voting head chose, ranked; coordinates ``rank_layer``, ``rank_head``)
and, when every example has the probe's label field, ``correct (example)`` and ``accuracy`` (their mean).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import xarray as xr
from pydantic import Field

from headlab import ranked
from headlab.plugin import (
    HeadSelection,
    NonEmptyStr,
    PositiveInt,
    StepContext,
    StrictModel,
    hookimpl,
    tokenize,
)
from headlab.resources import Estimate, EstimateContext
from headlab.spec import SpecTypes

from .probe import collect_z, length_batches, nearest_mean_predict

__all__ = ["majority_vote", "sav", "sav_config"]


def sav_config(types: SpecTypes) -> type[StrictModel]:
    """The config of a sav step: the probe step, the voting heads, the batch size."""

    class Sav(StrictModel):
        """Classify the step's examples by a majority vote of heads' nearest class means (SAVs)."""

        probe: NonEmptyStr = Field(description="id of an earlier probe step (classifier: nearest_mean)")
        heads: HeadSelection | None = Field(
            None, description="the voting heads ({from: pr, top: 20}, [[layer, head], ...]); default every head")
        batch_size: PositiveInt = 8

        def estimate(self, ctx: EstimateContext) -> list[Estimate]:
            """Hidden states of a batch's forward over the longest prompt (resource guard)."""
            return [ctx.activations(ctx.task.tokens, ctx.rows(self.batch_size))]

    return Sav


def majority_vote(head_vote: np.ndarray, n_classes: int) -> tuple[np.ndarray, np.ndarray]:
    """``(votes (example, class), winner (example,))`` from ``head_vote`` (example, rank) class indices with the
    highest-ranked head first; a tie goes to the tied class that the highest-ranked head voted for."""
    n, k = head_vote.shape
    votes = np.zeros((n, n_classes), dtype=np.int64)
    for r in range(k):
        np.add.at(votes, (np.arange(n), head_vote[:, r]), 1)
    winner = np.empty(n, dtype=np.int64)
    for e in range(n):
        tied = set(np.flatnonzero(votes[e] == votes[e].max()).tolist())
        winner[e] = next(int(c) for c in head_vote[e] if int(c) in tied)
    return votes, winner


def _probe_step(action: Any, ctx: StepContext) -> xr.Dataset:
    name = action.probe
    if name not in ctx.results:
        earlier = ", ".join(ctx.results) or "none"
        raise ValueError(f"sav: probe '{name}' is not an earlier step of this cell (earlier steps: {earlier}); name "
                         "a probe step")
    pr = ctx.results[name]
    if pr.attrs.get("method") != "probe" or "class_mean" not in pr:
        raise ValueError(f"sav: step '{name}' is not a probe step (it ran {pr.attrs.get('method', 'no detector')}); "
                         "name a step with detect: {kind: probe, classifier: nearest_mean, ...}")
    return pr


def sav(action: Any, ctx: StepContext) -> xr.Dataset:
    """The ``sav`` action over the step's examples."""
    pr = _probe_step(action, ctx)
    geo = ctx.model.geometry
    class_mean = pr["class_mean"].transpose("class", "layer", "head", "head_dim").values
    if class_mean.shape[1:3] != (geo.n_layers, geo.n_heads):
        raise ValueError(f"sav: probe '{action.probe}' has {class_mean.shape[1]} layers x {class_mean.shape[2]} "
                         f"heads, this model {geo.n_layers} x {geo.n_heads}; run the probe on the same model")
    classes = pr["class"].values
    order = [h for h, _ in ranked(pr["score"])]
    chosen = set(ctx.heads(action.heads)) if action.heads is not None else set(order)
    voters = [h for h in order if h in chosen]
    if not voters:
        raise ValueError("sav: the head selection is empty; select at least one head")
    position = pr.attrs.get("position", "last")
    position = position if position in ("last", "mean") else int(position)

    examples = ctx.examples
    n = len(examples)
    chunks = length_batches(ctx.model, examples, action.batch_size)
    head_vote = np.empty((n, len(voters)), dtype=np.int64)
    layers = np.array([layer for layer, _ in voters])
    heads = np.array([head for _, head in voters])
    for idx in ctx.progress(chunks, "sav forwards"):
        batch = tokenize(ctx.model, [examples[i] for i in idx])
        try:
            z = collect_z(ctx.model, batch, position)[:, layers, heads]  # (rows, rank, D)
        except IndexError as e:
            row, length = e.args
            raise ValueError(f"sav: the probe's position {position} is outside example {idx[row]}'s prompt of "
                             f"{length} tokens; use prompts at least that long") from None
        means = class_mean[:, layers, heads].transpose(1, 0, 2)  # (rank, class, D)
        head_vote[idx] = nearest_mean_predict(means, z.transpose(1, 0, 2)).T
    votes, winner = majority_vote(head_vote, len(classes))

    ds = xr.Dataset({
        "votes": xr.DataArray(votes, dims=("example", "class"), coords={"class": classes}),
        "prediction": xr.DataArray(classes[winner], dims=("example",)),
        "head_vote": xr.DataArray(head_vote, dims=("example", "rank"),
                                  coords={"rank_layer": ("rank", layers), "rank_head": ("rank", heads)}),
    })
    label = pr.attrs.get("label")
    truth = [ex.meta.get(label) for ex in examples]
    if label and all(t is not None for t in truth):
        text = [str(c) for c in classes]
        gold = np.array([text.index(str(t)) if str(t) in text else -1 for t in truth])
        correct = (gold == winner).astype(float)
        ds["correct"] = xr.DataArray(correct, dims=("example",))
        ds["accuracy"] = xr.DataArray(float(correct.mean()))
        ds.attrs["metrics"] = ["correct"]
    ds.attrs.update(method="sav", model=ctx.model.name, probe=action.probe, n_heads=len(voters),
                    position=str(position), forwards=len(chunks), reference="docs/methods.md#sparse-attention-vectors")
    return ds


@hookimpl
def headlab_register_actions(register):
    register("sav", sav_config, sav,
             description="classify examples by a majority vote of heads' nearest class means (SAVs)")
