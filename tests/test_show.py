"""``headlab show`` in 80 columns: one table for the run (step | what it did | metric | value | n | 95% interval),
every step listed (a step with no summary figure says so), step ids whole, and its numbers equal to ones computed
here from the stored per-example values: n, the examples dropped as undefined, Wilson's interval, a per-token
score's peak (the value the report's head map shows), and the n of each cell of a sweep over the task's size."""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

import headlab
from headlab.circuit_view import head_map
from headlab.cli import app

from fixtures.cli import cli, error_line

ROOT = Path(__file__).parent.parent
pytestmark = pytest.mark.skipif(not (ROOT / "headlab/plugins/models/tiny/headlab-tiny/config.json").is_file(),
                                reason="the embedded model headlab-tiny is not built")

Z = 1.959963984540054  # the 97.5% normal quantile
LONG = "per_token_patching_of_every_head_at_every_position"  # longer than any column could be at 80 columns
PAIRS = "{kind: kv_swap, n: 3, num_pairs: 3}"
SPEC = f"""\
name: show-test
model: headlab-tiny
task: {{kind: counterfact, n: 12}}
steps:
  - id: {LONG}
    task: {PAIRS}
    detect: {{kind: activation_patching, unit: z_position}}
  - id: resid
    task: {PAIRS}
    detect: {{kind: activation_patching, unit: resid}}
  - id: edges
    task: {PAIRS}
    detect: {{kind: edge_attribution, circuit: {{top: 5}}}}
  - id: greedy
    generate: {{metrics: [context_memory], max_new_tokens: 3}}
  - id: decore_random
    generate:
      decode: {{kind: decore, heads: [[3, 0], [3, 1]], random: true, alpha: entropy}}
      metrics: [context_memory]
      max_new_tokens: 3
"""


def wilson(k: int, n: int) -> tuple[float, float]:
    """Wilson's score interval, from its formula."""
    p = k / n
    centre = (p + Z * Z / (2 * n)) / (1 + Z * Z / n)
    half = Z / (1 + Z * Z / n) * math.sqrt(p * (1 - p) / n + Z * Z / (4 * n * n))
    return centre - half, centre + half


def show(*args: str, columns: int = 80) -> str:
    out = CliRunner().invoke(app, ["show", *args], env={"COLUMNS": str(columns)})
    assert out.exit_code == 0, out.output
    return out.output


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> headlab.Run:
    return headlab.run(SPEC, out=tmp_path_factory.mktemp("runs"))


def test_one_table_in_80_columns_with_every_step_whole(run):
    text = show(str(run.path))
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= 80, text
    rows = {line.split()[0]: line for line in lines[3:] if line[:1].strip()}  # rows that start with a step id
    assert [s for s in rows if s in run.steps] == run.steps, text  # every step, in order, its id whole
    assert len(lines) <= 3 + len(run.steps) + 2 + 2, text  # a row per step and metric, a note per step without one
    assert re.search(r"^resid +detect.* no summary", text, re.M), text
    assert "resid: no summary figure: its score is over layer x token (see `headlab report`)" in text
    assert "edges: no summary figure: its score is over edge (see `headlab report`)" in text
    assert re.search(r"^decore_random +control: ", text, re.M), text  # a control says so first


def test_a_per_token_score_shows_its_peak_like_the_report(run):
    score = run.results[LONG]["score"]  # (layer, head, token)
    values = score.transpose("layer", "head", "token").values
    flat = np.abs(values).reshape(-1, values.shape[-1])
    peak = values.reshape(-1, values.shape[-1])[np.arange(flat.shape[0]), flat.argmax(-1)].reshape(values.shape[:2])
    layer, head = np.unravel_index(np.argmax(peak), peak.shape)
    lines = show(str(run.path)).splitlines()
    row = lines[lines.index(LONG) + 1]  # an id too long for its column has a line of its own above its row
    assert f" top head L{layer}H{head} " in row and row.split()[-3:] == [f"{peak[layer, head]:.3f}", "-", "-"], row
    np.testing.assert_allclose(head_map(score).values, peak)  # the report's head map: the same numbers
    assert not np.allclose(peak, values.mean(-1))  # a mean over tokens would differ


@pytest.mark.parametrize("step", ["greedy", "decore_random"])
def test_n_drops_and_interval_equal_a_count_made_here(run, step):
    values = run.results[step]["context_memory"].values
    defined = values[~np.isnan(values)]
    n, k = defined.size, int(defined.sum())
    low, high = wilson(k, n)
    text = show(str(run.path), "--steps", step)
    row = next(line for line in text.splitlines() if line.startswith(step + " "))
    count = f"{n}/{values.size}" if n < values.size else str(n)
    assert row.split()[-5:] == ["context_memory", f"{k / n:.3f}", count, f"[{low:.3f},", f"{high:.3f}]"], row
    detail = next(line for line in text.splitlines() if "│ context_memory" in line)
    cells = [c.strip() for c in detail.strip("│ ").split("│")]
    assert cells[:4] == ["context_memory", f"{k / n:.4f}", f"[{low:.4f}, {high:.4f}]", str(n)]
    assert cells[4].startswith(str(values.size - n))


def test_steps_in_detail_and_an_unknown_step(run, capfd):
    text = show(str(run.path), "--steps", columns=200)
    for step in run.steps:
        assert re.search(rf"^{step}: ", text, re.M), step
    assert f"{LONG}: detect activation_patching (unit z_position)" in text
    assert "top heads (activation_patching, the per-token peak)" in " ".join(text.split())
    code, err = cli(["show", str(run.path), "gredy"], capfd)
    assert code == 2
    assert error_line(err) == ("error: command line: show: the run has no step 'gredy' (did you mean 'greedy'?); "
                               f"its steps: {LONG}, resid, edges, greedy, decore_random")


def test_each_cell_of_a_sweep_over_the_task_size_counts_its_own_examples(tmp_path):
    spec = ("name: sizes\nmodel: headlab-tiny\ntask: {kind: counterfact, n: 5}\nsteps:\n"
            "  - id: greedy\n    generate: {metrics: [context_memory], max_new_tokens: 3}\n"
            "sweep:\n  task.n: [5, 9]\n")
    run = headlab.run(spec, out=tmp_path)
    rows = [r for r in headlab.summary_rows(run) if r.metric.endswith("context_memory")]
    for r, size in zip(rows, (5, 9), strict=True):
        values = run.cell(f"c000{(5, 9).index(size)}", "greedy")["context_memory"].values
        assert values.size == size
        defined = values[~np.isnan(values)]
        assert (r.cell, r.estimate.n, r.estimate.dropped) == ({"task.n": size}, defined.size, size - defined.size)
        assert r.estimate.mean == pytest.approx(defined.mean())
    text = show(str(run.path))
    assert max(len(line) for line in text.splitlines()) <= 80
    assert [line.split()[-3] for line in text.splitlines() if "context_memory" in line] == [r.n for r in rows]
