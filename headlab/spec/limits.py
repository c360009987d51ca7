"""The spec's ``limits:``: the resource guard's budget (:class:`Limits`) and sizes such as ``8GiB``."""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import BeforeValidator, Field
from pydantic_core import PydanticCustomError

from ..config import StrictModel

__all__ = ["Limits", "parse_size"]


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
          "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


def parse_size(value: Any) -> int:
    """Bytes of a size: an integer, or a string such as ``512MB``, ``8GiB``, ``1.5G``. Raises ValueError."""
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not a size")
    if isinstance(value, int):
        if value < 1:
            raise ValueError(f"{value} is not a positive number of bytes")
        return value
    match = _SIZE.match(str(value))
    if not match:
        raise ValueError(f"{value!r} is not a size (write e.g. 8GiB, 512MB or a number of bytes)")
    unit = match.group(2).lower().removesuffix("b")
    size = int(float(match.group(1)) * _UNITS[unit])
    if size < 1:
        raise ValueError(f"{value!r} is not a positive size")
    return size


def _size(value: Any) -> Any:
    if value is None:
        return None
    try:
        return parse_size(value)
    except ValueError as e:
        raise PydanticCustomError("size", str(e)) from None


class Limits(StrictModel):
    """The resource guard's budget (see docs/reliability.md). Unset: ``HEADLAB_MEMORY_LIMIT``, else derived from
    the machine's memory (the device's for a GPU run)."""

    memory: Annotated[Annotated[int, Field(ge=1, le=2**62)] | None, BeforeValidator(_size)] = Field(
        None, description="largest estimated memory a cell may need: bytes or e.g. 8GiB, 512MB")
    guard: bool = Field(True, description="false: run without the resource check")

