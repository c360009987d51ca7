"""Notebook widgets over headlab's runs, specs and instrumentation (``pip install 'headlab[notebook]'``).

- :class:`HeadMap`: (layer x head) heatmap of any score array; hover values, click/drag selection
  as a head list, a spec fragment (``heads: [[l, h], ...]``) and PASTA JSON.
- :class:`AttentionView`: tokens coloured by one head's attention from one query (or the attention
  mass on named spans), through the instrumentation probes, paged for long inputs; with images (a
  vision-language model), each image with the head's attention as a heatmap over its patches.
- :class:`ImagePatchView`: an image with one value per patch as a heatmap (hover/click for values).
- :class:`SpecRunner`: edit/load a spec, validate with inline errors, run with live progress,
  cancel into a resumable run, result tables.
- :class:`PatchingMap`, :class:`DLABars`, :class:`CircuitGraph`: circuit analyses (patching per head and, on
  a click, per token; direct logit attribution as signed bars; an edge attribution's circuit as a graph).
- :class:`KvTradeoff`: a metric of the steps with a ``kv`` policy against the kept KV fraction or bytes, one
  point per step and sweep cell.
- :class:`AtlasMap`: the roles of every head of a labelled head cube (the atlas), a stripe per role; hover lists
  the head's scores, click selects it.
- :class:`RunBrowser` / :class:`Compare`: runs of a store, metric tables across sweep cells and runs,
  generations side by side with differences highlighted.
- :func:`step_view` / :func:`run_views`: the figure each stored step takes (the widget above that fits its
  result), as the browser and the runner show them.

Everything renders offline in JupyterLab (the JavaScript is inline; nothing is fetched).
"""

from __future__ import annotations

try:
    import anywidget  # noqa: F401
    import ipywidgets  # noqa: F401
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("headlab.widgets needs the notebook extras: pip install 'headlab[notebook]'") from e

from .atlas import AtlasMap, hover_lines
from .attention import AttentionView, TokenView
from .browser import (
    Compare,
    RunBrowser,
    diff_html,
    generation_table,
    generations_html,
    metric_table,
    side_by_side,
    top_heads_table,
)
from .circuits import CircuitGraph, DLABars, PatchingMap
from .headmap import HeadMap, as_head_scores, spec_fragment
from .image import ImagePatchView
from .kv import KvTradeoff
from .runner import SpecRunner, WidgetReporter, error_html
from .views import run_views, step_view

__all__ = [
    "AtlasMap", "AttentionView", "CircuitGraph", "Compare", "DLABars", "HeadMap", "ImagePatchView", "KvTradeoff", "PatchingMap", "RunBrowser",
    "SpecRunner", "TokenView", "WidgetReporter",
    "as_head_scores", "diff_html", "error_html", "generation_table", "generations_html", "hover_lines", "metric_table",
    "run_views", "side_by_side", "spec_fragment", "step_view", "top_heads_table",
]
