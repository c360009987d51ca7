"""The dynamic ``Spec`` model: its unions hold the config models of every registered component kind, and
its steps offer every registered action; and its JSON Schema.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Annotated, Any, Optional, Union, get_origin

from pydantic import BaseModel, BeforeValidator, Field, create_model, field_validator, model_validator
from pydantic_core import PydanticCustomError

from ..config import ComponentConfig, StrictModel, suggest
from ..plugin_manager import CATEGORIES, Registry, get_manager
from .fields import ID_MAX, ID_PATTERN, MAX_SEED, NAME_MAX, NAME_PATTERN, Seed
from .limits import Limits
from .model_spec import ModelSpec, default_model

__all__ = ["SpecTypes", "build_spec_model", "json_schema"]


def _coerce_model(default: str | None) -> Callable[[Any], Any]:
    """The spec's ``model`` as a :class:`ModelSpec`'s data: a bare string is the ``id``; a model without
    ``id``, ``path`` or ``config`` is ``default``, the registry's default model."""
    def coerce(value: Any) -> Any:
        if isinstance(value, str):
            return {"id": value}
        if isinstance(value, Mapping) and all(value.get(k) is None for k in ("id", "path", "config")):
            if default is None:
                raise PydanticCustomError("no_default_model",
                                          "no model is registered as the default: give id, path or config")
            return {**value, "id": default}
        return value
    return coerce


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
                    {"category": label, "kind": str(kind), "hint": suggest(kind, kinds),
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
    registry = registry or get_manager().registry
    types = SpecTypes(registry)
    Task = types.union("tasks")
    Executor = types.union("executors")
    executor = types.default("executors")
    actions = tuple(registry.actions)
    coerce_model = _coerce_model(default_model(registry))
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
        model: Annotated[ModelSpec, BeforeValidator(coerce_model)] = Field(default_factory=dict,
                                                                           validate_default=True)
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


def json_schema(registry: Registry | None = None) -> dict[str, Any]:
    """The JSON Schema of specs, every installed plugin kind included."""
    schema = build_spec_model(registry or get_manager().registry).model_json_schema(by_alias=True)
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "headlab spec"
    return schema
