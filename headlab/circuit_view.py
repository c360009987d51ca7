"""Figures of circuit analyses, shared by ``headlab report`` and the notebook widgets.

- :func:`circuit_kind` tells a detect result's kind by its variables and attrs: ``"patching"``
  (``activation_patching`` / ``attribution_patching``: ``score`` over ``(layer, head[, token])`` or
  ``(layer, kv_head)`` beside ``clean`` and ``corrupt``), ``"dla"`` (``direct_logit_attribution``: ``score``,
  ``rest``, ``logit_diff``) or ``"edges"`` (edge attribution: ``score`` over ``(source, destination)``, or over one
  edge dimension with ``source`` and ``destination`` coordinates).
- :func:`head_map` reduces a patching score to one value per head, :func:`position_grid_svg` draws chosen
  heads' scores per token.
- :func:`dla_terms` / :func:`dla_bars_svg`: each head's direct effect, the heads left out, the rest and the
  total as signed bars.
- :func:`parse_node`, :func:`circuit_edges` and :func:`circuit_graph_svg`: the circuit as a graph whose nodes
  (embeddings, heads, MLPs, logits) are laid out by layer, embeddings at the bottom and logits at the top, and
  whose edges are as wide as their weight's magnitude and coloured by its sign.

Node names (edge attribution's labels): ``emb``, ``logits``, ``a<layer>.h<head>`` (a head; a destination may
name its input, ``a3.h1.q`` / ``.k`` / ``.v``; other groups such as ``a3.kv0.k`` are heads of that layer too),
``m<layer>`` (an MLP). Any other name is drawn on a row of its own below the embeddings.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from html import escape
from typing import Literal, NamedTuple

import numpy as np
import xarray as xr

from .summary import head_scores
from .svg import SIGN_COLORS, bar_chart_svg, grid_svg, sign_color

__all__ = ["Edge", "Node", "circuit_edges", "circuit_graph_svg", "circuit_kind", "dla_bars_svg", "dla_terms",
           "head_map", "parse_node", "position_grid_svg"]

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
    if "layer" in dims and ("head" in dims or "kv_head" in dims):
        if method in _PATCHING or ({"clean", "corrupt"} <= set(ds.data_vars) and ("patched" in ds or "atp" in ds)):
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


def position_grid_svg(score: xr.DataArray, heads: Sequence[tuple[int, int]], *, tokens: Sequence[str] | None = None,
                      title: str = "score per token", cell: int = 16) -> str:
    """The per-token scores of ``heads`` (rows ``L<layer>H<head>``) from a ``(layer, head, token)`` score, one
    column per token (labelled by ``tokens`` when given, else its index), as a :func:`headlab.svg.grid_svg`."""
    extra = [d for d in score.dims if d not in ("layer", "head", "token")]
    if extra:
        score = score.mean(extra)
    score = score.transpose("layer", "head", "token")
    n = score.sizes["token"]
    if tokens is not None:
        cols = [str(t) for t in tokens]
    elif "token" in score.coords:
        cols = [str(int(t)) for t in score["token"].values]
    else:
        cols = [str(t) for t in range(n)]
    if len(cols) != n:
        raise ValueError(f"{len(cols)} token labels for {n} tokens")
    values = np.array([score.sel(layer=layer, head=head).values for layer, head in heads], dtype=float).reshape(
        len(heads), n)
    return grid_svg(values, [_head_label(a, b) for a, b in heads], cols, title=title, cell=cell)


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


def dla_bars_svg(ds: xr.Dataset, *, max_heads: int = 32, title: str = "direct logit attribution") -> str:
    """:func:`dla_terms` as signed bars (:func:`headlab.svg.bar_chart_svg`)."""
    terms = dla_terms(ds, max_heads)
    return bar_chart_svg([t for t, _ in terms], [v for _, v in terms], title=title,
                         xlabel="contribution to logit[answer] - logit[wrong] (mean over examples)")


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


def _row(node: Node) -> tuple[float, int]:
    """A node's row: bottom (other, embeddings) to top (logits); a layer's heads below its MLP."""
    if node.kind == "other":
        return (-2.0, 0)
    if node.kind == "emb":
        return (-1.0, 0)
    if node.kind == "logits":
        return (math.inf, 0)
    return (float(node.layer), 0 if node.kind == "head" else 1)


def _row_label(key: tuple[float, int]) -> str:
    layer, part = key
    if layer == -2:
        return "other"
    if layer == -1:
        return "emb"
    if layer == math.inf:
        return "logits"
    return f"L{int(layer)} {'attn' if part == 0 else 'mlp'}"


def circuit_graph_svg(edges: Sequence[Edge], *, title: str = "circuit", col: int = 64, row: int = 64) -> str:
    """The circuit of ``edges`` as inline SVG: one box per node (``data-node``), rows by layer (embeddings at
    the bottom, each layer's heads then its MLP, logits at the top), an edge per entry (``data-source``,
    ``data-destination``, ``data-port``, ``data-weight``) from its source's box to its destination's, an input
    port (q, k, v) marked where it enters, width proportional to ``|weight|`` over the largest, coloured by sign
    (:data:`headlab.svg.SIGN_COLORS`)."""
    nodes: dict[str, Node] = {}
    parsed: list[tuple[Edge, Node, Node, str | None]] = []
    for e in edges:
        s, _ = parse_node(e.source)
        d, port = parse_node(e.destination)
        nodes.setdefault(s.name, s)
        nodes.setdefault(d.name, d)
        parsed.append((e, nodes[s.name], nodes[d.name], port))
    rows: dict[tuple[float, int], list[Node]] = {}
    for node in nodes.values():
        rows.setdefault(_row(node), []).append(node)
    keys = sorted(rows)
    widest = max((len(v) for v in rows.values()), default=1)
    left, top, box_w, box_h = 70, 26 if title else 8, col - 12, 20
    left += col if len(keys) > 2 else 0  # room for the edges that bow left
    width = max(left + widest * col + 16 + (col if len(keys) > 2 else 0), 300)
    height = top + max(len(keys), 1) * row + 30
    where: dict[str, tuple[float, float]] = {}
    row_of: dict[str, int] = {}
    for rank, key in enumerate(keys):
        members = sorted(rows[key], key=lambda n: (n.group, n.index, n.name))
        y = top + (len(keys) - 1 - rank) * row + row / 2
        offset = left + (widest - len(members)) * col / 2
        for i, node in enumerate(members):
            where[node.name] = (offset + i * col + col / 2, y)
            row_of[node.name] = rank
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" class="circuit" width="{width}" height="{height}" '
             f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="10">']
    if title:
        parts.append(f'<text x="4" y="14" font-size="12" font-weight="bold">{escape(title)}</text>')
    for rank, key in enumerate(keys):
        y = top + (len(keys) - 1 - rank) * row + row / 2
        parts.append(f'<text x="4" y="{y + 3:.1f}" fill="#666">{escape(_row_label(key))}</text>')
    biggest = max((abs(e.weight) for e in edges), default=1.0) or 1.0
    port_dx = {"q": -box_w / 3, "k": 0.0, "v": box_w / 3}
    for k, (e, s, d, port) in enumerate(parsed):
        (x1, y1), (x2, y2) = where[s.name], where[d.name]
        # an edge past rows between its ends bows sideways, so it does not run through their boxes
        bow = min(abs(row_of[d.name] - row_of[s.name]) - 1, 5) * col * 0.3 * (1 if k % 2 else -1)
        x2 += port_dx.get(port or "", 0.0)
        if y1 >= y2:  # the usual case: the source below its destination
            y1, y2 = y1 - box_h / 2, y2 + box_h / 2
        else:
            y1, y2 = y1 + box_h / 2, y2 - box_h / 2
        mid = (y1 + y2) / 2
        w = 1 + 5 * abs(e.weight) / biggest
        label = f"{escape(e.source)} \u2192 {escape(e.destination)}: {e.weight:.4g}"
        parts.append(f'<path d="M{x1:.1f},{y1:.1f} C{x1 + bow:.1f},{mid:.1f} {x2 + bow:.1f},{mid:.1f} {x2:.1f},{y2:.1f}" '
                     f'fill="none" stroke="{sign_color(e.weight)}" stroke-width="{w:.2f}" stroke-opacity="0.75" '
                     f'data-source="{escape(e.source)}" data-destination="{escape(e.destination)}" '
                     f'data-port="{port or ""}" data-weight="{e.weight:.6g}"><title>{label}</title></path>')
        if port:
            dy = 8 if y2 > y1 else -3
            parts.append(f'<text x="{x2:.1f}" y="{y2 + dy:.1f}" text-anchor="middle" font-size="8" '
                         f'fill="#333">{port}</text>')
    for name, (x, y) in where.items():
        node = nodes[name]
        fill = {"head": "#f3f3f3", "mlp": "#e8eef7", "emb": "#f7efe2", "logits": "#f7efe2"}.get(node.kind, "#ffffff")
        parts.append(f'<g class="node" data-node="{escape(name)}" data-kind="{node.kind}">'
                     f'<rect x="{x - box_w / 2:.1f}" y="{y - box_h / 2:.1f}" width="{box_w}" height="{box_h}" rx="4" '
                     f'fill="{fill}" stroke="#555"/><text x="{x:.1f}" y="{y + 3.5:.1f}" text-anchor="middle">'
                     f'{escape(name)}</text><title>{escape(name)}</title></g>')
    y = height - 10
    parts.append(f'<text x="4" y="{y}" fill="{SIGN_COLORS["positive"]}">\u2014 positive</text>'
                 f'<text x="70" y="{y}" fill="{SIGN_COLORS["negative"]}">\u2014 negative</text>'
                 f'<text x="136" y="{y}" fill="#666">width: |score| / {biggest:.3g}</text>')
    parts.append("</svg>")
    return "".join(parts)
