"""``iti``: inference-time intervention (Li et al. 2023, "Inference-Time Intervention: Eliciting Truthful
Answers from a Language Model").

Definition: docs/methods.md#inference-time-intervention-iti. On each selected head ``(l, h)``, the head's
output ``z[l, h, t]`` (its slice of the ``o_proj`` input) becomes ``z[l, h, t] + alpha * sigma[l, h] *
theta[l, h]`` at the chosen positions ``t``:

- ``theta``: a unit vector per head, from a ``probe`` step (``probe:``): its ``direction`` (the unit mass-mean
  direction, mean z of one class minus mean z of the other; ``direction: mass_mean``, the paper's choice), its
  ``probe_direction`` (the unit weight vector of the head's logistic probe; ``probe``), or a seeded random unit
  vector per head (``random``, the control; drawn for every head of the model at once, so a head's vector does
  not depend on which other heads are selected);
- ``sigma``: the standard deviation of ``z . direction`` over the probe step's examples (its ``sigma``), or over
  another probe step's examples (``sigma_from:``, e.g. a probe on held-out data, so that nothing of the
  evaluation data leaks into the step length). The same ``sigma`` scales the three directions, so that they
  move ``z`` by the same amount;
- positions (per batch row, in the row's padded coordinates): ``last`` (the default) the last prompt token and
  every token after it: each generated token under the KV cache in ``generate``, the choice's tokens in a
  ``score`` step (a choice is scored like a generated answer), as the reference edits the last position of
  every forward; ``answer`` the tokens after the prompt only (a scored choice's tokens, where the reference's
  multiple-choice evaluation means to edit; the generated tokens in ``generate``); ``all`` every position.

The additions are :class:`headlab.AddZ` edits with ``from_position`` (one per distinct start among the rows),
so ITI runs on the fast attention path, per batch row, combined with other steering methods and decoding
strategies (DoLa, DeCoRe, ... copy the edits to their extra rows), in ``generate``, ``score`` and ``evaluate``.
"""

from __future__ import annotations

from typing import Any, Literal

import numpy as np
import torch
import xarray as xr
from pydantic import Field

from headlab import AddZ
from headlab.plugin import (
    Batch,
    ComponentConfig,
    FiniteFloat,
    HeadSelection,
    NonEmptyStr,
    NonNegativeInt,
    Seed,
    StepContext,
    hookimpl,
)

from .common import resolve_heads

Direction = Literal["mass_mean", "probe", "random"]
Positions = Literal["last", "all", "answer"]
DIRECTION_VARIABLE = {"mass_mean": "direction", "probe": "probe_direction"}


class Iti(ComponentConfig):
    """ITI: add alpha * sigma * theta to the output z of the selected heads, theta a probe step's direction."""

    kind: Literal["iti"] = "iti"
    probe: NonEmptyStr = Field(description="id of an earlier probe step (detect: {kind: probe}): its directions "
                               "and sigma")
    heads: HeadSelection | list[NonNegativeInt] = Field(
        description="heads to steer: {from: <probe step>, top: 48} (ITI's default K; add random: true for the "
        "control), [[layer, head], ...], {\"<layer>\": [heads]}, a list of layers, or {file: heads.json}")
    alpha: FiniteFloat = Field(15.0, description="strength: z += alpha * sigma * theta (ITI's default 15)")
    direction: Direction = Field(
        "mass_mean", description="theta: mass_mean (the probe step's unit mass-mean direction), probe (its probe's "
        "unit weight vector) or random (a seeded unit vector per head, the control)")
    positions: Positions = Field(
        "last", description="last: the last prompt token and every later one (generated tokens, a scored "
        "choice); answer: the tokens after the prompt only; all: every position")
    sigma_from: NonEmptyStr | None = Field(
        None, description="id of another probe step whose sigma (std of z . direction over its examples) to use, "
        "so that sigma comes from other data than the probe; default: the probe step's own")
    seed: Seed = Field(0, description="seed of the random directions (direction: random)")


def _probe_dataset(ctx: StepContext, step: str, field: str) -> xr.Dataset:
    """The dataset of the earlier probe step ``step`` named by the config field ``field``."""
    results = ctx.results
    if step not in results:
        earlier = ", ".join(f"'{s}'" for s in results) or "none"
        raise ValueError(f"iti: {field}: '{step}' is not an earlier step of this cell (earlier steps: {earlier}); "
                         f"name a probe step (detect: {{kind: probe}}) that runs before this one")
    ds = results[step]
    missing = [v for v in ("direction", "sigma") if v not in ds]
    if missing:
        method = ds.attrs.get("method")
        what = f"a '{method}' step" if method else "not a probe step"
        raise ValueError(f"iti: {field}: step '{step}' is {what}: it has no {' or '.join(missing)}; name a probe "
                         f"step (detect: {{kind: probe}})")
    return ds


def _geometry_of(ds: xr.Dataset, name: str) -> tuple[int, ...]:
    """The sizes of ``ds[name]`` over its dims, which must be (layer, head[, head_dim])."""
    da = ds[name]
    want = ("layer", "head", "head_dim") if name != "sigma" else ("layer", "head")
    if tuple(da.dims) != want:
        raise ValueError(f"iti: the probe's {name} has dims {tuple(da.dims)}, not {want}: ITI steers along one "
                         "direction per head")
    return tuple(int(s) for s in da.shape)


def _check_geometry(ds: xr.Dataset, step: str, field: str, geo: Any) -> None:
    """The probe step ``step`` was taken on a model of ``geo``'s geometry."""
    layers, heads, dim = _geometry_of(ds, "direction")
    if _geometry_of(ds, "sigma") != (layers, heads) or (layers, heads, dim) != (geo.n_layers, geo.n_heads,
                                                                                 geo.head_dim):
        raise ValueError(
            f"iti: {field}: step '{step}' has another model's geometry ({layers} layers x {heads} heads, head_dim "
            f"{dim}); this model has {geo.n_layers} x {geo.n_heads}, head_dim {geo.head_dim}: take it from a probe "
            "step on this model")


def random_directions(shape: tuple[int, int, int], seed: int) -> np.ndarray:
    """Seeded unit vectors of the last axis's length for every (layer, head) of ``shape``."""
    v = np.random.default_rng(seed).standard_normal(shape)
    return v / np.linalg.norm(v, axis=-1, keepdims=True)


def steering_vectors(config: Iti, ctx: StepContext, heads: list[tuple[int, int]]) -> torch.Tensor:
    """``alpha * sigma[l, h] * theta[l, h]`` of ``heads`` (heads, head_dim), in float64, checked: directions and
    sigma finite, the step length finite in the model's dtype."""
    geo = ctx.model.geometry
    ds = _probe_dataset(ctx, config.probe, "probe")
    _check_geometry(ds, config.probe, "probe", geo)
    if config.sigma_from is not None:
        sds = _probe_dataset(ctx, config.sigma_from, "sigma_from")
        _check_geometry(sds, config.sigma_from, "sigma_from", geo)
    else:
        sds = ds
    if config.direction == "random":
        theta_all = random_directions((geo.n_layers, geo.n_heads, geo.head_dim), config.seed)
        name = "direction"
    else:
        name = DIRECTION_VARIABLE[config.direction]
        if name not in ds:
            raise ValueError(f"iti: direction: {config.direction}: step '{config.probe}' has no {name} (a probe with "
                             "classifier: logistic has one)")
        _geometry_of(ds, name)
        theta_all = np.asarray(ds[name].values, dtype=np.float64)
    sigma_all = np.asarray(sds["sigma"].values, dtype=np.float64)
    idx = (np.array([h[0] for h in heads], dtype=int), np.array([h[1] for h in heads], dtype=int))
    theta, sigma = theta_all[idx], sigma_all[idx]
    for values, what, source in ((theta, name, config.probe), (sigma, "sigma", config.sigma_from or config.probe)):
        bad = [heads[i] for i in np.flatnonzero(~np.isfinite(values.reshape(len(heads), -1)).all(-1))]
        if bad:
            raise ValueError(f"iti: step '{source}' has no finite {what} for head(s) {bad[:4]}; steer other heads")
    length = config.alpha * sigma
    dtype = getattr(ctx.model.model, "dtype", torch.float32)
    finite = torch.isfinite(torch.as_tensor(length, dtype=torch.float64).to(dtype))
    if not bool(finite.all()):
        i = int((~finite).nonzero()[0, 0])
        raise ValueError(f"iti: alpha {config.alpha:g} times sigma {sigma[i]:.4g} of head {heads[i]} is "
                         f"{length[i]:.4g}, beyond the model's {str(dtype).removeprefix('torch.')} range; lower alpha")
    return torch.as_tensor(length[:, None] * theta, dtype=torch.float64)


def start_positions(batch: Batch, positions: Positions) -> list[int]:
    """The first edited position of every row of ``batch`` (padded coordinates; every later one is edited)."""
    if positions == "all":
        return [0] * batch.size
    if positions == "answer":
        return [batch.prompt_end(r) for r in range(batch.size)]
    return [batch.prompt_end(r) - 1 for r in range(batch.size)]


def steer(config: Iti, ctx: StepContext, batch: Batch, plan: Any) -> None:
    """Add ITI's vectors for every row of ``batch`` to ``plan``."""
    heads = resolve_heads(ctx, config.heads)
    if not heads:
        return
    values = steering_vectors(config, ctx, heads)[:, None, :]  # (heads, 1, head_dim)
    rows_by_start: dict[int, list[int]] = {}
    for r, start in enumerate(start_positions(batch, config.positions)):
        rows_by_start.setdefault(start, []).append(r)
    plan.add(*(AddZ(heads, values, None if len(rows) == batch.size else rows, owner=config, from_position=start)
               for start, rows in rows_by_start.items()))


@hookimpl
def headlab_register_steering(register):
    register(Iti, steer)
