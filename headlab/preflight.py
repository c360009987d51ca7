"""Checks of a spec against its tasks, its model and the machine, before a run's store is created and again
before each cell's steps run: the example fields components read (:func:`check_fields`, :func:`check_examples`,
:func:`check_requirements`), each config's own ``preflight()`` (:func:`check_steps`), and a cell's head
selections and resource estimate (:func:`preflight`). A failure is one located :class:`SpecError` or a
:class:`StepError` naming the step and its component.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from pydantic import BaseModel
from pydantic_core import to_jsonable_python

from . import resources
from .context import Example
from .errors import StepError, step_error
from .heads import HeadSelectionError, check_top
from .model import LoadedModel
from .plugin_manager import CATEGORIES, get_manager
from .scoring import (
    build_examples,
    declared_fields,
    required_fields,
    requirement_message,
    unmet_by_examples,
    unmet_by_task,
)
from .spec import Cell, LoadedSpec, SpecError, _position, format_path

__all__ = ["PREFLIGHT_CELLS", "PREFLIGHT_TASKS", "check_examples", "check_fields", "check_requirements",
           "check_steps", "preflight", "requiring"]

PREFLIGHT_CELLS = 4096
"""Cells checked against the model and the resource budget before a run starts (each is checked again before
it runs)."""

PREFLIGHT_TASKS = 16
"""Distinct tasks whose examples are built before a run starts, to check them against the fields the components
of their steps read (every cell's are checked again before each step runs)."""


def requiring(node: Any, path: list[Any] | None = None) -> Iterator[tuple[list[Any], Any]]:
    """``(path, config)`` of every component config inside a step's action config ``node`` that declares the
    example fields it reads (a ``requires()`` method, :func:`headlab.scoring.required_fields`), depth first;
    ``path`` is the config's place below the action (``["metrics", 0]``)."""
    path = [] if path is None else path
    if isinstance(node, BaseModel):
        if required_fields(node):
            yield path, node
        for name, info in type(node).model_fields.items():
            yield from requiring(getattr(node, name, None), [*path, info.alias or name])
    elif isinstance(node, (list, tuple)):
        for i, item in enumerate(node):
            yield from requiring(item, [*path, i])
    elif isinstance(node, Mapping):
        for key, item in node.items():
            yield from requiring(item, [*path, key])


def _component_of(config: Any) -> tuple[str, Any]:
    """The category label (``metric``) and the registered component of a component config (None if none)."""

    registry = get_manager().registry
    for name, category in CATEGORIES.items():
        comp = registry.components[name].get(getattr(config, "kind", "")) if category.style == "config" else None
        if comp is not None and isinstance(config, comp.config):
            return category.label, comp
    return "component", None


def _lacking(task: Any, examples: list[Example], lacking: list[int]) -> str:
    """``example 0 (data row 1) of task 'jsonl' lacks (2 of 2 examples)``."""
    first = lacking[0]
    row = examples[first].meta.get("row") if isinstance(examples[first].meta, Mapping) else None
    where = f"example {first}" + (f" (data row {row})" if row is not None else "")
    return f"{where} of task '{task.kind}' lacks ({len(lacking)} of {len(examples)} examples)"


def check_requirements(step: Any, task: Any, examples: list[Example], cell: Cell | None = None) -> None:
    """Refuse a step one of whose components reads an example field (its ``requires()``) that one of the
    task's ``examples`` lacks, before the step runs: a :class:`StepError` naming the step and the component
    (a ``ValueError``, exit code 2), with the field and the tasks the component fits."""
    for _, config in requiring(getattr(step, step.action)):
        unmet = unmet_by_examples(config, examples)
        if unmet is None:
            continue
        label, comp = _component_of(config)
        message = requirement_message(config, unmet[0], _lacking(task, examples, unmet[1]), label)
        raise StepError.wrap(ValueError(message), step=step.id, action=step.action, category=label,
                             kind=config.kind, plugin=comp.plugin if comp is not None else "?",
                             cell=getattr(cell, "name", ""), values=cell.as_dict() if cell is not None else {})


def _requirement_error(loaded: LoadedSpec, i: int, step: Any, where: list[Any], config: Any,
                       group: tuple[str, ...], lacks: str, cell: Cell | None) -> Any:
    """The :class:`SpecError` of a component that reads a field its task does not give, located at the
    component (``steps[0].generate.metrics[0]``)."""

    label, _ = _component_of(config)
    path = ["steps", i, step.action, *where]
    line, col = _position(loaded.tree, path) if loaded.tree is not None else (None, None)
    swept = f" in cell {cell.name} ({', '.join(f'{k}={v!r}' for k, v in cell.values)})" \
        if cell is not None and cell.values else ""
    return SpecError(f"step '{step.id}': {requirement_message(config, group, lacks, label)}{swept}",
                     source=loaded.source, line=line, col=col, path=format_path(path))


def check_fields(loaded: LoadedSpec, cells: list[Cell] | None = None) -> None:
    """Refuse, before a run's store is created and in ``headlab validate``, a step one of whose components
    reads an example field (its ``requires()``) that the step's task never gives (the task's
    ``example_fields()``; a task that does not declare them is checked on its examples instead,
    :func:`check_examples` and :func:`check_requirements`). A :class:`SpecError` located at the component,
    for ``cells`` (default: the first :data:`PREFLIGHT_CELLS`), each distinct task and step once."""
    if not any(next(requiring(getattr(step, step.action)), None) for step in loaded.spec.steps):
        return  # a component that a sweep adds is checked on the examples
    if cells is None:
        cells = [cell for _, cell in zip(range(PREFLIGHT_CELLS), loaded.cells, strict=False)]
    seen: set[str] = set()
    for cell in cells:
        spec = loaded.for_cell(cell)
        for i, step in enumerate(spec.steps):
            task = step.task or spec.task
            key = f"{task.model_dump_json()}:{step.id}:{jsonable(getattr(step, step.action))}"
            if key in seen:
                continue
            seen.add(key)
            fields = declared_fields(task)
            if fields is None:
                continue
            for where, config in requiring(getattr(step, step.action)):
                group = unmet_by_task(config, fields)
                if group is not None:
                    raise _requirement_error(loaded, i, step, where, config, group,
                                             f"task '{task.kind}' does not give", cell if cell.values else None)


def check_examples(loaded: LoadedSpec, cells: list[Cell], models: Any) -> None:
    """Build, before a run's store is created, the examples of the steps whose components read example fields
    (at most :data:`PREFLIGHT_TASKS` distinct tasks of ``cells``) and refuse a step whose task's examples lack
    one: a :class:`SpecError` located at the component. A task that fails to build is left to its cell, which
    reports it naming the step and the task."""
    built: dict[str, list[Example] | None] = {}
    for cell in cells:
        spec = loaded.for_cell(cell)
        for i, step in enumerate(spec.steps):
            needs = list(requiring(getattr(step, step.action)))
            if not needs:
                continue
            task = step.task or spec.task
            key = f"{spec.model.model_dump_json()}:{task.model_dump_json()}:{spec.seed}"
            if key not in built:
                if len(built) >= PREFLIGHT_TASKS:
                    return
                try:
                    built[key] = build_examples(task, models.get(spec.model), spec.seed)
                except Exception:  # noqa: BLE001 - the cell builds them again and reports the failure
                    built[key] = None
            examples = built[key]
            if not examples:
                continue
            for where, config in needs:
                unmet = unmet_by_examples(config, examples)
                if unmet is not None:
                    raise _requirement_error(loaded, i, step, where, config, unmet[0],
                                             _lacking(task, examples, unmet[1]), cell if cell.values else None)


def preflight(loaded: LoadedSpec, spec: Any, lm: LoadedModel, cell: Cell | None = None) -> None:
    """Checks of one cell's spec against the loaded model, before anything of the cell runs: every ``top`` of
    a head selection within the model's heads (a located :class:`SpecError`), and the resource guard
    (:func:`headlab.resources.check`)."""

    swept = f"cell {cell.name} ({', '.join(f'{k}={v!r}' for k, v in cell.values)})" if cell and cell.values else ""
    for path, node in _selections(spec.model_dump(by_alias=True, exclude_none=True), []):
        try:
            check_top(node.get("top"), lm.geometry)
        except HeadSelectionError as e:
            where = [*path, "top"]
            line, col = _position(loaded.tree, where) if loaded.tree is not None else (None, None)
            raise SpecError(f"{e}" + (f" in {swept}" if swept else ""), source=loaded.source, line=line, col=col,
                            path=format_path(where)) from None
    try:
        resources.check(spec, lm, swept)
    except resources.EstimateFailed as e:  # a plugin's size() or estimate() raised: name it, its step and plugin
        raise step_error(e.cause, step=e.step, config=None if e.task else e.config,
                         task=e.config if e.task else None, cell=cell,
                         during="size()" if e.task else "estimate()") from e.cause


def _checked_configs(spec: Any) -> Iterator[tuple[list[Any], Any]]:
    """``(key path, config)`` of every config whose ``preflight()`` :func:`check_steps` runs: the spec's task,
    and each step's own task and action config."""
    if getattr(spec, "task", None) is not None:
        yield ["task"], spec.task
    for i, step in enumerate(spec.steps):
        if getattr(step, "task", None) is not None:
            yield ["steps", i, "task"], step.task
        yield ["steps", i, step.action], getattr(step, step.action)


def check_steps(loaded: LoadedSpec, cells: list[Cell] | None = None) -> None:
    """Check the example fields the steps' components read against their tasks (:func:`check_fields`), and run
    the ``preflight()`` check of every step config and task config that has one (an ``evaluate`` step's
    lm-eval tasks, the size of a task's data file) for ``cells`` (default: the first
    :data:`PREFLIGHT_CELLS`), each distinct config once: before a run's store is created, and in ``headlab
    validate``. A failure is a :class:`SpecError` located at the step's key or the task's (the check's
    ``ValueError`` may carry a ``path`` within the config)."""

    check_fields(loaded, cells)
    if not any(callable(getattr(config, "preflight", None)) for _, config in _checked_configs(loaded.spec)):
        return
    seen: set[str] = set()
    if cells is None:
        cells = [cell for _, cell in zip(range(PREFLIGHT_CELLS), loaded.cells, strict=False)]
    for cell in cells:
        spec = loaded.for_cell(cell)
        for at, config in _checked_configs(spec):
            check = getattr(config, "preflight", None)
            if not callable(check):
                continue
            key = f"{format_path(at[:2])}:{type(config).__name__}:{jsonable(config)}"
            if key in seen:
                continue
            seen.add(key)
            try:
                check()
            except ValueError as e:
                where = [*at, *getattr(e, "path", ())]
                line, col = _position(loaded.tree, where) if loaded.tree is not None else (None, None)
                swept = f" in cell {cell.name} ({', '.join(f'{k}={v!r}' for k, v in cell.values)})" \
                    if cell.values else ""
                raise SpecError(f"{e}{swept}", source=loaded.source, line=line, col=col,
                                path=format_path(where)) from None


def _selections(node: Any, path: list[Any]) -> Any:
    """(path, mapping) of every head selection with a ``top`` in a dumped spec."""
    if isinstance(node, Mapping):
        if "top" in node and ("from" in node or "file" in node):
            yield path, node
        for k, v in node.items():
            yield from _selections(v, [*path, k])
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _selections(v, [*path, i])


def jsonable(config: Any) -> Any:
    """A config as JSON-compatible data (aliases as keys): what a stored step's ``config`` attribute holds."""
    if isinstance(config, BaseModel):
        return config.model_dump(mode="json", by_alias=True)
    return to_jsonable_python(config, by_alias=True)
