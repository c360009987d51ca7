"""The plugin contract: pluggy hook specifications.

Every hook registers components. A plugin implements a hook and calls ``register`` once per
component it provides. Built-in plugins in ``headlab.plugins`` use exactly these hooks, so a
third-party package installed with pip (entry-point group ``headlab``), or a module, class or
instance registered from a notebook cell with :func:`headlab.register_plugin`, is indistinguishable
from a built-in one. ``headlab.plugin_manager.CATEGORIES`` lists the categories, one hook each.

A component is a pydantic *config model* (a subclass of :class:`headlab.spec.ComponentConfig`
with a ``kind: Literal["name"]`` field) plus an *implementation* callable. The config model joins
the spec's discriminated union for its category, so it is validated, documented in the JSON
Schema and listed by ``headlab plugins`` like every built-in kind.

Example (a complete plugin module)::

    from typing import Literal
    import xarray as xr
    from headlab import hookimpl, ComponentConfig

    class MyDetector(ComponentConfig):
        \"\"\"Scores every head by ...\"\"\"
        kind: Literal["my_detector"] = "my_detector"
        threshold: float = 0.5

    def detect(config: MyDetector, ctx) -> xr.Dataset:
        ...

    @hookimpl
    def headlab_register_detectors(register):
        register(MyDetector, detect)

The same module, defined in a notebook cell, is registered with ``headlab.register_plugin(module)``
(or a class whose hooks take no ``self``, or an instance).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pluggy

__all__ = ["Register", "headlab_register_actions", "headlab_register_choice_metrics", "headlab_register_commands",
           "headlab_register_decoders", "headlab_register_detectors", "headlab_register_executors",
           "headlab_register_kv_policies", "headlab_register_metrics", "headlab_register_models", "headlab_register_steering",
           "headlab_register_tasks", "hookimpl", "hookspec"]

hookspec = pluggy.HookspecMarker("headlab")
hookimpl = pluggy.HookimplMarker("headlab")

Register = Callable[..., Any]


@hookspec
def headlab_register_tasks(register: Register) -> None:
    """Register task kinds: ``register(ConfigModel, build)``.

    ``build(config, ctx: headlab.TaskContext) -> list[headlab.Example]`` produces the examples a
    run works on (prompts, targets, choices, marked spans). ``ctx`` carries the tokenizer and seed.
    """


@hookspec
def headlab_register_detectors(register: Register) -> None:
    """Register detector kinds: ``register(ConfigModel, detect)``.

    ``detect(config, ctx: headlab.StepContext) -> xarray.Dataset`` scores heads. The dataset has a
    variable ``score`` with dims ``("layer", "head")`` and may add per-example variables with an
    ``example`` dim. A later step can select heads from it with ``heads: {from: <step id>, top: k}``.
    """


@hookspec
def headlab_register_steering(register: Register) -> None:
    """Register steering method kinds: ``register(ConfigModel, steer)``.

    ``steer(config, ctx: headlab.StepContext, batch: headlab.generation.Batch, plan) -> report | None``
    adds edits for the rows of ``batch`` to the instrumentation ``plan`` (a
    :class:`headlab.instrument.Plan`) before generation starts. A method that decides something during
    generation (VHR picks its heads at the first step) may return ``report``: a callable that, once the
    batch is generated, returns ``{name: xarray.DataArray}`` with ``example`` (the batch's rows) as first
    dimension; a ``generate`` step stores them over all its examples.
    """


@hookspec
def headlab_register_decoders(register: Register) -> None:
    """Register decoding strategy kinds: ``register(ConfigModel, decode)``.

    ``decode(config, request: headlab.generation.DecodeRequest) -> headlab.generation.Decoded``
    generates continuations for a batch of prompts (the request carries the model, the tokenized
    batch, the steering plan, ``max_new_tokens``, stop strings, the seed and the step context).

    ``register(ConfigModel, decode, default=True)`` makes the kind the default decoder: the one a
    ``generate`` or ``score`` step without ``decode`` uses (the built-in default is ``greedy``). At most
    one plugin registers the default (any ``register(Config, impl)`` hook accepts ``default=True``;
    an action reads it with :meth:`headlab.spec.SpecTypes.default`).

    A decoder that can also score choices (the ``score`` action) registers its scorer with it:
    ``register(ConfigModel, decode, score=score)`` with ``score(config, request:
    headlab.generation.ScoreRequest) -> headlab.generation.Scored`` (one summed score per row, a row
    being an example's prompt followed by one of its choices).
    """


@hookspec
def headlab_register_metrics(register: Register) -> None:
    """Register metric kinds: ``register(ConfigModel, compute)``.

    ``compute(config, examples: list[headlab.Example], outputs: list[str]) -> numpy.ndarray`` returns
    one float per example; the run summary shows the mean. A ``generate`` step lists them in
    ``metrics:`` (a bare kind or a mapping with options).

    A metric whose step-level numbers are not means of per-example values (precision, F1, a ratio of
    sums) registers them too: ``register(ConfigModel, compute, aggregate=aggregate)`` with
    ``aggregate(config, examples, outputs, values: numpy.ndarray) -> Mapping[str, float]`` (``values``:
    what ``compute`` returned). Each ``name`` (an identifier) is stored as the variable
    ``<kind>_<name>`` without the ``example`` dimension, next to the per-example ``<kind>``, and listed
    with the step's metrics; :func:`headlab.scoring.metric_values` computes both.
    """


@hookspec
def headlab_register_choice_metrics(register: Register) -> None:
    """Register multiple-choice metric kinds: ``register(ConfigModel, compute)``.

    ``compute(config, examples: list[headlab.Example], scores: numpy.ndarray) -> numpy.ndarray`` returns
    one float per example from the ``(example, choice)`` scores of a ``score`` step (NaN beyond an
    example's choices; the true choices are ``meta["labels"]``, else ``label``). A ``score`` step lists
    them in ``metrics:`` (default: TruthfulQA's ``mc1``, ``mc2``, ``mc3`` and ``accuracy``); the run
    summary shows the mean.
    """


@hookspec
def headlab_register_actions(register: Register) -> None:
    """Register step actions: ``register(name, config, run, description="")``.

    A step holds exactly one action, under its name (``{id: s, <name>: <config>}``). ``run(config,
    ctx: headlab.StepContext) -> xarray.Dataset`` executes it (``ctx.examples``, ``ctx.model``,
    ``ctx.results`` of earlier steps); the runner merges the examples' inputs into the dataset, adds the
    attributes ``step``, ``action``, ``task``, ``config`` and ``model``, and stores it.
    ``description`` documents the step key in the JSON Schema.

    ``config`` is the type of the step key's value: a pydantic model (e.g. a
    :class:`headlab.spec.StrictModel` subclass), or a *builder* ``config(types:
    headlab.spec.SpecTypes) -> type`` called each time the spec model is built, for a config that holds
    components: ``types.union("decoders")`` is the union of every registered decoder kind then,
    ``types.default("decoders")`` the default decoder's config model. The built-ins ``detect``,
    ``generate`` and ``score`` (``headlab.plugins.actions``) are registered this way. Example::

        from pydantic import Field
        import xarray as xr
        from headlab import component, hookimpl
        from headlab.spec import StrictModel

        def patch_config(types):
            class Patch(StrictModel):
                \"\"\"Patch heads, then decode.\"\"\"
                decode: types.union("decoders") = Field(default_factory=types.default("decoders"))
                scale: float = 0.0
            return Patch

        def patch(config, ctx) -> xr.Dataset:
            decoder = component("decoders", config.decode.kind)
            ...

        @hookimpl
        def headlab_register_actions(register):
            register("patch", patch_config, patch, description="patch heads, then decode")

    Action names are identifiers, unique across plugins; ``id``, ``task`` and ``action`` are reserved.
    """


@hookspec
def headlab_register_models(register: Register) -> None:
    """Register named models: ``register(name, load, description="")``.

    ``load(spec: headlab.spec.ModelSpec) -> headlab.model.LoadedModel``. A spec whose ``model`` is
    ``name`` is loaded by ``load`` instead of the Hugging Face loader.

    ``register(name, load, description, default=True)`` makes it the default model: the one a spec
    without ``model`` (or a :class:`headlab.spec.ModelSpec` without ``id``, ``path`` or ``config``)
    loads. At most one plugin registers the default; the built-in one is the embedded ``headlab-tiny``.
    """


@hookspec
def headlab_register_executors(register: Register) -> None:
    """Register executor kinds: ``register(ConfigModel, execute, default=False)``.

    An executor decides where and in what order a run's sweep cells run; the spec names it under
    ``execution: {executor: <kind>, ...options}`` (the config model's ``kind`` field is declared with
    ``alias="executor"``: ``kind: Literal["slurm"] = Field("slurm", alias="executor")``). The built-ins
    are ``local`` (the default: cells one after another in this process) and ``ray`` (each cell a task
    on a Ray cluster).

    ``execute(config, job: headlab.runner.Job) -> None`` runs ``job.cells`` (the cells not yet done) and
    returns when each is done or recorded as failed. The runner has created or reopened nothing yet:
    the executor calls ``job.start(model)`` once (``model``: a :class:`headlab.model.LoadedModel` the
    driver loaded, for the run's provenance, or None), then either runs a cell in this process with
    ``job.run_cell(cell)``, or sends ``job.task(cell)`` (a picklable :class:`headlab.runner.CellTask`) to
    a worker process that calls :func:`headlab.runner.execute_cell` and reports back, on the driver,
    ``job.cell_done(result)`` or ``job.cell_failed(failure)``. Workers write each finished cell into
    its own group of the run's store; the driver alone records completion, so a cell is read as
    finished only once ``job.cell_done`` ran. ``job.cancelled()`` tells when to stop (raise
    ``KeyboardInterrupt``).
    """


@hookspec
def headlab_register_kv_policies(register: Register) -> None:
    """Register KV-cache policy kinds: ``register(ConfigModel, compile)``.

    ``compile(config, ctx: headlab.StepContext) -> headlab.kv.HeadMap`` decides, per ``(layer, kv_head)``,
    which key/value heads keep their whole cache and how many sink and recent tokens the others keep, and
    whether they also keep a compensation token (the built-ins ``full``, ``streaming``, ``razor`` and
    ``random`` live in ``headlab.plugins.kv``). Heads come from
    ``ctx.results`` and the model's geometry (``headlab.kv.kv_heads`` resolves any head selection into KV
    heads); a :class:`headlab.kv.HeadwiseCache` holds a cache laid out by the map.
    """


@hookspec
def headlab_register_commands(app: Any, run_spec: Callable[..., Any]) -> None:
    """Add commands to the ``headlab`` command line (as ``llm``'s ``register_commands``).

    ``app`` is the command line's ``typer.Typer``: ``@app.command("atlas")`` adds ``headlab atlas``. Called once
    when the command line is built, for a command that is not one of headlab's own (and for ``headlab --help``),
    so ``headlab run`` loads no plugin's commands. ``run_spec(spec, out=None) -> headlab.Run`` runs a spec (a
    path, YAML text or a mapping) as ``headlab run`` does: progress on stderr, Ctrl-C stores the finished cells,
    the summary table and the run's location printed, exit code 1 when a cell failed. A command reports bad input
    by raising ``ValueError`` or :class:`headlab.SpecError` (one line, exit 2), never with ``sys.exit``. Example::

        import typer
        from headlab import hookimpl

        @hookimpl
        def headlab_register_commands(app, run_spec):
            @app.command("hello")
            def hello(name: str = typer.Argument("world")) -> None:
                \"\"\"Say hello.\"\"\"
                typer.echo(f"hello {name}")
    """
