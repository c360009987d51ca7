"""The vocabulary of dimension names: every array headlab returns names its axes with these words.

Step results (detectors, ``generate``, ``score``, the task's examples stored with them), steering
reports, decoding diagnostics and the arrays of a :class:`headlab.instrument.Recording` all use the
names of :data:`DIMENSIONS`. A run adds one dimension per sweep key, named by its dotted spec path
(``task.length``, ``answer.decode.alpha``) or top-level key (``seed``). Third-party plugins are free to
add their own names; reusing these keeps their results composable with the built-ins (``.sel``,
``.mean("example")``, the widgets and the report).

    >>> import headlab
    >>> sorted(headlab.DIMENSIONS)[:4]
    ['choice', 'draw', 'example', 'head']
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
import xarray as xr

__all__ = ["DIMENSIONS", "head_array", "unknown_dims"]

#: dimension name -> meaning, for every dimension of a built-in result
DIMENSIONS: dict[str, str] = {
    "example": "an example of the step's task, in the task's order (in a Recording: a row of the batch)",
    "layer": "a decoder layer of the model (0 = nearest the input); coordinates are layer indices",
    "head": "an attention (query) head of a layer; coordinates are head indices",
    "kv_head": "a key/value head of a layer (under grouped-query attention it serves n_heads / n_kv_heads query "
               "heads: kv_head j serves heads j * g .. (j + 1) * g - 1); coordinates are KV head indices",
    "token": "a position in an example's prompt token ids (input_ids, unpadded, from 0)",
    "step": "a decoding step: step t chose the t-th generated token (its query is the last prompt token for "
            "t = 0, then the token chosen at step t - 1)",
    "query": "the absolute position of an attending (query) token in the batch's left-padded sequence, "
             "counted from the first token of the first forward in the instrument context",
    "key": "the absolute position of an attended (key) token, counted like query",
    "position": "an absolute position (counted like query) at which head outputs z were kept",
    "span": "a key span [start, end) of a span probe, or a named span of the examples",
    "offset": "a relative key offset delta >= 0 of an offset probe: the key at query - delta",
    "pair": "a (query, key) position pair of a pair probe, in the order given per row (the calls of a generate "
            "in order); the coordinates pair_query and pair_key hold its positions (-1: an unused slot)",
    "head_dim": "a component of a head's output vector z (before o_proj)",
    "class": "a class of a classification label (probe, sav); coordinates are the label's values, sorted",
    "choice": "an answer option of a multiple-choice example",
    "task": "a task: an lm-evaluation-harness task (or group) an evaluate step ran, coordinates are its names; "
            "or one of the tasks a detector profiles heads on (pasta_profile)",
    "detector": "a detector of the head atlas: the role it scores (previous_token, induction, retrieval, ...); "
                "coordinates are the names",
    "k": "a number of heads masked together (ablation)",
    "draw": "a random draw of heads (ablation's control)",
    "rank": "a place in a ranked list of heads (0 = first)",
    "slot": "a place in a list of heads, padded with -1",
    "fraction": "a fraction of a model's heads masked together (a pruning curve)",
    "patch_row": "a row of an image's token grid (image patches, top to bottom)",
    "patch_col": "a column of an image's token grid (image patches, left to right)",
    "pixel_y": "a pixel row of a stored image (top to bottom)",
    "pixel_x": "a pixel column of a stored image (left to right)",
    "channel": "a colour channel of a stored image (red, green, blue)",
    "src_layer": "the layer of the earlier (source) head of a pair of heads, e.g. a composition score's writer; "
                 "coordinates are layer indices",
    "src_head": "the head (in src_layer) of the earlier (source) head of a pair of heads; coordinates are head "
                "indices",
    "source": "a source node of a model's computational graph (the embeddings, a head's output, an MLP's "
              "output: emb, a3.h1, m2), in a dense (source, destination) edge score",
    "destination": "a destination node of a model's computational graph (a head's query, key or value input, "
                   "an MLP's input, the logits: a3.h1.q, a3.kv0.k, m2, logits), in a dense edge score",
    "edge": "an edge of a model's computational graph (edge_attribution), from a source node to a destination "
            "node; the coordinates source and destination name them (emb, a3.h1, m2; a3.h1.q, a3.kv0.k, m2, "
            "logits)",
}


def head_array(values: Any, *leading: str, name: str | None = None) -> xr.DataArray:
    """``values`` (..., layer, head) as a DataArray with dims ``(*leading, "layer", "head")``.

    ``leading`` names the axes before the last two (``head_array(scores, "example")`` for per-example scores
    of shape (example, layer, head)); the ``layer`` and ``head`` axes get the coordinates ``0..n-1``, the
    others none.
    """
    arr = np.asarray(values)
    if arr.ndim != len(leading) + 2:
        raise ValueError(f"head_array: {arr.ndim}-d values for dims {(*leading, 'layer', 'head')}")
    return xr.DataArray(arr, dims=(*leading, "layer", "head"), name=name,
                        coords={"layer": np.arange(arr.shape[-2]), "head": np.arange(arr.shape[-1])})


def unknown_dims(obj: xr.Dataset | xr.DataArray, allowed: Iterable[str] = ()) -> list[str]:
    """The dimensions of ``obj`` (every variable of a Dataset) that are neither in :data:`DIMENSIONS` nor in
    ``allowed`` (e.g. a run's sweep keys), sorted."""
    dims = set(obj.dims)
    if isinstance(obj, xr.Dataset):
        for var in obj.variables.values():
            dims.update(var.dims)
    return sorted(str(d) for d in dims if d not in DIMENSIONS and d not in set(allowed))
