"""Path patching: how much of a behaviour flows from one sender head to a set of receivers, and only along
that path.

Definition: docs/methods.md#path-patching (Wang et al. 2022, "Interpretability in the Wild", the two-pass
version). The examples are pairs (the pair tasks ``pairs``, ``kv_swap``, ``ioi_pairs``), the metric and the
normalised ``score`` those of ``activation_patching`` (docs/methods.md#metrics-for-circuit-analysis).

For each sender head ``(l, h)`` (``senders``; every head by default, each scored alone), with ``direction:
denoise`` (the default: the source run is the clean prompt, the target run the corrupted one):

1. pass 1 runs the target prompt with the sender's ``z`` from the source run and every other head's ``z``
   frozen at its value in the target run (:class:`headlab.ReplaceZ`); the MLPs are recomputed (as in the
   paper: a path through MLPs only counts as direct), and the receivers' inputs are recorded;
2. pass 2 runs the target prompt with only the receivers' inputs replaced by their pass-1 values, everything
   else recomputed.

``receivers: logits`` (the default): the receiver is the final residual stream, read by the unembedding, so
pass 2 is pass 1 and the metric is pass 1's (the sender's effect through its direct path and the MLPs after
it). ``receivers: {heads: [[layer, head], ...], input: q | k | v}``: the queries of those query heads
(:class:`headlab.ReplaceQ`), or the keys or values of those key/value heads (``[layer, kv_head]``;
:class:`headlab.ReplaceKV`) at every position, as attention reads them. ``noise`` swaps the roles of the
two prompts.

Both passes are rows of batched forwards, one sender and pair per row, ``batch_size`` rows at a time.

Outputs: ``score (layer, head)`` (NaN for a head that is not a sender), ``patched (layer, head, example)``,
``clean (example)``, ``corrupt (example)``.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import torch
import xarray as xr
from pydantic import Field

from headlab import ReplaceKV, ReplaceQ, ReplaceZ
from headlab.plugin import (
    ComponentConfig,
    NonNegativeInt,
    Plan,
    PositiveInt,
    Probes,
    StepContext,
    StrictModel,
    forward,
    hookimpl,
)
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

__all__ = ["PathPatching", "Receivers", "detect", "path_patch_chunk"]

Head = tuple[NonNegativeInt, NonNegativeInt]


class Receivers(StrictModel):
    """Receiver heads and the input of theirs that the paths end in."""

    heads: list[Head] = Field(min_length=1, description="[layer, head] for q; [layer, kv_head] for k and v")
    input: Literal["q", "k", "v"] = Field(description="the queries, keys or values of the receivers")


class PathPatching(ComponentConfig):
    """Exact two-pass path patching from each sender head to the logits or to receivers' q/k/v inputs."""

    kind: Literal["path_patching"] = "path_patching"
    metric: Metric = Field("logit_diff", description="logit[answer] - logit[wrong], or the answer's log-probability")
    direction: Direction = Field("denoise", description="denoise: the sender's clean z into the corrupted run; "
                                 "noise: the reverse")
    senders: list[Head] | None = Field(None, description="the sender heads [layer, head], each scored alone; "
                                       "default: every head")
    receivers: Literal["logits"] | Receivers = Field("logits", description="logits (the final residual stream) "
                                                     "or {heads, input: q|k|v}")
    normalise: Normalise = Field("means", description="the score's ratio of example means, or the mean of ratios")
    batch_size: PositiveInt = Field(32, description="rows (one sender and pair each) per forward")
    pair_batch_size: PositiveInt = Field(8, description="pairs whose clean and corrupted runs share a forward")

    def estimate(self, ctx: EstimateContext) -> list[Estimate]:
        """Hidden states of a patched forward over the longest prompt (resource guard)."""
        return [ctx.activations(ctx.task.tokens, ctx.rows(max(self.batch_size, 2 * self.pair_batch_size)))]


def _check_heads(config: PathPatching, L: int, H: int, K: int) -> list[tuple[int, int]]:
    """The senders as (layer, head) pairs; a ValueError naming a sender or receiver the model lacks."""
    senders = [(int(a), int(b)) for a, b in config.senders] if config.senders is not None else \
        [(ly, h) for ly in range(L) for h in range(H)]
    for ly, h in senders:
        if ly >= L or h >= H:
            raise ValueError(f"{config.kind}: sender [{ly}, {h}] is not a head of this model ({L} layers x {H} "
                             "heads)")
    if isinstance(config.receivers, Receivers):
        units, what = (H, "heads") if config.receivers.input == "q" else (K, "key/value heads")
        for ly, h in config.receivers.heads:
            if ly >= L or h >= units:
                raise ValueError(f"{config.kind}: receiver [{ly}, {h}] is not one of this model's {what} "
                                 f"({L} layers x {units}; input {config.receivers.input})")
    return senders


def _pass_one(runs: PairRuns, rows: list[tuple[tuple[int, int], int]], L: int, H: int) -> Plan:
    """The edits of pass 1 for ``rows`` (sender, pair): every head frozen at the target run, then the sender
    replaced by the source run (``runs`` oriented: source prompts first)."""
    z_source, z_target = runs.z[runs.rows("clean")], runs.z[runs.rows("corrupt")]
    pairs = torch.tensor([e for _, e in rows], device=z_target.device)
    plan = Plan()
    for layer in range(L):
        plan.add(ReplaceZ([(layer, h) for h in range(H)], z_target[pairs, layer]))
    for r, ((layer, head), e) in enumerate(rows):
        plan.add(ReplaceZ([(layer, head)], z_source[e, layer, head][None, None], rows=[r]))
    return plan


def path_patch_chunk(lm, runs: PairRuns, config: PathPatching, senders: list[tuple[int, int]]
                     ) -> dict[tuple[tuple[int, int], int], float]:
    """The path-patched metric of every (sender, pair) of a chunk of pairs (``runs`` from
    :func:`~headlab.plugins.detectors.activation_patching.pair_runs`)."""
    L, H = lm.geometry.n_layers, lm.geometry.n_heads
    if config.direction == "noise":
        n = runs.n
        order = torch.cat([torch.arange(n, 2 * n), torch.arange(n)])
        runs = PairRuns(runs.ids[order.to(runs.ids.device)], runs.mask[order.to(runs.mask.device)],
                        runs.z[order.to(runs.z.device)], runs.metric,
                        runs.answer, runs.wrong, runs.pad)
    target = runs.rows("corrupt")
    ids, mask = runs.ids[target], runs.mask[target]
    receivers = config.receivers if isinstance(config.receivers, Receivers) else None
    jobs = [(s, e) for s in senders for e in range(runs.n)]
    out: dict[tuple[tuple[int, int], int], float] = {}
    for start in range(0, len(jobs), config.batch_size):
        rows = jobs[start:start + config.batch_size]
        which = torch.tensor([e for _, e in rows], device=ids.device)
        plan = _pass_one(runs, rows, L, H)
        if receivers is not None:
            layers = sorted({ly for ly, _ in receivers.heads})
            key = "q_positions" if receivers.input == "q" else "kv_positions"
            plan.probes = Probes(layers=layers, **{key: "all"})
        res, rec = forward(lm, ids[which], plan, attention_mask=mask[which], logits_to_keep=1)
        if receivers is not None:
            plan = Plan()
            recorded = {"q": rec.q, "k": rec.k, "v": rec.v}[receivers.input]
            for ly, h in receivers.heads:
                values = recorded[:, layers.index(ly), h][:, None]  # (rows, 1, T, D)
                if receivers.input == "q":
                    plan.add(ReplaceQ([(ly, h)], values))
                elif receivers.input == "k":
                    plan.add(ReplaceKV([(ly, h)], values, None))
                else:
                    plan.add(ReplaceKV([(ly, h)], None, values))
            res, _ = forward(lm, ids[which], plan, attention_mask=mask[which], logits_to_keep=1)
        rr = which.to(runs.answer.device)
        m = metric_of(res.logits[:, -1], runs.answer[rr], runs.wrong[rr], config.metric)
        for key_row, value in zip(rows, m.tolist(), strict=True):
            out[key_row] = value
    return out


def detect(config: PathPatching, ctx: StepContext) -> xr.Dataset:
    """The ``path_patching`` detector over a pair task."""
    geo = ctx.model.geometry
    L, H = geo.n_layers, geo.n_heads
    senders = _check_heads(config, L, H, geo.n_kv_heads)
    answer, wrong = pair_inputs(ctx.examples, config.kind)
    n = len(ctx.examples)
    clean, corrupt = np.zeros(n), np.zeros(n)
    patched = np.full((L, H, n), np.nan)
    for idx in ctx.progress(pair_chunks(n, config.pair_batch_size), "path patching"):
        runs = pair_runs(ctx.model, [ctx.examples[i] for i in idx], [answer[i] for i in idx],
                         [wrong[i] for i in idx], config.metric)
        m = runs.metric.detach().cpu().numpy()
        clean[idx], corrupt[idx] = m[:len(idx)], m[len(idx):]
        for ((layer, head), e), value in path_patch_chunk(ctx.model, runs, config, senders).items():
            patched[layer, head, idx[e]] = value
    score = normalised_score(patched, clean, corrupt, config.normalise, config.kind)
    ds = xr.Dataset({
        "score": xr.DataArray(score, dims=("layer", "head")),
        "patched": xr.DataArray(patched, dims=("layer", "head", "example")),
        "clean": xr.DataArray(clean, dims=("example",)),
        "corrupt": xr.DataArray(corrupt, dims=("example",)),
    }).assign_coords(layer=np.arange(L), head=np.arange(H))
    if isinstance(config.receivers, Receivers):
        receivers = f"{config.receivers.input} of " + ", ".join(f"({a}, {b})" for a, b in config.receivers.heads)
    else:
        receivers = "logits"
    ds.attrs.update(method="path_patching", model=ctx.model.name, metric=config.metric, direction=config.direction,
                    normalise=config.normalise, receivers=receivers, mlps="recomputed",
                    frozen="every head but the sender, at the target run (pass 1)",
                    convention=CONVENTION if config.normalise == "means" else PER_EXAMPLE,
                    position="last", reference="docs/methods.md#path-patching")
    return ds


@hookimpl
def headlab_register_detectors(register):
    register(PathPatching, detect)
