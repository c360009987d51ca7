"""Activation patching: how much of a behaviour one head's output carries from one prompt into another.

Definition: docs/methods.md#activation-patching (the metrics and the normalised score:
docs/methods.md#metrics-for-circuit-analysis). The examples are pairs (the pair tasks ``pairs``, ``kv_swap``,
``ioi_pairs``: ``prompt`` the clean prompt, ``meta["corrupt_prompt"]`` the corrupted one of the same token length,
``meta["answer_id"]`` / ``meta["wrong_id"]`` the answer tokens).

``direction: denoise`` (the default) runs the corrupted prompt with one head's output ``z`` replaced by its
value on the clean prompt; ``noise`` runs the clean prompt with the corrupted value. ``unit: z`` replaces
the head's ``z`` at every position (``(layer, head)``); ``z_position`` at one token of the prompt
(``(layer, head, token)``; ``token`` counts from the prompt's first token, left padding skipped); ``kv`` replaces
the keys (as attention reads them, after the rotary embedding) and values of one key/value head at every
position (:class:`headlab.ReplaceKV`; ``(layer, kv_head)``, the coordinate ``serves (kv_head, head)`` marks
the query heads each one serves under grouped-query attention); ``resid`` replaces the residual stream entering
one decoder layer at one token (:class:`headlab.ReplaceResid`, docs/methods.md#residual-stream-patching;
``(layer, token)``; layer 0's input is the embedding).

The metric is read at the last position: ``logit_diff = logit[answer] - logit[wrong]`` or ``logprob`` =
the log-probability of the answer. ``score = (mean patched - mean corrupt) / (mean clean - mean corrupt)``
over the examples (``normalise: means``; ``per_example``: the mean of each example's ratio), so 1 = the
patched run behaves like the clean one, 0 = like the corrupted one, in both directions.

One forward over the clean and the corrupted prompts of a chunk of pairs records every head's ``z`` at
every position (``Probes(z_positions="all")``); the patched runs are then rows of batched forwards, one
patch per row (:class:`headlab.ReplaceZ`), ``batch_size`` rows at a time, the rows of a forward patching one
layer (``batch_size: auto``: as many of a layer's rows as :func:`patched_row_bytes` fits in a quarter of the
memory budget of the model's device, :func:`headlab.resources.budget`; ``attrs["rows_per_forward"]`` is the
most rows a forward ran). Per token, the tokens before the first one where a pair's prompts differ are not run: their ``z`` is
the same in both runs, so their patched metric is the unpatched target's.

``resume: true`` (the default) skips, exactly, what a patch cannot change: that forward also records the
residual stream at the input of every layer and every key and value, and a patched forward starts at the
patched layer from the target run's residual stream (:func:`headlab.start_at_layer`); it runs only the
positions from the first one a row's patch can change (the first differing token of the pair, or the patched
token), the keys and values before them the target run's (a KV cache; on a model whose cache has sliding
window layers every position is run). Only the last position's logits are computed. ``attrs["start"]``
(``patched_layer`` / ``embeddings``) and ``attrs["prefix"]`` (``target_cache`` / ``recomputed``) say which
path ran.

Outputs: ``score (layer, head[, token])`` (``(layer, kv_head)`` for ``kv``, ``(layer, token)`` for ``resid``),
``patched (..., example)`` (the raw metric;
NaN at a token an example does not have), ``clean (example)``, ``corrupt (example)`` (not ``clean`` /
``corrupt``: a pair task's examples have a field ``corrupt``, the corrupted prompt).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
import xarray as xr
from pydantic import Field
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from headlab import ReplaceKV, ReplaceResid, ReplaceZ, positions_from_mask, start_at_layer
from headlab.plugin import (
    Batch,
    ComponentConfig,
    Example,
    LoadedModel,
    Plan,
    PositiveInt,
    Probes,
    StepContext,
    forward,
    hookimpl,
    tokenize,
)
from headlab.plugins.detectors.direct_logit_attribution import answer_ids
from headlab.resources import Estimate, EstimateContext, budget

__all__ = ["ActivationPatching", "PairRuns", "detect", "metric_of", "normalised_score", "pair_runs", "patched_row_bytes",
           "rows_per_forward"]

Metric = Literal["logit_diff", "logprob"]
Direction = Literal["denoise", "noise"]
Normalise = Literal["means", "per_example"]

#: the convention of ``score``, stored in the attrs
CONVENTION = "(mean patched - mean corrupt) / (mean clean - mean corrupt) over examples"
PER_EXAMPLE = "mean over examples of (patched - corrupt) / (clean - corrupt)"


class ActivationPatching(ComponentConfig):
    """Exact activation patching of each head's output between the clean and corrupted prompts of a pair task."""

    kind: Literal["activation_patching"] = "activation_patching"
    metric: Metric = Field("logit_diff", description="logit[answer] - logit[wrong], or the answer's log-probability")
    direction: Direction = Field("denoise", description="denoise: clean z into the corrupted run; noise: the reverse")
    unit: Literal["z", "z_position", "kv", "resid"] = Field(
        "z", description="a head's z at every position, at one token, a key/value head's keys and values, or the "
        "residual stream entering a layer at one token")
    normalise: Normalise = Field("means", description="the score's ratio of example means, or the mean of ratios")
    batch_size: PositiveInt | Literal["auto"] = Field(
        32, description="rows (one patch each) per patched forward; auto: as many as fit a quarter of the memory "
        "budget (a GPU's memory fills with rows)")
    pair_batch_size: PositiveInt = Field(8, description="pairs whose clean and corrupted runs share a forward")
    resume: bool = Field(True, description="start each patched forward at the patched layer from the target run's "
                         "residual stream and run only the positions the patch can change (exact); false: every "
                         "patched forward runs the whole model")

    def estimate(self, ctx: EstimateContext) -> list[Estimate]:
        """Hidden states of a patched forward over the longest prompt (resource guard); with ``resume``, the
        residual stream and the keys and values recorded for a chunk of pairs and a patched forward's KV cache."""
        rows = 1 if self.batch_size == "auto" else self.batch_size  # auto: sized to the budget when it runs
        out = [ctx.activations(ctx.task.tokens, ctx.rows(max(rows, 2 * self.pair_batch_size)))]
        if self.resume:
            pairs = ctx.rows(2 * self.pair_batch_size)
            out += [ctx.activations(ctx.task.tokens * ctx.geometry.n_layers, pairs,
                                    "residual stream of every layer (resume)"),
                    ctx.kv_cache(ctx.task.tokens, pairs, "keys and values of every layer (resume)"),
                    ctx.kv_cache(ctx.task.tokens, ctx.rows(rows), "KV cache of a patched forward (resume)")]
        return out


def metric_of(logits_last: torch.Tensor, answer: torch.Tensor, wrong: torch.Tensor, metric: str) -> torch.Tensor:
    """The metric per row (float64, differentiable) from the last position's logits (rows, vocab) and each
    row's answer and wrong-answer token ids."""
    x = logits_last.double()
    if metric == "logit_diff":
        return x.gather(1, answer[:, None])[:, 0] - x.gather(1, wrong[:, None])[:, 0]
    if metric == "logprob":
        return torch.log_softmax(x, dim=-1).gather(1, answer[:, None])[:, 0]
    raise ValueError(f"unknown metric {metric!r} (logit_diff or logprob)")


@dataclass
class PairRuns:
    """A chunk of pairs run once, clean and corrupted: ``ids`` / ``mask`` (2n, T) with the clean prompts in
    rows ``0..n-1`` and the corrupted ones in ``n..2n-1`` (the same padding: a pair has one token length),
    ``z`` (2n, layer, head, T, head_dim) every head's output, ``metric`` (2n,) float64, ``answer`` /
    ``wrong`` (n,) token ids, ``pad`` (n,) left padding of each pair; ``k`` / ``v`` (2n, layer, kv_head, T,
    head_dim) the keys and values when recorded (``kv=True``); ``resid`` (2n, layer, T, d_model) the residual
    stream at the input of each layer when recorded (``resid=True``)."""

    ids: torch.Tensor
    mask: torch.Tensor
    z: torch.Tensor
    metric: torch.Tensor
    answer: torch.Tensor
    wrong: torch.Tensor
    pad: list[int]
    k: torch.Tensor | None = None
    v: torch.Tensor | None = None
    resid: torch.Tensor | None = None

    @property
    def n(self) -> int:
        return int(self.answer.shape[0])

    def rows(self, which: str) -> slice:
        """The rows of the ``clean`` or ``corrupt`` prompts."""
        return slice(0, self.n) if which == "clean" else slice(self.n, 2 * self.n)


def pair_batch(lm, examples: list[Example]) -> Batch:
    """The clean prompts of ``examples`` (pair-task examples) then their corrupted ones, tokenized as one
    left-padded batch; a ValueError naming the first pair whose prompts differ in token length."""
    corrupt = [Example(prompt=str(ex.meta["corrupt_prompt"])) for ex in examples]
    batch = tokenize(lm, list(examples) + corrupt)
    n = len(examples)
    if not torch.equal(batch.attention_mask[:n], batch.attention_mask[n:]):
        row = next(i for i in range(n) if batch.pad[i] != batch.pad[n + i])
        raise ValueError(f"example {row}: the clean and corrupted prompts have different token lengths")
    return batch


def pair_runs(lm, examples: list[Example], answer: list[int], wrong: list[int], metric: str,
              kv: bool = False, resid: bool = False) -> PairRuns:
    """One forward over the clean and corrupted prompts of ``examples`` (pair-task examples), recording every
    head's ``z`` at every position (and every key/value head's keys and values with ``kv``, the residual
    stream at the input of every decoder layer with ``resid``)."""
    batch = pair_batch(lm, examples)
    n = len(examples)
    probes = Probes(z_positions="all", kv_positions="all" if kv else None)
    inputs: list[torch.Tensor] = []
    handles = [layer.register_forward_pre_hook(
        lambda module, args, kwargs: inputs.append((args[0] if args else kwargs["hidden_states"]).detach()),
        with_kwargs=True) for layer in lm.decoder_layers] if resid else []
    try:
        out, rec = forward(lm, batch.input_ids, Plan(probes=probes), attention_mask=batch.attention_mask,
                           logits_to_keep=1)
    finally:
        for h in handles:
            h.remove()
    device = out.logits.device
    a = torch.tensor(answer, device=device)
    w = torch.tensor(wrong, device=device)
    m = metric_of(out.logits[:, -1], a.repeat(2), w.repeat(2), metric)
    return PairRuns(batch.input_ids, batch.attention_mask, rec.z, m, a, w, [int(p) for p in batch.pad[:n]],
                    rec.k, rec.v, torch.stack(inputs, dim=1) if resid else None)


def normalised_score(patched: np.ndarray, clean: np.ndarray, corrupt: np.ndarray, normalise: str,
                     method: str) -> np.ndarray:
    """``score`` from ``patched`` (..., example) (NaN where a unit does not exist for an example) and the
    ``clean`` / ``corrupt`` metrics (example,), as ``normalise`` says (module docstring); a ValueError naming
    the metric (and the example, per example) when clean and corrupt are equal (to 1e-5 relative: two rows
    of one float32 forward over the same prompt may differ in rounding)."""
    valid = ~np.isnan(patched)
    if normalise == "per_example":
        gap = clean - corrupt
        flat = np.abs(gap) <= 1e-5 * np.maximum(1.0, np.abs(clean))
        if flat.any():
            i = int(np.flatnonzero(flat)[0])
            raise ValueError(f"{method}: example {i} has the same metric on its clean and corrupted prompts "
                             f"({clean[i]:.6g}): the per-example ratio (patched - corrupt) / (clean - corrupt) "
                             "is undefined; use normalise: means or a pair whose corruption changes the answer")
        with np.errstate(invalid="ignore"):
            return np.nanmean(np.where(valid, (patched - corrupt) / gap, np.nan), axis=-1)
    count = valid.sum(-1)
    mean_c, mean_k = (np.where(valid, v, 0.0).sum(-1) / np.maximum(count, 1) for v in (clean, corrupt))
    gap = mean_c - mean_k
    if np.any(np.abs(gap[count > 0]) <= 1e-5 * np.maximum(1.0, np.abs(mean_c[count > 0]))):
        raise ValueError(f"{method}: the mean metric is the same on the clean and the corrupted prompts "
                         f"({float(np.mean(clean)):.6g}): the score (mean patched - mean corrupt) / (mean clean - "
                         "mean corrupt) is undefined; the corruption must change the metric")
    mean_p = np.where(valid, patched, 0.0).sum(-1) / np.maximum(count, 1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(count > 0, (mean_p - mean_k) / gap, np.nan)


@dataclass(frozen=True)
class _Patch:
    """One patched row: ``key`` the unit index, ``e`` the example, ``layer`` the layer it edits, ``start``
    the positions before which the patched run equals the target run (nothing before them changes),
    ``head`` the head (key/value head for ``kv``), ``position`` the patched position (``None``: every
    position) and ``values`` the source run's ``z`` there ((T, head_dim), or (1, head_dim) at ``position``;
    the keys for ``kv``, ``kv_values`` its values; the residual stream (1, d_model) for ``resid``, ``head`` -1)."""

    key: tuple[int, ...]
    e: int
    layer: int
    start: int
    head: int
    position: int | None
    values: torch.Tensor
    kv_values: torch.Tensor | None = None


def _shared_prefix(runs: PairRuns, e: int) -> int:
    """The number of padded positions before the first token where pair ``e``'s two prompts differ."""
    differ = (runs.ids[e] != runs.ids[runs.n + e]).nonzero()
    return int(differ[0, 0]) if differ.numel() else int(runs.ids.shape[1])


def _patches(runs: PairRuns, unit: str, layer: int, H: int, K: int) -> Iterator[_Patch | tuple[tuple[int, ...], int]]:
    """Every patch of a chunk on ``layer``: the source run's ``z`` of one head at every position or at one
    token of the example, or the keys and values of one key/value head at every position. A token before
    the first one where the pair's prompts differ has the same ``z`` in both runs, so its patch changes
    nothing: it comes as ``(unit index, example)`` alone, its patched metric the target's."""
    source = runs.rows("clean")
    T = runs.ids.shape[1]
    shared = [min(_shared_prefix(runs, e), T - 1) for e in range(runs.n)]
    if unit == "kv":
        k_source, v_source = runs.k[source], runs.v[source]
        for kvh in range(K):
            for e in range(runs.n):
                yield _Patch((layer, kvh), e, layer, shared[e], kvh, None, k_source[e, layer, kvh],
                             v_source[e, layer, kvh])
        return
    if unit == "resid":
        r_source = runs.resid[source]
        for e in range(runs.n):
            pad = runs.pad[e]
            for token in range(T - pad):
                p = pad + token
                if p < shared[e]:
                    yield (layer, token), e
                else:
                    yield _Patch((layer, token), e, layer, p, -1, p, r_source[e, layer, p:p + 1])
        return
    z_source = runs.z[source]
    for head in range(H):
        for e in range(runs.n):
            z = z_source[e, layer, head]
            if unit == "z":
                yield _Patch((layer, head), e, layer, shared[e], head, None, z)
                continue
            pad = runs.pad[e]
            for token in range(T - pad):
                p = pad + token
                if p < shared[e]:
                    yield (layer, head, token), e
                else:  # the positions before p are those of the target run
                    yield _Patch((layer, head, token), e, layer, p, head, p, z[p:p + 1])


def _edits(batch: list[_Patch], unit: str, layer: int, s: int) -> list[ReplaceZ | ReplaceKV | ReplaceResid]:
    """The edits of a forward whose row ``r`` carries ``batch[r]`` and whose queries start at position ``s``:
    one per (head, position) over the rows that patch it."""
    groups: dict[tuple[int, int | None], list[int]] = {}
    for r, p in enumerate(batch):
        groups.setdefault((p.head, p.position), []).append(r)
    edits: list[ReplaceZ | ReplaceKV | ReplaceResid] = []
    for (head, position), rows in groups.items():
        if unit == "resid":
            x = torch.stack([batch[r].values for r in rows])
            edits.append(ReplaceResid(layer, x, rows=rows, positions=[position - s]))
        elif unit == "kv":  # key slots are absolute positions: the cached prefix's keys are replaced too
            keys = torch.stack([batch[r].values for r in rows])[:, None]
            values = torch.stack([batch[r].kv_values for r in rows])[:, None]
            edits.append(ReplaceKV([(layer, head)], keys, values, rows=rows))
        elif position is None:
            z = torch.stack([batch[r].values[s:] for r in rows])[:, None]
            edits.append(ReplaceZ([(layer, head)], z, rows=rows))
        else:
            z = torch.stack([batch[r].values for r in rows])[:, None]
            edits.append(ReplaceZ([(layer, head)], z, rows=rows, positions=[position - s]))
    return edits


def _swap(runs: PairRuns, direction: str) -> PairRuns:
    """``runs`` with the source prompts (patched from) first: the clean ones to denoise, the corrupted to noise."""
    if direction == "denoise":
        return runs
    n = runs.n
    order = torch.cat([torch.arange(n, 2 * n), torch.arange(n)])

    def rows(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t[order.to(t.device)]

    return PairRuns(rows(runs.ids), rows(runs.mask), rows(runs.z), rows(runs.metric), runs.answer, runs.wrong,
                    runs.pad, rows(runs.k), rows(runs.v), rows(runs.resid))


def prefix_reusable(lm: LoadedModel | torch.nn.Module) -> bool:
    """Whether the patched forwards can take the keys and values of the prompts' shared prefix from the
    target run: the model's KV cache is made of plain growing layers (no sliding window)."""
    model = lm.model if isinstance(lm, LoadedModel) else lm
    return all(type(layer) is DynamicLayer for layer in DynamicCache(config=model.config).layers)


def _prefix_cache(model, runs: PairRuns, rows: torch.Tensor, s: int, layer: int, n_layers: int):
    """A KV cache holding the target run's keys and values of positions ``0..s-1`` for ``rows`` (example
    indices of the target rows) at layers ``layer..`` (and layer 0, which sizes the mask)."""
    cache = DynamicCache(config=model.config)
    target = runs.rows("corrupt")
    k, v = runs.k[target], runs.v[target]
    idx = rows.to(k.device)
    for ly in sorted({0, *range(layer, n_layers)}):
        cache.update(k[idx, ly, :, :s], v[idx, ly, :, :s], ly)
    return cache


def patched_row_bytes(lm: LoadedModel, tokens: int) -> int:
    """The memory one row of a patched forward over ``tokens`` positions takes, estimated from the model's
    shape: a layer's activations (4 hidden states, the query, key and value heads and 3 MLP-sized tensors per
    token), the KV cache of every layer and two float32 rows of logits."""
    geo = lm.geometry
    config = lm.model.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    d_model = int(text.hidden_size)
    mlp = int(getattr(text, "intermediate_size", None) or getattr(text, "n_inner", None) or 4 * d_model)
    vocab = int(getattr(text, "vocab_size", 0) or 0)
    width = torch.finfo(lm.model.dtype).bits // 8
    per_token = 4 * d_model + (geo.n_heads + 2 * geo.n_kv_heads) * geo.head_dim + 3 * mlp
    kv = geo.n_layers * 2 * geo.n_kv_heads * geo.head_dim
    return int(tokens) * (per_token + kv) * width + 2 * vocab * 4


def rows_per_forward(lm: LoadedModel, tokens: int, rows: int) -> int:
    """How many of ``rows`` patched rows over ``tokens`` positions one forward runs under ``batch_size: auto``:
    those that fit a quarter of the memory budget of the model's device (at least one, all when unlimited)."""
    limit = budget(None, str(lm.device)).limit("device")
    if limit is None:
        return max(1, rows)
    return max(1, min(rows, limit // 4 // patched_row_bytes(lm, tokens)))


def patch_chunk(lm: LoadedModel, runs: PairRuns, unit: str, metric: str, batch_size: int | Literal["auto"],
                direction: str = "denoise", resume: bool = False, prefix: bool = False,
                rows_run: list[int] | None = None) -> dict[tuple[tuple[int, ...], int], float]:
    """The patched metric of every (unit, example) of a chunk of pairs, ``batch_size`` patches per forward
    (the rows of a forward edit one layer; ``auto``: :func:`rows_per_forward`; ``rows_run`` collects each
    forward's rows). ``resume``: each forward starts at the patched layer from the
    target run's residual stream (``runs.resid``); ``prefix`` (with ``resume``): it runs only the positions
    from the first one a row's patch can change, the keys and values before them the target run's
    (``runs.k`` / ``runs.v``). Both are exact: what they skip is the target run's own values."""
    geo = lm.geometry
    model = lm.model
    prefix = prefix and resume
    oriented = _swap(runs, direction)
    target = oriented.rows("corrupt")
    ids, mask = oriented.ids[target], oriented.mask[target]
    resid = None if oriented.resid is None else oriented.resid[target]
    out: dict[tuple[tuple[int, ...], int], float] = {}

    def run(batch: list[_Patch], layer: int) -> None:
        s = min(p.start for p in batch) if prefix else 0
        plan = Plan().add(*_edits(batch, unit, layer, s))
        rows = torch.tensor([p.e for p in batch], device=ids.device)
        kwargs: dict = {"position_ids": positions_from_mask(mask[rows])[:, s:]}
        if s:
            kwargs.update(cache=_prefix_cache(model, oriented, rows, s, layer, geo.n_layers), use_cache=True)
        with contextlib.ExitStack() as stack:
            if resume and layer > 0:
                stack.enter_context(start_at_layer(model, layer, resid[rows.to(resid.device), layer, s:]))
            res, _ = forward(lm, ids[rows, s:], plan, attention_mask=mask[rows], logits_to_keep=1, **kwargs)
        rr = rows.to(oriented.answer.device)
        m = metric_of(res.logits[:, -1], oriented.answer[rr], oriented.wrong[rr], metric)
        for p, value in zip(batch, m.tolist(), strict=True):
            out[(p.key, p.e)] = value

    target_metric = oriented.metric[target].tolist()
    for layer in range(geo.n_layers):
        pending: list[_Patch] = []
        for item in _patches(oriented, unit, layer, geo.n_heads, geo.n_kv_heads):
            if isinstance(item, tuple):
                out[item] = target_metric[item[1]]
            else:
                pending.append(item)
        pending.sort(key=lambda p: p.start)  # rows whose runs start at the same position share a forward
        size = rows_per_forward(lm, ids.shape[1], len(pending)) if batch_size == "auto" else batch_size
        for j in range(0, len(pending), size):
            run(pending[j:j + size], layer)
            if rows_run is not None:
                rows_run.append(len(pending[j:j + size]))
    return out


def pair_chunks(n: int, size: int) -> list[list[int]]:
    """Consecutive chunks of ``size`` example indices."""
    return [list(range(j, min(j + size, n))) for j in range(0, n, size)]


def pair_inputs(examples: list[Example], kind: str) -> tuple[list[int], list[int]]:
    """The answer and wrong token ids of a pair task's examples; an example without a corrupted prompt is an
    error naming it and the pair tasks."""
    answer, wrong = answer_ids(examples, kind)
    for i, ex in enumerate(examples):
        if "corrupt_prompt" not in ex.meta:
            raise ValueError(f"{kind}: example {i} has no corrupted prompt (meta['corrupt_prompt']); use a pair "
                             "task (kind pairs, kv_swap or ioi_pairs)")
    return answer, wrong


def detect(config: ActivationPatching, ctx: StepContext) -> xr.Dataset:
    """The ``activation_patching`` detector over a pair task."""
    geo = ctx.model.geometry
    L, H = geo.n_layers, geo.n_heads
    answer, wrong = pair_inputs(ctx.examples, config.kind)
    n = len(ctx.examples)
    clean, corrupt = np.zeros(n), np.zeros(n)
    chunks = pair_chunks(n, config.pair_batch_size)
    results: dict = {}
    rows_run: list[int] = []
    n_tokens = 0
    prefix = config.resume and prefix_reusable(ctx.model)
    for idx in ctx.progress(chunks, "activation patching"):
        runs = pair_runs(ctx.model, [ctx.examples[i] for i in idx], [answer[i] for i in idx],
                         [wrong[i] for i in idx], config.metric, kv=config.unit == "kv" or prefix,
                         resid=config.resume or config.unit == "resid")
        m = runs.metric.detach().cpu().numpy()
        clean[idx], corrupt[idx] = m[:len(idx)], m[len(idx):]
        n_tokens = max(n_tokens, max(runs.ids.shape[1] - p for p in runs.pad))
        for (key, e), value in patch_chunk(ctx.model, runs, config.unit, config.metric, config.batch_size,
                                           config.direction, resume=config.resume, prefix=prefix,
                                           rows_run=rows_run).items():
            results[(key, idx[e])] = value
    coords: dict = {"layer": np.arange(L), "head": np.arange(H)}
    if config.unit == "z":
        patched = np.full((L, H, n), np.nan)
        dims: tuple[str, ...] = ("layer", "head", "example")
    elif config.unit == "kv":
        K = geo.n_kv_heads
        patched = np.full((L, K, n), np.nan)
        dims = ("layer", "kv_head", "example")
        group = H // K
        coords["kv_head"] = np.arange(K)
        coords["serves"] = (("kv_head", "head"), np.arange(H)[None, :] // group == np.arange(K)[:, None])
    elif config.unit == "resid":
        patched = np.full((L, n_tokens, n), np.nan)
        dims = ("layer", "token", "example")
        coords = {"layer": np.arange(L), "token": np.arange(n_tokens)}
    else:
        patched = np.full((L, H, n_tokens, n), np.nan)
        dims = ("layer", "head", "token", "example")
        coords = {"layer": np.arange(L), "head": np.arange(H), "token": np.arange(n_tokens)}
    for (key, e), value in results.items():
        patched[(*key, e)] = value
    score = normalised_score(patched, clean, corrupt, config.normalise, config.kind)
    ds = xr.Dataset({
        "score": xr.DataArray(score, dims=dims[:-1]),
        "patched": xr.DataArray(patched, dims=dims),
        "clean": xr.DataArray(clean, dims=("example",)),
        "corrupt": xr.DataArray(corrupt, dims=("example",)),
    })
    ds = ds.assign_coords(coords)
    ds.attrs.update(method="activation_patching", model=ctx.model.name, metric=config.metric,
                    direction=config.direction, unit=config.unit, normalise=config.normalise,
                    convention=CONVENTION if config.normalise == "means" else PER_EXAMPLE,
                    position="last", reference="docs/methods.md#activation-patching",
                    start="patched_layer" if config.resume else "embeddings",
                    prefix="target_cache" if prefix else "recomputed", batch_size=str(config.batch_size),
                    rows_per_forward=max(rows_run, default=0))
    return ds


@hookimpl
def headlab_register_detectors(register):
    register(ActivationPatching, detect)
