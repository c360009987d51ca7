"""Head lists: resolving spec selections, and the published JSON formats.

Heads are ``(layer, query_head)`` pairs, 0-based. Two interchange formats are supported:

- retrieval-head format (Wu et al. 2024; DeCoRe ships lists in it): ``{"<layer>-<head>": [score, ...]}``,
  ranked by the mean score;
- PASTA format (Zhang et al. 2023): ``{"<layer>": [head, ...]}`` or a list of layers (all heads).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import xarray as xr

if TYPE_CHECKING:
    from .geometry import Geometry

__all__ = ["Head", "HeadSelectionError", "check_score", "check_top", "draw_like", "from_pasta_json",
           "from_retrieval_json", "ranked", "read_heads_file", "select_heads", "to_pasta_json", "to_retrieval_json"]

Head = tuple[int, int]


class HeadSelectionError(ValueError):
    """A head selection cannot be resolved (unknown step, no score, out-of-range head)."""


def ranked(score: xr.DataArray) -> list[tuple[Head, float]]:
    """Heads of a ``(layer, head)`` score array, highest first (NaN last; ties by layer, head)."""
    values = np.nan_to_num(score.transpose("layer", "head").values.astype(float), nan=-np.inf)
    order = sorted(np.ndindex(values.shape), key=lambda lh: (-values[lh], lh))
    return [((int(l_), int(h)), float(values[l_, h])) for l_, h in order]


def _check(heads: Iterable[Head], geometry: Geometry | None) -> list[Head]:
    out = [(int(l_), int(h)) for l_, h in heads]
    if geometry is not None:
        for l_, h in out:
            if not (0 <= l_ < geometry.n_layers and 0 <= h < geometry.n_heads):
                raise HeadSelectionError(
                    f"head ({l_}, {h}) is outside this model ({geometry.n_layers} layers x {geometry.n_heads} heads)")
    return out


def check_score(score: xr.DataArray, geometry: Geometry | None, what: str = "a score") -> None:
    """Refuse a head score that is not over exactly ``(layer, head)`` of this model's size."""
    if set(score.dims) != {"layer", "head"}:
        raise HeadSelectionError(f"{what}: its score has dimensions {tuple(score.dims)}, not (layer, head)")
    if geometry is not None and (score.sizes["layer"], score.sizes["head"]) != (geometry.n_layers, geometry.n_heads):
        raise HeadSelectionError(f"{what}: its score is {score.sizes['layer']} layers x {score.sizes['head']} heads; "
                                 f"this model has {geometry.n_layers} x {geometry.n_heads}")


def check_top(top: int | None, geometry: Geometry | None, what: str = "top") -> None:
    """Refuse a ``top`` larger than the model's number of heads (it would silently select every head)."""
    if top is not None and geometry is not None and top > geometry.n_layers * geometry.n_heads:
        raise HeadSelectionError(
            f"{what} {top} is more than this model's {geometry.n_layers * geometry.n_heads} heads "
            f"({geometry.n_layers} layers x {geometry.n_heads} heads)")


def read_heads_file(path: str | Path, geometry: Geometry | None = None, top: int | None = None) -> list[Head]:
    """Heads from a retrieval-head or PASTA JSON file (see module docs). Any problem with the file is a
    :class:`HeadSelectionError` naming it."""
    p = Path(path)
    if not p.is_file():
        raise HeadSelectionError(f"heads file '{path}' does not exist")
    check_top(top, geometry)
    try:
        data = json.loads(p.read_bytes().decode("utf-8-sig"))
    except UnicodeDecodeError as e:
        raise HeadSelectionError(f"heads file '{path}': not UTF-8 text (byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise HeadSelectionError(f"heads file '{path}' line {e.lineno} column {e.colno}: not JSON: {e.msg}") from None
    except (OSError, RecursionError) as e:
        raise HeadSelectionError(f"heads file '{path}': cannot read it ({type(e).__name__}: {e})") from None
    try:
        if isinstance(data, Mapping) and data and all("-" in str(k) for k in data):
            scores = from_retrieval_json(data)
            heads = [h for h, _ in sorted(scores.items(), key=lambda kv: (-kv[1], kv[0]))]
        else:
            heads = from_pasta_json(data, geometry)
        return _check(heads[:top] if top else heads, geometry)
    except HeadSelectionError as e:
        raise HeadSelectionError(f"heads file '{path}': {e}") from None
    except (ValueError, TypeError) as e:
        raise HeadSelectionError(f"heads file '{path}': not a retrieval-head {{\"<layer>-<head>\": [scores]}} or "
                                 f"PASTA {{\"<layer>\": [heads]}} head list ({e})") from None


def from_retrieval_json(data: Mapping[str, Any]) -> dict[Head, float]:
    """``{"<layer>-<head>": [scores]}`` -> mean score per head."""
    out: dict[Head, float] = {}
    for key, scores in data.items():
        layer, head = (int(x) for x in str(key).split("-"))
        vals = scores if isinstance(scores, list) else [scores]
        out[(layer, head)] = float(np.mean(vals)) if vals else 0.0
    return out


def to_retrieval_json(per_instance: xr.DataArray) -> dict[str, list[float]]:
    """A ``(example, layer, head)`` (or ``(layer, head)``) score array in the retrieval-head format."""
    arr = per_instance if "example" in per_instance.dims else per_instance.expand_dims("example")
    arr = arr.transpose("example", "layer", "head")
    return {f"{l_}-{h}": [float(x) for x in arr.values[:, l_, h]]
            for l_ in range(arr.sizes["layer"]) for h in range(arr.sizes["head"])}


def from_pasta_json(data: Any, geometry: Geometry | None = None) -> list[Head]:
    """PASTA's ``{"<layer>": [heads]}`` or ``[layers]`` (every head of those layers)."""
    if isinstance(data, Mapping):
        return [(int(layer), int(h)) for layer, hs in data.items() for h in hs]
    if isinstance(data, list):
        if geometry is None:
            raise HeadSelectionError("a list of layers needs the model's head count")
        return [(int(layer), h) for layer in data for h in range(geometry.n_heads)]
    raise HeadSelectionError("PASTA heads must be a mapping {layer: [heads]} or a list of layers")


def to_pasta_json(heads: Iterable[Head]) -> dict[str, list[int]]:
    """Heads in PASTA's ``{"<layer>": [heads]}`` format."""
    out: dict[str, list[int]] = {}
    for layer, head in sorted(heads):
        out.setdefault(str(layer), []).append(int(head))
    return out


def draw_like(chosen: list[Head], pool: list[Head], rng: np.random.Generator, *, match_layers: bool = False,
              exclude: bool = False, offset: int | None = None) -> list[Head]:
    """As many heads as ``chosen``, drawn without replacement from ``pool`` (per layer as in ``chosen`` with
    ``match_layers``; never one of ``chosen`` with ``exclude``); ``offset`` re-seeds the draw from ``rng`` so
    that controls with different offsets differ. Raises ``ValueError`` when the pool is too small."""
    if offset is not None:
        rng = np.random.default_rng([int(rng.integers(2**32)), offset % 2**32])
    taken = set(chosen) if exclude else set()
    if not match_layers:
        free = [h for h in pool if h not in taken]
        if len(free) < len(chosen):
            raise ValueError(f"cannot draw {len(chosen)} random heads from {len(free)} heads outside the selection")
        return sorted(free[i] for i in rng.choice(len(free), size=len(chosen), replace=False))
    out: list[Head] = []
    for layer in sorted({ly for ly, _ in chosen}):
        need = sum(1 for ly, _ in chosen if ly == layer)
        free = [h for h in pool if h[0] == layer and h not in taken]
        if len(free) < need:
            raise ValueError(f"match_layers: layer {layer} has {len(free)} heads outside the selection, "
                             f"{need} needed")
        out += [free[i] for i in rng.choice(len(free), size=need, replace=False)]
    return sorted(out)


def select_heads(selection: Any, results: Mapping[str, xr.Dataset], geometry: Geometry | None = None,
                 *, rng: np.random.Generator | None = None) -> list[Head]:
    """Resolve a spec head selection (``HeadsFrom``, ``HeadsFile``, list of pairs, PASTA mapping)."""
    if selection is None:
        return []
    if hasattr(selection, "file"):
        return read_heads_file(selection.file, geometry, selection.top)
    if hasattr(selection, "from_"):
        if selection.from_ not in results:
            raise HeadSelectionError(f"step '{selection.from_}' has no result in this cell")
        ds = results[selection.from_]
        if "score" not in ds:
            raise HeadSelectionError(f"step '{selection.from_}' produced no `score` to rank heads by")
        score = ds["score"]
        check_score(score, geometry, f"step '{selection.from_}'")
        order = ranked(score)
        check_top(selection.top, geometry)
        finite = int(np.isfinite(score.values).sum())
        if selection.top is not None:
            if selection.top > finite:
                raise HeadSelectionError(f"top {selection.top} of step '{selection.from_}': only {finite} heads have a "
                                         "finite score (the others are NaN or infinite), so the selection would "
                                         "rank heads by nothing")
            chosen = [h for h, _ in order[: selection.top]]
        else:
            chosen = [h for h, s in order if s >= selection.threshold]
            if not chosen and not getattr(selection, "allow_empty", False):
                best = max((s for _, s in order), default=float("nan"))
                raise HeadSelectionError(f"threshold {selection.threshold} selects no head of step "
                                         f"'{selection.from_}' (its highest score is {best:.4g}), so the step would "
                                         "run on no heads: lower it, or add `allow_empty: true`")
        if selection.random:
            chosen = draw_like(chosen, [h for h, _ in order], rng or np.random.default_rng(0),
                               match_layers=selection.match_layers, offset=selection.seed)
        return _check(chosen, geometry)
    if isinstance(selection, Mapping):
        return _check(from_pasta_json(selection, geometry), geometry)
    return _check(selection, geometry)
