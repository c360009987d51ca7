"""The attention patterns of chosen heads on one short prompt, the CircuitsVis-style view of a detect step.

- :func:`top_heads`: the heads of a detect result's ``score`` of largest magnitude;
- :func:`head_patterns`: each chosen head's attention over one prompt's tokens, ``(rank, query, key)``, with
  the tokens' text, from one forward with the full-pattern probe of the chosen heads' layers
  (:class:`headlab.instrument.Probes` ``pattern``); the prompt is held to ``max_tokens`` tokens, so the
  pattern is small by construction;
- :func:`run_model`: a stored run's model, loaded again when it is on this machine and has the run's weights.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import xarray as xr

from .context import Example
from .forward_pass import forward
from .generation import tokenize
from .instrument import Plan, Probes
from .model import LoadedModel, load_model
from .plugin_manager import get_manager
from .spec import ModelSpec

__all__ = ["PATTERN_TOKEN_LIMIT", "head_patterns", "run_model", "top_heads"]

#: the most tokens :func:`head_patterns` takes by default: a pattern grows with their square
PATTERN_TOKEN_LIMIT = 96


def top_heads(score: xr.DataArray, k: int = 4) -> list[tuple[int, int]]:
    """The ``k`` heads of largest ``|score|`` (ties in layer, head order) of a ``(layer, head[, ...])`` score; a
    ``token`` dimension is reduced to each head's per-token score of largest magnitude, other dimensions (sweep
    keys) averaged; NaN heads last."""
    if not {"layer", "head"} <= set(score.dims):
        raise ValueError(f"a head score has dimensions (layer, head), not {score.dims}")
    if "token" in score.dims:
        score = abs(score).max("token", skipna=True)
    extra = [d for d in score.dims if d not in ("layer", "head")]
    score = (score.mean(extra) if extra else score).transpose("layer", "head")
    vals = np.abs(score.values.astype(float))
    layers, heads = score["layer"].values, score["head"].values
    order = sorted(np.ndindex(vals.shape), key=lambda ij: (-vals[ij] if np.isfinite(vals[ij]) else np.inf, ij))
    return [(int(layers[i]), int(heads[j])) for i, j in order[:k]]


def _text(tokenizer: Any, token_id: int) -> str:
    if tokenizer is None:
        return str(token_id)
    text = tokenizer.decode([token_id])
    return text if text.strip() else str(tokenizer.convert_ids_to_tokens(token_id))


def head_patterns(lm: LoadedModel, prompt: str | Sequence[int], heads: Sequence[Sequence[int]], *,
                  max_tokens: int = PATTERN_TOKEN_LIMIT) -> xr.DataArray:
    """The attention of each of ``heads`` (``(layer, head)`` pairs, in the given order) on one prompt (a string or
    token ids), post-softmax: ``(rank, query, key)``, row ``query`` over the keys up to it, with the coordinates
    ``layer (rank)``, ``head (rank)`` and ``query_token (query)`` / ``key_token (key)`` (the tokens' text).
    A prompt of more than ``max_tokens`` tokens is refused (``ValueError``)."""
    geo = lm.geometry
    picked = [(int(a), int(b)) for a, b in heads]
    if not picked:
        raise ValueError("no heads to show")
    for layer, head in picked:
        if not (0 <= layer < geo.n_layers and 0 <= head < geo.n_heads):
            raise ValueError(f"head ({layer}, {head}) is not a head of this model ({geo.n_layers} layers x "
                             f"{geo.n_heads} heads)")
    example = Example(prompt=prompt) if isinstance(prompt, str) else Example(prompt="", input_ids=list(prompt))
    batch = tokenize(lm, [example], device=lm.device)
    n = int(batch.input_ids.shape[1])
    if n > max_tokens:
        raise ValueError(f"the prompt has {n} tokens, more than max_tokens={max_tokens}: a full attention "
                         "pattern is for short prompts (use headlab.widgets.AttentionView for long ones)")
    layers = sorted({layer for layer, _ in picked})
    _, rec = forward(lm, batch, Plan(probes=Probes(pattern=True, layers=layers)), logits_to_keep=1)
    pattern = rec.to_xarray("pattern").isel(example=0)
    values = np.stack([pattern.sel(layer=layer, head=head).values[:n, :n] for layer, head in picked])
    ids = [int(i) for i in batch.input_ids[0].tolist()]
    tokens = [_text(lm.tokenizer, i) for i in ids]
    return xr.DataArray(values.astype(np.float32), dims=("rank", "query", "key"),
                        coords={"rank": np.arange(len(picked)), "layer": ("rank", [a for a, _ in picked]),
                                "head": ("rank", [b for _, b in picked]), "query": np.arange(n),
                                "key": np.arange(n), "query_token": ("query", tokens), "key_token": ("key", tokens)},
                        name="attention")


@functools.lru_cache(maxsize=1)
def _load(model_json: str, seed: int, digest: str) -> LoadedModel | None:
    data = json.loads(model_json)
    data.update(device="cpu", device_map=None, max_memory=None, offload_folder=None)
    spec = ModelSpec(**data)
    ref = spec.path or spec.id
    local = spec.config is not None or (ref is not None and (ref in get_manager().components["models"]
                                                             or Path(ref).expanduser().is_dir()))
    if not local:
        return None
    try:
        lm = load_model(spec, seed)
    except Exception:  # noqa: BLE001 - not loadable here: the caller says the patterns need the model
        return None
    return lm if not digest or lm.digest == digest else None


def run_model(attrs: dict[str, Any]) -> LoadedModel | None:
    """The model of a stored run (its ``attrs``: the resolved spec, the seed and the weights digest), loaded on
    the CPU when it is an embedded model, a local checkpoint or a model built from a config, and its weights
    digest is the run's; None otherwise (nothing is downloaded). The last one loaded is kept."""
    try:
        model = json.loads(attrs["resolved"])["model"]
    except (KeyError, TypeError, ValueError):
        return None
    return _load(json.dumps(model, sort_keys=True), int(attrs.get("seed", 0) or 0), str(attrs.get("model_digest", "")))
