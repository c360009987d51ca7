"""Comparing the atlases of two models of the same geometry (a base model and a fine-tune, or two checkpoints of
one run): which heads gained or lost each role, and whether each detector ranks the heads alike.

Definition (docs/atlas.md#compare): for every detector in both cubes, per head,

- ``score_diff = score_B - score_A``;
- ``label_change``: ``+1`` where B labels the head and A does not (gained), ``-1`` where A does and B does not
  (lost), ``0`` otherwise; each model's labels follow its own cube's thresholds;
- ``rank_correlation (detector)``: Spearman's rho between the two models' scores over every head
  (``scipy.stats.spearmanr``; NaN where either model's scores are constant or missing), with its p-value
  ``rank_correlation_p``. A role carried by the same heads in both models has rho near 1.

:func:`compare_cubes` returns these (with ``score_b`` and ``label_b``) on the ``(detector, layer, head)`` grid
of the detectors both cubes hold, and attrs ``compare_model`` (B's name), ``gained`` and ``lost`` (JSON:
detector -> ``["L<layer>H<head>", ...]``) and ``compare_only`` (JSON: detectors one model's cube lacks, with
which). :func:`geometry_mismatch` says how two head geometries differ; the atlas refuses to compare models
whose layers, heads, key/value heads or head dimension differ.

In the atlas (``atlas: {compare: B}``, ``headlab atlas A --compare B``) B is loaded like A (a registered model's
name or a local checkpoint directory, on A's device and dtype; :func:`load_like`), its geometry is checked before
any detector runs, B's atlas is built with A's settings and seed, and :func:`merge_comparison` adds the
comparison to A's cube: one result holds both (``score`` and ``label`` are A's; ``score_b``, ``label_b`` B's).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import xarray as xr

from headlab import Geometry, component, load_model
from headlab.plugin import LoadedModel, ModelSpec

__all__ = ["compare_cubes", "comparison_lines", "geometry_mismatch", "load_like", "merge_comparison"]


def geometry_mismatch(a: Geometry, b: Geometry) -> str | None:
    """What differs between two head geometries (``None`` when nothing does), e.g. ``"layers 4 vs 2"``."""
    fields = (("layers", "n_layers"), ("heads", "n_heads"), ("key/value heads", "n_kv_heads"),
              ("head_dim", "head_dim"))
    diffs = [f"{label} {getattr(a, name)} vs {getattr(b, name)}" for label, name in fields
             if getattr(a, name) != getattr(b, name)]
    return ", ".join(diffs) or None


def _spearman(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    from scipy.stats import spearmanr

    ok = np.isfinite(x) & np.isfinite(y)
    if ok.sum() < 3 or np.ptp(x[ok]) == 0 or np.ptp(y[ok]) == 0:
        return float("nan"), float("nan")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = spearmanr(x[ok], y[ok])
    return float(res.statistic), float(res.pvalue)


def _heads(mask: np.ndarray) -> list[str]:
    return [f"L{layer}H{head}" for layer, head in np.argwhere(mask)]


def compare_cubes(a: xr.Dataset, b: xr.Dataset, *, model_b: str = "") -> xr.Dataset:
    """The per-head differences of cube ``b`` from cube ``a`` (see the module docstring). Raises ``ValueError``
    when their (layer, head) grids differ."""
    if (a.sizes["layer"], a.sizes["head"]) != (b.sizes["layer"], b.sizes["head"]):
        raise ValueError(f"the two atlases have different head grids: {a.sizes['layer']} x {a.sizes['head']} vs "
                         f"{b.sizes['layer']} x {b.sizes['head']} (layers x heads)")
    names_a = [str(d) for d in a["detector"].values]
    names_b = {str(d) for d in b["detector"].values}
    both = [d for d in names_a if d in names_b]
    only = {d: "A" for d in names_a if d not in names_b}
    only.update({d: "B" for d in sorted(names_b) if d not in names_a})
    sa = a["score"].sel(detector=both).values.astype(float)
    sb = b["score"].sel(detector=both).values.astype(float)
    la = a["label"].sel(detector=both).values.astype(bool)
    lb = b["label"].sel(detector=both).values.astype(bool)
    change = lb.astype(np.int8) - la.astype(np.int8)
    rho = np.array([_spearman(sa[i].ravel(), sb[i].ravel()) for i in range(len(both))]).reshape(len(both), 2)
    dims = ("detector", "layer", "head")
    out = xr.Dataset(
        {"score_b": (dims, sb), "label_b": (dims, lb), "score_diff": (dims, sb - sa), "label_change": (dims, change),
         "rank_correlation": ("detector", rho[:, 0]), "rank_correlation_p": ("detector", rho[:, 1])},
        coords={"detector": both, "layer": a["layer"].values if "layer" in a.coords else np.arange(sa.shape[1]),
                "head": a["head"].values if "head" in a.coords else np.arange(sa.shape[2])})
    out.attrs.update(
        compare_model=model_b or str(b.attrs.get("model", "")),
        gained=json.dumps({d: _heads(change[i] > 0) for i, d in enumerate(both)}),
        lost=json.dumps({d: _heads(change[i] < 0) for i, d in enumerate(both)}),
        compare_only=json.dumps(only))
    return out


def comparison_lines(ds: xr.Dataset) -> list[str]:
    """One line per detector of a comparison: the rank correlation and the heads gained and lost."""
    gained, lost = json.loads(ds.attrs["gained"]), json.loads(ds.attrs["lost"])
    lines = []
    for name in ds["detector"].values:
        d = str(name)
        rho = float(ds["rank_correlation"].sel(detector=d))
        text = f"{d:<18} rank correlation {rho:+.2f}" if np.isfinite(rho) else f"{d:<18} rank correlation   n/a"
        text += f"  gained: {', '.join(gained[d]) or '-'}  lost: {', '.join(lost[d]) or '-'}"
        lines.append(text)
    return lines


def load_like(ref: str, lm: LoadedModel) -> LoadedModel:
    """The model ``ref`` names (a registered model's name or a local checkpoint directory; remote code off), on
    ``lm``'s device and in its dtype; ``ValueError`` when ``ref`` is neither or its geometry differs from ``lm``'s."""
    try:
        component("models", ref)
        spec = ModelSpec(id=ref)
    except Exception:  # noqa: BLE001 - not a registered name: a checkpoint directory or nothing
        if not Path(ref).expanduser().is_dir():
            raise ValueError(f"compare: {ref!r} is neither a registered model (headlab-tiny, ...) nor a local "
                             "checkpoint directory; give the model to compare with as one of them") from None
        spec = ModelSpec(path=str(Path(ref).expanduser()))
    dtype = str(getattr(lm.model, "dtype", "float32")).removeprefix("torch.")
    device = str(getattr(lm.model, "device", "cpu"))
    spec = spec.model_copy(update={"device": device, "dtype": dtype if dtype in ("float32", "bfloat16", "float16")
                                   else "auto"})
    other = load_model(spec)
    diff = geometry_mismatch(lm.geometry, other.geometry)
    if diff is not None:
        raise ValueError(f"compare: {ref} does not have the geometry of {lm.name} ({diff}); compare two models "
                         "with the same layers, heads, key/value heads and head_dim (a base model and its "
                         "fine-tune, two checkpoints of one run)")
    return other


def merge_comparison(cube: xr.Dataset, comparison: xr.Dataset) -> xr.Dataset:
    """``cube`` (A's) with the comparison's variables and attrs added, on A's detectors (a detector B lacks:
    ``score_b``, ``score_diff`` and the correlation NaN, ``label_b`` False, ``label_change`` 0)."""
    full = comparison.reindex(detector=cube["detector"].values)
    missing = ~cube["detector"].isin(comparison["detector"].values)
    out = cube.copy()
    for name in ("score_b", "score_diff", "rank_correlation", "rank_correlation_p"):
        out[name] = full[name].astype(float)
    out["label_b"] = full["label_b"].where(~missing, False).astype(bool)
    out["label_change"] = full["label_change"].where(~missing, 0).astype(np.int8)
    out.attrs.update(comparison.attrs)
    return out
