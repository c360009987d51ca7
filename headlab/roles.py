"""Reading a labelled head cube: every head of a model scored, ranked and labelled by several detectors.

A cube is an xarray Dataset with ``score``, ``label`` (bool) and ``rank`` (1 = top) over ``(detector, layer,
head)``, and per detector its ``threshold`` (a label is ``score >= threshold``), where the threshold comes from
(``threshold_source``), and the null's ``null_mean`` and ``null_std`` (the detector on a control where the role
cannot exist). A comparison of two cubes holds ``score_diff`` and ``label_change`` (+1 a head gained the role,
-1 it lost it) over ``(detector, layer, head)`` and ``rank_correlation (detector)``. A causal check adds
``effect (detector)``, ``control_effect (detector, draw)`` and ``supported (detector)``.

This module turns them into plain rows: the roles of each head (:func:`roles_by_head`), a head's card (every
detector's score, label, rank and threshold margin, :func:`head_card`, :func:`head_cards`), the top heads of
each role (:func:`top_heads`), the causal check per role (:func:`causal_rows`, :func:`causal_sentence`) and the
heads that gained or lost a role (:func:`changed_heads`). The figures of :mod:`headlab.role_figures`, the
notebook widget and the exports are built from these rows.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import xarray as xr

__all__ = ["CARD_FIELDS", "causal_rows", "causal_sentence", "changed_heads", "detectors", "head_card", "head_cards",
           "heads_text", "is_cube", "is_cube_comparison", "per_detector", "roles_by_head", "top_heads"]

CARD_FIELDS = ("score", "label", "rank", "threshold", "margin")
"""What a head card gives per detector: the score, the label, the rank (1 = top), the threshold and the margin
``score - threshold`` (positive: the label is set)."""

_CUBE_DIMS = ("detector", "layer", "head")


def _over_cube(ds: xr.Dataset, name: str) -> bool:
    return name in ds and set(_CUBE_DIMS) <= set(ds[name].dims)


def is_cube(ds: xr.Dataset) -> bool:
    """Whether ``ds`` is a labelled head cube: ``score`` and ``label`` over ``(detector, layer, head)``."""
    return _over_cube(ds, "score") and _over_cube(ds, "label")


def is_cube_comparison(ds: xr.Dataset) -> bool:
    """Whether ``ds`` compares two cubes: ``score_diff`` and ``label_change`` over ``(detector, layer, head)``."""
    return _over_cube(ds, "score_diff") and _over_cube(ds, "label_change")


def detectors(ds: xr.Dataset) -> list[str]:
    """The cube's detectors, in its order."""
    return [str(d) for d in ds["detector"].values]


def per_detector(ds: xr.Dataset, name: str, detector: str, default: Any = None) -> Any:
    """The value of ``name`` for one detector: a variable over ``detector``, a variable without it or an
    attribute (the same for every detector), else ``default``. Numbers come back as Python floats, NaN as None."""
    if name in ds:
        da = ds[name]
        value = da.sel(detector=detector).values if "detector" in da.dims else da.values
        value = value.item() if np.ndim(value) == 0 else value
    elif name in ds.attrs:
        value = ds.attrs[name]
    else:
        return default
    if isinstance(value, (bytes, np.bytes_)):
        value = value.decode()
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, (int, float, np.integer, np.floating)):
        f = float(value)
        return f if math.isfinite(f) else None
    return value


def _grid(ds: xr.Dataset, name: str) -> np.ndarray:
    return ds[name].transpose(*_CUBE_DIMS).values


def _layers_heads(ds: xr.Dataset) -> tuple[list[int], list[int]]:
    layers = [int(v) for v in (ds["layer"].values if "layer" in ds.coords else range(ds.sizes["layer"]))]
    heads = [int(v) for v in (ds["head"].values if "head" in ds.coords else range(ds.sizes["head"]))]
    return layers, heads


def _number(v: Any) -> float | None:
    f = float(v)
    return f if math.isfinite(f) else None


def roles_by_head(cube: xr.Dataset) -> dict[tuple[int, int], list[str]]:
    """Every head's roles (the detectors that label it), in the cube's detector order; a head without a label
    maps to an empty list."""
    names = detectors(cube)
    layers, heads = _layers_heads(cube)
    label = _grid(cube, "label").astype(bool)
    return {(la, he): [names[d] for d in range(len(names)) if label[d, i, j]]
            for i, la in enumerate(layers) for j, he in enumerate(heads)}


def _cards(cube: xr.Dataset, cells: list[tuple[int, int]]) -> list[dict[str, Any]]:
    names = detectors(cube)
    score = _grid(cube, "score").astype(float)
    label = _grid(cube, "label").astype(bool)
    rank = _grid(cube, "rank") if "rank" in cube else None
    thresholds = [per_detector(cube, "threshold", n) for n in names]
    layers, heads = _layers_heads(cube)
    cards = []
    for i, j in cells:
        card: dict[str, Any] = {"layer": layers[i], "head": heads[j], "roles": [], "detectors": {}}
        for d, name in enumerate(names):
            s = _number(score[d, i, j])
            t = thresholds[d]
            card["detectors"][name] = {"score": s, "label": bool(label[d, i, j]),
                                       "rank": int(rank[d, i, j]) if rank is not None else None, "threshold": t,
                                       "margin": None if s is None or t is None else s - t}
            if label[d, i, j]:
                card["roles"].append(name)
        cards.append(card)
    return cards


def head_card(cube: xr.Dataset, layer: int, head: int) -> dict[str, Any]:
    """One head's card: ``{"layer", "head", "roles": [...], "detectors": {detector: {score, label, rank,
    threshold, margin}}}`` (:data:`CARD_FIELDS`; NaN as None)."""
    layers, heads = _layers_heads(cube)
    return _cards(cube, [(layers.index(int(layer)), heads.index(int(head)))])[0]


def head_cards(cube: xr.Dataset) -> list[dict[str, Any]]:
    """The card of every head (:func:`head_card`), layer by layer, head by head."""
    layers, heads = _layers_heads(cube)
    return _cards(cube, [(i, j) for i in range(len(layers)) for j in range(len(heads))])


def top_heads(cube: xr.Dataset, k: int = 5) -> list[dict[str, Any]]:
    """Per detector, its ``k`` best heads by ``rank`` (by score where the cube has no rank; NaN last): rows of
    ``detector, rank, layer, head, score, label, threshold, margin`` (``score - threshold``), ``null_z`` (how many
    of the null's standard deviations the score lies above the null's mean; None without a null) and
    ``threshold_source``."""
    layers, heads = _layers_heads(cube)
    score = _grid(cube, "score").astype(float)
    label = _grid(cube, "label").astype(bool)
    rank = _grid(cube, "rank") if "rank" in cube else None
    rows = []
    for d, name in enumerate(detectors(cube)):
        flat = score[d].ravel()
        if rank is not None:
            order = np.argsort(rank[d].ravel(), kind="stable")
        else:
            order = np.argsort(np.where(np.isnan(flat), np.inf, -flat), kind="stable")
        threshold = per_detector(cube, "threshold", name)
        mean, std = per_detector(cube, "null_mean", name), per_detector(cube, "null_std", name)
        source = per_detector(cube, "threshold_source", name, "")
        for index in order[:k]:
            i, j = divmod(int(index), len(heads))
            s = _number(flat[index])
            null_z = None
            if s is not None and mean is not None and std:
                null_z = (s - mean) / std
            rows.append({"detector": name, "rank": int(rank[d, i, j]) if rank is not None else len(rows) + 1,
                         "layer": layers[i], "head": heads[j], "score": s, "label": bool(label[d, i, j]),
                         "threshold": threshold,
                         "margin": None if s is None or threshold is None else s - threshold,
                         "null_z": null_z, "threshold_source": str(source)})
    return rows


def causal_rows(cube: xr.Dataset) -> list[dict[str, Any]]:
    """Per detector the cube's causal check says something about: ``detector``, ``metric`` (``causal_metric``),
    ``status`` (``causal_status``: ``supported``, ``not supported``, ``no labelled heads``, ...; from
    ``supported`` where the cube has no status), ``effect`` (None where none was measured), ``control_mean``,
    ``control_std`` (sample std, ``ddof=1``) of the random draws, ``control_low`` / ``control_high`` (mean minus
    and plus two std: a label is supported when its effect is positive and above ``control_high``), ``draws``
    (finite draws), ``supported`` (None where the cube does not say) and ``k`` (heads masked per role)."""
    if "effect" not in cube:
        return []
    k = cube.attrs.get("causal_k")
    rows = []
    for name in detectors(cube):
        effect = per_detector(cube, "effect", name)
        status = per_detector(cube, "causal_status", name)
        if effect is None and not status:
            continue
        draws = np.array([], dtype=float)
        if "control_effect" in cube and effect is not None:
            c = cube["control_effect"].sel(detector=name).values.astype(float).ravel()
            draws = c[np.isfinite(c)]
        supported = per_detector(cube, "supported", name)
        supported = None if supported is None or effect is None else bool(supported)
        mean = float(draws.mean()) if draws.size else None
        std = float(draws.std(ddof=1)) if draws.size > 1 else None
        rows.append({"detector": name, "metric": str(per_detector(cube, "causal_metric", name, "") or ""),
                     "status": str(status or {True: "supported", False: "not supported", None: ""}[supported]),
                     "effect": effect, "control_mean": mean, "control_std": std,
                     "control_low": None if std is None else mean - 2 * std,
                     "control_high": None if std is None else mean + 2 * std,
                     "draws": int(draws.size), "supported": supported,
                     "k": int(k) if isinstance(k, (int, np.integer)) else None})
    return rows


def causal_sentence(row: dict[str, Any]) -> str:
    """One row of :func:`causal_rows` in words: the harm done by ablating the role's top labelled heads against
    random heads, and whether the label is causally supported ("not supported" said as such); a role that was
    not measured gets its status."""
    if row["effect"] is None:
        return f"{row['detector']}: {row['status'] or 'not measured'}."
    heads = f"its top {row['k']} labelled heads" if row["k"] else "its top labelled heads"
    metric = f" ({row['metric']})" if row["metric"] else ""
    control = ("no random draws" if row["control_mean"] is None else
               f"random heads {row['control_mean']:+.3g}" + (f" ± {row['control_std']:.2g}" if row["control_std"]
                                                             is not None else "") + f" over {row['draws']} draws")
    verdict = {True: "supported", False: "not supported: its heads do no more than random heads",
               None: "support not recorded"}[row["supported"]]
    return f"{row['detector']}: ablating {heads} harms the role's metric{metric} by {row['effect']:+.3g}, {control}; " \
           f"{verdict}."


def changed_heads(comparison: xr.Dataset) -> list[dict[str, Any]]:
    """Per detector, the heads that gained the role (``label_change`` +1) and lost it (-1), each with its
    ``score_diff``: rows of ``detector, gained, lost`` (lists of ``(layer, head, score_diff)``, largest
    ``|score_diff|`` first) and ``rank_correlation`` (None when not stored)."""
    layers, heads = _layers_heads(comparison)
    change = _grid(comparison, "label_change").astype(int)
    diff = _grid(comparison, "score_diff").astype(float)
    rows = []
    for d, name in enumerate(detectors(comparison)):
        found: dict[int, list[tuple[int, int, float | None]]] = {1: [], -1: []}
        for sign in (1, -1):
            for i, j in zip(*np.nonzero(change[d] == sign), strict=True):
                found[sign].append((layers[i], heads[j], _number(diff[d, i, j])))
            found[sign].sort(key=lambda t: (-abs(t[2]) if t[2] is not None else 0.0, t[0], t[1]))
        rows.append({"detector": name, "gained": found[1], "lost": found[-1],
                     "rank_correlation": per_detector(comparison, "rank_correlation", name)})
    return rows


def heads_text(heads: Sequence[tuple[int, int, float | None]]) -> str:
    """``L3H1 (+0.42), L0H2 (-0.1)``: heads with their score differences."""
    return ", ".join(f"L{la}H{he}" + (f" ({d:+.3g})" if d is not None else "") for la, he, d in heads) or "none"
