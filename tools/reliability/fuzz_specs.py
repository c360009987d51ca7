"""Fuzz the spec loader: tens of thousands of generated and mutated specs, counting escapes and hangs.

Specs come from tests/spec_strategies.py: valid for the JSON Schema, or broken at the data level
(deleted/renamed/unknown keys, wrong types, hostile values, bad sweeps, deep or wide values) or at the
YAML level (tags, aliases and alias bombs, duplicate keys, deep nesting, truncation, stray characters).
Each is given to ``headlab.load_spec``; the outcome is one of

- accepted,
- a ``SpecError`` with a location (a line, or a key path),
- an unlocated ``SpecError`` (counted apart),
- an escape: any other exception (a bug),
- a hang: more than ``--timeout`` seconds (the load is interrupted at that point).

    OMP_NUM_THREADS=1 python tools/reliability/fuzz_specs.py --n 20000 --seed 0 --out fuzz.json

Not part of the test suite (tests/test_spec_properties.py runs the same strategies on a few hundred).
"""

from __future__ import annotations

import argparse
import collections
import json
import signal
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))


class Hang(BaseException):
    """Raised by the alarm: the load took longer than the timeout."""


def _alarm(signum: int, frame: Any) -> None:
    raise Hang


def classify(kind: str, value: Any, timeout: float) -> tuple[str, str, float]:
    """Load one spec; returns (outcome, detail, seconds)."""
    import headlab
    from headlab.spec import SpecError

    started = time.perf_counter()
    signal.setitimer(signal.ITIMER_REAL, timeout)
    try:
        headlab.load_spec(value)
        outcome, detail = "accepted", ""
    except SpecError as e:
        located = e.line is not None or bool(e.path)
        outcome, detail = ("spec_error" if located else "unlocated"), str(e)[:300]
    except Hang:
        outcome, detail = "hang", f"interrupted after {timeout} s"
    except Exception as e:  # noqa: BLE001 - an escape is what we count
        outcome, detail = "escape", f"{type(e).__name__}: {str(e)[:300]}"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    seconds = time.perf_counter() - started
    if seconds > timeout and outcome != "hang":
        outcome, detail = "hang", f"{outcome} after {seconds:.1f} s: {detail}"
    return outcome, detail, seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=20_000, help="specs to try")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds after which a load is a hang")
    parser.add_argument("--valid-share", type=float, default=0.25, help="share of unmutated (schema-valid) specs")
    parser.add_argument("--out", type=Path, default=None, help="write counts and failing inputs as JSON")
    args = parser.parse_args()

    import spec_strategies as S
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hseed
    from hypothesis import strategies as st

    import headlab

    headlab.load_spec("name: warmup\ntask: {kind: repeated_tokens}\nsteps: [{id: a, detect: {kind: induction}}]\n")
    signal.signal(signal.SIGALRM, _alarm)
    counts: collections.Counter[str] = collections.Counter()
    by_source: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    failures: list[dict[str, Any]] = []
    slowest: list[tuple[float, str]] = []
    started = time.time()

    def check(source: str, value: Any) -> None:
        outcome, detail, seconds = classify(source, value, args.timeout)
        counts[outcome] += 1
        by_source[source][outcome] += 1
        slowest.append((seconds, source))
        slowest.sort(reverse=True)
        del slowest[5:]
        if outcome in ("escape", "hang", "unlocated") and len(failures) < 200:
            text = value if isinstance(value, str) else json.dumps(value, default=str)
            failures.append({"outcome": outcome, "source": source, "detail": detail, "input": text[:4000]})
        total = sum(counts.values())
        if total % 1000 == 0:
            print(f"{total:6d} specs, {time.time() - started:6.0f} s: {dict(counts)}", flush=True)

    def run(strategy: st.SearchStrategy, n: int) -> None:
        if n <= 0:
            return

        @hseed(args.seed)
        @settings(max_examples=n, deadline=None, database=None, phases=[Phase.generate],
                  suppress_health_check=list(HealthCheck))
        @given(strategy)
        def one(case: tuple[str, Any]) -> None:
            check(*case)

        one()

    n_valid = round(args.n * args.valid_share)
    run(S.schema_specs().map(lambda d: ("valid", d)), n_valid)
    run(S.mutated_specs(), args.n - n_valid)
    total = sum(counts.values())
    report = {"specs": total, "seconds": round(time.time() - started, 1), "seed": args.seed,
              "timeout_s": args.timeout, "counts": dict(counts),
              "by_source": {k: dict(v) for k, v in by_source.items()},
              "escapes": counts["escape"], "hangs": counts["hang"], "unlocated": counts["unlocated"],
              "slowest_s": [round(s, 2) for s, _ in slowest], "failures": failures}
    print(json.dumps({k: v for k, v in report.items() if k != "failures"}, indent=2))
    for f in failures[:20]:
        print(f"{f['outcome']} ({f['source']}): {f['detail']}\n    input: {f['input'][:300]!r}")
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
