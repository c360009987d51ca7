"""Executors as components, without a Ray cluster: the category, the spec's ``execution``, the JSON
Schema, the CLI's ``--executor``, the one-line error without Ray, the local executor's failure records
and resume, the executor contract (a third-party executor on public names), stores at URLs, and cells
that were written but not marked done."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Literal

import pytest
import xarray as xr
from pydantic import Field

import headlab
from headlab.plugin_manager import CATEGORIES, PluginError, get_manager
from headlab.results import RunWriter
from headlab.runner import CellError, CellResult, Job, ModelCache, execute_cell

from fixtures.specs import spec_text

ROOT = Path(__file__).parent.parent
STEPS = "  - id: prev\n    detect: {kind: previous_token}\n  - id: ind\n    detect: {kind: induction}\n"
SWEEP = "  task.length: [4, 5, 6]\n"


def cli(*args: str, code: str = "", env: dict | None = None) -> subprocess.CompletedProcess:
    """``headlab ARGS`` in a subprocess, after running ``code`` there."""
    prog = f"{code}\nimport sys\nfrom headlab.cli import main\nsys.argv = ['headlab', *{list(args)!r}]\nmain()\n"
    return subprocess.run([sys.executable, "-c", prog], capture_output=True, text=True, cwd=ROOT, timeout=300,
                          env=env)


def test_executors_are_a_category_listed_by_plugins_and_in_the_schema():
    assert CATEGORIES["executors"].hook == "headlab_register_executors" and CATEGORIES["executors"].key == "executor"
    mgr = get_manager()
    assert {"local", "ray"} <= set(mgr.components["executors"])
    assert mgr.registry.default("executors").kind == "local"
    res = cli("plugins", "--json")
    assert res.returncode == 0, res.stderr
    listed = {(c["category"], c["kind"]) for row in json.loads(res.stdout) for c in row["components"]}
    assert {("executors", "local"), ("executors", "ray")} <= listed
    schema = headlab.json_schema()
    execution = schema["properties"]["execution"]
    union = next(m for m in execution["anyOf"] if "discriminator" in m)
    assert union["discriminator"]["propertyName"] == "executor"
    assert set(union["discriminator"]["mapping"]) >= {"local", "ray"}
    ray = schema["$defs"]["RayExecutor"]["properties"]
    assert {"executor", "address", "num_gpus_per_cell", "num_cpus_per_cell", "max_retries"} <= set(ray)
    assert ray["max_retries"]["default"] == 2 and ray["num_gpus_per_cell"]["default"] == 0


def test_execution_in_the_spec():
    loaded = headlab.load_spec(spec_text(STEPS))
    assert loaded.spec.execution.kind == "local"
    text = spec_text(STEPS) + "execution: {executor: ray, address: auto, num_cpus_per_cell: 2, max_retries: 0}\n"
    ex = headlab.load_spec(text).spec.execution
    assert (ex.kind, ex.address, ex.num_cpus_per_cell, ex.max_retries, ex.num_gpus_per_cell) == ("ray", "auto", 2, 0, 0)
    assert json.loads(headlab.load_spec(text).spec.model_dump_json(by_alias=True))["execution"]["executor"] == "ray"
    assert headlab.load_spec(spec_text(STEPS) + "execution: ray\n").spec.execution.kind == "ray"
    with pytest.raises(headlab.SpecError, match=r":9:\d+: execution: unknown executor kind 'rya' \(did you mean 'ray'"):
        headlab.load_spec(spec_text(STEPS) + "execution:\n  executor: rya\n")
    with pytest.raises(headlab.SpecError, match=r":11:3: execution.num_gpus: unknown key 'num_gpus'"):
        headlab.load_spec(spec_text(STEPS) + "execution:\n  executor: ray\n  num_gpus: 1\n")
    with pytest.raises(headlab.SpecError, match=r"execution.max_retries: Input should be greater than or equal to 0"):
        headlab.load_spec(spec_text(STEPS) + "execution:\n  executor: ray\n  max_retries: -1\n")
    # the CLI's --executor/--address: another executor starts from its defaults, the same one keeps its options
    ray = headlab.load_spec(text)
    assert ray.with_execution({"address": "ray://h:10001"}).spec.execution.num_cpus_per_cell == 2
    assert ray.with_execution({"executor": "local"}).spec.execution.kind == "local"
    with pytest.raises(headlab.SpecError, match="execution.address: unknown key 'address'"):
        loaded.with_execution({"address": "auto"})


def test_executor_ray_without_ray_is_one_line(tmp_path):
    spec = tmp_path / "s.yaml"
    spec.write_text(spec_text(STEPS, out=str(tmp_path / "runs")))
    res = cli("run", str(spec), "--executor", "ray", code="import sys\nsys.modules['ray'] = None")
    assert res.returncode == 2
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert lines == ["error: executor 'ray' needs Ray, which is not installed: pip install 'headlab[ray]'"], res.stderr
    assert not (tmp_path / "runs").exists()  # no store is created


def test_local_failure_is_recorded_and_resume_finishes(tmp_path):
    import executor_plugins

    name = headlab.register_plugin(executor_plugins, replace=True)
    try:
        fault = tmp_path / "fault"
        fault.write_text("on")
        config = f"{{log: {tmp_path / 'log.txt'}, fail_value: 1, fail_while: {fault}}}"
        text = spec_text(f"  - id: p\n    probe: {config}\n", sweep="  p.value: [0, 1, 2]\n")
        with pytest.raises(headlab.StepError, match="injected fault"):  # names the step, its cause is the fault
            headlab.run(text, out=tmp_path / "runs")
        (path,) = (tmp_path / "runs").iterdir()
        failed = headlab.open_run(path)
        assert failed.status == "failed" and failed.cells_done == 1
        info = failed.failed_cells["c0001"]
        assert (info["step"], info["error"], info["values"]) == ("p", "RuntimeError: injected fault in cell value 1",
                                                                 {"p.value": 1})
        assert "executor_plugins.py" in info["traceback"]
        fault.unlink()
        seen = []
        resumed = headlab.run(None, resume=path, on_cell=lambda c: seen.append(c.index))
        assert seen == [1, 2] and resumed.status == "complete" and resumed.failed_cells == {}
        whole = headlab.run(text, out=tmp_path / "whole")
        for i in range(3):
            xr.testing.assert_identical(whole.cell(f"c{i:04d}", "p"), resumed.cell(f"c{i:04d}", "p"))
    finally:
        headlab.unregister_plugin(name)


class Reversed(headlab.ComponentConfig):
    """Run the cells last first, each through the worker path (a task, execute_cell, cell_done)."""

    kind: Literal["reversed"] = Field("reversed", alias="executor")


class ReversedExecutor:
    """A third-party executor, on public names only: the protocol a distributed executor follows."""

    order: list[int] = []

    @staticmethod
    @headlab.hookimpl
    def headlab_register_executors(register):
        def execute(config, job: Job) -> None:
            job.start()
            worker = ModelCache()
            for cell in reversed(job.cells):
                task = pickle.loads(pickle.dumps(job.task(cell)))  # what a worker process receives
                try:
                    result = execute_cell(task, worker)
                except CellError as e:
                    job.cell_failed(e.failure)
                    continue
                assert isinstance(result, CellResult)
                ReversedExecutor.order.append(cell.index)
                job.cell_done(result)

        register(Reversed, execute)


def test_a_third_party_executor_follows_the_protocol(tmp_path):
    name = headlab.register_plugin(ReversedExecutor, replace=True)
    try:
        text = spec_text(STEPS, sweep=SWEEP)
        local = headlab.run(text, out=tmp_path / "local")
        other = headlab.run(text, out=tmp_path / "other", execution={"executor": "reversed"})
        assert ReversedExecutor.order == [2, 1, 0] and other.attrs["executor"] == "reversed"
        assert other.status == "complete" and other.attrs["model_digest"] == local.attrs["model_digest"]
        for i in range(3):
            for step in ("prev", "ind"):
                xr.testing.assert_identical(local.cell(f"c{i:04d}", step), other.cell(f"c{i:04d}", step))
    finally:
        headlab.unregister_plugin(name)


def test_an_executor_config_must_be_named_by_executor():
    class Bad(headlab.ComponentConfig):
        kind: Literal["bad"] = "bad"

    class BadPlugin:
        @staticmethod
        @headlab.hookimpl
        def headlab_register_executors(register):
            register(Bad, lambda config, job: None)

    with pytest.raises(PluginError, match=r"alias='executor'"):
        headlab.register_plugin(BadPlugin)


def test_a_written_cell_is_finished_only_once_marked_done(tmp_path):
    run = headlab.run(spec_text(STEPS), out=tmp_path)
    writer = RunWriter(run.path)
    ds = run.cell("c0000", "prev")
    writer.write_cell("c0001", {}, {"prev": ds, "ind": ds}, {"started": 0.0}, done=False)
    reopened = headlab.open_run(run.path)
    assert reopened.cells_done == 1 and reopened.results["prev"].identical(run.results["prev"])
    writer.write_cell("c0002", {}, {"prev": ds}, {}, done=False)
    import zarr

    zarr.open_group(str(run.path), mode="r+")["cells/c0002"].attrs["steps"] = ["prev", "ind"]  # a step missing
    with pytest.raises(ValueError, match="c0002 is not completely written"):
        writer.mark_done("c0002")
    writer.mark_done("c0001", seconds=1.0)
    assert headlab.open_run(run.path).cells_done == 2


def test_a_store_at_an_fsspec_url(tmp_path):
    text = spec_text(STEPS, sweep=SWEEP)
    url = f"memory://headlab-test-{tmp_path.name}"
    run = headlab.run(text, out=url)
    assert run.location.startswith(url + "/test-") and run.status == "complete"
    again = headlab.open_run(run.location)
    local = headlab.run(text, out=tmp_path)
    for step in ("prev", "ind"):
        xr.testing.assert_identical(again.results[step], local.results[step])
    resumed = headlab.run(None, resume=run.location)
    assert resumed.cells_done == 3
