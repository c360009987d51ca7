"""Plugins: the hook contract, third-party packages via entry points, broken plugins, allow-listing."""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from headlab import hookspecs
from headlab.plugin_manager import HOOK_FOR, get_manager

from conftest import spec_text

ROOT = Path(__file__).parent.parent
EXAMPLE = ROOT / "examples" / "headlab-plugin-example"


def hook_names() -> list[str]:
    return [n for n, f in inspect.getmembers(hookspecs, inspect.isfunction) if n.startswith("headlab_")]


def test_every_hook_is_documented():
    docs = (ROOT / "docs" / "plugins.md").read_text()
    for name in hook_names():
        assert inspect.getdoc(getattr(hookspecs, name)), f"{name} has no docstring"
        assert f"`{name}`" in docs, f"{name} is missing from docs/plugins.md"
    assert set(HOOK_FOR.values()) | {"headlab_register_models"} == set(hook_names())


def test_builtins_register_through_the_hooks():
    mgr = get_manager()
    sources = {info.source for info in mgr.infos.values() if info.components}
    assert "built-in" in sources
    for comp in mgr.components["detectors"].values():
        assert comp.plugin in mgr.infos


def run_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "headlab.cli", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=300)


def fake_distribution(tmp_path: Path, name: str, module_code: str) -> dict:
    """A distribution on PYTHONPATH with a `headlab` entry point (no pip needed)."""
    (tmp_path / f"{name}.py").write_text(module_code)
    info = tmp_path / f"{name}-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[headlab]\n{name} = {name}\n")
    return {"PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}


def test_broken_plugin_is_reported_and_headlab_still_runs(tmp_path):
    env = fake_distribution(tmp_path, "broken_plugin", "raise ImportError('missing dependency xyz')\n")
    res = run_cli("plugins", "--json", env=env)
    assert res.returncode == 0, res.stderr
    rows = {r["name"]: r for r in json.loads(res.stdout)}
    assert "missing dependency xyz" in rows["broken_plugin"]["error"]
    assert rows["broken_plugin"]["source"] == "distribution broken_plugin"
    spec = tmp_path / "s.yaml"
    spec.write_text(spec_text("  - id: ind\n    detect: {kind: induction}\n"))
    assert run_cli("validate", str(spec), env=env).returncode == 0


def test_headlab_plugins_allow_list(tmp_path):
    code = ("from typing import Literal\nfrom headlab import ComponentConfig, hookimpl\n"
            "class M(ComponentConfig):\n    kind: Literal['always_one'] = 'always_one'\n"
            "def f(c, ex, out):\n    return [1.0] * len(out)\n"
            "@hookimpl\ndef headlab_register_metrics(register):\n    register(M, f)\n")
    env = fake_distribution(tmp_path, "tiny_metric_plugin", code)
    names = lambda extra: {r["name"] for r in json.loads(run_cli("plugins", "--json", env={**env, **extra}).stdout)}  # noqa: E731
    assert "tiny_metric_plugin" in names({})
    assert "tiny_metric_plugin" not in names({"HEADLAB_PLUGINS": "none"})
    assert "tiny_metric_plugin" in names({"HEADLAB_PLUGINS": "tiny_metric_plugin"})
    assert "tiny_metric_plugin" not in names({"HEADLAB_PLUGINS": "something_else"})


@pytest.fixture(scope="module")
def example_plugin_installed():
    pip = [sys.executable, "-m", "pip"]
    res = subprocess.run([*pip, "install", "-q", "--no-deps", "--no-build-isolation", str(EXAMPLE)],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr
    yield
    subprocess.run([*pip, "uninstall", "-q", "-y", "headlab-plugin-example"], capture_output=True, timeout=300)


def test_example_plugin_installs_lists_and_runs(example_plugin_installed, tmp_path):
    res = run_cli("plugins", "--json")
    rows = {r["name"]: r for r in json.loads(res.stdout)}
    example = rows["example"]
    assert example["source"] == "distribution headlab-plugin-example" and example["version"] == "0.2.0"
    assert {c["kind"] for c in example["components"]} == {"output_norm", "word_count"}
    assert "output_norm" in run_cli("schema").stdout
    steps = ("  - id: norms\n    detect: {kind: output_norm}\n"
             "  - id: gen\n    generate: {max_new_tokens: 3, metrics: [word_count]}\n")
    spec = tmp_path / "s.yaml"
    spec.write_text(spec_text(steps))
    res = run_cli("run", str(spec), "--out", str(tmp_path / "runs"))
    assert res.returncode == 0, res.stderr
    import headlab
    from headlab.model import from_config
    from headlab.spec import ModelSpec

    (run_dir,) = (tmp_path / "runs").iterdir()
    run = headlab.open_run(run_dir)
    score = run.results["norms"]["score"].values
    from conftest import TINY_LLAMA

    lm = from_config(ModelSpec(config=TINY_LLAMA), seed=0)  # same seed as the run -> same weights
    w = lm.model.model.layers[1].self_attn.o_proj.weight.detach()
    d = lm.geometry.head_dim
    np.testing.assert_allclose(score[1, 2], torch.linalg.matrix_norm(w[:, 2 * d:3 * d]).item(), rtol=1e-5)
    counts = run.results["gen"]["word_count"].values
    outputs = run.results["gen"]["output"].values
    assert counts.tolist() == [float(len(str(o).split())) for o in outputs]
