"""The ``ray`` executor against the ``local`` one: a 16-cell sweep on the embedded model, and Ray's per-cell
overhead.

    python benchmarks/bench_executor.py [--workers 2] [--n 16] [--repeats 2] [--write]

- sweep: the quickstart's three detectors (previous-token, duplicate-token, induction) on ``headlab-tiny``
  over ``task.length`` x ``seed`` (4 x 4 = 16 cells), ``--n`` sequences per cell. ``local`` runs the cells
  one after another in this process, once with torch on 1 thread (as each Ray worker) and once with
  torch's default threads (all cores); ``ray`` runs them on ``--workers`` workers of a local Ray cluster
  started here (``ray.init(num_cpus=workers)``, not timed). Ray is timed cold (worker processes start and load the model inside the run) and warm
  (``keep_workers: true``, a second run on the same workers); the results of every run are checked
  identical to the local run's, cell by cell;
- overhead: the same 16 cells with one step whose action does nothing (registered in this script: it
  reaches the workers by value), so a cell's time is the executor's own: spec, task, store write,
  scheduling. Printed as seconds per cell for local and (warm) Ray, and their difference.

Prints cells/s of each and the ratio ray/local. On a machine other processes load, the figures move with
them: run it on a quiet one, or say what else ran.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from headlab import hookimpl

SPEC = """name: bench-executor
model: headlab-tiny
task: {{kind: repeated_tokens, n: {n}, length: 16}}
steps:
  - id: previous
    detect: {{kind: previous_token}}
  - id: duplicate
    detect: {{kind: duplicate_token, exclude_bos: true}}
  - id: induction
    detect: {{kind: induction, exclude_bos: true}}
sweep:
  task.length: [12, 16, 20, 24]
  seed: [0, 1, 2, 3]
"""

EMPTY = """name: bench-overhead
model: headlab-tiny
task: {kind: repeated_tokens, n: 1, length: 4}
steps:
  - id: nothing
    nothing: {}
sweep:
  task.length: [4, 5, 6, 7]
  seed: [0, 1, 2, 3]
"""


class Nothing:
    """A plugin with an action that does nothing (the per-cell overhead is all that is left)."""

    @staticmethod
    @hookimpl
    def headlab_register_actions(register):
        import xarray as xr
        from pydantic import BaseModel, ConfigDict

        class NothingConfig(BaseModel):
            model_config = ConfigDict(extra="forbid")

        register("nothing", NothingConfig, lambda config, ctx: xr.Dataset(), description="do nothing")


def timed(fn, *args, **kwargs):
    start = time.perf_counter()
    out = fn(*args, **kwargs)
    return time.perf_counter() - start, out


def identical(a, b) -> bool:
    import xarray as xr

    for i in range(a.cells_total):
        for step in a.steps:
            xr.testing.assert_identical(a.cell(f"c{i:04d}", step), b.cell(f"c{i:04d}", step))
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--n", type=int, default=16, help="sequences per cell")
    parser.add_argument("--repeats", type=int, default=2, help="timed runs of each; the fastest is reported")
    args = parser.parse_args()

    os.environ.setdefault("RAY_agent_register_timeout_ms", "180000")  # a loaded machine starts Ray's agents slowly
    import ray
    import torch

    import headlab

    default_threads = torch.get_num_threads()
    headlab.register_plugin(Nothing)
    out = Path(tempfile.mkdtemp(prefix="bench-executor-"))
    spec = SPEC.format(n=args.n)
    cold_ray = {"executor": "ray", "workers": args.workers}
    warm_ray = {**cold_ray, "keep_workers": True}

    print(f"machine: {os.cpu_count()} CPUs; local: torch on 1 and on {default_threads} threads; "
          f"ray: {args.workers} workers x 1 CPU")
    t, _ = timed(ray.init, num_cpus=args.workers, include_dashboard=False, log_to_driver=False,
                 logging_level="WARNING")
    print(f"ray.init (local cluster, not timed below): {t:.1f}s")

    from headlab.plugins.executors.ray import release_workers

    rows = []
    for label, text in (("sweep", spec), ("empty steps", EMPTY)):
        headlab.run(text, out=out / "local")  # warm-up: imports, caches
        times: dict[str, float] = {}
        runs = {}
        cold_s, runs["ray cold"] = timed(headlab.run, text, out=out / "ray", execution=cold_ray)
        times["ray cold"] = cold_s
        headlab.run(text, out=out / "ray", execution=warm_ray)  # start the kept workers, load the model
        for _ in range(args.repeats):  # interleaved, so a load spike from elsewhere hits each alike
            for name, threads, execution in (("local 1 thread", 1, None), (f"local {default_threads} threads",
                                                                          default_threads, None),
                                             ("ray warm", default_threads, warm_ray)):
                torch.set_num_threads(threads)
                t, runs[name] = timed(headlab.run, text, out=out / "x", execution=execution)
                times[name] = min(times.get(name, t), t)
        release_workers()
        for name, r in runs.items():
            assert identical(runs["local 1 thread"], r), name
        rows.append((label, runs["ray cold"].cells_total, times))

    names = list(rows[0][2])
    print("\n" + f"{'':12s} {'cells':>5s} " + " ".join(f"{n:>16s}" for n in names) + "   (cells/s)")
    for label, n, times in rows:
        print(f"{label:12s} {n:5d} " + " ".join(f"{n / times[k]:16.2f}" for k in names))
    for label, _, times in rows:
        local1, localn = times["local 1 thread"], times[f"local {default_threads} threads"]
        print(f"{label}: ray warm / local 1 thread {local1 / times['ray warm']:.2f}x, ray warm / local "
              f"{default_threads} threads {localn / times['ray warm']:.2f}x, ray cold / local 1 thread "
              f"{local1 / times['ray cold']:.2f}x")
    label, n, times = rows[1]
    local_s, warm_s = times["local 1 thread"], times["ray warm"]
    print(f"\nper-cell time with empty steps: local {local_s / n * 1000:.0f} ms; ray (warm, {args.workers} "
          f"workers) {warm_s / n * 1000:.0f} ms of wall time, {warm_s * args.workers / n * 1000:.0f} ms of worker "
          f"time: Ray's per-cell overhead {(warm_s * args.workers - local_s) / n * 1000:.0f} ms")
    print("every Ray run's arrays are identical to the local run's (assert_identical, every step of every cell)")
    ray.shutdown()


if __name__ == "__main__":
    from _common import main_writing_results

    main_writing_results(main, __file__)
