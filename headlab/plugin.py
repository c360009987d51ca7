"""Everything a plugin author needs, in one place: ``from headlab.plugin import ...``.

A plugin is a pip package whose module implements hooks (``@hookimpl``) that register components: a pydantic
config (a ``ComponentConfig`` with a literal ``kind``) and the function that does the work. A minimal detector
uses six names: ``ComponentConfig``, ``hookimpl``, ``StepContext``, ``tokenize``, ``Probes`` and ``forward``
(``headlab new-plugin detector NAME`` writes one). The names, by what they are for:

- **Registration**: ``hookimpl`` marks the hook functions (``headlab_register_detectors(register)`` and the
  others of the Plugins guide); ``ComponentConfig`` is the base of a component's config, ``StrictModel`` of
  the nested objects inside one.
- **Config field types**, bounded so that a spec's bad value is caught where it is written: ``PositiveInt``,
  ``NonNegativeInt``, ``PositiveFloat``, ``NonNegativeFloat``, ``FiniteFloat``, ``Probability``,
  ``NonEmptyStr``, ``Seed``; ``HeadSelection`` is the spec's way to name heads (a list, ``from`` an earlier
  step, a file), resolved by ``StepContext.heads``; ``ModelSpec`` describes a model (in tests, a tiny random
  one built from a transformers config).
- **Contexts**, what a component receives: ``StepContext`` (the model, the task's examples, earlier steps'
  results, the seed, progress bars) for detectors, steering, decoders and actions; ``TaskContext``
  (tokenizer, seed, vocabulary size) for task builders; ``Example``, one prompt with its targets, spans and
  metadata.
- **Models, batches and forwards**: ``LoadedModel`` (``.model``, ``.tokenizer``, ``.geometry``, ``.name``)
  and ``from_config`` (a random model from a transformers config, for tests); ``tokenize`` turns examples
  into a left-padded ``Batch``; ``forward`` runs a batch under a plan (or just probes) and returns the
  model's outputs and the ``Recording``; ``instrumented`` applies a plan to every forward inside a ``with``
  block (a ``generate``, a custom loop).
- **Plans and probes**: ``Plan`` holds typed edits of heads (``mask_heads``, ``scale_heads``, ``bias_keys``,
  ``patch_z``, ``add_z``, ...) and ``Probes``, what to read (attention mass on key spans or offsets, top-1
  keys, entropies, head outputs ``z``); the ``Recording`` holds what the probes read.
- **The decoding loop**, for decoders: ``decode_loop`` runs the KV-cache decoding loop for a
  ``DecodeRequest``, calling the strategy with a ``DecodeState`` at each step, and returns ``Decoded``;
  ``Rows`` are the batch rows the loop runs (e.g. two copies of each prompt). A decoder's scorer receives a
  ``ScoreRequest`` (prompts with continuations) and returns ``Scored``, usually ``sum_continuation`` of its
  per-token scores.
- **Heads and anatomy**: ``head_weights`` gives one layer's per-head ``W_Q``, ``W_K``, ``W_V`` and ``W_O``
  for weight-level methods.
- **The result contract** (the guide's page "The result contract"): a step returns an ``xarray.Dataset``
  whose dimensions are names of ``DIMENSIONS``, and a detector's ``score`` is ``(layer, head)``;
  ``head_array`` builds ``(..., layer, head)`` arrays with their labels; a result that breaks the contract is
  refused with a ``ContractError`` naming the component.

The other public modules (``headlab.generation``, ``headlab.kv``, ``headlab.decoding``, ``headlab.resources``,
...) hold the advanced names that built-in plugins of one kind share; the Plugins guide lists them.
"""

from __future__ import annotations

from .anatomy import head_weights
from .context import Example, StepContext, TaskContext
from .dims import DIMENSIONS, head_array
from .errors import ContractError
from .forward_pass import forward
from .generation import (
    Batch,
    Decoded,
    DecodeRequest,
    DecodeState,
    Rows,
    Scored,
    ScoreRequest,
    decode_loop,
    instrumented,
    sum_continuation,
    tokenize,
)
from .hookspecs import hookimpl
from .instrument import Plan, Probes, Recording
from .model import LoadedModel, from_config
from .spec import (
    ComponentConfig,
    FiniteFloat,
    HeadSelection,
    ModelSpec,
    NonEmptyStr,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    Probability,
    Seed,
    StrictModel,
)

__all__ = [
    # registration
    "ComponentConfig", "StrictModel", "hookimpl",
    # config field types
    "FiniteFloat", "HeadSelection", "ModelSpec", "NonEmptyStr", "NonNegativeFloat", "NonNegativeInt",
    "PositiveFloat", "PositiveInt", "Probability", "Seed",
    # contexts
    "Example", "StepContext", "TaskContext",
    # models, batches and forwards
    "Batch", "LoadedModel", "forward", "from_config", "instrumented", "tokenize",
    # plans and probes
    "Plan", "Probes", "Recording",
    # the decoding loop and scoring continuations
    "DecodeRequest", "DecodeState", "Decoded", "Rows", "ScoreRequest", "Scored", "decode_loop", "sum_continuation",
    # heads and anatomy
    "head_weights",
    # the result contract
    "DIMENSIONS", "ContractError", "head_array",
]
