"""What the built-in contrastive strategies share beyond :mod:`headlab.decoding`: DeCoRe's entropy alpha
and the early-exit parts of a model (DoLa's output head and final norm)."""

from __future__ import annotations

import math
from typing import Any

import torch


def entropy_alpha(logits: torch.Tensor, *, scale: bool = False, cap: float | None = None) -> torch.Tensor:
    """DeCoRe's entropy alpha (docs/methods.md#decore): ``H(softmax(logits))`` in nats, as the reference
    computes it (``-sum p log(p + 1e-12)``), optionally divided by ``log |V|`` and capped at ``cap``."""
    p = logits.float().softmax(-1)
    h = -(p * torch.log(p + 1e-12)).sum(-1)
    if scale:
        h = h / math.log(logits.shape[-1])
    if cap is not None:
        h = torch.clamp(h, max=cap)
    return h


# --------------------------------------------------------------------------- model parts
def output_head(model: Any) -> torch.nn.Module:
    """The language-model head (``get_output_embeddings()``)."""
    head = model.get_output_embeddings()
    if head is None:
        raise ValueError("this model has no output embeddings (lm_head); DoLa needs one")
    return head


def final_norm(model: Any) -> torch.nn.Module:
    """The final normalisation applied before the LM head (``norm``, ``ln_f``, ``final_layer_norm``...)."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    for owner in (decoder, getattr(model, "model", None), getattr(model, "transformer", None)):
        for name in ("norm", "ln_f", "final_layer_norm", "final_layernorm"):
            mod = getattr(owner, name, None) if owner is not None else None
            if isinstance(mod, torch.nn.Module):
                return mod
    raise ValueError(f"cannot find the final norm of {type(model).__name__}; use final_norm: false")


def tied_embeddings(model: Any) -> bool:
    """Whether input and output embeddings are tied (HF's DoLa reads ``config.tie_word_embeddings``)."""
    cfg = model.config
    value = getattr(cfg, "tie_word_embeddings", None)
    if value is None and hasattr(cfg, "get_text_config"):
        value = getattr(cfg.get_text_config(), "tie_word_embeddings", False)
    return bool(value)


