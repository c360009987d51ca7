"""Head-level KV-cache policies: head maps, and a cache that holds fewer keys for compressed heads.

A *head map* (:class:`HeadMap`) says, per ``(layer, kv_head)``, whether a key/value head keeps its whole cache
(``kv_full``) or a bounded one: the ``sink`` first tokens of its row plus the ``window`` most recent tokens
(DuoAttention's streaming heads; StreamingLLM's layout when no head is full). Decisions are per KV head: under
grouped-query attention, KV head ``j`` serves query heads ``j * g .. (j + 1) * g - 1`` (``g = n_heads //
n_kv_heads``, transformers' ``repeat_kv`` layout), and a query-head selection becomes a KV-head one by a
:data:`GqaRule`. Budgets (``top``, a count of full heads) are counted in KV heads.

:func:`kv_heads` compiles any spec head selection (``{from: step, top: k}``, a threshold, pairs, layers, a
retrieval-head or PASTA JSON file, or DuoAttention's ``full_attention_heads.tsv``) into the boolean
``kv_full`` array; :func:`random_kv_heads` draws the same number of full KV heads at random (the control).
The ``kv`` component category (:func:`headlab.hookspecs.headlab_register_kv_policies`) turns a policy
config into a :class:`HeadMap`.

Budgets (:class:`KvBudget`: a kept fraction, a byte size or a mean of tokens per KV head) make as many KV
heads full as fit at a context length, in the order :func:`kv_priority` gives (:meth:`HeadMap.budgeted`).
HeadKV's per-KV-head budgets are a :class:`HeadBudgetMap` (:func:`headkv_allocation`), and
:func:`snapkv_keep` picks the keys each KV head keeps after a prefill. :func:`to_kvpress` exports a map as
a press of kvpress (an optional dependency).

:class:`HeadwiseCache` is a transformers :class:`~transformers.Cache` that stores, per layer, a *full group*
(the full KV heads, every position) and a *bounded group* (the compressed KV heads: ``sink`` slots plus a
ring buffer of ``window`` slots), batched with left padding: positions are counted in each row's own
tokens, so the sinks of a left-padded row are its first real tokens. Its ``nbytes`` are the bytes of the
keys and values it actually holds. Its ``update`` leaves a :class:`SplitCall` that headlab's attention
(:mod:`headlab.instrument.kv_split`) reads each group from; :func:`kv_policy` runs a model's forwards with
such caches and measures them (:class:`KvUsage`). Under a :class:`HeadBudgetMap` its layers are
:class:`HeadBudgetLayer`: the prefill (in one forward or, with ``prefill_chunk``, in several) attends every
head, then each compressed KV head keeps only the keys :func:`snapkv_keep` selects for it (its own buffers, no
padding to another head's budget) and every later token.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import threading
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Annotated, Any, Literal, Union

import numpy as np
import torch
import torch.nn.functional as F
import xarray as xr
from pydantic import Discriminator, Field, Tag, model_validator
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from transformers.cache_utils import Cache, CacheLayerMixin

from .config import StrictModel
from .geometry import Geometry
from .heads import from_retrieval_json, read_heads_file, select_heads
from .spec.fields import MAX_FLOAT, FiniteFloat, NonEmptyStr, NonNegativeInt, PositiveInt
from .spec.heads import HeadsFile, HeadsFrom

__all__ = ["DuoHeadsFile", "GqaRule", "HeadBudgetLayer", "HeadMap", "HeadwiseCache", "HeadwiseLayer", "KvHeadSelection",
           "KvPolicyError", "KvUsage", "SplitCall", "kv_heads", "kv_policy", "random_kv_heads", "read_duo_heads",
           "split_call",
           "HeadBudgetMap", "HeadScoreSource", "KvBudget", "ScoresFile", "ScoresFrom", "head_scores",
           "headkv_allocation", "kv_head_scores", "kv_priority", "read_head_scores", "snapkv_keep", "to_kvpress",
           "token_bytes"]

GqaRule = Literal["any", "all", "mean"]
"""How the query heads of a KV head decide it is full: ``any`` (one selected query head suffices; with
scores, KV heads rank by the highest score of their query heads), ``all`` (every query head selected; the
lowest score) or ``mean`` (the mean score; for a plain list of heads, at least half of them selected)."""


class KvPolicyError(ValueError):
    """A KV policy cannot be compiled or applied (bad head file, budget, geometry, padding)."""


class DuoHeadsFile(StrictModel):
    """DuoAttention's ``full_attention_heads.tsv``: one line per layer, one tab-separated value per KV head
    (0/1, or a trained gate in [0, 1]). A KV head is full when its value is >= ``threshold``, or, with
    ``top``, when it is among the ``top`` highest values (ties by layer, then KV head)."""

    file: NonEmptyStr = Field(description="path of a .tsv file (layers x KV heads)")
    top: PositiveInt | None = Field(None, description="keep the k KV heads with the highest values in full")
    threshold: FiniteFloat = Field(0.5, description="a KV head is full when its value is >= threshold")


class ScoresFrom(StrictModel):
    """Every head, ranked by (or weighted with) an earlier step's ``score``: no cut of its own (a budget
    decides how many KV heads are full; ``headkv`` weighs every head)."""

    from_: str = Field(alias="from", description="id of an earlier step whose result has a `score`")


class ScoresFile(StrictModel):
    """A head-score file: the retrieval-head / HeadKV JSON ``{"<layer>-<head>": [scores]}`` (query heads, the
    mean of each list) or DuoAttention's ``.tsv`` (KV heads). As a ``full_heads`` selection, ``threshold``
    keeps the KV heads whose aggregated score is >= it."""

    file: NonEmptyStr = Field(description="path of a .json (layer-head scores) or .tsv (layers x KV heads) file")
    threshold: FiniteFloat | None = Field(None, description="full_heads: KV heads whose score is >= threshold")


def _selection_form(value: Any) -> str:
    """Which form of KV head selection ``value`` is (a ``.tsv`` file is DuoAttention's format; a bare
    ``{from: step}`` ranks every head for a budget; a ``.json`` file with a ``threshold`` is a score file)."""
    if isinstance(value, DuoHeadsFile):
        return "heads[tsv]"
    if isinstance(value, ScoresFile):
        return "heads[scores]"
    if isinstance(value, ScoresFrom):
        return "heads[rank]"
    if isinstance(value, HeadsFile):
        return "heads[file]"
    if isinstance(value, HeadsFrom):
        return "heads[from]"
    if isinstance(value, Mapping):
        if "from" in value or "from_" in value:
            return "heads[rank]" if set(value) <= {"from", "from_"} else "heads[from]"
        if "file" in value:
            if str(value["file"]).lower().endswith(".tsv"):
                return "heads[tsv]"
            return "heads[scores]" if "threshold" in value else "heads[file]"
        return "heads[layers]"
    return "heads[pairs]"


KvHeadSelection = Annotated[
    Union[  # noqa: UP007
        Annotated[HeadsFrom, Tag("heads[from]")], Annotated[HeadsFile, Tag("heads[file]")],
        Annotated[DuoHeadsFile, Tag("heads[tsv]")], Annotated[ScoresFrom, Tag("heads[rank]")],
        Annotated[ScoresFile, Tag("heads[scores]")],
        Annotated[list[tuple[NonNegativeInt, NonNegativeInt]], Tag("heads[pairs]")],
        Annotated[dict[str, list[NonNegativeInt]], Tag("heads[layers]")]],
    Discriminator(_selection_form)]
"""The heads a KV policy keeps in full: any spec head selection (:data:`headlab.HeadSelection`, query heads
mapped to KV heads by a :data:`GqaRule`), a DuoAttention ``{file: full_attention_heads.tsv}`` (KV heads), a
score file with a ``threshold`` (:class:`ScoresFile`), or, under a budget, every head ranked by a step's
scores (``{from: step}``, :class:`ScoresFrom`)."""


def _score_form(value: Any) -> str:
    if isinstance(value, ScoresFile) or (isinstance(value, Mapping) and "file" in value):
        return "scores[file]"
    return "scores[from]"


HeadScoreSource = Annotated[
    Union[Annotated[ScoresFrom, Tag("scores[from]")], Annotated[ScoresFile, Tag("scores[file]")]],  # noqa: UP007
    Discriminator(_score_form)]
"""Where per-head scores come from: ``{from: step}`` (the step's ``score``) or ``{file: heads.json}`` (the
retrieval-head / HeadKV format) / ``{file: full_attention_heads.tsv}`` (DuoAttention's, KV heads)."""


# --- head maps -----------------------------------------------------------------------------------------


def _kv_array(values: np.ndarray, name: str = "kv_full") -> xr.DataArray:
    return xr.DataArray(values, dims=("layer", "kv_head"), name=name,
                        coords={"layer": np.arange(values.shape[0]), "kv_head": np.arange(values.shape[1])})


def _group(geometry: Geometry) -> int:
    if geometry.n_kv_heads <= 0 or geometry.n_heads % geometry.n_kv_heads:
        raise KvPolicyError(f"{geometry.n_heads} query heads cannot be grouped over {geometry.n_kv_heads} KV heads")
    return geometry.n_heads // geometry.n_kv_heads


def read_duo_heads(path: str | Path, geometry: Geometry | None = None) -> xr.DataArray:
    """The values of a DuoAttention ``full_attention_heads.tsv`` as a float ``(layer, kv_head)`` array.

    Every line is a layer and holds one tab-separated number per KV head; with ``geometry`` the shape must be
    the model's. Any problem is a :class:`KvPolicyError` naming the file and line."""
    p = Path(path)
    if not p.is_file():
        raise KvPolicyError(f"heads file '{path}' does not exist")
    try:
        text = p.read_bytes().decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise KvPolicyError(f"heads file '{path}': not UTF-8 text (byte {e.start})") from None
    rows: list[list[float]] = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        fields = line.strip().split("\t")
        try:
            values = [float(x) for x in fields]
        except ValueError:
            raise KvPolicyError(f"heads file '{path}' line {number}: not tab-separated numbers: {line[:60]!r}") from None
        if not all(math.isfinite(v) for v in values):
            raise KvPolicyError(f"heads file '{path}' line {number}: a value is not finite")
        if rows and len(values) != len(rows[0]):
            raise KvPolicyError(f"heads file '{path}' line {number}: {len(values)} values, the first line has "
                                f"{len(rows[0])}")
        rows.append(values)
    if not rows:
        raise KvPolicyError(f"heads file '{path}': empty (one line per layer, one value per KV head)")
    arr = np.asarray(rows, dtype=float)
    if geometry is not None and arr.shape != (geometry.n_layers, geometry.n_kv_heads):
        raise KvPolicyError(f"heads file '{path}': {arr.shape[0]} layers x {arr.shape[1]} KV heads, this model has "
                            f"{geometry.n_layers} x {geometry.n_kv_heads}")
    return _kv_array(arr, "kv_gate")


def _top(values: np.ndarray, k: int, what: str) -> np.ndarray:
    """The ``k`` largest entries of a (layer, kv_head) array (NaN last; ties by layer, then KV head)."""
    if k > values.size:
        raise KvPolicyError(f"{what} {k} is more than this model's {values.size} KV heads "
                            f"({values.shape[0]} layers x {values.shape[1]} KV heads)")
    flat = np.nan_to_num(values.astype(float), nan=-np.inf).ravel()
    order = np.lexsort((np.arange(flat.size), -flat))[:k]
    out = np.zeros(values.size, dtype=bool)
    out[order] = True
    return out.reshape(values.shape)


def _aggregate(per_query: np.ndarray, geometry: Geometry, rule: GqaRule) -> np.ndarray:
    """(layer, head) values -> (layer, kv_head) by ``rule`` (max, min or mean over each KV head's group)."""
    grouped = per_query.reshape(geometry.n_layers, geometry.n_kv_heads, _group(geometry))
    if rule == "any":
        return grouped.max(axis=-1)
    if rule == "all":
        return grouped.min(axis=-1)
    return grouped.mean(axis=-1)


def _indicator(heads: Sequence[tuple[int, int]], geometry: Geometry) -> np.ndarray:
    out = np.zeros((geometry.n_layers, geometry.n_heads))
    for layer, head in heads:
        out[layer, head] = 1.0
    return out


def _from_set(heads: Sequence[tuple[int, int]], geometry: Geometry, rule: GqaRule) -> np.ndarray:
    agg = _aggregate(_indicator(heads, geometry), geometry, rule)
    return agg >= 0.5 if rule == "mean" else agg >= 1.0


def _raw_scores(score: xr.DataArray, geometry: Geometry, where: str) -> np.ndarray:
    if set(score.dims) != {"layer", "head"}:
        raise KvPolicyError(f"{where}: `score` has dims {tuple(score.dims)}, not (layer, head)")
    values = score.transpose("layer", "head").values.astype(float)
    if values.shape != (geometry.n_layers, geometry.n_heads):
        raise KvPolicyError(f"{where}: `score` is {values.shape[0]} layers x {values.shape[1]} heads, this model has "
                            f"{geometry.n_layers} x {geometry.n_heads}")
    return values


def _scores(score: xr.DataArray, geometry: Geometry, where: str) -> np.ndarray:
    return np.nan_to_num(_raw_scores(score, geometry, where), nan=-np.inf)


def random_kv_heads(n_full: int, geometry: Geometry, rng: np.random.Generator, *,
                    per_layer: Sequence[int] | None = None, exclude: xr.DataArray | None = None) -> xr.DataArray:
    """``n_full`` KV heads drawn uniformly without replacement (``per_layer[l]`` of layer ``l`` instead, when
    given), as a boolean ``(layer, kv_head)`` array; never one of ``exclude`` (a boolean map) when given."""
    taken = np.zeros((geometry.n_layers, geometry.n_kv_heads), dtype=bool) if exclude is None \
        else exclude.transpose("layer", "kv_head").values.astype(bool)
    out = np.zeros_like(taken)
    if per_layer is None:
        free = np.flatnonzero(~taken.ravel())
        if n_full > free.size:
            raise KvPolicyError(f"cannot draw {n_full} random full KV heads from {free.size} free KV heads")
        out.ravel()[rng.choice(free, size=n_full, replace=False)] = True
    else:
        for layer, need in enumerate(per_layer):
            free = np.flatnonzero(~taken[layer])
            if need > free.size:
                raise KvPolicyError(f"layer {layer}: cannot draw {need} random full KV heads from {free.size}")
            out[layer, rng.choice(free, size=int(need), replace=False)] = True
    return _kv_array(out)


def kv_heads(selection: Any, results: Mapping[str, xr.Dataset], geometry: Geometry, *, gqa: GqaRule = "any",
             rng: np.random.Generator | None = None) -> xr.DataArray:
    """The KV heads a selection keeps in full, as a boolean ``(layer, kv_head)`` array ``kv_full``.

    ``selection`` is a :data:`KvHeadSelection` (None: no head is full). Scored selections (``{from: step}``
    on the step's ``score``, a retrieval-head JSON file with ``top``) rank KV heads by their query heads'
    scores aggregated by ``gqa``; ``top`` counts KV heads and ``threshold`` applies to the aggregate. Lists of
    query heads (pairs, layers, a PASTA file, a retrieval file without ``top``) map to KV heads by ``gqa``.
    A DuoAttention file names KV heads directly (``gqa`` does not apply). ``{from: s, random: true}`` draws
    as many full KV heads at random with ``rng`` (per layer as selected with ``match_layers``)."""
    shape = (geometry.n_layers, geometry.n_kv_heads)
    _group(geometry)
    if selection is None:
        return _kv_array(np.zeros(shape, dtype=bool))
    if isinstance(selection, DuoHeadsFile):
        values = read_duo_heads(selection.file, geometry).values
        full = _top(values, selection.top, "top") if selection.top is not None else values >= selection.threshold
        return _kv_array(full)
    if isinstance(selection, HeadsFrom):
        where = f"heads from step '{selection.from_}'"
        if selection.from_ not in results:
            raise KvPolicyError(f"{where}: the step has no result in this cell")
        if "score" not in results[selection.from_]:
            raise KvPolicyError(f"{where}: the step produced no `score` to rank heads by")
        agg = _aggregate(_scores(results[selection.from_]["score"], geometry, where), geometry, gqa)
        full = _top(agg, selection.top, "top") if selection.top is not None else agg >= selection.threshold
        if selection.random:
            seeded = rng or np.random.default_rng(0)
            if selection.seed is not None:
                seeded = np.random.default_rng([int(seeded.integers(2**32)), selection.seed])
            per_layer = full.sum(axis=1).tolist() if selection.match_layers else None
            return random_kv_heads(int(full.sum()), geometry, seeded, per_layer=per_layer)
        return _kv_array(full)
    if isinstance(selection, HeadsFile):
        try:
            heads = read_heads_file(selection.file, geometry)
        except ValueError as e:
            raise KvPolicyError(str(e)) from None
        data = json.loads(Path(selection.file).read_bytes().decode("utf-8-sig"))
        scored = isinstance(data, Mapping) and data and all("-" in str(k) for k in data)
        if selection.top is not None and scored:
            per_query = np.full((geometry.n_layers, geometry.n_heads), -np.inf)
            for (layer, head), value in from_retrieval_json(data).items():
                per_query[layer, head] = value if math.isfinite(value) else -np.inf
            return _kv_array(_top(_aggregate(per_query, geometry, gqa), selection.top, "top"))
        if selection.top is not None:
            raise KvPolicyError(f"heads file '{selection.file}': `top` needs scores (the retrieval-head format "
                                "{\"<layer>-<head>\": [scores]}); a PASTA list has none")
        return _kv_array(_from_set(heads, geometry, gqa))
    if isinstance(selection, ScoresFrom):
        raise KvPolicyError(f"heads from step '{selection.from_}': {{from: ...}} without `top` or `threshold` ranks "
                            "every head for a budget; give `top`, `threshold` or a `budget`")
    if isinstance(selection, ScoresFile):
        if selection.threshold is None:
            raise KvPolicyError(f"heads file '{selection.file}': give `threshold` (or a `budget` to rank its heads)")
        return _kv_array(_kv_scores(selection, results, geometry, gqa) >= selection.threshold)
    try:
        heads = select_heads(selection, {}, geometry)
    except ValueError as e:
        raise KvPolicyError(str(e)) from None
    return _kv_array(_from_set(heads, geometry, gqa))


# --- head scores and budget rankings -------------------------------------------------------------------


def read_head_scores(path: str | Path, geometry: Geometry | None = None) -> xr.DataArray:
    """The per-head scores of a retrieval-head / HeadKV JSON file ``{"<layer>-<head>": [scores]}`` (keys in any
    order; a list or a single number per head) as a float ``(layer, head)`` array ``score``: the mean of each
    head's list, NaN for a head the file does not name. With ``geometry`` every head must lie inside the model.
    Any problem is a :class:`KvPolicyError` naming the file."""
    p = Path(path)
    if not p.is_file():
        raise KvPolicyError(f"heads file '{path}' does not exist")
    try:
        data = json.loads(p.read_bytes().decode("utf-8-sig"))
    except UnicodeDecodeError as e:
        raise KvPolicyError(f"heads file '{path}': not UTF-8 text (byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise KvPolicyError(f"heads file '{path}' line {e.lineno} column {e.colno}: not JSON: {e.msg}") from None
    if not (isinstance(data, Mapping) and data and all("-" in str(k) for k in data)):
        raise KvPolicyError(f"heads file '{path}': not a head-score file {{\"<layer>-<head>\": [scores]}} (a PASTA "
                            "head list has no scores)")
    try:
        scores = from_retrieval_json(data)
    except (ValueError, TypeError) as e:
        raise KvPolicyError(f"heads file '{path}': a key is not \"<layer>-<head>\" or a value not a list of "
                            f"numbers ({e})") from None
    if any(layer < 0 or head < 0 for layer, head in scores):
        raise KvPolicyError(f"heads file '{path}': a negative layer or head index")
    shape = (max(layer for layer, _ in scores) + 1, max(head for _, head in scores) + 1)
    if geometry is not None:
        outside = [lh for lh in scores if lh[0] >= geometry.n_layers or lh[1] >= geometry.n_heads]
        if outside:
            raise KvPolicyError(f"heads file '{path}': head {outside[0][0]}-{outside[0][1]} is outside this model "
                                f"({geometry.n_layers} layers x {geometry.n_heads} heads)")
        shape = (geometry.n_layers, geometry.n_heads)
    out = np.full(shape, np.nan)
    for (layer, head), value in scores.items():
        if not math.isfinite(value):
            raise KvPolicyError(f"heads file '{path}': the score of head {layer}-{head} is not finite")
        out[layer, head] = value
    return xr.DataArray(out, dims=("layer", "head"), name="score",
                        coords={"layer": np.arange(shape[0]), "head": np.arange(shape[1])})


def head_scores(source: ScoresFrom | ScoresFile | HeadsFrom, results: Mapping[str, xr.Dataset],
                geometry: Geometry) -> xr.DataArray:
    """The scores a :data:`HeadScoreSource` gives: a ``(layer, head)`` array for a step's ``score`` or a JSON
    file (NaN where a head has none), a ``(layer, kv_head)`` one for a DuoAttention ``.tsv``."""
    if isinstance(source, (ScoresFrom, HeadsFrom)):
        where = f"heads from step '{source.from_}'"
        if source.from_ not in results:
            raise KvPolicyError(f"{where}: the step has no result in this cell")
        if "score" not in results[source.from_]:
            raise KvPolicyError(f"{where}: the step produced no `score` to rank heads by")
        values = _raw_scores(results[source.from_]["score"], geometry, where)
        return xr.DataArray(values, dims=("layer", "head"), name="score",
                            coords={"layer": np.arange(values.shape[0]), "head": np.arange(values.shape[1])})
    if str(source.file).lower().endswith(".tsv"):
        return read_duo_heads(source.file, geometry)
    return read_head_scores(source.file, geometry)


def kv_head_scores(source: ScoresFrom | ScoresFile, results: Mapping[str, xr.Dataset], geometry: Geometry, *,
                   gqa: GqaRule = "any") -> xr.DataArray:
    """A :data:`HeadScoreSource`'s scores per KV head, a float ``(layer, kv_head)`` array ``kv_score``: query
    heads aggregated by ``gqa`` (max, min or mean over each KV head's group; NaN where one has no score); a
    DuoAttention file's values as they are."""
    scores = head_scores(source, results, geometry)
    values = scores.values.astype(float)
    if "head" in scores.dims:
        values = _aggregate(values, geometry, gqa)
    return _kv_array(values, "kv_score")


def _kv_scores(source: Any, results: Mapping[str, xr.Dataset], geometry: Geometry, gqa: GqaRule) -> np.ndarray:
    """KV-head scores of a source for ranking (``gqa`` over each KV head's query heads; no score: -inf)."""
    scores = head_scores(source, results, geometry)
    values = scores.values.astype(float)
    values = np.where(np.isnan(values), -np.inf, values)
    return _aggregate(values, geometry, gqa) if "head" in scores.dims else values


def _is_scored_file(path: str) -> bool:
    data = json.loads(Path(path).read_bytes().decode("utf-8-sig"))
    return bool(isinstance(data, Mapping) and data and all("-" in str(k) for k in data))


def kv_priority(selection: Any, results: Mapping[str, xr.Dataset], geometry: Geometry, *, gqa: GqaRule = "any",
                rng: np.random.Generator | None = None) -> xr.DataArray:
    """The order in which a budget makes KV heads full: a float ``(layer, kv_head)`` array ``kv_priority``,
    higher first (ties by layer, then KV head), ``-inf`` for a KV head the selection never makes full.

    Scored selections rank by their KV-head scores (query heads aggregated by ``gqa``), and their cut
    (``top``, ``threshold``), when they have one, bounds the candidates; ``{from: step}``, a head-score file
    without ``top`` and a DuoAttention file without an explicit ``top`` or ``threshold`` rank every KV head.
    Lists of heads and random draws are candidates of equal priority."""
    _group(geometry)
    if selection is None:
        raise KvPolicyError("a budget ranks KV heads by `full_heads`: give a head selection with scores "
                            "({from: step} ranks every head)")
    if isinstance(selection, ScoresFrom):
        return _kv_array(_kv_scores(selection, results, geometry, gqa), "kv_priority")
    if isinstance(selection, ScoresFile):
        scores = _kv_scores(selection, results, geometry, gqa)
        if selection.threshold is not None:
            scores = np.where(scores >= selection.threshold, scores, -np.inf)
        return _kv_array(scores, "kv_priority")
    if isinstance(selection, DuoHeadsFile):
        values = read_duo_heads(selection.file, geometry).values.astype(float)
        if {"top", "threshold"} & selection.model_fields_set:
            values = np.where(kv_heads(selection, results, geometry).values, values, -np.inf)
        return _kv_array(values, "kv_priority")
    if isinstance(selection, HeadsFrom) and not selection.random:
        chosen = kv_heads(selection, results, geometry, gqa=gqa)
        return _kv_array(np.where(chosen.values, _kv_scores(selection, results, geometry, gqa), -np.inf),
                         "kv_priority")
    if isinstance(selection, HeadsFile):
        chosen = kv_heads(selection, results, geometry, gqa=gqa)  # checks the file
        if _is_scored_file(selection.file):
            scores = _kv_scores(ScoresFile(file=selection.file), results, geometry, gqa)
            return _kv_array(np.where(chosen.values if selection.top is not None else np.isfinite(scores), scores,
                                      -np.inf), "kv_priority")
        return _kv_array(np.where(chosen.values, 0.0, -np.inf), "kv_priority")
    chosen = kv_heads(selection, results, geometry, gqa=gqa, rng=rng)
    return _kv_array(np.where(chosen.values, 0.0, -np.inf), "kv_priority")


def token_bytes(geometry: Geometry, dtype: str | torch.dtype) -> int:
    """Bytes one token's key and value take in one KV head: ``2 * head_dim * itemsize`` of ``dtype`` (a torch
    dtype or its name, ``"bfloat16"``)."""
    resolved = getattr(torch, dtype, None) if isinstance(dtype, str) else dtype
    if not isinstance(resolved, torch.dtype):
        raise KvPolicyError(f"dtype {dtype!r} is not a torch dtype")
    return 2 * geometry.head_dim * torch.empty((), dtype=resolved).element_size()


_BYTES_MAX = 2**53


class KvBudget(StrictModel):
    """How much KV cache a policy keeps per row (one sequence of the batch): a ``fraction`` of what the full
    cache holds, a number of ``bytes`` (keys and values of every layer), or a mean number of tokens per KV head
    (``tokens_per_head``), met at a context of ``length`` tokens per row (by default the length the step
    resolves the map at: its longest row at the end of the step)."""

    fraction: Annotated[float, Field(gt=0, le=1)] | None = Field(
        None, description="kept fraction of the full cache's keys and values (sinks, windows, GQA included)")
    bytes: Annotated[int, Field(ge=1, le=_BYTES_MAX)] | None = Field(
        None, description="bytes of keys and values kept per row, over all layers (the model's dtype)")
    tokens_per_head: Annotated[float, Field(gt=0, le=MAX_FLOAT)] | None = Field(
        None, description="mean tokens a KV head keeps per row (HeadKV's 'KV size')")
    length: PositiveInt | None = Field(
        None, description="tokens per row at which the budget is met (default: the step's context length)")

    @model_validator(mode="after")
    def _one_size(self) -> KvBudget:
        given = [name for name in ("fraction", "bytes", "tokens_per_head") if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError("give exactly one of `fraction`, `bytes` and `tokens_per_head`"
                             + (f" (got {', '.join(given)})" if given else ""))
        return self

    def describe(self) -> str:
        """The budget in words, ``"fraction 0.3"``, ``"4096 bytes"``, ``"128 tokens per KV head"``."""
        if self.fraction is not None:
            return f"fraction {self.fraction:g}"
        if self.bytes is not None:
            return f"{self.bytes} bytes"
        return f"{self.tokens_per_head:g} tokens per KV head"

    def tokens(self, n_kv_heads: int, length: int, bytes_per_token: int | None = None) -> float:
        """Tokens the budget lets a row keep over all ``n_kv_heads`` KV heads of the model at ``length`` tokens
        per row (``bytes_per_token``: :func:`token_bytes`, needed for a ``bytes`` budget)."""
        if self.fraction is not None:
            return self.fraction * n_kv_heads * length
        if self.bytes is not None:
            if not bytes_per_token:
                raise KvPolicyError("a `bytes` budget needs the bytes of one token's key and value (the dtype)")
            return self.bytes / bytes_per_token
        return float(self.tokens_per_head) * n_kv_heads


_EPS = 1e-9


@dataclass(frozen=True)
class HeadMap:
    """What a KV policy keeps: ``kv_full`` (bool, ``(layer, kv_head)``) marks the KV heads that keep every
    token; every other KV head keeps its row's ``sink`` first tokens and ``window`` most recent tokens (the
    window includes the current query's token). ``window`` is None only when every head is full. With
    ``compensate`` a compressed KV head also keeps one compensation token, the mean of the keys and values it
    dropped (RazorAttention). ``attrs`` describe the policy (stored with :meth:`to_dataarray`).

    ``prefill`` says what a compressed head attends in a row's first forward (its prefill): ``"bounded"`` (the
    default), its sinks and window as in decode; ``"full"``, every earlier token of the prompt, as every head
    does (kvpress's and DuoAttention's deployment: the cache keeps only the sinks and window afterwards). The
    cache holds the same keys either way; later forwards are decode steps under the bounded mask.

    A *budgeted* map (:meth:`budgeted`) is pending until a context length is known: ``budget`` and
    ``priority`` (the order in which KV heads become full) are set, ``kv_full`` is all False, and
    :meth:`for_length` (which :meth:`kept_tokens`, :meth:`kept_fraction` and :meth:`to_dataarray` call) makes
    the largest number of KV heads full that the budget fits at that length."""

    kv_full: xr.DataArray
    sink: int = 0
    window: int | None = None
    attrs: Mapping[str, Any] = field(default_factory=dict)
    compensate: bool = False
    budget: KvBudget | None = None
    priority: xr.DataArray | None = None
    token_bytes: int | None = None
    prefill: Literal["bounded", "full"] = "bounded"

    def _check_kv_full(self) -> None:
        if tuple(self.kv_full.dims) != ("layer", "kv_head"):
            raise KvPolicyError(f"a head map has dims (layer, kv_head), not {tuple(self.kv_full.dims)}")
        if self.kv_full.dtype != bool:
            raise KvPolicyError(f"a head map is boolean, not {self.kv_full.dtype}")
        if self.budget is not None and self.budget.bytes is not None and not self.token_bytes:
            raise KvPolicyError("a `bytes` budget needs `token_bytes` (the bytes of one token's key and value)")

    def __post_init__(self) -> None:
        self._check_kv_full()
        if self.sink < 0:
            raise KvPolicyError(f"sink {self.sink} is negative")
        if self.window is None and not bool(self.kv_full.all()):
            raise KvPolicyError("a head map with compressed heads needs a window")
        if self.window is not None and self.window < 1:
            raise KvPolicyError(f"window {self.window}: a window holds at least the query's own token")
        if self.budget is not None and (self.priority is None or self.priority.shape != self.kv_full.shape):
            raise KvPolicyError("a budgeted head map needs a (layer, kv_head) priority")
        if self.prefill not in ("bounded", "full"):
            raise KvPolicyError(f"prefill {self.prefill!r}: 'bounded' or 'full'")
        if self.prefill == "full" and self.compensate:
            raise KvPolicyError("prefill: full is not available with a compensation token (razor)")

    @classmethod
    def full(cls, geometry: Geometry, **attrs: Any) -> HeadMap:
        """Every KV head keeps every token (today's cache)."""
        return cls(_kv_array(np.ones((geometry.n_layers, geometry.n_kv_heads), dtype=bool)),
                   attrs={"policy": "full", **attrs})

    @classmethod
    def budgeted(cls, priority: xr.DataArray, budget: KvBudget, *, sink: int, window: int,
                 token_bytes: int | None = None, attrs: Mapping[str, Any] | None = None,
                 prefill: Literal["bounded", "full"] = "bounded") -> HeadMap:
        """The map that keeps the most full KV heads (in ``priority`` order, see :func:`kv_priority`) whose
        cache fits ``budget``, every other KV head keeping ``sink`` + ``window`` tokens; resolved now when the
        budget has a ``length``, else pending until :meth:`for_length`."""
        shape = priority.transpose("layer", "kv_head").shape
        pending = cls(_kv_array(np.zeros(shape, dtype=bool)), sink=sink, window=window,
                      attrs={**(attrs or {}), "budget": budget.describe()}, budget=budget,
                      priority=priority.transpose("layer", "kv_head"), token_bytes=token_bytes, prefill=prefill)
        return pending._resolve(budget.length) if budget.length is not None else pending

    @property
    def pending(self) -> bool:
        """Whether a budget still waits for a context length (:meth:`for_length`)."""
        return self.budget is not None

    @property
    def n_layers(self) -> int:
        """Number of layers."""
        return int(self.kv_full.sizes["layer"])

    @property
    def n_kv_heads(self) -> int:
        """Number of KV heads per layer."""
        return int(self.kv_full.sizes["kv_head"])

    @property
    def n_full(self) -> int:
        """Number of full KV heads over all layers."""
        return int(self.kv_full.sum())

    @property
    def is_full(self) -> bool:
        """Whether every KV head keeps every token."""
        return bool(self.kv_full.all())

    def _budget_tokens(self, length: int) -> float:
        return self.budget.tokens(self.n_layers * self.n_kv_heads, length, self.token_bytes)

    def _resolve(self, length: int) -> HeadMap:
        """The pending budget met at ``length`` tokens per row (see :meth:`budgeted`)."""
        if length <= 0:
            raise KvPolicyError(f"length {length}: a budget is met at a context of at least one token")
        total = self.n_layers * self.n_kv_heads
        bounded = min(length, self.sink + self.window)
        allowed = self._budget_tokens(length)
        where = f"budget {self.budget.describe()} at {length} tokens per row"
        if allowed < total * bounded * (1 - _EPS):
            least = f"fraction {bounded / length:.4g}"
            if self.token_bytes:
                least += f", {total * bounded * self.token_bytes} bytes"
            raise KvPolicyError(f"{where}: {allowed / total:.4g} tokens per KV head, below sink {self.sink} + window "
                                f"{self.window} ({bounded} tokens at this length); the least this policy keeps is "
                                f"{least}")
        fits = total if bounded >= length else min(total, math.floor((allowed - total * bounded)
                                                                       / (length - bounded) + _EPS))
        priority = self.priority.values.astype(float)
        priority = np.where(np.isnan(priority), -np.inf, priority)
        candidates = int((priority > -np.inf).sum())
        n = min(fits, candidates)
        attrs = {**self.attrs, "budget_length": int(length), "budget_fraction": allowed / (total * length),
                 "budget_full_kv_heads": int(fits)}
        if n < fits:
            attrs["note"] = f"the budget fits {fits} full KV heads, the selection ranks only {candidates}"
        return type(self)(_kv_array(_top(priority, n, "budget")), sink=self.sink, window=self.window, attrs=attrs,
                          compensate=self.compensate, prefill=self.prefill)

    def kept_tokens(self, length: int) -> xr.DataArray:
        """Tokens each KV head holds after a row of ``length`` tokens, ``(layer, kv_head)``."""
        if self.pending:
            return self.for_length(length).kept_tokens(length)
        bounded = length if self.window is None else min(length, self.sink + self.window)
        if self.compensate and self.window is not None and length > self.sink + self.window:
            bounded += 1  # the compensation token
        return _kv_array(np.where(self.kv_full.values, length, bounded).astype(np.int64), "kv_kept_tokens")

    def kept_fraction(self, length: int) -> float:
        """The fraction of a full cache's keys (and bytes) this map holds after a row of ``length`` tokens:
        sinks, windows and the sharing of a KV head by its query heads included."""
        if length <= 0:
            raise KvPolicyError(f"length {length}: a kept fraction needs at least one token")
        return float(self.kept_tokens(length).sum()) / (self.n_layers * self.n_kv_heads * length)

    def for_length(self, length: int, new_tokens: int = 0) -> HeadMap:
        """This map for rows of at most ``length`` tokens (``length + new_tokens`` with a generation's new
        tokens: what the cache holds at the end): a pending budget met there, and every head full, said in
        ``attrs["note"]``, when ``sink + window`` covers it (no compressed head would drop a token)."""
        length = length + new_tokens
        if self.pending:
            return self._resolve(length).for_length(length)
        if self.is_full or self.window is None or self.sink + self.window < length:
            return self
        note = (f"sink {self.sink} + window {self.window} >= context {length}: no token is dropped, every head "
                "keeps its full cache")
        return HeadMap(xr.ones_like(self.kv_full, dtype=bool), attrs={
            **self.attrs, "effective": "full", "note": note, "requested_full_kv_heads": self.n_full})

    def to_dataarray(self, length: int | None = None) -> xr.DataArray:
        """``kv_full`` with attributes: the policy's, ``sink``, ``window`` and ``prefill`` (absent when every
        head is full), ``full_kv_heads``, and with ``length`` the ``kept_fraction`` at that length (a pending
        budget is met there first; it needs the length)."""
        if self.pending:
            if length is None:
                raise KvPolicyError(f"budget {self.budget.describe()}: the head map is known at a context length; "
                                    "give the length")
            return self.for_length(length).to_dataarray(length)
        out = self.kv_full.copy().rename("kv_full")
        attrs: dict[str, Any] = {k: v for k, v in self.attrs.items() if v is not None}
        attrs.update(sink=self.sink, full_kv_heads=self.n_full)
        if self.compensate:
            attrs["compensate"] = True
        if self.window is not None:
            attrs["window"] = self.window
            if not self.is_full:
                attrs["prefill"] = self.prefill
        if length is not None:
            attrs.update(length=int(length), kept_fraction=self.kept_fraction(length))
        out.attrs = attrs
        return out


def headkv_allocation(scores: np.ndarray | xr.DataArray, base: int, beta: float = 1.5,
                      temp: float = 1.0) -> np.ndarray:
    """HeadKV's split of a per-head budget (Fu et al. 2024): every head gives ``floor(base / beta)`` of its
    ``base`` tokens to a shared pool and keeps the rest; the pool (that share times the number of heads) is
    handed out in proportion to the normalised scores (``s / sum(s)``, raised to ``temp`` and normalised
    again): head ``i`` gets ``round(share_i * pool + base - floor(base / beta))`` tokens (half to even).

    ``scores`` are non-negative with a positive sum, one per head (any shape: the result has it); ``base``
    excludes the observation window."""
    values = np.asarray(scores, dtype=float)
    if base < 0:
        raise KvPolicyError(f"base budget {base} is negative")
    if beta < 1:
        raise KvPolicyError(f"beta {beta} < 1 would give a head a negative minimum")
    share = _shares(values, temp)
    per_head_pool = base // beta
    pool = per_head_pool * values.size
    return np.round(share * pool + (base - per_head_pool)).astype(np.int64)


@dataclass(frozen=True)
class HeadBudgetMap(HeadMap):
    """HeadKV's layout: every KV head keeps its own number of tokens, ``kv_budget`` (int, ``(layer,
    kv_head)``): after the prefill, its ``kv_budget - observation_window`` keys with the highest pooled
    attention from the last ``observation_window`` queries plus those queries' own tokens
    (:func:`snapkv_keep`); tokens generated later are appended to every head. ``kv_full`` marks the KV heads
    whose budget covers the whole prompt (set by :meth:`for_length`). ``sink`` and ``window`` do not apply.

    ``importance`` holds each KV head's share of the pool (it sums to 1); with a ``fraction`` budget and no
    ``length``, the map is pending (``kv_budget`` None) until :meth:`for_length`."""

    kv_budget: xr.DataArray | None = None
    importance: xr.DataArray | None = None
    beta: float = 1.5
    observation_window: int = 8
    kernel_size: int = 7
    pooling: Literal["max", "avg"] = "max"

    def __post_init__(self) -> None:
        self._check_kv_full()
        if self.observation_window < 1:
            raise KvPolicyError(f"observation window {self.observation_window}: at least one query is needed")
        if self.kernel_size < 1 or self.kernel_size % 2 == 0:
            raise KvPolicyError(f"kernel size {self.kernel_size}: an odd pooling width is needed")
        if self.kv_budget is None and (self.budget is None or self.importance is None):
            raise KvPolicyError("a HeadKV map needs per-KV-head budgets, or a budget and importances")
        if self.kv_budget is not None and (tuple(self.kv_budget.dims) != ("layer", "kv_head")
                                           or self.kv_budget.shape != self.kv_full.shape):
            raise KvPolicyError("`kv_budget` is a (layer, kv_head) array of the head map's shape")

    @classmethod
    def allocate(cls, scores: xr.DataArray, budget: KvBudget, *, beta: float = 1.5, temp: float = 1.0,
                 observation_window: int = 8, kernel_size: int = 7, pooling: Literal["max", "avg"] = "max",
                 token_bytes: int | None = None, attrs: Mapping[str, Any] | None = None) -> HeadBudgetMap:
        """HeadKV's map from non-negative KV-head ``scores`` (``(layer, kv_head)``) and a total ``budget``:
        ``B = floor(budget tokens / KV heads)`` is the mean tokens per KV head, the observation window
        included, and :func:`headkv_allocation` splits ``B - observation_window`` by the scores. Pending only
        for a ``fraction`` budget without ``length``."""
        values = scores.transpose("layer", "kv_head")
        try:
            share = _shares(values.values, temp)
        except KvPolicyError as e:
            raise KvPolicyError(f"headkv scores: {e}") from None
        pending = cls(_kv_array(np.zeros(values.shape, dtype=bool)), attrs={**(attrs or {}), "budget": budget.describe()},
                      budget=budget, token_bytes=token_bytes, importance=_kv_array(share, "kv_importance"), beta=beta,
                      observation_window=observation_window, kernel_size=kernel_size, pooling=pooling)
        if budget.length is not None:
            return pending._resolve(budget.length)
        if budget.fraction is None:
            return pending._resolve(1)
        return pending

    def _resolve(self, length: int) -> HeadBudgetMap:
        total = self.n_layers * self.n_kv_heads
        allowed = self._budget_tokens(length)
        mean = math.floor(allowed / total + _EPS)
        where = f"budget {self.budget.describe()}" + (f" at {length} tokens per row" if self.budget.fraction else "")
        if mean < self.observation_window:
            raise KvPolicyError(f"{where}: {mean} tokens per KV head, below the observation window "
                                f"{self.observation_window} every head keeps")
        kept = headkv_allocation(self.importance.values, mean - self.observation_window, self.beta)
        attrs = {**self.attrs, "budget_tokens_per_head": mean}
        if self.budget.fraction is not None:
            attrs["budget_length"] = int(length)
        return replace(self, budget=None, attrs=attrs,
                       kv_budget=_kv_array(kept + self.observation_window, "kv_budget"))

    def kept_tokens(self, length: int, new_tokens: int = 0) -> xr.DataArray:
        """Tokens each KV head holds after a prompt of ``length`` tokens and ``new_tokens`` generated ones:
        ``min(length, kv_budget) + new_tokens`` (``length + new_tokens`` for a full head)."""
        resolved = self.for_length(length)
        if not isinstance(resolved, HeadBudgetMap):
            return resolved.kept_tokens(length + new_tokens)
        budget = np.minimum(resolved.kv_budget.values, length)
        return _kv_array((np.where(resolved.kv_full.values, length, budget) + new_tokens).astype(np.int64),
                         "kv_kept_tokens")

    def kept_fraction(self, length: int, new_tokens: int = 0) -> float:
        """The fraction of a full cache's keys (and bytes) held after a prompt of ``length`` tokens and
        ``new_tokens`` generated ones."""
        if length <= 0:
            raise KvPolicyError(f"length {length}: a kept fraction needs at least one token")
        return float(self.kept_tokens(length, new_tokens).sum()) / (self.n_layers * self.n_kv_heads
                                                                     * (length + new_tokens))

    def for_length(self, length: int, new_tokens: int = 0) -> HeadMap:
        """This map for prompts of at most ``length`` tokens: a pending budget met at ``length``, the prompt
        (HeadKV compresses the prompt; ``new_tokens`` generated later join every head and change nothing
        here); KV heads whose budget covers the prompt are full; when all are, the plain full map with a
        ``note``."""
        resolved = self._resolve(length) if self.pending else self
        full = resolved.kv_full.values | (resolved.kv_budget.values >= length)
        if full.all():
            note = (f"every KV head's budget covers the context of {length} tokens: no token is dropped, every head "
                    "keeps its full cache")
            return HeadMap(xr.ones_like(self.kv_full, dtype=bool), attrs={**resolved.attrs, "effective": "full",
                                                                          "note": note})
        return replace(resolved, kv_full=_kv_array(full))

    def to_dataarray(self, length: int | None = None) -> xr.DataArray:
        """``kv_full`` with attributes: the policy's, ``observation_window``, ``kernel_size``, ``pooling``,
        ``beta``, ``full_kv_heads``, and with ``length`` the ``kept_fraction`` of the prompt (a pending budget
        is met there first; it needs the length). :meth:`budget_dataarray` gives the budgets."""
        if self.pending and length is None:
            raise KvPolicyError(f"budget {self.budget.describe()}: the head map is known at a context length; give "
                                "the length")
        resolved = self if length is None else self.for_length(length)
        if not isinstance(resolved, HeadBudgetMap):
            return resolved.to_dataarray(length)
        out = resolved.kv_full.copy().rename("kv_full")
        attrs: dict[str, Any] = {k: v for k, v in resolved.attrs.items() if v is not None}
        attrs.update(full_kv_heads=resolved.n_full, observation_window=self.observation_window,
                     kernel_size=self.kernel_size, pooling=self.pooling, beta=self.beta)
        if length is not None:
            attrs.update(length=int(length), kept_fraction=resolved.kept_fraction(length))
        out.attrs = attrs
        return out

    def budget_dataarray(self, length: int | None = None) -> xr.DataArray:
        """``kv_budget``: the tokens each KV head keeps after the prefill, ``(layer, kv_head)`` (a pending budget
        is met at ``length`` first)."""
        if self.pending:
            if length is None:
                raise KvPolicyError(f"budget {self.budget.describe()}: the budgets are known at a context length; "
                                    "give the length")
            return self._resolve(length).kv_budget.copy()
        return self.kv_budget.copy()


def _shares(values: np.ndarray, temp: float) -> np.ndarray:
    """HeadKV's normalised scores: ``s / sum(s)`` raised to ``temp``, normalised again."""
    if temp <= 0 or not math.isfinite(temp):
        raise KvPolicyError(f"temp {temp} must be positive and finite")
    if not np.isfinite(values).all() or (values < 0).any() or values.sum() <= 0:
        bad = "a score is missing or not finite" if not np.isfinite(values).all() else \
            ("a score is negative" if (values < 0).any() else "every score is 0")
        raise KvPolicyError(f"HeadKV's allocation needs finite, non-negative head scores with a positive sum ({bad})")
    share = values / values.sum()
    share = share**temp
    return share / share.sum()


def snapkv_keep(keys: torch.Tensor, queries: torch.Tensor, budget: Sequence[int] | torch.Tensor, *,
                kernel_size: int = 7, pooling: Literal["max", "avg"] = "max", pad: Sequence[int] | torch.Tensor | None = None,
                scaling: float | None = None) -> list[torch.Tensor]:
    """The keys each KV head of one layer keeps after the prefill, SnapKV-style (Li et al. 2024, as HeadKV
    uses it): the positions of its ``budget[j] - W`` highest-scoring keys before the observation window plus
    the window's ``W`` own tokens.

    ``keys`` ``[batch, n_kv_heads, seq, head_dim]`` are the layer's keys after prefill (left-padded rows;
    ``pad[b]`` padding tokens, default none) and ``queries`` ``[batch, n_heads, W, head_dim]`` its last ``W``
    queries (both after the rotary embedding); KV head ``j`` serves query heads ``j*g .. (j+1)*g - 1``. A
    key's score is the attention (softmax of ``scaling * q.k``, default ``1/sqrt(head_dim)``, over the row's
    keys causally) it receives, averaged over the window's queries (of the row's own tokens) and the KV head's
    query heads,
    then pooled over neighbouring positions (``pooling`` max or avg, width ``kernel_size``, over the keys
    before the window); ties go to the earlier position. A row with at most ``budget[j]`` tokens keeps them
    all. Returns, per KV head, the kept positions ``[batch, k]`` as indices into ``seq``, ascending, with
    -1 first where a row keeps fewer than the longest row."""
    if keys.dim() != 4 or queries.dim() != 4:
        raise KvPolicyError("keys are [batch, n_kv_heads, seq, head_dim] and queries [batch, n_heads, W, head_dim]")
    batch, n_kv, seq, dim = keys.shape
    n_heads, window = queries.shape[1], queries.shape[2]
    if queries.shape[0] != batch or queries.shape[-1] != dim or n_heads % n_kv:
        raise KvPolicyError(f"queries {tuple(queries.shape)} do not fit keys {tuple(keys.shape)}")
    if window > seq:
        raise KvPolicyError(f"an observation window of {window} queries over {seq} keys")
    if kernel_size < 1 or kernel_size % 2 == 0:
        raise KvPolicyError(f"kernel size {kernel_size}: an odd pooling width is needed")
    budgets = [int(b) for b in (budget.tolist() if isinstance(budget, torch.Tensor) else budget)]
    if len(budgets) != n_kv:
        raise KvPolicyError(f"{len(budgets)} budgets for {n_kv} KV heads")
    if any(b < window for b in budgets):
        raise KvPolicyError(f"a budget of {min(budgets)} tokens is below the observation window of {window}")
    device = keys.device
    pads = torch.zeros(batch, dtype=torch.long, device=device) if pad is None \
        else torch.as_tensor(pad, dtype=torch.long, device=device)
    group = n_heads // n_kv
    positions = torch.arange(seq, device=device)
    query_pos = torch.arange(seq - window, seq, device=device)
    visible = (positions[None, None, :] <= query_pos[None, :, None]) & (positions[None, None, :] >= pads[:, None, None])
    scale = dim**-0.5 if scaling is None else scaling
    # the query heads of a KV head against its keys, without repeating the keys per query head
    grouped = queries.float().reshape(batch, n_kv, group * window, dim)
    logits = torch.matmul(grouped, keys.float().transpose(-1, -2)).view(batch, n_kv, group, window, seq) * scale
    attn = torch.softmax(logits.masked_fill(~visible[:, None, None], float("-inf")), dim=-1)
    # a padding query sees no key (its row is NaN): it adds nothing; a row's mean and sum rank alike
    score = attn.nan_to_num(0.0).mean(dim=(2, 3))[..., : seq - window]
    if seq > window:
        flat = score.reshape(batch * n_kv, 1, seq - window)
        if pooling == "max":
            pooled = F.max_pool1d(flat, kernel_size, stride=1, padding=kernel_size // 2)
        else:
            pooled = F.avg_pool1d(flat, kernel_size, stride=1, padding=kernel_size // 2)
        score = pooled.view(batch, n_kv, seq - window)
    real_key = positions[None, : seq - window] >= pads[:, None]  # (batch, seq - W)
    score = score.masked_fill(~real_key[:, None], float("-inf"))
    in_window = (positions[None, :] >= seq - window) & (positions[None, :] >= pads[:, None])
    out = []
    for head, head_budget in enumerate(budgets):
        keep = in_window.clone()
        picks = min(head_budget - window, seq - window)
        if picks > 0:
            order = torch.sort(score[:, head], dim=-1, descending=True, stable=True).indices[:, :picks]
            chosen = torch.zeros_like(keep)
            chosen.scatter_(1, order, True)
            keep |= chosen & torch.cat([real_key, torch.zeros_like(in_window[:, seq - window:])], dim=1)
        count = int(keep.sum(dim=1).max())
        ranked = torch.sort(torch.where(keep, positions[None, :], -1), dim=1).values
        out.append(ranked[:, seq - count:])
    return out


# --- kvpress interoperability ------------------------------------------------------------------------


@functools.cache
def _press_class(base: type) -> type:
    """A subclass of kvpress's ``DuoAttentionPress`` that takes its streaming heads from a head map instead of
    DuoAttention's published patterns (built once, on first use, so kvpress stays optional)."""

    @dataclass
    class HeadMapPress(base):  # type: ignore[misc, valid-type]
        """kvpress's DuoAttention press with headlab's head map: ``full_heads`` (bool, layers x KV heads) keep
        every key; every other KV head keeps ``sink`` first and ``recent`` last prompt keys."""

        full_heads: torch.Tensor | None = None
        sink: int = 0
        recent: int = 0

        def post_init_from_model(self, model: Any) -> None:
            shape = _model_kv_shape(model)
            if tuple(self.full_heads.shape) != shape:
                raise KvPolicyError(f"the head map has {tuple(self.full_heads.shape)[0]} layers x "
                                    f"{tuple(self.full_heads.shape)[1]} KV heads, this model {shape[0]} x {shape[1]}")
            self.sink_size, self.recent_size = self.sink, self.recent
            device = model.device  # its first parameter's: meta where accelerate offloads it
            self.streaming_mask = ~self.full_heads.to("cpu" if device.type == "meta" else device)

    HeadMapPress.__qualname__ = HeadMapPress.__name__ = "HeadMapPress"
    return HeadMapPress


def _model_kv_shape(model: Any) -> tuple[int, int]:
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return (int(config.num_hidden_layers),
            int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads))


@functools.cache
def _headkv_press_class(base: type) -> type:
    """A kvpress press (subclass of its ``BasePress``) that keeps, per KV head, the keys :func:`snapkv_keep`
    selects for a HeadKV map's budgets, and hides the others from later queries the way kvpress's head-wise
    presses do (``masked_key_indices``)."""
    from kvpress.utils import get_prerope_query_states
    from transformers.models.llama.modeling_llama import rotate_half

    @dataclass
    class HeadKVPress(base):  # type: ignore[misc, valid-type]
        """HeadKV's per-KV-head budgets (``kv_budget``, layers x KV heads) with SnapKV-style selection over the
        last ``observation_window`` prompt queries."""

        kv_budget: torch.Tensor | None = None
        observation_window: int = 8
        kernel_size: int = 7
        pooling: str = "max"

        def post_init_from_model(self, model: Any) -> None:
            shape = _model_kv_shape(model)
            if tuple(self.kv_budget.shape) != shape:
                raise KvPolicyError(f"the head map has {tuple(self.kv_budget.shape)[0]} layers x "
                                    f"{tuple(self.kv_budget.shape)[1]} KV heads, this model {shape[0]} x {shape[1]}")

        def compress(self, module: Any, hidden_states: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                     attentions: Any, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor]:
            window = self.observation_window
            if keys.shape[2] <= window:
                return keys, values
            queries = get_prerope_query_states(module, hidden_states[:, -window:])
            cos, sin = kwargs["position_embeddings"]
            cos, sin = cos[:, -window:].unsqueeze(1), sin[:, -window:].unsqueeze(1)
            queries = queries * cos + rotate_half(queries) * sin
            kept = snapkv_keep(keys, queries, self.kv_budget[module.layer_idx].tolist(), kernel_size=self.kernel_size,
                               pooling=self.pooling, scaling=getattr(module, "scaling", None))
            hidden = torch.ones(keys.shape[:3], dtype=torch.bool, device=keys.device)
            for head, positions in enumerate(kept):
                rows, cols = torch.nonzero(positions >= 0, as_tuple=True)
                hidden[rows, head, positions[rows, cols]] = False
            module.masked_key_indices = torch.nonzero(hidden, as_tuple=True)
            return keys, values

    HeadKVPress.__qualname__ = HeadKVPress.__name__ = "HeadKVPress"
    return HeadKVPress


def to_kvpress(head_map: HeadMap, length: int | None = None) -> Any:
    """The head map as a kvpress press (kvpress 0.5, the ``kvpress`` extra), to run in kvpress's own pipeline.

    A ``streaming`` or ``random`` map becomes a ``DuoAttentionPress`` whose streaming heads
    (``streaming_mask``, layers x KV heads) are the map's compressed KV heads, with ``sink_size = sink`` and
    ``recent_size = window - 1`` (kvpress keeps the last ``recent_size`` prompt keys and every generated one,
    so the first generated token sees exactly the keys it sees under headlab). A ``headkv`` map
    (:class:`HeadBudgetMap`) becomes a press that keeps each KV head's :func:`snapkv_keep` selection after
    the prefill and hides its other keys. A pending budget needs ``length``. docs/kv.md says where kvpress
    differs."""
    if head_map.pending and length is None:
        raise KvPolicyError(f"budget {head_map.budget.describe()}: give the context length to export the map at")
    if isinstance(head_map, HeadBudgetMap):
        resolved = head_map._resolve(length) if head_map.pending else head_map
        budget = torch.as_tensor(resolved.kv_budget.transpose("layer", "kv_head").values, dtype=torch.long)
        return _headkv_press_class(_kvpress("BasePress"))(
            kv_budget=budget, observation_window=resolved.observation_window, kernel_size=resolved.kernel_size,
            pooling=resolved.pooling)
    if length is not None:
        head_map = head_map.for_length(length)
    if not head_map.is_full and head_map.window < 2:
        raise KvPolicyError(f"window {head_map.window}: kvpress keeps `window - 1` recent prompt keys and cannot "
                            "keep none (its DuoAttention press reads 0 as 'all')")
    full = torch.as_tensor(head_map.kv_full.transpose("layer", "kv_head").values, dtype=torch.bool)
    return _press_class(_kvpress("DuoAttentionPress"))(
        head_compression_ratio=float((~full).float().mean()), full_heads=full, sink=head_map.sink,
        recent=0 if head_map.is_full else head_map.window - 1)


def _kvpress(name: str) -> type:
    """A class of kvpress, or the error that says how to install it."""
    try:
        import kvpress
    except ImportError as e:
        raise KvPolicyError(f"kvpress is not importable ({e}): pip install 'headlab[kvpress]' (kvpress 0.5 needs "
                            "transformers < 5.3; docs/kv.md)") from None
    return getattr(kvpress, name)


# --- the cache -----------------------------------------------------------------------------------------


def _grow(buf: torch.Tensor, size: int, dim: int, fill: float | int = 0) -> torch.Tensor:
    """``buf`` extended along ``dim`` to ``size`` entries with ``fill`` (a new tensor; ``buf`` when large enough)."""
    if buf.shape[dim] >= size:
        return buf
    shape = list(buf.shape)
    shape[dim] = size - buf.shape[dim]
    return torch.cat([buf, buf.new_full(shape, fill)], dim=dim)


@dataclass
class SplitCall:
    """One attention call over a :class:`HeadwiseLayer` with compressed heads, as the layer's ``update`` left
    it for the attention that follows: the chunk's keys and values of the compressed KV heads
    (``[batch, n_compressed, q, head_dim]``), ``start`` (tokens stored before the chunk, left padding
    included: the chunk's first token is at padded position ``start``) and, for a chunk of several tokens
    after earlier ones, ``prior``: the bounded group's keys, values and slot positions before the chunk was
    stored (the update overwrites ring slots the chunk's first queries still see) and, under compensation,
    ``prior_comp``: the layer's compensation sums before the chunk (the update adds the chunk's drops to them).
    A one-token chunk reads the bounded group after the update, which holds exactly the keys its query sees.

    ``prefill`` marks a layer's first call on which every head attends causally: the update returned every KV
    head's keys of the chunk (``chunk_keys``/``chunk_values`` are those). On a :class:`HeadBudgetLayer` the
    attention then calls :meth:`HeadBudgetLayer.compress` with its last queries, and a later call reads each
    compressed head's kept keys and new tokens; on a :class:`HeadwiseLayer` with ``full_prefill`` the update
    has already stored the bounded group (the compressed heads' sinks and window), and later calls are decode
    steps over it."""

    layer: HeadwiseLayer
    chunk_keys: torch.Tensor
    chunk_values: torch.Tensor
    start: int
    prior: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    path: str | None = None
    prior_comp: tuple[torch.Tensor, torch.Tensor] | None = None
    prefill: bool = False


_SPLIT = threading.local()
_FORWARD = threading.local()  # ``running``: the HeadwiseCache of the forward running under kv_policy, if any


def _implicit_mask(mask_function: Any, attention_mask: torch.Tensor | None, q_length: int, kv_length: int,
                   q_offset: Any, kv_offset: Any) -> bool:
    """Whether the attention mask of the forward running under :func:`kv_policy` can stay implicit (None, marked
    on the cache's layers): its cache has compressed heads in every layer (so every attention call reads it
    through headlab's split attention, which rebuilds causality and left padding from the layer), the mask is
    transformers' plain causal one over the cache's positions, and the 2-D padding mask is exactly the
    cache's left padding. Otherwise (any other mask pattern, padding the cache does not know) False: the
    dense mask is built as before."""
    from transformers.masking_utils import causal_mask_function

    cache = getattr(_FORWARD, "running", None)
    if cache is None or mask_function is not causal_mask_function or not isinstance(q_offset, int) \
            or kv_offset != 0 or q_offset + q_length != kv_length:
        return False
    layers = cache.layers
    if not layers or not all(isinstance(ly, HeadwiseLayer) and ly.n_compressed for ly in layers):
        return False
    pad = layers[0].pad
    if attention_mask is None:
        if pad is not None and bool((pad > 0).any()):
            return False
    else:
        if attention_mask.dim() != 2 or attention_mask.shape[-1] != kv_length:
            return False
        rows = attention_mask.shape[0]
        pad = torch.zeros(rows, dtype=torch.long) if pad is None else pad
        expect = torch.arange(kv_length, device=attention_mask.device)[None, :] >= pad.to(attention_mask.device)[:, None]
        if expect.shape != attention_mask.shape or not torch.equal(attention_mask.bool(), expect):
            return False
    for layer in layers:
        layer.implicit_mask = True
    return True


def split_call(keys: torch.Tensor) -> SplitCall | None:
    """The pending :class:`SplitCall` whose layer's ``update`` returned ``keys`` (the full group's keys, as an
    attention function receives them), marked read; None for keys of any other cache. An attention that gets
    a SplitCall must attend the full group over ``keys`` and the compressed heads over the bounded group."""
    last = getattr(_SPLIT, "last", None)
    if last is None or last[0] is not keys:
        return None
    _SPLIT.last = None
    last[1].layer.pending = None
    return last[1]


class HeadwiseLayer(CacheLayerMixin):
    """One layer of a :class:`HeadwiseCache`: the full group (``keys``/``values``, ``[batch, n_full, seq,
    head_dim]``, every position including left padding, as :class:`~transformers.DynamicLayer` holds them)
    and the bounded group of the compressed KV heads: ``slot_keys``/``slot_values`` ``[batch, n_compressed,
    slots, head_dim]``, the first ``min(sink, longest row)`` slots the sinks and the others a ring of at most
    ``window`` slots, with each slot's position in its row's own tokens in ``slot_pos`` (-1 while empty).
    With ``compensate``, ``comp_keys``/``comp_values`` ``[batch, n_compressed, 1, head_dim]`` (float32) are
    the sums of the keys and values the bounded group dropped (own positions ``sink <= p < n - window``).

    With ``full_prefill`` the layer's first update (the row's prefill) returns every KV head's keys of the chunk,
    which the attention reads causally for every head, and stores only what the map keeps (the same groups
    as a bounded prefill); a later update of several tokens is refused (the prompt must be the first forward)."""

    is_compileable = False
    is_sliding = False
    is_croppable = False

    def __init__(self, full: Sequence[bool], sink: int, window: int | None, pad: torch.Tensor | None = None, *,
                 compensate: bool = False, full_prefill: bool = False) -> None:
        super().__init__()
        self.full_heads = torch.tensor([i for i, f in enumerate(full) if f], dtype=torch.long)
        self.compressed_heads = torch.tensor([i for i, f in enumerate(full) if not f], dtype=torch.long)
        if len(self.compressed_heads) and window is None:
            raise KvPolicyError("compressed KV heads need a window")
        self.n_kv_heads = len(full)
        self.sink, self.window = int(sink), (None if window is None else int(window))
        self.pad = pad
        self.seen = 0
        self.n_sink = 0
        self.min_pad = self.max_pad = 0
        self.slot_keys = self.slot_values = self.slot_pos = None
        self.compensate = bool(compensate) and len(self.compressed_heads) > 0
        if self.compensate and full_prefill:
            raise KvPolicyError("prefill: full is not available with a compensation token (razor)")
        self.full_prefill = bool(full_prefill)
        #: with ``full_prefill``, a later forward of at most this many tokens is the prompt's question (fed after
        #: the prefill's compression, under the bounded mask; :func:`kv_policy`'s ``question_tokens``), not a
        #: refused piece of the prompt
        self.question_tokens = 0
        self.comp_keys = self.comp_values = None
        self.pending: SplitCall | None = None
        #: the running forward's attention mask was left implicit (None): causal over the padded positions,
        #: the row's ``pad`` first positions padding (set per forward under :func:`kv_policy`)
        self.implicit_mask = False
        self.attention_paths: set[str] = set()  # how the attention read this layer (kv_split records it)

    # the two parts of the bounded group, as views of its slots
    @property
    def sink_keys(self) -> torch.Tensor | None:
        """The sink slots' keys (a view)."""
        return None if self.slot_keys is None else self.slot_keys[:, :, :self.n_sink]

    @property
    def sink_values(self) -> torch.Tensor | None:
        """The sink slots' values (a view)."""
        return None if self.slot_values is None else self.slot_values[:, :, :self.n_sink]

    @property
    def sink_pos(self) -> torch.Tensor | None:
        """The sink slots' positions (a view)."""
        return None if self.slot_pos is None else self.slot_pos[:, :self.n_sink]

    @property
    def ring_keys(self) -> torch.Tensor | None:
        """The ring slots' keys (a view; slot ``s`` holds position ``p`` with ``(p - sink) % window == s``)."""
        return None if self.slot_keys is None else self.slot_keys[:, :, self.n_sink:]

    @property
    def ring_values(self) -> torch.Tensor | None:
        """The ring slots' values (a view)."""
        return None if self.slot_values is None else self.slot_values[:, :, self.n_sink:]

    @property
    def ring_pos(self) -> torch.Tensor | None:
        """The ring slots' positions (a view)."""
        return None if self.slot_pos is None else self.slot_pos[:, self.n_sink:]

    @property
    def n_compressed(self) -> int:
        """Number of compressed KV heads."""
        return len(self.compressed_heads)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        batch, heads, _, dim = key_states.shape
        if heads != self.n_kv_heads:
            raise KvPolicyError(f"the head map has {self.n_kv_heads} KV heads, this layer's keys have {heads}")
        self.device, self.dtype = key_states.device, key_states.dtype
        pad = torch.zeros(batch, dtype=torch.long) if self.pad is None else torch.as_tensor(self.pad, dtype=torch.long)
        if pad.shape != (batch,):
            raise KvPolicyError(f"{pad.numel()} padding lengths for a batch of {batch} rows")
        self.min_pad, self.max_pad = int(pad.min()), int(pad.max())  # the only host sync of the layer
        self.pad = pad.to(self.device)
        self.full_heads = self.full_heads.to(self.device)
        self.compressed_heads = self.compressed_heads.to(self.device)
        n_comp = len(self.compressed_heads)
        self.keys = key_states.new_zeros((batch, len(self.full_heads), 0, dim))
        self.values = value_states.new_zeros((batch, len(self.full_heads), 0, value_states.shape[-1]))
        self.slot_keys = key_states.new_zeros((batch, n_comp, 0, dim))
        self.slot_values = value_states.new_zeros((batch, n_comp, 0, value_states.shape[-1]))
        self.slot_pos = torch.full((batch, 0), -1, dtype=torch.long, device=self.device)
        if self.compensate:
            self.comp_keys = key_states.new_zeros((batch, n_comp, 1, dim), dtype=torch.float32)
            self.comp_values = value_states.new_zeros((batch, n_comp, 1, value_states.shape[-1]), dtype=torch.float32)
        self.n_sink = 0
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the states of the next ``key_states.shape[-2]`` tokens; returns the full group's keys and
        values (every KV head's when the map is full, exactly what :class:`~transformers.DynamicLayer`
        returns). With compressed heads it leaves a :class:`SplitCall` for the attention (:func:`split_call`;
        ``pending`` until an attention reads it); under ``full_prefill`` the first update returns every KV head's
        keys and values of the chunk (the prefill's attention reads them all causally)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if len(self.full_heads) == self.n_kv_heads:
            self.keys = torch.cat([self.keys, key_states], dim=-2)
            self.values = torch.cat([self.values, value_states], dim=-2)
            self.seen += key_states.shape[-2]
            return self.keys, self.values
        q = key_states.shape[-2]
        if self.full_prefill and self.seen and q > max(1, self.question_tokens):
            raise KvPolicyError(f"prefill: full: a forward of {q} tokens after the row's prefill (a prompt fed in "
                                "several forwards, e.g. by prefill_chunk); the first forward must be the whole prompt")
        if len(self.full_heads):
            self.keys = torch.cat([self.keys, key_states.index_select(1, self.full_heads)], dim=-2)
            self.values = torch.cat([self.values, value_states.index_select(1, self.full_heads)], dim=-2)
        else:  # a new (empty) tensor, so that split_call recognises this call's keys
            self.keys = torch.cat([self.keys, key_states[:, :0]], dim=-2)
            self.values = torch.cat([self.values, value_states[:, :0]], dim=-2)
        if self.full_prefill and self.seen == 0:  # the prefill: every head reads this chunk's keys
            self.pending = SplitCall(self, key_states, value_states, 0, prefill=True)
            _SPLIT.last = (key_states, self.pending)
            self._store_bounded(key_states.index_select(1, self.compressed_heads),
                                value_states.index_select(1, self.compressed_heads))
            self.seen = q
            return key_states, value_states
        prior = prior_comp = None
        if q > 1 and self.seen and self.slot_pos.shape[1]:
            prior = (self.slot_keys.clone(), self.slot_values.clone(), self.slot_pos.clone())
            if self.compensate:
                prior_comp = (self.comp_keys.clone(), self.comp_values.clone())
        ck = key_states.index_select(1, self.compressed_heads)
        cv = value_states.index_select(1, self.compressed_heads)
        self.pending = SplitCall(self, ck, cv, self.seen, prior, prior_comp=prior_comp)
        _SPLIT.last = (self.keys, self.pending)
        self._store_bounded(ck, cv)
        self.seen += q
        return self.keys, self.values

    def _store_bounded(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        q = keys.shape[-2]
        own = self.seen + torch.arange(q, device=self.device)[None, :] - self.pad[:, None]  # (batch, q)
        longest = max(0, self.seen + q - self.min_pad)  # real tokens of the longest row after this update
        sink, window = self.sink, self.window
        n_sink, ring = min(sink, longest), min(window, max(0, longest - sink))
        size = n_sink + ring  # the ring only starts once every sink slot exists: growth is at the end
        self.slot_keys = _grow(self.slot_keys, size, 2)
        self.slot_values = _grow(self.slot_values, size, 2)
        self.slot_pos = _grow(self.slot_pos, size, 1, -1)
        self.n_sink = n_sink
        if q == 1 and self.seen >= self.max_pad:  # a decode step: every row's token is real, no host sync
            pos = own[:, 0]
            slot = torch.where(pos < sink, pos, sink + (pos - sink) % window)
            index = slot.view(-1, 1, 1, 1)
            if self.compensate:  # the ring slot's previous token leaves the window: into the sums
                evicted = (self.slot_pos.gather(1, slot[:, None]) >= sink).view(-1, 1, 1, 1)
                for total, buf in ((self.comp_keys, self.slot_keys), (self.comp_values, self.slot_values)):
                    old = buf.gather(2, index.expand(-1, buf.shape[1], 1, buf.shape[3]))
                    total.add_(torch.where(evicted, old.float(), torch.zeros((), device=old.device)))
            self.slot_keys.scatter_(2, index.expand(-1, keys.shape[1], 1, keys.shape[3]), keys)
            self.slot_values.scatter_(2, index.expand(-1, values.shape[1], 1, values.shape[3]), values)
            self.slot_pos.scatter_(1, slot[:, None], pos[:, None])
            return
        count = self.seen + q - self.pad  # each row's real tokens after this update
        if self.compensate:  # the chunk's tokens that are dropped at once
            dropped = ((own >= sink) & (own < (count - window)[:, None]))[:, None, :, None]
            self.comp_keys.add_((keys.float() * dropped).sum(2, keepdim=True))
            self.comp_values.add_((values.float() * dropped).sum(2, keepdim=True))
        rows, cols = torch.nonzero((own >= 0) & (own < sink), as_tuple=True)
        if rows.numel():
            slots = own[rows, cols]
            self.slot_keys[rows, :, slots] = keys[rows, :, cols]
            self.slot_values[rows, :, slots] = values[rows, :, cols]
            self.slot_pos[rows, slots] = slots
        rows, cols = torch.nonzero((own >= sink) & (own >= (count - window)[:, None]), as_tuple=True)
        if rows.numel():
            positions = own[rows, cols]
            slots = sink + (positions - sink) % window
            if self.compensate:  # the tokens these slots held leave the window
                evicted = (self.slot_pos[rows, slots] >= sink)[:, None, None]
                for total, buf in ((self.comp_keys, self.slot_keys), (self.comp_values, self.slot_values)):
                    old = torch.where(evicted, buf[rows, :, slots].float(), torch.zeros((), device=buf.device))
                    total[:, :, 0].index_put_((rows,), old, accumulate=True)
            self.slot_keys[rows, :, slots] = keys[rows, :, cols]
            self.slot_values[rows, :, slots] = values[rows, :, cols]
            self.slot_pos[rows, slots] = positions

    def compressed(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The bounded group: keys and values ``[batch, n_compressed, slots, head_dim]`` (sink slots, then the
        ring, not in position order) and each slot's position in its row's own tokens ``[batch, slots]``
        (-1: an empty slot, to be masked). The layer's own buffers, not copies."""
        if not self.is_initialized:
            raise KvPolicyError("the cache holds nothing yet")
        return self.slot_keys, self.slot_values, self.slot_pos

    def compensation(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The compensation token of each row and compressed head: the mean key and value ``[batch,
        n_compressed, 1, head_dim]`` (in the cache's dtype) of the tokens dropped so far, and their number per
        row ``[batch]`` (0: nothing dropped, no token)."""
        if not self.compensate or not self.is_initialized:
            raise KvPolicyError("this layer keeps no compensation token")
        count = (self.seen - self.pad - self.sink - self.window).clamp(min=0)
        scale = 1.0 / count.clamp(min=1).to(torch.float32).view(-1, 1, 1, 1)
        return ((self.comp_keys * scale).to(self.dtype), (self.comp_values * scale).to(self.dtype), count)

    def _tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.keys, self.values, self.slot_keys, self.slot_values, self.comp_keys,
                            self.comp_values) if t is not None]

    def nbytes(self) -> int:
        """Bytes of the keys and values this layer holds (both groups and the compensation sums; the int64 slot
        positions excluded)."""
        return sum(t.numel() * t.element_size() for t in self._tensors())

    def full_nbytes(self) -> int:
        """Bytes a full cache (:class:`~transformers.DynamicLayer`) would hold for the same tokens."""
        if not self.is_initialized:
            return 0
        batch, dim, vdim = self.keys.shape[0], self.keys.shape[-1], self.values.shape[-1]
        return batch * self.n_kv_heads * self.seen * (dim + vdim) * self.keys.element_size()

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """``(kv_length, kv_offset)`` of the full group's layout: every position seen plus the query's."""
        return self.seen + query_length, 0

    def get_seq_length(self) -> int:
        """Tokens stored so far per row, left padding included (the positions of the full group)."""
        return self.seen

    def get_max_length(self) -> int:
        """-1: the full group grows without bound."""
        return -1

    def reset(self) -> None:
        """Drop every stored token."""
        self.keys = self.values = self.slot_keys = self.slot_values = self.slot_pos = None
        self.comp_keys = self.comp_values = None
        self.seen = self.n_sink = 0
        self.pending = None
        self.is_initialized = False

    def crop(self, tokens_to_remove: int) -> None:
        """Refused: the bounded group has already dropped the tokens a crop would need back."""
        raise KvPolicyError("a headwise KV cache cannot be cropped (its compressed heads dropped old tokens)")

    def _select_rows(self, pick: Any) -> None:
        for name in ("keys", "values", "slot_keys", "slot_values", "slot_pos", "comp_keys", "comp_values", "pad"):
            tensor = getattr(self, name)
            if isinstance(tensor, torch.Tensor):
                setattr(self, name, pick(tensor))
        if isinstance(self.pad, torch.Tensor) and self.pad.numel():
            self.min_pad, self.max_pad = int(self.pad.min()), int(self.pad.max())

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Reorder the rows (beam search)."""
        if self.is_initialized:
            self._select_rows(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat every row ``repeats`` times."""
        if self.is_initialized:
            self._select_rows(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep only the rows ``indices``."""
        if self.is_initialized:
            self._select_rows(lambda t: t[indices.to(t.device) if isinstance(indices, torch.Tensor) else indices])

    def offload(self) -> None:
        """Move every stored tensor to the CPU."""
        if self.is_initialized:
            self._select_rows(lambda t: t.to("cpu", non_blocking=True))

    def prefetch(self) -> None:
        """Move every stored tensor back to the layer's device."""
        if self.is_initialized:
            self._select_rows(lambda t: t.to(self.device, non_blocking=True))


class HeadBudgetLayer(HeadwiseLayer):
    """One layer of a :class:`HeadwiseCache` under a :class:`HeadBudgetMap` (HeadKV): the full group as in
    :class:`HeadwiseLayer`, and for each compressed KV head ``i`` (in ``compressed_heads`` order) its own
    buffers, so that no head holds more than it keeps: ``kept_keys[i]``/``kept_values[i]`` ``[batch, 1, k_i,
    head_dim]``, the prompt keys :func:`snapkv_keep` selected for it (``k_i``: the most any row keeps, at most
    its budget), with their padded indices ``kept_pos[i]`` ``[batch, k_i]`` (ascending; -1 fills the front of a
    row that keeps fewer), and ``new_keys``/``new_values`` ``[batch, n_compressed, n, head_dim]``, the ``n``
    tokens stored after the prefill (every head keeps them all), at padded indices ``prefill_length + t``.

    The prefill (the first update, or with ``prompt_length`` every update until the prompt's ``prompt_length``
    padded positions are stored: a prompt fed in several chunks) stores and returns every KV head's keys of the
    prompt so far; the attention attends them all causally and hands the layer its queries: :meth:`observe`
    after a chunk before the prompt's last, which keeps (only) the last ``observation_window`` of them, and
    :meth:`compress` after the last, which keeps each compressed head's selection and drops the rest."""

    def __init__(self, full: Sequence[bool], budgets: Sequence[int], pad: torch.Tensor | None = None, *,
                 observation_window: int = 8, kernel_size: int = 7, pooling: Literal["max", "avg"] = "max") -> None:
        super().__init__(full, 0, 1, pad)
        if len(budgets) != len(full):
            raise KvPolicyError(f"{len(budgets)} budgets for {len(full)} KV heads")
        self.window = None
        self.budgets = [int(b) for b in budgets]
        self.observation_window, self.kernel_size, self.pooling = int(observation_window), int(kernel_size), pooling
        self.kept_keys: list[torch.Tensor] | None = None
        self.kept_values: list[torch.Tensor] | None = None
        self.kept_pos: list[torch.Tensor] | None = None
        self.new_keys = self.new_values = None
        self.prefill_length = 0
        #: padded positions of the prompt (None: the first update is the whole prompt); every update before
        #: the one that stores the last of them is a chunk of the prefill (:meth:`HeadwiseCache.set_prompt_length`)
        self.prompt_length: int | None = None
        #: the last ``observation_window`` queries of the prefill's chunks so far ``[batch, n_heads, <= W,
        #: head_dim]`` (after the rotary embedding), until :meth:`compress`
        self.window_queries: torch.Tensor | None = None

    @property
    def compressed_budgets(self) -> list[int]:
        """The budgets of the compressed KV heads, in ``compressed_heads`` order."""
        return [self.budgets[int(i)] for i in self.compressed_heads]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the states of the next tokens; returns the keys and values the attention reads causally: in
        the prefill (the first call, or every chunk of a prompt of ``prompt_length`` positions) every KV head's
        keys of the prompt so far, later the full group's. With compressed heads it leaves a :class:`SplitCall`
        (``prefill`` in the prefill) for the attention (:func:`split_call`)."""
        if not len(self.compressed_heads):
            return super().update(key_states, value_states, *args, **kwargs)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        q = key_states.shape[-2]
        if self.kept_keys is None:
            if self.seen and (self.prompt_length is None or self.seen >= self.prompt_length):
                raise KvPolicyError("headkv: the prefill's attention did not compress this layer")
            if self.prompt_length is not None and self.seen + q > self.prompt_length:
                raise KvPolicyError(f"headkv: a chunk of {q} tokens after {self.seen} ends past the prompt's "
                                    f"{self.prompt_length} positions")
            if self.seen:
                self.keys = torch.cat([self.keys, key_states], dim=-2)
                self.values = torch.cat([self.values, value_states], dim=-2)
            else:
                self.keys, self.values = key_states, value_states
            self.pending = SplitCall(self, key_states, value_states, self.seen, prefill=True)
            _SPLIT.last = (self.keys, self.pending)
            self.seen += q
            return self.keys, self.values
        if len(self.full_heads):
            self.keys = torch.cat([self.keys, key_states.index_select(1, self.full_heads)], dim=-2)
            self.values = torch.cat([self.values, value_states.index_select(1, self.full_heads)], dim=-2)
        else:  # a new (empty) tensor, so that split_call recognises this call's keys
            self.keys = torch.cat([self.keys, key_states[:, :0]], dim=-2)
            self.values = torch.cat([self.values, value_states[:, :0]], dim=-2)
        ck = key_states.index_select(1, self.compressed_heads)
        cv = value_states.index_select(1, self.compressed_heads)
        self.new_keys = torch.cat([self.new_keys, ck], dim=-2)
        self.new_values = torch.cat([self.new_values, cv], dim=-2)
        self.pending = SplitCall(self, ck, cv, self.seen)
        _SPLIT.last = (self.keys, self.pending)
        self.seen += q
        return self.keys, self.values

    @property
    def prompt_complete(self) -> bool:
        """Whether the layer has stored the whole prompt and not yet compressed it: the prefill's attention then
        calls :meth:`compress` (else, after an earlier chunk of the prompt, :meth:`observe`)."""
        return self.kept_keys is None and self.seen > 0 and (self.prompt_length is None
                                                              or self.seen >= self.prompt_length)

    def observe(self, queries: torch.Tensor) -> None:
        """After the attention of a chunk of the prompt before its last: keep the last ``observation_window``
        queries of the prefill so far (``queries`` ``[batch, n_heads, q, head_dim]``, the chunk's, after the
        rotary embedding), for the selection at the prompt's end; a copy, so that the chunk's queries are freed."""
        if self.kept_keys is not None:
            raise KvPolicyError("headkv: the layer's prefill was already compressed")
        recent = queries[:, :, -self.observation_window:]
        if self.window_queries is not None:
            recent = torch.cat([self.window_queries, recent], dim=2)[:, :, -self.observation_window:]
        self.window_queries = recent.clone()

    def compress(self, queries: torch.Tensor, scaling: float | None = None) -> None:
        """After the attention of the prefill's last call: keep, per compressed KV head, the prompt keys
        :func:`snapkv_keep` selects from the prompt's last ``observation_window`` queries (those of ``queries``,
        ``[batch, n_heads, q, head_dim]`` after the rotary embedding, preceded by the ones :meth:`observe` kept
        from earlier chunks when ``q`` is shorter than the window) within its budget, and only the full heads'
        keys in the full group. A compressed head whose budget covers the prompt keeps every token of its rows."""
        if self.kept_keys is not None or self.keys is None:
            raise KvPolicyError("headkv: a layer is compressed once, after its prefill")
        if self.window_queries is not None:
            queries = torch.cat([self.window_queries, queries[:, :, -self.observation_window:]], dim=2)
            self.window_queries = None
        keys, values = self.keys, self.values
        batch, _, seq, dim = keys.shape
        group = queries.shape[1] // self.n_kv_heads
        comp = self.compressed_heads
        budgets = self.compressed_budgets
        real = torch.arange(seq, device=keys.device)[None, :] >= self.pad[:, None]  # (batch, seq)
        every = torch.where(real, torch.arange(seq, device=keys.device)[None, :], -1)[:, self.min_pad:]
        select = [i for i, b in enumerate(budgets) if b < seq]  # (a budget is never below the window)
        chosen: dict[int, torch.Tensor] = {}
        if select:
            heads = comp[select]
            qh = (heads[:, None] * group + torch.arange(group, device=keys.device)[None, :]).reshape(-1)
            window = queries[:, :, -self.observation_window:]
            picked = snapkv_keep(keys.index_select(1, heads), window.index_select(1, qh),
                                 [budgets[i] for i in select], kernel_size=self.kernel_size, pooling=self.pooling,
                                 pad=self.pad, scaling=scaling)
            chosen = dict(zip(select, picked, strict=True))
        self.kept_keys, self.kept_values, self.kept_pos = [], [], []
        for i, head in enumerate(comp.tolist()):
            pos = chosen.get(i, every)
            index = pos.clamp(min=0)[:, None, :, None]
            valid = (pos >= 0)[:, None, :, None]
            for out, src in ((self.kept_keys, keys), (self.kept_values, values)):
                taken = src[:, head:head + 1].gather(2, index.expand(-1, -1, -1, src.shape[-1]))
                out.append(torch.where(valid, taken, torch.zeros((), dtype=src.dtype, device=src.device)))
            self.kept_pos.append(pos)
        self.new_keys = keys.new_zeros((batch, len(comp), 0, dim))
        self.new_values = values.new_zeros((batch, len(comp), 0, values.shape[-1]))
        self.keys = keys.index_select(1, self.full_heads)
        self.values = values.index_select(1, self.full_heads)
        self.prefill_length = seq

    def head_cache(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Compressed head ``i``'s keys and values ``[batch, 1, n, head_dim]`` (its kept prompt keys, then the
        tokens stored since) and their padded indices ``[batch, n]`` (-1: an empty slot, to be masked)."""
        if self.kept_keys is None:
            raise KvPolicyError("headkv: the layer keeps nothing until its prefill was compressed")
        n_new = self.new_keys.shape[2]
        new_pos = (self.prefill_length + torch.arange(n_new, device=self.device))[None, :].expand(
            self.kept_pos[i].shape[0], -1)
        return (torch.cat([self.kept_keys[i], self.new_keys[:, i:i + 1]], dim=2),
                torch.cat([self.kept_values[i], self.new_values[:, i:i + 1]], dim=2),
                torch.cat([self.kept_pos[i], new_pos], dim=1))

    def compressed(self) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
        """Every compressed head's :meth:`head_cache`, as three lists (keys, values, padded indices)."""
        parts = [self.head_cache(i) for i in range(len(self.compressed_heads))]
        return [p[0] for p in parts], [p[1] for p in parts], [p[2] for p in parts]

    def kept_keys_per_head(self) -> torch.Tensor:
        """Keys each ``(row, kv_head)`` holds, ``[batch, n_kv_heads]``: every real token of the row for a full
        head, its valid kept slots plus the new tokens for a compressed one."""
        if not self.is_initialized:
            raise KvPolicyError("the cache holds nothing yet")
        out = (self.seen - self.pad)[:, None].repeat(1, self.n_kv_heads)
        if self.kept_pos is not None:
            for i, head in enumerate(self.compressed_heads.tolist()):
                out[:, head] = (self.kept_pos[i] >= 0).sum(1) + self.new_keys.shape[2]
        return out

    def _tensors(self) -> list[torch.Tensor]:
        kept = [*(self.kept_keys or []), *(self.kept_values or [])]
        return [t for t in (self.keys, self.values, self.new_keys, self.new_values, *kept) if t is not None]

    def reset(self) -> None:
        """Drop every stored token."""
        super().reset()
        self.kept_keys = self.kept_values = self.kept_pos = None
        self.new_keys = self.new_values = self.window_queries = None
        self.prefill_length = 0

    def _select_rows(self, pick: Any) -> None:
        super()._select_rows(pick)
        for name in ("new_keys", "new_values", "window_queries"):
            if isinstance(getattr(self, name), torch.Tensor):
                setattr(self, name, pick(getattr(self, name)))
        for name in ("kept_keys", "kept_values", "kept_pos"):
            if getattr(self, name) is not None:
                setattr(self, name, [pick(t) for t in getattr(self, name)])


class HeadwiseCache(Cache):
    """A transformers :class:`~transformers.Cache` laid out by a :class:`HeadMap`: per layer, the full KV
    heads keep every token and the compressed ones only their row's ``sink`` first and ``window`` most recent
    tokens, so compressed heads really hold fewer keys.

    ``pad`` gives each row's number of left-padding tokens (see :meth:`from_attention_mask`); positions are
    counted in each row's own tokens. ``update`` returns the full group's keys and values, identical to
    :class:`~transformers.DynamicCache`'s when the map is full; an attention reads the compressed group with
    :meth:`compressed` (or the :class:`SplitCall` the update leaves). With compressed heads, transformers' own
    attention functions do not read the bounded group: a model runs with headlab's attention, which attends
    each group over its own keys (:func:`kv_policy` checks it).

    Under a :class:`HeadBudgetMap` (HeadKV) the layers are :class:`HeadBudgetLayer`: the prefill attends
    every head in full, then each compressed KV head keeps its SnapKV selection and every later token. Under
    a map with ``prefill="full"`` the first forward attends every head causally over the prompt, and the
    layers keep the same sinks and window as under a bounded prefill."""

    def __init__(self, head_map: HeadMap, pad: Sequence[int] | torch.Tensor | None = None) -> None:
        if head_map.pending:
            raise KvPolicyError("a budgeted head map is known at a context length: call for_length() first")
        self.head_map = head_map
        pad_t = None if pad is None else torch.as_tensor(pad, dtype=torch.long)
        if pad_t is not None and bool((pad_t < 0).any()):
            raise KvPolicyError("a padding length is negative")
        full = head_map.kv_full.transpose("layer", "kv_head").values
        if isinstance(head_map, HeadBudgetMap):
            budgets = head_map.kv_budget.transpose("layer", "kv_head").values
            super().__init__(layers=[HeadBudgetLayer(
                row.tolist(), budget.tolist(), pad_t, observation_window=head_map.observation_window,
                kernel_size=head_map.kernel_size, pooling=head_map.pooling)
                for row, budget in zip(full, budgets, strict=True)])
            return
        super().__init__(layers=[HeadwiseLayer(row.tolist(), head_map.sink, head_map.window, pad_t,
                                               compensate=head_map.compensate,
                                               full_prefill=head_map.prefill == "full") for row in full])

    @classmethod
    def from_attention_mask(cls, head_map: HeadMap, attention_mask: torch.Tensor) -> HeadwiseCache:
        """A cache for a left-padded batch with this 2-D ``attention_mask`` (1: a token, 0: padding, every
        0 before the row's first 1); refuses right or inner padding."""
        mask = torch.as_tensor(attention_mask).bool()
        if mask.dim() != 2:
            raise KvPolicyError(f"an attention mask of {mask.dim()} dims; a 2-D (batch, seq) one is needed")
        pad = (~mask).long().cumprod(dim=1).sum(dim=1)
        if bool((mask.sum(dim=1) != mask.shape[1] - pad).any()):
            raise KvPolicyError("a headwise KV cache needs left padding: a row has padding after its first token")
        return cls(head_map, pad)

    def set_prompt_length(self, tokens: int) -> None:
        """Say that the prompt spans the first ``tokens`` positions of every row (left padding included) and may
        be fed in several forwards: a :class:`HeadBudgetLayer` attends every head over the prompt until it has
        stored them all and compresses at the end of that forward (by default the first forward is the whole
        prompt). Given before the first forward; other layers need nothing."""
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
            raise KvPolicyError(f"a prompt length must be a positive number of tokens, not {tokens!r}")
        if self.get_seq_length():
            raise KvPolicyError("the prompt length is given before the cache stores any token")
        for layer in self.layers:
            if isinstance(layer, HeadBudgetLayer):
                layer.prompt_length = tokens

    def _layer(self, layer_idx: int) -> HeadwiseLayer:
        if not 0 <= layer_idx < len(self.layers):
            raise KvPolicyError(f"layer {layer_idx} is outside this cache ({len(self.layers)} layers)")
        return self.layers[layer_idx]

    def full_heads(self, layer_idx: int) -> torch.Tensor:
        """The KV heads of the full group of a layer, in the order the group stores them."""
        return self._layer(layer_idx).full_heads

    def compressed_heads(self, layer_idx: int) -> torch.Tensor:
        """The KV heads of the bounded group of a layer, in the order the group stores them."""
        return self._layer(layer_idx).compressed_heads

    def full_group(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A layer's full group: keys and values ``[batch, n_full, seq, head_dim]`` at every position of the
        left-padded batch (a row's own position ``p`` is at index ``p + pad[row]``)."""
        layer = self._layer(layer_idx)
        if not layer.is_initialized:
            raise KvPolicyError("the cache holds nothing yet")
        return layer.keys, layer.values

    def compressed(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A layer's bounded group: keys, values and slot positions (see :meth:`HeadwiseLayer.compressed`; a
        :class:`HeadBudgetLayer` gives one tensor per compressed head, :meth:`HeadBudgetLayer.compressed`)."""
        return self._layer(layer_idx).compressed()

    def nbytes(self, layer_idx: int | None = None) -> int:
        """Bytes of the keys and values held, in one layer or (None) all of them."""
        layers = self.layers if layer_idx is None else [self._layer(layer_idx)]
        return sum(layer.nbytes() for layer in layers)

    def full_nbytes(self, layer_idx: int | None = None) -> int:
        """Bytes a :class:`~transformers.DynamicCache` would hold for the same tokens (one layer or all)."""
        layers = self.layers if layer_idx is None else [self._layer(layer_idx)]
        return sum(layer.full_nbytes() for layer in layers)

    def kept_fraction(self) -> float:
        """``nbytes() / full_nbytes()``: the true fraction of a full cache held (NaN before any token)."""
        full = self.full_nbytes()
        return self.nbytes() / full if full else float("nan")

    def layer_nbytes(self) -> xr.DataArray:
        """Bytes held per layer, a ``(layer,)`` array named ``kv_bytes``."""
        return xr.DataArray(np.array([layer.nbytes() for layer in self.layers], dtype=np.int64), dims=("layer",),
                            coords={"layer": np.arange(len(self.layers))}, name="kv_bytes")



# --- peak memory on a CPU ----------------------------------------------------------------------------------


class _LiveBytes(TorchDispatchMode):
    """While active: the peak number of bytes of tensor storage created inside it and alive at the same time
    (``peak``). Every tensor an operator returns on new storage (not a view of, or written into, one of its
    inputs) counts from its creation until its storage is freed; storage that existed before (weights) never
    counts. Operators' internal scratch buffers are not seen."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._refs: dict[weakref.ref, int] = {}

    def _free(self, ref: weakref.ref) -> None:
        self.live -= self._refs.pop(ref, 0)

    def _count(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        if getattr(storage, "_headlab_counted", False):  # several outputs on one new storage
            return
        storage._headlab_counted = True
        nbytes = storage.nbytes()
        self._refs[weakref.ref(storage, self._free)] = nbytes
        self.live += nbytes

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if not _aliases(func):
            if isinstance(out, torch.Tensor):
                self._count(out)
            else:
                for t in tree_leaves(out):
                    if isinstance(t, torch.Tensor):
                        self._count(t)
            if self.live > self.peak:
                self.peak = self.live
        return out


@functools.cache
def _aliases(func: Any) -> bool:
    """Whether an operator's outputs may share storage with its inputs (views, in-place and ``out=`` ops)."""
    schema = getattr(func, "_schema", None)
    return schema is None or any(r.alias_info is not None for r in schema.returns)


# --- running a model under a policy ------------------------------------------------------------------------


def _layer_bytes(layer: Any) -> tuple[int, int]:
    """(bytes held, bytes a full cache would hold) of one cache layer."""
    if isinstance(layer, HeadwiseLayer):
        return layer.nbytes(), layer.full_nbytes()
    held = sum(t.numel() * t.element_size() for t in (getattr(layer, "keys", None), getattr(layer, "values", None))
               if isinstance(t, torch.Tensor))
    return held, held


@dataclass
class KvUsage:
    """What the caches of a :func:`kv_policy` context held: per layer, the bytes of keys and values held by
    each cache at its last forward, summed over the caches (one per prefill: a batch decoded, or a batch of
    rows scored) and so over their rows; what full caches would have held; the attention paths that read
    the split caches; and the peak memory of the context in bytes (``peak_memory``, None when not measured)
    with what it measured (``peak_memory_measure``): ``"cuda max_memory_allocated"``, the CUDA allocator's
    peak (weights included; on a model split across GPUs, the peaks of its GPUs summed, the measure then
    naming them: ``"cuda max_memory_allocated, summed over cuda:0, cuda:1"``); ``"cpu peak live tensor
    bytes"``, the peak bytes of tensors created inside the context and alive at once (weights and anything
    allocated before excluded; operators' internal scratch buffers unseen)."""

    head_map: HeadMap
    layer_bytes: np.ndarray
    layer_full_bytes: np.ndarray
    caches: int = 0
    paths: set[str] = field(default_factory=set)
    peak_memory: int | None = None
    peak_memory_measure: str | None = None
    _current: Any = None

    def _fold(self) -> None:
        cache, self._current = self._current, None
        if cache is None:
            return
        self.caches += 1
        for i, layer in enumerate(getattr(cache, "layers", [])[: len(self.layer_bytes)]):
            held, full = _layer_bytes(layer)
            self.layer_bytes[i] += held
            self.layer_full_bytes[i] += full
            if isinstance(layer, HeadwiseLayer):
                self.paths |= layer.attention_paths

    def _track(self, cache: Any) -> None:
        if cache is not self._current:
            self._fold()
            self._current = cache

    @property
    def nbytes(self) -> int:
        """Bytes held, over every layer and cache."""
        return int(self.layer_bytes.sum())

    @property
    def full_nbytes(self) -> int:
        """Bytes full caches would have held for the same tokens."""
        return int(self.layer_full_bytes.sum())

    def kept_fraction(self) -> float:
        """``nbytes / full_nbytes`` (NaN when no cache held a token)."""
        return self.nbytes / self.full_nbytes if self.full_nbytes else float("nan")

    def to_dataarray(self) -> xr.DataArray:
        """The bytes held per layer, a ``(layer,)`` int64 array named ``kv_bytes``."""
        return xr.DataArray(self.layer_bytes.astype(np.int64), dims=("layer",), name="kv_bytes",
                            coords={"layer": np.arange(len(self.layer_bytes))})


def _decoder(model: Any) -> Any:
    get = getattr(model, "get_decoder", None)
    try:
        inner = get() if callable(get) else None
    except Exception:  # noqa: BLE001 - a model without a separable decoder runs hooked at the top
        inner = None
    return inner if isinstance(inner, torch.nn.Module) else model


_CUDA_PEAK = "cuda max_memory_allocated"
_CPU_PEAK = "cpu peak live tensor bytes"
#: forward arguments :func:`kv_policy`'s ``prefill_chunk`` splits along the sequence, besides the cache
_CHUNKED = ("input_ids", "inputs_embeds", "attention_mask", "position_ids", "cache_position")


def _check_chunkable(head_map: HeadMap, prefill_chunk: int | None) -> None:
    if prefill_chunk is None:
        return
    if isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, int) or prefill_chunk < 1:
        raise KvPolicyError(f"prefill_chunk must be a positive number of tokens, not {prefill_chunk!r}")
    if head_map.prefill == "full" and not head_map.is_full:
        raise KvPolicyError("prefill: full: a chunked prefill is not supported (a later chunk would need the full "
                            "keys of the chunks before it); prefill the prompt in one forward")


def _check_question(head_map: HeadMap, question_tokens: int) -> None:
    if isinstance(question_tokens, bool) or not isinstance(question_tokens, int) or question_tokens < 0:
        raise KvPolicyError(f"question_tokens must be a number of tokens (>= 0), not {question_tokens!r}")
    if not question_tokens or head_map.is_full:
        return
    if isinstance(head_map, HeadBudgetMap):
        raise KvPolicyError("headkv: question_tokens is not supported (its prefill selects each KV head's keys at "
                            "the end of the whole prompt)")
    if head_map.prefill != "full":
        raise KvPolicyError(f"question_tokens {question_tokens}: the question is fed after a full prefill's "
                            "compression; with prefill: bounded every query already attends the compressed cache "
                            "(give prefill: full)")


def _question_plan(n_question: int) -> Any:
    """The split of :func:`kv_policy`'s ``question_tokens``, for :func:`_splitting`: a forward that starts without
    a cache (a prefill) runs as every row's tokens but the last ``n_question`` (the context), then those last
    ``n_question`` columns (the question: left padding makes them every row's last tokens)."""

    def plan(named: dict[str, Any], seq: torch.Tensor, positional: bool) -> list[int] | None:
        if positional:
            raise KvPolicyError("question_tokens: a forward with positional arguments after the input ids cannot be "
                                "split; pass them by name")
        if named.get("cache") is not None or named.get("past_key_values") is not None:
            return None
        mask = named.get("attention_mask")
        real = mask.sum(-1) if isinstance(mask, torch.Tensor) and mask.dim() == 2 else \
            torch.full(seq.shape[:1], seq.shape[1], device=seq.device)
        short = torch.nonzero(real <= n_question).flatten().tolist()
        if short:
            raise KvPolicyError(f"question_tokens {n_question}: row {short[0]} of the batch has "
                                f"{int(real[short[0]])} tokens, so no context before its question (the last "
                                f"{n_question}); give prompts longer than question_tokens")
        n = seq.shape[1]
        return [n - n_question, n]

    return plan


def _chunk_plan(chunk: int) -> Any:
    """The split of :func:`kv_policy`'s ``prefill_chunk``, for :func:`_splitting`: a forward of more than
    ``chunk`` new tokens runs as forwards of ``chunk`` tokens (the last one shorter)."""

    def plan(named: dict[str, Any], seq: torch.Tensor, positional: bool) -> list[int] | None:
        n = seq.shape[1]
        return None if positional or n <= chunk else [*range(chunk, n, chunk), n]

    return plan


def _chunked_forward(forward: Any, ends: Sequence[int], kwargs: dict[str, Any], new_cache: Any, *,
                     what: str = "prefill_chunk") -> Any:
    """``forward(**kwargs)`` fed as forwards ending at the new tokens ``ends`` (the last: all of them) into one
    cache (``new_cache(attention_mask)`` when the forward starts none: a cache laid out for every row's padding):
    the logits (and hidden states) of every chunk concatenated, the cache after the last. ``what`` names the
    option in errors."""
    ids = kwargs.get("input_ids")
    seq = ids if ids is not None else kwargs["inputs_embeds"]
    n = seq.shape[1]
    for name in ("output_attentions", "labels"):
        if kwargs.get(name):
            raise KvPolicyError(f"{what}: a forward with `{name}` cannot be chunked")
    for name, value in kwargs.items():  # e.g. an image's pixels, which belong to one chunk
        if name not in _CHUNKED and isinstance(value, torch.Tensor):
            raise KvPolicyError(f"{what}: a forward with the tensor argument `{name}` cannot be chunked")
    keep = kwargs.pop("logits_to_keep", 0)
    if not isinstance(keep, int):
        raise KvPolicyError(f"{what}: `logits_to_keep` must be a number of positions")
    cache_key = "cache" if "cache" in kwargs or "past_key_values" not in kwargs else "past_key_values"
    cache = kwargs.pop(cache_key, None)
    mask = kwargs.get("attention_mask")
    if mask is not None and mask.dim() != 2:
        raise KvPolicyError(f"{what}: a forward needs a 2-D attention mask, not one of {mask.dim()} dims")
    before = 0 if mask is None else mask.shape[1] - n  # tokens the mask covers ahead of this forward's
    if cache is None:
        cache = new_cache(mask if mask is not None else torch.ones(seq.shape[:2], dtype=torch.long,
                                                                   device=seq.device))
        if isinstance(cache, HeadwiseCache):  # the forward is the prompt: headkv compresses after its last chunk
            cache.set_prompt_length(n)
    logits, hidden, out = [], None, None
    for a, b in zip([0, *ends[:-1]], ends, strict=True):
        part = dict(kwargs)
        for name in ("input_ids", "inputs_embeds", "position_ids", "cache_position"):
            value = kwargs.get(name)
            if value is not None:
                part[name] = value[:, a:b] if name in ("input_ids", "inputs_embeds") else value[..., a:b]
        if mask is not None:
            part["attention_mask"] = mask[:, : before + b]
        part[cache_key] = cache
        part["use_cache"] = True
        if keep:
            part["logits_to_keep"] = min(keep, b - a)
        out = forward(**part)
        cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
        logits.append(out.logits)
        states = getattr(out, "hidden_states", None)
        if states is not None:
            hidden = [[h] for h in states] if hidden is None else [h + [x] for h, x in zip(hidden, states, strict=True)]
    out.logits = torch.cat(logits, dim=1)
    if keep:
        out.logits = out.logits[:, -keep:]
    if hidden is not None:
        out.hidden_states = tuple(torch.cat(h, dim=1) for h in hidden)
    return out


def _cuda_devices(model: torch.nn.Module) -> list[torch.device]:
    """The CUDA devices ``model`` computes on: where its parameters are, and the GPUs its ``device_map`` places
    modules on (an offloaded module's parameters are on ``meta`` between forwards), in index order."""
    found = {p.device for p in model.parameters() if p.device.type == "cuda"}
    for place in (getattr(model, "hf_device_map", None) or {}).values():
        if isinstance(place, int) and not isinstance(place, bool):
            found.add(torch.device("cuda", place))
        elif str(place).startswith("cuda"):
            found.add(torch.device(str(place)))
    indexed = {d if d.index is not None else torch.device("cuda", torch.cuda.current_device()) for d in found}
    return sorted(indexed, key=lambda d: d.index)


@contextlib.contextmanager
def kv_policy(model: torch.nn.Module, head_map: HeadMap, *, prefill_chunk: int | None = None,
              question_tokens: int = 0, cpu_peak: bool = False) -> Any:
    """Run every forward of ``model`` (a transformers causal LM) inside the block with a cache laid out by
    ``head_map``; yields the :class:`KvUsage` (complete once the block exits).

    A forward that starts without a cache (a prefill) gets a :class:`HeadwiseCache` for its left-padded
    attention mask, and ``use_cache`` on; a later forward that continues one keeps it. Under a map with
    every head full the model's own cache is used (the same logits as without the context) and only
    measured. With compressed heads the model must run with headlab's attention (``attn_implementation=
    "headlab"``), which reads each group over its own keys; a forward whose attention left the compressed
    heads unread, or that continues a cache of another type, is a :class:`KvPolicyError`.

    ``prefill_chunk``: a forward of more than this many new tokens runs as forwards of at most that many
    tokens into one cache (the same logits, concatenated, up to float rounding), so that the transient memory
    of a long prompt is bounded by the chunk (under ``razor``, each chunk's queries take their compensation
    tokens from the cache's sums and ring plus the chunk's own prefix). Under ``headkv`` every chunk of a
    prompt attends every head over all earlier prompt keys, which the cache holds until the prompt's last
    chunk, where the selection runs over the prompt's last ``observation_window`` queries (kept across
    chunks): the same kept keys as one forward; there the chunk bounds the activations, not the prompt's
    keys. Refused under ``prefill="full"`` maps with compressed heads.

    ``question_tokens`` (under a ``prefill="full"`` map with compressed heads; 0: off): a forward that starts
    without a cache runs as two forwards into one cache, every row's tokens but its last ``question_tokens``
    (the context: every head attends it in full, then the compressed heads keep their sinks and window), then
    those last tokens (the question), whose compressed heads attend only the kept sinks and window and the
    question's own earlier tokens, as decode steps do: kvpress's context/question split. The rows must be
    left-padded, each with more than ``question_tokens`` tokens. Under a map with every head full nothing is
    split (the question would attend the same keys).

    The peak memory (:attr:`KvUsage.peak_memory`) is measured on CUDA, and on a CPU with ``cpu_peak``
    (every operator inside the block is then tracked, which slows small models down)."""
    _check_chunkable(head_map, prefill_chunk)
    _check_question(head_map, question_tokens)
    compressed = not head_map.is_full
    impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if compressed and impl != "headlab":
        raise KvPolicyError(f"a KV policy with compressed heads needs headlab's attention; this model runs "
                            f"attn_implementation={impl!r}")
    n_layers = head_map.n_layers
    usage = KvUsage(head_map, np.zeros(n_layers, dtype=np.int64), np.zeros(n_layers, dtype=np.int64))
    target = _decoder(model)
    gpus = _cuda_devices(model)
    cuda = gpus[0] if gpus else None
    for gpu in gpus:
        torch.cuda.reset_peak_memory_stats(gpu)

    def before(module: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        kwargs = dict(kwargs)
        kwargs["use_cache"] = True
        if cache is None:
            if compressed:
                mask = kwargs.get("attention_mask")
                if mask is None:
                    ids = kwargs.get("input_ids", args[0] if args else None)
                    if ids is None:
                        ids = kwargs["inputs_embeds"][..., 0]
                    mask = torch.ones(ids.shape[:2], dtype=torch.long, device=ids.device)
                elif mask.dim() != 2:
                    raise KvPolicyError(f"a KV policy needs a 2-D attention mask, not one of {mask.dim()} dims")
                kwargs.pop("past_key_values", None)
                kwargs["cache"] = HeadwiseCache.from_attention_mask(head_map, mask)
        elif compressed and not isinstance(cache, HeadwiseCache):
            raise KvPolicyError(f"a KV policy with compressed heads cannot continue a {type(cache).__name__}")
        running = kwargs.get("cache")
        running = kwargs.get("past_key_values") if running is None else running
        _FORWARD.running = running if isinstance(running, HeadwiseCache) else None
        for layer in getattr(_FORWARD.running, "layers", ()):
            layer.implicit_mask = False
        return args, kwargs

    def after(module: Any, args: tuple, kwargs: dict, output: Any) -> None:
        _FORWARD.running = None
        cache = getattr(output, "cache", None) or getattr(output, "past_key_values", None)
        if isinstance(cache, HeadwiseCache):
            unread = [i for i, layer in enumerate(cache.layers) if layer.pending is not None]
            if unread:
                raise KvPolicyError(f"layer {unread[0]}: the attention did not read the compressed KV heads (the "
                                    "model must run with headlab's attention)")
        if cache is not None:
            usage._track(cache)

    handles = [target.register_forward_pre_hook(before, with_kwargs=True),
               target.register_forward_hook(after, with_kwargs=True)]
    if prefill_chunk is not None:
        handles.append(_splitting(model, _chunk_plan(prefill_chunk), lambda mask: HeadwiseCache.from_attention_mask(
            head_map, mask) if compressed else None, "prefill_chunk"))
    if question_tokens and compressed:
        def question_cache(mask: torch.Tensor) -> HeadwiseCache:
            cache = HeadwiseCache.from_attention_mask(head_map, mask)
            for layer in cache.layers:
                layer.question_tokens = question_tokens
            return cache

        handles.append(_splitting(model, _question_plan(question_tokens), question_cache, "question_tokens"))
    tracker = _LiveBytes() if cuda is None and cpu_peak else None
    try:
        with tracker if tracker is not None else contextlib.nullcontext():
            yield usage
    finally:
        _FORWARD.running = None
        for handle in handles:
            handle.remove()
        usage._fold()
        if cuda is not None:
            usage.peak_memory = sum(int(torch.cuda.max_memory_allocated(gpu)) for gpu in gpus)
            usage.peak_memory_measure = _CUDA_PEAK if len(gpus) == 1 else \
                f"{_CUDA_PEAK}, summed over {', '.join(str(gpu) for gpu in gpus)}"
        elif tracker is not None:
            usage.peak_memory = int(tracker.peak)
            usage.peak_memory_measure = _CPU_PEAK


class _ChunkHandle:
    """Undoes :func:`_splitting`."""

    def __init__(self, model: torch.nn.Module, previous: Any) -> None:
        self.model, self.previous = model, previous

    def remove(self) -> None:
        if self.previous is None:
            self.model.__dict__.pop("forward", None)
        else:
            self.model.forward = self.previous


def _splitting(model: torch.nn.Module, plan: Any, new_cache: Any, what: str) -> _ChunkHandle:
    """``model``'s forward, until the handle is removed, runs a forward that ``plan(named arguments, input ids or
    embeddings, positional arguments after them?)`` splits (the ends of the forwards, in new tokens; None: not
    split) as those forwards into one cache (:func:`_chunked_forward`; ``what`` names the option in errors)."""
    previous = model.__dict__.get("forward")
    plain = model.forward

    @functools.wraps(plain)
    def forward(*args: Any, **kwargs: Any) -> Any:
        named = {"input_ids": args[0], **kwargs} if args else kwargs
        seq = named.get("input_ids")
        seq = seq if seq is not None else named.get("inputs_embeds")
        ends = None if seq is None else plan(named, seq, len(args) > 1)
        if ends is None:
            return plain(*args, **kwargs)
        return _chunked_forward(plain, ends, named, new_cache, what=what)

    model.forward = forward
    return _ChunkHandle(model, previous)
