"""The numbers of circuit analyses, shared by ``headlab report`` and the notebook widgets (whose figures are
:mod:`headlab.circuit_figures`).

- :func:`circuit_kind` tells a detect result's kind by its variables and attrs: ``"patching"``
  (``activation_patching`` / ``attribution_patching``: ``score`` over ``(layer, head[, token])`` or
  ``(layer, kv_head)`` beside ``clean`` and ``corrupt``), ``"dla"`` (``direct_logit_attribution``: ``score``,
  ``rest``, ``logit_diff``) or ``"edges"`` (edge attribution: ``score`` over ``(source, destination)``, or over one
  edge dimension with ``source`` and ``destination`` coordinates).
- :func:`head_map` reduces a patching score to one value per head.
- :func:`dla_terms`: each head's direct effect, the heads left out, the rest and the total.
- :func:`parse_node`, :func:`circuit_edges`: the circuit's edges (nodes: embeddings, heads, MLPs, logits),
  strongest first; :func:`circuit_of`: the circuit an edge attribution step selected (``in_circuit``) with its
  faithfulness.
- :func:`resid_map`: residual-stream patching (``unit: resid``) as ``(layer, token)``; :func:`token_labels`: the
  text of one example's tokens for a token axis (:func:`tokenizer_for` finds the run's tokenizer).
- :func:`atp_pairs` and :func:`atp_vs_exact`: attribution patching against the exact patching of the same task,
  unit by unit, with their Spearman correlation and top-k overlap.
- :func:`dla_panels`: the heads' direct effects apart from the totals (the heads' sum, ``rest``, the logit
  difference), which would dwarf them on one axis.

Node names (edge attribution's labels): ``emb``, ``logits``, ``a<layer>.h<head>`` (a head; a destination may
name its input, ``a3.h1.q`` / ``.k`` / ``.v``; other groups such as ``a3.kv0.k`` are heads of that layer too),
``m<layer>`` (an MLP); :func:`headlab.circuit_figures.graph_layout` draws any other name on a row of its own
below the embeddings.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

import numpy as np
import xarray as xr

from .model import load_model_by_name_tokenizer
from .summary import head_scores

__all__ = ["AtPComparison", "Circuit", "Edge", "Node", "atp_pairs", "atp_vs_exact", "circuit_edges",
           "circuit_kind", "circuit_of", "dla_panels", "dla_terms", "head_map", "parse_node", "resid_map",
           "token_labels", "tokenizer_for"]

CircuitKind = Literal["patching", "dla", "edges"]
Reduce = Literal["peak", "sum", "mean"]

_PATCHING = ("activation_patching", "attribution_patching")


def _score(ds: xr.Dataset | xr.DataArray) -> xr.DataArray | None:
    if isinstance(ds, xr.DataArray):
        return ds
    return ds["score"] if "score" in ds else None


def circuit_kind(ds: xr.Dataset) -> CircuitKind | None:
    """``"patching"``, ``"dla"``, ``"edges"`` or None: which circuit figure ``ds`` (a detect result) takes."""
    score = _score(ds)
    if score is None:
        return None
    dims = set(score.dims)
    if {"source", "destination"} <= dims or (score.ndim >= 1 and {"source", "destination"} <= set(score.coords)
                                            and "layer" not in dims):
        return "edges"
    method = ds.attrs.get("method")
    patched = method in _PATCHING or ({"clean", "corrupt"} <= set(ds.data_vars) and ("patched" in ds or "atp" in ds))
    if {"layer", "token"} <= dims and not {"head", "kv_head"} & dims and patched:
        return "patching"
    if "layer" in dims and ("head" in dims or "kv_head" in dims):
        if patched:
            return "patching"
        if "head" in dims and (method == "direct_logit_attribution" or {"rest", "logit_diff"} <= set(ds.data_vars)):
            return "dla"
    return None


def head_map(score: xr.DataArray, reduce: Reduce = "peak") -> xr.DataArray:
    """``score`` as ``(layer, head)`` (``(layer, kv_head)`` for key/value patching): a ``token`` dimension
    reduced by ``reduce`` (``peak``: the per-token score of largest magnitude; ``sum``; ``mean``; NaN skipped),
    any other extra dimension (sweep keys) averaged; ``peak`` is :func:`headlab.summary.head_scores`."""
    if reduce == "peak" or "token" not in score.dims:
        return head_scores(score)  # the value the run summary and `headlab show` give
    if reduce == "sum":
        score = score.sum("token", skipna=True, min_count=1)
    else:
        score = score.mean("token", skipna=True)
    return head_scores(score)


def _head_label(layer: int, head: int) -> str:
    return f"L{layer}H{head}"


def resid_map(score: xr.DataArray) -> xr.DataArray:
    """A residual-stream patching score (``unit: resid``) as ``(layer, token)``, any other dimension (sweep keys)
    averaged; NaN where no example has the token."""
    if not {"layer", "token"} <= set(score.dims) or {"head", "kv_head"} & set(score.dims):
        raise ValueError(f"a residual-stream score has dimensions (layer, token), not {score.dims}")
    extra = [d for d in score.dims if d not in ("layer", "token")]
    if extra:
        score = score.mean(extra, skipna=True)
    return score.transpose("layer", "token").astype(float)


@functools.lru_cache(maxsize=4)
def tokenizer_for(model: str, revision: str | None = None) -> Any | None:
    """The tokenizer of a run's model (``run.attrs["model"]``): a registered model's (the embedded ones), else a
    Hugging Face tokenizer found on this machine (nothing is downloaded); None when there is none."""

    try:
        tokenizer = load_model_by_name_tokenizer(model)
        if tokenizer is not None:
            return tokenizer
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(model, revision=revision or None, local_files_only=True)
    except Exception:  # noqa: BLE001 - no tokenizer here: the axes fall back to token indices
        return None


def _token_text(tokenizer: Any, token_id: int) -> str:
    text = tokenizer.decode([token_id])
    return text if text.strip() else str(tokenizer.convert_ids_to_tokens(token_id))


def token_labels(ds: xr.Dataset, tokenizer: Any | None = None, *, example: int = 0) -> list[str]:
    """One label per position of ``ds``'s ``token`` dimension for a token axis: the text of example ``example``'s
    prompt tokens (its stored ``input_ids``, position 0 its first token, as patching counts them); where the
    example's corrupted prompt (``corrupt_prompt``, pair tasks) has another token, ``clean/corrupt``; ``""`` past
    the example's end. Without a tokenizer or stored ids: the positions' indices."""
    n = ds.sizes["token"]
    if tokenizer is None or "input_ids" not in ds:
        return [str(int(t)) for t in ds["token"].values] if "token" in ds.coords else [str(t) for t in range(n)]
    ids = [int(i) for i in ds["input_ids"].isel(example=example).values if int(i) >= 0]
    labels = [_token_text(tokenizer, i) for i in ids]
    if "corrupt_prompt" in ds.coords:
        other = tokenizer(str(ds["corrupt_prompt"].values[example]))["input_ids"]
        if len(other) == len(ids):
            labels = [t if a == b else f"{t}/{_token_text(tokenizer, b)}" for t, a, b in zip(labels, ids, other, strict=True)]
    return (labels + [""] * n)[:n]


def dla_terms(ds: xr.Dataset, max_heads: int = 32) -> list[tuple[str, float]]:
    """The bars of a ``direct_logit_attribution`` result: every head (``L<layer>H<head>``, in layer order) when
    there are at most ``max_heads``, else the ``max_heads`` of largest magnitude and ``other heads`` (the sum of
    the rest); then ``rest`` (embeddings, MLPs, biases: the example mean) and ``logit diff`` (the mean total,
    which the bars above it sum to). Extra dimensions of ``score`` (sweep keys) are averaged."""
    score = ds["score"]
    extra = [d for d in score.dims if d not in ("layer", "head")]
    score = (score.mean(extra) if extra else score).transpose("layer", "head")
    vals = score.values.astype(float)
    layers = score["layer"].values if "layer" in score.coords else np.arange(vals.shape[0])
    heads = score["head"].values if "head" in score.coords else np.arange(vals.shape[1])
    cells = [(int(layers[i]), int(heads[j]), float(vals[i, j])) for i in range(vals.shape[0])
             for j in range(vals.shape[1])]
    terms: list[tuple[str, float]] = []
    if len(cells) <= max_heads:
        terms = [(_head_label(a, b), v) for a, b, v in cells]
    else:
        order = sorted(range(len(cells)), key=lambda k: (-abs(cells[k][2]) if math.isfinite(cells[k][2])
                                                           else math.inf, k))
        keep = sorted(order[:max_heads])
        terms = [(_head_label(cells[k][0], cells[k][1]), cells[k][2]) for k in keep]
        terms.append((f"other heads ({len(cells) - max_heads})",
                      float(np.nansum([cells[k][2] for k in order[max_heads:]]))))
    for name, label in (("rest", "rest"), ("logit_diff", "logit diff")):
        if name in ds:
            terms.append((label, float(ds[name].mean())))
    return terms


def dla_panels(ds: xr.Dataset, max_heads: int = 32) -> tuple[list[tuple[str, float]], list[tuple[str, float]]]:
    """A ``direct_logit_attribution`` result as two panels: the heads' terms of :func:`dla_terms` (``other heads``
    included), and the totals: ``heads`` (the sum of every head's direct effect), ``rest`` and ``logit diff``
    (example means; ``heads + rest = logit diff``)."""
    terms = dla_terms(ds, max_heads)
    totals_names = {"rest", "logit diff"}
    heads = [t for t in terms if t[0] not in totals_names]
    score = ds["score"]
    extra = [d for d in score.dims if d not in ("layer", "head")]
    total = float(np.nansum((score.mean(extra) if extra else score).values))
    return heads, [("heads", total)] + [t for t in terms if t[0] in totals_names]


# --- the circuit graph -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Node:
    """A node of a circuit graph: its name without an input port, its kind, layer and place in the layer."""

    name: str
    kind: Literal["emb", "head", "mlp", "logits", "other"]
    layer: int = -1
    group: str = ""
    index: int = 0


class Edge(NamedTuple):
    """An edge of a circuit graph; ``destination`` may name an input port (``a3.h1.q``)."""

    source: str
    destination: str
    weight: float


_HEAD = re.compile(r"^a(\d+)\.([a-z_]+)(\d+)(?:\.([qkv]))?$")
_MLP = re.compile(r"^m(\d+)$")


def parse_node(name: str) -> tuple[Node, str | None]:
    """The node a label names and its input port (``q``, ``k``, ``v``, or None)."""
    if name in ("emb", "embed", "embeddings"):
        return Node(name, "emb"), None
    if name in ("logits", "unembed"):
        return Node(name, "logits"), None
    m = _HEAD.match(name)
    if m:
        layer, group, index, port = int(m[1]), m[2], int(m[3]), m[4]
        return Node(f"a{layer}.{group}{index}", "head", layer, group, index), port
    m = _MLP.match(name)
    if m:
        return Node(name, "mlp", int(m[1])), None
    return Node(name, "other"), None


def circuit_edges(score: xr.DataArray | xr.Dataset, *, top_k: int | None = 30,
                  threshold: float | None = None) -> list[Edge]:
    """The edges of an edge-attribution ``score``, largest magnitude first (ties in array order): a
    ``(source, destination)`` array whose coordinates are node labels, or one edge dimension with ``source`` and
    ``destination`` coordinates. NaN and zero weights are not edges; ``threshold`` keeps ``|weight| >= threshold``, ``top_k``
    the ``top_k`` largest (None: all). Other dimensions (sweep keys) are averaged."""
    da = _score(score) if isinstance(score, xr.Dataset) else score
    if da is None:
        raise ValueError("this dataset has no `score` variable")
    if {"source", "destination"} <= set(da.dims):
        extra = [d for d in da.dims if d not in ("source", "destination")]
        da = (da.mean(extra) if extra else da).transpose("source", "destination")
        vals = da.values.astype(float)
        rows, cols = np.nonzero(np.isfinite(vals) & (vals != 0))
        weights = vals[rows, cols]
        src, dst = da["source"].values[rows], da["destination"].values[cols]
    else:
        if not {"source", "destination"} <= set(da.coords):
            raise ValueError("edge scores need dimensions (source, destination), or source and destination "
                             "coordinates on an edge dimension")
        dim = da["source"].dims[0]
        extra = [d for d in da.dims if d != dim]
        da = da.mean(extra) if extra else da
        vals = da.values.astype(float)
        keep = np.nonzero(np.isfinite(vals) & (vals != 0))[0]
        weights, src, dst = vals[keep], da["source"].values[keep], da["destination"].values[keep]
    order = np.argsort(-np.abs(weights), kind="stable")
    if threshold is not None:
        order = order[np.abs(weights[order]) >= threshold]
    if top_k is not None:
        order = order[:top_k]
    return [Edge(str(src[i]), str(dst[i]), float(weights[i])) for i in order]


class Circuit(NamedTuple):
    """The circuit an edge attribution step selected: its edges (largest ``|score|`` first), how they were
    chosen, and the metrics of the clean, corrupted and circuit runs (example means) with the faithfulness."""

    edges: list[Edge]
    selection: str
    clean: float
    corrupt: float
    circuit: float
    faithfulness: float
    faithfulness_normalised: float


def circuit_of(ds: xr.Dataset) -> Circuit | None:
    """The circuit of an edge attribution result (its ``in_circuit`` edges and ``circuit`` metric), None when the
    step selected none. ``faithfulness`` = mean circuit / mean clean metric, ``faithfulness_normalised`` =
    (circuit - corrupt) / (clean - corrupt) of the means; with sweep keys the scores and metrics are averaged
    over the cells and an edge is in the circuit when it is in any cell's."""
    if "in_circuit" not in ds or "circuit" not in ds or "score" not in ds:
        return None
    score, member = ds["score"], ds["in_circuit"]
    dim = score["source"].dims[0] if "source" in score.coords and "source" not in score.dims else None
    if dim is None:
        raise ValueError("a circuit's edges are one edge dimension with source and destination coordinates")
    extra = [d for d in member.dims if d != dim]
    if extra:
        member = member.any(extra)
    keep = np.flatnonzero(member.values.astype(bool))
    extra = [d for d in score.dims if d != dim]
    mean = (score.mean(extra) if extra else score).values.astype(float)
    src, dst = score["source"].values, score["destination"].values
    order = sorted(keep.tolist(), key=lambda i: (-abs(mean[i]) if np.isfinite(mean[i]) else math.inf, i))
    edges = [Edge(str(src[i]), str(dst[i]), float(mean[i])) for i in order]
    clean, corrupt, circuit = (float(ds[name].mean()) for name in ("clean", "corrupt", "circuit"))
    gap = clean - corrupt
    selection = str(ds.attrs.get("circuit_selection", f"{len(edges)} edges"))
    return Circuit(edges, selection, clean, corrupt, circuit,
                   circuit / clean if clean else math.nan, (circuit - corrupt) / gap if gap else math.nan)


# --- attribution patching against exact patching ---------------------------------------------------------

class AtPComparison(NamedTuple):
    """Attribution patching's scores against exact patching's, unit by unit (the units finite in both)."""

    atp_step: str
    exact_step: str
    units: list[str]
    exact: np.ndarray
    atp: np.ndarray
    spearman: float
    top_k: int
    top_k_overlap: float


def _same_task(a: xr.Dataset, b: xr.Dataset) -> bool:
    if "prompt" not in a or "prompt" not in b or a.sizes.get("example") != b.sizes.get("example"):
        return False
    same = np.array_equal(a["prompt"].values, b["prompt"].values)
    if "corrupt_prompt" in a.coords and "corrupt_prompt" in b.coords:
        same = same and np.array_equal(a["corrupt_prompt"].values, b["corrupt_prompt"].values)
    return bool(same)


def atp_pairs(results: Mapping[str, xr.Dataset]) -> list[tuple[str, str]]:
    """``(attribution patching step, exact patching step)`` for each ``attribution_patching`` result of
    ``results`` whose exact counterpart ran: its ``reference_step``, else the last ``activation_patching`` step
    before it with the same unit, metric, direction and normalisation on the same prompts."""
    steps = list(results)
    pairs = []
    for i, step in enumerate(steps):
        ds = results[step]
        if ds.attrs.get("method") != "attribution_patching" or "score" not in ds:
            continue
        ref = ds.attrs.get("reference_step")
        if not (isinstance(ref, str) and ref in results):
            keys = ("unit", "metric", "direction", "normalise")
            ref = next((s for s in reversed(steps[:i]) if results[s].attrs.get("method") == "activation_patching"
                        and all(results[s].attrs.get(k) == ds.attrs.get(k) for k in keys)
                        and _same_task(results[s], ds)), None)
        if ref is not None and results[ref]["score"].dims == ds["score"].dims:
            pairs.append((step, ref))
    return pairs


def _unit_label(index: Mapping[str, Any]) -> str:
    parts = []
    if "layer" in index:
        parts.append(f"L{int(index['layer'])}")
    if "head" in index:
        parts.append(f"H{int(index['head'])}")
    if "kv_head" in index:
        parts.append(f"KV{int(index['kv_head'])}")
    label = "".join(parts)
    if "token" in index:
        label += f" t{int(index['token'])}"
    return label


def _ranks(x: np.ndarray) -> np.ndarray:
    from scipy.stats import rankdata

    return rankdata(x)


def atp_vs_exact(atp: xr.Dataset, exact: xr.Dataset, *, top_k: int = 10, atp_step: str = "",
                 exact_step: str = "") -> AtPComparison:
    """Attribution patching's ``score`` against exact patching's over the units finite in both (sweep keys
    averaged): the Spearman rank correlation (ties ranked by their mean rank) and the fraction of exact
    patching's ``top_k`` units (largest ``|score - s0|``, ``s0`` = 0 to denoise, 1 to noise) among AtP's."""
    a, e = atp["score"], exact["score"]
    unit_dims = [d for d in e.dims if d in ("layer", "head", "kv_head", "token")]
    a = a.mean([d for d in a.dims if d not in unit_dims]) if set(a.dims) - set(unit_dims) else a
    e = e.mean([d for d in e.dims if d not in unit_dims]) if set(e.dims) - set(unit_dims) else e
    a, e = xr.align(a.transpose(*unit_dims), e.transpose(*unit_dims), join="inner")
    av, ev = a.values.astype(float).ravel(), e.values.astype(float).ravel()
    keep = np.flatnonzero(np.isfinite(av) & np.isfinite(ev))
    shape = a.shape
    units = [_unit_label({d: a[d].values[i] if d in a.coords else i
                          for d, i in zip(unit_dims, np.unravel_index(k, shape), strict=True)}) for k in keep]
    av, ev = av[keep], ev[keep]
    ra, re_ = _ranks(av) - (len(av) + 1) / 2, _ranks(ev) - (len(ev) + 1) / 2
    denom = float(np.sqrt((ra ** 2).sum() * (re_ ** 2).sum()))
    rho = float((ra * re_).sum() / denom) if denom > 0 else math.nan
    s0 = 1.0 if exact.attrs.get("direction") == "noise" else 0.0
    k = min(int(top_k), len(av))
    top_e = set(np.argsort(-np.abs(ev - s0), kind="stable")[:k].tolist())
    top_a = set(np.argsort(-np.abs(av - s0), kind="stable")[:k].tolist())
    overlap = len(top_e & top_a) / k if k else math.nan
    return AtPComparison(atp_step, exact_step, units, ev, av, rho, k, overlap)
