"""The OV circuits of a model's heads, in blocks of the vocabulary (shared by ``successor`` and
``copy_suppression``).

Definition: docs/methods.md#ov-circuits. The OV circuit of head ``(l, h)`` maps a token ``t`` to logits:

    OV[t] = fold_out( fold_in(W_E[t]) W_V[kv(h)] W_O[h] ) W_U

- ``fold_in`` is layer ``l``'s input norm without its scale: ``centre(W_E[t]) * g_in`` (``centre`` subtracts
  the mean for LayerNorm, nothing for RMS norms; ``g_in`` the gain as the module applies it); nothing for
  architectures whose attention reads the residual stream directly (olmo2);
- ``fold_out`` is the final norm without its scale: ``centre(y) * g_final``;
- where the architecture normalises the attention output before the residual stream (gemma2's and olmo2's
  ``post_attention_layernorm``), that norm's gain ``g_post`` multiplies the head's output, before ``fold_out``;
- ``kv(h)`` is the key/value head query head ``h`` reads (grouped-query attention).

Left out: the norms' scales ``1 / s(x)`` (one positive factor per row ``t``, which changes no ranking
within a row), every bias (the norms', ``b_V``, ``b_O``, ``b_U``), the first MLP (no "effective embedding"),
and gemma2's embedding scale and final soft-capping (a positive factor and a monotonic map). The scores
below only compare entries of one row, so of what is left out only the biases could change them.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Literal

import torch
from torch import Tensor

from headlab.plugins.detectors.norms import affine_norm

__all__ = [
    "POST_ATTENTION_NORMS", "Precision", "attention_output_norm", "fold_out", "folded_inputs", "model_type", "ov_rows",
    "rank_counts", "single_token",
]

Precision = Literal["float32", "float64"]
_DTYPES = {"float32": torch.float32, "float64": torch.float64}


def folded_inputs(lm: Any, layer: int, tokens: Tensor, precision: Precision = "float32") -> Tensor:
    """``fold_in(W_E[tokens]) W_V[kv(h)] W_O[h]`` for every head of ``layer``: (head, token, d_model), the
    heads' outputs before the final norm's fold."""
    dtype = _DTYPES[precision]
    W_E = lm.embedding
    x = W_E[tokens.to(W_E.device)].to(dtype)
    d_model = int(W_E.shape[1])
    norm = lm.input_norm(layer)
    if norm is not None:
        with lm.weights_loaded(norm):
            rule = affine_norm(norm, d_model)
        x = rule.centred(x) * rule.gain.to(x.device, dtype)
    hw = lm.head_weights(layer)
    W_V = hw.per_query_head(hw.W_V).to(x.device, dtype)  # (H, d_model, D)
    out = torch.einsum("tm,hmd,hdn->htn", x, W_V, hw.W_O.to(x.device, dtype))
    post = attention_output_norm(lm, layer)
    if post is None:
        return out
    with lm.weights_loaded(post):
        rule = affine_norm(post, d_model)
    return rule.centred(out) * rule.gain.to(out.device, dtype)


#: architectures that normalise the attention output before adding it to the residual stream, and the
#: decoder layer's attribute holding that norm
POST_ATTENTION_NORMS = {"gemma2": "post_attention_layernorm", "olmo2": "post_attention_layernorm"}


def model_type(lm: Any) -> str:
    """The text model's ``model_type`` (a vision-language model's text tower's)."""
    config = lm.model.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return str(getattr(text, "model_type", "") or "")


def attention_output_norm(lm: Any, layer: int) -> torch.nn.Module | None:
    """The norm that layer ``layer`` applies to its attention output before the residual stream (gemma2,
    olmo2), else ``None``."""
    name = POST_ATTENTION_NORMS.get(model_type(lm))
    return None if name is None else getattr(lm.decoder_layers[layer], name)


def fold_out(lm: Any, y: Tensor) -> Tensor:
    """``centre(y) * g_final`` (the final norm without its scale)."""
    norm = lm.final_norm
    with lm.weights_loaded(norm):
        rule = affine_norm(norm, int(y.shape[-1]))
    return rule.centred(y) * rule.gain.to(y.device, y.dtype)


def ov_rows(lm: Any, layer: int, tokens: Tensor, *, columns: Tensor | None = None, block: int = 4096,
            precision: Precision = "float32") -> Iterator[tuple[slice, Tensor]]:
    """``(column slice, OV[tokens][:, :, columns block])`` blocks of every head of ``layer``:
    (head, token, block) tensors over the vocabulary (or over ``columns``, token ids), ``block`` columns at a
    time."""
    out = fold_out(lm, folded_inputs(lm, layer, tokens, precision))
    W_U = lm.unembedding
    n = int(W_U.shape[1]) if columns is None else int(columns.numel())
    for start in range(0, n, block):
        cols = slice(start, min(start + block, n))
        ids = torch.arange(cols.start, cols.stop, device=W_U.device) if columns is None \
            else columns[cols].to(W_U.device)
        yield cols, out @ W_U[:, ids].to(out.device, out.dtype)


def rank_counts(lm: Any, layer: int, tokens: Tensor, *, block: int = 4096,
                precision: Precision = "float32") -> tuple[Tensor, Tensor]:
    """For every head of ``layer`` and each token ``t`` of ``tokens``: how many entries of the row ``OV[t]``
    (over the whole vocabulary of ``W_U``, ``t`` itself left out) are greater, and how many are smaller, than its
    own ``OV[t, t]``:
    two (head, token) int64 tensors, computed ``block`` columns at a time."""
    out = fold_out(lm, folded_inputs(lm, layer, tokens, precision))
    W_U = lm.unembedding
    own = (out * W_U[:, tokens.to(W_U.device)].T.to(out.device, out.dtype)[None]).sum(-1)  # (H, T)
    greater = torch.zeros(own.shape, dtype=torch.long, device=own.device)
    smaller = torch.zeros_like(greater)
    ids = tokens.to(own.device)
    for start in range(0, int(W_U.shape[1]), block):
        logits = out @ W_U[:, start: start + block].to(out.device, out.dtype)
        others = torch.arange(start, start + logits.shape[-1], device=own.device)[None] != ids[:, None]
        greater += ((logits > own[..., None]) & others).sum(-1)
        smaller += ((logits < own[..., None]) & others).sum(-1)
    return greater, smaller


def single_token(tokenizer: Any, text: str) -> int | None:
    """The token id of ``text`` when it encodes (without special tokens) to exactly one token that is not
    the unknown token, else ``None``."""
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    if len(ids) != 1:
        return None
    unk = getattr(tokenizer, "unk_token_id", None)
    return None if unk is not None and ids[0] == unk else int(ids[0])
