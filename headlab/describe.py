"""What a step did, in a few words, from a run's resolved config: the text of ``headlab show``'s "what it did"
column and of the report's step headers, and whether the step is a control.

>>> spec = headlab.load_spec("specs/decoding_counterfact.yaml").spec    # doctest: +SKIP
>>> describe_steps(spec)["decore_random"].text                          # doctest: +SKIP
'control: generate decore (heads from retrieval top 8, random, alpha entropy)'

The words come from the configs alone, never from a method's name: the action, the component's ``kind`` and
the options given with a value other than the config model's default (a decoder's ``alpha``, a steering
method's ``heads``). Head selections read as ``from retrieval top 4``, ``random like profile top 4``, ``8 listed
heads`` or ``file heads.json top 4``. A step is a control when one of its components draws at random
(a head selection or a component config with ``random: true``, or an option set to ``random``, as ITI's
``direction: random``) or is a control by construction (its config
class sets ``control: ClassVar[bool] = True``, as the ``random`` KV policy does).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ValidationError

from .config import ComponentConfig
from .plugin_manager import get_manager
from .spec import HeadsFrom, build_spec_model

__all__ = ["StepDescription", "describe_step", "describe_steps", "heads_text", "is_control"]

CONTROL_PREFIX = "control: "


@dataclass(frozen=True)
class StepDescription:
    """What one step did: ``text`` (one line, ``control: `` first for a control), ``is_control`` and the parts
    the text is made of."""

    step: str
    text: str
    is_control: bool
    action: str
    kind: str | None = None
    """The detector's kind (detect) or the decoder's kind (generate, score, evaluate)."""
    options: tuple[str, ...] = ()
    """The detector's or the decoder's non-default options, as words (``alpha 0.5``)."""
    steering: tuple[str, ...] = ()
    """One entry per steering method: its kind and non-default options."""
    heads: tuple[str, ...] = ()
    """Every head selection of the step, as words (``from retrieval top 4``)."""
    kv: str | None = None
    """The KV policy: its kind and non-default options."""
    task: str | None = None
    """The step's own task, where it has one (``niah``; ``emphasis (emphasis markers)`` when it is the spec's
    task kind with other options)."""
    fields: dict[str, Any] = field(default_factory=dict)
    """The action's non-default options as plain data (JSON-ready)."""


def is_control(config: Any) -> bool:
    """Whether ``config`` (a component config, a head selection or any config model, with everything it holds)
    draws at random in place of a selection (``random: true``, or an option set to ``random``: ITI's
    ``direction: random``) or is a control by construction (its class sets ``control = True``)."""
    if isinstance(config, BaseModel):
        if getattr(type(config), "control", False) is True or getattr(config, "random", False) is True:
            return True
        values = [getattr(config, name) for name in type(config).model_fields]
        return any(v == "random" for v in values if isinstance(v, str)) or any(is_control(v) for v in values)
    if isinstance(config, (list, tuple)):
        return any(is_control(v) for v in config)
    if isinstance(config, Mapping):
        return any(is_control(v) for v in config.values())
    return False


def _number(v: Any) -> str:
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, float):
        return f"{v:g}" if math.isfinite(v) else str(v)
    return str(v)


def _plain(v: Any) -> str:
    """Plain data in words: a mapping with a ``kind`` as ``kind (key value, ...)``."""
    if isinstance(v, Mapping):
        rest = [f"{str(k).replace('_', ' ')} {_plain(x)}" for k, x in v.items() if k != "kind"]
        return _with(str(v["kind"]), rest) if "kind" in v else ", ".join(rest)
    if isinstance(v, (list, tuple)):
        return f"[{', '.join(_plain(x) for x in v)}]"
    return _number(v)


def _is_pairs(v: Any) -> bool:
    return isinstance(v, (list, tuple)) and bool(v) and all(
        isinstance(p, (list, tuple)) and len(p) == 2 and all(isinstance(x, int) for x in p) for p in v)


def _is_layer_map(v: Any) -> bool:
    return isinstance(v, Mapping) and bool(v) and all(
        isinstance(k, str) and k.isdigit() and isinstance(h, (list, tuple)) for k, h in v.items())


def heads_text(selection: Any) -> str | None:
    """A head selection in words, or None when ``selection`` is not one."""
    if isinstance(selection, HeadsFrom):
        rule = f"top {selection.top}" if selection.top is not None else f"score >= {_number(selection.threshold)}"
        if not selection.random:
            return f"from {selection.from_} {rule}"
        extra = (", per layer" if selection.match_layers else "") + (
            f", seed {selection.seed}" if selection.seed is not None else "")
        return f"random like {selection.from_} {rule}{extra}"
    if isinstance(selection, BaseModel) and {"from_", "file"} & set(type(selection).model_fields):
        source = "from_" if "from_" in type(selection).model_fields else "file"
        data = selection.model_dump(exclude_defaults=True, exclude={source})
        rest = " ".join(f"{k.replace('_', ' ')} {_number(v)}" for k, v in data.items())
        return f"{'from' if source == 'from_' else 'file'} {getattr(selection, source)}" + (f" {rest}" if rest else "")
    if _is_pairs(selection):
        pairs = [tuple(p) for p in selection]
        if len(pairs) <= 2:
            return " ".join(f"L{a}H{b}" for a, b in pairs)
        return f"{len(pairs)} listed heads"
    if _is_layer_map(selection):
        n = sum(len(h) for h in selection.values())
        layers = ", ".join(sorted(selection, key=int))
        return f"{n} listed heads in layer{'s' if len(selection) > 1 else ''} {layers}"
    return None


def _options(config: BaseModel, heads: list[str], skip: Sequence[str] = ("kind",)) -> list[str]:
    """The non-default options of ``config`` as words; head selections go into ``heads`` too."""
    words = []
    for name, info in type(config).model_fields.items():
        if name in skip:
            continue
        value = getattr(config, name)
        if not info.is_required() and value == info.get_default(call_default_factory=True):
            continue
        key = (info.alias or name).replace("_", " ")
        said = heads_text(value)
        if said is not None:
            heads.append(said)
            words.append(said if key == "heads" and said[0].isdigit() else f"{key} {said}")
        elif isinstance(value, ComponentConfig):
            inner = _options(value, heads)
            words.append(f"{key} {value.kind}" + (f" ({', '.join(inner)})" if inner else ""))
        elif isinstance(value, BaseModel):
            inner = _options(value, heads, skip=())
            words.append(f"{key} {' '.join(inner)}" if inner else key)
        elif isinstance(value, Mapping):
            words.append(f"{key} {_plain(value)}")
        elif isinstance(value, (list, tuple)):
            items = [_with(v.kind, _options(v, heads)) if isinstance(v, ComponentConfig) else _plain(v) for v in value]
            words.append(f"{key} [{', '.join(items)}]")
        elif value is True:
            words.append(key)
        else:
            words.append(f"{key} {_number(value)}")
    return words


def _component(config: ComponentConfig, heads: list[str]) -> tuple[str, list[str]]:
    return config.kind, _options(config, heads)


def _with(kind: str, options: Sequence[str]) -> str:
    return f"{kind} ({', '.join(options)})" if options else kind


def _task_text(task: ComponentConfig | None, spec_task: ComponentConfig | None) -> str | None:
    if task is None:
        return None
    if spec_task is None or task.kind != spec_task.kind:
        return task.kind
    differ = [f"{name.replace('_', ' ')} {_number(getattr(task, name))}" for name in type(task).model_fields
              if name != "kind" and getattr(task, name) != getattr(spec_task, name)
              and not isinstance(getattr(task, name), (list, tuple, Mapping, BaseModel))]
    return _with(task.kind, differ)


def describe_step(step: Any, spec_task: Any = None) -> StepDescription:
    """What ``step`` (a validated step of a spec) did: its action, the detector's or decoder's kind and
    non-default options, steering, head selections, KV policy and own task (compared with ``spec_task``, the
    spec's task), and whether it is a control."""
    action = step.action
    config = getattr(step, action)
    heads: list[str] = []
    kind, options, steering, kv = None, [], [], None
    parts = [action]
    if isinstance(config, ComponentConfig):  # the action's config is a component (detect: a detector)
        kind, options = _component(config, heads)
        parts.append(_with(kind, options))
    elif isinstance(config, BaseModel):
        decoder = getattr(config, "decode", None)
        if isinstance(decoder, ComponentConfig):
            kind, options = _component(decoder, heads)
            parts.append(_with(kind, options))
        steering = [_with(*_component(s, heads)) for s in getattr(config, "steer", None) or []
                    if isinstance(s, ComponentConfig)]
        policy = getattr(config, "kv", None)
        if isinstance(policy, ComponentConfig):
            kv = _with(*_component(policy, heads))
        if (steering or kv) and len(parts) == 2 and not options and kind == _default_decoder():
            parts.pop()  # "generate, steer pasta (...)": the default decoder goes without saying
        if steering:
            parts[-1] += ","
            parts.append("steer " + "; ".join(steering))
        if kv:
            parts[-1] += ","
            parts.append("kv " + kv)
    task = _task_text(getattr(step, "task", None), spec_task)
    if task:
        parts.append(f"on {task}")
    control = is_control(config)
    text = (CONTROL_PREFIX if control else "") + " ".join(parts)
    fields = _given(config) if isinstance(config, BaseModel) else {}
    return StepDescription(step=step.id, text=text, is_control=control, action=action, kind=kind,
                           options=tuple(options), steering=tuple(steering), heads=tuple(heads), kv=kv, task=task,
                           fields=fields)


def _default_decoder() -> str | None:
    comp = get_manager().registry.default("decoders")
    return None if comp is None else comp.config.kind_name()


def _given(value: Any) -> Any:
    """``value`` as JSON-ready data without the options left at their defaults (a component's ``kind`` kept)."""
    if isinstance(value, BaseModel):
        out = {"kind": value.kind} if isinstance(value, ComponentConfig) else {}
        for name, info in type(value).model_fields.items():
            v = getattr(value, name)
            if name != "kind" and (info.is_required() or v != info.get_default(call_default_factory=True)):
                out[info.alias or name] = _given(v)
        return out
    if isinstance(value, (list, tuple)):
        return [_given(v) for v in value]
    if isinstance(value, Mapping):
        return {str(k): _given(v) for k, v in value.items()}
    return json.loads(json.dumps(value, default=str))


def _validated(spec: Any) -> Any:
    if isinstance(spec, BaseModel):
        return spec
    data = json.loads(spec) if isinstance(spec, (str, bytes)) else spec
    return build_spec_model().model_validate(data)


def describe_steps(spec: Any) -> dict[str, StepDescription]:
    """:func:`describe_step` of every step, by id, in the spec's order. ``spec`` is a validated spec, its data
    or a run's resolved config (``Run.attrs["resolved"]``, JSON). A resolved config that no longer validates
    (a plugin it names is not installed) gives ``{}``."""
    try:
        model = _validated(spec)
    except (ValidationError, ValueError, TypeError):
        return {}
    return {step.id: describe_step(step, model.task) for step in model.steps}
