"""kvpress export: a head map as a press of NVIDIA's kvpress (an optional dependency), for its own pipeline."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
from transformers.models.llama.modeling_llama import rotate_half

from .errors import KvPolicyError
from .maps import HeadBudgetMap, HeadMap
from .snapkv import snapkv_keep

try:  # the kvpress extra; without it, exporting says how to install it
    import kvpress
    from kvpress.utils import get_prerope_query_states
except ImportError as e:
    kvpress = None
    _MISSING = str(e)

__all__ = ["to_kvpress"]


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
    if kvpress is None:
        raise KvPolicyError(f"kvpress is not importable ({_MISSING}): pip install 'headlab[kvpress]' (kvpress 0.5 "
                            "needs transformers < 5.3; docs/kv.md)")
    return getattr(kvpress, name)
