"""What plugins receive: examples, the task context and the step context.

:class:`Example` and :data:`IMAGE_MARKER` are defined in :mod:`headlab.example` (a leaf) and re-exported here.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
import xarray as xr

from .example import IMAGE_MARKER, Example
from .heads import Head, select_heads
from .model import LoadedModel

__all__ = ["IMAGE_MARKER", "Example", "Reporter", "StepContext", "TaskContext", "strip_tags"]

T = TypeVar("T")


def strip_tags(text: str, tags: Mapping[str, str]) -> tuple[str, dict[str, list[tuple[int, int]]]]:
    """Remove ``<tag>...</tag>`` markers from ``text`` and return the plain text and the marked spans.

    ``tags`` maps a span name to a tag name (``{"emphasis": "em"}``: the ``<em>...</em>`` emphasis markers
    PASTA steers on). Spans are ``[start, end)`` character offsets into the returned text, ready for
    :attr:`Example.spans`. Tags may not nest in themselves; an unbalanced tag is a ``ValueError``.

        >>> strip_tags("a <em>b c</em> d", {"emphasis": "em"})
        ('a b c d', {'emphasis': [(2, 5)]})
    """
    if not tags:
        return text, {}
    by_tag = {tag: name for name, tag in tags.items()}
    pattern = re.compile("|".join(rf"</?{re.escape(t)}>" for t in by_tag))
    out: list[str] = []
    spans: dict[str, list[tuple[int, int]]] = {name: [] for name in tags}
    open_at: dict[str, int] = {}
    pos = 0
    length = 0
    for m in pattern.finditer(text):
        piece = text[pos:m.start()]
        out.append(piece)
        length += len(piece)
        pos = m.end()
        closing = m.group(0).startswith("</")
        tag = m.group(0).strip("</>")
        if not closing:
            if tag in open_at:
                raise ValueError(f"nested <{tag}> in {text[:80]!r}")
            open_at[tag] = length
        else:
            if tag not in open_at:
                raise ValueError(f"</{tag}> without <{tag}> in {text[:80]!r}")
            spans[by_tag[tag]].append((open_at.pop(tag), length))
    if open_at:
        tag = next(iter(open_at))
        raise ValueError(f"<{tag}> is never closed in {text[:80]!r}")
    out.append(text[pos:])
    return "".join(out), {k: v for k, v in spans.items() if v}


@dataclass
class TaskContext:
    """What a task builder receives: the tokenizer (None for random models without one) and seed."""

    tokenizer: Any
    seed: int
    vocab_size: int

    def require_tokenizer(self, task: str) -> Any:
        """The tokenizer, or a clear error for tasks that need text."""
        if self.tokenizer is None:
            raise ValueError(f"task '{task}' needs a tokenizer; this model has none "
                             "(set model.config.tokenizer to a checkpoint or registered name)")
        return self.tokenizer


class Reporter:
    """Progress reporting. The default does nothing; the CLI and widgets pass their own."""

    def start(self, key: str, total: int | None, description: str) -> None:
        """A unit of work named ``key`` with ``total`` items begins."""

    def advance(self, key: str, n: int = 1) -> None:
        """``n`` more items of ``key`` are done."""

    def stop(self, key: str) -> None:
        """``key`` is finished."""


@dataclass
class StepContext:
    """What a step's plugin receives.

    ``results`` are the datasets of earlier steps of the same cell, by step id. ``store`` is the location of
    the run store the step's results go to (a local path or an fsspec URL; ``""`` outside a run).
    """

    model: LoadedModel
    examples: list[Example]
    results: Mapping[str, xr.Dataset]
    seed: int
    step_id: str = ""
    reporter: Reporter = field(default_factory=Reporter)
    cancel: Callable[[], bool] = field(default=lambda: False)
    store: str = ""

    def heads(self, selection: Any) -> list[Head]:
        """Resolve a spec head selection against earlier results and the model's geometry."""
        rng = np.random.default_rng(self.seed)
        return select_heads(selection, self.results, self.model.geometry, rng=rng)

    def progress(self, items: Iterable[T], description: str, total: int | None = None) -> Iterator[T]:
        """Iterate ``items`` while reporting progress under this step's id (``step <id>: <description>``)."""
        key = f"step:{self.step_id}"
        if total is None and hasattr(items, "__len__"):
            total = len(items)  # type: ignore[arg-type]
        self.reporter.start(key, total, f"step {self.step_id}: {description}" if self.step_id else description)
        try:
            for item in items:
                if self.cancel():
                    raise KeyboardInterrupt
                yield item
                self.reporter.advance(key)
        finally:
            self.reporter.stop(key)
