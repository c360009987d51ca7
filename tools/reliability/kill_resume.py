"""kill -9 a sweep run at random points and check that every resume equals the uninterrupted run.

    python tools/reliability/kill_resume.py [--kills 24] [--seed 0] [--work DIR] [--keep]

A "point" is a write of the run store: every file zarr writes (``zarr.storage._local._put``: the
temporary store's metadata while the run is being created, each cell's arrays, chunks and attributes, the
run's status) is counted in an uninterrupted run of a 4-cell sweep (two steps: induction detection, then
generation steered by the detected heads). Each kill picks a write at random (seeded) and a way to die:

- ``before``: SIGKILL just before that write;
- ``torn``: the write's temporary file is half written, then SIGKILL (a kill in the middle of a write);
- ``after``: SIGKILL right after it (the process was computing the next cell).

Then ``headlab.run(None, resume=RUN)`` finishes the run, and every step's combined results must equal the
uninterrupted run's (``xarray.testing.assert_identical``). When the kill came while the store was being
created, no run exists (``headlab.list_runs`` lists none, ``--resume`` on the leftover ``.creating``
directory is a clear error) and running the spec again must give the same results. Prints one line per
kill and the counts; exits 1 if any resume differed or any kill did not kill.

``tests/test_interrupts.py`` imports this module and runs a few kills in the default suite.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TINY_LLAMA = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 97, "max_position_embeddings": 256}
SPEC = f"""name: killme
model: {{config: {json.dumps(TINY_LLAMA)}}}
task: {{kind: repeated_tokens, n: 4, length: 8}}
steps:
  - id: ind
    detect: {{kind: induction}}
  - id: gen
    generate: {{max_new_tokens: 4, steer: [{{kind: head_mask, heads: {{from: ind, top: 2}}}}]}}
sweep:
  task.length: [4, 6]
  seed: [0, 1]
"""
MODES = ("before", "torn", "after")

CHILD = r"""
import os, signal, sys, threading
import zarr.storage._local as local

target, mode = int(sys.argv[3]), sys.argv[4]
count = 0
lock = threading.Lock()
put = local._put

def counted(path, value, exclusive=False):
    global count
    with lock:  # zarr writes from several threads at once
        count += 1
        mine = count
    if mine == target and mode == "before":
        os.kill(os.getpid(), signal.SIGKILL)
    if mine == target and mode == "torn":
        data = bytes(value.as_buffer_like())
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(str(path) + ".torn.partial", "wb") as f:
            f.write(data[: max(1, len(data) // 2)])
            f.flush()
            os.fsync(f.fileno())
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        return put(path, value, exclusive)
    finally:  # also after a write zarr makes fail on purpose (an exclusive write of an existing key)
        if mine == target and mode == "after":
            os.kill(os.getpid(), signal.SIGKILL)

local._put = counted
import headlab
headlab.run(open(sys.argv[2]).read(), out=sys.argv[1])
print("writes", count)
"""


def child(out: Path, spec: Path, target: int, mode: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run the spec in a fresh process that dies at write ``target`` (0: never; it prints its write count)."""
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-c", CHILD, str(out), str(spec), str(target), mode],
                          capture_output=True, text=True, timeout=timeout, env=env)


def reference(work: Path, spec_text: str = SPEC) -> tuple[Path, int, object]:
    """Write the spec, run it uninterrupted in a child (counting its writes); returns (spec file, writes, run)."""
    import headlab

    work.mkdir(parents=True, exist_ok=True)
    spec = work / "spec.yaml"
    spec.write_text(spec_text)
    res = child(work / "reference", spec, 0, "none")
    if res.returncode != 0:
        raise RuntimeError(f"the uninterrupted run failed: {res.stderr.strip()[-2000:]}")
    writes = int(res.stdout.split("writes")[-1].split()[0])
    (path,) = [p for p in (work / "reference").iterdir() if not p.name.startswith(".")]
    return spec, writes, headlab.open_run(path)


def kill_and_resume(work: Path, spec: Path, ref: object, target: int, mode: str) -> dict:
    """One kill at write ``target`` (``mode``), then resume (or run again when no run was created) and compare.
    Returns a dict: where the kill landed (``creating``/``running``), whether resume equalled the reference."""
    import xarray as xr

    import headlab
    from headlab.results import RunNotFound

    out = work / f"kill-{target}-{mode}"
    shutil.rmtree(out, ignore_errors=True)
    started = time.time()
    res = child(out, spec, target, mode)
    if res.returncode != -signal.SIGKILL:
        return {"target": target, "mode": mode, "ok": False,
                "error": f"not killed: exit {res.returncode}: {res.stderr.strip()[-500:]}"}
    entries = list(out.iterdir()) if out.exists() else []
    runs = headlab.list_runs(out) if out.exists() else []
    real = [p for p in entries if not p.name.startswith(".")]
    where = "running" if real else "creating"
    try:
        if real:
            (path,) = real
            status = headlab.open_run(path).status
            resumed = headlab.run(None, resume=path)
        else:
            assert runs == [], f"a half-created store is listed as a run: {runs}"
            for left in entries:  # a leftover .creating directory: resume says so in one line
                try:
                    headlab.run(None, resume=left)
                    raise AssertionError(f"--resume accepted the half-created {left.name}")
                except RunNotFound as e:
                    assert "\n" not in str(e)
            status = "none"
            resumed = headlab.run(spec.read_text(), out=out / "again")
        for step in ref.results:
            xr.testing.assert_identical(resumed.results[step], ref.results[step])
        assert resumed.status == "complete" and not resumed.problems
    except Exception as e:  # noqa: BLE001 - reported, and the script exits 1
        return {"target": target, "mode": mode, "where": where, "ok": False, "error": f"{type(e).__name__}: {e}"}
    return {"target": target, "mode": mode, "where": where, "status": status, "ok": True,
            "seconds": round(time.time() - started, 1)}


def points(writes: int, kills: int, seed: int) -> list[tuple[int, str]]:
    """``kills`` distinct (write, mode) points drawn with ``seed``; the first writes (store creation) always
    get one kill."""
    rng = random.Random(seed)
    chosen = {(rng.randint(1, min(3, writes)), rng.choice(MODES))}
    while len(chosen) < min(kills, writes * len(MODES)):
        chosen.add((rng.randint(1, writes), rng.choice(MODES)))
    return sorted(chosen)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=24)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--work", type=Path, default=None)
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="headlab-kill-"))
    spec, writes, ref = reference(work)
    print(f"uninterrupted run: {writes} store writes, {ref.cells_total} cells; killing at {args.kills} points "
          f"(seed {args.seed})", flush=True)
    results = []
    for target, mode in points(writes, args.kills, args.seed):
        r = kill_and_resume(work, spec, ref, target, mode)
        results.append(r)
        print(json.dumps(r), flush=True)
    ok = sum(r["ok"] for r in results)
    creating = sum(r.get("where") == "creating" for r in results)
    print(f"{ok}/{len(results)} resumes identical to the uninterrupted run ({creating} kills during store "
          f"creation, {len(results) - creating} during the run)")
    if not args.keep and args.work is None:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if ok == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
