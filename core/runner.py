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
from .generation import DecodeRequest, ScoreRequest, continuation_batch, tokenize
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
    infos: list[tuple[dict[str, Any], list[int]]] = []
    steered: dict[str, list[xr.DataArray]] = {}
    batches = [ctx.examples[i: i + action.batch_size] for i in range(0, len(ctx.examples), action.batch_size)]
    for chunk in ctx.progress(batches, "generating", total=len(batches)):
        batch = tokenize(ctx.model, chunk)
        plan = None
        reports = []
        if action.steer:
            plan = Plan()
            for cfg in action.steer:
                report = mgr.get("steering", cfg.kind).impl(cfg, ctx, batch, plan)
                if callable(report):
                    reports.append(report)
        request = DecodeRequest(ctx.model, batch, action.max_new_tokens, list(action.stop), plan, ctx.seed, ctx)
        decoded = decoder.impl(action.decode, request)
        outputs.extend(decoded.texts)
        infos.append((decoded.info, [len(t) for t in decoded.tokens]))
        for report in reports:
            for name, array in report().items():
                steered.setdefault(name, []).append(array)
    ds = xr.Dataset({"output": ("example", np.array(outputs, dtype=object))})
    arrays, attrs = decode_info(infos, ctx.model.geometry)
    ds = ds.assign(arrays)
    for name, parts in steered.items():
        if len(parts) == len(batches):
            ds[name] = xr.concat(parts, dim="example", join="outer")
    ds.attrs.update(attrs)
    names = []
    for cfg in action.metrics:
        comp = mgr.get("metrics", cfg.kind)
        values = np.asarray(comp.impl(cfg, ctx.examples, outputs), dtype=float)
        ds[cfg.kind] = ("example", values)
        names.append(cfg.kind)
    ds.attrs.update(decode=action.decode.kind, steer=[c.kind for c in action.steer], metrics=names)
    return ds


def decode_info(parts: list[tuple[dict[str, Any], list[int]]], geometry: Any,
                ) -> tuple[dict[str, xr.DataArray], dict[str, Any]]:
    """The arrays and attributes a ``generate`` step stores from its batches' ``Decoded.info``.

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


def mc_metrics(logprobs: np.ndarray, examples: list[Example]) -> dict[str, np.ndarray]:
    """TruthfulQA's multiple-choice metrics from per-choice scores ``(example, choice)`` (NaN = no choice).

    The true choices are ``meta["labels"]`` (1 = true) when given, else ``label`` alone. MC1: the labelled
    choice scores above every false one; MC2: the normalised probability mass ``sum_true exp(s) /
    sum_all exp(s)``; MC3: the fraction of true choices scoring above every false one; accuracy: the
    best-scoring choice is true. ``predicted`` is the best-scoring choice.
    """
    n = len(examples)
    out = {k: np.full(n, np.nan) for k in ("mc1", "mc2", "mc3", "accuracy")}
    out["predicted"] = np.full(n, -1, dtype=np.int64)
    for i, ex in enumerate(examples):
        k = len(ex.choices or [])
        s = logprobs[i, :k]
        labels = np.asarray(ex.meta.get("labels") or [int(j == ex.label) for j in range(k)], dtype=bool)
        best = int(np.argmax(s))
        out["predicted"][i] = best
        out["accuracy"][i] = float(labels[best])
        if not labels.any() or labels.all():
            continue
        true, false = s[labels], s[~labels]
        label = ex.label if ex.label is not None and labels[ex.label] else int(np.flatnonzero(labels)[0])
        out["mc1"][i] = float(s[label] > false.max())
        out["mc3"][i] = float(np.mean(true > false.max()))
        shifted = np.exp(s - s.max())
        out["mc2"][i] = float(shifted[labels].sum() / shifted.sum())
    return out


def run_score(action: Any, ctx: StepContext) -> xr.Dataset:
    """The ``score`` action: every (example, choice) row scored under the decoder's ``score``.

    A decoder supports scoring when its implementation carries a ``score`` attribute:
    ``decode.score(config, request: ScoreRequest) -> Scored`` (see docs/plugins.md).
    """
    from .instrument import Plan

    mgr = get_manager()
    decoder = mgr.get("decoders", action.decode.kind)
    scorer = getattr(decoder.impl, "score", None)
    if scorer is None:
        raise ValueError(f"decoder '{action.decode.kind}' does not support scoring (its implementation has no "
                         "`score` attribute)")
    missing = [i for i, ex in enumerate(ctx.examples) if not ex.choices]
    if missing:
        raise ValueError(f"the score action needs examples with `choices` (example {missing[0]} has none)")
    pairs = [(i, j) for i, ex in enumerate(ctx.examples) for j in range(len(ex.choices or []))]
    width = max(len(ex.choices or []) for ex in ctx.examples)
    logprobs = np.full((len(ctx.examples), width), np.nan)
    n_tok = np.zeros((len(ctx.examples), width), dtype=np.int64)
    chunks = [pairs[i: i + action.batch_size] for i in range(0, len(pairs), action.batch_size)]
    for chunk in ctx.progress(chunks, "scoring", total=len(chunks)):
        sources = [ctx.examples[i] for i, _ in chunk]
        conts = [ctx.examples[i].choices[j] for i, j in chunk]
        batch, n_tokens = continuation_batch(ctx.model, list(zip(sources, conts, strict=True)))
        plan = None
        if action.steer:
            plan = Plan()
            for cfg in action.steer:
                mgr.get("steering", cfg.kind).impl(cfg, ctx, batch, plan)
        request = ScoreRequest(ctx.model, batch, n_tokens, sources, conts, plan, ctx.seed, ctx)
        scored = scorer(action.decode, request)
        for (i, j), value, n in zip(chunk, scored.logprobs, n_tokens, strict=True):
            logprobs[i, j], n_tok[i, j] = value, n
    metrics = mc_metrics(logprobs, ctx.examples)
    choices = np.full((len(ctx.examples), width), "", dtype=object)
    for i, ex in enumerate(ctx.examples):
        choices[i, : len(ex.choices or [])] = ex.choices
    ds = xr.Dataset({
        "logprob": (("example", "choice"), logprobs),
        "choice_tokens": (("example", "choice"), n_tok),
        "choice_text": (("example", "choice"), choices),
        "label": ("example", np.array([-1 if ex.label is None else ex.label for ex in ctx.examples])),
        **{k: ("example", v) for k, v in metrics.items()},
    }).assign_coords(choice=np.arange(width))
    names = ["mc1", "mc2", "mc3", "accuracy"]
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
        elif step.score is not None:
            ds = run_score(step.score, ctx)
            config = step.score.model_dump(mode="json", by_alias=True)
        else:
            ds = run_generate(step.generate, ctx)
            config = step.generate.model_dump(mode="json", by_alias=True)
        ex = examples_dataset(examples, lm)
        ds = ds.merge(ex, compat="override", join="left"
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
