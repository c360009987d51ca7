"""Hostile input, round two (issue [robustness]), where runs are stored, listed and computed: a stored run whose
attributes are JSON of the wrong types, `headlab runs` of what is no directory, a plugin's resource estimate that
raises, a result dataset with its own `prompt`, disk-write errors of every kind, and Ray that cannot start under
an address-space limit. Each case goes through the command line as a user types it: exit code and one line."""

from __future__ import annotations

import builtins
import errno
import json
import os
import shutil
from typing import Literal

import numpy as np
import pytest
import xarray as xr

import headlab
from headlab import ComponentConfig, hookimpl
from headlab.dims import head_array

from fixtures.cli import cli, command, error_line
from fixtures.specs import spec_text

STEPS = "  - id: ind\n    detect: {kind: induction}\n"


# --------------------------------------------------------------------------- stored runs of the wrong types
@pytest.fixture
def good_run(tmp_path, capfd, monkeypatch):
    """A finished run under ./runs (relative, so the listing's columns stay short), the cwd being tmp_path."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "s.yaml").write_text(spec_text(STEPS))
    code, err = cli(["run", "s.yaml", "--out", "runs"], capfd)
    assert code == 0, err
    (run,) = (tmp_path / "runs").iterdir()
    return run


def _damage(run, name: str, **attrs) -> str:
    bad = run.parent / name
    shutil.copytree(run, bad)
    meta = json.loads((bad / "zarr.json").read_text())
    meta["attributes"].update(attrs)
    (bad / "zarr.json").write_text(json.dumps(meta))
    return f"runs/{name}"


@pytest.mark.parametrize("attrs, message", [
    ({"cells_total": "x", "status": "failed"}, "attribute cells_total is 'x' (str), not a non-negative integer"),
    ({"steps": "ind"}, "attribute steps is 'ind' (str), not a list of step ids"),
    ({"sweep": [1, 2], "status": "running"}, "attribute sweep is [1, 2] (list), not a mapping of sweep keys"),
    ({"failed_cells": "c0000"}, "attribute failed_cells is 'c0000' (str), not a mapping of cells"),
])
def test_a_run_of_the_wrong_types_is_listed_damaged_beside_the_good_one(good_run, capfd, attrs, message):
    bad = _damage(good_run, "bad", **attrs)
    code, out, err = command(["runs", "runs"], capfd)
    assert code == 0 and "Traceback" not in err and "error:" not in err, err  # was: invalid literal for int()
    rows = {line.split("│")[1].strip(): line for line in out.splitlines() if line.startswith("│")}
    assert "complete" in rows[good_run.name], out
    assert f"damaged: {bad}/zarr.json: {message}" in rows[bad], out
    # `show` of it: one line naming the file, the attribute and the fix, exit 2
    code, err = cli(["show", bad], capfd)
    line = error_line(err)
    assert code == 2, err
    assert line.startswith(f"error: '{bad}' is a damaged run store: {bad}/zarr.json: {message}"), line
    assert "restore that file, or delete the run and run its spec again" in line, line


def test_runs_of_a_missing_directory_or_a_file_is_one_line(tmp_path, capfd, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, err = cli(["runs", "nowhere"], capfd)
    assert code == 2 and error_line(err).startswith("error: runs: no directory 'nowhere'; name the directory a "
                                                    "run's --out"), err
    (tmp_path / "s.yaml").write_text("name: t\n")
    code, err = cli(["runs", "s.yaml"], capfd)
    assert code == 2 and error_line(err).startswith("error: runs: 's.yaml' is a file, not a directory of runs"), err
    (tmp_path / "empty").mkdir()  # an empty directory is an empty listing, as before
    assert command(["runs", "empty"], capfd)[0] == 0


# --------------------------------------------------------------------------- a plugin's resource estimate raises
class Costly(ComponentConfig):
    """A detector whose resource estimate (or, for a task, size) raises."""

    kind: Literal["costly"] = "costly"
    error: str = "RuntimeError"

    def estimate(self, ctx):
        raise getattr(builtins, self.error)("the estimate's formula divided by zero heads")


def costly(config: Costly, ctx):
    raise AssertionError("the step never runs")


class CostlyTask(ComponentConfig):
    """A task whose size() raises."""

    kind: Literal["costly_task"] = "costly_task"

    def size(self):
        raise KeyError("n")


def costly_task(config: CostlyTask, ctx):
    return [headlab.Example(prompt="a b")]


class CostlyPlugin:
    @hookimpl
    def headlab_register_detectors(self, register):
        register(Costly, costly)

    @hookimpl
    def headlab_register_tasks(self, register):
        register(CostlyTask, costly_task)


@pytest.fixture
def costly_plugin():
    name = headlab.register_plugin(CostlyPlugin(), "costly-plugin")
    yield name
    headlab.unregister_plugin(name)


@pytest.mark.parametrize("error, code", [("RuntimeError", 1), ("ValueError", 2)])
def test_an_estimate_that_raises_names_the_step_the_component_and_its_plugin(costly_plugin, tmp_path, capfd,
                                                                            error, code):
    spec = tmp_path / "s.yaml"
    spec.write_text(spec_text(STEPS + f"  - id: c\n    detect: {{kind: costly, error: {error}}}\n"))
    got, err = cli(["run", str(spec), "--out", str(tmp_path / "runs")], capfd)
    line = error_line(err)
    assert got == code, err
    assert line.startswith(f"error: step 'c' (detector 'costly', plugin {costly_plugin}, in its estimate()): "
                           f"{error}: the estimate's formula divided by zero heads"), line
    assert not (tmp_path / "runs").exists()  # estimated before the store exists
    # a task's size() that raises: the task is named
    spec.write_text(spec_text(STEPS, task="{kind: costly_task}"))
    got, err = cli(["run", str(spec), "--out", str(tmp_path / "runs")], capfd)
    line = error_line(err)
    assert got == 1 and line.startswith(f"error: step 'ind' (task 'costly_task', plugin {costly_plugin}, in its "
                                        "size()): KeyError: 'n'"), line


# --------------------------------------------------------------------------- a result with its own `prompt`
class Prompted(ComponentConfig):
    """A detector whose result has a variable of the task's stored inputs."""

    kind: Literal["prompted"] = "prompted"
    variable: str = "prompt"


def prompted(config: Prompted, ctx):
    g = ctx.model.geometry
    score = head_array(np.ones((g.n_layers, g.n_heads)))
    values = np.array(["forged"] * len(ctx.examples), dtype=object)
    return xr.Dataset({"score": score, config.variable: ("example", values)})


class PromptedPlugin:
    @hookimpl
    def headlab_register_detectors(self, register):
        register(Prompted, prompted)


@pytest.mark.parametrize("variable, what", [("prompt", "prompts"), ("target", "targets")])
def test_a_result_with_its_own_prompt_is_refused_naming_the_variable(tmp_path, capfd, variable, what):
    name = headlab.register_plugin(PromptedPlugin(), "prompted-plugin")
    try:
        spec = tmp_path / "s.yaml"
        spec.write_text(spec_text(STEPS + f"  - id: p\n    detect: {{kind: prompted, variable: {variable}}}\n"))
        code, err = cli(["run", str(spec), "--out", str(tmp_path / "runs")], capfd)
    finally:
        headlab.unregister_plugin(name)
    line = error_line(err)
    assert code == 1, err
    assert line.startswith(f"error: step 'p' (detector 'prompted', plugin {name}): ContractError: the result cannot "
                           f"be stored: it has its own variable '{variable}', which would replace the task's {what} "
                           "that headlab stores"), line
    (run,) = (tmp_path / "runs").iterdir()
    assert headlab.open_run(run).partial_cells["c0000"]["steps"] == ["ind"]  # nothing forged was stored


# --------------------------------------------------------------------------- disk-write errors by errno
@pytest.mark.parametrize("code, advice, exit_code", [  # ENOSPC: tests/test_hostile_run.py
    (errno.EDQUOT, "free space (or raise the disk quota)", 1),
    (errno.EFBIG, "raise the file-size limit (ulimit -f) or free space", 1),
    (errno.EROFS, "make the store writable again", 2),
    (errno.EACCES, "make the store writable again", 2),
    (errno.EPERM, "make the store writable again", 2),
    (errno.EIO, "the system said errno 5 (EIO) while writing; fix that", 1),
])
def test_a_cell_write_error_gets_the_advice_of_its_errno(tmp_path, capfd, monkeypatch, code, advice, exit_code):
    from headlab.results import RunWriter

    def refuse(self, *args, **kwargs):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(RunWriter, "write_cell", refuse)
    spec = tmp_path / "s.yaml"
    spec.write_text(spec_text(STEPS))
    got, err = cli(["run", str(spec), "--out", str(tmp_path / "runs")], capfd)
    (run,) = (tmp_path / "runs").iterdir()
    line = error_line(err)
    assert got == exit_code, err
    assert f"cannot write cell c0000 into {run}/cells/c0000: {os.strerror(code)}; {advice}, then finish the run " \
           f"with `headlab run --resume {run}`" in line, line
    if code not in (errno.EDQUOT, errno.EFBIG):
        assert "free space" not in line, line


@pytest.mark.parametrize("code, advice, exit_code", [
    (errno.EDQUOT, "free space (or raise the disk quota) and run again", 1),
    (errno.EROFS, "choose a writable --out (or the spec's output:) and run again", 2),
    (errno.EACCES, "choose a writable --out (or the spec's output:) and run again", 2),
    (errno.EPERM, "choose a writable --out (or the spec's output:) and run again", 2),
    (errno.ENAMETOOLONG, "choose a shorter --out path (or the spec's output:; at most 255 bytes a part)", 2),
    (errno.EIO, "the system said errno 5 (EIO) while writing; fix that and run again", 1),
])
def test_a_store_that_cannot_be_created_gets_the_advice_of_its_errno(tmp_path, capfd, monkeypatch, code, advice,
                                                                      exit_code):
    from headlab.results import RunWriter

    def refuse(cls, path, attrs):
        raise OSError(code, os.strerror(code), str(path))

    monkeypatch.setattr(RunWriter, "create", classmethod(refuse))
    spec = tmp_path / "s.yaml"
    spec.write_text(spec_text(STEPS))
    got, err = cli(["run", str(spec), "--out", str(tmp_path / "runs")], capfd)
    line = error_line(err)
    assert got == exit_code, err
    assert f"cannot create the run store {tmp_path / 'runs'}/test-" in line, line
    assert f": {os.strerror(code)}; {advice}" in line, line
    if code != errno.EDQUOT:
        assert "free space" not in line, line


def test_an_out_path_with_a_name_too_long_is_one_line(tmp_path, capfd):
    spec = tmp_path / "s.yaml"
    spec.write_text(spec_text(STEPS))
    out = tmp_path / ("x" * 300)  # a real component over the file system's 255 bytes
    got, err = cli(["run", str(spec), "--out", str(out)], capfd)
    line = error_line(err)
    assert got == 2, err
    assert f"cannot create the run store {out}/test-" in line and "File name too long" in line, line
    assert "choose a shorter --out path (or the spec's output:; at most 255 bytes a part) and run again" in line
    assert "free space" not in line, line
