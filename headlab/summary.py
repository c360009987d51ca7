"""Honest means: a metric's mean over examples with the n it averages over, the examples it dropped as
undefined (and the metric's reason), and a 95% interval.

Every mean that ``headlab show``, the run summary, the report and the widgets print comes from
:func:`estimate`, so they cannot disagree:

>>> e = estimate([1, 0, 1, float("nan")], metric="context_memory", drop_reason="the output matches neither answer")
>>> e.n, e.dropped, round(e.mean, 3), e.interval
(3, 1, 0.667, 'wilson')

A metric's per-example value is *undefined* where it is NaN (``context_memory`` on an output that matches
neither answer); such examples are left out of the mean and counted in ``dropped``. Values that are all 0
or 1 are proportions and get the Wilson score interval; other values get a seeded percentile bootstrap
interval of the mean.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

import numpy as np
import xarray as xr

__all__ = ["Estimate", "estimate", "metric_estimate", "UNDEFINED_ATTR", "BOOTSTRAP_RESAMPLES", "head_scores", "peak"]

UNDEFINED_ATTR = "undefined_when"
"""The per-example metric variable's attribute that holds the metric's reason for an undefined (NaN) value."""

BOOTSTRAP_RESAMPLES = 2000
"""Resamples of the bootstrap interval."""


@dataclass(frozen=True)
class Estimate:
    """A metric's mean over the examples where it is defined, with its n, drops and interval."""

    metric: str
    mean: float
    n: int
    dropped: int
    drop_reason: str | None
    low: float
    high: float
    interval: Literal["wilson", "bootstrap", "none"]
    level: float = 0.95

    @property
    def total(self) -> int:
        """Examples before dropping the undefined ones."""
        return self.n + self.dropped

    def interval_text(self, digits: int = 3) -> str:
        """``[low, high]``, or ``-`` where there is no interval (fewer than two defined values)."""
        if not (math.isfinite(self.low) and math.isfinite(self.high)):
            return "-"
        return f"[{self.low:.{digits}f}, {self.high:.{digits}f}]"

    def dropped_text(self) -> str:
        """``0``, or how many were dropped and why."""
        if not self.dropped:
            return "0"
        return f"{self.dropped} ({self.drop_reason})" if self.drop_reason else str(self.dropped)

    def text(self, digits: int = 3) -> str:
        """One line: mean, interval, n and drops."""
        mean = f"{self.mean:.{digits}f}" if math.isfinite(self.mean) else "undefined"
        out = f"{mean} {self.interval_text(digits)} n={self.n}"
        return out + (f", {self.dropped_text()} dropped" if self.dropped else "")

    def as_dict(self) -> dict[str, Any]:
        """The fields as plain Python values (JSON-ready)."""
        return asdict(self)


def _is_proportion(values: np.ndarray) -> bool:
    return values.size > 0 and bool(np.isin(values, (0.0, 1.0)).all())


def estimate(values: Sequence[float] | np.ndarray | Any, *, metric: str, proportion: bool | None = None,
             drop_reason: str | None = None, seed: int = 0, level: float = 0.95) -> Estimate:
    """The mean of ``values`` (an array or DataArray over examples) where they are defined (not NaN), with
    n, the number dropped as undefined and a ``level`` interval: Wilson's score interval for proportions
    (``proportion``; by default, when every defined value is 0 or 1), else a percentile bootstrap of the
    mean seeded by ``seed``. ``drop_reason`` is the metric's own words for an undefined value."""
    raw = np.asarray(getattr(values, "values", values), dtype=float).ravel()
    defined = raw[~np.isnan(raw)]
    n, dropped = int(defined.size), int(raw.size - defined.size)
    reason = drop_reason if dropped else None
    if n == 0:
        return Estimate(metric, math.nan, 0, dropped, reason, math.nan, math.nan, "none", level)
    mean = float(defined.mean())
    # scipy.stats takes ~1.5 s to import: imported here, not by every `headlab` command (show, runs, --help)
    from scipy import stats

    is_prop = _is_proportion(defined) if proportion is None else proportion
    if is_prop:
        ci = stats.binomtest(int(round(defined.sum())), n).proportion_ci(confidence_level=level, method="wilson")
        return Estimate(metric, mean, n, dropped, reason, float(ci.low), float(ci.high), "wilson", level)
    if n < 2 or np.all(defined == defined[0]):
        low = high = mean if n >= 2 else math.nan
        return Estimate(metric, mean, n, dropped, reason, low, high, "bootstrap" if n >= 2 else "none", level)
    res = stats.bootstrap((defined,), np.mean, confidence_level=level, n_resamples=BOOTSTRAP_RESAMPLES,
                          method="percentile", rng=np.random.default_rng(seed))
    return Estimate(metric, mean, n, dropped, reason, float(res.confidence_interval.low),
                    float(res.confidence_interval.high), "bootstrap", level)


def metric_estimate(values: Any, metric: str, *, seed: int = 0) -> Estimate:
    """:func:`estimate` of a stored per-example metric array, with the metric's reason for an undefined value
    from its ``undefined_when`` attribute (``"undefined (NaN)"`` where the metric gives none)."""
    attrs = getattr(values, "attrs", {}) or {}
    reason = str(attrs.get(UNDEFINED_ATTR) or "undefined (NaN)")
    return estimate(values, metric=metric, drop_reason=reason, seed=seed)


def peak(da: xr.DataArray, dim: str) -> xr.DataArray:
    """The entry of largest magnitude along ``dim``, its sign kept (NaN where every entry is NaN)."""
    arr = da.values.astype(float)
    axis = da.dims.index(dim)
    mag = np.where(np.isfinite(arr), np.abs(arr), -1.0)
    idx = np.expand_dims(mag.argmax(axis=axis), axis)
    out = np.take_along_axis(arr, idx, axis=axis).squeeze(axis)
    out[(mag < 0).all(axis=axis)] = np.nan
    return xr.DataArray(out, dims=[d for d in da.dims if d != dim],
                        coords={k: v for k, v in da.coords.items() if dim not in v.dims})


def head_scores(score: xr.DataArray) -> xr.DataArray:
    """One value per head of a head score (``(layer, head)``, or ``(layer, kv_head)``): a ``token`` dimension
    reduced to its per-token peak (:func:`peak`), every other dimension (sweep keys) averaged. The number the
    run summary, ``headlab show`` and the report's head maps give for a head."""
    head = "kv_head" if "kv_head" in score.dims and "head" not in score.dims else "head"
    if "token" in score.dims:
        score = peak(score, "token")
    extra = [d for d in score.dims if d not in ("layer", head)]
    if extra:
        score = score.mean(extra)
    return score.transpose("layer", head).astype(float)
