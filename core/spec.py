"""The spec DSL: pydantic models for experiment files, their JSON Schema, and located errors.

A spec is YAML (loaded safely: no tags, no duplicate keys, never any code) validated by one
pydantic model. Plugin config models join discriminated unions keyed by ``kind`` when the model is
built, so third-party kinds are validated and documented exactly like built-ins.

Example::

    name: quickstart
    model: headlab-tiny
    task: {kind: repeated_tokens, n: 8, length: 24}
    steps:
      - id: induction
        detect: {kind: induction}
    sweep:
      task.length: [16, 32]
"""

from __future__ import annotations

import copy
import difflib
import functools
import io
import itertools
import json
import math
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, Optional, Union, get_origin, overload

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    create_model,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

if TYPE_CHECKING:
    from .plugin_manager import Registry

DEFAULT_MODEL = "headlab-tiny"

# Limits on what a spec may be: YAML is parsed within them, so a hostile file fails fast with one line.
MAX_SPEC_CHARS = 65_536
"""Longest spec text (characters); data belongs in a task's data file, not in the spec. (The YAML parser
that locates errors reads about 30 KB a second, so this also bounds the time to load a spec.)"""
MAX_DEPTH = 64
"""Deepest nesting of mappings and lists (aliases included)."""
MAX_NODES = 50_000
"""Most values (mapping/list entries and scalars) a spec may hold once its YAML aliases are expanded."""
MAX_CELLS = 1_000_000
"""Most cells a sweep may have (the product of the numbers of values of its keys)."""
MAX_SWEEP_VALUES = 10_000
"""Most values one sweep key may have (each is validated)."""

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"
"""A spec ``name``: it names the run directory, so a safe file name (no '/', not '.' or '..')."""
NAME_MAX = 100
ID_PATTERN = r"^[A-Za-z_][A-Za-z0-9_-]*$"
"""A step ``id``: it names a group of the run store and is the first part of dotted sweep paths."""
ID_MAX = 64
MAX_INT = 2**31 - 1
"""Largest count or length a spec field takes (:data:`PositiveInt`, :data:`NonNegativeInt`); anything larger
is never a real experiment, and the resource guard refuses much smaller values that do not fit."""
MAX_SEED = 2**32 - 1
"""Largest seed (:data:`Seed`): the range every seeded library accepts (numpy's legacy seeds are 32-bit)."""
MAX_YAML_INT = 2**63 - 1
"""Largest integer (in absolute value) a spec's YAML may hold: past it no tensor or C library can take it."""

_PATTERN_HELP = {
    NAME_PATTERN: "a name may hold only letters, digits, '.', '_' and '-', starting with a letter or digit "
                  "(it names the run directory)",
    ID_PATTERN: "a step id may hold only letters, digits, '_' and '-', starting with a letter or '_'",
}


class SpecError(Exception):
    """A spec problem, located: ``file:line:col: key.path: message``. One line, no traceback."""

    def __init__(self, message: str, *, source: str = "<spec>", line: int | None = None,
                 col: int | None = None, path: str = "") -> None:
        self.message, self.source, self.line, self.col, self.path = message, source, line, col, path
        super().__init__(str(self))

    def __str__(self) -> str:
        where = self.source
        if self.line is not None:
            where += f":{self.line}:{self.col or 1}"
        return f"{where}: {self.path + ': ' if self.path else ''}{self.message}"


def _suggest(word: str, options: Iterable[str]) -> str:
    match = difflib.get_close_matches(str(word), list(options), n=1, cutoff=0.6)
    return f" (did you mean '{match[0]}'?)" if match else ""


# --- shared field types: every built-in config uses them, so bounds hold by construction ---------------

PositiveInt = Annotated[int, Field(ge=1, le=MAX_INT)]
"""A count or length: 1 .. :data:`MAX_INT` (``n``, ``length``, ``max_new_tokens``, ``batch_size``, ``top``)."""
NonNegativeInt = Annotated[int, Field(ge=0, le=MAX_INT)]
"""A count that may be zero, or an index: 0 .. :data:`MAX_INT` (``distractors``, a layer, a token id)."""
Seed = Annotated[int, Field(ge=0, le=MAX_SEED)]
"""A seed or a seed offset: 0 .. :data:`MAX_SEED`."""
FiniteFloat = Annotated[float, Field(allow_inf_nan=False)]
"""Any finite number (NaN and infinities are refused; every float of a :class:`StrictModel` is finite anyway)."""
PositiveFloat = Annotated[float, Field(gt=0, allow_inf_nan=False)]
"""A finite number > 0 (factors, temperatures, scales)."""
NonNegativeFloat = Annotated[float, Field(ge=0, allow_inf_nan=False)]
"""A finite number >= 0 (weights, slack fractions)."""
Probability = Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)]
"""A finite number in [0, 1] (probabilities, fractions, recall thresholds)."""
NonEmptyStr = Annotated[str, Field(min_length=1)]
"""A string of at least one character (stop strings, span names: an empty one would match everywhere)."""


class StrictModel(BaseModel):
    """Base of every spec model: unknown keys are errors with a "did you mean" suggestion, and every float
    field is finite (NaN and infinities are refused, in third-party configs too)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _reject_unknown_keys(cls, data: Any) -> Any:
        if isinstance(data, Mapping):
            known = set(cls.model_fields)
            known |= {f.alias for f in cls.model_fields.values() if f.alias}
            for key in data:
                if key not in known:
                    raise PydanticCustomError(
                        "unknown_key", "unknown key '{key}'{hint}",
                        {"key": str(key), "hint": _suggest(key, sorted(known))},
                    )
        return data


class ComponentConfig(StrictModel):
    """Base of plugin config models. Subclasses declare ``kind: Literal["name"] = "name"``."""

    kind: str

    @classmethod
    def kind_name(cls) -> str:
        """The literal ``kind`` this config model is registered under."""
        return cls.model_fields["kind"].default


# --- head selections -----------------------------------------------------------------------------

class HeadsFrom(StrictModel):
    """Heads taken from an earlier step's ``score``: the ``top`` highest, or all above ``threshold``."""

    from_: str = Field(alias="from", description="id of an earlier step whose result has a `score`")
    top: PositiveInt | None = Field(None, description="take the k highest-scoring heads (at most the model's heads)")
    threshold: FiniteFloat | None = Field(None, description="take heads whose score is >= threshold")
    random: bool = Field(False, description="draw the same number of heads at random instead (control)")
    match_layers: bool = Field(False, description="random: as many heads per layer as the selection has")
    seed: Seed | None = Field(None, description="random: offset added to the run seed, so that several controls "
                             "in one cell draw different heads")

    @model_validator(mode="after")
    def _one_rule(self) -> HeadsFrom:
        if self.top is None and self.threshold is None:
            raise ValueError("give `top` or `threshold`")
        if (self.match_layers or self.seed is not None) and not self.random:
            raise ValueError("`match_layers` and `seed` shape a random draw: add `random: true`")
        return self


class HeadsFile(StrictModel):
    """Heads from a JSON file: retrieval-head format ``{"<layer>-<head>": [scores]}`` (ranked by mean,
    with ``top``) or PASTA format ``{"<layer>": [heads]}`` / ``[layers]``."""

    file: NonEmptyStr
    top: PositiveInt | None = Field(None, description="take the k best heads of the file (at most the model's heads)")


def _heads_form(value: Any) -> str:
    """Which form of head selection ``value`` is, so an error names the form's own key (``top``), not another's."""
    if isinstance(value, HeadsFrom) or (isinstance(value, Mapping) and ("from" in value or "from_" in value)):
        return "heads[from]"
    if isinstance(value, HeadsFile) or (isinstance(value, Mapping) and "file" in value):
        return "heads[file]"
    return "heads[layers]" if isinstance(value, Mapping) else "heads[pairs]"


HeadSelection = Annotated[
    Union[  # noqa: UP007
        Annotated[HeadsFrom, Tag("heads[from]")], Annotated[HeadsFile, Tag("heads[file]")],
        Annotated[list[tuple[NonNegativeInt, NonNegativeInt]], Tag("heads[pairs]")],
        Annotated[dict[str, list[NonNegativeInt]], Tag("heads[layers]")]],
    Discriminator(_heads_form)]
"""How a spec names heads: ``{from: step, top: k}``, ``[[layer, head], ...]``, ``{"<layer>": [heads]}``
or ``{file: heads.json}``."""


# --- fixed parts of the spec ---------------------------------------------------------------------

#: the devices a spec may name: torch's device strings with an index of 0..127 (torch wraps larger ones)
DEVICE_PATTERN = r"^(auto|cpu|(cuda|mps|xpu)(:([0-9]|[1-9][0-9]|1[01][0-9]|12[0-7]))?)$"


class ModelSpec(StrictModel):
    """Which model to load and how. A bare string in the spec is the ``id``."""

    id: NonEmptyStr | None = Field(None, description="Hugging Face id, local directory, or registered name")
    path: NonEmptyStr | None = Field(None, description="local directory with a Hugging Face checkpoint")
    config: dict[str, Any] | None = Field(
        None, description="build from a transformers config mapping (needs `model_type`) with random weights")
    revision: str | None = None
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = "float32"
    device: str = Field("auto", description="'auto' (cuda if available, else cpu), 'cpu', 'cuda', 'cuda:1', ...",
                        json_schema_extra={"pattern": DEVICE_PATTERN})
    trust_remote_code: bool = False

    @field_validator("device")
    @classmethod
    def _known_device(cls, value: str) -> str:
        """A device torch knows (whether this machine has it is checked when the model loads)."""
        if value == "auto":
            return value
        import torch

        try:
            if not re.fullmatch(DEVICE_PATTERN, value) or torch.device(value).type not in ("cpu", "cuda", "mps", "xpu"):
                raise ValueError(value)
        except (RuntimeError, ValueError, TypeError):
            raise PydanticCustomError(
                "unknown_device", "unknown device '{device}': use auto, cpu, cuda, cuda:<index>, mps or xpu",
                {"device": value}) from None
        return value

    @model_validator(mode="after")
    def _one_source(self) -> ModelSpec:
        given = [k for k in ("id", "path", "config") if getattr(self, k) is not None]
        if len(given) > 1:
            raise ValueError(f"give only one of id, path, config (got {', '.join(given)})")
        if not given:
            self.id = DEFAULT_MODEL
        return self

    @property
    def name(self) -> str:
        """A short human-readable name for the model."""
        if self.config is not None:
            return f"random-{self.config.get('model_type', 'model')}"
        return str(self.path or self.id)


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
          "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


def parse_size(value: Any) -> int:
    """Bytes of a size: an integer, or a string such as ``512MB``, ``8GiB``, ``1.5G``. Raises ValueError."""
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not a size")
    if isinstance(value, int):
        if value < 1:
            raise ValueError(f"{value} is not a positive number of bytes")
        return value
    match = _SIZE.match(str(value))
    if not match:
        raise ValueError(f"{value!r} is not a size (write e.g. 8GiB, 512MB or a number of bytes)")
    unit = match.group(2).lower().removesuffix("b")
    size = int(float(match.group(1)) * _UNITS[unit])
    if size < 1:
        raise ValueError(f"{value!r} is not a positive size")
    return size


def _size(value: Any) -> Any:
    if value is None:
        return None
    try:
        return parse_size(value)
    except ValueError as e:
        raise PydanticCustomError("size", str(e)) from None


class Limits(StrictModel):
    """The resource guard's budget (see docs/reliability.md). Unset: ``HEADLAB_MEMORY_LIMIT``, else derived from
    the machine's memory (the device's for a GPU run)."""

    memory: Annotated[Annotated[int, Field(ge=1, le=2**62)] | None, BeforeValidator(_size)] = Field(
        None, description="largest estimated memory a cell may need: bytes or e.g. 8GiB, 512MB")
    guard: bool = Field(True, description="false: run without the resource check")


def _coerce_model(value: Any) -> Any:
    return {"id": value} if isinstance(value, str) else value


def _union(category: str, models: dict[str, type[ComponentConfig]]) -> Any:
    if not models:
        return Annotated[dict, Field(json_schema_extra={"description": f"no {category} plugins installed"})]
    members = tuple(models.values())
    if len(members) == 1:
        return members[0]
    return Annotated[Union[members], Field(discriminator="kind")]  # noqa: UP007


def _check_kind(label: str, kinds: list[str], key: str = "kind", default: str | None = None):
    def check(value: Any) -> Any:
        if isinstance(value, str) and key != "kind":  # `execution: ray` = `execution: {executor: ray}`
            value = {key: value}
        if not isinstance(value, Mapping) and not isinstance(value, BaseModel):
            raise PydanticCustomError(
                "unknown_kind", "expected a {category}: a mapping with `{key}` (one of: {kinds}), got {got}",
                {"category": label, "key": key, "kinds": ", ".join(kinds) or "none installed",
                 "got": _describe(value)})
        if isinstance(value, Mapping):
            kind = value.get(key, value.get("kind"))
            if kind is None and default is not None and key != "kind":  # `execution: {}`: the default executor
                value, kind = {**value, key: default}, default
            if kind is None:
                raise PydanticCustomError("missing_kind", "missing `{key}` (one of: {kinds})",
                                          {"key": key, "kinds": ", ".join(kinds) or "none installed"})
            if not isinstance(kind, str):
                raise PydanticCustomError("unknown_kind", "`{key}` must be a name (one of: {kinds}), got {got}",
                                          {"key": key, "kinds": ", ".join(kinds) or "none installed",
                                           "got": _describe(kind)})
            if kind not in kinds:
                raise PydanticCustomError(
                    "unknown_kind", "unknown {category} kind '{kind}'{hint}; installed: {kinds}",
                    {"category": label, "kind": str(kind), "hint": _suggest(kind, kinds),
                     "kinds": ", ".join(kinds) or "none (install a plugin that provides one)"})
        return value
    return check


def _describe(value: Any) -> str:
    """``a list``, ``the number 3``, ...: what a value is, for messages."""
    if value is None:
        return "nothing (null)"
    if isinstance(value, bool):
        return f"the boolean {str(value).lower()}"
    if isinstance(value, (int, float)):
        return f"the number {value}"
    if isinstance(value, str):
        return f"the string {value[:40]!r}"
    return {list: "a list", tuple: "a list", dict: "a mapping"}.get(type(value), f"a {type(value).__name__}")


class SpecTypes:
    """The spec's types of the registered components, as an action's config builder receives them.

    A step action registers a config *builder* when its config holds components (the ``generate``
    action's config holds a decoder and steering methods): ``builder(types: SpecTypes) -> type`` is
    called each time the spec model is built, so the config sees exactly the kinds registered then
    (see :func:`headlab.hookspecs.headlab_register_actions`).
    """

    def __init__(self, registry: Registry) -> None:
        self.registry = registry
        self._unions: dict[str, Any] = {}

    def union(self, category: str) -> Any:
        """The type of one component of ``category`` in a spec: its registered config models as a union
        discriminated by ``kind`` (an unknown or missing kind is a located error with a suggestion)."""
        from .plugin_manager import CATEGORIES

        if category not in self._unions:
            if category not in CATEGORIES or CATEGORIES[category].style != "config":
                configs = [c for c, v in CATEGORIES.items() if v.style == "config"]
                raise KeyError(f"'{category}' is not a category of config components (one of: {', '.join(configs)})")
            models = self.registry.configs(category)
            fallback = self.default(category)
            check = _check_kind(CATEGORIES[category].label, sorted(models), CATEGORIES[category].key,
                                None if fallback is None else fallback.kind_name())
            self._unions[category] = Annotated[_union(category, models), BeforeValidator(check)]
        return self._unions[category]

    def kinds(self, category: str) -> list[str]:
        """The kinds registered in ``category``, in registration order."""
        return list(self.registry.components[category])

    def default(self, category: str) -> type[ComponentConfig] | None:
        """The config model registered with ``default=True`` in ``category`` (None when there is none)."""
        comp = self.registry.default(category)
        return None if comp is None else comp.config

    def action(self, name: str) -> Any:
        """The config type of the step action ``name`` (its builder called with these types)."""
        config = self.registry.actions[name].config
        if isinstance(config, type) or get_origin(config) is not None:
            return config
        return config(self)


def build_spec_model(registry: Registry | None = None) -> type[BaseModel]:
    """Build the ``Spec`` pydantic model whose unions hold every registered component kind and whose
    steps offer every registered action."""
    from .plugin_manager import get_manager

    registry = registry or get_manager().registry
    types = SpecTypes(registry)
    Task = types.union("tasks")
    Executor = types.union("executors")
    executor = types.default("executors")
    actions = tuple(registry.actions)
    listed = " or ".join([", ".join(actions[:-1]), actions[-1]] if len(actions) > 1 else actions) or "none installed"

    class StepBase(StrictModel):
        @model_validator(mode="before")
        @classmethod
        def _one_action(cls, data: Any) -> Any:
            if isinstance(data, Mapping) and set(data) <= set(cls.model_fields):
                given = [a for a in actions if data.get(a) is not None]
                if len(given) != 1:
                    raise PydanticCustomError(
                        "step_action", "a step needs exactly one action: {actions} (got {got})",
                        {"actions": listed, "got": ", ".join(given) or "none"})
            return data

        @property
        def action(self) -> str:
            """The name of the step's action."""
            return next(a for a in actions if getattr(self, a) is not None)

    fields: dict[str, Any] = {"id": (str, Field(pattern=ID_PATTERN, max_length=ID_MAX))}
    for name, comp in registry.actions.items():
        fields[name] = (Optional[types.action(name)], Field(None, description=comp.description))  # noqa: UP045
    fields["task"] = (Optional[Task], Field(  # noqa: UP045
        None, description="use another task for this step instead of the spec's"))
    Step = create_model("Step", __base__=StepBase, __doc__="One step of the experiment: exactly one action.",
                        __module__=__name__, **fields)

    class Spec(StrictModel):
        """A headlab experiment."""

        name: str = Field("experiment", pattern=NAME_PATTERN, max_length=NAME_MAX,
                          description="experiment name (used for the run directory)")
        description: str = ""
        model: Annotated[ModelSpec, BeforeValidator(_coerce_model)] = Field(default_factory=ModelSpec)
        task: Task = Field(description="where the examples come from")
        steps: list[Step] = Field(min_length=1)
        sweep: dict[str, list[Any]] = Field(default_factory=dict,
                                            description="dotted spec path -> values; a grid of cells")
        seed: Seed = Field(0, description=f"seed of every cell (0 .. {MAX_SEED})")
        output: str = Field("./headlab-runs", description="directory (or fsspec URL) holding run stores")
        execution: Optional[Executor] = Field(  # noqa: UP045
            default_factory=lambda: executor() if executor is not None else None,
            description="how the cells run: `executor: <kind>` and its options (default: "
                        f"{executor.kind_name() if executor is not None else 'none installed'}); never changes results")
        limits: Limits = Field(default_factory=lambda: Limits(),
                               description="resource budget a cell may use (checked before it runs)")

        @field_validator("steps")
        @classmethod
        def _unique_ids(cls, steps: list[Any]) -> list[Any]:
            seen: set[str] = set()
            for i, step in enumerate(steps):
                if step.id in seen:
                    raise PydanticCustomError("duplicate_step", "duplicate step id '{id}' (step {i})",
                                              {"id": step.id, "i": i})
                seen.add(step.id)
            return steps

    Spec.__name__ = "Spec"
    return Spec


# --- loading --------------------------------------------------------------------------------------

SAFE_TAGS = re.compile(r"^tag:yaml\.org,2002:(str|int|float|bool|null|map|seq|timestamp)$")


class _Walk:
    """Plain Python from a ruamel round-trip tree, within :data:`MAX_DEPTH` and :data:`MAX_NODES`.

    Aliases are shared nodes in the tree; copying them is where an alias bomb would expand, so every
    value produced is counted and the first one past the limit is an error located at its key.
    """

    def __init__(self, source: str, tree: Any) -> None:
        self.source, self.tree, self.count, self.path = source, tree, 0, []

    def fail(self, message: str, at: tuple[int, int] | None = None) -> SpecError:
        line, col = at or _position(self.tree, self.path)
        if line is None:
            line, col = 1, 1
        shown = format_path(self.path[:8]) + ("..." if len(self.path) > 8 else "")
        return SpecError(message, source=self.source, line=line, col=col, path=shown)

    def __call__(self, node: Any) -> Any:
        self.count += 1
        if self.count > MAX_NODES:
            raise self.fail(f"the spec expands to more than {MAX_NODES:,} values (YAML aliases repeating "
                            "large anchors?)")
        if len(self.path) > MAX_DEPTH:
            raise self.fail(f"nested deeper than {MAX_DEPTH} levels")
        tag = getattr(getattr(node, "tag", None), "value", None) or getattr(node, "tag", None)
        if isinstance(tag, str) and (tag.startswith("!") or (not SAFE_TAGS.match(tag) and tag.startswith("tag:"))):
            raise self.fail(f"YAML tag {tag} is not allowed: a spec holds data only")
        if isinstance(node, Mapping):
            out = {}
            for k, v in node.items():
                if not isinstance(k, (str, int, float, bool)) and k is not None:
                    try:
                        line, col = node.lc.key(k)
                        at: tuple[int, int] | None = (line + 1, col + 1)
                    except (AttributeError, KeyError, TypeError):
                        at = None
                    raise self.fail("a key must be a plain name or number, not a "
                                    f"{'list' if isinstance(k, (list, tuple)) else 'mapping'}", at)
                key = str(k) if not isinstance(k, (int, float, bool)) else k
                self.path.append(key)
                out[key] = self(v)
                self.path.pop()
            return out
        if isinstance(node, list):
            items = []
            for i, v in enumerate(node):
                self.path.append(i)
                items.append(self(v))
                self.path.pop()
            return items
        if hasattr(node, "value") and tag is not None:
            raise self.fail(f"YAML tag {tag} is not allowed: a spec holds data only")
        if isinstance(node, int) and not isinstance(node, bool) and abs(node) > MAX_YAML_INT:
            digits = len(str(abs(int(node))))
            raise self.fail(f"the integer ({digits} digits) is too large; the limit is {MAX_YAML_INT:,} in absolute value")
        if type(node).__name__ in ("ScalarFloat", "ScalarInt", "ScalarBoolean"):
            return {"ScalarFloat": float, "ScalarInt": int, "ScalarBoolean": bool}[type(node).__name__](node)
        if isinstance(node, str):
            return str(node)
        return node


def _locate_tag(node: Any, path: list[Any] | None = None, seen: set[int] | None = None) -> tuple[Any, list[Any]] | None:
    """The first explicit tag in the tree: (its parent, its path). Shared (aliased) nodes are visited once."""
    path = path or []
    seen = set() if seen is None else seen
    if id(node) in seen or len(path) > MAX_DEPTH:
        return None
    seen.add(id(node))
    if isinstance(node, Mapping):
        for k, v in node.items():
            t = getattr(v, "tag", None)
            tv = getattr(t, "value", t)
            if isinstance(tv, str) and (tv.startswith("!") or (tv.startswith("tag:") and not SAFE_TAGS.match(tv))):
                return node, path + [k]
            found = _locate_tag(v, path + [k], seen)
            if found:
                return found
    elif isinstance(node, list):
        for i, v in enumerate(node):
            found = _locate_tag(v, path + [i], seen)
            if found:
                return found
    return None


@functools.cache
def _located_constructor() -> type:
    """ruamel's round-trip constructor, turning any failure to build a value (``!!int abc``, a ``!!pairs``
    key) into a YAML error at that value's position."""
    from ruamel.yaml.constructor import ConstructorError, RoundTripConstructor
    from ruamel.yaml.error import YAMLError

    def located(build: Any) -> Any:
        @functools.wraps(build)
        def wrapper(self: Any, node: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                return build(self, node, *args, **kwargs)
            except (YAMLError, RecursionError):
                raise
            except Exception as e:
                raise ConstructorError(None, None, f"cannot read this value ({type(e).__name__}: {e})",
                                       node.start_mark) from None
        return wrapper

    class LocatedConstructor(RoundTripConstructor):
        construct_object = located(RoundTripConstructor.construct_object)
        construct_mapping = located(RoundTripConstructor.construct_mapping)

    return LocatedConstructor


@functools.cache
def _bounded_scanner() -> type:
    """ruamel's round-trip scanner, refusing nesting past :data:`MAX_DEPTH` as it reads (its look-ahead for
    simple keys is quadratic in the flow nesting depth, so the limit must hold before the composer's)."""
    from ruamel.yaml.scanner import RoundTripScanner, ScannerError

    class BoundedScanner(RoundTripScanner):
        def _too_deep(self) -> ScannerError:
            return ScannerError(None, None, f"nested deeper than {MAX_DEPTH} levels", self.reader.get_mark())

        def fetch_flow_collection_start(self, TokenClass: Any, to_push: str) -> None:
            if len(self.flow_context) >= MAX_DEPTH:
                raise self._too_deep()
            super().fetch_flow_collection_start(TokenClass, to_push)

        def add_indent(self, column: int) -> bool:
            if len(self.indents) >= MAX_DEPTH:
                raise self._too_deep()
            return super().add_indent(column)

    return BoundedScanner


def parse_yaml(text: str, source: str = "<spec>") -> tuple[dict[str, Any], Any]:
    """Parse spec YAML safely. Returns (plain data, round-trip tree for locating errors).

    Refused with one located :class:`SpecError`: explicit tags, duplicate keys, a text longer than
    :data:`MAX_SPEC_CHARS`, nesting deeper than :data:`MAX_DEPTH`, and more than :data:`MAX_NODES`
    values once aliases are expanded.
    """
    from ruamel.yaml import YAML
    from ruamel.yaml.error import MarkedYAMLError, YAMLError
    from ruamel.yaml.reader import ReaderError

    if len(text) > MAX_SPEC_CHARS:
        raise SpecError(f"the spec is {len(text):,} characters long; the limit is {MAX_SPEC_CHARS:,} (data "
                        "belongs in a task's data file)", source=source, line=1, col=1)
    yaml = YAML(typ="rt")
    yaml.allow_duplicate_keys = False
    yaml.max_depth = MAX_DEPTH
    yaml.Scanner = _bounded_scanner()
    yaml.Constructor = _located_constructor()
    try:
        tree = yaml.load(io.StringIO(text))
    except MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        problem = (e.problem or e.context or "invalid YAML").strip()
        if "duplicate key" in problem:
            problem = problem.split(" with value")[0].replace("found duplicate key", "duplicate key")
        if "maximum depth" in problem:
            problem = f"nested deeper than {MAX_DEPTH} levels"
        raise SpecError(problem, source=source, line=mark.line + 1 if mark else None,
                        col=mark.column + 1 if mark else None) from None
    except ReaderError as e:
        where = text[: e.position] if isinstance(e.position, int) else ""
        raise SpecError(f"invalid YAML: {str(e).splitlines()[0]}", source=source, line=where.count("\n") + 1,
                        col=len(where) - (where.rfind("\n") + 1) + 1) from None
    except YAMLError as e:
        raise SpecError(f"invalid YAML: {str(e).splitlines()[0]}", source=source, line=1, col=1) from None
    except RecursionError:  # a parser path not covered by max_depth
        raise SpecError(f"nested deeper than {MAX_DEPTH} levels", source=source, line=1, col=1) from None
    if tree is None:
        raise SpecError("the spec is empty", source=source, line=1, col=1)
    if not isinstance(tree, Mapping):
        raise SpecError("a spec is a mapping of keys (name, model, task, steps, ...)", source=source, line=1, col=1)
    tagged = _locate_tag(tree)
    if tagged:
        parent, path = tagged
        line, col = _position(tree, path)
        tag = getattr(parent[path[-1]], "tag", None)
        raise SpecError(f"YAML tag {getattr(tag, 'value', tag)} is not allowed: a spec holds data only",
                        source=source, line=line, col=col, path=format_path(path))
    return _Walk(source, tree)(tree), tree


def _position(tree: Any, path: list[Any]) -> tuple[int | None, int | None]:
    """1-based (line, col) of the deepest node of ``path`` present in the round-trip tree."""
    node, line, col = tree, None, None
    for part in path:
        try:
            if isinstance(node, Mapping) and part in node:
                line, col = node.lc.key(part)
                node = node[part]
            elif isinstance(node, list) and isinstance(part, int) and part < len(node):
                line, col = node.lc.item(part)
                node = node[part]
            elif isinstance(node, Mapping) and part in (node.get("kind"), node.get("executor")):
                continue  # discriminator tag in pydantic's location
            else:
                break
        except (AttributeError, KeyError, TypeError):
            break
    if line is None:
        return (1, 1) if path else (None, None)
    return line + 1, col + 1


def format_path(path: Iterable[Any]) -> str:
    """``['steps', 0, 'detect', 'kind']`` -> ``steps[0].detect.kind``."""
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _clean_loc(loc: tuple[Any, ...], data: Any) -> list[Any]:
    """Drop pydantic's union-member markers from an error location, keeping real keys."""
    out: list[Any] = []
    node = data
    for part in loc:
        if isinstance(node, Mapping) and part not in node and isinstance(part, str) and (
                part in (node.get("kind"), node.get("executor")) or "[" in part
                or part.startswith(("function-", "constrained-", "lax-"))
                or part in ("list", "dict", "str", "int", "float")):
            continue
        if not isinstance(node, Mapping) and isinstance(part, str) and out:
            continue  # a union member's marker below a list or a scalar (``list[int]``, ``constrained-int``)
        out.append(part)
        if isinstance(node, Mapping):
            node = node.get(part)
        elif isinstance(node, list) and isinstance(part, int) and part < len(node):
            node = node[part]
        else:
            node = None
    return out


def first_error(exc: ValidationError, data: Any, tree: Any, source: str) -> SpecError:
    """Turn pydantic's first (most specific) error into a located one-line SpecError."""
    errors = exc.errors(include_url=False)
    rank = {"unknown_key": 0, "unknown_kind": 0, "missing_kind": 0, "step_action": 1}
    # most specific first; among equals, a member of a union that rejects the value beats one of the wrong type
    errors.sort(key=lambda e: (rank.get(e["type"], 2), -len(e["loc"]), e["type"].endswith("_type")))
    err = errors[0]
    path = _clean_loc(err["loc"], data)
    msg = err["msg"]
    if err["type"] == "unknown_key":
        path.append(err["ctx"]["key"])
    elif err["type"] == "missing":
        msg = f"missing required key '{path[-1]}'" if path else msg
    elif err["type"] in ("union_tag_invalid", "literal_error") and path and path[-1] != "kind":
        pass
    elif err["type"] == "string_pattern_mismatch" and err.get("ctx", {}).get("pattern") in _PATTERN_HELP:
        msg = f"{err['input']!r} is not allowed: {_PATTERN_HELP[err['ctx']['pattern']]}"
    msg = msg.replace("Value error, ", "")
    line, col = _position(tree, path) if tree is not None else (None, None)
    return SpecError(msg, source=source, line=line, col=col, path=format_path(path))


# --- sweeps ---------------------------------------------------------------------------------------

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
    steps = {s.get("id"): (i, s) for i, s in enumerate(data.get("steps", [])) if isinstance(s, Mapping)}
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
                       f"{_suggest(head, [*data, *steps])}")
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
    from .plugin_manager import get_manager

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


# --- the loaded spec ------------------------------------------------------------------------------

@dataclass
class LoadedSpec:
    """A validated spec: the pydantic object, the raw data it came from, and its text."""

    spec: Any
    data: dict[str, Any]
    text: str
    source: str
    tree: Any = None
    registry: Any = None

    @property
    def cells(self) -> Cells:
        """The sweep grid in row-major order of the sweep keys (one cell when there is no sweep)."""
        return Cells(self.spec.sweep)

    def for_cell(self, cell: Cell) -> Any:
        """The spec object with the cell's sweep values applied."""
        data = {k: v for k, v in self.data.items() if k != "sweep"}
        for key, value in cell.values:
            data = set_path(data, key, value, registry=self.registry)
        return self.spec.__class__.model_validate(data)

    def with_overrides(self, overrides: Mapping[str, Any]) -> LoadedSpec:
        """A new loaded spec with ``--set path=value`` overrides applied to its data."""
        data = self.data
        for key, value in overrides.items():
            try:
                data = set_path(data, key, value, registry=self.registry)
            except KeyError as e:
                raise SpecError(f"--set {e.args[0]}", source=self.source) from None
        return validate_data(data, text=self.text, source=self.source, tree=None, registry=self.registry)

    def with_execution(self, execution: Mapping[str, Any]) -> LoadedSpec:
        """A new loaded spec whose ``execution`` is updated by ``execution`` (the CLI's ``--executor``,
        ``--address``): naming another executor starts from that executor's defaults."""
        data = copy.deepcopy(self.data)
        current = data.get("execution")
        current = {"executor": current} if isinstance(current, str) else dict(current or {})
        now = current.pop("kind", current.pop("executor", getattr(self.spec.execution, "kind", None)))
        kind = execution.get("executor", execution.get("kind", now))
        current = {"executor": kind, **(current if kind == now else {})}
        current.update({k: v for k, v in execution.items() if v is not None and k != "kind"})
        data["execution"] = current
        return validate_data(data, text=self.text, source=self.source, tree=None, registry=self.registry)


def validate_data(data: dict[str, Any], *, text: str = "", source: str = "<spec>", tree: Any = None,
                  registry: Registry | None = None) -> LoadedSpec:
    """Validate raw spec data, sweep included; raise SpecError located in the YAML.

    ``registry`` defaults to the plugin manager's registry at the time of each call.
    """
    from .plugin_manager import get_manager

    Spec = build_spec_model(registry or get_manager().registry)
    try:
        spec = Spec.model_validate(data)
    except ValidationError as e:
        raise first_error(e, data, tree, source) from None
    _check_references(spec, tree, source)
    loaded = LoadedSpec(spec=spec, data=data, text=text, source=source, tree=tree, registry=registry)
    _check_sweep(spec, data, tree, source, registry)
    return loaded


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
    import numpy as np

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


def _check_references(spec: Any, tree: Any, source: str) -> None:
    """Every ``heads: {from: id}`` names an earlier step that produces scores."""
    earlier: dict[str, str] = {}
    for i, step in enumerate(spec.steps):
        for path, ref in _find_refs(step.model_dump(by_alias=True), ["steps", i]):
            if ref not in earlier:
                line, col = _position(tree, path) if tree is not None else (None, None)
                hint = _suggest(ref, earlier)
                where = "a later step" if ref in {s.id for s in spec.steps} else "no step"
                raise SpecError(f"'{ref}' is {where}; heads can only come from an earlier step{hint}",
                                source=source, line=line, col=col, path=format_path(path))
        earlier[step.id] = step.action


def _find_refs(node: Any, path: list[Any]) -> Iterable[tuple[list[Any], str]]:
    if isinstance(node, Mapping):
        if isinstance(node.get("from"), str):
            yield [*path, "from"], node["from"]
        for k, v in node.items():
            if v is not None:
                yield from _find_refs(v, [*path, k])
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _find_refs(v, [*path, i])


def load_spec(source: str | Path | Mapping[str, Any], *, registry: Registry | None = None) -> LoadedSpec:
    """Load and validate a spec from a path, a YAML string, or a mapping.

    Raises :class:`SpecError` with ``file:line:col: key.path: message`` on any problem.
    """
    if isinstance(source, Mapping):
        return validate_data(copy.deepcopy(dict(source)), source="<dict>", registry=registry)
    if isinstance(source, Path) or (isinstance(source, str) and "\n" not in source
                                    and source.endswith((".yaml", ".yml"))):
        path = Path(source)
        if not path.is_file():
            raise SpecError(f"no such spec file; check the path{' (it is a directory)' if path.is_dir() else ''}",
                            source=str(path))
        text, name = path.read_text(encoding="utf-8"), str(path)
    else:
        text, name = str(source), "<spec>"
    data, tree = parse_yaml(text, name)
    return validate_data(data, text=text, source=name, tree=tree, registry=registry)


def json_schema(registry: Registry | None = None) -> dict[str, Any]:
    """The JSON Schema of specs, every installed plugin kind included."""
    from .plugin_manager import get_manager

    schema = build_spec_model(registry or get_manager().registry).model_json_schema(by_alias=True)
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "headlab spec"
    return schema
