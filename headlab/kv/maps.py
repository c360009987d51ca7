"""Head maps and budgets: what a KV policy keeps per ``(layer, kv_head)``, and HeadKV's allocation.

A :class:`HeadMap` marks the KV heads that keep every token (``kv_full``); every other KV head keeps its
row's ``sink`` first and ``window`` most recent tokens. A :class:`KvBudget` (a kept fraction, a byte size or
a mean of tokens per KV head) makes as many KV heads full as fit at a context length
(:meth:`HeadMap.budgeted`). HeadKV's per-KV-head budgets are a :class:`HeadBudgetMap`
(:func:`headkv_allocation`). :func:`kv_array` and :func:`top_kv_heads` build and cut ``(layer, kv_head)``
arrays for the other modules of the package.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Annotated, Any, Literal

import numpy as np
import torch
import xarray as xr
from pydantic import Field, model_validator

from ..config import StrictModel
from ..geometry import Geometry
from ..spec.fields import MAX_FLOAT, PositiveInt
from .errors import KvPolicyError

__all__ = ["HeadBudgetMap", "HeadMap", "KvBudget", "headkv_allocation", "kv_array", "token_bytes", "top_kv_heads"]


def kv_array(values: np.ndarray, name: str = "kv_full") -> xr.DataArray:
    """``values`` (layers x KV heads) as a ``(layer, kv_head)`` array named ``name``, with integer coordinates."""
    return xr.DataArray(values, dims=("layer", "kv_head"), name=name,
                        coords={"layer": np.arange(values.shape[0]), "kv_head": np.arange(values.shape[1])})


def top_kv_heads(values: np.ndarray, k: int, what: str) -> np.ndarray:
    """The ``k`` largest entries of a (layer, kv_head) array (NaN last; ties by layer, then KV head)."""
    if k > values.size:
        raise KvPolicyError(f"{what} {k} is more than this model's {values.size} KV heads "
                            f"({values.shape[0]} layers x {values.shape[1]} KV heads)")
    flat = np.nan_to_num(values.astype(float), nan=-np.inf).ravel()
    order = np.lexsort((np.arange(flat.size), -flat))[:k]
    out = np.zeros(values.size, dtype=bool)
    out[order] = True
    return out.reshape(values.shape)


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
        return cls(kv_array(np.ones((geometry.n_layers, geometry.n_kv_heads), dtype=bool)),
                   attrs={"policy": "full", **attrs})

    @classmethod
    def budgeted(cls, priority: xr.DataArray, budget: KvBudget, *, sink: int, window: int,
                 token_bytes: int | None = None, attrs: Mapping[str, Any] | None = None,
                 prefill: Literal["bounded", "full"] = "bounded") -> HeadMap:
        """The map that keeps the most full KV heads (in ``priority`` order, see :func:`kv_priority`) whose
        cache fits ``budget``, every other KV head keeping ``sink`` + ``window`` tokens; resolved now when the
        budget has a ``length``, else pending until :meth:`for_length`."""
        shape = priority.transpose("layer", "kv_head").shape
        pending = cls(kv_array(np.zeros(shape, dtype=bool)), sink=sink, window=window,
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
        return type(self)(kv_array(top_kv_heads(priority, n, "budget")), sink=self.sink, window=self.window, attrs=attrs,
                          compensate=self.compensate, prefill=self.prefill)

    def kept_tokens(self, length: int) -> xr.DataArray:
        """Tokens each KV head holds after a row of ``length`` tokens, ``(layer, kv_head)``."""
        if self.pending:
            return self.for_length(length).kept_tokens(length)
        bounded = length if self.window is None else min(length, self.sink + self.window)
        if self.compensate and self.window is not None and length > self.sink + self.window:
            bounded += 1  # the compensation token
        return kv_array(np.where(self.kv_full.values, length, bounded).astype(np.int64), "kv_kept_tokens")

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
        pending = cls(kv_array(np.zeros(values.shape, dtype=bool)), attrs={**(attrs or {}), "budget": budget.describe()},
                      budget=budget, token_bytes=token_bytes, importance=kv_array(share, "kv_importance"), beta=beta,
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
                       kv_budget=kv_array(kept + self.observation_window, "kv_budget"))

    def kept_tokens(self, length: int, new_tokens: int = 0) -> xr.DataArray:
        """Tokens each KV head holds after a prompt of ``length`` tokens and ``new_tokens`` generated ones:
        ``min(length, kv_budget) + new_tokens`` (``length + new_tokens`` for a full head)."""
        resolved = self.for_length(length)
        if not isinstance(resolved, HeadBudgetMap):
            return resolved.kept_tokens(length + new_tokens)
        budget = np.minimum(resolved.kv_budget.values, length)
        return kv_array((np.where(resolved.kv_full.values, length, budget) + new_tokens).astype(np.int64),
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
        return replace(resolved, kv_full=kv_array(full))

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
