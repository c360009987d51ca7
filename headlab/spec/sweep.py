"""Sweeps: setting a dotted spec path (:func:`set_path`), the grid of cells (:class:`Cells`), and checking a
spec's ``sweep`` without building the grid.
"""

from __future__ import annotations

import copy
import itertools
import json
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, overload

import numpy as np
from pydantic import ValidationError

from ..config import suggest
from ..plugin_manager import Registry, get_manager
from .errors import SpecError, _position, first_error
from .heads import _check_references
from .spec_model import build_spec_model

__all__ = ["MAX_CELLS", "MAX_SWEEP_VALUES", "UNSWEEPABLE", "Cell", "Cells", "set_path"]


MAX_CELLS = 1_000_000
"""Most cells a sweep may have (the product of the numbers of values of its keys)."""
MAX_SWEEP_VALUES = 10_000
"""Most values one sweep key may have (each is validated)."""


def set_path(data: dict[str, Any], dotted: str, value: Any, *, registry: Registry | None = None) -> dict[str, Any]:
    """Return a copy of raw spec data with ``dotted`` set to ``value``.

    The first segment is a top-level key (``task``, ``model``, ``seed``) or a step id; the rest walk
    into that step's action (``answer.decode.alpha``) or the mapping. A mapping missing on the way is
    created with the value the validated spec has there (a generate step without ``decode`` gets its
    default decoder's config), so ``answer.decode.alpha`` can be swept. Raises KeyError with a message.
    """
    original = data
    data = copy.deepcopy(data)
    parts = dotted.split(".")
    head, rest = parts[0], parts[1:]
    listed = data.get("steps")
    steps = {s["id"]: (i, s) for i, s in enumerate(listed if isinstance(listed, list) else [])
             if isinstance(s, Mapping) and isinstance(s.get("id"), str)}  # other ids are validation's to refuse
    where: list[Any]
    if head in steps:
        index, node = steps[head]
        where = ["steps", index]
        actions = _action_names(registry)
        action = next((a for a in actions if a in node), None)
        if rest and rest[0] not in (*actions, "task") and action:
            node = node[action]
            where.append(action)
    elif head in data or head in ("seed", "model", "task", "name", "output"):
        if not rest:
            data[head] = value
            return data
        if head == "model" and isinstance(data.get("model"), str):
            data["model"] = {"id": data["model"]}
        node = data.setdefault(head, {})
        where = [head]
    else:
        raise KeyError(f"'{dotted}': '{head}' is neither a top-level key nor a step id"
                       f"{suggest(head, [*data, *steps])}")
    if not rest:
        raise KeyError(f"'{dotted}': name a key inside step '{head}', e.g. {head}.<key>")
    for part in rest[:-1]:
        if isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
            where.append(int(part))
        elif isinstance(node, Mapping) and isinstance(node.get(part), (Mapping, list)):
            node = node[part]
            where.append(part)
        elif isinstance(node, Mapping) and part not in node and isinstance(
                default := _resolved(original, [*where, part], registry), Mapping):
            node = node.setdefault(part, default)
            where.append(part)
        else:
            raise KeyError(f"'{dotted}': no mapping at '{part}'")
    last = rest[-1]
    if isinstance(node, list) and last.isdigit():
        node[int(last)] = value
    elif isinstance(node, dict):
        node[last] = value
    else:
        raise KeyError(f"'{dotted}': cannot set '{last}'")
    return data


def _action_names(registry: Registry | None) -> list[str]:
    return list((registry or get_manager().registry).actions)


def _resolved(data: Mapping[str, Any], path: list[Any], registry: Registry | None) -> Any:
    """The value at ``path`` of the validated spec (defaults filled in), or None if there is none."""
    try:
        spec = build_spec_model(registry).model_validate({k: v for k, v in data.items() if k != "sweep"})
    except ValidationError:
        return None
    node: Any = spec.model_dump(mode="json", by_alias=True)
    for part in path:
        try:
            node = node[part]
        except (KeyError, IndexError, TypeError):
            return None
    return copy.deepcopy(node)


@dataclass(frozen=True)
class Cell:
    """One point of the sweep grid: its index and the value of each sweep key."""

    index: int
    values: tuple[tuple[str, Any], ...]

    @property
    def name(self) -> str:
        return f"c{self.index:04d}"

    def as_dict(self) -> dict[str, Any]:
        return dict(self.values)


class Cells(Sequence[Cell]):
    """The sweep grid in row-major order of the sweep keys, computed on demand (never the whole product)."""

    def __init__(self, sweep: Mapping[str, Sequence[Any]]) -> None:
        self.keys = list(sweep)
        self.values = [list(v) for v in sweep.values()]

    def __len__(self) -> int:
        return math.prod(len(v) for v in self.values)

    @overload
    def __getitem__(self, index: int) -> Cell: ...

    @overload
    def __getitem__(self, index: slice) -> list[Cell]: ...

    def __getitem__(self, index: int | slice) -> Cell | list[Cell]:
        n = len(self)
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(n))]
        i = index + n if index < 0 else index
        if not 0 <= i < n:
            raise IndexError(f"cell {index} of {n}")
        picked, rest = [], i
        for values in reversed(self.values):
            rest, k = divmod(rest, len(values))
            picked.append(values[k])
        return Cell(i, tuple(zip(self.keys, reversed(picked), strict=True)))

    def __iter__(self) -> Iterator[Cell]:
        for i, combo in enumerate(itertools.product(*self.values)):
            yield Cell(i, tuple(zip(self.keys, combo, strict=True)))


UNSWEEPABLE = {"name": "it names the run, not a cell", "output": "it is where runs are stored, not a cell",
               "sweep": "a sweep cannot sweep itself", "limits": "the resource budget holds for the whole run"}


def _sweep_label(value: Any) -> Any:
    """What a sweep value is as a result coordinate, for finding duplicates the way the store would."""
    if isinstance(value, (list, dict, tuple)):
        return json.dumps(value, sort_keys=True)
    if isinstance(value, float) and value != value:
        return "nan"
    return value


def _check_sweep(spec: Any, data: Mapping[str, Any], tree: Any, source: str, registry: Any = None) -> None:
    """Each sweep key names a spec field (not an id, the name or the output) and has unique values, each of
    which validates. Each distinct value is validated once, against the spec without its sweep, so the
    cost is linear in the number of values; the grid of cells is never built."""

    Spec = type(spec)
    base = {k: v for k, v in data.items() if k != "sweep"}
    ids = [s.id for s in spec.steps]
    n_cells = 1
    for key, values in spec.sweep.items():
        line, col = _position(tree, ["sweep", key]) if tree is not None else (None, None)

        def fail(message: str, key: str = key, line: Any = line, col: Any = col) -> SpecError:
            return SpecError(message, source=source, line=line, col=col, path=f"sweep.{key}")

        if not values:
            raise fail("a sweep key needs at least one value")
        if len(values) > MAX_SWEEP_VALUES:
            raise fail(f"{len(values):,} values; a sweep key may have at most {MAX_SWEEP_VALUES:,}")
        head = key.split(".")[0]
        if head in UNSWEEPABLE and head not in ids:
            raise fail(f"'{head}' cannot be swept: {UNSWEEPABLE[head]}")
        labels = np.asarray([_sweep_label(v) for v in values])
        first: dict[Any, int] = {}
        for i, label in enumerate(labels.tolist()):
            label = "nan" if isinstance(label, float) and label != label else label
            if label in first:
                raise fail(f"item {i} ({values[i]!r}) repeats item {first[label]} ({values[first[label]]!r}): "
                           "sweep values must be unique, each labels a cell of the results")
            first[label] = i
        for value in values:
            try:
                swept = set_path(base, key, value, registry=registry)
            except KeyError as e:
                raise fail(f"bad sweep path {e.args[0]}") from None
            try:
                cell = Spec.model_validate(swept)
            except ValidationError as e:
                inner = first_error(e, swept, None, source)
                raise fail(f"value {value!r} is invalid at {inner.path}: {inner.message}") from None
            if [s.id for s in cell.steps] != ids:
                raise fail(f"value {value!r} changes the step ids to {[s.id for s in cell.steps]}: results are "
                           "stored by step id, so a sweep cannot change them; sweep a key inside a step instead")
            try:
                _check_references(cell, None, source)
            except SpecError as e:
                raise fail(f"value {value!r}: {e.path}: {e.message}") from None
        n_cells *= len(values)
        if n_cells > MAX_CELLS:
            raise fail(f"the sweep has more than {MAX_CELLS:,} cells (the product of the numbers of values)")

