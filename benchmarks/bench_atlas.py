"""The head atlas against its detectors run one by one, each as its own spec step (not a test).

    python benchmarks/bench_atlas.py [--model headlab-tiny] [--tokens 64] [--n 8] [--importance] [--reps 3] \
        [--threads 1] [--write]

In one process, with the same tasks (the atlas's built-in tasks, recorded in its ``detector_steps``) and seed:

- ``alone``: each entry of ``detector_steps`` as the one ``detect`` step of its own spec (``headlab.run``), as
  a user runs it; copy suppression and the copying score are one step, so it runs once;
- ``atlas``: the spec of one ``atlas`` step (what ``headlab atlas MODEL`` runs), with ``null: none`` (the same
  detectors, the pattern roles from one shared forward) and with the default null (every detector again on a
  re-initialised copy of the model).

Every run includes what a run costs (loading the model, building the tasks, writing the store). Time: the
median of ``--reps`` wall-clock runs after one warm-up run of each. Printed: each detector's time, their sum and
maximum, the atlas's times and the ratios atlas / max (the issue's bound: at most 3) and atlas / sum.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time


def ratio(a: float, b: float) -> str:
    """``a / b`` as ``1.23x``."""
    return f"{a / b:.2f}x" if b else "n/a"


def timed(spec: dict, out: str, reps: int) -> float:
    """The median wall-clock seconds of ``headlab.run(spec)`` over ``reps`` runs, after one warm-up run."""
    import headlab

    headlab.run(spec, out=out)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        headlab.run(spec, out=out)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="headlab-tiny", help="a registered model or a local checkpoint directory")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--importance", action="store_true", help="also gradient importance and Ships")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch default)")
    args = p.parse_args()
    import torch

    from headlab.plugins.atlas.atlas import atlas_spec

    if args.threads:
        torch.set_num_threads(args.threads)
    base = atlas_spec(args.model, tokens=args.tokens, n=args.n, importance=args.importance, null="none")
    with tempfile.TemporaryDirectory() as out:
        import headlab

        cube = headlab.run(base, out=out).results["atlas"]
        steps = json.loads(cube.attrs["detector_steps"])
        singles: dict[str, float] = {}
        done: dict[str, str] = {}
        for name, step in steps.items():
            key = json.dumps([step["task"], step["detect"]], sort_keys=True)
            if key in done:  # copying is read from the copy_suppression step
                print(f"{name:<20} (the same step as {done[key]})", flush=True)
                continue
            done[key] = name
            spec = {"name": f"alone-{name}", "model": base["model"], "seed": base["seed"], "task": step["task"],
                    "steps": [{"id": name, "detect": step["detect"]}]}
            singles[name] = timed(spec, out, args.reps)
            print(f"{name:<20} alone {singles[name]:8.2f} s", flush=True)
        atlas = timed(base, out, args.reps)
        with_null = dict(base, steps=[{"id": "atlas", "atlas": {**base["steps"][0]["atlas"], "null": "reinit"}}])
        atlas_null = timed(with_null, out, args.reps)
    total, slowest = sum(singles.values()), max(singles.values())
    worst = max(singles, key=singles.get)
    print(f"\nmodel {args.model}, tokens {args.tokens}, n {args.n}, torch threads {torch.get_num_threads()}, "
          f"median of {args.reps}")
    print(f"detectors alone: sum {total:.2f} s, max {slowest:.2f} s ({worst})")
    print(f"atlas, null none:   {atlas:8.2f} s   atlas / max {ratio(atlas, slowest)}   atlas / sum "
          f"{ratio(atlas, total)}")
    print(f"atlas, null reinit: {atlas_null:8.2f} s   atlas / max {ratio(atlas_null, slowest)}   atlas / sum "
          f"{ratio(atlas_null, total)}")


if __name__ == "__main__":
    from _common import main_writing_results

    main_writing_results(main, __file__)
