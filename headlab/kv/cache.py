"""The headwise cache: a transformers ``Cache`` laid out by a head map, one cache layer per model layer."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import xarray as xr
from transformers.cache_utils import Cache

from .errors import KvPolicyError
from .layers import HeadBudgetLayer, HeadwiseLayer
from .maps import HeadBudgetMap, HeadMap

__all__ = ["HeadwiseCache"]


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
