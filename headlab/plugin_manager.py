"""The plugin manager: pluggy's own machinery, one table of component categories, in-process plugins.

Every plugin is a pluggy plugin registered on one ``pluggy.PluginManager`` (``get_manager().pm``), and
every installed one is found the same way, through the entry points of group ``headlab``: headlab's
own distribution declares its built-in modules of ``headlab.plugins`` there (registered first, in the
order of their names), other distributions their plugins (``pm.load_setuptools_entrypoints``); then
comes whatever a notebook registers with :func:`register_plugin` (or ``pm.register``). Components are
collected by calling each plugin's ``headlab_register_*`` hook implementations
(``pm.hook.<hook>.get_hookimpls()``, one plugin at a time so every component is attributed to its
plugin) with a ``register`` callable, and collected again whenever the set of registered plugins
changes: a kind registered from a notebook cell is seen at once by the spec models, the JSON Schema,
``headlab plugins`` and the widgets, and is gone after :func:`unregister_plugin`.

``HEADLAB_PLUGINS`` controls autoloading of third-party plugins: unset loads all of them, an empty
string or ``none`` loads none, a comma-separated list loads only those entry-point names. Built-ins
(the entry points of headlab's own distribution) always load. A plugin that fails to import (even
with ``SystemExit``), or whose hooks register something invalid, is reported by name with its error
(``headlab plugins``) and skipped.

:data:`CATEGORIES` is the one table of component categories; the spec models, this manager, the JSON
Schema and ``headlab plugins`` all read it.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.metadata as md
import os
import pkgutil
import re
import types
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import pluggy

from . import hookspecs
from .config import ComponentConfig
from .version import __version__

__all__ = ["CATEGORIES", "Category", "Component", "PluginError", "PluginInfo", "component", "get_manager",
           "plugins_for_workers", "register_plugin", "register_worker_plugins", "unregister_plugin"]

GROUP = "headlab"
BUILTIN_PACKAGE = f"{GROUP}.plugins"
"""The package whose modules are headlab's own plugins, registered through the same hooks as third parties."""
"""The entry-point group of headlab plugins: headlab's own distribution declares its built-ins there too."""

BUILT_IN = "built-in"
IN_PROCESS = "in-process"


@dataclass(frozen=True)
class Category:
    """One category of components: its hook, how the hook's ``register`` is called, how it is named.

    ``style`` is the signature of ``register``:

    - ``"config"``: ``register(ConfigModel, implementation, *, default=False)`` (decoders also take
      ``score=``, metrics ``aggregate=``); the config models of the category join one discriminated union
      of the spec (see :class:`headlab.spec.SpecTypes`);
    - ``"action"``: ``register(name, config, run, description="")``, a step action;
    - ``"model"``: ``register(name, load, description="")``, a named model.

    ``key`` is the spec key that names a component's kind: ``kind`` for most categories, ``executor``
    for executors (``execution: {executor: ray, ...}``); a config model of a category whose key is not
    ``kind`` declares its kind field with that alias (``kind: Literal["x"] = Field("x", alias="executor")``).
    """

    name: str
    hook: str
    label: str
    description: str
    style: Literal["config", "action", "model"] = "config"
    key: str = "kind"


CATEGORIES: dict[str, Category] = {c.name: c for c in (
    Category("tasks", "headlab_register_tasks", "task", "where a run's examples come from"),
    Category("detectors", "headlab_register_detectors", "detector", "score heads (the detect action)"),
    Category("steering", "headlab_register_steering", "steering",
             "edit heads while a step generates or scores"),
    Category("decoders", "headlab_register_decoders", "decoder",
             "decoding strategies (and their scoring of choices)"),
    Category("metrics", "headlab_register_metrics", "metric", "per-example metrics of generated outputs"),
    Category("choice_metrics", "headlab_register_choice_metrics", "choice metric",
             "per-example metrics of the scores of an example's choices (the score action)"),
    Category("actions", "headlab_register_actions", "action", "what a step does (detect, generate, ...)",
             "action"),
    Category("models", "headlab_register_models", "model", "named models a spec's `model` can name",
             "model"),
    Category("executors", "headlab_register_executors", "executor",
             "how a run's cells are executed (`execution:`; in this process, on a Ray cluster, ...)", key="executor"),
    Category("kv", "headlab_register_kv_policies", "KV policy",
             "which key/value heads keep their whole cache, and what the others keep (head-level KV policies)"),
)}
"""Every category of component by name, in the order ``headlab plugins`` lists them."""

RESERVED_ACTIONS = frozenset({"id", "task", "action"})


@dataclass
class Component:
    """One registered component.

    ``config`` is the config model (``"config"`` categories), the action's config type or config builder
    (actions), or None (models). ``default`` marks the category's default kind (``register(...,
    default=True)``; the generate and score actions use the default decoder). ``score`` is a decoder's
    scorer for the ``score`` action (``register(Config, decode, score=score_fn)``), None if it has none.
    ``aggregate`` is a metric's step-level aggregate (``register(Config, compute, aggregate=fn)``, see
    :func:`headlab.hookspecs.headlab_register_metrics`), None if it has none.
    """

    category: str
    kind: str
    config: Any
    impl: Callable[..., Any]
    plugin: str
    description: str = ""
    default: bool = False
    score: Callable[..., Any] | None = None
    aggregate: Callable[..., Any] | None = None


@dataclass
class PluginInfo:
    """What ``headlab plugins`` lists for one plugin."""

    name: str
    source: str
    version: str
    components: list[Component] = field(default_factory=list)
    error: str | None = None


class PluginError(Exception):
    """A plugin registered something invalid, or a component or plugin does not exist."""


class Registry:
    """Registered components by category and kind, in registration order.

    A snapshot: the manager builds a new one whenever the set of plugins changes.
    """

    def __init__(self, components: Mapping[str, Mapping[str, Component]] | None = None) -> None:
        self.components: dict[str, dict[str, Component]] = {c: {} for c in CATEGORIES}
        for category, comps in (components or {}).items():
            self.components[category].update(comps)

    def get(self, category: str, kind: str) -> Component:
        """The component registered for ``kind`` in ``category``."""
        if category not in self.components:
            raise PluginError(f"no component category '{category}' (one of: {', '.join(CATEGORIES)})")
        try:
            return self.components[category][kind]
        except KeyError:
            raise PluginError(f"no {category} plugin provides kind '{kind}'") from None

    def configs(self, category: str) -> dict[str, type[ComponentConfig]]:
        """The config models of a ``"config"`` category by kind."""
        return {kind: comp.config for kind, comp in self.components[category].items()}

    def default(self, category: str) -> Component | None:
        """The component registered with ``default=True`` in ``category``, if any."""
        return next((c for c in self.components[category].values() if c.default), None)

    @property
    def actions(self) -> dict[str, Component]:
        """Step actions by name."""
        return self.components["actions"]


class Manager:
    """Registers plugins on ``self.pm`` and holds the components their hooks register.

    The built-ins always register; ``entry_points=False`` leaves out the plugins of other distributions.
    """

    def __init__(self, *, entry_points: bool = True) -> None:
        self.pm = pluggy.PluginManager("headlab")
        self.pm.add_hookspecs(hookspecs)
        self._sources: dict[str, tuple[str, str]] = {}
        self._failed: dict[str, PluginInfo] = {}
        self._snapshot: tuple[tuple[str, Any], ...] | None = None
        self._registry = Registry()
        self._infos: dict[str, PluginInfo] = {}
        self._load_builtins()
        self._refresh()
        if entry_points:
            self._load_entry_points()

    # --- loading ---------------------------------------------------------------------------------

    def _load_builtins(self) -> None:
        """Register headlab's own plugins: every module of the built-in plugins package that implements a
        hook, in the order of their names. One that fails to import is an error (headlab is broken), not a
        plugin to skip."""
        for module in _builtin_plugins():
            self.pm.register(module, name=module.__name__)
            self._sources[module.__name__] = (BUILT_IN, __version__)

    def _load_entry_points(self) -> None:
        allow = os.environ.get("HEADLAB_PLUGINS")
        names = None if allow is None else {n.strip() for n in allow.split(",") if n.strip()} - {"none"}
        for ep in md.entry_points(group=GROUP):
            if ep.dist is not None and _is_headlab(ep.dist):
                continue  # the built-ins, loaded already whatever HEADLAB_PLUGINS says
            if names is not None and ep.name not in names:
                continue
            if self.pm.has_plugin(ep.name) or self.pm.is_blocked(ep.name):
                continue
            dist = ep.dist.name if ep.dist else "?"
            version = ep.dist.version if ep.dist else "?"
            try:
                self.pm.load_setuptools_entrypoints(GROUP, name=ep.name)
            except (Exception, SystemExit) as e:  # a broken plugin must not break headlab
                self._failed[ep.name] = PluginInfo(ep.name, f"distribution {dist}", version,
                                                   error=f"{type(e).__name__}: {e}")
                continue
            self._sources[ep.name] = (f"distribution {dist}", version)

    def register(self, plugin: Any, name: str | None = None, *, replace: bool = False) -> str:
        """Register a plugin (module, class or instance) now; see :func:`headlab.register_plugin`."""
        if name is None:
            name = self.pm.get_canonical_name(plugin)
        previous = self.pm.get_plugin(name) if replace else None
        previous_source = self._sources.get(name)
        if previous is not None:
            self.unregister(name)
        try:
            registered = self.pm.register(plugin, name=name)
        except Exception as e:  # pluggy: name or object already registered, or a bad hook signature
            self._restore(name, previous, previous_source)
            raise PluginError(f"cannot register {name}: {e}") from None
        if registered is None:
            raise PluginError(f"plugin name '{name}' is blocked")
        self._sources[registered] = (IN_PROCESS, str(getattr(plugin, "__version__", "")))
        error = self._infos_now()[registered].error
        if error is not None:
            self.pm.unregister(name=registered)
            self._sources.pop(registered, None)
            self._restore(name, previous, previous_source)
            raise PluginError(error if error.startswith(f"{registered}:") else f"{registered}: {error}")
        return registered

    def _restore(self, name: str, plugin: Any, source: tuple[str, str] | None) -> None:
        """Register again a plugin that ``register(..., replace=True)`` took out."""
        if plugin is not None:
            self.pm.register(plugin, name=name)
            if source is not None:
                self._sources[name] = source
        self._refresh()

    def unregister(self, name: str) -> None:
        """Unregister the plugin called ``name``; its components disappear."""
        if self.pm.get_plugin(name) is None:
            if self._failed.pop(name, None) is not None:
                return
            hint = difflib.get_close_matches(name, [n for n, p in self.pm.list_name_plugin() if p], n=1)
            raise PluginError(f"no plugin named '{name}' is registered"
                              + (f" (did you mean '{hint[0]}'?)" if hint else ""))
        self.pm.unregister(name=name)
        self._sources.pop(name, None)
        self._refresh()

    # --- collection ------------------------------------------------------------------------------

    @property
    def registry(self) -> Registry:
        """Every registered component (collected again if the plugins changed)."""
        self._refresh()
        return self._registry

    @property
    def components(self) -> dict[str, dict[str, Component]]:
        """Components by category (see :data:`CATEGORIES`) and kind."""
        return self.registry.components

    @property
    def infos(self) -> dict[str, PluginInfo]:
        """Every plugin, registered or failed to load, by name."""
        return self._infos_now()

    def _infos_now(self) -> dict[str, PluginInfo]:
        self._refresh()
        return {**self._infos, **{n: i for n, i in self._failed.items() if n not in self._infos}}

    def get(self, category: str, kind: str) -> Component:
        """The component registered for ``kind`` in ``category``."""
        return self.registry.get(category, kind)

    def _refresh(self) -> None:
        snapshot = tuple((n, p) for n, p in self.pm.list_name_plugin() if p is not None)
        if self._snapshot is not None and len(snapshot) == len(self._snapshot) and all(
                a[0] == b[0] and a[1] is b[1] for a, b in zip(snapshot, self._snapshot, strict=True)):
            return
        registry, infos = Registry(), {}
        for name, plugin in snapshot:
            source, version = self._sources.get(name, (IN_PROCESS, str(getattr(plugin, "__version__", ""))))
            info = infos[name] = PluginInfo(name, source, version)
            try:
                staged = self._collect(plugin, info, registry)
            except (Exception, SystemExit) as e:
                if source == BUILT_IN:
                    raise
                info.error = f"{type(e).__name__}: {e}" if not isinstance(e, PluginError) else str(e)
                if name not in self._sources:  # registered with pm.register directly: nobody else would see it
                    warnings.warn(f"headlab plugin {info.error}", stacklevel=3)
                continue
            for comp in staged:
                registry.components[comp.category][comp.kind] = comp
            info.components = staged
        self._registry, self._infos, self._snapshot = registry, infos, snapshot

    def _collect(self, plugin: Any, info: PluginInfo, registry: Registry) -> list[Component]:
        """Call ``plugin``'s hook implementations; returns its components (validated against ``registry``)."""
        unknown = [hc.name for hc in self.pm.get_hookcallers(plugin) or [] if not hc.has_spec()]
        if unknown:
            hooks = [c.hook for c in CATEGORIES.values()]
            hint = difflib.get_close_matches(unknown[0], hooks, n=1)
            raise PluginError(f"{info.name}: unknown hook {unknown[0]}"
                              + (f" (did you mean {hint[0]}?)" if hint else ""))
        staged: list[Component] = []
        for category in CATEGORIES.values():
            register = self._registrar(category, info, registry, staged)
            for impl in getattr(self.pm.hook, category.hook).get_hookimpls():
                if impl.plugin is plugin and not (impl.hookwrapper or impl.wrapper):
                    impl.function(*[{"register": register}[arg] for arg in impl.argnames])
        return staged

    def _registrar(self, category: Category, info: PluginInfo, registry: Registry,
                   staged: list[Component]) -> Callable[..., None]:
        def existing(kind: str) -> Component | None:
            return registry.components[category.name].get(kind) or next(
                (c for c in staged if c.category == category.name and c.kind == kind), None)

        def add(comp: Component) -> None:
            other = existing(comp.kind)
            if other is not None:
                raise PluginError(f"{info.name}: {category.label} kind '{comp.kind}' is already registered "
                                  f"by {other.plugin}")
            staged.append(comp)

        def check_default(kind: str) -> None:
            other = registry.default(category.name) or next(
                (c for c in staged if c.category == category.name and c.default), None)
            if other is not None:
                raise PluginError(f"{info.name}: default {category.label} '{kind}': '{other.kind}' of "
                                  f"{other.plugin} is already the default")

        def register_config(config: type[ComponentConfig], impl: Callable[..., Any], *,
                            default: bool = False, score: Callable[..., Any] | None = None,
                            aggregate: Callable[..., Any] | None = None) -> None:
            if not (isinstance(config, type) and issubclass(config, ComponentConfig)):
                raise PluginError(f"{info.name}: {category.name} config must subclass headlab.ComponentConfig")
            kind = config.kind_name()
            if not isinstance(kind, str):
                raise PluginError(f"{info.name}: {config.__name__}.kind needs a Literal default")
            if category.key != "kind" and config.model_fields["kind"].alias != category.key:
                raise PluginError(f"{info.name}: {category.label} config {config.__name__} is named by the spec key "
                                  f"'{category.key}': declare kind: Literal['{kind}'] = Field('{kind}', "
                                  f"alias='{category.key}')")
            if not callable(impl):
                raise PluginError(f"{info.name}: the implementation of {category.label} '{kind}' is not callable")
            if default:
                check_default(kind)
            if score is not None and (category.name != "decoders" or not callable(score)):
                raise PluginError(f"{info.name}: {category.label} '{kind}': only decoders take a callable score=")
            if aggregate is not None and (category.name != "metrics" or not callable(aggregate)):
                raise PluginError(f"{info.name}: {category.label} '{kind}': only metrics take a callable aggregate=")
            doc = (config.__doc__ or impl.__doc__ or "").strip().splitlines()
            add(Component(category.name, kind, config, impl, info.name, doc[0] if doc else "", bool(default),
                          score, aggregate))

        def register_action(name: str, config: Any, run: Callable[..., Any], description: str = "") -> None:
            if not (isinstance(name, str) and re.fullmatch(r"[A-Za-z][A-Za-z0-9_]*", name)) \
                    or name in RESERVED_ACTIONS or name.startswith("model_"):
                raise PluginError(f"{info.name}: action name {name!r} must be an identifier other than "
                                  f"{', '.join(sorted(RESERVED_ACTIONS))} (and not start with model_)")
            if not callable(run) or config is None:
                raise PluginError(f"{info.name}: action '{name}' needs a config type (or builder) and a "
                                  "callable run(config, ctx)")
            doc = (description or getattr(run, "__doc__", None) or "").strip().splitlines()
            add(Component(category.name, name, config, run, info.name, doc[0] if doc else ""))

        def register_model(name: str, load: Callable[..., Any], description: str = "", *,
                           default: bool = False) -> None:
            if not callable(load):
                raise PluginError(f"{info.name}: model '{name}' needs a callable load(spec)")
            if default:
                check_default(name)
            add(Component(category.name, name, None, load, info.name, description, bool(default)))

        return {"config": register_config, "action": register_action, "model": register_model}[category.style]


_manager: Manager | None = None


def get_manager(*, reload: bool = False) -> Manager:
    """The process-wide plugin manager (created on first use).

    ``reload`` builds a new one, reading the entry points again; plugins registered in process
    (:func:`register_plugin`) are registered on the new one too.
    """
    global _manager
    if _manager is None or reload:
        previous = _manager
        _manager = Manager()
        if previous is not None:
            for name, plugin in previous.pm.list_name_plugin():
                if plugin is not None and not _manager.pm.has_plugin(name) \
                        and previous._sources.get(name, (IN_PROCESS,))[0] == IN_PROCESS:
                    try:
                        _manager.register(plugin, name)
                    except PluginError as e:
                        warnings.warn(f"headlab plugin {e}", stacklevel=2)
    return _manager


def component(category: str, kind: str) -> Component:
    """The component registered for ``kind`` in ``category`` (see :data:`CATEGORIES`): its ``impl``, its
    ``config`` model, and a decoder's ``score`` or a metric's ``aggregate``. Raises :class:`PluginError`
    naming the category and kind when no plugin provides it."""
    return get_manager().get(category, kind)


def register_plugin(plugin: Any, name: str | None = None, *, replace: bool = False) -> str:
    """Register a plugin (a module, a class or an instance, e.g. defined in a notebook cell) now.

    Its ``headlab_register_*`` hooks are called at once: the spec models, :func:`headlab.json_schema`,
    ``headlab plugins`` and the widgets see its kinds immediately. ``name`` defaults to pluggy's
    (the module's or class's ``__name__``). ``replace`` unregisters a plugin of that name first (re-running
    a notebook cell). Returns the name; raises :class:`PluginError` (and registers nothing) when a hook
    registers something invalid, e.g. a kind another plugin registered (both plugins are named).
    """
    return get_manager().register(plugin, name, replace=replace)


def unregister_plugin(name: str) -> None:
    """Unregister the plugin called ``name`` (the name :func:`register_plugin` returned)."""
    get_manager().unregister(name)


def plugins_for_workers() -> list[tuple[str, Any]]:
    """The plugins of this process that a worker process may lack, as it receives them.

    Every plugin but the built-ins: those registered in process (:func:`register_plugin`) and those of
    installed distributions. ``(name, "module.name")`` for a module (the worker imports it by name, so
    it must be installed or on the worker's ``PYTHONPATH``), ``(name, object)`` for a class or instance
    (pickled: one defined in a notebook or script travels by value with cloudpickle, as Ray sends it).
    """
    mgr = get_manager()
    out: list[tuple[str, Any]] = []
    for name, plugin in mgr.pm.list_name_plugin():
        if plugin is None or mgr._sources.get(name, (IN_PROCESS,))[0] == BUILT_IN:
            continue
        if isinstance(plugin, types.ModuleType):
            if plugin.__name__ == "__main__":
                warnings.warn(f"plugin {name} is the __main__ module: other processes cannot import it; "
                              "register a class or put the hooks in an importable module", stacklevel=2)
                continue
            out.append((name, plugin.__name__))
        else:
            out.append((name, plugin))
    return out


def register_worker_plugins(plugins: list[tuple[str, Any]]) -> None:
    """Register in this (worker) process the plugins :func:`plugins_for_workers` listed in the driver's.

    A plugin already registered under its name is kept when it is the same object (a module, or an
    installed distribution's plugin), else replaced; one that cannot be imported here is skipped with a
    warning (a spec that uses its kinds then fails to validate, naming the kind).
    """
    mgr = get_manager()
    for name, ref in plugins:
        try:
            plugin = importlib.import_module(ref) if isinstance(ref, str) else ref
        except Exception as e:
            warnings.warn(f"headlab plugin {name} ({ref}) cannot be imported in this worker: {e}", stacklevel=2)
            continue
        current = mgr.pm.get_plugin(name)
        if current is plugin or (current is None and mgr.pm.get_name(plugin) is not None):
            continue
        mgr.register(plugin, name, replace=True)


def _is_headlab(dist: md.Distribution) -> bool:
    return re.sub(r"[-_.]+", "-", dist.name or "").lower() == "headlab"


def _builtin_plugins() -> list[types.ModuleType]:
    """The modules of the built-in plugins package (``BUILTIN_PACKAGE``) that implement a hook, by name."""
    package = importlib.import_module(BUILTIN_PACKAGE)
    found = []
    for info in sorted(pkgutil.walk_packages(package.__path__, f"{package.__name__}."), key=lambda i: i.name):
        if info.ispkg:
            continue
        module = importlib.import_module(info.name)
        if any(name.startswith("headlab_") and hasattr(obj, f"{GROUP}_impl") for name, obj in vars(module).items()):
            found.append(module)
    return found
