"""The circuit figures as Vega-Lite charts (:mod:`headlab.figures`), for ``headlab report``, the notebook and
exported files; the numbers come from :mod:`headlab.circuit_view`.

- :func:`head_map_chart`: a ``(layer, head)`` score, signed scores on a diverging scale centred at 0;
- :func:`token_chart`: scores over tokens (residual-stream patching's ``(layer, token)``, chosen heads' per-token
  scores), the tokens' text on the token axis;
- :func:`dla_chart`: direct logit attribution as two bar panels, the heads apart from the totals;
- :func:`circuit_chart`: the circuit as a node-link diagram (:func:`graph_layout`: embeddings at the bottom,
  each layer's heads then its MLP, logits at the top), edges coloured by sign and as wide as ``|score|``,
  faithfulness in the title;
- :func:`atp_scatter`: attribution patching against exact patching, one point per unit, with the Spearman
  correlation and the top-k overlap;
- :func:`pattern_charts`: chosen heads' attention patterns (query x key) on one prompt, the tokens on both axes.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence

import altair as alt
import numpy as np
import xarray as xr

from . import figures
from .circuit_view import AtPComparison, Circuit, Edge, Node, dla_panels, parse_node

__all__ = ["SIGN_RANGE", "atp_scatter", "circuit_chart", "dla_chart", "graph_layout", "head_map_chart", "pattern_charts",
           "token_chart"]


#: the colours of a positive and a negative edge: the ends of the heatmaps' diverging scale
SIGN_RANGE = ("#b2182b", "#2166ac")


def head_map_chart(score: xr.DataArray, *, title: str, highlight: Sequence[tuple[int, int]] = ()) -> figures.Chart:
    """A ``(layer, head)`` (or ``(layer, kv_head)``) score as a heatmap: diverging and centred at 0 when a value
    is negative, sequential from 0 otherwise; ``highlight`` heads outlined."""
    head = "kv_head" if "kv_head" in score.dims else "head"
    return figures.heatmap(score.transpose("layer", head), x=head, y="layer", title=title, highlight=highlight,
                           x_title="key/value head" if head == "kv_head" else "head")


def token_chart(values: np.ndarray, rows: Sequence[str], tokens: Sequence[str], *, title: str,
                row_title: str, value: str = "score") -> figures.Chart:
    """``values`` ``(len(rows), len(tokens))`` as a heatmap with one column per token, labelled by its text
    (the same text twice stays two columns); signed values on a diverging scale centred at 0."""
    arr = np.asarray(values, dtype=float).reshape(len(rows), len(tokens))
    chart = figures.heatmap(arr, x="token", y=row_title, value=value, title=title, x_title="token",
                            y_title=row_title, x_labels=list(tokens), y_labels=list(rows), cell=20)
    return _every_token(chart)


def _every_token(chart: figures.Chart) -> figures.Chart:
    """Every token's label drawn (the same token twice is two columns, and none may be hidden)."""
    return chart.configure_axisX(labelOverlap=False, labelAngle=-60, labelLimit=90)


def dla_chart(ds: xr.Dataset, *, max_heads: int = 32,
              title: str = "direct logit attribution") -> tuple[figures.Chart, figures.Chart]:
    """A ``direct_logit_attribution`` result as two panels (:func:`headlab.circuit_view.dla_panels`): each head's
    direct effect on its own axis, and the heads' sum, ``rest`` and the logit difference they add up to."""
    heads, totals = dla_panels(ds, max_heads)
    what = "direct effect on logit[answer] - logit[wrong]"
    left = figures.bar_chart([{"term": t, "value": v} for t, v in heads], category="term", value="value",
                             value_title=what, category_title="head", title=[title, "each head"],
                             value_zero=True, bar=14)
    right = figures.bar_chart([{"term": t, "value": v} for t, v in totals], category="term", value="value",
                              value_title="mean over examples", category_title="total",
                              title=["", "heads + rest = logit diff"], bar=20, width=240)
    return left, right


def graph_layout(edges: Sequence[Edge]) -> tuple[dict[str, tuple[float, int]], list[str]]:
    """Positions of a circuit's nodes: node name -> ``(x, row)``, rows bottom (0) to top, ``x`` centred in its
    row; and each row's label (``emb``, ``L<layer> attn``, ``L<layer> mlp``, ``logits``, ``other``)."""
    nodes: dict[str, Node] = {}
    for e in edges:
        for name in (e.source, e.destination):
            node, _ = parse_node(name)
            nodes.setdefault(node.name, node)

    def row_key(node: Node) -> tuple[float, int]:
        if node.kind in ("other", "emb"):
            return (-2.0 if node.kind == "other" else -1.0, 0)
        if node.kind == "logits":
            return (math.inf, 0)
        return (float(node.layer), 0 if node.kind == "head" else 1)

    rows: dict[tuple[float, int], list[Node]] = {}
    for node in nodes.values():
        rows.setdefault(row_key(node), []).append(node)
    keys = sorted(rows)
    where: dict[str, tuple[float, int]] = {}
    labels = []
    for rank, key in enumerate(keys):
        members = sorted(rows[key], key=lambda n: (n.group, n.index, n.name))
        for i, node in enumerate(members):
            where[node.name] = (i - (len(members) - 1) / 2, rank)
        layer, part = key
        labels.append("other" if layer == -2 else "emb" if layer == -1 else "logits" if layer == math.inf
                      else f"L{int(layer)} {'attn' if part == 0 else 'mlp'}")
    return where, labels


def circuit_chart(circuit: Circuit | Sequence[Edge], *, title: str = "circuit") -> figures.Chart:
    """The circuit (a :class:`headlab.circuit_view.Circuit` or edges) as a node-link diagram laid out by
    :func:`graph_layout`: an edge from its source's node to its destination's (a query, key or value input
    enters left, middle or right of the node), coloured by its score on a diverging scale centred at 0 and as
    wide as ``|score|``; a circuit's faithfulness and normalised faithfulness in the title."""
    edges = list(circuit.edges if isinstance(circuit, Circuit) else circuit)
    where, labels = graph_layout(edges)
    port_dx = {"q": -0.25, "k": 0.0, "v": 0.25}
    rows = []
    for e in edges:
        s, _ = parse_node(e.source)
        d, port = parse_node(e.destination)
        (x1, y1), (x2, y2) = where[s.name], where[d.name]
        rows.append({"source": e.source, "destination": e.destination, "score": e.weight, "size": abs(e.weight),
                     "x": x1, "y": y1, "x2": x2 + port_dx.get(port or "", 0.0), "y2": y2})
    biggest = max((r["size"] for r in rows), default=1.0) or 1.0
    xs = [x for x, _ in where.values()] or [0.0]
    x_scale = alt.Scale(domain=[min(xs) - 0.8, max(xs) + 0.8])
    y_scale = alt.Scale(domain=[-0.5, max(len(labels), 1) - 0.5])
    y_axis = alt.Axis(title="row", values=list(range(len(labels))), labelExpr=f"{json.dumps(dict(enumerate(labels)))}"
                      "[datum.value]", grid=False)
    x_axis = alt.Axis(title="nodes of the row", labels=False, ticks=False, grid=False)
    for r in rows:
        r["sign"] = "positive" if r["score"] > 0 else "negative"
    link = alt.Chart(alt.Data(values=rows)).mark_rule(opacity=0.75).encode(
        x=alt.X("x:Q", scale=x_scale, axis=x_axis), y=alt.Y("y:Q", scale=y_scale, axis=y_axis), x2="x2:Q", y2="y2:Q",
        color=alt.Color("sign:N", title="edge score", scale=alt.Scale(domain=["positive", "negative"],
                                                                     range=list(SIGN_RANGE))),
        strokeWidth=alt.StrokeWidth("size:Q", title="|score|", scale=alt.Scale(domain=[0, biggest], range=[1, 8])),
        tooltip=[alt.Tooltip("source:N"), alt.Tooltip("destination:N"), alt.Tooltip("score:Q", format=".4g")])
    node_rows = [{"node": name, "x": x, "y": y} for name, (x, y) in where.items()]
    base = alt.Chart(alt.Data(values=node_rows)).encode(x=alt.X("x:Q", scale=x_scale, axis=x_axis),
                                                         y=alt.Y("y:Q", scale=y_scale, axis=y_axis),
                                                         tooltip=[alt.Tooltip("node:N")])
    boxes = base.mark_square(size=900, color="#f3f3f3", stroke="#555555", opacity=1)
    text = base.mark_text(fontSize=9).encode(text="node:N")
    if isinstance(circuit, Circuit):
        title = [title, f"{len(edges)} edges ({circuit.selection}); faithfulness {circuit.faithfulness:.3g}, "
                        f"normalised {circuit.faithfulness_normalised:.3g} (metric: clean {circuit.clean:.3g}, "
                        f"corrupted {circuit.corrupt:.3g}, circuit {circuit.circuit:.3g})"]
    width = int(min(900, max(260, 70 * (max(xs) - min(xs) + 2))))
    return alt.layer(link, boxes, text).properties(width=width, height=max(160, 56 * len(labels)), title=title)


def atp_scatter(c: AtPComparison, *, label_top: int = 10) -> figures.Chart:
    """Attribution patching's score (y) against exact patching's (x), one point per unit; the ``label_top``
    units of largest exact ``|score|`` labelled; the Spearman correlation and the top-k overlap in the title."""
    order = np.argsort(-np.abs(c.exact), kind="stable")[:label_top]
    shown = set(order.tolist())
    points = [{"unit": u, "label": u if i in shown else "", "exact": float(e), "atp": float(a)}
              for i, (u, e, a) in enumerate(zip(c.units, c.exact, c.atp, strict=True))]
    title = [f"{c.atp_step or 'AtP'} against {c.exact_step or 'exact patching'}",
             f"Spearman {c.spearman:.3f}; top-{c.top_k} overlap {c.top_k_overlap:.2f} ({len(points)} units)"]
    return figures.scatter(points, x="exact", y="atp", x_title="exact patching score", y_title="AtP estimate",
                           label="label", title=title, tooltip=["unit"])


def pattern_charts(patterns: xr.DataArray, *, title: str = "") -> list[figures.Chart]:
    """One heatmap per head of :func:`headlab.attention_patterns.head_patterns` (query down, key across, the
    tokens' text on both), on a sequential scale from 0 to 1."""
    charts = []
    for rank in range(patterns.sizes["rank"]):
        one = patterns.isel(rank=rank)
        head = f"L{int(one['layer'])}H{int(one['head'])}"
        charts.append(figures.heatmap(one.values, x="key", y="query", value="attention",
                                      title=f"{title}{head}", x_title="key (attended token)",
                                      y_title="query (attending token)", x_labels=list(one["key_token"].values),
                                      y_labels=list(one["query_token"].values), scale="sequential", vmin=0.0,
                                      vmax=1.0, cell=16).configure_axisY(labelOverlap=False))
    return [_every_token(c) for c in charts]
