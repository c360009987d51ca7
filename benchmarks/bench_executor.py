"""The ``ray`` executor against the ``local`` one: a 16-cell sweep on the embedded model, and Ray's per-cell
overhead.

    python benchmarks/bench_executor.py [--workers 2] [--n 16] [--threads 0] [--repeats 1]

- sweep: the quickstart's three detectors (previous-token, duplicate-token, induction) on ``headlab-tiny``
  over ``task.length`` x ``seed`` (4 x 4 = 16 cells), ``--n`` sequences per cell. ``local`` runs the cells
  one after another in this process (torch with ``--threads`` threads, 0: torch's default); ``ray`` runs
  them on ``--workers`` workers of a local Ray cluster started here (``ray.init(num_cpus=workers)``, not
  timed). Ray is timed cold (worker processes start and load the model inside the run) and warm
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
    parser.add_argument("--threads", type=int, default=0, help="torch threads of the local run (0: default)")
    parser.add_argument("--repeats", type=int, default=1, help="timed runs of each; the fastest is reported")
    args = parser.parse_args()

    import ray
    import torch

    import headlab

    if args.threads:
        torch.set_num_threads(args.threads)
    headlab.register_plugin(Nothing)
    out = Path(tempfile.mkdtemp(prefix="bench-executor-"))
    spec = SPEC.format(n=args.n)
    cold_ray = {"executor": "ray", "workers": args.workers}
    warm_ray = {**cold_ray, "keep_workers": True}

    print(f"machine: {torch.get_num_threads()} torch threads (local), {args.workers} Ray workers x 1 CPU")
    t, _ = timed(ray.init, num_cpus=args.workers, include_dashboard=False, log_to_driver=False,
                 logging_level="WARNING")
    print(f"ray.init (local cluster, not timed below): {t:.1f}s")

    rows = []
    for label, text in (("sweep", spec), ("empty steps", EMPTY)):
        local_s, local = min((timed(headlab.run, text, out=out / "local") for _ in range(args.repeats)),
                             key=lambda r: r[0])
        cold_s, cold = timed(headlab.run, text, out=out / "ray", execution=cold_ray)
        headlab.run(text, out=out / "ray", execution=warm_ray)  # start the kept workers, load the model
        warm_s, warm = min((timed(headlab.run, text, out=out / "ray", execution=warm_ray)
                            for _ in range(args.repeats)), key=lambda r: r[0])
        from headlab.plugins.executors.ray import release_workers

        release_workers()
        assert identical(local, cold) and identical(local, warm)
        n = local.cells_total
        rows.append((label, n, local_s, cold_s, warm_s))

    print(f"\n{'':12s} {'cells':>5s} {'local':>16s} {'ray cold':>16s} {'ray warm':>16s} {'cold/local':>10s} "
          f"{'warm/local':>10s}")
    for label, n, local_s, cold_s, warm_s in rows:
        print(f"{label:12s} {n:5d} {n / local_s:9.2f} cells/s {n / cold_s:9.2f} cells/s {n / warm_s:9.2f} cells/s "
              f"{local_s / cold_s:9.2f}x {local_s / warm_s:9.2f}x")
    label, n, local_s, cold_s, warm_s = rows[1]
    print(f"\nper-cell time with empty steps: local {local_s / n * 1000:.0f} ms, ray (warm, {args.workers} workers, "
          f"wall / cells) {warm_s / n * 1000:.0f} ms; Ray's per-cell overhead over local "
          f"{max(0.0, warm_s * args.workers - local_s) / n * 1000:.0f} ms of worker time per cell")
    print("every Ray run's arrays are identical to the local run's (assert_identical, every step of every cell)")
    ray.shutdown()


if __name__ == "__main__":
    main()
