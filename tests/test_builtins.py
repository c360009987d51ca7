"""Built-in plugins are found like third-party ones (entry points of headlab's own distribution), the
default model comes from the registry, and ``headlab.component`` returns registered components."""

from __future__ import annotations

import ast
import importlib.metadata as md
import sys
from pathlib import Path

import pytest

import headlab
from headlab.plugin_manager import BUILT_IN, GROUP, Component, Registry, get_manager
from headlab.spec import ModelSpec, build_spec_model, load_spec

ROOT = Path(__file__).parent.parent


def declared_entry_points() -> dict[str, str]:
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - Python 3.10
        import tomli as tomllib
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]["entry-points"][GROUP]


def hook_modules() -> set[str]:
    """The modules under plugins/ that implement a ``headlab_register_*`` hook."""
    out = set()
    for path in (ROOT / "plugins").rglob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        if any(isinstance(n, ast.FunctionDef) and n.name.startswith("headlab_register_") for n in tree.body):
            out.add(".".join(("headlab.plugins", *path.relative_to(ROOT / "plugins").with_suffix("").parts)))
    return out


def test_every_plugin_module_is_declared_and_installed_as_an_entry_point():
    declared = declared_entry_points()
    assert set(declared.values()) == hook_modules()
    assert all(name == module for name, module in declared.items())  # a built-in is named by its module
    installed = {ep.name: ep.value for ep in md.distribution("headlab").entry_points.select(group=GROUP)}
    assert installed == declared, "the installed metadata is stale: pip install --no-deps --no-build-isolation -e ."


def test_the_builtins_are_the_entry_points_of_headlabs_distribution():
    mgr = get_manager()
    builtins = [name for name, info in mgr.infos.items() if info.source == BUILT_IN]
    assert builtins == sorted(declared_entry_points())  # registered first, in the order of their names
    assert list(mgr.infos)[: len(builtins)] == builtins
    assert {c.plugin for comps in mgr.components.values() for c in comps.values()} >= {
        "headlab.plugins.decoding.greedy", "headlab.plugins.models.embedded"}


def test_core_names_no_plugin_module_and_no_model():
    for path in (ROOT / "core" / "plugin_manager.py", *sorted((ROOT / "core" / "spec").glob("*.py"))):
        source = path.read_text()
        assert "headlab.plugins." not in source.replace("``headlab.plugins``", ""), path
        assert '"headlab-tiny"' not in source, path


def _registry(*models: tuple[str, bool]) -> Registry:
    """The built-ins' registry with its models replaced by ``(name, default)``."""
    base = get_manager().registry
    comps = {c: dict(v) for c, v in base.components.items()}
    comps["models"] = {name: Component("models", name, None, lambda spec: None, "test", default=default)
                       for name, default in models}
    return Registry(comps)


def test_the_default_model_is_the_registrys():
    assert get_manager().registry.default("models").kind == "headlab-tiny"
    assert ModelSpec().id == "headlab-tiny"
    text = "task: {kind: repeated_tokens, n: 2, length: 4}\nsteps:\n  - id: a\n    detect: {kind: induction}\n"
    assert load_spec(text).spec.model.id == "headlab-tiny"
    other = _registry(("headlab-tiny", False), ("other-model", True))
    for spec in (text, "model: {dtype: bfloat16}\n" + text):
        loaded = load_spec(spec, registry=other)
        assert loaded.spec.model.id == "other-model"
    assert load_spec("model: {path: /x}\n" + text, registry=other).spec.model.id is None
    assert build_spec_model(other).model_validate(load_spec(text).data).model.id == "other-model"
    with pytest.raises(headlab.SpecError, match="no model is registered as the default"):
        load_spec(text, registry=_registry(("headlab-tiny", False)))


def test_a_second_default_model_is_refused():
    class Models:
        @staticmethod
        @headlab.hookimpl
        def headlab_register_models(register):
            register("another-default", lambda spec: None, "a second default", default=True)

    with pytest.raises(headlab.PluginError, match="default model 'another-default': 'headlab-tiny' of "
                                                  "headlab.plugins.models.embedded is already the default"):
        headlab.register_plugin(Models, name="second-default-model")
    assert "another-default" not in get_manager().components["models"]


def test_component_returns_the_registered_component():
    greedy = headlab.component("decoders", "greedy")
    assert greedy is get_manager().registry.components["decoders"]["greedy"]
    assert greedy.default and greedy.score is not None and greedy.config.kind_name() == "greedy"
    with pytest.raises(headlab.PluginError, match="no decoders plugin provides kind 'gready'"):
        headlab.component("decoders", "gready")
    with pytest.raises(headlab.PluginError, match="no component category 'decoder'"):
        headlab.component("decoder", "greedy")
