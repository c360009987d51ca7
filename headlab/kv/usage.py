"""Usage accounting: the bytes the caches of a KV policy held, and the peak memory while it ran.

:class:`KvUsage` sums, per layer, what each cache held at its last forward against what full caches would
have held; :class:`LiveBytes` measures the peak of live tensor bytes on a CPU.
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import xarray as xr
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from .layers import HeadwiseLayer
from .maps import HeadMap

__all__ = ["KvUsage", "LiveBytes"]


class LiveBytes(TorchDispatchMode):
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
