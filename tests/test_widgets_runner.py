"""SpecRunner state: validation messages located in the editor, live progress, cancel -> resumable
run -> resume gives the same results as an uninterrupted run."""

from __future__ import annotations

import numpy as np
import pytest

from fixtures.specs import spec_text

pytest.importorskip("ipywidgets")

import headlab  # noqa: E402
from headlab.context import StepContext  # noqa: E402
from headlab.widgets import SpecRunner, WidgetReporter, error_html  # noqa: E402

STEPS = ("  - id: ind\n    detect: {kind: induction}\n"
         "  - id: gen\n    generate: {max_new_tokens: 2, metrics: [contains]}\n")
SWEEP = "  task.length: [4, 6, 8]\n"


def test_validation_errors_are_shown_at_their_line(tmp_path):
    text = spec_text(STEPS, sweep=SWEEP)
    runner = SpecRunner(text.replace("kind: induction", "kind: inductoin", 1), out=tmp_path)
    err = runner.error
    assert err is not None and (err.line, err.col) == (6, 5)
    assert "unknown detector kind 'inductoin' (did you mean 'induction'?)" in err.message
    assert runner.loaded is None and runner.run_button.disabled
    html = runner.errors.value
    assert 'data-line="6"' in html and "detect: {kind: inductoin}" in html
    caret = html.split('class="hl-caret">')[1].split("^")[0]
    assert len(caret) == 7 + 4  # under column 5 of "   6 | "
    # fixing the text clears the error at once (validation runs as one types)
    runner.editor.value = text
    assert runner.error is None and runner.errors.value == "" and not runner.run_button.disabled
    assert "valid: 2 steps, 3 cells" in runner.status.value
    # a YAML syntax error and an unknown key, each located
    runner.editor.value = text.replace("steps:", "steps: [", 1)
    assert runner.error is not None and runner.error.line is not None
    runner.editor.value = text.replace("max_new_tokens", "max_new_tokenz")
    assert runner.error.path == "steps[1].generate.max_new_tokenz" and runner.error.line == 8
    assert "did you mean &#x27;max_new_tokens&#x27;" in runner.errors.value
    # a bad sweep path
    runner.editor.value = text.replace("task.length:", "tsak.length:")
    assert runner.error.path == "sweep.tsak.length" and runner.run_button.disabled
    runner.start(wait=True)
    assert runner.state == "idle"  # an invalid spec does not start


def test_load_file_names_it_in_errors(tmp_path):
    path = tmp_path / "exp.yaml"
    path.write_text(spec_text(STEPS).replace("detect:", "detekt:"))
    runner = SpecRunner(path, out=tmp_path)
    assert runner.path.value == str(path) and runner.editor.value == path.read_text()
    assert str(runner.error).startswith(f"{path}:6:")
    assert f"{path}:6:" in runner.errors.value
    runner.load(tmp_path / "missing.yaml")
    assert "no such spec file" in str(runner.error)
    assert "no such spec file" in error_html(runner.error, "")


def test_run_progress_and_results(tmp_path):
    runner = SpecRunner(spec_text(STEPS, sweep=SWEEP), out=tmp_path)
    runner.start(wait=True)
    assert runner.state == "complete", runner.status.value
    assert runner.cells_bar.value == runner.cells_bar.max == 3 and runner.cells_bar.bar_style == "success"
    hist = runner.reporter.history
    assert hist[0] == ("start", "cells", 0, 3) and hist[-1] == ("stop", "cells", 3, 3)
    cell_values = [v for ev, key, v, _ in hist if ev == "advance" and key == "cells"]
    assert cell_values == [0, 1, 2, 3]  # first advance reports the 0 already-done cells
    assert {key for _, key, _, _ in hist} == {"cells", "step:ind", "step:gen"}
    # in each of the 3 cells: the runner names the step, then the detector's own progress takes the key over
    assert sum(1 for ev, key, _, _ in hist if ev == "start" and key == "step:ind") == 6
    result = runner.result
    assert result is not None and result.status == "complete" and runner.run_path == result.path
    summary, maps, compare = runner.results.children
    assert "headlab run" in summary.value and len(maps.children) == 1
    np.testing.assert_allclose(np.array(maps.children[0].values),
                               result.results["ind"]["score"].mean("task.length").values)
    assert "contains" in compare.metrics_html.value
    assert runner.cancel_button.disabled and not runner.editor.disabled


def test_cancel_leaves_a_resumable_run(tmp_path):
    text = spec_text(STEPS, sweep=SWEEP)
    runner = SpecRunner(text, out=tmp_path / "a")
    original = runner.reporter.advance
    fired: list[int] = []

    def advance(key: str, n: int = 1) -> None:  # press "cancel" once the first cell is stored
        original(key, n)
        if key == "cells" and runner.cells_bar.value == 1 and not fired:
            fired.append(1)
            runner.cancel()

    runner.reporter.advance = advance
    runner.start(wait=True)
    assert runner.state == "interrupted", runner.status.value
    assert runner.run_path is not None and not runner.resume_button.disabled
    stored = headlab.open_run(runner.run_path)
    assert stored.status == "interrupted" and stored.cells_done == 1 and stored.cells_total == 3
    assert "resume to finish" in runner.status.value
    runner.resume(wait=True)
    assert runner.state == "complete" and runner.result.path == stored.path
    assert runner.result.cells_done == 3
    uninterrupted = headlab.run(text, out=tmp_path / "b")
    for step in ("ind", "gen"):
        a, b = runner.result.results[step], uninterrupted.results[step]
        for name in a.data_vars:
            np.testing.assert_array_equal(a[name].values, b[name].values)


def test_widget_reporter_follows_step_progress():
    import ipywidgets as w

    cells, step, label = w.IntProgress(), w.IntProgress(), w.HTML()
    rep = WidgetReporter(cells, step, label)
    ctx = StepContext(model=None, examples=[], results={}, seed=0, step_id="scan", reporter=rep)
    seen = []
    for _ in ctx.progress(range(4), "scanning heads"):
        seen.append(step.value)
    assert seen == [0, 1, 2, 3] and step.value == step.max == 4
    assert step.description == "scan" and "scan: scanning heads" in label.value
    assert rep.history[-1] == ("stop", "step:scan", 4, 4)
