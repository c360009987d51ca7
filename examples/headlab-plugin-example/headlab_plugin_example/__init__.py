"""An example headlab plugin: the ``output_norm`` detector, the ``word_count`` metric, the
``head_temperature`` steering method and the ``head_contrast`` decoding strategy (with a scorer)."""

from __future__ import annotations

from typing import Literal

import numpy as np
import torch
import xarray as xr
from pydantic import Field

from headlab.plugin import ComponentConfig, Example, StepContext, head_array, hookimpl

from . import decoding, steering


class OutputNorm(ComponentConfig):
    """Norm of each head's slice of the attention output projection (weights only)."""

    kind: Literal["output_norm"] = "output_norm"
    ord: Literal["fro", "nuc"] = Field("fro", description="matrix norm of the (hidden x head_dim) slice")


class WordCount(ComponentConfig):
    """Number of whitespace-separated words in the output."""

    kind: Literal["word_count"] = "word_count"


def output_norm(config: OutputNorm, ctx: StepContext) -> xr.Dataset:
    """Score each head by the matrix norm of its output weights ``W_O[head]`` (d_head x d_model)."""
    lm, geo = ctx.model, ctx.model.geometry
    scores = np.zeros((geo.n_layers, geo.n_heads))
    for layer in range(geo.n_layers):
        W_O = lm.head_weights(layer).W_O.float()  # noqa: N806 - TransformerLens' name
        scores[layer] = torch.linalg.matrix_norm(W_O, ord=config.ord).numpy()
    return xr.Dataset({"score": head_array(scores)}, attrs={"method": "output_norm"})


def word_count(config: WordCount, examples: list[Example], outputs: list[str]) -> np.ndarray:
    """Words per output."""
    return np.array([len(o.split()) for o in outputs], dtype=float)


@hookimpl
def headlab_register_detectors(register):
    register(OutputNorm, output_norm)


@hookimpl
def headlab_register_metrics(register):
    register(WordCount, word_count)


@hookimpl
def headlab_register_steering(register):
    register(steering.HeadTemperature, steering.steer)


@hookimpl
def headlab_register_decoders(register):
    register(decoding.HeadContrast, decoding.decode, score=decoding.score)
