"""Head geometry of a decoder (layers, query heads, key/value heads, head dimension), read from its config.

A leaf: it imports nothing of headlab, so the model loader (:mod:`headlab.model`), the anatomy
(:mod:`headlab.anatomy`) and head selections (:mod:`headlab.heads`) share it without importing each other.
:mod:`headlab.model` re-exports every name here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["Geometry", "ModelLoadError", "geometry_of"]


class ModelLoadError(Exception):
    """The model could not be loaded; the message says why and what to do."""


@dataclass(frozen=True)
class Geometry:
    """Head geometry of a decoder: layers, query heads, key/value heads, head dimension."""

    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int

    @property
    def n_total_heads(self) -> int:
        """Number of (layer, query head) pairs."""
        return self.n_layers * self.n_heads


def geometry_of(model: Any) -> Geometry:
    """Read the head geometry from a transformers model's (text) config."""
    config = model.config
    if hasattr(config, "get_text_config"):
        config = config.get_text_config()
    layers = getattr(config, "num_hidden_layers", None) or getattr(config, "n_layer", None)
    heads = getattr(config, "num_attention_heads", None) or getattr(config, "n_head", None)
    if not layers or not heads:
        raise ModelLoadError(f"cannot read layers/heads from {type(config).__name__}; is this a decoder model?")
    kv = getattr(config, "num_key_value_heads", None) or heads
    hidden = getattr(config, "hidden_size", None) or getattr(config, "n_embd", None)
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    return Geometry(int(layers), int(heads), int(kv), int(head_dim))
