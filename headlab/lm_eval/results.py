"""lm-eval's results as an xarray Dataset: per-task metrics over ``task``, logged samples over ``example``."""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import xarray as xr

try:  # for its version; results read without it too
    import lm_eval
except ImportError:  # pragma: no cover - exercised without the extra
    lm_eval = None

__all__ = ["results_dataset"]


log = logging.getLogger("headlab.lm_eval")


def _metric_keys(results: Mapping[str, Any]) -> list[tuple[str, str]]:
    """``(metric, filter)`` pairs of lm-eval's per-task results, stderr excluded, in first-seen order."""
    keys: list[tuple[str, str]] = []
    for row in results.values():
        for key in row:
            if "," not in key or "_stderr," in key:
                continue
            metric, filt = key.split(",", 1)
            if (metric, filt) not in keys:
                keys.append((metric, filt))
    return keys


def _names(keys: list[tuple[str, str]]) -> dict[tuple[str, str], str]:
    """Variable names: the metric's name, or ``metric_filter`` when a metric comes with several filters."""
    count: dict[str, int] = {}
    for metric, _ in keys:
        count[metric] = count.get(metric, 0) + 1
    return {(m, f): (m if count[m] == 1 else f"{m}_{f}") for m, f in keys}


def _float(value: Any) -> float:
    try:
        out = float(value)
    except (TypeError, ValueError):
        return math.nan
    return out


def results_dataset(results: Mapping[str, Any]) -> xr.Dataset:
    """lm-eval's results (``simple_evaluate(..., log_samples=True)``) as one xarray Dataset.

    - over ``task`` (the tasks and groups lm-eval reports): one variable per metric (``acc``,
      ``exact_match``; ``<metric>_<filter>`` when a metric comes with several filters), its standard error
      ``<name>_stderr``, and ``n_samples``;
    - over ``example`` (one per logged sample and filter; coordinates ``sample_task``, ``doc_id``,
      ``filter``): ``prompt`` (the context the task produced, markers included), ``target``, ``output`` (the
      filtered generation; ``raw_output`` before the filters), ``logprob``, ``is_greedy`` and
      ``choice_text`` over ``(example, choice)`` for log-likelihood requests, and the sample's metric values
      ``sample_<name>`` (NaN where a sample's task has no such metric).

    ``attrs``: ``metrics`` (the per-task metric names), ``filters`` (name -> lm-eval filter), ``higher_is_better``,
    ``lm_eval_version``, ``task_versions``, ``n_shot``.
    """
    per_task = dict(results.get("results", {}))
    tasks = list(per_task)
    keys = _metric_keys(per_task)
    names = _names(keys)
    data: dict[str, Any] = {}
    for key, name in names.items():
        metric, filt = key
        data[name] = ("task", np.array([_float(per_task[t].get(f"{metric},{filt}")) for t in tasks]))
        data[f"{name}_stderr"] = ("task", np.array([_float(per_task[t].get(f"{metric}_stderr,{filt}"))
                                                    for t in tasks]))
    n_samples = results.get("n-samples", {})
    data["n_samples"] = ("task", np.array([int(n_samples.get(t, {}).get("effective", -1)) for t in tasks],
                                          dtype=np.int64))
    samples = [(t, s) for t, rows in results.get("samples", {}).items() for s in rows]
    width = max((len(s.get("arguments", [])) for _, s in samples if _is_loglik(s)), default=0)
    n = len(samples)
    prompt = np.full(n, "", dtype=object)
    target = np.full(n, "", dtype=object)
    output = np.full(n, "", dtype=object)
    raw = np.full(n, "", dtype=object)
    lp = np.full((n, width), np.nan)
    greedy = np.zeros((n, width), dtype=bool)
    choice = np.full((n, width), "", dtype=object)
    values = {name: np.full(n, np.nan) for name in names.values()}
    for i, (_, s) in enumerate(samples):
        args = s.get("arguments", [])
        prompt[i] = str(args[0][0]) if args else ""
        target[i] = s["target"] if isinstance(s.get("target"), str) else json.dumps(s.get("target"), default=str)
        if _is_loglik(s):
            for j, (arg, resp) in enumerate(zip(args, s.get("filtered_resps", []), strict=False)):
                choice[i, j] = str(arg[1])
                lp[i, j] = _float(resp[0])
                greedy[i, j] = bool(resp[1])
        else:
            filtered = s.get("filtered_resps", [])
            output[i] = _text(filtered[0]) if filtered else ""
            resps = s.get("resps", [])
            raw[i] = _text(resps[0][0] if resps and isinstance(resps[0], list) and resps[0] else resps[0]) \
                if resps else ""
        filt = s.get("filter", "none")
        for metric in s.get("metrics", []):
            name = names.get((metric, filt))
            if name is not None and metric in s:
                values[name][i] = _float(s[metric])
    data.update({
        "prompt": ("example", prompt), "target": ("example", target), "output": ("example", output),
        "raw_output": ("example", raw), "logprob": (("example", "choice"), lp),
        "is_greedy": (("example", "choice"), greedy), "choice_text": (("example", "choice"), choice),
        **{f"sample_{name}": ("example", v) for name, v in values.items()},
    })
    ds = xr.Dataset(data, coords={
        "task": np.array(tasks, dtype=object), "example": np.arange(n), "choice": np.arange(width),
        "sample_task": ("example", np.array([t for t, _ in samples], dtype=object)),
        "doc_id": ("example", np.array([int(s.get("doc_id", -1)) for _, s in samples], dtype=np.int64)),
        "filter": ("example", np.array([str(s.get("filter", "none")) for _, s in samples], dtype=object)),
    })
    higher = results.get("higher_is_better", {})
    better = {}
    for (metric, _), name in names.items():
        for t in tasks:
            if metric in higher.get(t, {}):
                better[name] = higher[t][metric]
                break
    version = getattr(lm_eval, "__version__", "")
    ds.attrs.update(metrics=list(names.values()), filters={n: f for (_, f), n in names.items()},
                    higher_is_better=better, lm_eval_version=version,
                    task_versions={t: str(v) for t, v in results.get("versions", {}).items()},
                    n_shot={t: _float(v) for t, v in results.get("n-shot", {}).items()})
    return ds


def _is_loglik(sample: Mapping[str, Any]) -> bool:
    args = sample.get("arguments") or []
    resps = sample.get("filtered_resps") or []
    return bool(args) and len(args[0]) == 2 and isinstance(args[0][1], str) and bool(resps) and \
        isinstance(resps[0], (tuple, list)) and len(resps[0]) == 2 and not isinstance(resps[0][0], str)


def _text(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return _text(value[0]) if value else ""
    return str(value)
