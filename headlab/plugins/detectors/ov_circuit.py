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
from headlab.text import single_token

__all__ = ["OVCircuits", "POST_ATTENTION_NORMS", "Precision", "attention_output_norm", "model_type", "single_token"]

Precision = Literal["float32", "float64"]
_DTYPES = {"float32": torch.float32, "float64": torch.float64}


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


class OVCircuits:
    """The OV circuits of every head of one model (``lm``, a :class:`headlab.HeadlabModel`), computed in
    ``precision``. Each weight they read is read once: the embedding, the unembedding and the final norm when
    this is made, a layer's norms and value/output projections when that layer is first asked for (the last
    layer asked for is kept), so a model whose modules ``device_map`` offloads loads each of them once per
    detector run, not once per block."""

    def __init__(self, lm: Any, precision: Precision = "float32") -> None:
        self.lm = lm
        self.dtype = _DTYPES[precision]
        self.W_E = lm.embedding
        self.W_U = lm.unembedding
        self.d_model = int(self.W_E.shape[1])
        with lm.weights_loaded(lm.final_norm):
            self._final = affine_norm(lm.final_norm, self.d_model)
        self._layer: tuple[int, tuple[Any, Tensor, Tensor, Any]] | None = None

    def _weights(self, layer: int) -> tuple[Any, Tensor, Tensor, Any]:
        """Layer ``layer``'s (input norm rule or None, W_V per query head (H, d_model, D), W_O (H, D, d_model),
        attention output norm rule or None), on the embedding's device."""
        if self._layer is None or self._layer[0] != layer:
            device, lm = self.W_E.device, self.lm
            rules = []
            for norm in (lm.input_norm(layer), attention_output_norm(lm, layer)):
                if norm is None:
                    rules.append(None)
                    continue
                with lm.weights_loaded(norm):
                    rules.append(affine_norm(norm, self.d_model))
            hw = lm.head_weights(layer)
            W_V = hw.per_query_head(hw.W_V).to(device, self.dtype)
            self._layer = (layer, (rules[0], W_V, hw.W_O.to(device, self.dtype), rules[1]))
        return self._layer[1]

    def head_outputs(self, layer: int, tokens: Tensor) -> Tensor:
        """``fold_out(fold_in(W_E[tokens]) W_V[kv(h)] W_O[h])`` for every head of ``layer``: (head, token,
        d_model), what the unembedding turns into the OV logits."""
        norm_in, W_V, W_O, post = self._weights(layer)
        x = self.W_E[tokens.to(self.W_E.device)].to(self.dtype)
        if norm_in is not None:
            x = norm_in.centred(x) * norm_in.gain.to(x.device, self.dtype)
        out = torch.einsum("tm,hmd,hdn->htn", x, W_V, W_O)
        if post is not None:
            out = post.centred(out) * post.gain.to(out.device, self.dtype)
        return self._final.centred(out) * self._final.gain.to(out.device, self.dtype)

    def unembed_embed(self, block: int = 4096) -> Tensor:
        """``W_U W_E`` (d_model, d_model) in this object's precision, summed over ``block`` vocabulary rows at a
        time (never a vocabulary-square matrix); a ``ValueError`` when ``W_U`` has not as many columns as
        ``W_E`` has rows (the OV circuit is then not square)."""
        W_E, W_U = self.W_E, self.W_U
        vocab = int(W_E.shape[0])
        if int(W_U.shape[1]) != vocab:
            raise ValueError(f"the embedding has {vocab} rows and the unembedding {int(W_U.shape[1])} columns: the OV "
                             "circuit is not a square matrix and has no eigenvalues")
        out = torch.zeros(self.d_model, self.d_model, dtype=self.dtype, device=W_E.device)
        for start in range(0, vocab, block):
            out += W_U[:, start: start + block].to(W_E.device, self.dtype) @ W_E[start: start + block].to(self.dtype)
        return out

    def eigen_matrices(self, layer: int, unembed_embed: Tensor) -> Tensor:
        """(head, d_head, d_head) matrices ``fold_out(W_O[h]) W_U fold_in(W_E) W_V[kv(h)]`` of every head of
        ``layer``: a cyclic permutation of the OV circuit's factors, so they have its non-zero eigenvalues.
        ``unembed_embed`` is :meth:`unembed_embed`'s ``W_U W_E``."""
        norm_in, W_V, W_O, post = self._weights(layer)
        middle = unembed_embed.to(W_V.device, self.dtype)
        if norm_in is not None:  # fold_in acts on the rows of W_E, i.e. on the columns of W_U W_E
            middle = norm_in.centred(middle) * norm_in.gain.to(middle.device, self.dtype)
        out = W_O
        if post is not None:
            out = post.centred(out) * post.gain.to(out.device, self.dtype)
        out = self._final.centred(out) * self._final.gain.to(out.device, self.dtype)
        return out @ middle @ W_V

    def rows(self, layer: int, tokens: Tensor, *, columns: Tensor | None = None,
             block: int = 4096) -> Iterator[tuple[slice, Tensor]]:
        """``(column slice, OV[tokens][:, :, columns block])`` blocks of every head of ``layer``: (head, token,
        block) tensors over the vocabulary (or over ``columns``, token ids), ``block`` columns at a time."""
        out = self.head_outputs(layer, tokens)
        W_U = self.W_U
        n = int(W_U.shape[1]) if columns is None else int(columns.numel())
        for start in range(0, n, block):
            cols = slice(start, min(start + block, n))
            ids = torch.arange(cols.start, cols.stop, device=W_U.device) if columns is None \
                else columns[cols].to(W_U.device)
            yield cols, out @ W_U[:, ids].to(out.device, out.dtype)

    def rank_counts(self, layer: int, tokens: Tensor, *, block: int = 4096) -> tuple[Tensor, Tensor]:
        """For every head of ``layer`` and each token ``t`` of ``tokens``: how many entries of the row ``OV[t]``
        (over the whole vocabulary of ``W_U``, ``t`` itself left out) are greater, and how many are smaller,
        than its own ``OV[t, t]``: two (head, token) int64 tensors, computed ``block`` columns at a time."""
        out = self.head_outputs(layer, tokens)
        W_U = self.W_U
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
