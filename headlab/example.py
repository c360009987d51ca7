"""One input of a task (:class:`Example`) and the marker of an image in its prompt (:data:`IMAGE_MARKER`).

A leaf: it imports nothing of headlab, so the image encoding (:mod:`headlab.vision`) reads examples
without importing the step context. :mod:`headlab.context` (and ``headlab``) re-export both names.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["IMAGE_MARKER", "Example"]

#: where an example's image goes in its prompt (one marker per image, in order)
IMAGE_MARKER = "<image>"


@dataclass
class Example:
    """One input of a task.

    ``spans`` are character offsets ``[start, end)`` into ``prompt`` by name (``needle``,
    ``emphasis``, ...). ``input_ids`` is set by tasks defined on token ids (then ``prompt`` is their
    decoding). ``meta`` holds scalars (depth, context length, ...) stored as coordinates.
    ``images`` are the example's images (``PIL.Image.Image`` or local file paths), each placed in ``prompt``
    at a ``<image>`` marker (:data:`IMAGE_MARKER`), in order.
    """

    prompt: str
    target: str | None = None
    choices: list[str] | None = None
    label: int | None = None
    spans: dict[str, list[tuple[int, int]]] = field(default_factory=dict)
    input_ids: list[int] | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    images: list[Any] = field(default_factory=list)
