"""Spec-facing head selection: which KV heads a policy keeps in full, and per-head scores, from a spec.

The selection types a policy config declares (:data:`KvHeadSelection`, :data:`HeadScoreSource`,
:class:`DuoHeadsFile`, :class:`ScoresFrom`, :class:`ScoresFile`, :data:`GqaRule`) and the readers that
resolve them against a run's results and a model's geometry: :func:`kv_heads` (the boolean ``kv_full``
array), :func:`random_kv_heads` (the control), :func:`kv_priority` (the order a budget fills), the head
score readers (:func:`head_scores`, :func:`kv_head_scores`, :func:`read_head_scores`) and DuoAttention's
file (:func:`read_duo_heads`). Under grouped-query attention, KV head ``j`` serves query heads ``j * g ..
(j + 1) * g - 1`` (``g = n_heads // n_kv_heads``, transformers' ``repeat_kv`` layout), and a query-head
selection becomes a KV-head one by a :data:`GqaRule`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal, Union

import numpy as np
import xarray as xr
from pydantic import Discriminator, Field, Tag

from ..config import StrictModel
from ..geometry import Geometry
from ..heads import from_retrieval_json, read_heads_file, select_heads
from ..spec.fields import FiniteFloat, NonEmptyStr, NonNegativeInt, PositiveInt
from ..spec.heads import HeadsFile, HeadsFrom
from .errors import KvPolicyError
from .maps import kv_array, top_kv_heads

__all__ = ["DuoHeadsFile", "GqaRule", "HeadScoreSource", "KvHeadSelection", "ScoresFile", "ScoresFrom", "head_scores",
           "kv_head_scores", "kv_heads", "kv_priority", "random_kv_heads", "read_duo_heads", "read_head_scores"]


GqaRule = Literal["any", "all", "mean"]
"""How the query heads of a KV head decide it is full: ``any`` (one selected query head suffices; with
scores, KV heads rank by the highest score of their query heads), ``all`` (every query head selected; the
lowest score) or ``mean`` (the mean score; for a plain list of heads, at least half of them selected)."""


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
    return kv_array(arr, "kv_gate")


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
    return kv_array(out)


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
        return kv_array(np.zeros(shape, dtype=bool))
    if isinstance(selection, DuoHeadsFile):
        values = read_duo_heads(selection.file, geometry).values
        full = top_kv_heads(values, selection.top, "top") if selection.top is not None else values >= selection.threshold
        return kv_array(full)
    if isinstance(selection, HeadsFrom):
        where = f"heads from step '{selection.from_}'"
        if selection.from_ not in results:
            raise KvPolicyError(f"{where}: the step has no result in this cell")
        if "score" not in results[selection.from_]:
            raise KvPolicyError(f"{where}: the step produced no `score` to rank heads by")
        agg = _aggregate(_scores(results[selection.from_]["score"], geometry, where), geometry, gqa)
        full = top_kv_heads(agg, selection.top, "top") if selection.top is not None else agg >= selection.threshold
        if selection.random:
            seeded = rng or np.random.default_rng(0)
            if selection.seed is not None:
                seeded = np.random.default_rng([int(seeded.integers(2**32)), selection.seed])
            per_layer = full.sum(axis=1).tolist() if selection.match_layers else None
            return random_kv_heads(int(full.sum()), geometry, seeded, per_layer=per_layer)
        return kv_array(full)
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
            return kv_array(top_kv_heads(_aggregate(per_query, geometry, gqa), selection.top, "top"))
        if selection.top is not None:
            raise KvPolicyError(f"heads file '{selection.file}': `top` needs scores (the retrieval-head format "
                                "{\"<layer>-<head>\": [scores]}); a PASTA list has none")
        return kv_array(_from_set(heads, geometry, gqa))
    if isinstance(selection, ScoresFrom):
        raise KvPolicyError(f"heads from step '{selection.from_}': {{from: ...}} without `top` or `threshold` ranks "
                            "every head for a budget; give `top`, `threshold` or a `budget`")
    if isinstance(selection, ScoresFile):
        if selection.threshold is None:
            raise KvPolicyError(f"heads file '{selection.file}': give `threshold` (or a `budget` to rank its heads)")
        return kv_array(_kv_scores(selection, results, geometry, gqa) >= selection.threshold)
    try:
        heads = select_heads(selection, {}, geometry)
    except ValueError as e:
        raise KvPolicyError(str(e)) from None
    return kv_array(_from_set(heads, geometry, gqa))


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
    return kv_array(values, "kv_score")


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
        return kv_array(_kv_scores(selection, results, geometry, gqa), "kv_priority")
    if isinstance(selection, ScoresFile):
        scores = _kv_scores(selection, results, geometry, gqa)
        if selection.threshold is not None:
            scores = np.where(scores >= selection.threshold, scores, -np.inf)
        return kv_array(scores, "kv_priority")
    if isinstance(selection, DuoHeadsFile):
        values = read_duo_heads(selection.file, geometry).values.astype(float)
        if {"top", "threshold"} & selection.model_fields_set:
            values = np.where(kv_heads(selection, results, geometry).values, values, -np.inf)
        return kv_array(values, "kv_priority")
    if isinstance(selection, HeadsFrom) and not selection.random:
        chosen = kv_heads(selection, results, geometry, gqa=gqa)
        return kv_array(np.where(chosen.values, _kv_scores(selection, results, geometry, gqa), -np.inf),
                         "kv_priority")
    if isinstance(selection, HeadsFile):
        chosen = kv_heads(selection, results, geometry, gqa=gqa)  # checks the file
        if _is_scored_file(selection.file):
            scores = _kv_scores(ScoresFile(file=selection.file), results, geometry, gqa)
            return kv_array(np.where(chosen.values if selection.top is not None else np.isfinite(scores), scores,
                                      -np.inf), "kv_priority")
        return kv_array(np.where(chosen.values, 0.0, -np.inf), "kv_priority")
    chosen = kv_heads(selection, results, geometry, gqa=gqa, rng=rng)
    return kv_array(np.where(chosen.values, 0.0, -np.inf), "kv_priority")
