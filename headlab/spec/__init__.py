"""The spec DSL: pydantic models for experiment files, their JSON Schema, and located errors.

A spec is YAML (loaded safely: no tags, no duplicate keys, never any code) validated by one
pydantic model. Plugin config models join discriminated unions keyed by ``kind`` when the model is
built, so third-party kinds are validated and documented exactly like built-ins.

Example::

    name: quickstart
    model: headlab-tiny
    task: {kind: repeated_tokens, n: 8, length: 24}
    steps:
      - id: induction
        detect: {kind: induction}
    sweep:
      task.length: [16, 32]

Every name is importable from here; the modules hold them by concern: :mod:`~headlab.spec.fields`
(bounded field types, :class:`StrictModel`, :class:`ComponentConfig`), :mod:`~headlab.spec.heads` (head
selections), :mod:`~headlab.spec.model_spec` (:class:`ModelSpec`), :mod:`~headlab.spec.limits` (the
resource budget), :mod:`~headlab.spec.spec_model` (the ``Spec`` model built from the registry),
:mod:`~headlab.spec.safe_yaml` (:func:`parse_yaml` and its limits), :mod:`~headlab.spec.sweep` (sweep
paths and cells), :mod:`~headlab.spec.errors` (:class:`SpecError`) and :mod:`~headlab.spec.loading`
(:func:`load_spec`, :func:`validate_data`).
"""

from __future__ import annotations

from .errors import SpecError, first_error, format_path
from .errors import _position as _position
from .fields import (
    ID_MAX,
    ID_PATTERN,
    MAX_FLOAT,
    MAX_INT,
    MAX_SEED,
    NAME_MAX,
    NAME_PATTERN,
    ComponentConfig,
    FiniteFloat,
    NonEmptyStr,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    Probability,
    Seed,
    StrictModel,
)
from .heads import HeadSelection, HeadsFile, HeadsFrom
from .limits import Limits, parse_size
from .loading import LoadedSpec, load_spec, validate_data
from .model_spec import DEVICE_PATTERN, ModelSpec, default_model
from .safe_yaml import (
    MAX_DEPTH,
    MAX_NODES,
    MAX_SPEC_BYTES,
    MAX_SPEC_CHARS,
    MAX_YAML_INT,
    SAFE_TAGS,
    parse_yaml,
)
from .spec_model import SpecTypes, build_spec_model, json_schema
from .sweep import MAX_CELLS, MAX_SWEEP_VALUES, UNSWEEPABLE, Cell, Cells, set_path

__all__ = [
    "DEVICE_PATTERN", "ID_MAX", "ID_PATTERN", "MAX_CELLS", "MAX_DEPTH", "MAX_FLOAT", "MAX_INT", "MAX_NODES", "MAX_SEED",
    "MAX_SPEC_BYTES", "MAX_SPEC_CHARS", "MAX_SWEEP_VALUES", "MAX_YAML_INT", "NAME_MAX", "NAME_PATTERN", "SAFE_TAGS",
    "UNSWEEPABLE",
    "Cell", "Cells", "ComponentConfig", "FiniteFloat", "HeadSelection", "HeadsFile", "HeadsFrom", "Limits",
    "LoadedSpec", "ModelSpec", "NonEmptyStr", "NonNegativeFloat", "NonNegativeInt", "PositiveFloat", "PositiveInt",
    "Probability", "Seed", "SpecError", "SpecTypes", "StrictModel", "build_spec_model", "default_model",
    "first_error", "format_path", "json_schema", "load_spec", "parse_size", "parse_yaml", "set_path",
    "validate_data",
]
