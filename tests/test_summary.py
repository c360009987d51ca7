"""Honest means: n, drops (with the metric's reason) and the 95% interval, the same in `headlab show`, the
report and the run summary, checked against formulas written here."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path
from typing import ClassVar, Literal

import numpy as np
import pytest

import headlab
from headlab.report import render_report

from fixtures.specs import spec_text

Z = 1.959963984540054  # the 97.5% normal quantile


def wilson(k: int, n: int) -> tuple[float, float]:
    """Wilson's score interval, from its formula."""
    p = k / n
    centre = (p + Z * Z / (2 * n)) / (1 + Z * Z / n)
    half = Z / (1 + Z * Z / n) * math.sqrt(p * (1 - p) / n + Z * Z / (4 * n * n))
    return centre - half, centre + half


def test_proportion_counts_drops_and_wilson_interval():
    values = [1, 0, 1, 1, math.nan, 0, 1, math.nan, 1, 1]
    e = headlab.estimate(values, metric="m", drop_reason="no answer")
    assert (e.n, e.dropped, e.drop_reason, e.interval) == (8, 2, "no answer", "wilson")
    assert e.mean == pytest.approx(6 / 8)
    assert (e.low, e.high) == pytest.approx(wilson(6, 8), abs=1e-9)
    assert e.dropped_text() == "2 (no answer)"
    none = headlab.estimate([1.0, 0.0], metric="m", drop_reason="never used")
    assert none.dropped == 0 and none.drop_reason is None


def test_bootstrap_interval_of_a_continuous_mean():
    x = np.random.default_rng(1).normal(3.0, 2.0, size=400)
    e = headlab.estimate(np.append(x, math.nan), metric="m")
    half = Z * x.std(ddof=1) / math.sqrt(x.size)
    assert e.interval == "bootstrap" and e.n == 400 and e.dropped == 1
    assert e.mean == pytest.approx(x.mean())
    assert e.low == pytest.approx(x.mean() - half, abs=0.15 * half)
    assert e.high == pytest.approx(x.mean() + half, abs=0.15 * half)
    assert headlab.estimate(x, metric="m", seed=3) == headlab.estimate(x, metric="m", seed=3)


def test_no_defined_value_is_undefined_not_zero():
    e = headlab.estimate([math.nan, math.nan], metric="m", drop_reason="r")
    assert e.n == 0 and e.dropped == 2 and math.isnan(e.mean) and e.interval_text() == "-"


class HalfDefined(headlab.ComponentConfig):
    """1 on even examples, 0 on every third odd one, undefined elsewhere (a fixed pattern the test knows)."""

    kind: Literal["half_defined"] = "half_defined"
    undefined_when: ClassVar[str] = "the example index is odd and not a multiple of 3"


def half_defined(i: int) -> float:
    return 1.0 if i % 2 == 0 else (0.0 if i % 3 == 0 else math.nan)


def test_show_report_and_summary_agree_with_an_independent_count(tmp_path: Path):
    class Plugin:
        @headlab.hookimpl
        def headlab_register_metrics(self, register):
            register(HalfDefined, lambda config, examples, outputs: np.array(
                [half_defined(i) for i in range(len(outputs))]))

    name = headlab.register_plugin(Plugin(), name="summary-half", replace=True)
    try:
        run = headlab.run(spec_text("  - id: gen\n    generate: {max_new_tokens: 1, metrics: [half_defined]}\n",
                                    task="{kind: repeated_tokens, n: 14, length: 4}", out=str(tmp_path / "runs")))
    finally:
        headlab.unregister_plugin(name)
    values = [half_defined(i) for i in range(14)]
    defined = [v for v in values if not math.isnan(v)]
    n, dropped, k = len(defined), 14 - len(defined), int(sum(defined))
    low, high = wilson(k, n)
    e = run.summary()["gen"]["cells"][0]["estimates"]["half_defined"]
    assert (e.n, e.dropped, e.mean) == (n, dropped, pytest.approx(k / n))
    assert (e.low, e.high) == pytest.approx((low, high), abs=1e-9)
    reason = HalfDefined.undefined_when
    assert e.drop_reason == reason

    html = render_report(run)
    row = (f'<td>half_defined</td><td class="num">{k / n:.4g}</td><td>[{low:.4f}, {high:.4f}]</td>'
           f'<td class="num">{n}</td><td>{dropped} ({reason})</td>')
    assert row in html

    env = {**os.environ, "COLUMNS": "200"}
    shown = subprocess.run([sys.executable, "-m", "headlab.cli", "show", str(run.path), "--steps"],
                           capture_output=True, text=True, env=env, check=True).stdout
    summary_row = next(ln for ln in shown.splitlines() if ln.startswith("gen "))  # the run's summary table
    assert summary_row.split()[-5:] == ["half_defined", f"{k / n:.3f}", f"{n}/{n + dropped}", f"[{low:.3f},",
                                        f"{high:.3f}]"]
    line = next(ln for ln in shown.splitlines() if "half_defined" in ln and "│" in ln)  # the step in detail
    cells = [c.strip() for c in line.strip("│ ").split("│")]
    assert cells[:4] == ["half_defined", f"{k / n:.4f}", f"[{low:.4f}, {high:.4f}]", str(n)]
    assert cells[4] == f"{dropped} ({reason})"
