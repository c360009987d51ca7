"""The one mechanism that reads and edits attention heads during a forward pass.

headlab registers an attention implementation named ``"headlab"`` with transformers'
``AttentionInterface`` (and a mask function of the same name with ``AttentionMaskInterface``; without it a
newly registered attention function receives ``attention_mask=None`` for left-padded batches). Models are
loaded with ``attn_implementation="headlab"`` after :func:`register`. Outside an :func:`instrument`
context, or for a layer the active :class:`Plan` does not touch, the function calls transformers' SDPA
attention exactly, so logits are identical to ``attn_implementation="sdpa"``. Inside a context,
:func:`headlab.kernels.choose_backend` decides each layer's path: that same SDPA call when the plan's edits
on the layer are only query/output scales (applied around it) and nothing reads the layer's outputs, else
:func:`headlab.kernels.attention` with the plan's edits and probes for that layer.

Example::

    from headlab import instrument as ins
    ins.register()
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation=ins.ATTN_IMPLEMENTATION)
    plan = ins.Plan(probes=ins.Probes(argmax=True, spans=[(10, 20)]))
    plan.mask_heads([(3, 1), (5, 0)], rows=[1], mode="query")  # row 1 masked, row 0 base, one forward
    with ins.instrument(model, plan) as rec:
        model(**batch)
    rec.argmax       # (example, layer, head, query) int64 tensor, absolute key positions
    rec.to_xarray("argmax")  # the same as an xarray.DataArray with named dims and coordinates

Positions: every position (queries, probe spans, key spans, argmax) is an absolute position in the
(left-padded) input sequence, counting from 0 at the first token of the first forward inside the context;
in ``generate`` the prompt is positions ``0..N-1`` and the query of decode step ``t`` is ``N - 1 + t``.
Nothing is monkey-patched: the active plan lives in a ``contextvars.ContextVar``.

Modules: ``plan`` (the typed edits and :class:`Plan`), ``probes`` (:class:`Probes` and their position
arguments as tensors), ``recording`` (:class:`Recording`), ``positions`` (absolute positions <-> the
query rows and key slots of one attention call), ``session`` (the state of one context and the plan's
tensors for one layer call), ``attention`` (the registered :func:`attention_forward`), ``masks``,
``trunk`` (:func:`shared_trunk`, :func:`expand_cache`, :func:`start_at_layer`), ``residual`` (the per-layer residual edits as
decoder-layer hooks), ``layers`` (a model's attention layers and the
models refused) and ``context`` (:func:`register`, :func:`instrument`).
"""

from __future__ import annotations

from .attention import attention_forward
from .context import active_plan, instrument, register
from .layers import ATTN_IMPLEMENTATION, UnsupportedModelError, attention_layers, decoder_layers
from .plan import (
    AddZ,
    DropResidGrad,
    Edit,
    Head,
    HeadSpec,
    KeyBias,
    LayerCallback,
    LayerContext,
    LayerFunction,
    OutputScale,
    Plan,
    QueryScale,
    ReplaceKV,
    ReplaceQ,
    ReplaceResid,
    ReplaceZ,
    ScoreZero,
    SteeringConflictError,
)
from .probes import Probes, per_row_spans, span_tensor
from .recording import DIMS, Recording
from .trunk import expand_cache, shared_trunk, start_at_layer

__all__ = [
    "ATTN_IMPLEMENTATION",
    "AddZ",
    "DIMS",
    "DropResidGrad",
    "Edit",
    "Head",
    "HeadSpec",
    "KeyBias",
    "LayerCallback",
    "LayerContext",
    "LayerFunction",
    "OutputScale",
    "Plan",
    "Probes",
    "QueryScale",
    "Recording",
    "ReplaceKV",
    "ReplaceQ",
    "ReplaceResid",
    "ReplaceZ",
    "ScoreZero",
    "SteeringConflictError",
    "UnsupportedModelError",
    "active_plan",
    "attention_forward",
    "attention_layers",
    "decoder_layers",
    "expand_cache",
    "instrument",
    "per_row_spans",
    "register",
    "shared_trunk",
    "span_tensor",
    "start_at_layer",
]
