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

:class:`HeadwiseCache` is a transformers :class:`~transformers.Cache` that stores, per layer, a *full group*
(the full KV heads, every position) and a *bounded group* (the compressed KV heads: ``sink`` slots plus a
ring buffer of ``window`` slots), batched with left padding: positions are counted in each row's own
tokens, so the sinks of a left-padded row are its first real tokens. Its ``nbytes`` are the bytes of the
keys and values it actually holds. An attention that reads each group over its own keys is not part of
this module (docs/kv.md says what is wired).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal, Union

import numpy as np
import torch
import xarray as xr
from pydantic import Discriminator, Field, Tag
from transformers.cache_utils import Cache, CacheLayerMixin

from .config import StrictModel
from .geometry import Geometry
from .heads import from_retrieval_json, read_heads_file, select_heads
from .spec.fields import FiniteFloat, NonEmptyStr, NonNegativeInt, PositiveInt
from .spec.heads import HeadsFile, HeadsFrom

__all__ = ["DuoHeadsFile", "GqaRule", "HeadMap", "HeadwiseCache", "HeadwiseLayer", "KvHeadSelection",
           "KvPolicyError", "kv_heads", "random_kv_heads", "read_duo_heads"]

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


def _selection_form(value: Any) -> str:
    """Which form of KV head selection ``value`` is (a ``.tsv`` file is DuoAttention's format)."""
    if isinstance(value, DuoHeadsFile):
        return "heads[tsv]"
    if isinstance(value, HeadsFile):
        return "heads[file]"
    if isinstance(value, HeadsFrom):
        return "heads[from]"
    if isinstance(value, Mapping):
        if "from" in value or "from_" in value:
            return "heads[from]"
        if "file" in value:
            return "heads[tsv]" if str(value["file"]).lower().endswith(".tsv") else "heads[file]"
        return "heads[layers]"
    return "heads[pairs]"


KvHeadSelection = Annotated[
    Union[  # noqa: UP007
        Annotated[HeadsFrom, Tag("heads[from]")], Annotated[HeadsFile, Tag("heads[file]")],
        Annotated[DuoHeadsFile, Tag("heads[tsv]")],
        Annotated[list[tuple[NonNegativeInt, NonNegativeInt]], Tag("heads[pairs]")],
        Annotated[dict[str, list[NonNegativeInt]], Tag("heads[layers]")]],
    Discriminator(_selection_form)]
"""The heads a KV policy keeps in full: any spec head selection (:data:`headlab.HeadSelection`, query heads
mapped to KV heads by a :data:`GqaRule`) or a DuoAttention ``{file: full_attention_heads.tsv}`` (KV heads)."""


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


def _scores(score: xr.DataArray, geometry: Geometry, where: str) -> np.ndarray:
    if set(score.dims) != {"layer", "head"}:
        raise KvPolicyError(f"{where}: `score` has dims {tuple(score.dims)}, not (layer, head)")
    values = score.transpose("layer", "head").values.astype(float)
    if values.shape != (geometry.n_layers, geometry.n_heads):
        raise KvPolicyError(f"{where}: `score` is {values.shape[0]} layers x {values.shape[1]} heads, this model has "
                            f"{geometry.n_layers} x {geometry.n_heads}")
    return np.nan_to_num(values, nan=-np.inf)


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
    try:
        heads = select_heads(selection, {}, geometry)
    except ValueError as e:
        raise KvPolicyError(str(e)) from None
    return _kv_array(_from_set(heads, geometry, gqa))


@dataclass(frozen=True)
class HeadMap:
    """What a KV policy keeps: ``kv_full`` (bool, ``(layer, kv_head)``) marks the KV heads that keep every
    token; every other KV head keeps its row's ``sink`` first tokens and ``window`` most recent tokens (the
    window includes the current query's token). ``window`` is None only when every head is full. ``attrs``
    describe the policy (stored with :meth:`to_dataarray`)."""

    kv_full: xr.DataArray
    sink: int = 0
    window: int | None = None
    attrs: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if tuple(self.kv_full.dims) != ("layer", "kv_head"):
            raise KvPolicyError(f"a head map has dims (layer, kv_head), not {tuple(self.kv_full.dims)}")
        if self.kv_full.dtype != bool:
            raise KvPolicyError(f"a head map is boolean, not {self.kv_full.dtype}")
        if self.sink < 0:
            raise KvPolicyError(f"sink {self.sink} is negative")
        if self.window is None and not bool(self.kv_full.all()):
            raise KvPolicyError("a head map with compressed heads needs a window")
        if self.window is not None and self.window < 1:
            raise KvPolicyError(f"window {self.window}: a window holds at least the query's own token")

    @classmethod
    def full(cls, geometry: Geometry, **attrs: Any) -> HeadMap:
        """Every KV head keeps every token (today's cache)."""
        return cls(_kv_array(np.ones((geometry.n_layers, geometry.n_kv_heads), dtype=bool)),
                   attrs={"policy": "full", **attrs})

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

    def kept_tokens(self, length: int) -> xr.DataArray:
        """Tokens each KV head holds after a row of ``length`` tokens, ``(layer, kv_head)``."""
        bounded = length if self.window is None else min(length, self.sink + self.window)
        return _kv_array(np.where(self.kv_full.values, length, bounded).astype(np.int64), "kv_kept_tokens")

    def kept_fraction(self, length: int) -> float:
        """The fraction of a full cache's keys (and bytes) this map holds after a row of ``length`` tokens:
        sinks, windows and the sharing of a KV head by its query heads included."""
        if length <= 0:
            raise KvPolicyError(f"length {length}: a kept fraction needs at least one token")
        return float(self.kept_tokens(length).sum()) / (self.n_layers * self.n_kv_heads * length)

    def for_length(self, length: int) -> HeadMap:
        """This map for rows of at most ``length`` tokens: every head full, said in ``attrs["note"]``, when
        ``sink + window`` covers the whole context (no compressed head would drop a token)."""
        if self.is_full or self.window is None or self.sink + self.window < length:
            return self
        note = (f"sink {self.sink} + window {self.window} >= context {length}: no token is dropped, every head "
                "keeps its full cache")
        return HeadMap(xr.ones_like(self.kv_full, dtype=bool), attrs={
            **self.attrs, "effective": "full", "note": note, "requested_full_kv_heads": self.n_full})

    def to_dataarray(self, length: int | None = None) -> xr.DataArray:
        """``kv_full`` with attributes: the policy's, ``sink``, ``window`` (absent when every head is full),
        ``full_kv_heads``, and with ``length`` the ``kept_fraction`` at that length."""
        out = self.kv_full.copy().rename("kv_full")
        attrs: dict[str, Any] = {k: v for k, v in self.attrs.items() if v is not None}
        attrs.update(sink=self.sink, full_kv_heads=self.n_full)
        if self.window is not None:
            attrs["window"] = self.window
        if length is not None:
            attrs.update(length=int(length), kept_fraction=self.kept_fraction(length))
        out.attrs = attrs
        return out


# --- the cache -----------------------------------------------------------------------------------------


def _grow(buf: torch.Tensor, size: int, dim: int, fill: float | int = 0) -> torch.Tensor:
    """``buf`` extended along ``dim`` to ``size`` entries with ``fill`` (a new tensor; ``buf`` when large enough)."""
    if buf.shape[dim] >= size:
        return buf
    shape = list(buf.shape)
    shape[dim] = size - buf.shape[dim]
    return torch.cat([buf, buf.new_full(shape, fill)], dim=dim)


class HeadwiseLayer(CacheLayerMixin):
    """One layer of a :class:`HeadwiseCache`: the full group (``keys``/``values``, ``[batch, n_full, seq,
    head_dim]``, every position including left padding, as :class:`~transformers.DynamicLayer` holds them)
    and the bounded group of the compressed KV heads (``sink`` slots and a ring of ``window`` slots per row,
    each slot's position in its row's own tokens, -1 while empty)."""

    is_compileable = False
    is_sliding = False
    is_croppable = False

    def __init__(self, full: Sequence[bool], sink: int, window: int | None, pad: torch.Tensor | None = None) -> None:
        super().__init__()
        self.full_heads = torch.tensor([i for i, f in enumerate(full) if f], dtype=torch.long)
        self.compressed_heads = torch.tensor([i for i, f in enumerate(full) if not f], dtype=torch.long)
        if len(self.compressed_heads) and window is None:
            raise KvPolicyError("compressed KV heads need a window")
        self.n_kv_heads = len(full)
        self.sink, self.window = int(sink), (None if window is None else int(window))
        self.pad = pad
        self.seen = 0
        self.sink_keys = self.sink_values = self.ring_keys = self.ring_values = None
        self.sink_pos = self.ring_pos = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        batch, heads, _, dim = key_states.shape
        if heads != self.n_kv_heads:
            raise KvPolicyError(f"the head map has {self.n_kv_heads} KV heads, this layer's keys have {heads}")
        self.device, self.dtype = key_states.device, key_states.dtype
        pad = torch.zeros(batch, dtype=torch.long) if self.pad is None else torch.as_tensor(self.pad, dtype=torch.long)
        if pad.shape != (batch,):
            raise KvPolicyError(f"{pad.numel()} padding lengths for a batch of {batch} rows")
        self.pad = pad.to(self.device)
        self.full_heads = self.full_heads.to(self.device)
        self.compressed_heads = self.compressed_heads.to(self.device)
        n_comp = len(self.compressed_heads)
        self.keys = key_states.new_zeros((batch, len(self.full_heads), 0, dim))
        self.values = value_states.new_zeros((batch, len(self.full_heads), 0, value_states.shape[-1]))
        self.sink_keys = key_states.new_zeros((batch, n_comp, 0, dim))
        self.sink_values = value_states.new_zeros((batch, n_comp, 0, value_states.shape[-1]))
        self.ring_keys, self.ring_values = self.sink_keys.clone(), self.sink_values.clone()
        self.sink_pos = torch.full((batch, 0), -1, dtype=torch.long, device=self.device)
        self.ring_pos = self.sink_pos.clone()
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the states of the next ``key_states.shape[-2]`` tokens; returns the full group's keys and
        values (every KV head's when the map is full, exactly what :class:`~transformers.DynamicLayer`
        returns)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if len(self.full_heads) == self.n_kv_heads:
            self.keys = torch.cat([self.keys, key_states], dim=-2)
            self.values = torch.cat([self.values, value_states], dim=-2)
        else:
            if len(self.full_heads):
                self.keys = torch.cat([self.keys, key_states.index_select(1, self.full_heads)], dim=-2)
                self.values = torch.cat([self.values, value_states.index_select(1, self.full_heads)], dim=-2)
            self._store_bounded(key_states.index_select(1, self.compressed_heads),
                                value_states.index_select(1, self.compressed_heads))
        self.seen += key_states.shape[-2]
        return self.keys, self.values

    def _store_bounded(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        q = keys.shape[-2]
        own = self.seen + torch.arange(q, device=self.device)[None, :] - self.pad[:, None]  # (batch, q)
        count = self.seen + q - self.pad  # each row's real tokens after this update
        longest = int(count.max().clamp(min=0))
        sink, window = self.sink, self.window
        self.sink_keys = _grow(self.sink_keys, min(sink, longest), 2)
        self.sink_values = _grow(self.sink_values, min(sink, longest), 2)
        self.sink_pos = _grow(self.sink_pos, min(sink, longest), 1, -1)
        ring = min(window, max(0, longest - sink))
        self.ring_keys = _grow(self.ring_keys, ring, 2)
        self.ring_values = _grow(self.ring_values, ring, 2)
        self.ring_pos = _grow(self.ring_pos, ring, 1, -1)
        rows, cols = torch.nonzero((own >= 0) & (own < sink), as_tuple=True)
        if rows.numel():
            slots = own[rows, cols]
            self.sink_keys[rows, :, slots] = keys[rows, :, cols]
            self.sink_values[rows, :, slots] = values[rows, :, cols]
            self.sink_pos[rows, slots] = slots
        rows, cols = torch.nonzero((own >= sink) & (own >= (count - window)[:, None]), as_tuple=True)
        if rows.numel():
            positions = own[rows, cols]
            slots = (positions - sink) % window
            self.ring_keys[rows, :, slots] = keys[rows, :, cols]
            self.ring_values[rows, :, slots] = values[rows, :, cols]
            self.ring_pos[rows, slots] = positions

    def compressed(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The bounded group: keys and values ``[batch, n_compressed, slots, head_dim]`` (sink slots, then the
        ring, not in position order) and each slot's position in its row's own tokens ``[batch, slots]``
        (-1: an empty slot, to be masked)."""
        if not self.is_initialized:
            raise KvPolicyError("the cache holds nothing yet")
        return (torch.cat([self.sink_keys, self.ring_keys], dim=2), torch.cat([self.sink_values, self.ring_values], 2),
                torch.cat([self.sink_pos, self.ring_pos], dim=1))

    def _tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.keys, self.values, self.sink_keys, self.sink_values, self.ring_keys,
                            self.ring_values) if t is not None]

    def nbytes(self) -> int:
        """Bytes of the keys and values this layer holds (both groups; the int64 slot positions excluded)."""
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
        self.keys = self.values = self.sink_keys = self.sink_values = self.ring_keys = self.ring_values = None
        self.sink_pos = self.ring_pos = None
        self.seen = 0
        self.is_initialized = False

    def crop(self, tokens_to_remove: int) -> None:
        """Refused: the bounded group has already dropped the tokens a crop would need back."""
        raise KvPolicyError("a headwise KV cache cannot be cropped (its compressed heads dropped old tokens)")

    def _select_rows(self, pick: Any) -> None:
        for name in ("keys", "values", "sink_keys", "sink_values", "ring_keys", "ring_values", "sink_pos",
                     "ring_pos", "pad"):
            tensor = getattr(self, name)
            if isinstance(tensor, torch.Tensor):
                setattr(self, name, pick(tensor))

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


class HeadwiseCache(Cache):
    """A transformers :class:`~transformers.Cache` laid out by a :class:`HeadMap`: per layer, the full KV
    heads keep every token and the compressed ones only their row's ``sink`` first and ``window`` most recent
    tokens, so compressed heads really hold fewer keys.

    ``pad`` gives each row's number of left-padding tokens (see :meth:`from_attention_mask`); positions are
    counted in each row's own tokens. ``update`` returns the full group's keys and values, identical to
    :class:`~transformers.DynamicCache`'s when the map is full; an attention reads the compressed group with
    :meth:`compressed`. With compressed heads, transformers' own attention functions do not read the bounded
    group: a model must run with an attention that attends each group over its own keys (not yet wired, see
    docs/kv.md)."""

    def __init__(self, head_map: HeadMap, pad: Sequence[int] | torch.Tensor | None = None) -> None:
        self.head_map = head_map
        pad_t = None if pad is None else torch.as_tensor(pad, dtype=torch.long)
        if pad_t is not None and bool((pad_t < 0).any()):
            raise KvPolicyError("a padding length is negative")
        full = head_map.kv_full.transpose("layer", "kv_head").values
        super().__init__(layers=[HeadwiseLayer(row.tolist(), head_map.sink, head_map.window, pad_t) for row in full])

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
        """A layer's bounded group: keys, values and slot positions (see :meth:`HeadwiseLayer.compressed`)."""
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

