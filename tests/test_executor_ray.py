"""The ``ray`` executor on a local Ray cluster this module starts (2 CPUs, nothing outside the machine).

Every Ray run is compared with the ``local`` executor's run of the same spec, cell by cell and step by
step (``xarray.testing.assert_identical``). Worker processes are separate interpreters: the test plugin
(tests/executor_plugins.py: the ``probe`` action, the ``counted-tiny`` model) reaches them by module name,
with tests/ on their PYTHONPATH.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import xarray as xr

import headlab
import headlab.context

from fixtures.specs import spec_text

ray = pytest.importorskip("ray")
#: the slow set (CI runs it): every test here starts or uses a Ray cluster, whose processes cost about a minute of
#: CPU; the executor contract without Ray is tested in the default set (tests/test_executors.py). One xdist
#: group: the slow set (`--dist loadgroup`) runs them on one worker, which starts the module's cluster once
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("ray_cluster")]

from headlab.plugins.executors.ray import release_workers, worker_info  # noqa: E402

TESTS = Path(__file__).parent
ROOT = TESTS.parent
RAY = {"executor": "ray", "workers": 2, "keep_workers": True}  # runs of this module reuse two workers


class Events(headlab.context.Reporter):
    """Records the progress the driver reports."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str, int | None]] = []

    def start(self, key, total, description):
        self.events.append(("start", key, total))

    def advance(self, key, n=1):
        self.events.append(("advance", key, n))

    def count(self, key: str) -> int:
        return sum(n for event, k, n in self.events if event == "advance" and k == key)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A local Ray cluster whose workers import the test plugin and log model loads."""
    import executor_plugins

    logs = tmp_path_factory.mktemp("ray-logs")
    saved = {k: os.environ.get(k) for k in ("PYTHONPATH", "HEADLAB_TEST_LOADS", "RAY_agent_register_timeout_ms")}
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(TESTS), saved["PYTHONPATH"]) if p)
    os.environ["HEADLAB_TEST_LOADS"] = str(logs / "loads.txt")
    os.environ.setdefault("RAY_agent_register_timeout_ms", "180000")  # Ray's agents start slowly on a busy machine
    name = headlab.register_plugin(executor_plugins, replace=True)
    for attempt in range(3):  # Ray gives its raylet 30 s to start; a loaded machine can miss that once
        try:
            ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="WARNING")
            break
        except Exception as e:
            ray.shutdown()
            if "timed out during startup" not in str(e) or attempt == 2:
                raise
    try:
        yield logs
    finally:
        ray.shutdown()
        headlab.unregister_plugin(name)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def assert_same_store(a: headlab.Run, b: headlab.Run) -> None:
    """Every step of every cell identical, and the combined results too."""
    assert a.cells_done == b.cells_done == a.cells_total
    for i in range(a.cells_total):
        for step in a.steps:
            xr.testing.assert_identical(a.cell(f"c{i:04d}", step), b.cell(f"c{i:04d}", step))
    assert set(a.results) == set(b.results)
    for step in a.results:
        xr.testing.assert_identical(a.results[step], b.results[step])


def test_quickstart_sweep_equals_local(cluster, tmp_path):
    spec = ROOT / "specs" / "quickstart.yaml"
    local = headlab.run(spec, out=tmp_path / "local", overrides={"task.n": 4})
    remote = headlab.run(spec, out=f"file://{tmp_path}/ray", overrides={"task.n": 4}, execution=RAY)
    assert remote.status == "complete" and remote.attrs["executor"] == "ray"
    assert remote.path.parent == tmp_path / "ray"  # file:// URL: the same local store
    assert_same_store(local, remote)
    for key in ("model", "model_digest", "device", "dtype", "n_layers"):  # provenance from the workers
        assert remote.attrs[key] == local.attrs[key], key
    assert [r.path for r in headlab.list_runs(tmp_path / "ray")] == [remote.path]  # one run, seen as one
    assert remote.summary() == local.summary()


def test_generate_sweep_equals_local(cluster, tmp_path):
    steps = """  - id: ret
    detect: {kind: previous_token}
  - id: gen
    generate:
      max_new_tokens: 3
      metrics: [exact_match, contains]
      steer:
        - {kind: head_scale, heads: {from: ret, top: 2}, factor: 0.5}
"""
    sweep = "  gen.decode: [{kind: greedy}, {kind: dola, layers: [0, 1]}]\n  task.length: [5, 7]\n"
    text = spec_text(steps, sweep=sweep)
    local = headlab.run(text, out=tmp_path / "local")
    remote = headlab.run(text, out=tmp_path / "ray", execution=RAY)
    assert remote.cells_total == 4
    assert_same_store(local, remote)


def probe_spec(tmp_path: Path, **options) -> str:
    config = ", ".join(f"{k}: {v}" for k, v in {"log": str(tmp_path / "attempts.txt"), **options}.items())
    return spec_text(f"  - id: p\n    probe: {{{config}}}\n", sweep="  p.value: [0, 1, 2, 3]\n")


def attempts(tmp_path: Path) -> Counter:
    return Counter(int(line.split()[0]) for line in (tmp_path / "attempts.txt").read_text().splitlines())


def test_failing_cell_is_retried_recorded_and_resumed(cluster, tmp_path):
    fault = tmp_path / "fault"
    fault.write_text("on")
    text = probe_spec(tmp_path, fail_value=2, fail_while=str(fault))
    progress = Events()
    with pytest.warns(UserWarning, match="1 of 4 cells"):
        run = headlab.run(text, out=tmp_path / "ray", execution={**RAY, "max_retries": 2}, reporter=progress)
    # the driver's progress: cells done, failed, running (on 2 workers, none left at the end)
    assert ("start", "cells", 4) in progress.events and ("start", "running", 2) in progress.events
    assert (progress.count("cells"), progress.count("failed"), progress.count("running")) == (3, 1, 0)
    assert max(itertools.accumulate(n for e, k, n in progress.events if e == "advance" and k == "running")) == 2
    assert run.status == "failed" and run.cells_done == 3
    assert attempts(tmp_path) == {0: 1, 1: 1, 2: 3, 3: 1}  # retried max_retries times, the others ran once
    (name, failure), = run.failed_cells.items()
    assert name == "c0002" and failure["values"] == {"p.value": 2} and failure["step"] == "p"
    assert failure["error"] == "RuntimeError: injected fault in cell value 2" and failure["attempts"] == 3
    assert sorted(run.results["p"]["p.value"].values.tolist()) == [0, 1, 3]  # finished cells are usable

    fault.unlink()  # fixed: resume (through the CLI, on the same cluster) runs only the failed cell
    release_workers()  # the CLI's driver starts its own workers: give it the cluster's CPUs
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), str(entry_point(tmp_path))])}
    address = ray.get_runtime_context().gcs_address
    res = subprocess.run([sys.executable, "-m", "headlab.cli", "run", "--resume", str(run.path), "--executor", "ray",
                          "--address", address], capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    assert attempts(tmp_path) == {0: 1, 1: 1, 2: 4, 3: 1}
    resumed = headlab.open_run(run.path)
    assert resumed.status == "complete" and resumed.failed_cells == {}
    (tmp_path / "attempts.txt").unlink()
    local = headlab.run(text, out=tmp_path / "local")
    assert_same_store(local, resumed)


def entry_point(tmp_path: Path) -> Path:
    """A distribution directory whose `headlab` entry point is the test plugin (the CLI process loads it)."""
    info = tmp_path / "dist" / "executor_plugins-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: executor-plugins\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[headlab]\nexecutor_plugins = executor_plugins\n")
    return info.parent


def test_a_worker_killed_mid_cell_is_replaced_and_the_run_completes(cluster, tmp_path):
    marker = tmp_path / "killed"
    text = probe_spec(tmp_path, kill_value=1, kill_once=str(marker))
    marker.write_text("")  # the local run does not kill
    local = headlab.run(text, out=tmp_path / "local")
    marker.unlink()
    (tmp_path / "attempts.txt").unlink()
    release_workers()
    remote = headlab.run(text, out=tmp_path / "ray", execution={"executor": "ray"})  # workers end with the run
    assert worker_info() == []
    assert marker.read_text().strip()  # the worker did kill itself with SIGKILL during cell 1
    assert remote.status == "complete" and remote.failed_cells == {}
    assert attempts(tmp_path)[1] == 2
    pids = {line.split()[1] for line in (tmp_path / "attempts.txt").read_text().splitlines()
            if line.split()[0] == "1"}
    assert marker.read_text().strip() in pids and len(pids) == 2  # the retry ran in another process
    assert_same_store(local, remote)


def test_cells_sharing_a_model_load_it_once_per_worker(cluster, tmp_path):
    loads = cluster / "loads.txt"
    before = loads.read_text().splitlines() if loads.exists() else []
    text = ("name: shared\nmodel: counted-tiny\ntask: {kind: repeated_tokens, n: 4, length: 8}\n"
            "steps:\n  - id: prev\n    detect: {kind: previous_token}\nsweep:\n  task.length: [3, 4, 5, 6, 7, 8]\n")
    keep = RAY
    try:
        run = headlab.run(text, out=tmp_path, execution=keep)
        assert run.status == "complete" and run.cells_done == 6
        new = loads.read_text().splitlines()[len(before):]
        assert 1 <= len(new) <= 2 and len(set(new)) == len(new)  # at most once per worker, for 6 cells
        workers = worker_info()  # the workers kept: the processes that loaded it, one load each
        assert len(workers) == 2 and {str(w["pid"]) for w in workers} >= set(new)
        assert sum(w["loads"] for w in workers) == len(new)
        again = headlab.run(text, out=tmp_path, execution=keep)  # kept workers keep their model
        assert loads.read_text().splitlines()[len(before) + len(new):] == []
        assert_same_store(run, again)
    finally:
        release_workers()
    assert worker_info() == []


@pytest.mark.parametrize("ask, named", [({"num_cpus_per_cell": 8}, "execution.num_cpus_per_cell is 8 but the Ray "
                                         "cluster has 2 CPUs in all"),
                                        ({"num_gpus_per_cell": 1}, "execution.num_gpus_per_cell is 1 but the Ray "
                                         "cluster has 0 GPUs in all")])
def test_more_than_the_cluster_has_is_refused_at_once(cluster, tmp_path, ask, named):
    import time

    from headlab.plugin_manager import PluginError

    start = time.monotonic()
    with pytest.raises(PluginError, match=named):
        headlab.run(spec_text("  - id: ind\n    detect: {kind: induction}\n"), out=tmp_path,
                    execution={"executor": "ray", **ask})
    assert time.monotonic() - start < 15  # it waited forever for a worker the cluster cannot hold
    assert not any(tmp_path.iterdir())  # refused before the store exists


def test_a_sweep_started_in_the_repository_root_equals_local(tmp_path):
    """The command as a user types it in the checkout's root: the driver and its Ray workers (which inherit
    the driver's directory, first on their sys.path) import transformers and Hugging Face's ``kernels``,
    not a folder of the checkout. Its own local cluster (``--address local``), two cells, equal to the
    local executor's run."""
    spec = ROOT / "specs" / "quickstart.yaml"
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "PYTHONSAFEPATH")}
    env["HEADLAB_PLUGINS"] = "none"
    res = subprocess.run([sys.executable, "-m", "headlab.cli", "run", "specs/quickstart.yaml", "--set", "task.n=4",
                          "--executor", "ray", "--address", "local", "--out", str(tmp_path / "ray")],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    (path,) = [r.path for r in headlab.list_runs(tmp_path / "ray")]
    remote = headlab.open_run(path)
    assert remote.status == "complete" and remote.attrs["executor"] == "ray" and remote.cells_total == 2
    local = headlab.run(spec, out=tmp_path / "local", overrides={"task.n": 4})
    assert_same_store(local, remote)
