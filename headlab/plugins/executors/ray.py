"""The ``ray`` executor: each sweep cell is a task on a Ray cluster, all writing one run store.

The driver (the process running ``headlab run``) creates the run store and keeps a pool of worker
processes, Ray actors with ``num_cpus_per_cell`` CPUs and ``num_gpus_per_cell`` GPUs each. A worker
runs a cell exactly as the local executor does (:func:`headlab.runner.execute_cell`), writes it into the
cell's own group of the store (a local path shared by every node, or an fsspec URL such as
``s3://bucket/runs``) and reports back; the driver then marks the cell done. A worker keeps the models it
loaded (the ``models_per_worker`` most recent), and the driver sends a cell to a worker that already holds
its model when one is free, so cells sharing a model load it once per worker. Workers end with the run
and give their CPUs and GPUs back; with ``keep_workers: true`` they stay up, models loaded, for the next
run of the same process (a notebook's runs), holding their resources meanwhile.

A cell that raises is sent again (to any worker) up to ``max_retries`` times, then recorded as failed
with its step and error while the other cells go on; a worker process that dies mid-cell (killed, out
of memory, node lost) is replaced and its cell sent again, counted the same way. A cell is read as
finished only once the driver marked it done, so nothing a dead worker half-wrote is ever read.
"""

from __future__ import annotations

import functools
import os
import platform
import socket
import time
from collections import deque
from typing import Any, Literal

from pydantic import Field

from headlab.plugin import ComponentConfig, NonNegativeInt, PositiveInt, hookimpl
from headlab.plugin_manager import PluginError
from headlab.runner import CellError, CellFailure, CellTask, Job, ModelCache, execute_cell
from headlab.spec import Cell

INSTALL = "executor 'ray' needs Ray, which is not installed: pip install 'headlab[ray]'"


class RayExecutor(ComponentConfig):
    """Run each sweep cell as a task on a Ray cluster; workers keep loaded models between cells."""

    kind: Literal["ray"] = Field("ray", alias="executor")
    address: str | None = Field(
        None, description="'auto' (a running cluster: RAY_ADDRESS or `ray start` on this node), "
                          "'ray://host:port' (Ray Client), or null: the cluster this process is connected to, "
                          "else one found as 'auto' finds it, else a new local one for this run")
    num_gpus_per_cell: float = Field(0, ge=0, description="GPUs of each worker (a cell runs on one worker; "
                                                          "fractions share a GPU)")
    num_cpus_per_cell: float = Field(1, gt=0, description="CPUs of each worker (Ray sets the worker's "
                                                          "OMP_NUM_THREADS, so torch's threads, to it unless set)")
    max_retries: NonNegativeInt = Field(2, description="times a failed cell (raised, or its worker died) is sent again")
    workers: PositiveInt | None = Field(None, description="worker processes (default: as many as the cluster's "
                                                         "CPUs / num_cpus_per_cell and GPUs / num_gpus_per_cell "
                                                         "hold, at most one per cell)")
    models_per_worker: PositiveInt = Field(1, description="loaded models a worker keeps (least recently used go)")
    keep_workers: bool = Field(False, description="keep the workers and their models for this process's next run "
                                                  "(a notebook; they hold their CPUs and GPUs meanwhile; "
                                                  "headlab.plugins.executors.ray.release_workers() ends them)")
    start_timeout: float = Field(120, gt=0, description="seconds to wait for the first worker to start; past it "
                                                        "the run is refused, before its store exists, naming Ray's "
                                                        "logs (a worker that cannot start, for example under a low "
                                                        "ulimit -v, would be waited for forever)")


class CellWorker:
    """A worker process (run as a Ray actor): runs cells and keeps its models between them."""

    def __init__(self, models_per_worker: int = 1) -> None:
        self.models = ModelCache(max_models=models_per_worker)

    def run(self, task: CellTask) -> Any:
        """Run and write one cell (:func:`headlab.runner.execute_cell`)."""
        return execute_cell(task, self.models)

    def info(self) -> dict[str, Any]:
        """This worker's process id, host and number of model loads so far."""
        return {"pid": os.getpid(), "host": platform.node(), "loads": self.models.loads}


_pools: dict[tuple[Any, ...], list[Any]] = {}


def _ray() -> Any:
    try:
        import ray
    except ImportError:
        raise PluginError(INSTALL) from None
    return ray


def _pool(ray: Any, config: RayExecutor, n: int) -> list[Any]:
    """``n`` workers of this Ray session with ``config``'s resources (started if missing)."""
    key = _key(ray, config)
    for stale in [k for k in _pools if k[0] != key[0]]:
        del _pools[stale]
    pool = _pools.setdefault(key, [])
    actor = ray.remote(CellWorker).options(num_cpus=config.num_cpus_per_cell, num_gpus=config.num_gpus_per_cell,
                                           max_restarts=0)
    while len(pool) < n:
        pool.append(actor.remote(config.models_per_worker))
    return pool


def _key(ray: Any, config: RayExecutor) -> tuple[Any, ...]:
    return (ray.get_runtime_context().get_job_id(), config.num_cpus_per_cell, config.num_gpus_per_cell,
            config.models_per_worker)


def _replace(ray: Any, config: RayExecutor, pool: list[Any], slot: int) -> None:
    """Kill the worker in ``slot`` (it died or stopped answering) and start a new one there."""
    try:
        ray.kill(pool[slot], no_restart=True)
    except Exception:  # already gone
        pass
    pool[slot] = ray.remote(CellWorker).options(num_cpus=config.num_cpus_per_cell,
                                                num_gpus=config.num_gpus_per_cell,
                                                max_restarts=0).remote(config.models_per_worker)


def _size(ray: Any, config: RayExecutor, cells: int) -> int:
    """Workers to start: as many as the cluster's CPUs and GPUs hold (at most ``workers``, one per cell). A
    worker the whole cluster cannot hold is a :class:`PluginError` at once (Ray would wait for it forever)."""
    resources = ray.cluster_resources()
    for key, field, asked in (("CPU", "num_cpus_per_cell", config.num_cpus_per_cell),
                              ("GPU", "num_gpus_per_cell", config.num_gpus_per_cell)):
        have = float(resources.get(key, 0))
        if asked > have:
            raise PluginError(f"executor 'ray': execution.{field} is {asked:g} but the Ray cluster has "
                              f"{have:g} {key}s in all, so no worker could ever start; ask for at most {have:g} "
                              "(or add nodes)")
    n = int(resources.get("CPU", 1) // config.num_cpus_per_cell)
    if config.num_gpus_per_cell > 0:
        n = min(n, int(resources.get("GPU", 0) // config.num_gpus_per_cell))
    return max(1, min(config.workers or n, cells))


PROBE_SECONDS = 5.0
"""How long :func:`_reachable` waits for a cluster's address to accept a connection."""


def _reachable(address: str | None) -> None:
    """Refuse (:class:`PluginError`, within :data:`PROBE_SECONDS`) an explicit ``host:port`` or
    ``ray://host:port`` address nothing listens on; Ray itself would retry for a long time without a word.
    ``auto`` and ``None`` are found by Ray (``RAY_ADDRESS``, a cluster started on this node) and not probed,
    except that an explicit ``RAY_ADDRESS`` is."""

    target = address if address not in (None, "auto", "local") else os.environ.get("RAY_ADDRESS") or None
    if target is None or target in ("auto", "local"):
        return
    hostport = target.split("://", 1)[1] if "://" in target else target
    hostport = hostport.split("/", 1)[0]
    host, sep, port = hostport.rpartition(":")
    if not sep or not port.isdigit():
        return  # not host:port; Ray reports what it makes of it
    host = host.strip("[]") or "127.0.0.1"
    try:
        socket.create_connection((host, int(port)), timeout=PROBE_SECONDS).close()
    except OSError as e:
        why = "timed out" if isinstance(e, TimeoutError) else (e.strerror or type(e).__name__)
        named = f"address {address!r}" if target == address else f"RAY_ADDRESS {target!r}"
        raise PluginError(f"executor 'ray': cannot reach a Ray cluster at {named}: {host}:{port}: {why}; start one "
                          "(`ray start --head`) or give its address (execution.address, --address)") from None


def _failure(ray: Any, error: BaseException, cell: Cell) -> tuple[CellFailure, bool]:
    """The failure a task's error stands for, and whether its worker is lost."""
    if isinstance(error, ray.exceptions.RayTaskError):
        cause = getattr(error, "cause", None)
        if isinstance(cause, CellError):
            return cause.failure, False
        return CellFailure.from_exception(cell, None, cause if isinstance(cause, BaseException) else error), False
    text = str(error).strip().splitlines()
    line = f"worker lost ({type(error).__name__}{': ' + text[0] if text else ''})"
    return CellFailure(cell.name, cell.as_dict(), None, line), True


def _address_space_limit() -> int | None:
    """This process's address-space limit in bytes (``ulimit -v``), or None where there is none."""
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    return None if soft == resource.RLIM_INFINITY else soft


STORE_MINIMUM = 256 * 2**20
"""The smallest object store :func:`_store_under_limit` gives a local cluster (cells pass small messages)."""

WORKER_HEADROOM = 5 * 2**29
"""What a worker maps beside the object store: torch, a small model, Ray's threads and their malloc arenas."""


def _gib(n: float) -> str:
    return f"{n / 2**30:.3g} GiB"


def _store_under_limit(limit: int) -> int:
    """The object store for a local cluster started under an address-space limit of ``limit`` bytes.

    Every Ray process maps the whole object store into its address space, and by default it is 30% of
    the machine's memory: past the limit, its workers die at start and ``ray.init`` waits for them forever,
    deaf to Ctrl-C, or Ray aborts the process. Half of what a worker leaves free of the limit beside
    :data:`WORKER_HEADROOM` (at most Ray's default) keeps every process inside it; a limit too low for
    :data:`STORE_MINIMUM` is a :class:`PluginError`, before anything starts."""
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    store = min(int(0.3 * memory), (limit - WORKER_HEADROOM) // 2)  # Ray's default is 30% of memory
    if store < STORE_MINIMUM:
        need = WORKER_HEADROOM + 2 * STORE_MINIMUM
        raise PluginError(f"executor 'ray': this process's address-space limit (ulimit -v) is {_gib(limit)}, too low "
                          f"for a local Ray cluster, whose workers need at least {_gib(need)} each (torch, the model "
                          "and Ray's object store); raise it (`ulimit -v unlimited`) or run without Ray "
                          "(--executor local)")
    return store


def _init(ray: Any, config: RayExecutor) -> None:
    """Connect to (or start) the Ray cluster of ``config.address``; what cannot is a :class:`PluginError`."""
    _reachable(config.address)
    options: dict[str, Any] = {}
    if config.address in (None, "local"):  # a new local cluster (None: unless one is running)
        # Ray holds the first driver's connection until the workers it starts with have come up, deaf to
        # Ctrl-C: one that never does would hold it forever; :func:`_await_start` waits for them instead
        options["_system_config"] = {"prestart_worker_first_driver": False}
        limit = _address_space_limit()
        if limit is not None:
            options["object_store_memory"] = _store_under_limit(limit)
    init = functools.partial(ray.init, address=config.address, include_dashboard=False, log_to_driver=False,
                             logging_level="WARNING")
    try:
        try:
            init(**options)
        except ValueError as e:  # address None found a running cluster, which keeps its own settings
            if not options or not str(e).startswith("When connecting to an existing cluster"):
                raise
            init()
    except (ConnectionError, TimeoutError, ValueError, RuntimeError) as e:
        ray.shutdown()  # stop whatever it started
        text = str(e).strip().splitlines()
        raise PluginError(f"executor 'ray': cannot connect to a Ray cluster at address {config.address!r}"
                          + (f": {text[0]}" if text else "")) from None
    except BaseException:  # Ctrl-C while the cluster starts: nothing of it stays behind
        ray.shutdown()
        raise


def execute(config: RayExecutor, job: Job) -> None:
    """Run ``job.cells`` as Ray tasks on a pool of workers; retry, then record failures."""
    ray = _ray()
    started_here = False
    if not ray.is_initialized():
        _init(ray, config)
        started_here = True
    try:
        n = _size(ray, config, len(job.cells)) if job.cells else 0  # a cluster too small is refused before the store
        if job.cells:
            try:  # workers that cannot start are refused before the store too
                _await_start(ray, config, job, _pool(ray, config, n))
            except BaseException:
                _release(ray, config)
                raise
        job.start()
        if job.cells:
            _schedule(ray, config, job, n)
    finally:
        if started_here:
            _pools.clear()
            ray.shutdown()


def _await_start(ray: Any, config: RayExecutor, job: Job, pool: list[Any]) -> None:
    """Wait (at most ``config.start_timeout`` seconds, Ctrl-C heard) until a worker of ``pool`` answers: one
    that dies as it starts (out of memory, a low ``ulimit -v``) is restarted by Ray without end."""
    pending = [actor.info.remote() for actor in pool]
    deadline = time.monotonic() + config.start_timeout
    while True:
        if job.cancelled():
            raise KeyboardInterrupt
        ready, _ = ray.wait(pending, num_returns=1, timeout=0.5)
        if ready:
            return
        if time.monotonic() > deadline:
            limit = _address_space_limit()
            why = (f"; this process's address-space limit (ulimit -v) is {_gib(limit)}: raise it "
                   "(`ulimit -v unlimited`)" if limit is not None else "")
            raise PluginError(f"executor 'ray': no worker started within {config.start_timeout:g} s (see the Ray "
                              f"logs under {_logs()}){why}, give it longer (execution.start_timeout) or run "
                              "without Ray (--executor local)")


def _logs() -> str:
    """Where a local Ray cluster writes its logs."""
    base = os.environ.get("RAY_TMPDIR") or os.environ.get("TMPDIR") or "/tmp"  # Ray's own choice on Linux
    return os.path.join(base, "ray", "session_latest", "logs")


def _schedule(ray: Any, config: RayExecutor, job: Job, n: int) -> None:
    pool = _pool(ray, config, n)
    model_of = {c.name: job.spec.for_cell(c).model.model_dump_json() for c in job.cells}
    order = {key: i for i, key in enumerate(dict.fromkeys(model_of.values()))}
    todo = deque(sorted(job.cells, key=lambda c: order[model_of[c.name]]))  # cells sharing a model together
    holding: list[str | None] = [None] * n
    idle = list(range(n))
    inflight: dict[Any, tuple[int, Cell]] = {}
    attempts: dict[str, int] = {}
    job.reporter.start("running", n, f"running on {n} Ray worker{'s' if n > 1 else ''}")
    try:
        while todo or inflight:
            if job.cancelled():
                raise KeyboardInterrupt
            while idle and todo:
                slot = idle.pop(0)
                cell = next((c for c in todo if model_of[c.name] == holding[slot]), todo[0])
                todo.remove(cell)
                holding[slot] = model_of[cell.name]
                inflight[pool[slot].run.remote(job.task(cell))] = (slot, cell)
                job.reporter.advance("running", 1)
            ready, _ = ray.wait(list(inflight), num_returns=1, timeout=0.5)
            for ref in ready:
                slot, cell = inflight.pop(ref)
                job.reporter.advance("running", -1)
                idle.append(slot)
                try:
                    result = ray.get(ref)
                except ray.exceptions.RayError as e:
                    failure, lost = _failure(ray, e, cell)
                    if lost:
                        _replace(ray, config, pool, slot)
                        holding[slot] = None
                    attempts[cell.name] = attempts.get(cell.name, 0) + 1
                    if attempts[cell.name] <= config.max_retries:
                        todo.appendleft(cell)
                    else:
                        failure.attempts = attempts[cell.name]
                        job.cell_failed(failure)
                    continue
                job.cell_done(result)
    except BaseException:
        for slot in sorted({slot for slot, _ in inflight.values()}, reverse=True):
            ray.kill(pool.pop(slot), no_restart=True)  # cells still running stop; what they wrote stays unfinished
        raise
    finally:
        job.reporter.stop("running")
        if not config.keep_workers:
            _release(ray, config)


def _release(ray: Any, config: RayExecutor) -> None:
    """End the workers of ``config``'s pool: their CPUs and GPUs go back to the cluster."""
    for key in [k for k in _pools if k[1:] == _key(ray, config)[1:]]:
        for actor in _pools.pop(key):
            ray.kill(actor, no_restart=True)


def worker_info() -> list[dict[str, Any]]:
    """Process id, host and model loads of each worker this process keeps (``keep_workers: true``)."""
    ray = _ray()
    if not ray.is_initialized():
        return []
    job_id = ray.get_runtime_context().get_job_id()
    return [info for key, pool in _pools.items() if key[0] == job_id for info in ray.get([a.info.remote() for a in pool])]


def release_workers() -> None:
    """End every worker this process keeps (``keep_workers: true``); their resources go back to the cluster."""
    ray = _ray()
    for key in list(_pools):
        for actor in _pools.pop(key):
            if ray.is_initialized():
                ray.kill(actor, no_restart=True)


@hookimpl
def headlab_register_executors(register):
    register(RayExecutor, execute)
