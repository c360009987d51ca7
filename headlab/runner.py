"""Executing a spec: model once, sweep cells, steps in order, each finished cell written to zarr.

A step runs its action, a component like any other (``headlab_register_actions``; the built-in
``detect``, ``generate``, ``score`` and ``evaluate`` live in ``headlab.plugins.actions``), dispatched by
name. The runner stores the task's inputs (prompts, targets, token ids, meta) with a step's dataset,
unless the action's ``example`` dimension is something else: an action whose dataset has the attribute
``example_source`` (``evaluate``: ``"lm-eval"``, its samples) stores its own.

A cell's results are a function of (spec, cell) alone: the seed is reset at the start of every
cell and examples are rebuilt from the task config, so cells can run in any order or in parallel
and an interrupted run resumes with exactly the results an uninterrupted one would have.

Where the cells run is an executor's business, a component too (``headlab_register_executors``; the
built-in ``local`` and ``ray`` live in ``headlab.plugins.executors``): :func:`run` creates or reopens the
store, hands the executor a :class:`Job` (the cells still to run and the driver's bookkeeping) and
sets the run's status from what the executor reported. A worker process runs one cell from a
picklable :class:`CellTask` with :func:`execute_cell`.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import json
import platform
import re
import time
import traceback
import uuid
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import fsspec
import numpy as np
import torch
import transformers
import xarray as xr

from . import resources
from .context import Example, Reporter, StepContext
from .contract import OutOfMemory, StoreWriteError, meta_problem, result_problems, write_advice
from .describe import describe_step
from .dims import DIMENSIONS
from .errors import ContractError, StepError, describe, step_error
from .generation import ContextLengthWarning
from .inputs import check_resume, input_digests
from .model import LoadedModel, ModelLoadError, load_model
from .plugin_manager import get_manager, plugins_for_workers, register_worker_plugins
from .preflight import (
    PREFLIGHT_CELLS,
    check_examples,
    check_fields,
    check_requirements,
    check_steps,
    jsonable,
    preflight,
)
from .results import Run, RunWriter, is_url, now, open_run, store_location
from .scoring import build_examples
from .spec import Cell, LoadedSpec, load_spec
from .version import __version__

__all__ = ["CellError", "CellFailure", "CellResult", "CellTask", "Job", "ModelCache", "build_examples",
           "check_examples", "check_fields", "check_requirements", "execute_cell", "run"]

class ModelCache:
    """Loads each distinct model spec (with the seed its random weights are drawn with) once, within the
    resource budget ``limits``.

    A run's driver keeps every model it loaded; a worker process that runs cells of many runs keeps
    the ``max_models`` most recently used (``loads`` counts the loads).
    """

    def __init__(self, seed: int = 0, max_models: int | None = None, limits: Any = None) -> None:
        self._models: OrderedDict[str, LoadedModel] = OrderedDict()
        self.seed = seed
        self.max_models = max_models
        self.limits = limits
        self.loads = 0

    def get(self, spec: Any, seed: int | None = None) -> LoadedModel:
        """The loaded model of ``spec`` (a :class:`headlab.spec.ModelSpec`), loading it if needed. Any
        failure is a :class:`ModelLoadError` naming the model (and the plugin that loads it), a
        :class:`~headlab.resources.ResourceLimitError` past the budget."""
        seed = self.seed if seed is None else seed
        key = f"{seed}:{spec.model_dump_json()}"
        if key in self._models:
            self._models.move_to_end(key)
            return self._models[key]
        if self.max_models is not None and len(self._models) >= self.max_models:
            while len(self._models) >= self.max_models:
                self._models.popitem(last=False)
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        resources.check_model(spec, self.limits)
        try:
            self._models[key] = load_model(spec, seed)
        except (ModelLoadError, resources.ResourceLimitError):
            raise
        except Exception as e:  # a model plugin or transformers failing in its own way: one line naming it
            comp = get_manager().components["models"].get(spec.path or spec.id or "")
            by = f" (model plugin {comp.plugin})" if comp is not None else ""
            first = (str(e).strip().splitlines() or [""])[0]
            raise ModelLoadError(f"cannot load model '{spec.name}'{by}: {type(e).__name__}: {first}") from e
        self.loads += 1
        return self._models[key]


def _seed(seed: int) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed % (2**32))


def check_context(examples: list[Example], lm: LoadedModel, config: Any, cache: dict[int, int]) -> None:
    """Refuse a step whose longest prompt plus its ``max_new_tokens`` is longer than the model's context window
    (``model: {extrapolate: true}`` allows it). ``cache``: prompt lengths by example id, kept across steps."""
    limit = lm.context_length
    if limit is None or not examples:
        return
    longest, where = 0, 0
    for i, ex in enumerate(examples):
        n = cache.get(id(ex))
        if n is None:
            if ex.input_ids is not None:
                n = len(ex.input_ids)
            elif lm.tokenizer is not None:
                n = len(lm.tokenizer(ex.prompt)["input_ids"])
            else:
                n = 0
            cache[id(ex)] = n
        if n > longest:
            longest, where = n, i
    new = int(getattr(config, "max_new_tokens", 0) or 0)
    if longest + new > limit:
        plus = f" + {new} new tokens" if new else ""
        raise ValueError(f"example {where} is {longest:,} tokens{plus} = {longest + new:,}, longer than the model's "
                         f"context window of {limit:,} tokens; shorten the task, or set `model: {{extrapolate: true}}` "
                         "to run past it")


LONG_FORWARD_TOKENS = 8192
"""Tokens of one forward (rows x positions) from which its progress through the layers is reported."""


@contextlib.contextmanager
def forward_progress(lm: LoadedModel, reporter: Reporter, step_id: str,
                     min_tokens: int = LONG_FORWARD_TOKENS) -> Iterator[None]:
    """Report each forward of at least ``min_tokens`` tokens layer by layer (the key ``forward:<step id>``),
    so a cell busy with one long prompt shows where it is."""
    if type(reporter) is Reporter:  # nobody is watching
        yield
        return
    try:
        layers = lm.decoder_layers
    except Exception:  # noqa: BLE001 - a model whose layers anatomy cannot find runs without this progress
        layers = []
    if not layers:
        yield
        return
    key, total = f"forward:{step_id}", len(layers)
    active = [False]

    def begin(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        hidden = args[0] if args else kwargs.get("hidden_states")
        shape = tuple(getattr(hidden, "shape", ()))
        tokens = int(np.prod(shape[:-1])) if len(shape) >= 2 else 0
        if tokens >= min_tokens:
            active[0] = True
            reporter.start(key, total, f"step {step_id}: forward over {tokens:,} tokens: layers")

    def done(module: Any, args: tuple[Any, ...], output: Any, last: bool = False) -> None:
        if active[0]:
            reporter.advance(key)
            if last:
                active[0] = False
                reporter.stop(key)

    handles = [layers[0].register_forward_pre_hook(begin, with_kwargs=True)]
    handles += [layer.register_forward_hook(functools.partial(done, last=i == total - 1))
                for i, layer in enumerate(layers)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        if active[0]:
            reporter.stop(key)


def check_meta(examples: list[Example]) -> None:
    """Refuse (``ValueError``) examples whose ``meta`` fields a run store cannot hold: a field mixing strings
    with numbers or booleans, or an integer beyond 64 bits (checked before the step runs)."""
    for key in sorted({k for ex in examples for k in ex.meta}):
        problem = meta_problem(key, [ex.meta.get(key) for ex in examples])
        if problem:
            raise ValueError(f"the task's {problem}")


#: the variables of the task's inputs that :func:`examples_dataset` stores with a step's results
STORED_INPUTS = {"prompt": "prompts", "target": "targets", "input_ids": "token ids"}


def check_result(ds: xr.Dataset, step: Any, config: Any, lm: LoadedModel, n_examples: int) -> None:
    """Refuse a step's result that breaks the contract of stored results (:func:`headlab.contract.result_problems`),
    or that has a variable of the task's stored inputs (:data:`STORED_INPUTS`), with a :class:`ContractError`
    naming the component that made it (the detector of a ``detect`` step, else
    the action) and the variable."""
    problems = result_problems(ds, lm.geometry, None if "example_source" in ds.attrs else n_examples)
    if "example_source" not in ds.attrs:  # the task's inputs are stored beside the result: never in its place
        problems = [f"it has its own variable {name!r}, which would replace the task's {what} that headlab stores "
                    f"with every step's results; rename that variable" for name, what in STORED_INPUTS.items()
                    if name in ds.variables] + problems
    if not problems:
        return
    detector = get_manager().components["detectors"].get(getattr(config, "kind", ""))
    category, kind = ("detectors", config.kind) if detector is not None and isinstance(config, detector.config) \
        else ("actions", step.action)
    more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
    raise ContractError(f"the result cannot be stored: {problems[0]}{more}", category=category, kind=kind)


_ALLOCATED = re.compile(r"(?:tried to allocate|unable to allocate)\s+([0-9][0-9.,]*)\s*([KMGTP]i?B|bytes|B)\b",
                        re.IGNORECASE)


def _memory_error(exc: BaseException, step: Any, config: Any) -> BaseException:
    """``exc`` itself, or for an out-of-memory error (``MemoryError``, ``torch.cuda.OutOfMemoryError``) an
    :class:`headlab.contract.OutOfMemory` line with the size that failed and the knobs that make it fit."""
    if not isinstance(exc, (MemoryError, torch.cuda.OutOfMemoryError)) or isinstance(exc, OutOfMemory):
        return exc
    cuda = isinstance(exc, torch.cuda.OutOfMemoryError)
    found = _ALLOCATED.search(str(exc))
    if found is None:
        size = "(the allocator did not say how much)"
    elif found.group(2).lower() in ("bytes", "b"):
        size = resources.format_bytes(float(found.group(1).replace(",", "")))
    else:
        size = f"{found.group(1)} {found.group(2)}"
    batch = f"make the step's batch_size smaller ({step.action}.batch_size of step '{step.id}'), or " \
        if hasattr(config, "batch_size") else ""
    err = OutOfMemory(f"out of {'GPU' if cuda else 'host'} memory allocating {size}; {batch}make the task smaller "
                      "(n, length, max_new_tokens), or set limits.memory in the spec (or --memory-limit) to a budget "
                      "this machine holds, so the resource guard refuses such a cell before it runs")
    err.__traceback__ = exc.__traceback__
    err.__cause__ = exc
    return err


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
        if key in ds.variables or key in DIMENSIONS:
            raise ValueError(f"the task gives its examples a field {key!r}, the name of headlab's own "
                             f"{'dimension' if key in DIMENSIONS else 'variable'} {key!r} of every step's results; "
                             "rename that field in the task's data")
    for key in meta_keys:
        values = [ex.meta.get(key) for ex in examples]
        if all(isinstance(v, (int, float, str, bool, np.generic)) for v in values):
            ds = ds.assign_coords({key: ("example", np.array(values, dtype=object if
                                                             isinstance(values[0], str) else None))})
    return ds.assign_coords(example=np.arange(len(examples)), token=np.arange(n))


def run_cell(loaded: LoadedSpec, cell: Cell, models: ModelCache, reporter: Reporter | None = None,
             cancel: Callable[[], bool] | None = None, on_step: Callable[[str], None] | None = None,
             store: str = "") -> dict[str, xr.Dataset]:
    """Run every step of one sweep cell in this process; returns step id -> Dataset.

    ``on_step(step_id)`` is called as each step starts (an executor reports which step failed); ``store``
    is the run store the cell is written to (:attr:`StepContext.store`). The exception that stops the cell
    (a :class:`StepError`, a ``KeyboardInterrupt``) is raised as it is, with the attribute ``completed_steps``:
    step id -> Dataset of the steps that completed before it (empty when none did).
    """
    results: dict[str, xr.Dataset] = {}
    try:
        return _run_steps(loaded, cell, models, reporter, cancel, on_step, store, results)
    except BaseException as e:
        with contextlib.suppress(Exception):  # an exception type that takes no attributes: nothing is kept
            e.completed_steps = dict(results)  # type: ignore[attr-defined]
        raise


def _run_steps(loaded: LoadedSpec, cell: Cell, models: ModelCache, reporter: Reporter | None,
               cancel: Callable[[], bool] | None, on_step: Callable[[str], None] | None, store: str,
               results: dict[str, xr.Dataset]) -> dict[str, xr.Dataset]:
    """:func:`run_cell`, each completed step's Dataset put into ``results`` as it completes."""
    spec = loaded.for_cell(cell)
    reporter = reporter or Reporter()
    lm = models.get(spec.model, seed=loaded.spec.seed)
    preflight(loaded, spec, lm, cell)
    _seed(spec.seed)
    example_cache: dict[str, list[Example]] = {}
    token_cache: dict[int, int] = {}
    for i, step in enumerate(spec.steps, 1):
        if on_step is not None:
            on_step(step.id)
        # progress names the step that runs: "step decore (3/6): generate decore (heads from retrieval top 8)";
        # the step's own progress (StepContext.progress) takes the same key over
        running = f"step:{step.id}"
        reporter.start(running, None, f"step {step.id} ({i}/{len(spec.steps)}): {describe_step(step, spec.task).text}")
        try:
            task = step.task or spec.task
            key = task.model_dump_json()
            if key not in example_cache:
                try:
                    example_cache[key] = build_examples(task, lm, spec.seed)
                    check_meta(example_cache[key])
                except (Exception, SystemExit) as e:
                    raise step_error(_memory_error(e, step, None), step=step, config=None, task=task, cell=cell) from e
            examples = example_cache[key]
            if not spec.model.extrapolate:
                try:
                    check_context(examples, lm, getattr(step, step.action), token_cache)
                except ValueError as e:
                    raise step_error(e, step=step, config=None, task=task, cell=cell) from e
            check_requirements(step, task, examples, cell)
            ctx = StepContext(model=lm, examples=examples, results=results, seed=spec.seed, step_id=step.id,
                              reporter=reporter, cancel=cancel or (lambda: False), store=store)
            _seed(spec.seed)
            config = getattr(step, step.action)
            try:
                with forward_progress(lm, reporter, step.id), warnings.catch_warnings():
                    if spec.model.extrapolate:  # long prompts are asked for: no warning about them
                        warnings.simplefilter("ignore", ContextLengthWarning)
                    ds = get_manager().get("actions", step.action).impl(config, ctx)
                if not isinstance(ds, xr.Dataset):
                    raise TypeError(f"the action returned {type(ds).__name__}, not an xarray Dataset")
                check_result(ds, step, config, lm, len(examples))
            except (Exception, SystemExit) as e:  # KeyboardInterrupt passes: the run is interrupted, not failed
                raise step_error(_memory_error(e, step, config), step=step, config=config, cell=cell) from e
            if "example_source" not in ds.attrs:  # the step's `example` are the task's examples: store their inputs
                try:
                    ex = examples_dataset(examples, lm)
                    clash = sorted(set(ex.coords) & set(ds.variables) - set(ex.dims) - set(ds.dims))
                    if clash:
                        raise ValueError(f"the task gives its examples a field {clash[0]!r}, the name of a variable this "
                                         "step stores; rename that field in the task's data")
                except ValueError as e:
                    raise step_error(e, step=step, config=None, task=task, cell=cell) from e
                ds = ds.merge(ex, compat="override", join="left"
                              if "example" in ds.dims else "outer")
            ds.attrs.update(step=step.id, action=step.action, task=task.kind, config=json.dumps(jsonable(config)),
                            model=lm.name)
            results[step.id] = ds
        finally:
            reporter.stop(running)
    return results


def provenance(lm: LoadedModel | None) -> dict[str, Any]:
    """Versions, host and model facts for a run's attributes."""


    out = {"headlab_version": __version__, "torch_version": torch.__version__,
           "transformers_version": transformers.__version__, "python_version": platform.python_version(),
           "host": platform.node()}
    if lm is not None:
        out.update(lm.provenance())
    return out


def _run_dir(output: str, name: str) -> str:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    output = store_location(output)
    if is_url(output):

        fs, root = fsspec.core.url_to_fs(output)
        base = f"{output.rstrip('/')}/{name}-{stamp}"
        path, i = base, 1
        while fs.exists(f"{root.rstrip('/')}/{path.rsplit('/', 1)[1]}"):
            i += 1
            path = f"{base}-{i}"
        return path
    local = Path(output) / f"{name}-{stamp}"
    candidate, i = local, 1
    while candidate.exists():
        i += 1
        candidate = Path(f"{local}-{i}")
    return str(candidate)


def write_cell(writer: RunWriter, cell: Cell, results: Mapping[str, xr.Dataset], timing: Mapping[str, Any], *,
               done: bool = True) -> None:
    """Write ``cell``'s results into the run store; an ``OSError`` (no space left, a file-size limit) is a
    :class:`headlab.contract.StoreWriteError` naming the cell's path in the store and the command that
    finishes the run."""
    try:
        writer.write_cell(cell.name, cell.as_dict(), results, timing, done=done)
    except OSError as e:
        where = f"{str(writer.location).rstrip('/')}/cells/{cell.name}"
        file = f" ({e.filename})" if getattr(e, "filename", None) else ""
        reason = e.strerror or str(e) or type(e).__name__
        raise StoreWriteError(e.errno, f"cannot write cell {cell.name} into {where}{file}: {reason}; "
                              f"{write_advice(e.errno, created=True)}, then finish the run with `headlab run "
                              f"--resume {writer.location}`") from e


def _keep_completed(store: RunWriter | str, cell: Cell, step: str | None, exc: BaseException,
                    timing: Mapping[str, Any]) -> bool:
    """Write the steps of ``cell`` that completed before ``exc`` stopped it in step ``step`` (the
    ``completed_steps`` :func:`run_cell` attaches) into the cell's group, marked partial. Best effort: a
    failure to write is a note on ``exc`` and never replaces it. Returns whether anything was kept."""
    completed = getattr(exc, "completed_steps", None)
    if step is None or not completed:
        return False
    cause = exc.cause if isinstance(exc, StepError) else exc
    error = "interrupted" if isinstance(exc, KeyboardInterrupt) else describe(cause)
    try:
        writer = store if isinstance(store, RunWriter) else RunWriter(store)
        writer.write_cell(cell.name, cell.as_dict(), completed, timing, done=False,
                          failed={"step": step, "error": error})
    except Exception as e:  # noqa: BLE001 - the error that stopped the cell is the one to report
        with contextlib.suppress(Exception):
            exc.add_note(f"the steps of cell {cell.name} completed before step '{step}' were not kept: "
                         f"{describe(e)}")
        return False
    return True


# --- executing cells: what an executor and its workers use ----------------------------------------

@dataclass
class CellFailure:
    """Why a cell failed: the cell and its sweep values, the step that raised (None: before the first
    step, e.g. loading the model, or while writing), the exception as one line, its traceback, and the
    number of attempts made."""

    cell: str
    values: dict[str, Any]
    step: str | None
    error: str
    traceback: str = ""
    attempts: int = 1

    @classmethod
    def from_exception(cls, cell: Cell, step: str | None, exc: BaseException) -> CellFailure:
        """The failure of ``cell`` in ``step`` by ``exc`` (its traceback included)."""
        if isinstance(exc, StepError):  # the plugin's own exception is the error to record
            exc = exc.cause
        text = str(exc).strip().splitlines()
        line = f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__
        tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        return cls(cell.name, cell.as_dict(), step, line, tb)

    def as_dict(self) -> dict[str, Any]:
        """The record stored in the run's ``failed_cells`` attribute."""
        return {"values": self.values, "step": self.step, "error": self.error, "attempts": self.attempts,
                "traceback": self.traceback}

    def __str__(self) -> str:
        where = f" step '{self.step}'" if self.step else ""
        return f"cell {self.cell} {json.dumps(self.values, default=str)}{where}: {self.error}"


class CellError(Exception):
    """A cell failed in a worker (:func:`execute_cell`); carries its :class:`CellFailure`. Picklable, so
    it crosses process boundaries (Ray's, multiprocessing's) intact."""

    def __init__(self, failure: CellFailure) -> None:
        super().__init__(str(failure))
        self.failure = failure

    def __reduce__(self) -> tuple[Any, ...]:
        return (CellError, (self.failure,))


@dataclass
class CellResult:
    """What a worker reports for a cell it ran and wrote: when, for how long, where, with what model."""

    cell: Cell
    started: float
    seconds: float
    host: str
    provenance: dict[str, Any] = field(default_factory=dict)


@dataclass
class CellTask:
    """One cell as a worker process receives it, picklable: the spec's raw data and text, the cell,
    the run store's location, and the plugins registered in the driver's process (see
    :func:`headlab.plugin_manager.plugins_for_workers`)."""

    spec: dict[str, Any]
    text: str
    source: str
    cell: Cell
    store: str
    plugins: list[tuple[str, Any]] = field(default_factory=list)
    plugins_token: str = ""

    def load(self) -> LoadedSpec:
        """The validated spec (cached per process)."""
        key = json.dumps(self.spec, sort_keys=True, default=str)
        loaded = _SPECS.get(key)
        if loaded is None:
            loaded = load_spec(self.spec)
            loaded.text, loaded.source = self.text, self.source
            _SPECS[key] = loaded
            while len(_SPECS) > 8:
                _SPECS.popitem(last=False)
        return loaded


_SPECS: OrderedDict[str, LoadedSpec] = OrderedDict()
_PLUGINS_TOKEN: list[str] = [""]


def execute_cell(task: CellTask, models: ModelCache, reporter: Reporter | None = None,
                 cancel: Callable[[], bool] | None = None) -> CellResult:
    """Run one cell in a worker process and write it into the run's store, not yet marked done.

    The worker's half of a distributed executor: registers the driver's in-process plugins (once per
    run), validates the spec (cached), runs the cell's steps exactly as locally (:func:`run_cell`, with
    the worker's ``models``) and writes them into the cell's own group of the store. The driver marks
    the cell done with :meth:`Job.cell_done`. Any failure raises :class:`CellError` (cell, step, error);
    a step that fails (or is interrupted) leaves the steps completed before it written as a partial cell.
    """
    step: list[str | None] = [None]
    cell = task.cell
    started = time.time()
    try:
        if task.plugins and task.plugins_token != _PLUGINS_TOKEN[0]:
            register_worker_plugins(task.plugins)
            _PLUGINS_TOKEN[0] = task.plugins_token
        loaded = task.load()
        results = run_cell(loaded, cell, models, reporter, cancel, on_step=lambda s: step.__setitem__(0, s),
                           store=task.store)
        lm = models.get(loaded.for_cell(cell).model, seed=loaded.spec.seed)
        seconds = time.time() - started
        step[0] = None
        write_cell(RunWriter(task.store), cell, results, {"started": started, "seconds": seconds,
                                                          "host": platform.node()}, done=False)
    except (Exception, KeyboardInterrupt) as e:
        _keep_completed(task.store, cell, step[0], e, {"started": started, "seconds": time.time() - started,
                                                        "host": platform.node()})
        if isinstance(e, KeyboardInterrupt):
            raise
        raise CellError(CellFailure.from_exception(cell, step[0], e)) from None
    return CellResult(cell, started, seconds, platform.node(), lm.provenance())


class Job:
    """An executor's share of a run: the spec, the cells still to run, and the driver's bookkeeping.

    ``spec`` is the loaded spec, ``cells`` the cells not yet done (sweep order), ``models`` the driver's
    model cache (for cells run in this process), ``reporter`` the progress reporter, ``failures`` the
    cells recorded as failed in this session. See :func:`headlab.hookspecs.headlab_register_executors`.
    """

    def __init__(self, loaded: LoadedSpec, cells: list[Cell], *, writer: RunWriter | None,
                 create: Callable[[dict[str, Any]], RunWriter], total: int, reporter: Reporter,
                 cancel: Callable[[], bool] | None = None, on_cell: Callable[[Cell], None] | None = None,
                 executor: str = "") -> None:
        self.spec = loaded
        self.cells = list(cells)
        self.models = ModelCache(loaded.spec.seed)
        self.reporter = reporter
        self.failures: dict[str, CellFailure] = {}
        self.executor = executor
        self._writer = writer
        self._create = create
        self._total = total
        self._cancel = cancel or (lambda: False)
        self._on_cell = on_cell
        self._started = False
        self._token = uuid.uuid4().hex
        self._plugins: list[tuple[str, Any]] | None = None
        self._failed_before: set[str] = set()
        self._provenance = False

    @property
    def writer(self) -> RunWriter:
        """The run store's writer (creates the store if :meth:`start` was not called)."""
        if not self._started:
            self.start()
        assert self._writer is not None
        return self._writer

    @property
    def started(self) -> bool:
        """Whether :meth:`start` has run."""
        return self._started

    @property
    def store(self) -> str:
        """The run store's location (a local path or an fsspec URL) that workers write cells into."""
        return self.writer.location

    def start(self, model: LoadedModel | None = None) -> RunWriter:
        """Create the run store (a new run; ``model``'s provenance is recorded now, else from the first
        cell a worker reports) or reopen it (resume); start the ``cells`` progress. Called once."""
        if self._started:
            assert self._writer is not None
            return self._writer
        if self._writer is None:
            self._writer = self._create(provenance(model))
        self._failed_before = set(self._writer.failed_cells())
        self._provenance = "model_digest" in self._writer.root().attrs
        self._writer.set_attrs(status="running", executor=self.executor)
        self._started = True
        self.reporter.start("cells", self._total, f"{self.spec.spec.name}: cells")
        self.reporter.advance("cells", self._total - len(self.cells))
        return self._writer

    def task(self, cell: Cell) -> CellTask:
        """``cell`` as a worker process receives it (picklable; run it with :func:`execute_cell`)."""
        if self._plugins is None:
            self._plugins = plugins_for_workers()
        return CellTask(self.spec.data, self.spec.text, self.spec.source, cell, self.store, self._plugins,
                        self._token)

    def run_cell(self, cell: Cell) -> None:
        """Run ``cell`` in this process with the driver's models, write it and record it done. A failure
        is recorded (:meth:`cell_failed`) and re-raised; the steps completed before a step that failed (or
        was interrupted) are written as a partial cell."""
        writer = self.writer
        step: list[str | None] = [None]
        started = time.time()
        try:
            results = run_cell(self.spec, cell, self.models, self.reporter, self._cancel,
                               on_step=lambda s: step.__setitem__(0, s), store=writer.location)
            step[0] = None
            write_cell(writer, cell, results, {"started": started, "seconds": time.time() - started})
        except (Exception, KeyboardInterrupt) as e:
            if not isinstance(e, KeyboardInterrupt):
                self.cell_failed(CellFailure.from_exception(cell, step[0], e))
            _keep_completed(writer, cell, step[0], e, {"started": started, "seconds": time.time() - started})
            raise
        self._finished(cell)

    def cell_done(self, result: CellResult) -> None:
        """Record a cell a worker ran and wrote (:func:`execute_cell`) as done."""
        writer = self.writer
        if result.provenance and not self._provenance:
            writer.set_attrs(**result.provenance)
            self._provenance = True
        writer.mark_done(result.cell.name, started=result.started, seconds=result.seconds, host=result.host)
        self._finished(result.cell)

    def cell_failed(self, failure: CellFailure) -> None:
        """Record a cell as failed (after its last attempt); the run goes on with the other cells."""
        if not self.failures:
            self.reporter.start("failed", None, "failed cells")
        self.failures[failure.cell] = failure
        try:
            self.writer.record_failure(failure.cell, failure.as_dict())
        except OSError:  # a full disk: the run is still marked failed (run) and the error says where
            pass
        self.reporter.advance("failed")

    def cancelled(self) -> bool:
        """Whether the run was asked to stop (the executor then raises ``KeyboardInterrupt``)."""
        return bool(self._cancel())

    def _finished(self, cell: Cell) -> None:
        if cell.name in self._failed_before or cell.name in self.failures:
            self.writer.record_failure(cell.name, None)
            self.failures.pop(cell.name, None)
        self.reporter.advance("cells")
        if self._on_cell is not None:
            self._on_cell(cell)


def run(spec: str | Path | Mapping[str, Any] | LoadedSpec | None, *, out: str | Path | None = None,
        overrides: Mapping[str, Any] | None = None, resume: str | Path | None = None,
        reporter: Reporter | None = None, cancel: Callable[[], bool] | None = None,
        on_cell: Callable[[Cell], None] | None = None, execution: Mapping[str, Any] | None = None,
        recompute: bool = False) -> Run:
    """Run a spec (path, YAML text, mapping or loaded spec) and return the finished :class:`Run`.

    ``resume`` completes an interrupted or failed run store (its own spec is used): cells that are
    missing, unfinished, failed or damaged are computed, intact ones are kept, provided nothing they were
    computed from changed (the resolved spec, a data file, the weights: else
    :class:`headlab.inputs.InputChanged`); ``recompute=True`` computes every cell again from the current
    inputs and records them. A local store is created
    atomically, then each finished cell is written as it completes; ``on_cell`` is called after each.
    ``execution`` updates the spec's ``execution`` (``{"executor": "ray", "address": "auto"}``): which
    executor runs the cells never changes their results. A cell that fails under the ``local``
    executor raises (after it is recorded); an executor that goes on past failed cells (``ray``)
    returns a run whose ``status`` is ``"failed"`` and whose ``failed_cells`` say why.
    """
    reporter = reporter or Reporter()
    writer: RunWriter | None = None
    previous: Run | None = None
    if recompute and resume is None:
        raise ValueError("recompute=True recomputes a stored run: give resume=RUN")
    if resume is not None:
        previous = open_run(resume)
        loaded = load_spec(previous.spec_data)
        loaded.text = previous.spec_text
        writer = RunWriter(resume)
    else:
        assert spec is not None, "give a spec or resume="
        loaded = spec if isinstance(spec, LoadedSpec) else load_spec(spec)
        if overrides:
            loaded = loaded.with_overrides(overrides)
    if execution:
        loaded = loaded.with_execution(execution)
    cells = loaded.cells
    config = loaded.spec.execution
    comp = get_manager().get("executors", config.kind) if config is not None else get_manager().registry.default(
        "executors")
    if comp is None:
        raise ValueError("no executor is installed")
    check_steps(loaded)
    models = ModelCache(loaded.spec.seed, limits=loaded.spec.limits)
    first = None
    if previous is not None and comp.kind == "local" and len(cells):
        first = models.get(loaded.for_cell(cells[0]).model)  # the model whose digest the run recorded
    if previous is not None and not recompute:
        check_resume(previous.attrs, loaded.spec, str(resume), model_digest=first.digest if first else None)
    done = writer.done_cells() if writer is not None and not recompute else set()
    todo = [c for c in cells if c.name not in done]
    if comp.kind == "local":  # refuse before a store is created; every cell is checked again as it runs
        for cell in todo[:PREFLIGHT_CELLS]:
            cell_spec = loaded.for_cell(cell)
            preflight(loaded, cell_spec, models.get(cell_spec.model), cell)
        check_examples(loaded, todo[:PREFLIGHT_CELLS], models)
    if recompute and writer is not None:  # every stored cell is computed again from the current inputs
        writer.forget_cells()
        writer.set_attrs(resolved=loaded.spec.model_dump_json(by_alias=True), input_digests=input_digests(loaded.spec),
                         recomputed=now(), **(provenance(first) if first is not None else {}))

    def create(prov: dict[str, Any]) -> RunWriter:
        attrs = {
            "name": loaded.spec.name, "status": "running", "created": now(), "spec_text": loaded.text,
            "spec_source": loaded.source, "spec_data": json.dumps(loaded.data),
            "resolved": loaded.spec.model_dump_json(by_alias=True), "sweep": loaded.spec.sweep,
            "steps": [s.id for s in loaded.spec.steps], "cells_total": len(cells), "seed": loaded.spec.seed,
            "model": loaded.spec.model.name, "input_digests": input_digests(loaded.spec), **prov,
        }
        output = str(out or loaded.spec.output)
        where = f"{output.rstrip('/')}/{loaded.spec.name}-{time.strftime('%Y%m%d-%H%M%S')}"
        try:
            where = _run_dir(output, loaded.spec.name)  # looking for a free name may fail too (a name too long)
            return RunWriter.create(where, attrs)
        except (FileExistsError, NotADirectoryError):
            raise
        except OSError as e:  # no space left, read-only, a name too long: nothing was kept (creation is atomic)
            raise StoreWriteError(e.errno, f"cannot create the run store {where}: {e.strerror or e}; "
                                  f"{write_advice(e.errno, created=False)} and run again") from e

    job = Job(loaded, todo, writer=writer, create=create, total=len(cells), reporter=reporter, cancel=cancel,
              on_cell=on_cell, executor=comp.kind)
    job.models = models
    try:
        comp.impl(config if config is not None else comp.config(), job)
        job.start()
    except BaseException as e:
        if job.started:
            try:
                job.writer.set_attrs(status="failed" if job.failures else "interrupted")
            except OSError:  # the disk that made the run fail may refuse this too; the error line says so
                pass
            if hasattr(e, "add_note"):
                e.add_note(f"run store: {job.writer.path}")  # the CLI names it in its "interrupted" line
        raise
    finally:
        if job.started:
            reporter.stop("cells")
    left = len(cells) - len(job.writer.done_cells())
    job.writer.set_attrs(status="complete" if left == 0 else "failed", finished=now())
    result = open_run(job.writer.location)
    if left:
        warnings.warn(f"{left} of {len(cells)} cells of run {result.path} failed; finish them with "
                      f"`headlab run --resume {result.path}`", stacklevel=2)
    return result
