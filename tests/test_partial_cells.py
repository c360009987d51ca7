"""Partial cells: a step that fails (or is interrupted) at run time keeps the steps of its cell that completed
before it in the run store, marked partial and read with ``Run.results``; the error line, the exit code and
the run's status stay as they were, ``headlab show`` lists the kept steps, and ``--resume`` computes the cell
again as a whole. Through the command line as a user types it, in process and through the worker path
(``execute_cell``)."""

from __future__ import annotations

import json
import os
import pickle
import re
from pathlib import Path
from typing import Literal

import pytest
import xarray as xr
import zarr
from pydantic import Field

import headlab
from headlab import ComponentConfig, StepError, hookimpl
from headlab.report import render_report
from headlab.results import RunWriter
from headlab.runner import CellError, Job, ModelCache, execute_cell

from fixtures.cli import command, error_line
from fixtures.specs import spec_text

PATCHING = "plugin headlab.plugins.detectors.activation_patching"
# a tiny random model on the embedded model's word tokenizer (every word of the pairs below is one token)
LLAMA = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 811, "max_position_embeddings": 256,
         "tokenizer": "headlab-tiny"}
ROWS = [{"clean": "red : blue , green : cat . red :", "corrupt": "red : blue , green : cat . green :",
         "answer": "blue", "wrong": "cat"},
        {"clean": "red : dog , green : bird . green :", "corrupt": "red : dog , green : bird . red :",
         "answer": "bird", "wrong": "dog"}]


def write_spec(folder: Path, steps: str, rows: list[dict]) -> None:
    """``spec.yaml`` and its ``pairs.jsonl`` (a path relative to the folder the user runs in)."""
    (folder / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "spec.yaml").write_text(f"name: circuits\nmodel: {{config: {json.dumps(LLAMA)}}}\n"
                                      f"task: {{kind: pairs, path: pairs.jsonl}}\nsteps:\n{steps}")


def without_mark(ds: xr.Dataset) -> xr.Dataset:
    """``ds`` without the attribute that marks the steps of partial cells."""
    ds = ds.copy()
    ds.attrs.pop("partial_cells", None)
    return ds


# --- a real run-time failure: activation patching on pairs whose corruption changes nothing -------------------

def test_a_step_failing_at_run_time_keeps_the_steps_before_it(tmp_path, capfd, monkeypatch):
    same = [{**row, "corrupt": row["clean"]} for row in ROWS]
    write_spec(tmp_path, "  - id: dla\n    detect: {kind: direct_logit_attribution}\n"
                         "  - id: patch\n    detect: {kind: activation_patching}\n", same)
    monkeypatch.chdir(tmp_path)
    code, _, err = command(["run", "spec.yaml", "--out", "runs"], capfd)
    assert code == 2
    line = error_line(err)  # the line is the one it was before partial cells were kept
    assert line.startswith(f"error: step 'patch' (detector 'activation_patching', {PATCHING}): ValueError: "
                           "activation_patching: the mean metric is the same on the clean and the corrupted "
                           "prompts"), line
    (store,) = (tmp_path / "runs").iterdir()
    run = headlab.Run(store)
    assert run.status == "failed" and run.cells_done == 0 and set(run.failed_cells) == {"c0000"}
    assert run.problems == [] and run.check() is run  # an intact partial cell is no damage
    info = run.partial_cells["c0000"]
    assert (info["values"], info["steps"], info["failed_step"]) == ({}, ["dla"], "patch")
    assert info["error"].startswith("ValueError: activation_patching: the mean metric is the same")
    assert set(run.results) == {"dla"} and run.results["dla"].attrs["partial_cells"] == ["c0000"]
    assert RunWriter(store).done_cells() == set()  # resume computes it

    write_spec(tmp_path, "  - id: dla\n    detect: {kind: direct_logit_attribution}\n", same)
    alone = headlab.run(tmp_path / "spec.yaml", out=tmp_path / "alone")  # the first step by itself
    xr.testing.assert_identical(without_mark(run.results["dla"]), alone.results["dla"])
    assert float(abs(run.results["dla"]["logit_diff"]).max()) > 0  # a real score, not fill values

    code, out, _ = command(["show", str(store)], capfd)
    assert code == 0
    assert "circuits failed, 0/1 cells" in out
    assert ("partial cell c0000: kept steps dla (shown below); step 'patch' failed: ValueError: activation_patching: "
            "the mean metric is the same on the clean and the corrupted prompts") in out, out
    assert re.search(r"^dla +detect direct_logit_attribution +top head +L\dH\d ", out, re.M), out
    assert "patch: no result stored (the step failed or has not run)" in out, out
    html = render_report(store)
    assert "partial cell c0000" in html and 'id="step-dla"' in html


# --- a test plugin whose step fails (or is interrupted) while a file exists ------------------------------------

class Flaky(ComponentConfig):
    """Twice the ``ind`` step's score plus ``value``; raises (``interrupt``: KeyboardInterrupt, else ValueError)
    in the cell whose ``value`` is ``fail_value`` while the file ``fail_while`` exists."""

    kind: Literal["flaky"] = "flaky"
    value: int = 0
    fail_value: int = 0
    fail_while: str = ""
    interrupt: bool = False


def flaky(config: Flaky, ctx) -> xr.Dataset:
    if config.fail_while and config.value == config.fail_value and os.path.exists(config.fail_while):
        if config.interrupt:
            raise KeyboardInterrupt
        raise ValueError(f"flaky: cell value {config.value} fails")
    return xr.Dataset({"score": 2 * ctx.results["ind"]["score"] + config.value})


class InWorker(ComponentConfig):
    """Each cell through the worker's path: a pickled task, execute_cell, cell_done or cell_failed."""

    kind: Literal["in_worker"] = Field("in_worker", alias="executor")


def in_worker(config: InWorker, job: Job) -> None:
    job.start()
    worker = ModelCache()
    for cell in job.cells:
        task = pickle.loads(pickle.dumps(job.task(cell)))  # what a worker process receives
        try:
            result = execute_cell(task, worker)
        except CellError as e:
            job.cell_failed(e.failure)
            continue
        job.cell_done(result)


class FlakyPlugin:
    @staticmethod
    @hookimpl
    def headlab_register_detectors(register):
        register(Flaky, flaky)

    @staticmethod
    @hookimpl
    def headlab_register_executors(register):
        register(InWorker, in_worker)


@pytest.fixture
def flaky_plugin():
    name = headlab.register_plugin(FlakyPlugin, "flaky-plugin", replace=True)
    yield name
    headlab.unregister_plugin(name)


def flaky_spec(tmp_path: Path, interrupt: bool = False) -> tuple[Path, Path]:
    """A two-cell sweep (``fl.value: [0, 1]``) of an induction step and a flaky one failing in the second cell
    while ``fault`` exists: (spec file, fault)."""
    fault = tmp_path / "fault"
    fault.write_text("on")
    steps = ("  - id: ind\n    detect: {kind: induction}\n"
             f"  - id: fl\n    detect: {{kind: flaky, fail_value: 1, fail_while: {json.dumps(str(fault))}"
             f"{', interrupt: true' if interrupt else ''}}}\n")
    spec = tmp_path / "s.yaml"
    spec.write_text(spec_text(steps, sweep="  fl.value: [0, 1]\n"))
    return spec, fault


def assert_as_uninterrupted(store: Path, spec: Path, tmp_path: Path, **run: object) -> None:
    """The run at ``store`` is complete, without partial cells, and identical to an uninterrupted run of ``spec``."""
    resumed = headlab.open_run(store)
    assert resumed.status == "complete" and resumed.cells_done == 2 and resumed.partial_cells == {}
    assert not resumed.problems and resumed.failed_cells == {}
    group = zarr.open_group(str(store), mode="r")["cells/c0001"]
    assert "partial" not in group.attrs and "failed_step" not in group.attrs and group.attrs["done"]
    whole = headlab.run(spec, out=tmp_path / "whole", **run)
    assert whole.status == "complete"
    for step in ("ind", "fl"):
        xr.testing.assert_identical(resumed.results[step], whole.results[step])


def test_resume_computes_a_partial_cell_again_as_a_whole(flaky_plugin, tmp_path, capfd):
    spec, fault = flaky_spec(tmp_path)
    code, _, err = command(["run", str(spec), "--out", str(tmp_path / "runs")], capfd)
    assert code == 2
    assert error_line(err) == (f"error: step 'fl' of cell c0001 (fl.value=1) (detector 'flaky', plugin "
                               f"{flaky_plugin}): ValueError: flaky: cell value 1 fails")
    (store,) = (tmp_path / "runs").iterdir()
    run = headlab.open_run(store)
    assert run.status == "failed" and run.cells_done == 1 and not run.problems
    assert run.partial_cells == {"c0001": {"values": {"fl.value": 1}, "steps": ["ind"], "failed_step": "fl",
                                           "error": "ValueError: flaky: cell value 1 fails"}}
    ind, fl = run.results["ind"], run.results["fl"]
    assert ind.attrs["partial_cells"] == ["c0001"] and "partial_cells" not in fl.attrs
    assert ind["fl.value"].values.tolist() == [0, 1] and fl["fl.value"].values.tolist() == [0]
    xr.testing.assert_identical(run.cell("c0001", "ind"), run.cell("c0000", "ind"))  # `ind` ignores fl.value
    code, out, _ = command(["show", str(store)], capfd)
    assert code == 0 and "partial cell c0001 (fl.value=1): kept steps ind (shown below); step 'fl' failed: " \
        "ValueError: flaky: cell value 1 fails" in out, out

    fault.unlink()
    code, _, err = command(["run", "--resume", str(store)], capfd)
    assert code == 0, err
    assert_as_uninterrupted(store, spec, tmp_path)


def test_an_interrupted_step_keeps_the_steps_before_it(flaky_plugin, tmp_path, capfd):
    spec, fault = flaky_spec(tmp_path, interrupt=True)
    code, _, err = command(["run", str(spec), "--out", str(tmp_path / "runs")], capfd)
    (store,) = (tmp_path / "runs").iterdir()
    assert code == 130 and "Traceback" not in err
    assert f"interrupted: finished cells are stored in {store}; finish with `headlab run --resume {store}`" in err
    run = headlab.open_run(store)
    assert run.status == "interrupted" and run.cells_done == 1 and not run.problems and run.failed_cells == {}
    assert run.partial_cells["c0001"]["steps"] == ["ind"] and run.partial_cells["c0001"]["error"] == "interrupted"
    assert run.results["ind"]["fl.value"].values.tolist() == [0, 1]
    code, out, _ = command(["show", str(store)], capfd)
    assert "partial cell c0001 (fl.value=1): kept steps ind (shown below); interrupted in step 'fl'" in out, out

    fault.unlink()
    code, _, err = command(["run", "--resume", str(store)], capfd)
    assert code == 0, err
    assert_as_uninterrupted(store, spec, tmp_path)


def test_the_worker_path_keeps_the_steps_before_a_failing_one(flaky_plugin, tmp_path):
    spec, fault = flaky_spec(tmp_path)
    worker = {"execution": {"executor": "in_worker"}}
    with pytest.warns(UserWarning, match="1 of 2 cells"):
        run = headlab.run(spec, out=tmp_path / "runs", **worker)
    assert run.status == "failed" and run.cells_done == 1 and not run.problems
    assert run.failed_cells["c0001"]["error"] == "ValueError: flaky: cell value 1 fails"
    info = run.partial_cells["c0001"]
    assert (info["steps"], info["failed_step"], info["error"]) == (["ind"], "fl", "ValueError: flaky: cell value 1 fails")
    assert zarr.open_group(str(run.path), mode="r")["cells/c0001"].attrs["host"]  # written by the worker
    with pytest.raises(ValueError, match="c0001 holds only the steps completed before step 'fl' failed"):
        RunWriter(run.path).mark_done("c0001")  # a driver can never take it for a finished cell

    fault.unlink()
    headlab.run(None, resume=run.path, **worker)
    assert_as_uninterrupted(run.path, spec, tmp_path, **worker)


def test_a_partial_cell_that_cannot_be_written_leaves_the_error_as_it_was(flaky_plugin, tmp_path, monkeypatch):
    spec, _ = flaky_spec(tmp_path)
    write = RunWriter.write_cell

    def full_disk(self, *args, failed=None, **kwargs):
        if failed is not None:
            raise OSError(28, "No space left on device")
        return write(self, *args, failed=failed, **kwargs)

    monkeypatch.setattr(RunWriter, "write_cell", full_disk)
    with pytest.raises(StepError) as info:
        headlab.run(spec, out=tmp_path / "runs")
    e = info.value
    assert isinstance(e, ValueError) and str(e) == (f"step 'fl' of cell c0001 (fl.value=1) (detector 'flaky', plugin "
                                                    f"{flaky_plugin}): ValueError: flaky: cell value 1 fails")
    assert "the steps of cell c0001 completed before step 'fl' were not kept: OSError: [Errno 28] No space left " \
        "on device" in e.__notes__
    assert set(e.completed_steps) == {"ind"}
    (store,) = (tmp_path / "runs").iterdir()
    run = headlab.open_run(store)
    assert run.status == "failed" and run.cells_done == 1 and run.partial_cells == {}
    assert run.results["ind"]["fl.value"].values.tolist() == [0]


def test_a_damaged_partial_cell_is_reported_and_forgotten_on_recompute(flaky_plugin, tmp_path):
    spec, _ = flaky_spec(tmp_path)
    with pytest.raises(StepError):
        headlab.run(spec, out=tmp_path / "runs")
    (store,) = (tmp_path / "runs").iterdir()
    chunk = store / "cells" / "c0001" / "ind" / "score" / "c" / "0" / "0"
    assert chunk.is_file()
    saved = chunk.read_bytes()
    chunk.unlink()
    damaged = headlab.open_run(store)
    assert damaged.problems == ["chunk cells/c0001/ind/score/c/0/0 is missing"]
    assert damaged.status.startswith("damaged: chunk cells/c0001/ind/score/c/0/0 is missing")
    with pytest.raises(headlab.results.RunDamaged, match="c0001/ind/score"):
        damaged.results  # noqa: B018 - never read back as fill values
    chunk.write_bytes(saved)
    RunWriter(store).forget_cells()  # what --recompute does first: nothing stored is read until computed again
    forgotten = headlab.open_run(store)
    assert forgotten.partial_cells == {} and forgotten.cells_done == 0 and forgotten.results == {}
