"""Log-probabilities and generations under a steering and decoding config, without a spec.

:func:`logprobs` scores continuations (or whole texts) and :func:`generate` decodes, both through the
same components a spec step uses: the registered decoding strategies (their scorer, or their
``decode``), the steering methods (their edits in a :class:`headlab.instrument.Plan`), headlab's
batching and KV cache. Notebooks, widgets and the lm-evaluation-harness adapter
(:mod:`headlab.lm_eval`) share them::

    >>> import headlab
    >>> s = headlab.logprobs("headlab-tiny", ["Question: What is the capital of France? Answer:"],
    ...                      [" Paris"], decode={"kind": "dola", "layers": "high"})   # doctest: +SKIP
    >>> s.logprobs, s.tokens, s.greedy                                                  # doctest: +SKIP

Configs are given as in a spec (mappings with ``kind``, a bare kind name for a decoder) or as config
objects; ``heads: {from: <step>}`` resolves against ``results`` (a run's ``results``, or ``{"retrieval":
dataset}``).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import xarray as xr
from pydantic import TypeAdapter, ValidationError

from .context import Example, StepContext, TaskContext
from .errors import ContractError
from .generation import Batch, Decoded, DecodeRequest, Scored, ScoreRequest, continuation_batch, tokenize
from .instrument import Plan
from .model import LoadedModel, embedding_rows, load_model
from .plugin_manager import get_manager
from .spec import ComponentConfig, ModelSpec, SpecTypes
from .summary import UNDEFINED_ATTR

__all__ = ["EXAMPLE_FIELDS", "as_model", "build_examples", "component", "declared_fields", "field_label",
           "fitting_tasks", "generate", "has_field", "logprobs", "metric_values", "required_fields", "requirement_message",
           "steering_plan", "unmet_by_examples", "unmet_by_task"]

Text = str | Example | Sequence[int]


def as_model(model: Any, seed: int = 0) -> LoadedModel:
    """A :class:`~headlab.model.LoadedModel`: ``model`` itself, or loaded from a model spec (a registered
    name such as ``headlab-tiny``, a local checkpoint directory, a hub id, a mapping such as ``{path: ...}``
    or ``{config: {...}}``, or a :class:`~headlab.spec.ModelSpec`)."""
    if isinstance(model, LoadedModel):
        return model

    if isinstance(model, ModelSpec):
        spec = model
    elif isinstance(model, str):
        spec = ModelSpec(id=model)
    elif isinstance(model, Mapping):
        spec = ModelSpec.model_validate(dict(model))
    else:
        raise TypeError(f"model: a LoadedModel or a model spec (name, path, mapping), not {type(model).__name__}")
    return load_model(spec, seed)


def component(category: str, value: Any) -> Any:
    """A component config of ``category`` (``decoders``, ``steering``, ...) validated as in a spec: a config
    object is returned as it is, a mapping is validated against the registered kinds, a bare string is
    the kind with its defaults. ``None`` is the category's default (the default decoder), or an error."""
    registry = get_manager().registry
    if isinstance(value, ComponentConfig):
        return value
    if value is None:
        default = registry.default(category)
        if default is None:
            raise ValueError(f"no {category} config given, and no default is registered")
        return default.config()
    if isinstance(value, str):
        value = {"kind": value}
    try:
        return TypeAdapter(SpecTypes(registry).union(category)).validate_python(dict(value))
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(p) for p in err["loc"] if not str(p).startswith(("function-", "tagged-union")))
        raise ValueError(f"{category} config {dict(value)!r}: {where + ': ' if where else ''}{err['msg']}") from None


def build_examples(task: Any, lm: LoadedModel, seed: int) -> list[Example]:
    """The examples of a task config (``task.kind`` a registered task), built by its plugin for ``lm``'s
    tokenizer and vocabulary as a run builds a step's task; an empty task, an example whose prompt is empty
    (no text but whitespace, no token ids, no image), or whose token ids are not rows of the model's input
    embedding, is a ``ValueError`` naming the example."""

    comp = get_manager().get("tasks", task.kind)
    vocab = int(getattr(lm.model.config.get_text_config(), "vocab_size", 0) or 0)
    examples = comp.impl(task, TaskContext(tokenizer=lm.tokenizer, seed=seed, vocab_size=vocab))
    if not examples:
        raise ValueError(f"task '{task.kind}' produced no examples")
    rows = embedding_rows(lm.model)
    for i, ex in enumerate(examples):
        row = ex.meta.get("row") if isinstance(ex.meta, dict) else None
        where = f"example {i}" + (f" (data row {row})" if row is not None else "")
        if ex.input_ids is not None and len(ex.input_ids) and rows is not None:
            bad = next((int(t) for t in ex.input_ids if not 0 <= int(t) < rows), None)
            if bad is not None:
                raise ValueError(f"task '{task.kind}' {where} has token id {bad:,}, but the model's input embedding "
                                 f"has {rows:,} rows (ids 0 to {rows - 1:,}), so the forward would fail; give the "
                                 "task ids of this model's vocabulary (or a model whose vocab_size covers them)")
        if not ex.images and (len(ex.input_ids) == 0 if ex.input_ids is not None else not ex.prompt.strip()):
            raise ValueError(f"task '{task.kind}' {where} has an empty prompt: a score or a generation would be "
                             "conditioned on nothing and averaged in with the others; fix the row (or the template "
                             "that renders it empty)")
        for name, text in (("prompt", ex.prompt), ("target", ex.target), *((f"choice {j}", c) for j, c in
                                                                          enumerate(ex.choices or ()))):
            found = _long_word(text) if isinstance(text, str) else None
            if found is not None:
                raise ValueError(f"task '{task.kind}': example {i}'s {name} has a word of {found[1]:,} characters "
                                 f"without whitespace (from character {found[0] + 1:,}), over the {MAX_WORD_CHARS:,} a "
                                 "tokenizer is given at once (a longer one can abort the process); break it with "
                                 "spaces or newlines")
    return examples


EXAMPLE_FIELDS = ("target", "choices", "label", "spans", "input_ids", "images")
"""The fields of an :class:`~headlab.Example` a component may declare it reads (``requires()``) or a task that
it gives (``example_fields()``), besides ``meta.<key>`` for a key of ``Example.meta``."""


def has_field(example: Example, name: str) -> bool:
    """Whether ``example`` has the field ``name`` (one of :data:`EXAMPLE_FIELDS` or ``meta.<key>``): set, and
    not an empty text, list or mapping (``target`` and ``label``: not None)."""
    if name.startswith("meta."):
        meta = example.meta if isinstance(example.meta, Mapping) else {}
        value = meta.get(name[len("meta."):])
        return value is not None and not (isinstance(value, (str, list, tuple, dict)) and len(value) == 0)
    if name in ("target", "label"):
        return getattr(example, name, None) is not None
    value = getattr(example, name, None)
    return value is not None and len(value) > 0


def field_label(name: str) -> str:
    """How a line names an example field: ``meta['answer']``, ``target``."""
    return f"meta['{name[len('meta.'):]}']" if name.startswith("meta.") else name


def required_fields(config: Any) -> list[tuple[str, ...]]:
    """The example fields a component config declares it reads, through its optional ``requires()`` method:
    one tuple per need, holding the fields of which any one will do (``[("meta.answers", "meta.answer",
    "target")]``). ``[]`` for a config that declares nothing (it is not checked)."""
    declare = getattr(config, "requires", None)
    if not callable(declare):
        return []
    out = []
    for need in declare() or ():
        group = (need,) if isinstance(need, str) else tuple(str(n) for n in need)
        if group:
            out.append(group)
    return out


def declared_fields(task: Any) -> frozenset[str] | None:
    """The fields a task config says its examples can have (its optional ``example_fields()`` method), or None
    when it does not say."""
    declare = getattr(task, "example_fields", None)
    if not callable(declare):
        return None
    return frozenset(declare())


def unmet_by_task(config: Any, fields: frozenset[str]) -> tuple[str, ...] | None:
    """The first need of ``config`` (:func:`required_fields`) none of whose fields is among ``fields``."""
    return next((group for group in required_fields(config) if not fields & set(group)), None)


def unmet_by_examples(config: Any, examples: Sequence[Example]) -> tuple[tuple[str, ...], list[int]] | None:
    """The first need of ``config`` that some of ``examples`` lack (none of its fields :func:`has_field`), with
    the indices of the examples that lack it; None when every example has what the config reads."""
    for group in required_fields(config):
        lacking = [i for i, ex in enumerate(examples) if not any(has_field(ex, f) for f in group)]
        if lacking:
            return group, lacking
    return None


def fitting_tasks(config: Any) -> list[str]:
    """The registered task kinds whose declared fields (:func:`declared_fields`, for the task's defaults) meet
    every need of ``config``: first those that give the first field of every need (the one the component reads
    first), then the others, each by name."""

    out = []
    for kind, comp in get_manager().components["tasks"].items():
        try:
            fields = declared_fields(comp.config.model_construct())
        except Exception:  # noqa: BLE001 - a task that cannot say without its options is not listed
            continue
        needs = required_fields(config)
        if fields is not None and all(fields & set(group) for group in needs):
            out.append((not all(group[0] in fields for group in needs), kind))
    return [kind for _, kind in sorted(out)]


MAX_LISTED_TASKS = 6
"""Task kinds a requirement line lists by name (the rest are counted)."""


def requirement_message(config: Any, group: tuple[str, ...], lacks: str, category: str = "metric") -> str:
    """The line saying that ``config`` (a component of ``category``) reads a field of ``group`` that ``lacks``
    (``"task 'niah' does not give"``) and which tasks give it: ``metric 'context_memory' reads
    meta['context_answer'] (or meta['context_answers']), which task 'niah' does not give; context_memory
    fits counterfact, memotrap, nq_swap, or csv/jsonl with meta: [context_answer, memory_answer]``."""

    first, *others = [field_label(f) for f in group]
    alternatives = f" (or {', '.join(others)})" if others else ""
    needs = required_fields(config)
    tasks = fitting_tasks(config)
    named = ", ".join(tasks[:MAX_LISTED_TASKS]) + (f" and {len(tasks) - MAX_LISTED_TASKS} more"
                                                   if len(tasks) > MAX_LISTED_TASKS else "")
    files = sorted(kind for kind, comp in get_manager().components["tasks"].items()
                   if {"meta", "target"} <= set(getattr(comp.config, "model_fields", {})))
    options = []
    if any("target" in g for g in needs):
        options.append("a target: template")
    meta = [g[0][len("meta."):] for g in needs if "target" not in g and g[0].startswith("meta.")]
    if meta:
        options.append(f"meta: [{', '.join(meta)}]")
    ways = [named] if named else []
    if files and options and all("target" in g or g[0].startswith("meta.") for g in needs):
        ways.append(f"{'/'.join(files)} with {' and '.join(options)}")
    fix = f"{config.kind} fits {', or '.join(ways)}" if ways else f"give {config.kind} a task whose examples have it"
    return f"{category} '{config.kind}' reads {first}{alternatives}, which {lacks}; {fix}"


MAX_WORD_CHARS = 100_000
"""The longest run of non-whitespace characters a task's example may hold (a fast tokenizer's pre-tokenizer
works on one such run at a time; one of megabytes can abort the process)."""


def _long_word(text: str) -> tuple[int, int] | None:
    """``(offset, length)`` of the first run of non-whitespace characters longer than :data:`MAX_WORD_CHARS`."""
    if len(text) <= MAX_WORD_CHARS:
        return None
    for m in re.finditer(r"\S+", text):
        if m.end() - m.start() > MAX_WORD_CHARS:
            return m.start(), m.end() - m.start()
    return None


def metric_values(config: Any, examples: Sequence[Example], outputs: Sequence[str]) -> dict[str, Any]:
    """What a step stores for the metric ``config`` (a metric config, a mapping with ``kind`` or a bare kind)
    on ``outputs`` of ``examples``: ``{kind: per-example values over "example"}`` and, for a metric
    registered with ``aggregate=``, ``{f"{kind}_{name}": value}`` for each of its step-level aggregates
    (0-d, without the ``example`` dimension). All are ``xarray.DataArray`` of floats, in that order. A metric
    whose config class declares ``undefined_when`` (a ``ClassVar[str]``: when its value is NaN) has that text in
    the per-example array's attrs, where :func:`headlab.summary.estimate`'s callers find the reason for a drop.

    A metric raising ``TypeError``/``ValueError`` or returning something other than one number per example,
    or an aggregate that is not a mapping of identifiers to numbers, is a :class:`headlab.errors.ContractError`
    naming the metric (as the ``generate`` action reports it)."""



    config = component("metrics", config)
    kind = config.kind
    comp = get_manager().get("metrics", kind)
    examples, outputs = list(examples), list(outputs)
    try:
        values = np.asarray(comp.impl(config, examples, outputs), dtype=float)
    except (TypeError, ValueError) as e:
        raise ContractError(f"the metric returned no numbers ({e})", category="metrics", kind=kind) from e
    if values.shape != (len(examples),):
        raise ContractError(f"the metric returned shape {values.shape}, not one number per example",
                            category="metrics", kind=kind)
    per_example = xr.DataArray(values, dims="example")
    reason = getattr(type(config), UNDEFINED_ATTR, None)
    if isinstance(reason, str) and reason:  # the metric's words for a NaN value (headlab.summary reports it)
        per_example.attrs[UNDEFINED_ATTR] = reason
    out: dict[str, Any] = {kind: per_example}
    if comp.aggregate is None:
        return out
    result = comp.aggregate(config, examples, outputs, values)
    if not isinstance(result, Mapping):
        raise ContractError(f"the metric's aggregate returned {type(result).__name__}, not a mapping of names to "
                            "numbers", category="metrics", kind=kind)
    for name, value in result.items():
        if not (isinstance(name, str) and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name)):
            raise ContractError(f"the metric's aggregate name {name!r} is not an identifier", category="metrics",
                                kind=kind)
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise ContractError(f"the metric's aggregate {name!r} is {value!r}, not a number", category="metrics",
                                kind=kind) from None
        out[f"{kind}_{name}"] = xr.DataArray(number)
    return out


def steering_plan(steer: Sequence[Any], ctx: StepContext, batch: Batch) -> tuple[Any, list[Callable[[], Any]]]:
    """The instrumentation plan of the steering configs ``steer`` for ``batch`` (None without any), and the
    reports they returned (called once the batch is generated). Each method adds its edits in turn, as in
    a ``generate`` or ``score`` step."""
    if not steer:
        return None, []

    mgr = get_manager()
    plan = Plan()
    reports = []
    for cfg in steer:
        report = mgr.get("steering", cfg.kind).impl(cfg, ctx, batch, plan)
        if callable(report):
            reports.append(report)
    return plan, reports


def _context(lm: LoadedModel, ctx: StepContext | None, results: Mapping[str, Any] | None, seed: int,
             examples: list[Example]) -> StepContext:
    if ctx is not None:
        return dataclasses.replace(ctx, model=lm, examples=examples)
    return StepContext(model=lm, examples=examples, results=dict(results or {}), seed=seed)


def _example(item: Text) -> Example:
    if isinstance(item, Example):
        return item
    if isinstance(item, str):
        return Example(prompt=item)
    return Example(prompt="", input_ids=[int(t) for t in item])


def _whole_text(lm: LoadedModel, item: Text) -> tuple[Example, list[int]]:
    """A text scored as a whole: its first token is the context, the rest the continuation."""
    ex = _example(item)
    if ex.input_ids is not None:
        ids = list(ex.input_ids)
    elif lm.tokenizer is None:
        raise ValueError("scoring text needs a tokenizer (the model has none); give token ids")
    else:
        ids = list(lm.tokenizer(ex.prompt, add_special_tokens=True)["input_ids"])
    if len(ids) < 2:
        raise ValueError(f"a text scored as a whole needs at least 2 tokens (its first is the context): {ex.prompt!r}")
    return Example(prompt=ex.prompt, input_ids=ids[:1], meta=ex.meta), ids[1:]


def logprobs(model: Any, prompts: Sequence[Text], continuations: Sequence[str | Sequence[int]] | None = None, *,
             steer: Sequence[Any] = (), decode: Any = None, batch_size: int = 8, seed: int = 0,
             results: Mapping[str, Any] | None = None, ctx: StepContext | None = None) -> Scored:
    """Score ``continuations[i]`` after ``prompts[i]`` under a decoding strategy and steering methods.

    - ``model``: a loaded model or a model spec (see :func:`as_model`).
    - ``prompts``: texts, :class:`~headlab.Example` objects (their ``spans`` steer: PASTA's ``emphasis``) or
      token-id lists. ``continuations``: one per prompt, text or token ids; the continuation's tokens are
      those of ``prompt + continuation`` after the prompt's own (as lm-evaluation-harness and the DoLa /
      DeCoRe reference code split them), or the given ids. ``None`` scores each prompt as a whole: every
      token after its first (BOS, for tokenizers that add one) given those before it.
    - ``decode``: the strategy (``{kind: dola, ...}``, ``"dola"``, a config object; default: the default
      decoder, ``greedy``: the model's log-likelihood); its registered scorer defines the per-token score
      (docs/decoding.md, "Scoring"). ``steer``: steering configs applied together (their edits never touch
      the continuation's own keys; see :meth:`headlab.generation.Batch.prompt_span`).
    - ``results`` (step id -> dataset) resolves ``heads: {from: step}``; ``ctx`` (a step's context) gives
      results, seed and progress at once. ``batch_size``: rows per forward (rows are sorted by length).

    Returns :class:`~headlab.generation.Scored`: ``logprobs[i]`` the summed score of row ``i``'s
    continuation, ``tokens[i]`` its per-token scores, ``greedy[i]`` whether every continuation token is the
    strategy's top-scoring token at its position (lm-evaluation-harness's ``is_greedy``).
    """
    lm = as_model(model, seed)
    decoder_cfg = component("decoders", decode)
    steer_cfgs = [component("steering", s) for s in steer]

    scorer = get_manager().get("decoders", decoder_cfg.kind).score
    if scorer is None:
        raise ValueError(f"decoder '{decoder_cfg.kind}' does not support scoring (it was registered without `score=`)")
    if continuations is None:
        pairs = [_whole_text(lm, p) for p in prompts]
    else:
        if len(continuations) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(continuations)} continuations")
        pairs = [(_example(p), c if isinstance(c, str) else [int(t) for t in c])
                 for p, c in zip(prompts, continuations, strict=True)]
    tok = lm.tokenizer

    def size(pair: tuple[Example, Any]) -> int:
        ex, cont = pair
        n = len(ex.input_ids) if ex.input_ids is not None else len(ex.prompt)
        return n + len(cont)

    order = sorted(range(len(pairs)), key=lambda i: -size(pairs[i]))
    out_lp: list[float] = [0.0] * len(pairs)
    out_tok: list[list[float]] = [[] for _ in pairs]
    out_greedy: list[bool] = [False] * len(pairs)
    seed = ctx.seed if ctx is not None else seed
    chunks = [order[i: i + batch_size] for i in range(0, len(order), batch_size)]
    step = _context(lm, ctx, results, seed, [pairs[i][0] for i in order])
    for chunk in (step.progress(chunks, "scoring") if ctx is not None else chunks):
        rows = [pairs[i] for i in chunk]
        batch, n_tokens = continuation_batch(lm, rows)
        conts = [c if isinstance(c, str) else (tok.decode(c) if tok is not None else " ".join(map(str, c)))
                 for _, c in rows]
        sources = [ex for ex, _ in rows]
        step_ctx = _context(lm, ctx, results, seed, sources)
        plan, _ = steering_plan(steer_cfgs, step_ctx, batch)
        scored = scorer(decoder_cfg, ScoreRequest(lm, batch, n_tokens, sources, conts, plan, seed, step_ctx))
        greedy = scored.greedy or [False] * len(chunk)
        for j, i in enumerate(chunk):
            out_lp[i] = float(scored.logprobs[j])
            out_tok[i] = list(scored.tokens[j]) if scored.tokens else []
            out_greedy[i] = bool(greedy[j])
    return Scored(out_lp, out_tok, out_greedy)


def generate(model: Any, prompts: Sequence[str | Example], *, steer: Sequence[Any] = (), decode: Any = None,
             max_new_tokens: int = 16, stop: Sequence[str] = (), batch_size: int = 8, seed: int = 0,
             results: Mapping[str, Any] | None = None, ctx: StepContext | None = None) -> Decoded:
    """Generate a continuation of every prompt with a decoding strategy and steering methods.

    Arguments as :func:`logprobs` (prompts are texts or :class:`~headlab.Example` objects), plus
    ``max_new_tokens`` and ``stop`` strings (a prompt stops at EOS or at a stop string; its text is cut at
    the first one). Prompts run in batches of ``batch_size``, in order, through headlab's KV-cache loop
    (:func:`headlab.generation.decode_loop`), as in a ``generate`` step.

    Returns :class:`~headlab.generation.Decoded` over all prompts: ``tokens`` (up to EOS), ``texts``, and
    ``info["batches"]``: each batch's own ``Decoded.info`` (the strategy's diagnostics).
    """
    lm = as_model(model, seed)
    decoder_cfg = component("decoders", decode)
    steer_cfgs = [component("steering", s) for s in steer]

    impl = get_manager().get("decoders", decoder_cfg.kind).impl
    examples = [_example(p) for p in prompts]
    seed = ctx.seed if ctx is not None else seed
    tokens: list[list[int]] = []
    texts: list[str] = []
    infos: list[dict[str, Any]] = []
    chunks = [examples[i: i + batch_size] for i in range(0, len(examples), batch_size)]
    step = _context(lm, ctx, results, seed, examples)
    for chunk in (step.progress(chunks, "generating") if ctx is not None else chunks):
        batch = tokenize(lm, chunk)
        step_ctx = _context(lm, ctx, results, seed, chunk)
        plan, _ = steering_plan(steer_cfgs, step_ctx, batch)
        decoded = impl(decoder_cfg, DecodeRequest(lm, batch, max_new_tokens, list(stop), plan, seed, step_ctx))
        tokens.extend(decoded.tokens)
        texts.extend(decoded.texts)
        infos.append(decoded.info)
    return Decoded(tokens, texts, {"batches": infos})
