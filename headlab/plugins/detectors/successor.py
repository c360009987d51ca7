"""Successor heads, from each head's OV circuit on ordinal sequences.

Definition: docs/methods.md#ov-circuits (the circuit and what is folded into it:
:mod:`headlab.plugins.detectors.ov_circuit`); Gould et al. 2023. Each sequence (digits, number words,
weekdays, months, letters by default; any lists of strings in ``sequences``) is mapped to tokens: an item's
token is ``prefix + item`` encoded without special tokens when that is exactly one token other than the
unknown token; items that are several tokens (or unknown) are skipped and counted. Item ``i`` of a sequence
is scored when it and item ``i + 1`` both have a token: it is a success for head ``(l, h)`` when the row
``OV[t_i]`` restricted to the tokens of the sequence's kept items peaks at ``t_{i+1}``.

``score (layer, head)`` is the fraction of successes over every scored item of every sequence. attrs:
``items_scored``, ``items_skipped`` and ``skipped`` (the skipped items, ``sequence:item`` comma-joined).
Weights only: the task's examples are not used.
"""

from __future__ import annotations

from typing import Annotated, Literal

import numpy as np
import torch
import xarray as xr
from pydantic import Field

from headlab.plugin import ComponentConfig, StepContext, head_array, hookimpl
from headlab.plugins.detectors.ov_circuit import OVCircuits, Precision
from headlab.text import SEQUENCES, sequence_tokens

__all__ = ["SEQUENCES", "Successor", "detect", "sequence_tokens", "succession_scores"]


class Successor(ComponentConfig):
    """Heads whose OV circuit maps an item of an ordinal sequence to the next one (successor heads)."""

    kind: Literal["successor"] = "successor"
    sequences: dict[str, Annotated[list[str], Field(min_length=2)]] = Field(
        default_factory=lambda: {k: list(v) for k, v in SEQUENCES.items()}, min_length=1,
        description="name -> the items of an ordinal sequence, in order (at least two items; at least one sequence)")
    prefix: str = Field(" ", description="put in front of each item before tokenizing (e.g. ' Monday')")
    precision: Precision = Field("float32", description="dtype of the OV products")


def succession_scores(lm, tokens: dict[str, list[int | None]],
                      precision: Precision = "float32") -> tuple[np.ndarray, int]:
    """``(score (layer, head), number of scored items)`` for the item tokens of :func:`sequence_tokens`."""
    geo = lm.geometry
    hits = np.zeros((geo.n_layers, geo.n_heads))
    scored = 0
    ov = OVCircuits(lm, precision)
    for layer in range(geo.n_layers):
        for ids in tokens.values():
            kept = [t for t in ids if t is not None]
            pairs = [(a, b) for a, b in zip(ids, ids[1:], strict=False) if a is not None and b is not None]
            if not pairs:
                continue
            scored += len(pairs) if layer == 0 else 0
            columns = torch.tensor(kept)
            rows = torch.tensor([a for a, _ in pairs])
            target = torch.tensor([kept.index(b) for _, b in pairs])
            (_, logits), = ov.rows(layer, rows, columns=columns, block=len(kept))
            hits[layer] += (logits.argmax(-1).cpu() == target).sum(-1).numpy()
    return hits / max(scored, 1), scored


def detect(config: Successor, ctx: StepContext) -> xr.Dataset:
    """The ``successor`` detector on the model's weights."""
    if ctx.model.tokenizer is None:
        raise ValueError("successor: the model has no tokenizer to map the sequences' items to tokens")
    tokens, skipped = sequence_tokens(ctx.model.tokenizer, config.sequences, config.prefix)
    with torch.no_grad():
        score, scored = succession_scores(ctx.model, tokens, config.precision)
    if scored == 0:
        raise ValueError("successor: no item of any sequence and its successor are both single tokens for this "
                         f"tokenizer (prefix {config.prefix!r}); skipped: {', '.join(skipped)}")
    ds = xr.Dataset({"score": head_array(score)})
    ds.attrs.update(method="successor", model=ctx.model.name, items_scored=scored, items_skipped=len(skipped),
                    skipped=", ".join(skipped), prefix=config.prefix, reference="docs/methods.md#ov-circuits")
    return ds


@hookimpl
def headlab_register_detectors(register):
    register(Successor, detect)
