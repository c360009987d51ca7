"""Starting Ray where it cannot start as asked (issue 34): under a low address-space limit (``ulimit -v``), with
workers that never come up, and interrupted while it starts. Each is ``headlab run`` as typed, in its own process
(a limit and a signal apply to a whole process), with its own local cluster; every Ray process it started must
be gone when it returns."""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

import headlab

from fixtures.cli import error_line

pytest.importorskip("ray")

ROOT = Path(__file__).parent.parent
GiB = 2**30

# a Ray worker (Ray's default_worker.py) that hangs as it starts, so it never registers; the driver is untouched
HANGING_WORKER = """\
import sys, time
if any(arg.endswith("default_worker.py") for arg in sys.argv):
    time.sleep(600)
"""


def started_by(marker: str) -> list[int]:
    """Live processes that carry ``marker`` in their environment: everything the command started, Ray's own
    daemons and workers included (they inherit the driver's environment)."""
    needle = f"HEADLAB_TEST_RUN={marker}".encode()
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            environ = Path(f"/proc/{entry}/environ").read_bytes()
            state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z" and needle in environ.split(b"\0"):
            pids.append(int(entry))
    return pids


def assert_nothing_left(marker: str) -> None:
    deadline = time.monotonic() + 15  # Ray's daemons take a moment to go after the driver stops them
    while (left := started_by(marker)) and time.monotonic() < deadline:
        time.sleep(0.5)
    for pid in left:  # clean up for the next test before failing this one
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    assert not left, f"Ray processes left behind: {left}"


def headlab_run(tmp_path: Path, spec: str = "specs/quickstart.yaml", limit: int | None = None,
                env: dict[str, str] | None = None, interrupt_when_started: bool = False) -> tuple[subprocess.CompletedProcess, str]:
    """``headlab run SPEC`` (the quickstart's two cells) with its own local Ray cluster, under an address-space
    limit of ``limit`` bytes, optionally sent SIGINT once Ray's processes exist; returns the result and the
    marker its processes carry."""
    marker = uuid.uuid4().hex
    environment = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "PYTHONSAFEPATH")}
    environment.update(HEADLAB_PLUGINS="none", HEADLAB_TEST_RUN=marker, **(env or {}))

    def start() -> None:
        signal.signal(signal.SIGINT, signal.SIG_DFL)  # as from a terminal
        if limit is not None:
            resource.setrlimit(resource.RLIMIT_AS, (limit, resource.RLIM_INFINITY))

    command = [sys.executable, "-m", "headlab.cli", "run", spec, "--set", "task.n=4", "--executor", "ray",
               "--address", "local", "--out", str(tmp_path / "runs")]
    proc = subprocess.Popen(command, cwd=ROOT, env=environment, preexec_fn=start, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    if interrupt_when_started:
        deadline = time.monotonic() + 120
        while len(started_by(marker)) < 3 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)  # the driver, then Ray's daemons (gcs_server, raylet) and its first workers
        time.sleep(2)
        proc.send_signal(signal.SIGINT)
    try:
        out, err = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
    return subprocess.CompletedProcess(command, proc.returncode, out, err), marker


@pytest.mark.slow  # a whole Ray run under the limit (about a minute); the cases below keep the default set honest
def test_a_run_under_an_8_gib_address_space_limit_completes_and_stops_its_cluster(tmp_path):
    """The limit the issue met (Ray hung for over a minute): the object store is sized to fit it."""
    res, marker = headlab_run(tmp_path, limit=8 * GiB)
    assert res.returncode == 0, res.stderr[-3000:]
    (run,) = headlab.list_runs(tmp_path / "runs")
    run = headlab.open_run(run.path)
    assert run.status == "complete" and run.attrs["executor"] == "ray" and run.cells_done == 2
    assert_nothing_left(marker)


@pytest.mark.slow  # starts Ray under a limit, as the other Ray tests (the slow set)
def test_an_address_space_limit_too_low_for_ray_is_one_line_before_anything_starts(tmp_path):
    start = time.monotonic()
    res, marker = headlab_run(tmp_path, limit=2 * GiB)
    line = error_line(res.stderr)
    assert res.returncode == 2, res.stderr[-3000:]
    assert "address-space limit (ulimit -v) is 2 GiB" in line and "ulimit -v unlimited" in line, line
    assert "--executor local" in line, line
    assert time.monotonic() - start < 60  # refused at once, never waiting for workers that cannot start
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())
    assert_nothing_left(marker)


@pytest.fixture
def hanging_workers(tmp_path) -> dict[str, str]:
    """The environment of a command whose Ray workers hang as they start (a ``sitecustomize`` they import)."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(HANGING_WORKER)
    return {"PYTHONPATH": os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p)}


@pytest.mark.slow  # starts a Ray cluster
def test_workers_that_never_start_are_given_up_on_in_one_line(tmp_path, hanging_workers):
    spec = tmp_path / "spec.yaml"  # the quickstart, told to wait 5 s for its workers
    spec.write_text((ROOT / "specs" / "quickstart.yaml").read_text()
                    + "execution: {executor: ray, address: local, start_timeout: 5}\n")
    res, marker = headlab_run(tmp_path, str(spec), env=hanging_workers)
    line = error_line(res.stderr)
    assert res.returncode == 2, res.stderr[-3000:]
    assert "no worker started within 5 s" in line and "execution.start_timeout" in line, line
    assert "Ray logs under" in line and "--executor local" in line, line
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())
    assert_nothing_left(marker)


@pytest.mark.slow  # starts a Ray cluster
def test_ctrl_c_while_ray_starts_exits_130_and_stops_what_started(tmp_path, hanging_workers):
    """Ray's start waits on its workers deaf to Ctrl-C; the run hears it and stops the cluster it started."""
    res, marker = headlab_run(tmp_path, env=hanging_workers, interrupt_when_started=True)
    assert res.returncode == 130, res.stderr[-3000:]
    assert "interrupted before the run store was created" in res.stderr and "Traceback" not in res.stderr
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())
    assert_nothing_left(marker)
