"""The base types of every config model: :class:`StrictModel` and :class:`ComponentConfig`.

A leaf of the import graph (it imports nothing of headlab), so that the plugin manager, which checks
that a registered config subclasses :class:`ComponentConfig`, and the spec, which builds its models
from the registry the plugin manager holds, both depend on it and not on each other.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, model_validator
from pydantic_core import PydanticCustomError

__all__ = ["ComponentConfig", "StrictModel", "suggest"]


def suggest(word: str, options: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for the option closest to ``word``, or ``""`` when none is close."""
    match = difflib.get_close_matches(str(word), list(options), n=1, cutoff=0.6)
    return f" (did you mean '{match[0]}'?)" if match else ""


class StrictModel(BaseModel):
    """Base of every spec model: unknown keys are errors with a "did you mean" suggestion, and every float
    field is finite (NaN and infinities are refused, in third-party configs too)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _reject_unknown_keys(cls, data: Any) -> Any:
        if isinstance(data, Mapping):
            known = set(cls.model_fields)
            known |= {f.alias for f in cls.model_fields.values() if f.alias}
            for key in data:
                if key not in known:
                    raise PydanticCustomError(
                        "unknown_key", "unknown key '{key}'{hint}",
                        {"key": str(key), "hint": suggest(key, sorted(known))},
                    )
        return data


class ComponentConfig(StrictModel):
    """Base of plugin config models. Subclasses declare ``kind: Literal["name"] = "name"``."""

    kind: str

    #: a control by construction (the ``random`` KV policy): a step using it is marked as a control, as is one
    #: whose components hold ``random: true`` (:func:`headlab.describe.is_control`)
    control: ClassVar[bool] = False

    @classmethod
    def kind_name(cls) -> str:
        """The literal ``kind`` this config model is registered under."""
        return cls.model_fields["kind"].default

