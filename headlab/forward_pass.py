"""headlab.forward_pass: :func:`forward` (``headlab.forward``) runs a batch through a model under a plan and returns
its outputs and the recording.

The one way every built-in (and any plugin) runs a forward over prompts with edits and probes, like
TransformerLens' ``run_with_cache`` over a declarative :class:`headlab.instrument.Plan` instead of hooks::

    batch = headlab.tokenize(lm, examples)
    out, rec = headlab.forward(lm, batch, Plan(probes=Probes(argmax=True)), logits_to_keep=1)
    rec.to_xarray("argmax")          # (example, layer, head, query)

Position ids follow the attention mask (left padding at position 0), the batch's images go in with it,
and no gradient is kept unless ``grad=True`` (the torch and SDPA paths are differentiable; the Triton
path is forward-only).
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any

import torch

from .generation import Batch
from .instrument import Plan, Probes, Recording, instrument
from .model import LoadedModel

__all__ = ["forward", "positions_from_mask"]


def positions_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids of a left-padded batch: each row's running token count, padding at 0."""
    return (attention_mask.cumsum(-1) - 1).clamp(min=0)


def _takes(model: Any, name: str) -> bool:
    try:
        return name in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):  # pragma: no cover - a forward without a signature
        return False


def forward(lm: LoadedModel | torch.nn.Module, batch: Batch | torch.Tensor, plan: Plan | Probes | None = None, *,
            copies: int = 1,
            attention_mask: torch.Tensor | None = None, grad: bool = False, logits_to_keep: int | None = None,
            **kwargs: Any) -> tuple[Any, Recording]:
    """One forward of ``lm`` over ``batch`` under ``plan``; returns the model's outputs and the
    :class:`~headlab.instrument.Recording` of the plan's probes (empty without probes).

    ``lm``: a :class:`~headlab.model.LoadedModel` (or the transformers model it holds).
    ``batch``: a :class:`~headlab.generation.Batch` from :func:`headlab.tokenize` (its attention mask,
    positions and image inputs are used), or a tensor of input ids (``attention_mask``: all ones unless
    given; positions from the mask). ``copies``: run that many copy-major copies of the batch as one
    batch (row ``r + c * B`` is row ``r`` of copy ``c``; a plan for the copies comes from
    :meth:`Plan.tile`). ``plan=None``: no edits, no probes (plain SDPA); a :class:`~headlab.instrument.Probes`:
    those probes and no edits (``Plan(probes=probes)``). ``grad``: keep the autograd graph.
    ``logits_to_keep``: compute logits only at the last ``n`` positions (when the model supports it).
    Other keywords go to the model's forward (``use_cache`` defaults to ``False``).
    """
    if isinstance(batch, Batch):
        ids = batch.input_ids.repeat(copies, 1) if copies > 1 else batch.input_ids
        mask = batch.attention_mask.repeat(copies, 1) if copies > 1 else batch.attention_mask
        kwargs = {**batch.forward_inputs(copies), "position_ids": batch.positions(copies), **kwargs}
    else:
        ids = batch if copies == 1 else batch.repeat(copies, 1)
        mask = torch.ones_like(ids) if attention_mask is None else attention_mask
        mask = mask.repeat(copies, 1) if copies > 1 and mask.shape[0] != ids.shape[0] else mask
        kwargs.setdefault("position_ids", positions_from_mask(mask))
    model = lm.model if isinstance(lm, LoadedModel) else lm
    if isinstance(plan, Probes):
        plan = Plan(probes=plan)
    kwargs.setdefault("use_cache", False)
    if logits_to_keep is not None and _takes(model, "logits_to_keep"):
        kwargs["logits_to_keep"] = logits_to_keep
    with contextlib.ExitStack() as stack:
        if not grad:
            stack.enter_context(torch.no_grad())
        rec = stack.enter_context(instrument(model, plan if plan is not None else Plan()))
        out = model(input_ids=ids, attention_mask=mask, **kwargs)
    return out, rec
