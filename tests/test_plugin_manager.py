"""Plugins: the hook contract, third-party packages via entry points, broken plugins, allow-listing,
in-process registration (a notebook cell) and third-party step actions."""

from __future__ import annotations

import importlib
import inspect
import json
import os
import subprocess
import sys
import types
from pathlib import Path
from typing import Literal

import numpy as np
import pytest
import torch
import xarray as xr
from pydantic import Field

import headlab
from headlab import hookspecs
from headlab.generation import DecodeRequest, tokenize
from headlab.plugin_manager import CATEGORIES, get_manager
from headlab.spec import StrictModel

from fixtures import cli
from fixtures.specs import TINY_LLAMA, spec_text

ROOT = Path(__file__).parent.parent
EXAMPLE = ROOT / "examples" / "headlab-plugin-example"


def hook_names() -> list[str]:
    return [n for n, f in inspect.getmembers(hookspecs, inspect.isfunction) if n.startswith("headlab_")]


def test_every_hook_is_documented():
    docs = (ROOT / "docs" / "plugins.md").read_text()
    for name in hook_names():
        assert inspect.getdoc(getattr(hookspecs, name)), f"{name} has no docstring"
        assert f"`{name}`" in docs, f"{name} is missing from docs/plugins.md"
    # every hook registers a component category, but headlab_register_commands (commands of the command line)
    assert {c.hook for c in CATEGORIES.values()} == set(hook_names()) - {"headlab_register_commands"}
    for c in CATEGORIES.values():  # the table of categories in the docs is the one in the code
        assert f"| `{c.name}` | `{c.hook}` |" in docs, f"category {c.name} is missing from docs/plugins.md"


def test_builtins_register_through_the_hooks():
    mgr = get_manager()
    sources = {info.source for info in mgr.infos.values() if info.components}
    assert "built-in" in sources
    for comp in mgr.components["detectors"].values():
        assert comp.plugin in mgr.infos


def run_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "headlab.cli", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=300)


def fake_distribution(tmp_path: Path, name: str, module_code: str) -> Path:
    """A distribution in ``tmp_path`` with a `headlab` entry point (no pip needed); put ``tmp_path`` on the path."""
    (tmp_path / f"{name}.py").write_text(module_code)
    info = tmp_path / f"{name}-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[headlab]\n{name} = {name}\n")
    return tmp_path


@pytest.fixture
def installed(monkeypatch):
    """``installed(path, **env)``: the plugin manager read anew, as a new ``headlab`` process would, with ``path``
    on ``sys.path`` (a distribution installed there) and ``env`` set; this process's own afterwards."""
    def load(path: Path | None = None, **env: str) -> None:
        if path is not None:
            monkeypatch.syspath_prepend(str(path))
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        get_manager(reload=True)

    yield load
    monkeypatch.undo()
    get_manager(reload=True)


def plugins_json(tmp_path: Path) -> dict[str, dict]:
    """``headlab plugins --json`` (in this process), by plugin name."""
    res = cli.run("plugins", "--json", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    return {r["name"]: r for r in json.loads(res.stdout)}


def test_broken_plugin_is_reported_and_headlab_still_runs(tmp_path, installed):
    installed(fake_distribution(tmp_path, "broken_plugin", "raise ImportError('missing dependency xyz')\n"))
    rows = plugins_json(tmp_path)
    assert "missing dependency xyz" in rows["broken_plugin"]["error"]
    assert rows["broken_plugin"]["source"] == "distribution broken_plugin"
    spec = tmp_path / "s.yaml"
    spec.write_text(spec_text("  - id: ind\n    detect: {kind: induction}\n"))
    res = cli.run("validate", str(spec), cwd=tmp_path)
    assert res.returncode == 0, res.stderr


def test_headlab_plugins_allow_list(tmp_path, installed):
    code = ("from typing import Literal\nfrom headlab import ComponentConfig, hookimpl\n"
            "class M(ComponentConfig):\n    kind: Literal['always_one'] = 'always_one'\n"
            "def f(c, ex, out):\n    return [1.0] * len(out)\n"
            "@hookimpl\ndef headlab_register_metrics(register):\n    register(M, f)\n")
    path = fake_distribution(tmp_path, "tiny_metric_plugin", code)
    installed(path)
    assert "tiny_metric_plugin" in plugins_json(tmp_path)
    for allow, listed in (("none", False), ("tiny_metric_plugin", True), ("something_else", False)):
        installed(HEADLAB_PLUGINS=allow)
        assert ("tiny_metric_plugin" in plugins_json(tmp_path)) == listed, allow


def test_a_broken_plugin_in_a_new_process_is_reported_too(tmp_path):
    """The same as an installed distribution that a new ``headlab`` process finds on its PYTHONPATH."""
    path = fake_distribution(tmp_path, "broken_plugin", "raise ImportError('missing dependency xyz')\n")
    res = run_cli("plugins", "--json", env={"PYTHONPATH": os.pathsep.join([str(path), os.environ.get("PYTHONPATH", "")])})
    assert res.returncode == 0, res.stderr
    assert "missing dependency xyz" in {r["name"]: r for r in json.loads(res.stdout)}["broken_plugin"]["error"]


@pytest.fixture(scope="module")
def example_plugin_installed():
    pip = [sys.executable, "-m", "pip"]
    res = subprocess.run([*pip, "install", "-q", "--no-deps", "--no-build-isolation", str(EXAMPLE)],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr
    importlib.invalidate_caches()
    get_manager(reload=True)  # as a new headlab process finds it
    yield
    subprocess.run([*pip, "uninstall", "-q", "-y", "headlab-plugin-example"], capture_output=True, timeout=300)
    importlib.invalidate_caches()
    get_manager(reload=True)


def test_example_plugin_installs_lists_and_runs(example_plugin_installed, tmp_path):
    example = plugins_json(tmp_path)["example"]
    assert example["source"] == "distribution headlab-plugin-example" and example["version"] == "0.3.0"
    assert {c["kind"] for c in example["components"]} == {"output_norm", "word_count", "head_temperature", "head_contrast"}
    assert "output_norm" in cli.run("schema", cwd=tmp_path).stdout
    steps = ("  - id: norms\n    detect: {kind: output_norm}\n"
             "  - id: gen\n    generate: {max_new_tokens: 3, metrics: [word_count]}\n")
    spec = tmp_path / "s.yaml"
    spec.write_text(spec_text(steps))
    res = cli.run("run", str(spec), "--out", str(tmp_path / "runs"), cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    import headlab
    from headlab.model import from_config
    from headlab.spec import ModelSpec

    (run_dir,) = (tmp_path / "runs").iterdir()
    run = headlab.open_run(run_dir)
    score = run.results["norms"]["score"].values
    from fixtures.specs import TINY_LLAMA

    lm = from_config(ModelSpec(config=TINY_LLAMA), seed=0)  # same seed as the run -> same weights
    w = lm.model.model.layers[1].self_attn.o_proj.weight.detach()
    d = lm.geometry.head_dim
    np.testing.assert_allclose(score[1, 2], torch.linalg.matrix_norm(w[:, 2 * d:3 * d]).item(), rtol=1e-5)
    counts = run.results["gen"]["word_count"].values
    outputs = run.results["gen"]["output"].values
    assert counts.tolist() == [float(len(str(o).split())) for o in outputs]


# --- in-process registration (a notebook cell), actions as components ------------------------------

CELL_STEPS = "  - id: const\n    detect: {kind: const_heads, value: 0.25}\n"


class ConstHeads(headlab.ComponentConfig):
    """Every head scores `value` (a detector defined 'in a notebook cell')."""

    kind: Literal["const_heads"] = "const_heads"
    value: float = 1.0


def const_heads(config: ConstHeads, ctx) -> xr.Dataset:
    geo = ctx.model.geometry
    return xr.Dataset({"score": (("layer", "head"), np.full((geo.n_layers, geo.n_heads), config.value))})


class CellPlugin:
    """A plugin class as a notebook cell would define it: hooks without `self`."""

    @headlab.hookimpl
    def headlab_register_detectors(register):
        register(ConstHeads, const_heads)


@pytest.fixture
def registered():
    """Register plugins for one test; whatever is still registered afterwards is unregistered."""
    names: list[str] = []

    def register(plugin, name=None, **kw):
        names.append(headlab.register_plugin(plugin, name, **kw))
        return names[-1]

    yield register
    for name in names:
        if get_manager().pm.has_plugin(name):
            headlab.unregister_plugin(name)


def test_cell_plugin_is_seen_at_once_and_gone_after_unregister(registered, tmp_path):
    from typer.testing import CliRunner

    from headlab.cli import app

    text = spec_text(CELL_STEPS)
    with pytest.raises(headlab.SpecError, match="unknown detector kind 'const_heads'"):
        headlab.load_spec(text)
    name = registered(CellPlugin)
    assert name == "CellPlugin"
    assert headlab.load_spec(text).spec.steps[0].detect.value == 0.25
    assert "const_heads" in json.dumps(headlab.json_schema())
    listed = {r["name"]: r for r in json.loads(CliRunner().invoke(app, ["plugins", "--json"]).stdout)}
    assert listed["CellPlugin"]["source"] == "in-process"
    assert listed["CellPlugin"]["components"][0]["kind"] == "const_heads"
    run = headlab.run(text, out=tmp_path)
    assert (run.results["const"]["score"].values == 0.25).all()
    assert run.results["const"].attrs["method"] == "const_heads"
    if importlib.util.find_spec("ipywidgets") is not None:
        from headlab.widgets import SpecRunner

        assert SpecRunner(text, out=tmp_path).error is None
    headlab.unregister_plugin(name)
    with pytest.raises(headlab.SpecError, match="unknown detector kind 'const_heads'"):
        headlab.load_spec(text)
    assert "const_heads" not in json.dumps(headlab.json_schema())
    assert "CellPlugin" not in get_manager().infos
    if importlib.util.find_spec("ipywidgets") is not None:
        assert "unknown detector kind" in str(SpecRunner(text, out=tmp_path).error)
    with pytest.raises(headlab.PluginError, match="no plugin named 'CellPlugin'"):
        headlab.unregister_plugin("CellPlugin")


def test_modules_instances_and_pluggy_register_work_too(registered):
    module = types.ModuleType("cell_module")

    @headlab.hookimpl
    def headlab_register_detectors(register):
        register(ConstHeads, const_heads)

    module.headlab_register_detectors = headlab_register_detectors
    assert registered(module) == "cell_module"
    assert "const_heads" in get_manager().components["detectors"]
    headlab.unregister_plugin("cell_module")

    class WithSelf:
        @headlab.hookimpl
        def headlab_register_detectors(self, register):
            register(ConstHeads, const_heads)

    registered(WithSelf(), "instance")
    assert get_manager().get("detectors", "const_heads").plugin == "instance"
    headlab.unregister_plugin("instance")
    # pluggy's own registration: components are collected again when the set of plugins changes
    pm = get_manager().pm
    pm.register(module, name="raw")
    try:
        assert get_manager().get("detectors", "const_heads").plugin == "raw"
        assert headlab.load_spec(spec_text(CELL_STEPS))
    finally:
        pm.unregister(name="raw")
    assert "const_heads" not in get_manager().components["detectors"]


def test_registering_an_existing_kind_names_both_plugins(registered):
    from headlab.plugins.detectors.patterns import Induction

    class Clash:
        @headlab.hookimpl
        def headlab_register_detectors(register):
            register(ConstHeads, const_heads)
            register(Induction, const_heads)

    with pytest.raises(headlab.PluginError) as info:
        registered(Clash)
    assert "Clash" in str(info.value) and "headlab.plugins.detectors.patterns" in str(info.value)
    assert "kind 'induction'" in str(info.value)
    # nothing of it stays registered, its valid kind included
    assert "Clash" not in get_manager().infos and "const_heads" not in get_manager().components["detectors"]
    registered(CellPlugin)
    with pytest.raises(headlab.PluginError, match="already registered"):
        registered(CellPlugin)
    registered(CellPlugin, replace=True)
    assert get_manager().get("detectors", "const_heads").plugin == "CellPlugin"


def test_invalid_registrations_are_clear_errors(registered):
    from headlab.plugins.decoding.greedy import Greedy

    class Default(headlab.ComponentConfig):
        kind: Literal["my_default"] = "my_default"

    class SecondDefault:
        @headlab.hookimpl
        def headlab_register_decoders(register):
            register(Default, lambda config, request: None, default=True)

    with pytest.raises(headlab.PluginError, match="'greedy' of headlab.plugins.decoding.greedy is already the default"):
        registered(SecondDefault)

    class Typo:
        @headlab.hookimpl
        def headlab_register_detector(register):
            register(ConstHeads, const_heads)

    with pytest.raises(headlab.PluginError, match="did you mean headlab_register_detectors"):
        registered(Typo)

    class ReservedAction:
        @headlab.hookimpl
        def headlab_register_actions(register):
            register("task", Greedy, lambda config, ctx: None)

    with pytest.raises(headlab.PluginError, match="action name 'task'"):
        registered(ReservedAction)
    assert set(get_manager().components["actions"]) == {"detect", "generate", "score", "evaluate", "prune_curve", "sav",
                                                     "atlas"}


def test_plugin_exiting_at_import_does_not_kill_headlab(tmp_path, monkeypatch):
    from headlab.plugin_manager import Manager

    fake_distribution(tmp_path, "exiting_plugin", "raise SystemExit(3)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    info = Manager().infos["exiting_plugin"]
    assert info.error == "SystemExit: 3" and info.source == "distribution exiting_plugin" and not info.components
    monkeypatch.setenv("HEADLAB_PLUGINS", "none")
    assert "exiting_plugin" not in Manager().infos


# A third-party action, written against public names only: it needs no change to headlab's core.

def patch_config(types):
    """The config of a `patch` step: holds the decoder union (default: the registered default decoder)."""
    Decoder = types.union("decoders")
    default = types.default("decoders")

    class Patch(StrictModel):
        """Scale each example's token count (a toy action)."""

        decode: Decoder = Field(default_factory=default)
        scale: float = 1.0

    return Patch


def patch(config, ctx) -> xr.Dataset:
    """Store `scale * tokens` per example and the greedy decoding of one new token."""
    decoded = get_manager().get("decoders", config.decode.kind).impl(
        config.decode, DecodeRequest(ctx.model, tokenize(ctx.model, ctx.examples), 1, seed=ctx.seed, ctx=ctx))
    scaled = [config.scale * len(ex.input_ids) for ex in ctx.examples]
    return xr.Dataset({"scaled": ("example", np.array(scaled)),
                       "next_token": ("example", np.array([t[0] for t in decoded.tokens]))},
                      attrs={"decoder": config.decode.kind})


@headlab.hookimpl
def headlab_register_actions(register):
    register("patch", patch_config, patch, description="scale token counts (toy action)")


def test_a_third_party_action_runs_from_a_spec(registered, tmp_path):
    import torch

    from headlab.model import from_config
    from headlab.runner import build_examples
    from headlab.spec import ModelSpec

    steps = "  - id: ind\n    detect: {kind: induction}\n  - id: p\n    patch: {scale: 2.0}\n"
    text = spec_text(steps, sweep="  p.decode.kind: [greedy, sample]\n")
    with pytest.raises(headlab.SpecError, match="unknown key 'patch'"):
        headlab.load_spec(text)
    registered(sys.modules[__name__], "toy_actions")
    assert "patch" in headlab.json_schema()["$defs"]["Step"]["properties"]
    with pytest.raises(headlab.SpecError, match="unknown key 'scal'"):
        headlab.load_spec(text.replace("scale:", "scal:"))
    with pytest.raises(headlab.SpecError, match="exactly one action: detect, evaluate, generate, prune_curve, score, atlas, sav or patch"):
        headlab.load_spec(text.replace("detect: {kind: induction}\n", "detect: {kind: induction}\n    patch: {}\n"))
    loaded = headlab.load_spec(text)
    assert loaded.spec.steps[1].patch.decode.kind == "greedy"  # the default decoder, named by no core code
    run = headlab.run(loaded, out=tmp_path)
    ds = run.results["p"]
    assert ds.attrs["action"] == "patch" and json.loads(ds.attrs["config"])["scale"] == 2.0
    assert list(ds["p.decode.kind"].values) == ["greedy", "sample"]
    lm = from_config(ModelSpec(config=TINY_LLAMA), seed=0)
    examples = build_examples(loaded.spec.task, lm, 0)
    expected = [2.0 * len(ex.input_ids) for ex in examples]
    np.testing.assert_array_equal(ds["scaled"].sel({"p.decode.kind": "greedy"}).values, expected)
    with torch.no_grad():
        logits = lm.model(input_ids=torch.tensor([ex.input_ids for ex in examples])).logits[:, -1]
    greedy_next = ds["next_token"].sel({"p.decode.kind": "greedy"}).values
    assert greedy_next.tolist() == logits.argmax(-1).tolist()


def test_the_default_decoder_is_whatever_a_plugin_registers_as_default():
    from headlab.plugin_manager import Manager

    class Mine(headlab.ComponentConfig):
        """A decoder registered as the default."""

        kind: Literal["mine"] = "mine"

    class MinePlugin:
        @headlab.hookimpl
        def headlab_register_decoders(register):
            register(Mine, lambda config, request: None, default=True)

    mgr = Manager(entry_points=False)  # not the process-wide manager: other tests keep their built-ins
    text = spec_text("  - id: gen\n    generate: {max_new_tokens: 2}\n")
    assert headlab.load_spec(text, registry=mgr.registry).spec.steps[0].generate.decode.kind == "greedy"
    mgr.unregister("headlab.plugins.decoding.greedy")
    with pytest.raises(headlab.SpecError, match="steps\\[0\\].generate.decode: missing required key 'decode'"):
        headlab.load_spec(text, registry=mgr.registry)
    mgr.register(MinePlugin)
    assert headlab.load_spec(text, registry=mgr.registry).spec.steps[0].generate.decode.kind == "mine"
    schema = headlab.json_schema(mgr.registry)
    assert schema["$defs"]["Generate"]["properties"]["decode"]["description"] == "decoding strategy (default: mine)"


def test_core_names_no_action_and_no_decoder():
    """The spec package and runner.py dispatch by the registry: no built-in action or decoder is named there."""
    for path in (*sorted((ROOT / "headlab" / "spec").glob("*.py")), ROOT / "headlab" / "runner.py"):
        source = path.read_text()
        for literal in ('"greedy"', "'greedy'", '"detect"', '"generate"', '"score"', "mc_metrics"):
            assert literal not in source, f"{path.name} names {literal}"


def test_every_register_option_is_documented():
    """Each keyword option of a ``"config"`` category's ``register`` (``default=``, ``score=``, ``aggregate=``)
    is in docs/plugins.md and in the docstring of a hook that takes it."""
    seen: dict[str, object] = {}

    class Probe:
        @staticmethod
        @headlab.hookimpl
        def headlab_register_metrics(register):
            seen["register"] = register

    name = headlab.register_plugin(Probe, name="register-probe", replace=True)
    try:
        options = [p.name for p in inspect.signature(seen["register"]).parameters.values() if p.kind == p.KEYWORD_ONLY]
    finally:
        headlab.unregister_plugin(name)
    assert {"default", "score", "aggregate"} <= set(options)
    docs = (ROOT / "docs" / "plugins.md").read_text()
    hook_docs = " ".join(inspect.getdoc(getattr(hookspecs, n)) or "" for n in hook_names())
    for option in options:
        assert f"{option}=" in docs, f"register option {option}= is missing from docs/plugins.md"
        assert f"{option}=" in hook_docs, f"register option {option}= is in no hook's docstring"
