"""Interrupted runs (issue 15): Ctrl-C (SIGINT) or SIGTERM during ``headlab run`` exits 130 and leaves a run that
``--resume`` completes to exactly the uninterrupted results; kill -9 at random (seeded) points of a sweep run,
store creation included, never leaves anything resume cannot finish (tools/reliability/kill_resume.py runs >= 20)."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import xarray as xr

import headlab
from headlab.cli import main

from fixtures.specs import spec_text

ROOT = Path(__file__).parent.parent

SLOW_PLUGIN = '''
"""A detector that takes a while (so a signal lands mid-run) and returns a deterministic score."""
import time
from typing import Literal

import numpy as np
import xarray as xr

from headlab import ComponentConfig, hookimpl


class Slow(ComponentConfig):
    kind: Literal["slow"] = "slow"
    seconds: float = 1.5


def detect(config, ctx):
    time.sleep(config.seconds)
    g = ctx.model.geometry
    score = np.arange(g.n_layers * g.n_heads, dtype=float).reshape(g.n_layers, g.n_heads) * len(ctx.examples[0].input_ids)
    return xr.Dataset({"score": (("layer", "head"), score)})


@hookimpl
def headlab_register_detectors(register):
    register(Slow, detect)
'''
STEPS = "  - id: ind\n    detect: {kind: induction}\n  - id: slow\n    detect: {kind: slow}\n"
SWEEP = "  task.length: [4, 5, 6, 7]\n"


def slow_plugin(tmp_path: Path) -> Path:
    """A distribution on a PYTHONPATH directory with the slow detector as a `headlab` entry point."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "slow_detector.py").write_text(SLOW_PLUGIN)
    info = site / "slow_detector-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: slow_detector\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[headlab]\nslow_detector = slow_detector\n")
    return site


def first_cell_done(out: Path) -> Path | None:
    for run in out.glob("[!.]*"):
        meta = run / "cells" / "c0000" / "zarr.json"
        if meta.is_file():
            try:
                if json.loads(meta.read_text())["attributes"].get("done"):
                    return run
            except (ValueError, KeyError):
                pass
    return None


def signal_after_first_cell(tmp_path: Path, steps: str, signum: int, preexec) -> tuple[int, str, Path]:
    """Run a 4-cell sweep of ``steps`` with the slow detector through ``python -m headlab.cli run`` (``preexec``
    run in the child before it starts), send ``signum`` once its first cell is stored: (exit status, stderr,
    run directory)."""
    site = slow_plugin(tmp_path)
    spec = tmp_path / "s.yaml"
    spec.write_text(spec_text(steps, sweep=SWEEP))
    out = tmp_path / "runs"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "headlab.cli", "run", str(spec), "--out", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT,
                            preexec_fn=preexec)
    deadline = time.time() + 240
    try:
        while (run := first_cell_done(out)) is None:
            assert proc.poll() is None, proc.communicate()
            assert time.time() < deadline, "no cell finished in time"
            time.sleep(0.05)
        proc.send_signal(signum)
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, stderr, run


@pytest.mark.parametrize("signum", [pytest.param(signal.SIGINT, id="SIGINT", marks=pytest.mark.slow),
                                    pytest.param(signal.SIGTERM, id="SIGTERM", marks=pytest.mark.slow),
                                    pytest.param(signal.SIGHUP, id="SIGHUP", marks=pytest.mark.slow)])
def test_a_signal_during_run_exits_130_and_resume_equals_an_uninterrupted_run(tmp_path, monkeypatch, signum):
    # started as from a terminal (the signal's default action: a background job of this test's own shell
    # would inherit SIGINT ignored), with the signal blocked, as a parent process may leave it
    returncode, stderr, run = signal_after_first_cell(
        tmp_path, STEPS, signum,
        lambda: (signal.signal(signum, signal.SIG_DFL), signal.pthread_sigmask(signal.SIG_BLOCK, {signum})))
    assert returncode == 130, stderr  # was 0: `headlab run x && headlab report ...` went on
    assert "Traceback" not in stderr, stderr
    assert f"interrupted: finished cells are stored in {run}; finish with `headlab run --resume {run}`" in stderr
    partial = headlab.open_run(run)
    assert partial.status == "interrupted" and 1 <= partial.cells_done < 4, (partial.status, partial.cells_done)

    monkeypatch.syspath_prepend(str(tmp_path / "site"))  # slow_plugin's distribution
    try:
        import slow_detector

        name = headlab.register_plugin(slow_detector, "slow_detector", replace=True)  # maybe autoloaded already
        try:
            main(["run", "--resume", str(run)])  # returns normally: exit code 0
            resumed = headlab.open_run(run)
            text = spec_text(STEPS.replace("{kind: slow}", "{kind: slow, seconds: 0}"), sweep=SWEEP)
            reference = headlab.run(text.replace(", seconds: 0", ""), out=tmp_path / "reference")
        finally:
            headlab.unregister_plugin(name)
    finally:
        sys.modules.pop("slow_detector", None)
    assert resumed.status == "complete" and resumed.cells_done == 4 and not resumed.problems
    for step in ("ind", "slow"):
        xr.testing.assert_identical(resumed.results[step], reference.results[step])


@pytest.mark.slow  # a whole run in a process of its own
def test_a_hangup_ignored_by_the_parent_as_nohup_does_leaves_the_run_going(tmp_path):
    returncode, stderr, run = signal_after_first_cell(
        tmp_path, STEPS.replace("{kind: slow}", "{kind: slow, seconds: 0.5}"), signal.SIGHUP,
        lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN))
    assert returncode == 0, stderr  # was 130: the handler replaced the ignore nohup asked for
    finished = headlab.open_run(run)
    assert finished.status == "complete" and finished.cells_done == 4, (finished.status, finished.cells_done)


class _SwallowedPlugin:
    """A detector during which a signal arrives and its KeyboardInterrupt is lost (as Python loses one raised in
    a garbage-collector callback): the handler has recorded the signal, nothing was raised."""

    @headlab.hookimpl
    def headlab_register_detectors(self, register):
        from typing import Literal

        from headlab import ComponentConfig

        class Swallowed(ComponentConfig):
            kind: Literal["swallowed_signal"] = "swallowed_signal"

        def detect(config, ctx):
            import numpy as np

            from headlab import cli

            try:
                cli._terminate(signal.SIGTERM, None)
            except KeyboardInterrupt:
                pass  # lost
            g = ctx.model.geometry
            return xr.Dataset({"score": (("layer", "head"), np.zeros((g.n_layers, g.n_heads)))})

        register(Swallowed, detect)


def test_a_signal_whose_interrupt_was_lost_still_stops_the_run_at_the_next_cell(tmp_path, capsys):
    name = headlab.register_plugin(_SwallowedPlugin(), name="swallowed-signal", replace=True)
    try:
        spec = tmp_path / "s.yaml"
        spec.write_text(spec_text("  - id: lost\n    detect: {kind: swallowed_signal}\n", sweep=SWEEP))
        with pytest.raises(SystemExit) as stop:
            main(["run", str(spec), "--out", str(tmp_path / "runs")])
    finally:
        headlab.unregister_plugin(name)
    assert stop.value.code == 130
    (run,) = (tmp_path / "runs").glob("[!.]*")
    partial = headlab.open_run(run)
    assert partial.status == "interrupted" and partial.cells_done == 1, (partial.status, partial.cells_done)
    assert f"finish with `headlab run --resume {run}`" in capsys.readouterr().err


def kill_resume():
    spec = importlib.util.spec_from_file_location("kill_resume", ROOT / "tools" / "reliability" / "kill_resume.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# slow: a reference run and three killed ones; the default set's signal tests and test_runner's
# interrupt-then-resume check the same equality at one point each
@pytest.mark.slow
def test_kill_9_at_random_points_then_resume_equals_the_uninterrupted_run(tmp_path):
    """Three seeded points of tools/reliability/kill_resume.py's sweep (the first while the store is being created);
    the script itself runs >= 20."""
    kr = kill_resume()
    spec, writes, reference = kr.reference(tmp_path)
    points = kr.points(writes, 3, seed=15)
    assert points[0][0] <= 3 and len(points) == 3
    results = [kr.kill_and_resume(tmp_path, spec, reference, target, mode) for target, mode in points]
    assert all(r["ok"] for r in results), results
    assert {r["where"] for r in results} == {"creating", "running"}, results
