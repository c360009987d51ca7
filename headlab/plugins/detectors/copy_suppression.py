"""Copy-suppression (negative) heads and copying heads, from each head's OV circuit.

Definition: docs/methods.md#ov-circuits (the circuit and what is folded into it:
:mod:`headlab.plugins.detectors.ov_circuit`). Over a seeded sample of tokens ``t`` (special tokens
excluded; every token when the vocabulary is not larger than ``tokens``):

- ``score (layer, head)``, the suppression score (McDougall et al. 2023): the fraction of the tokens whose
  own logit ``OV[t, t]`` is among the ``k`` smallest of the row ``OV[t]`` (fewer than ``k`` entries of the
  row are smaller);
- ``copying (layer, head)`` (Elhage et al. 2021): the fraction whose own logit is among the ``k`` largest
  (``copying: top_k``, the default), or with ``copying: eigen`` the eigenvalue copying score
  ``Re(sum lambda) / sum |lambda|`` over the eigenvalues of the whole vocabulary x vocabulary ``OV``, from the
  d_head x d_head matrix ``fold_out(W_O) W_U fold_in(W_E) W_V`` that has the same non-zero eigenvalues (the
  factors permuted cyclically); ``W_U fold_in(W_E)`` (d_model x d_model) is summed ``block`` vocabulary rows at
  a time.

Rows are computed ``row_block`` tokens at a time and compared with the whole vocabulary ``block`` columns at
a time, so a 150K vocabulary needs ``heads x row_block x block`` numbers at once, never a vocabulary-square
matrix. Weights only: the task's examples are not used.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import torch
import xarray as xr
from pydantic import Field

from headlab.plugin import ComponentConfig, PositiveInt, StepContext, head_array, hookimpl
from headlab.plugins.detectors.ov_circuit import OVCircuits, Precision
from headlab.resources import Estimate, EstimateContext

__all__ = ["CopySuppression", "detect", "eigen_copying", "eigen_scores", "ov_rank_scores", "rank_fractions",
           "sample_tokens"]


class CopySuppression(ComponentConfig):
    """Heads whose OV circuit lowers (suppresses) the logit of the token they attend to; also the copying score."""

    kind: Literal["copy_suppression"] = "copy_suppression"
    k: PositiveInt = Field(10, description="a token counts when its own logit is in the bottom-k (top-k for copying)")
    tokens: PositiveInt = Field(1000, description="number of sampled tokens (all when the vocabulary is smaller)")
    block: PositiveInt = Field(4096, description="vocabulary columns per block")
    row_block: PositiveInt = Field(256, description="sampled tokens per block")
    precision: Precision = Field("float32", description="dtype of the OV products")
    copying: Literal["top_k", "eigen"] = Field(
        "top_k", description="the copying score: the fraction of tokens in their row's top-k (top_k), or "
        "Re(sum lambda) / sum |lambda| over the OV circuit's eigenvalues (eigen)")

    def estimate(self, ctx: EstimateContext) -> list[Estimate]:
        """One block of OV logits of every head of a layer, and the heads' outputs for a block of tokens; with
        ``copying: eigen`` also one vocabulary block of the embedding and the unembedding."""
        g = ctx.geometry
        rows = min(self.row_block, self.tokens)
        width = 8 if self.precision == "float64" else 4
        cols = min(self.block, ctx.vocab_size)
        out = [Estimate("OV logits block", g.n_heads * rows * cols * width,
                        f"{g.n_heads} heads x {rows:,} tokens x {cols:,} columns x {width} bytes"),
               Estimate("heads' outputs", g.n_heads * rows * ctx.hidden_size * width,
                        f"{g.n_heads} heads x {rows:,} tokens x {ctx.hidden_size} hidden x {width} bytes")]
        if self.copying == "eigen":
            out.append(Estimate("vocabulary block of W_E and W_U (copying: eigen)", 2 * cols * ctx.hidden_size * width,
                                f"2 x {cols:,} vocabulary rows (block) x {ctx.hidden_size} hidden x {width} bytes; a "
                                "smaller block needs less"))
        return out


def sample_tokens(lm, n: int, seed: int, vocab: int | None = None) -> torch.Tensor:
    """``n`` distinct token ids of the embedding's vocabulary (of ``vocab`` rows, read from the model when
    None), special tokens excluded, seeded (all of them, in order, when there are not more than ``n``)."""
    vocab = int(lm.embedding.shape[0]) if vocab is None else vocab
    special = set(getattr(lm.tokenizer, "all_special_ids", None) or []) if lm.tokenizer is not None else set()
    ids = np.array([i for i in range(vocab) if i not in special])
    if len(ids) > n:
        ids = np.sort(np.random.default_rng(seed).choice(ids, size=n, replace=False))
    return torch.as_tensor(ids, dtype=torch.long)


def rank_fractions(ov: OVCircuits, layer: int, tokens: torch.Tensor, k: int, *, block: int = 4096,
                   row_block: int = 256) -> tuple[np.ndarray, np.ndarray]:
    """``(copying, suppression)`` (head,) arrays of ``layer``: the fractions of ``tokens`` whose own OV logit is
    in the top-``k`` / bottom-``k`` of their row."""
    top = np.zeros(ov.lm.geometry.n_heads)
    bottom = np.zeros_like(top)
    for start in range(0, len(tokens), row_block):
        greater, smaller = ov.rank_counts(layer, tokens[start: start + row_block], block=block)
        top += (greater < k).sum(-1).cpu().numpy()
        bottom += (smaller < k).sum(-1).cpu().numpy()
    return top / len(tokens), bottom / len(tokens)


def ov_rank_scores(lm, tokens: torch.Tensor, k: int, *, block: int = 4096, row_block: int = 256,
                   precision: Precision = "float32", ov: OVCircuits | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``(copying, suppression)`` (layer, head) arrays: the fractions of ``tokens`` whose own OV logit is in
    the top-``k`` / bottom-``k`` of their row (of ``ov``, the model's OV circuits in ``precision`` when None)."""
    ov = OVCircuits(lm, precision) if ov is None else ov
    rows = [rank_fractions(ov, layer, tokens, k, block=block, row_block=row_block)
            for layer in range(lm.geometry.n_layers)]
    return np.stack([r[0] for r in rows]), np.stack([r[1] for r in rows])


def eigen_scores(ov: OVCircuits, layer: int, unembed_embed: torch.Tensor) -> np.ndarray:
    """(head,) eigenvalue copying scores ``Re(sum lambda) / sum |lambda|`` of ``layer``'s heads, from
    :meth:`OVCircuits.unembed_embed`'s ``W_U W_E``; 0 for a head whose eigenvalues are all 0."""
    eig = torch.linalg.eigvals(ov.eigen_matrices(layer, unembed_embed))  # (head, d_head)
    total = eig.abs().sum(-1)
    return torch.where(total > 0, eig.real.sum(-1) / torch.where(total > 0, total, 1), 0).double().cpu().numpy()


def eigen_copying(lm, *, block: int = 4096, precision: Precision = "float32",
                  ov: OVCircuits | None = None) -> np.ndarray:
    """(layer, head) eigenvalue copying scores ``Re(sum lambda) / sum |lambda|`` of every head's OV circuit (of
    ``ov``, the model's OV circuits in ``precision`` when None); 0 for a head whose eigenvalues are all 0."""
    ov = OVCircuits(lm, precision) if ov is None else ov
    middle = ov.unembed_embed(block)
    return np.stack([eigen_scores(ov, layer, middle) for layer in range(lm.geometry.n_layers)])


def detect(config: CopySuppression, ctx: StepContext) -> xr.Dataset:
    """The ``copy_suppression`` detector on the model's weights (each layer's weights read once)."""
    with torch.no_grad():
        ov = OVCircuits(ctx.model, config.precision)
        middle = None
        if config.copying == "eigen":
            try:
                middle = ov.unembed_embed(config.block)
            except ValueError as e:
                raise ValueError(f"copy_suppression: copying: eigen: {e}") from None
        tokens = sample_tokens(ctx.model, config.tokens, ctx.seed, vocab=int(ov.W_E.shape[0]))
        copying, suppression = [], []
        for layer in range(ctx.model.geometry.n_layers):
            top, bottom = rank_fractions(ov, layer, tokens, config.k, block=config.block, row_block=config.row_block)
            copying.append(top if middle is None else eigen_scores(ov, layer, middle))
            suppression.append(bottom)
    ds = xr.Dataset({"score": head_array(np.stack(suppression)), "copying": head_array(np.stack(copying))})
    ds.attrs.update(method="copy_suppression", model=ctx.model.name, k=config.k, n_tokens=len(tokens),
                    vocab_size=int(ov.W_U.shape[1]), copying=config.copying, reference="docs/methods.md#ov-circuits")
    return ds


@hookimpl
def headlab_register_detectors(register):
    register(CopySuppression, detect)
