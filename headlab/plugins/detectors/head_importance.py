"""Gradient head importance (Michel, Levy and Neubig 2019, "Are Sixteen Heads Really Better than One?").

Definition: docs/methods.md#gradient-head-importance. Gate each head's output with ``xi_h = 1``; then
``d L / d xi_h = sum over positions t of z[h, t] . d L / d z[h, t]``, the zero-baseline case of attribution
patching (patching ``z`` to 0 is ``xi_h`` from 1 to 0; docs/methods.md#attribution-patching): the gradients come
from the same code, one forward and one backward per batch for all heads
(:func:`headlab.plugins.detectors.head_gradients.head_gradients`).

``L`` per example (``metric``):

- ``cross_entropy`` (default): the mean over the example's target tokens of ``-log p(target token)``, the
  prompt followed by the target (``Example.target``) as one sequence (teacher forcing);
- ``logit_diff`` / ``logprob``: the metric of attribution patching at the last prompt position,
  ``logit[answer] - logit[wrong]`` or the answer's log-probability (``meta["answer_id"]``, ``meta["wrong_id"]``:
  the pair tasks ``pairs``, ``kv_swap``, ``ioi_pairs``).

A metric computed from generated text (a registered metric such as ``exact_match``) has no gradient: the spec
is refused.

Where the absolute value sits (``abs``), ``N`` examples, ``g = d L_e / d z``:

- ``per_example`` (default): ``raw[h] = 1/N sum_e |sum_t z_e[h,t] . g_e[h,t]|`` (the paper's
  ``E_x |d L(x) / d xi_h|``; ACDC's convention): each example's first-order change of its loss when the head is
  removed, independent of how examples are batched;
- ``per_token`` (the original code): ``raw[h] = 1/N sum_e sum_t |z_e[h,t] . g_e[h,t]|``, which also counts
  changes that cancel within a sequence;
- ``per_batch`` (HF bertology): ``raw[h] = 1/N sum_b |sum_{e in b} sum_t z_e[h,t] . g_e[h,t]|`` over the batches
  of ``batch_size`` examples, which depends on the batch size (HF's default of 1 is ``per_example``).

``normalize``: ``layer_l2`` (default; the paper's) divides each layer's scores by their L2 norm;
``global_minmax`` does that, then maps the scores to [0, 1] by the global minimum and maximum (HF bertology's
default, both steps); ``none`` keeps ``raw``.

Outputs: ``score (layer, head)``, ``raw (layer, head)``, ``loss (example)`` (``L`` of each example).
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import torch
import xarray as xr
from pydantic import Field, field_validator

from headlab import PluginError, component
from headlab.generation import continuation_batch
from headlab.plugin import Batch, ComponentConfig, Example, Plan, PositiveInt, StepContext, hookimpl, tokenize
from headlab.plugins.detectors.activation_patching import metric_of
from headlab.plugins.detectors.direct_logit_attribution import answer_ids
from headlab.plugins.detectors.head_gradients import head_gradients
from headlab.resources import Estimate, EstimateContext

__all__ = ["GRADIENT_METRICS", "HeadImportance", "check_gradient_metric", "detect", "example_gradients", "importance",
           "normalized"]

#: the metrics with a gradient with respect to the heads' outputs
GRADIENT_METRICS = ("cross_entropy", "logit_diff", "logprob")

Abs = Literal["per_example", "per_token", "per_batch"]
Normalize = Literal["layer_l2", "global_minmax", "none"]


def check_gradient_metric(metric: str) -> None:
    """A ValueError unless ``metric`` is one of :data:`GRADIENT_METRICS`, saying why (a registered metric of
    generated text has no gradient)."""
    if metric in GRADIENT_METRICS:
        return
    try:
        component("metrics", metric)
    except PluginError:
        raise ValueError(f"unknown metric {metric!r} (one of {', '.join(GRADIENT_METRICS)})") from None
    raise ValueError(f"{metric!r} scores generated text and has no gradient with respect to the heads' "
                     f"outputs; use one of {', '.join(GRADIENT_METRICS)} (cross_entropy: the task's targets)")


class HeadImportance(ComponentConfig):
    """Gradient head importance (Michel et al. 2019): |dL/dxi_h| of a gate on each head's output."""

    kind: Literal["head_importance"] = "head_importance"
    metric: str = Field("cross_entropy", description="cross_entropy of the task targets, or logit_diff / logprob "
                        "at the last position (pair tasks); a metric of generated text has no gradient")
    abs: Abs = Field("per_example", description="where the absolute value sits: per example (default, the "
                     "paper's E_x|dL/dxi|), per token (original code) or per batch (HF bertology)")
    normalize: Normalize = Field("layer_l2", description="layer_l2: each layer's scores over their L2 norm; "
                                 "global_minmax: then min-max over all heads (HF); none: the raw scores")
    batch_size: PositiveInt = Field(8, description="examples per forward and backward (and per batch for "
                                    "abs: per_batch)")

    @field_validator("metric")
    @classmethod
    def _metric(cls, value: str) -> str:
        check_gradient_metric(value)
        return value

    def requires(self) -> list[tuple[str, ...]]:
        """The targets (cross_entropy), or a pair task's answer and wrong tokens."""
        if self.metric == "cross_entropy":
            return [("target",)]
        return [("meta.answer_id",), ("meta.wrong_id",)]

    def estimate(self, ctx: EstimateContext) -> list[Estimate]:
        """Hidden states of a batch kept for the backward (resource guard)."""
        return [ctx.activations(ctx.task.tokens, ctx.rows(self.batch_size))]


def _target_loss(n_tokens: list[int], ids: torch.Tensor):
    """The per-row mean cross-entropy of the last ``n_tokens[r]`` tokens of row ``r`` of ``ids`` (left-padded),
    as a function of the logits of the last ``max(n_tokens) + 1`` positions."""
    K = max(n_tokens) + 1
    T = ids.shape[1]

    def loss(logits: torch.Tensor) -> torch.Tensor:
        logp = torch.log_softmax(logits[:, :-1].double(), dim=-1)  # predictions of positions T-K+1 .. T-1
        tokens = ids[:, T - K + 1:].to(logp.device)
        nll = -logp.gather(-1, tokens[..., None])[..., 0]
        keep = torch.arange(K - 1, device=nll.device)[None, :] >= (K - 1 - torch.tensor(n_tokens, device=nll.device)
                                                                    )[:, None]
        return torch.where(keep, nll, 0.0).sum(-1) / torch.tensor(n_tokens, device=nll.device, dtype=nll.dtype)

    return loss, K


def example_gradients(lm, examples: list[Example], metric: str = "cross_entropy", plan: Plan | None = None,
                      ) -> tuple[torch.Tensor, torch.Tensor, Batch]:
    """``(terms (example, layer, head, position), loss (example,), batch)`` for one batch of examples:
    ``terms = z . d L_e / d z`` per head and position in float64 (0 at padding), ``loss`` each example's ``L``
    (module docstring), ``batch`` the left-padded batch that ran (under ``plan``'s edits, if any)."""
    if metric == "cross_entropy":
        missing = [i for i, ex in enumerate(examples) if not ex.target]
        if missing:
            raise ValueError(f"head_importance: example {missing[0]} has no target (metric cross_entropy reads the "
                             "task's targets)")
        batch, n_tokens = continuation_batch(lm, [(ex, ex.target) for ex in examples])
        fn, keep = _target_loss(n_tokens, batch.input_ids)
    else:
        answer, wrong = answer_ids(examples, "head_importance")
        batch = tokenize(lm, examples)
        a, w = torch.tensor(answer), torch.tensor(wrong)

        def fn(logits: torch.Tensor) -> torch.Tensor:
            return metric_of(logits[:, -1], a.to(logits.device), w.to(logits.device), metric)

        keep = 1
    z, g, loss = head_gradients(lm, batch, fn, logits_to_keep=keep, plan=plan)
    terms = (z.double() * g.double()).sum(-1)
    real = batch.attention_mask.to(terms.device).bool()[:, None, None, :]
    return torch.where(real, terms, 0.0).cpu(), loss.cpu(), batch


def importance(terms: torch.Tensor, convention: str) -> torch.Tensor:
    """(layer, head) the sum over a batch's examples of its terms (example, layer, head, position) with the
    absolute value where ``convention`` puts it (``per_example``, ``per_token``, ``per_batch``)."""
    if convention == "per_token":
        return terms.abs().sum((0, -1))
    if convention == "per_example":
        return terms.sum(-1).abs().sum(0)
    if convention == "per_batch":
        return terms.sum((0, -1)).abs()
    raise ValueError(f"abs: unknown convention {convention!r}")


def normalized(raw: np.ndarray, normalize: str) -> np.ndarray:
    """``raw`` (layer, head) normalised: ``layer_l2``, ``global_minmax`` (layer L2, then min-max) or ``none``."""
    if normalize == "none":
        return raw.copy()
    norm = np.sqrt((raw ** 2).sum(-1, keepdims=True))
    out = raw / (norm + 1e-20)
    if normalize == "global_minmax":
        spread = out.max() - out.min()
        out = (out - out.min()) / spread if spread > 0 else np.zeros_like(out)
    return out


def detect(config: HeadImportance, ctx: StepContext, mask: list[tuple[int, int]] | None = None,
           mode: str = "output", plan: Plan | None = None) -> xr.Dataset:
    """The ``head_importance`` detector over the task's examples; ``mask``: heads masked (``mode`` of
    :meth:`headlab.Plan.mask_heads`) in every forward, for a pruning curve that ranks again under its mask;
    ``plan``: the edits every forward runs under instead (another mask, e.g. a mean ablation)."""
    geo = ctx.model.geometry
    n = len(ctx.examples)
    if n == 0:
        raise ValueError("head_importance: the task has no examples")
    total = torch.zeros(geo.n_layers, geo.n_heads, dtype=torch.float64)
    loss = np.zeros(n)
    if plan is None:
        plan = Plan().mask_heads(mask, mode=mode) if mask else None
    chunks = [list(range(j, min(j + config.batch_size, n))) for j in range(0, n, config.batch_size)]
    for idx in ctx.progress(chunks, "head importance"):
        terms, m, _ = example_gradients(ctx.model, [ctx.examples[i] for i in idx], config.metric, plan)
        total += importance(terms, config.abs)
        loss[idx] = m.numpy()
    raw = (total / n).numpy()
    dims = ("layer", "head")
    ds = xr.Dataset({"score": (dims, normalized(raw, config.normalize)), "raw": (dims, raw),
                     "loss": ("example", loss)},
                    coords={"layer": np.arange(geo.n_layers), "head": np.arange(geo.n_heads)})
    ds.attrs.update(method="head_importance", model=ctx.model.name, metric=config.metric, abs=config.abs,
                    normalize=config.normalize, batch_size=config.batch_size,
                    reference="docs/methods.md#gradient-head-importance")
    return ds


@hookimpl
def headlab_register_detectors(register):
    register(HeadImportance, detect)
