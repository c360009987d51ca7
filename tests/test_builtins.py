"""Built-in plugins are every module of ``headlab.plugins`` that implements a hook, registered through the
same hooks as third-party ones; the default model comes from the registry; ``headlab.component`` returns
registered components."""

from __future__ import annotations

import ast
import importlib.metadata as md
from pathlib import Path

import pytest

import headlab
from headlab.plugin_manager import BUILT_IN, GROUP, Component, Registry, get_manager
from headlab.spec import ModelSpec, build_spec_model, load_spec

ROOT = Path(__file__).parent.parent


def hook_modules() -> set[str]:
    """The modules under plugins/ that implement a ``headlab_register_*`` hook."""
    out = set()
    for path in (ROOT / "headlab" / "plugins").rglob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        if any(isinstance(n, ast.FunctionDef) and n.name.startswith("headlab_register_") for n in tree.body):
            out.add(".".join(("headlab.plugins", *path.relative_to(ROOT / "headlab" / "plugins").with_suffix("").parts)))
    return out


def test_the_builtins_are_every_module_of_the_plugins_package_with_a_hook():
    mgr = get_manager()
    builtins = [name for name, info in mgr.infos.items() if info.source == BUILT_IN]
    assert builtins == sorted(hook_modules())  # registered first, in the order of their names
    assert list(mgr.infos)[: len(builtins)] == builtins
    assert {c.plugin for comps in mgr.components.values() for c in comps.values()} >= {
        "headlab.plugins.decoding.greedy", "headlab.plugins.models.embedded"}
    assert "headlab.plugins.decoding.common" not in builtins  # a helper module without hooks is no plugin
    # headlab's distribution declares none of them as entry points: the package tree is the one list
    assert not [ep for ep in md.entry_points(group=GROUP) if ep.value.startswith("headlab.plugins.")]


def test_core_names_no_plugin_module_and_no_model():
    for path in (ROOT / "headlab" / "plugin_manager.py", *sorted((ROOT / "headlab" / "spec").glob("*.py"))):
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
