"""Executing a spec: model once, sweep cells, steps in order, each finished cell written to zarr.

A step runs its action, a component like any other (``headlab_register_actions``; the built-in
``detect``, ``generate`` and ``score`` live in ``headlab.plugins.actions``), dispatched by name.

A cell's results are a function of (spec, cell) alone: the seed is reset at the start of every
cell and examples are rebuilt from the task config, so cells can run in any order or in parallel
and an interrupted run resumes with exactly the results an uninterrupted one would have.
"""

from __future__ import annotations

import json
import platform
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
import xarray as xr
from pydantic import BaseModel
from pydantic_core import to_jsonable_python

from . import resources
from .context import Example, Reporter, StepContext, TaskContext
from .errors import step_error
from .model import LoadedModel, ModelLoadError, load_model
from .plugin_manager import get_manager
from .results import Run, RunWriter, now, open_run
from .spec import Cell, LoadedSpec, load_spec

PREFLIGHT_CELLS = 4096
"""Cells checked against the model and the resource budget before a run starts (each is checked again before
it runs)."""


class ModelCache:
    """Loads each distinct model spec once per run (within the resource budget ``limits``)."""

    def __init__(self, seed: int = 0, limits: Any = None) -> None:
        self._models: dict[str, LoadedModel] = {}
        self.seed = seed
        self.limits = limits

    def get(self, spec: Any) -> LoadedModel:
        """The loaded model of ``spec``. Any failure is a :class:`ModelLoadError` naming the model (and the
        plugin that loads it), a :class:`~headlab.resources.ResourceLimitError` past the budget."""
        key = spec.model_dump_json()
        if key not in self._models:
            resources.check_model(spec, self.limits)
            try:
                self._models[key] = load_model(spec, self.seed)
            except (ModelLoadError, resources.ResourceLimitError):
                raise
            except Exception as e:  # a model plugin or transformers failing in its own way: one line naming it
                comp = get_manager().components["models"].get(spec.path or spec.id or "")
                by = f" (model plugin {comp.plugin})" if comp is not None else ""
                first = (str(e).strip().splitlines() or [""])[0]
                raise ModelLoadError(f"cannot load model '{spec.name}'{by}: {type(e).__name__}: {first}") from e
        return self._models[key]


def _seed(seed: int) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed % (2**32))


def build_examples(task_cfg: Any, lm: LoadedModel, seed: int) -> list[Example]:
    """Examples of a task config, through its plugin."""
    comp = get_manager().get("tasks", task_cfg.kind)
    vocab = int(getattr(lm.model.config.get_text_config(), "vocab_size", 0) or 0)
    examples = comp.impl(task_cfg, TaskContext(tokenizer=lm.tokenizer, seed=seed, vocab_size=vocab))
    if not examples:
        raise ValueError(f"task '{task_cfg.kind}' produced no examples")
    return examples


def examples_dataset(examples: list[Example], lm: LoadedModel) -> xr.Dataset:
    """The inputs a step saw: prompts, targets, token ids (right-padded with -1), meta as coordinates."""
    ids = []
    for ex in examples:
        if ex.input_ids is not None:
            ids.append(list(ex.input_ids))
        elif lm.tokenizer is not None:
            ids.append(lm.tokenizer(ex.prompt)["input_ids"])
        else:
            ids.append([])
    n = max((len(r) for r in ids), default=0)
    arr = np.full((len(ids), n), -1, dtype=np.int64)
    for i, r in enumerate(ids):
        arr[i, : len(r)] = r
    ds = xr.Dataset({
        "prompt": ("example", np.array([ex.prompt for ex in examples], dtype=object)),
        "target": ("example", np.array([ex.target or "" for ex in examples], dtype=object)),
        "input_ids": (("example", "token"), arr),
    })
    meta_keys = sorted({k for ex in examples for k in ex.meta})
    for key in meta_keys:
        values = [ex.meta.get(key) for ex in examples]
        if all(isinstance(v, (int, float, str, bool, np.generic)) for v in values):
            ds = ds.assign_coords({key: ("example", np.array(values, dtype=object if
                                                             isinstance(values[0], str) else None))})
    return ds.assign_coords(example=np.arange(len(examples)), token=np.arange(n))


def decode_info(parts: list[tuple[dict[str, Any], list[int]]], geometry: Any,
                ) -> tuple[dict[str, xr.DataArray], dict[str, Any]]:
    """The arrays and attributes a ``generate`` step stores from its batches' ``Decoded.info``.

    A public helper of core, not of one action: it is the storage convention of the ``Decoded.info``
    contract (:class:`headlab.generation.Decoded`), so any action that decodes (the built-in ``generate``,
    or a third party's) stores a strategy's diagnostics the same way.

    ``parts``: per batch, ``(info, generated length per row)``. Per-step values (a list over steps of
    per-row values) become ``(example, step)`` arrays, kept up to each row's last token (the step that
    chose EOS included); ``heads`` becomes the boolean ``(layer, head)`` array ``decode_heads``; other
    values equal in every batch become attributes ``decode_<key>``.
    """
    arrays: dict[str, xr.DataArray] = {}
    attrs: dict[str, Any] = {}
    if not parts:
        return arrays, attrs
    keys = [k for k in parts[0][0] if all(k in info for info, _ in parts)]
    for key in keys:
        values = [info[key] for info, _ in parts]
        if key == "heads":
            mask = np.zeros((geometry.n_layers, geometry.n_heads), dtype=bool)
            for layer, head in {(int(a), int(b)) for v in values for a, b in v}:
                mask[layer, head] = True
            arrays["decode_heads"] = xr.DataArray(mask, dims=("layer", "head"), coords={
                "layer": np.arange(geometry.n_layers), "head": np.arange(geometry.n_heads)})
        elif all(_per_step(v, len(n)) for v, (_, n) in zip(values, parts, strict=True)):
            rows = [[step[r] for step in v] for v, (_, n) in zip(values, parts, strict=True) for r in range(len(n))]
            lengths = [k for _, n in parts for k in n]
            width = max((len(r) for r in rows), default=0)
            ints = all(isinstance(x, (int, np.integer)) and not isinstance(x, bool) for r in rows for x in r)
            arr = np.full((len(rows), width), -1 if ints else np.nan, dtype=np.int64 if ints else float)
            for i, (row, k) in enumerate(zip(rows, lengths, strict=True)):
                keep = min(len(row), k + 1)
                arr[i, :keep] = row[:keep]
            arrays[key] = xr.DataArray(arr, dims=("example", "step"))
        elif all(v == values[0] for v in values):
            try:
                attrs[f"decode_{key}"] = json.loads(json.dumps(values[0]))
            except TypeError:
                continue
    return arrays, attrs


def _per_step(value: Any, rows: int) -> bool:
    return isinstance(value, list) and all(isinstance(step, list) and len(step) == rows for step in value)


def run_cell(loaded: LoadedSpec, cell: Cell, models: ModelCache, reporter: Reporter | None = None,
             cancel: Callable[[], bool] | None = None) -> dict[str, xr.Dataset]:
    """Run every step of one sweep cell; returns step id -> Dataset."""
    spec = loaded.for_cell(cell)
    reporter = reporter or Reporter()
    lm = models.get(spec.model)
    preflight(loaded, spec, lm, cell)
    _seed(spec.seed)
    results: dict[str, xr.Dataset] = {}
    example_cache: dict[str, list[Example]] = {}
    for step in spec.steps:
        task = step.task or spec.task
        key = task.model_dump_json()
        if key not in example_cache:
            try:
                example_cache[key] = build_examples(task, lm, spec.seed)
            except (Exception, SystemExit) as e:
                raise step_error(e, step=step, config=None, task=task, cell=cell) from e
        examples = example_cache[key]
        ctx = StepContext(model=lm, examples=examples, results=results, seed=spec.seed, step_id=step.id,
                          reporter=reporter, cancel=cancel or (lambda: False))
        _seed(spec.seed)
        config = getattr(step, step.action)
        try:
            ds = get_manager().get("actions", step.action).impl(config, ctx)
            if not isinstance(ds, xr.Dataset):
                raise TypeError(f"the action returned {type(ds).__name__}, not an xarray Dataset")
        except (Exception, SystemExit) as e:  # KeyboardInterrupt passes: the run is interrupted, not failed
            raise step_error(e, step=step, config=config, cell=cell) from e
        ex = examples_dataset(examples, lm)
        ds = ds.merge(ex, compat="override", join="left"
                      if "example" in ds.dims else "outer")
        ds.attrs.update(step=step.id, action=step.action, task=task.kind, config=json.dumps(_jsonable(config)),
                        model=lm.name)
        results[step.id] = ds
    return results


def preflight(loaded: LoadedSpec, spec: Any, lm: LoadedModel, cell: Cell | None = None) -> None:
    """Checks of one cell's spec against the loaded model, before anything of the cell runs: every ``top`` of
    a head selection within the model's heads (a located :class:`SpecError`), and the resource guard
    (:func:`headlab.resources.check`)."""
    from .heads import HeadSelectionError, check_top
    from .spec import SpecError, _position, format_path

    swept = f"cell {cell.name} ({', '.join(f'{k}={v!r}' for k, v in cell.values)})" if cell and cell.values else ""
    for path, node in _selections(spec.model_dump(by_alias=True, exclude_none=True), []):
        try:
            check_top(node.get("top"), lm.geometry)
        except HeadSelectionError as e:
            where = [*path, "top"]
            line, col = _position(loaded.tree, where) if loaded.tree is not None else (None, None)
            raise SpecError(f"{e}" + (f" in {swept}" if swept else ""), source=loaded.source, line=line, col=col,
                            path=format_path(where)) from None
    resources.check(spec, lm, swept)


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


def _jsonable(config: Any) -> Any:
    if isinstance(config, BaseModel):
        return config.model_dump(mode="json", by_alias=True)
    return to_jsonable_python(config, by_alias=True)


def provenance(lm: LoadedModel | None) -> dict[str, Any]:
    """Versions, host and model facts for a run's attributes."""
    import transformers

    from . import __version__

    out = {"headlab_version": __version__, "torch_version": torch.__version__,
           "transformers_version": transformers.__version__, "python_version": platform.python_version(),
           "host": platform.node()}
    if lm is not None:
        out.update(lm.provenance())
    return out


def _run_dir(output: str, name: str) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    base = Path(output) / f"{name}-{stamp}"
    path, i = base, 1
    while path.exists():
        i += 1
        path = Path(f"{base}-{i}")
    return path


def run(spec: str | Path | Mapping[str, Any] | LoadedSpec, *, out: str | Path | None = None,
        overrides: Mapping[str, Any] | None = None, resume: str | Path | None = None,
        reporter: Reporter | None = None, cancel: Callable[[], bool] | None = None,
        on_cell: Callable[[Cell], None] | None = None) -> Run:
    """Run a spec (path, YAML text, mapping or loaded spec) and return the finished :class:`Run`.

    ``resume`` completes an interrupted run store (its own spec is used): cells that are missing,
    unfinished or damaged are computed, intact ones are kept. The store is created atomically, then
    each finished cell is written as it completes; ``on_cell`` is called after each write.
    """
    reporter = reporter or Reporter()
    if resume is not None:
        previous = open_run(resume)
        loaded = load_spec(previous.spec_data)
        loaded.text = previous.spec_text
        writer = RunWriter(Path(resume))
    else:
        loaded = spec if isinstance(spec, LoadedSpec) else load_spec(spec)
        if overrides:
            loaded = loaded.with_overrides(overrides)
        writer = None
    cells = loaded.cells
    models = ModelCache(loaded.spec.seed, loaded.spec.limits)
    first_model = models.get(loaded.for_cell(cells[0]).model)
    for cell in cells[:PREFLIGHT_CELLS]:  # refuse before a store is created; every cell is checked again as it runs
        cell_spec = loaded.for_cell(cell)
        preflight(loaded, cell_spec, models.get(cell_spec.model), cell)
    if writer is None:
        attrs = {
            "name": loaded.spec.name, "status": "running", "created": now(), "spec_text": loaded.text,
            "spec_source": loaded.source, "spec_data": json.dumps(loaded.data),
            "resolved": loaded.spec.model_dump_json(by_alias=True), "sweep": loaded.spec.sweep,
            "steps": [s.id for s in loaded.spec.steps], "cells_total": len(cells), "seed": loaded.spec.seed,
            **provenance(first_model),
        }
        writer = RunWriter.create(_run_dir(str(out or loaded.spec.output), loaded.spec.name), attrs)
    done = writer.done_cells()
    todo = [c for c in cells if c.name not in done]
    writer.set_attrs(status="running")
    reporter.start("cells", len(cells), f"{loaded.spec.name}: cells")
    reporter.advance("cells", len(cells) - len(todo))
    try:
        for cell in todo:
            started = time.time()
            results = run_cell(loaded, cell, models, reporter, cancel)
            writer.write_cell(cell.name, cell.as_dict(), results,
                              {"started": started, "seconds": time.time() - started})
            reporter.advance("cells")
            if on_cell is not None:
                on_cell(cell)
    except BaseException as e:
        writer.set_attrs(status="interrupted")
        e.add_note(f"run store: {writer.path}")  # the CLI names it in its "interrupted" line
        raise
    finally:
        reporter.stop("cells")
    writer.set_attrs(status="complete", finished=now())
    return open_run(writer.path)
