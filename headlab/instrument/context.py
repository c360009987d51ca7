"""Registration with transformers (:func:`register`) and the :func:`instrument` context that applies a plan."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from .attention import attention_forward
from .layers import ATTN_IMPLEMENTATION, attention_layers, text_config
from .masks import mask_function
from .plan import Plan
from .recording import Recording
from .residual import residual_hooks
from .session import Session, activated, active_session

__all__ = ["active_plan", "instrument", "register"]

_REGISTERED = False


def register() -> str:
    """Register the ``"headlab"`` attention and mask functions with transformers (idempotent).

    Returns :data:`~headlab.instrument.ATTN_IMPLEMENTATION`, to pass as ``attn_implementation=`` when
    loading a model.
    """
    global _REGISTERED
    if not _REGISTERED:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface

        AttentionInterface.register(ATTN_IMPLEMENTATION, attention_forward)
        AttentionMaskInterface.register(ATTN_IMPLEMENTATION, mask_function)
        _REGISTERED = True
    return ATTN_IMPLEMENTATION


@contextlib.contextmanager
def instrument(model: Any, plan: Plan | None = None) -> Iterator[Recording]:
    """Apply ``plan`` to every forward of ``model`` inside the block; yields the :class:`Recording`.

    Use it around one forward or one ``model.generate(...)`` (the whole generation, prefill included: query
    positions are counted from the first call). Contexts nest (the innermost wins) and are per thread /
    per asyncio task.
    """
    plan = plan or Plan()
    layer_of = attention_layers(model)
    n_layers = int(text_config(model).num_hidden_layers)
    if plan.probes.layers is not None:
        bad = [ly for ly in plan.probes.layers if not 0 <= int(ly) < n_layers]
        if bad:
            raise ValueError(f"probe layers {bad} out of range (model has {n_layers})")
    for e in plan.edits:
        bad = [ly for ly, _ in (e.heads or []) if not 0 <= ly < n_layers]
        if bad:
            raise ValueError(f"edit layers {bad} out of range (model has {n_layers})")
    with activated(Session(plan, layer_of, n_layers)) as sess, residual_hooks(model, sess):
        yield sess.rec


def active_plan() -> Plan | None:
    """The plan of the innermost active :func:`instrument` context, if any."""
    sess = active_session()
    return None if sess is None else sess.plan
