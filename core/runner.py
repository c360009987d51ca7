"""Executing a spec: model once, sweep cells, steps in order, each finished cell written to zarr.

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

from .context import Example, Reporter, StepContext, TaskContext
from .generation import DecodeRequest, tokenize
from .model import LoadedModel, load_model
from .plugin_manager import get_manager
from .results import Run, RunWriter, now, open_run
from .spec import Cell, LoadedSpec, load_spec


class ModelCache:
    """Loads each distinct model spec once per run."""

    def __init__(self, seed: int = 0) -> None:
        self._models: dict[str, LoadedModel] = {}
        self.seed = seed

    def get(self, spec: Any) -> LoadedModel:
        key = spec.model_dump_json()
        if key not in self._models:
            self._models[key] = load_model(spec, self.seed)
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


def run_generate(action: Any, ctx: StepContext) -> xr.Dataset:
    """The ``generate`` action: steer, decode in batches, score with metrics."""
    from .instrument import Plan

    mgr = get_manager()
    decoder = mgr.get("decoders", action.decode.kind)
    outputs: list[str] = []
    batches = [ctx.examples[i: i + action.batch_size] for i in range(0, len(ctx.examples), action.batch_size)]
    for chunk in ctx.progress(batches, "generating", total=len(batches)):
        batch = tokenize(ctx.model, chunk)
        plan = None
        if action.steer:
            plan = Plan()
            for cfg in action.steer:
                mgr.get("steering", cfg.kind).impl(cfg, ctx, batch, plan)
        request = DecodeRequest(ctx.model, batch, action.max_new_tokens, list(action.stop), plan, ctx.seed)
        outputs.extend(decoder.impl(action.decode, request).texts)
    ds = xr.Dataset({"output": ("example", np.array(outputs, dtype=object))})
    names = []
    for cfg in action.metrics:
        comp = mgr.get("metrics", cfg.kind)
        values = np.asarray(comp.impl(cfg, ctx.examples, outputs), dtype=float)
        ds[cfg.kind] = ("example", values)
        names.append(cfg.kind)
    ds.attrs.update(decode=action.decode.kind, steer=[c.kind for c in action.steer], metrics=names)
    return ds


def run_cell(loaded: LoadedSpec, cell: Cell, models: ModelCache, reporter: Reporter | None = None,
             cancel: Callable[[], bool] | None = None) -> dict[str, xr.Dataset]:
    """Run every step of one sweep cell; returns step id -> Dataset."""
    spec = loaded.for_cell(cell)
    reporter = reporter or Reporter()
    lm = models.get(spec.model)
    _seed(spec.seed)
    results: dict[str, xr.Dataset] = {}
    example_cache: dict[str, list[Example]] = {}
    for step in spec.steps:
        task = step.task or spec.task
        key = task.model_dump_json()
        if key not in example_cache:
            example_cache[key] = build_examples(task, lm, spec.seed)
        examples = example_cache[key]
        ctx = StepContext(model=lm, examples=examples, results=results, seed=spec.seed, step_id=step.id,
                          reporter=reporter, cancel=cancel or (lambda: False))
        _seed(spec.seed)
        if step.detect is not None:
            ds = get_manager().get("detectors", step.detect.kind).impl(step.detect, ctx)
            ds.attrs.setdefault("method", step.detect.kind)
            config = step.detect.model_dump(mode="json", by_alias=True)
        else:
            ds = run_generate(step.generate, ctx)
            config = step.generate.model_dump(mode="json", by_alias=True)
        ex = examples_dataset(examples, lm)
        ds = ds.merge(ex.rename({"prompt": "prompt", "target": "target"}), compat="override", join="left"
                      if "example" in ds.dims else "outer")
        ds.attrs.update(step=step.id, action=step.action, task=task.kind, config=json.dumps(config),
                        model=lm.name)
        results[step.id] = ds
    return results


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

    ``resume`` completes an interrupted run store (its own spec is used). Each finished cell is
    written as it completes; ``on_cell`` is called after each write.
    """
    reporter = reporter or Reporter()
    if resume is not None:
        previous = open_run(resume)
        loaded = load_spec(json.loads(previous.attrs["spec_data"]))
        loaded.text = previous.spec_text
        writer = RunWriter(Path(resume))
    else:
        loaded = spec if isinstance(spec, LoadedSpec) else load_spec(spec)
        if overrides:
            loaded = loaded.with_overrides(overrides)
        writer = None
    cells = loaded.cells
    models = ModelCache(loaded.spec.seed)
    first_model = models.get(loaded.for_cell(cells[0]).model)
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
    except BaseException:
        writer.set_attrs(status="interrupted")
        raise
    finally:
        reporter.stop("cells")
    writer.set_attrs(status="complete", finished=now())
    return open_run(writer.path)
