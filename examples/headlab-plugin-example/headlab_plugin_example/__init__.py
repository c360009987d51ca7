"""An example headlab plugin: the ``output_norm`` detector, the ``word_count`` metric, the
``head_temperature`` steering method and the ``head_contrast`` decoding strategy (with a scorer)."""

from __future__ import annotations

from typing import Literal

import numpy as np
import torch
import xarray as xr
from pydantic import Field

from headlab import ComponentConfig, Example, StepContext, hookimpl
from headlab.dims import head_array

from . import decoding, steering


class OutputNorm(ComponentConfig):
    """Norm of each head's slice of the attention output projection (weights only)."""

    kind: Literal["output_norm"] = "output_norm"
    ord: Literal["fro", "nuc"] = Field("fro", description="matrix norm of the (hidden x head_dim) slice")


class WordCount(ComponentConfig):
    """Number of whitespace-separated words in the output."""

    kind: Literal["word_count"] = "word_count"


def _o_proj(layer: torch.nn.Module) -> torch.Tensor:
    attn = getattr(layer, "self_attn", None) or getattr(layer, "attn", None)
    proj = getattr(attn, "o_proj", None) or getattr(attn, "c_proj", None)
    weight = proj.weight
    return weight if hasattr(attn, "o_proj") else weight.T  # GPT-2's Conv1D stores (in, out)


def output_norm(config: OutputNorm, ctx: StepContext) -> xr.Dataset:
    """Score each head by the norm of its output-projection columns."""
    geo = ctx.model.geometry
    layers = ctx.model.model.model.layers if hasattr(ctx.model.model, "model") else ctx.model.model.transformer.h
    scores = np.zeros((geo.n_layers, geo.n_heads))
    for li, layer in enumerate(layers):
        w = _o_proj(layer).detach().float()
        for h in range(geo.n_heads):
            scores[li, h] = torch.linalg.matrix_norm(w[:, h * geo.head_dim:(h + 1) * geo.head_dim], ord=config.ord)
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
