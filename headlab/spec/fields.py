"""Shared field types of spec models: bounded numbers, non-empty strings, name and id patterns.

Every built-in config uses them, so bounds hold by construction; :class:`StrictModel` and
:class:`ComponentConfig` (from :mod:`headlab.config`) are the bases of every config model.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator, Field

from ..config import ComponentConfig, StrictModel

__all__ = [
    "ID_MAX", "ID_PATTERN", "MAX_FLOAT", "MAX_INT", "MAX_SEED", "NAME_MAX", "NAME_PATTERN", "ComponentConfig", "FiniteFloat",
    "NonEmptyStr", "NonNegativeFloat", "NonNegativeInt", "PositiveFloat", "PositiveInt", "Probability", "Seed",
    "StrictModel",
]


NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"
"""A spec ``name``: it names the run directory, so a safe file name (no '/', not '.' or '..')."""
NAME_MAX = 100
ID_PATTERN = r"^[A-Za-z_][A-Za-z0-9_-]*$"
"""A step ``id``: it names a group of the run store and is the first part of dotted sweep paths."""
ID_MAX = 64
MAX_INT = 2**31 - 1
"""Largest count or length a spec field takes (:data:`PositiveInt`, :data:`NonNegativeInt`); anything larger
is never a real experiment, and the resource guard refuses much smaller values that do not fit."""
MAX_SEED = 2**32 - 1
"""Largest seed (:data:`Seed`): the range every seeded library accepts (numpy's legacy seeds are 32-bit)."""

# --- shared field types: every built-in config uses them, so bounds hold by construction ---------------

PositiveInt = Annotated[int, Field(ge=1, le=MAX_INT)]
"""A count or length: 1 .. :data:`MAX_INT` (``n``, ``length``, ``max_new_tokens``, ``batch_size``, ``top``)."""
NonNegativeInt = Annotated[int, Field(ge=0, le=MAX_INT)]
"""A count that may be zero, or an index: 0 .. :data:`MAX_INT` (``distractors``, a layer, a token id)."""
Seed = Annotated[int, Field(ge=0, le=MAX_SEED)]
"""A seed or a seed offset: 0 .. :data:`MAX_SEED`."""
MAX_FLOAT = 3.4028234663852886e38
"""The largest float32: a spec's numbers become tensor values, and a larger one (``1e39``, finite in YAML) would be
infinite there."""


def _float32(value: float) -> float:
    if abs(value) > MAX_FLOAT:
        raise ValueError(f"{value:g} is beyond float32's range (|x| <= {MAX_FLOAT:.4g}): as a tensor value it would be "
                         "infinite")
    return value


FiniteFloat = Annotated[float, Field(allow_inf_nan=False), AfterValidator(_float32)]
"""Any finite number within float32's range (NaN and infinities are refused; every float of a :class:`StrictModel`
is finite anyway)."""
PositiveFloat = Annotated[float, Field(gt=0, allow_inf_nan=False), AfterValidator(_float32)]
"""A finite number > 0 (factors, temperatures, scales)."""
NonNegativeFloat = Annotated[float, Field(ge=0, allow_inf_nan=False), AfterValidator(_float32)]
"""A finite number >= 0 (weights, slack fractions)."""
Probability = Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)]
"""A finite number in [0, 1] (probabilities, fractions, recall thresholds)."""
NonEmptyStr = Annotated[str, Field(min_length=1)]
"""A string of at least one character (stop strings, span names: an empty one would match everywhere)."""

