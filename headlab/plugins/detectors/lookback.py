"""Lookback Lens: per-head lookback ratios during generation, and the logistic classifier over them.

Definition: docs/methods.md#lookback-ratio. For each generated token and head::

    LR = mean attention on context tokens / (mean attention on context tokens + mean attention on new tokens)

as the reference code computes it: the attention row is the one of the query that produced the token
(the last prompt token for the first generated token, then each generated token); context tokens are
the prompt's first ``C`` tokens, new tokens are every later key up to and including the query (the
prompt's last ``prompt_tail`` tokens, e.g. an answer prefix ``"\\n#Answer#:"``, count as new, as in the
reference; when no key is new yet, the mean over them is taken as 0 and ``LR = 1``). ``C`` is the end of
the examples' span named ``context`` when that option is set, else the prompt length minus
``prompt_tail``. Means are over real (unpadded) tokens.

The ratios come from the streaming span-mass probe of :mod:`headlab.instrument` (two key spans per row:
context and new), during a batched greedy decode (see
:func:`headlab.plugins.detectors.retrieval.probe_decode`); no attention matrix is stored.

Outputs: ``lookback_ratio (example, step, layer, head)`` (decode step ``t``: the query that chose the
``t``-th generated token; NaN after a row stopped; the run's ``token`` axis indexes the prompt's
``input_ids``), ``features (example, layer, head)`` = mean ratio over the generated tokens (the
reference's "predefined span" feature), ``score (layer, head)`` = mean of the features, ``n_tokens``
and ``output (example)``. :func:`window_features` gives the reference's sliding-window features and
:class:`LookbackClassifier` fits/applies its logistic regression (scikit-learn
``LogisticRegression(max_iter=1000)`` on the layer-major flattened features).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import numpy as np
import torch
import xarray as xr
from pydantic import Field

from headlab.plugin import (
    ComponentConfig,
    Example,
    LoadedModel,
    NonEmptyStr,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveInt,
    Probes,
    StepContext,
    head_array,
    hookimpl,
    tokenize,
)
from headlab.resources import Estimate, EstimateContext

from .retrieval import length_batches, probe_decode

__all__ = ["Lookback", "LookbackClassifier", "detect", "lookback_ratios", "window_features"]

_FAR = 1 << 40  # "to the end of the sequence" for a key span


class Lookback(ComponentConfig):
    """Lookback Lens features: per generated token and head, attention to the context vs to new tokens."""

    kind: Literal["lookback"] = "lookback"
    context: str | None = Field(None, description="name of the examples' span whose end closes the context "
                                "(default: the whole prompt minus prompt_tail)")
    prompt_tail: NonNegativeInt = Field(0, description="last prompt tokens counted as new tokens (answer prefix)")
    max_new_tokens: PositiveInt = 32
    stop: list[NonEmptyStr] = Field(default_factory=list, description="stop strings (non-empty)")
    batch_size: PositiveInt = 8
    length_slack: NonNegativeFloat = Field(0.125, description="a batch holds prompts at most this fraction longer "
                                "than its shortest (left padding costs compute)")

    def estimate(self, ctx: EstimateContext) -> list[Estimate]:
        """The KV cache of a batch decoding ``max_new_tokens`` after the longest prompt (resource guard)."""
        return [ctx.kv_cache(ctx.task.tokens + self.max_new_tokens, ctx.rows(self.batch_size))]


def lookback_ratios(lm: LoadedModel, examples: Sequence[Example], *, context: str | None = None,
                    prompt_tail: int = 0, max_new_tokens: int = 32, stop: Sequence[str] = (),
                    batch_size: int = 8, length_slack: float = 0.125,
                    progress: Any = None) -> tuple[np.ndarray, list[str]]:
    """Lookback ratios ``(example, step, layer, head)`` (NaN past each output) and the outputs."""
    geo = lm.geometry
    per: list[np.ndarray] = [np.zeros((0, geo.n_layers, geo.n_heads))] * len(examples)
    texts = [""] * len(examples)
    lengths = [len(ex.input_ids) if ex.input_ids is not None else len(lm.tokenizer(ex.prompt)["input_ids"])
               for ex in examples]
    chunks = length_batches(lengths, batch_size, length_slack)
    it = progress(chunks, "lookback ratios") if progress is not None else chunks
    for idx in it:
        batch = tokenize(lm, [examples[i] for i in idx])
        N = batch.length
        ends = []
        for r, i in enumerate(idx):
            if context is not None:
                spans = batch.spans(context)[r]
                if not spans:
                    raise ValueError(f"lookback: example {i} has no '{context}' span")
                end = max(e for _, e in spans)
            else:
                end = N - prompt_tail
            if end <= batch.pad[r]:
                raise ValueError(f"lookback: example {i} has an empty context")
            ends.append(end)
        spans = [[(batch.pad[r], ends[r]), (ends[r], _FAR)] for r in range(len(idx))]
        dec = probe_decode(lm, batch, Probes(spans=spans), max_new_tokens, stop)
        mass = dec.recording.span_mass.double()  # (B, L, H, T, 2)
        T = mass.shape[3]
        end_t = torch.tensor(ends, dtype=torch.float64, device=mass.device)
        n_ctx = end_t - torch.tensor(batch.pad, dtype=torch.float64, device=mass.device)
        step = torch.arange(T, dtype=torch.float64, device=mass.device)
        n_new = (N + step)[None, :] - end_t[:, None]  # keys [end, N + t) at decode step t: (B, T)
        m_ctx = mass[..., 0] / n_ctx.view(-1, 1, 1, 1)
        m_new = torch.where(n_new.view(-1, 1, 1, T) > 0, mass[..., 1] / n_new.clamp(min=1).view(-1, 1, 1, T),
                            torch.zeros((), dtype=torch.float64, device=mass.device))
        lr = (m_ctx / (m_ctx + m_new)).permute(0, 3, 1, 2).cpu().numpy()  # (B, T, L, H)
        active = dec.active.cpu().numpy()
        for r, i in enumerate(idx):
            per[i] = lr[r][active[r]]
            texts[i] = dec.texts[r]
    T = max(x.shape[0] for x in per)
    out = np.full((len(examples), T, geo.n_layers, geo.n_heads), np.nan)
    for i, x in enumerate(per):
        out[i, : x.shape[0]] = x
    return out, texts


def detect(config: Lookback, ctx: StepContext) -> xr.Dataset:
    """The ``lookback`` detector (see the module docstring)."""
    lr, texts = lookback_ratios(ctx.model, ctx.examples, context=config.context, prompt_tail=config.prompt_tail,
                                max_new_tokens=config.max_new_tokens, stop=config.stop,
                                batch_size=config.batch_size, length_slack=config.length_slack,
                                progress=ctx.progress)
    ratio = head_array(lr, "example", "step")
    n_tokens = np.isfinite(lr[:, :, 0, 0]).sum(1) if lr.shape[1] else np.zeros(len(texts), dtype=int)
    with np.errstate(invalid="ignore"):
        features = ratio.mean("step", skipna=True)
    ds = xr.Dataset({"lookback_ratio": ratio, "features": features, "score": features.mean("example"),
                     "n_tokens": ("example", n_tokens), "output": ("example", np.array(texts, dtype=object))})
    ds.attrs.update(method="lookback", model=ctx.model.name, context=config.context or "",
                    prompt_tail=config.prompt_tail,
                    reference="docs/methods.md#lookback-ratio")
    return ds


def window_features(ratio: xr.DataArray | np.ndarray, size: int = 8) -> np.ndarray:
    """Sliding-window features as the reference computes them: for each output (example, or one
    ``(step, layer, head)`` array) and each window end ``j >= size - 1`` inside the output, the mean
    ratio over tokens ``j - size + 1 .. j``. Returns ``(n_windows, layer, head)`` over all examples, in
    example order (outputs shorter than ``size`` give none)."""
    arr = np.asarray(ratio.transpose("example", "step", "layer", "head").values if
                     isinstance(ratio, xr.DataArray) else ratio, dtype=float)
    if arr.ndim == 3:
        arr = arr[None]
    out = []
    for ex in arr:
        n = int(np.isfinite(ex[:, 0, 0]).sum())
        for j in range(size - 1, n):
            out.append(ex[j - size + 1: j + 1].mean(0))
    if not out:
        return np.zeros((0, *arr.shape[2:]))
    return np.stack(out)


class LookbackClassifier:
    """The Lookback Lens classifier: logistic regression on flattened per-head features.

    ``fit(features, labels)`` with features ``(n, layer, head)`` (an ``xarray`` ``features`` array of a
    ``lookback`` step, or :func:`window_features` output) and binary labels (the reference uses 1 = the
    span is factual, 0 = hallucinated); ``predict_proba(features)`` returns ``P(label = 1)`` per row.
    Features are flattened layer-major (``L0H0, L0H1, ...``) like the reference. Other keyword arguments go
    to :class:`sklearn.linear_model.LogisticRegression` (reference: ``max_iter=1000``, default ``C=1``).
    """

    def __init__(self, **kwargs: Any) -> None:
        from sklearn.linear_model import LogisticRegression

        self.clf = LogisticRegression(**{"max_iter": 1000, **kwargs})

    @staticmethod
    def _x(features: xr.DataArray | np.ndarray) -> np.ndarray:
        if isinstance(features, xr.DataArray):
            first = [d for d in features.dims if d not in ("layer", "head")]
            features = features.transpose(*first, "layer", "head").values
        x = np.asarray(features, dtype=float)
        x = x.reshape(x.shape[0], -1)
        if np.isnan(x).any():
            raise ValueError("NaN in the features (an output with no generated token?)")
        return x

    def fit(self, features: xr.DataArray | np.ndarray, labels: Sequence[int] | np.ndarray) -> LookbackClassifier:
        """Fit on ``(n, layer, head)`` features and ``n`` binary labels; returns self."""
        self.clf.fit(self._x(features), np.asarray(labels))
        return self

    def predict_proba(self, features: xr.DataArray | np.ndarray) -> np.ndarray:
        """``P(label = 1)`` for each row of ``(n, layer, head)`` features."""
        return self.clf.predict_proba(self._x(features))[:, list(self.clf.classes_).index(1)]

    def apply(self, ds: xr.Dataset, method: Literal["mean", "window"] = "mean", size: int = 8) -> np.ndarray:
        """Scores of a ``lookback`` step's result: per example (``mean``) or per sliding window."""
        if method == "mean":
            return self.predict_proba(ds["features"])
        return self.predict_proba(window_features(ds["lookback_ratio"], size))

    @property
    def weights(self) -> np.ndarray:
        """The fitted coefficients, one per flattened feature (layer-major: ``L0H0, L0H1, ...``)."""
        return np.asarray(self.clf.coef_[0])


@hookimpl
def headlab_register_detectors(register):
    register(Lookback, detect)
