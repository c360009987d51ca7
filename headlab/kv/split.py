"""The split-call contract between a headwise cache layer and headlab's attention.

A :class:`~headlab.kv.layers.HeadwiseLayer` with compressed KV heads leaves, on each ``update``, a
:class:`SplitCall` keyed by the full group's keys it returned (:func:`leave_split`); the attention that
receives those keys takes it with :func:`split_call` and attends each group over its own keys. The cache of
the forward running under :func:`headlab.kv.kv_policy` is known here too (:func:`running_cache`), for the
mask function that may leave the attention mask implicit (:func:`headlab.kv.layers.mask_stays_implicit`).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import CacheLayerMixin

__all__ = ["SplitCall", "leave_split", "running_cache", "set_running_cache", "split_call"]


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

    layer: CacheLayerMixin  # the HeadwiseLayer (or HeadBudgetLayer) that left the call
    chunk_keys: torch.Tensor
    chunk_values: torch.Tensor
    start: int
    prior: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    path: str | None = None
    prior_comp: tuple[torch.Tensor, torch.Tensor] | None = None
    prefill: bool = False


_SPLIT = threading.local()
_FORWARD = threading.local()  # ``running``: the HeadwiseCache of the forward running under kv_policy, if any


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


def leave_split(keys: torch.Tensor, call: SplitCall | None) -> None:
    """Leave ``call`` for the attention that receives ``keys`` (what a layer's ``update`` returned)."""
    _SPLIT.last = (keys, call)


def running_cache() -> Any:
    """The :class:`~headlab.kv.cache.HeadwiseCache` of the forward running under :func:`headlab.kv.kv_policy`
    in this thread (None outside such a forward)."""
    return getattr(_FORWARD, "running", None)


def set_running_cache(cache: Any) -> None:
    """Say which cache the forward now running in this thread uses (None: no forward, or not a headwise one)."""
    _FORWARD.running = cache
