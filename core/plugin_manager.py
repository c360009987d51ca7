"""The plugin manager: built-in plugins first, then entry points of group ``headlab``.

``HEADLAB_PLUGINS`` controls autoloading of third-party plugins: unset loads all of them, an empty
string or ``none`` loads none, a comma-separated list loads only those entry-point names. Built-ins
always load. A plugin that fails to import is reported by name with its error and skipped.
"""

from __future__ import annotations

import importlib
import importlib.metadata as md
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pluggy

from . import hookspecs
from .spec import CATEGORIES, ComponentConfig, Registry

BUILTIN_PLUGINS = (
    "headlab.plugins.tasks.repeated_tokens",
    "headlab.plugins.tasks.synthetic_tasks",
    "headlab.plugins.tasks.files",
    "headlab.plugins.tasks.benchmarks",
    "headlab.plugins.detectors.patterns",
    "headlab.plugins.detectors.retrieval",
    "headlab.plugins.detectors.ablation",
    "headlab.plugins.detectors.segment_divergence",
    "headlab.plugins.detectors.lookback",
    "headlab.plugins.steering.pasta",
    "headlab.plugins.steering.pasta_profile",
    "headlab.plugins.steering.vhr",
    "headlab.plugins.steering.heads",
    "headlab.plugins.decoding.greedy",
    "headlab.plugins.decoding.dola",
    "headlab.plugins.decoding.decore",
    "headlab.plugins.decoding.contrastive",
    "headlab.plugins.metrics.text",
    "headlab.plugins.metrics.rouge",
    "headlab.plugins.metrics.answers",
    "headlab.plugins.models.embedded",
)

HOOK_FOR = {
    "tasks": "headlab_register_tasks",
    "detectors": "headlab_register_detectors",
    "steering": "headlab_register_steering",
    "decoders": "headlab_register_decoders",
    "metrics": "headlab_register_metrics",
}


@dataclass
class Component:
    """One registered component: its category, kind, config model, implementation and plugin."""

    category: str
    kind: str
    config: type[ComponentConfig] | None
    impl: Callable[..., Any]
    plugin: str
    description: str = ""


@dataclass
class PluginInfo:
    """What ``headlab plugins`` lists for one plugin."""

    name: str
    source: str
    version: str
    components: list[Component] = field(default_factory=list)
    error: str | None = None


class PluginError(Exception):
    """A plugin registered something invalid."""


class Manager:
    """Loads plugins and holds the components they register."""

    def __init__(self, *, entry_points: bool = True) -> None:
        self.pm = pluggy.PluginManager("headlab")
        self.pm.add_hookspecs(hookspecs)
        self.infos: dict[str, PluginInfo] = {}
        self.registry = Registry()
        self.components: dict[str, dict[str, Component]] = {c: {} for c in (*CATEGORIES, "models")}
        for modname in BUILTIN_PLUGINS:
            module = importlib.import_module(modname)
            self._add(module, modname, "built-in", _version("headlab"))
        if entry_points:
            self._load_entry_points()

    def _load_entry_points(self) -> None:
        allow = os.environ.get("HEADLAB_PLUGINS")
        names = None if allow is None else {n.strip() for n in allow.split(",") if n.strip()} - {"none"}
        for ep in md.entry_points(group="headlab"):
            if names is not None and ep.name not in names:
                continue
            dist = ep.dist.name if ep.dist else "?"
            version = ep.dist.version if ep.dist else "?"
            try:
                module = ep.load()
            except Exception as e:  # a broken plugin must not break headlab
                self.infos[ep.name] = PluginInfo(ep.name, f"distribution {dist}", version,
                                                 error=f"{type(e).__name__}: {e}")
                continue
            self._add(module, ep.name, f"distribution {dist}", version)

    def _add(self, module: Any, name: str, source: str, version: str) -> None:
        info = PluginInfo(name, source, version)
        self.infos[name] = info
        try:
            self.pm.register(module, name=name)
            for category, hook in HOOK_FOR.items():
                impl = getattr(module, hook, None)
                if impl is not None:
                    impl(register=self._registrar(category, info))
            if getattr(module, "headlab_register_models", None):
                module.headlab_register_models(register=self._model_registrar(info))
        except Exception as e:
            info.error = f"{type(e).__name__}: {e}"
            for comp in info.components:
                self.components[comp.category].pop(comp.kind, None)
                self.registry.configs.get(comp.category, {}).pop(comp.kind, None)
            info.components.clear()
            if source == "built-in":
                raise

    def _registrar(self, category: str, info: PluginInfo) -> Callable[..., None]:
        def register(config: type[ComponentConfig], impl: Callable[..., Any]) -> None:
            if not (isinstance(config, type) and issubclass(config, ComponentConfig)):
                raise PluginError(f"{info.name}: {category} config must subclass headlab.ComponentConfig")
            kind = config.kind_name()
            if not isinstance(kind, str):
                raise PluginError(f"{info.name}: {config.__name__}.kind needs a Literal default")
            if kind in self.components[category]:
                other = self.components[category][kind].plugin
                raise PluginError(f"{info.name}: {category} kind '{kind}' is already registered by {other}")
            doc = (config.__doc__ or impl.__doc__ or "").strip().splitlines()
            comp = Component(category, kind, config, impl, info.name, doc[0] if doc else "")
            self.components[category][kind] = comp
            self.registry.configs[category][kind] = config
            info.components.append(comp)
        return register

    def _model_registrar(self, info: PluginInfo) -> Callable[..., None]:
        def register(name: str, load: Callable[..., Any], description: str = "") -> None:
            if name in self.components["models"]:
                raise PluginError(f"{info.name}: model '{name}' is already registered")
            comp = Component("models", name, None, load, info.name, description)
            self.components["models"][name] = comp
            info.components.append(comp)
        return register

    def get(self, category: str, kind: str) -> Component:
        """The component registered for ``kind`` in ``category``."""
        try:
            return self.components[category][kind]
        except KeyError:
            raise PluginError(f"no {category} plugin provides kind '{kind}'") from None


_manager: Manager | None = None


def get_manager(*, reload: bool = False) -> Manager:
    """The process-wide plugin manager (created on first use)."""
    global _manager
    if _manager is None or reload:
        _manager = Manager()
    return _manager


def _version(dist: str) -> str:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return "0+unknown"
