"""benchmarks/bench_kv.py's predicted-peak arithmetic and its table cells, on synthetic measurements (no model,
no timing, no memory measured)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_kv.py"
MiB = 2**20


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_kv", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


FULL = {"kv_bytes": 128 * MiB, "peak_bytes": 555 * MiB, "live_kv_bytes": 120 * MiB, "live_peak_bytes": 456 * MiB}
STREAM = {"kv_bytes": 32 * MiB, "peak_bytes": 540 * MiB, "live_kv_bytes": 30 * MiB, "live_peak_bytes": 366 * MiB}


def test_predicted_peak_is_fulls_peak_less_its_cache_plus_the_cases(bench):
    assert bench.predicted_peak(STREAM, FULL) == (555 - 128 + 32) * MiB
    assert bench.predicted_peak(FULL, FULL) == FULL["peak_bytes"]
    # the live measure is predicted from its own pass's KV bytes, not the timing pass's
    assert bench.predicted_peak(STREAM, FULL, "live_peak_bytes", "live_kv_bytes") == (456 - 120 + 30) * MiB


def test_no_prediction_without_both_measurements(bench):
    assert bench.predicted_peak(STREAM, {"error": "timeout"}) is None
    assert bench.predicted_peak({"error": "skipped"}, FULL) is None
    live_failed = {"kv_bytes": 32 * MiB, "peak_bytes": 540 * MiB, "live_error": "rc=1: ModuleNotFoundError"}
    assert bench.predicted_peak(live_failed, FULL, "live_peak_bytes", "live_kv_bytes") is None
    assert bench.predicted_peak(STREAM, {"kv_bytes": 200 * MiB, "peak_bytes": 100 * MiB}) is None  # 100-200+32 < 0


def test_peak_cells(bench):
    assert bench.peak_cells(STREAM, FULL, "peak_bytes", "kv_bytes").split() == ["540.0", "459.0", "1.18x"]
    assert bench.peak_cells(STREAM, FULL, "live_peak_bytes", "live_kv_bytes").split() == ["366.0", "366.0", "1.00x"]
    assert bench.peak_cells({"kv_bytes": 1}, FULL, "live_peak_bytes", "live_kv_bytes").split() == ["n/a"] * 3
    assert bench.peak_cells(STREAM, {"error": "x"}, "peak_bytes", "kv_bytes").split() == ["540.0", "n/a", "n/a"]
