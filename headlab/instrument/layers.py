"""Which modules of a model are its attention layers, and the models headlab refuses to instrument."""

from __future__ import annotations

from typing import Any

import torch

__all__ = [
    "ATTN_IMPLEMENTATION",
    "REFUSED_KWARGS",
    "REFUSED_MODEL_TYPES",
    "UnsupportedModelError",
    "attention_layers",
    "decoder_layers",
    "text_config",
]

ATTN_IMPLEMENTATION = "headlab"

#: model types whose attention headlab cannot honour (ALiBi, learned position biases, attention sinks,
#: cross-attention): refused with one clear error rather than computed silently wrong
REFUSED_MODEL_TYPES = {
    "bloom": "ALiBi position biases",
    "falcon": "ALiBi / custom attention",
    "mpt": "ALiBi position biases",
    "t5": "relative position biases",
    "mt5": "relative position biases",
    "umt5": "relative position biases",
    "gpt_oss": "attention sinks",
    "longt5": "relative position biases",
}
#: keyword arguments of an attention call that carry a feature the kernels cannot honour
REFUSED_KWARGS = ("position_bias", "s_aux", "sinks", "alibi", "alibi_slopes")


class UnsupportedModelError(RuntimeError):
    """The model's attention has a feature headlab's kernels cannot honour."""


def _configs(model: Any) -> list:
    cfg = model.config
    out = [cfg]
    for name in ("text_config", "vision_config", "audio_config"):
        sub = getattr(cfg, name, None)
        if sub is not None:
            out.append(sub)
    return out


def text_config(model: Any) -> Any:
    """The config of the model's language model (the model's own config when it has no text config)."""
    cfg = model.config
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def attention_layers(model: Any) -> dict[int, int]:
    """Map ``id(attention module) -> layer index`` for the decoder (language model) layers.

    Raises :class:`UnsupportedModelError` for models headlab refuses (see :data:`REFUSED_MODEL_TYPES`,
    cross attention, models not loaded with ``attn_implementation="headlab"``).
    """
    text_cfg = text_config(model)
    for cfg in _configs(model):
        mt = getattr(cfg, "model_type", "")
        if mt in REFUSED_MODEL_TYPES:
            raise UnsupportedModelError(f"headlab does not support model type {mt!r}: {REFUSED_MODEL_TYPES[mt]}")
    if getattr(model.config, "is_encoder_decoder", False):
        raise UnsupportedModelError("headlab supports decoder-only models (and VLMs with a decoder); "
                                    "encoder-decoder cross-attention is not supported")
    impl = getattr(text_cfg, "_attn_implementation", None)
    if impl != ATTN_IMPLEMENTATION:
        raise UnsupportedModelError(
            f"the model's attention implementation is {impl!r}; call headlab.instrument.register() and load it "
            f"with attn_implementation={ATTN_IMPLEMENTATION!r}")
    n_layers = int(text_cfg.num_hidden_layers)
    layer_of: dict[int, int] = {}
    for name, mod in model.named_modules():
        if not type(mod).__name__.endswith("Attention") or not hasattr(mod, "layer_idx"):
            continue
        cfg = getattr(mod, "config", None)
        if cfg is not None and cfg is not text_cfg and getattr(cfg, "model_type", None) != text_cfg.model_type:
            continue
        if getattr(mod, "is_cross_attention", False) or "cross" in name.split(".")[-1]:
            raise UnsupportedModelError(f"headlab: cross-attention module {name} is not supported")
        if mod.layer_idx is None:
            raise UnsupportedModelError(f"headlab: attention module {name} has no layer_idx")
        layer_of[id(mod)] = int(mod.layer_idx)
    found = sorted(set(layer_of.values()))
    if found != list(range(n_layers)):
        raise UnsupportedModelError(
            f"headlab: found attention modules for layers {found}, expected 0..{n_layers - 1} "
            f"({type(model).__name__}); this architecture is not supported")
    return layer_of


def decoder_layers(model: Any) -> list[torch.nn.Module]:
    """The decoder layer modules of the language model, in order (the parents of its attention modules)."""
    layer_of = attention_layers(model)
    by_layer: dict[int, torch.nn.Module] = {}
    for name, mod in model.named_modules():
        idx = layer_of.get(id(mod))
        if idx is not None and idx not in by_layer and "." in name:
            by_layer[idx] = model.get_submodule(name.rsplit(".", 1)[0])
    return [by_layer[i] for i in range(len(by_layer))]
