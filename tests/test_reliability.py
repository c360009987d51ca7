"""Hostile and broken input (issue 15): store integrity, safe names, YAML limits, sweep rules, the
template sandbox and data-file errors. Each test fails on the code before the fix (see
docs/reliability.md) and passes after."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import tracemalloc
from pathlib import Path

import pytest
import xarray as xr

import headlab
from headlab.results import RunDamaged, RunNotFound
from headlab.spec import MAX_DEPTH, SpecError

from fixtures.specs import spec_error, spec_text
from fixtures.timing import within

ROOT = Path(__file__).parent.parent
STEPS = """  - id: ind
    detect: {kind: induction, exclude_bos: true}
"""


# --- the run store ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def sweep_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("runs")
    return headlab.run(spec_text(STEPS, sweep="  task.length: [4, 6]\n"), out=out / "src")


def damaged_copy(run, tmp_path, name: str) -> Path:
    path = tmp_path / name
    shutil.copytree(run.path, path)
    return path


def test_every_cell_records_the_arrays_it_wrote(sweep_run):
    attrs = json.loads((sweep_run.path / "cells" / "c0001" / "zarr.json").read_text())["attributes"]
    score = attrs["arrays"]["ind"]["score"]
    assert score["shape"] == [2, 4] and score["chunks"] == 1 and score["keys"] == ["c/0/0"]
    assert not sweep_run.problems and sweep_run.status == "complete"


def test_a_deleted_chunk_is_an_error_naming_it_never_fill_values(sweep_run, tmp_path):
    path = damaged_copy(sweep_run, tmp_path, "chunk")
    (path / "cells" / "c0001" / "ind" / "score" / "c" / "0" / "0").unlink()
    run = headlab.open_run(path)
    with pytest.raises(RunDamaged, match=r"chunk cells/c0001/ind/score/c/0/0 is missing"):
        run.results  # noqa: B018
    with pytest.raises(RunDamaged):
        run.cell("c0001", "ind")
    assert run.status.startswith("damaged: chunk cells/c0001/ind/score/c/0/0")


def test_a_missing_cell_of_a_complete_run_is_an_error(sweep_run, tmp_path):
    path = damaged_copy(sweep_run, tmp_path, "cell")
    shutil.rmtree(path / "cells" / "c0000")
    with pytest.raises(RunDamaged, match="cell c0000 is missing although the run is complete"):
        headlab.open_run(path).results  # noqa: B018


def test_resume_recomputes_damaged_cells_and_equals_the_original(sweep_run, tmp_path):
    path = damaged_copy(sweep_run, tmp_path, "resume")
    (path / "cells" / "c0000" / "ind" / "score" / "c" / "0" / "0").unlink()
    shutil.rmtree(path / "cells" / "c0001" / "ind" / "example_score")
    redone = []
    resumed = headlab.run(None, resume=path, on_cell=lambda c: redone.append(c.index))
    assert redone == [0, 1] and resumed.status == "complete"
    xr.testing.assert_identical(resumed.results["ind"], sweep_run.results["ind"])


def test_runs_lists_every_readable_run_and_marks_damaged_ones(sweep_run, tmp_path):
    runs_dir = tmp_path / "many"
    good = damaged_copy(sweep_run, runs_dir, "a-good")
    no_cells = damaged_copy(sweep_run, runs_dir, "b-no-cells")
    shutil.rmtree(no_cells / "cells")
    bad_json = damaged_copy(sweep_run, runs_dir, "c-bad-json")
    (bad_json / "zarr.json").write_text("{not json")
    bad_cell = damaged_copy(sweep_run, runs_dir, "d-bad-cell")
    (bad_cell / "cells" / "c0000" / "zarr.json").write_text("{")
    runs = {r.path.name: r for r in headlab.list_runs(runs_dir)}
    assert set(runs) == {"a-good", "b-no-cells", "c-bad-json", "d-bad-cell"}
    assert runs["a-good"].status == "complete" and runs["a-good"].path == good
    for name in ("b-no-cells", "c-bad-json", "d-bad-cell"):
        assert runs[name].status.startswith("damaged"), runs[name].status
    res = subprocess.run([sys.executable, "-m", "headlab.cli", "runs", str(runs_dir)], capture_output=True,
                         text=True, timeout=300, env={**os.environ, "COLUMNS": "200"})
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr
    assert res.stdout.count("damaged") == 3 and "complete" in res.stdout, res.stdout
    for path in (no_cells, bad_json):  # resume says what is wrong in one line
        with pytest.raises(RunDamaged) as info:
            headlab.run(None, resume=path)
        assert "damaged run store" in str(info.value) and "\n" not in str(info.value)


KILL_DURING_CREATION = """
import os, signal, sys
import zarr
sys.path.insert(0, {tests!r})
from fixtures.specs import spec_text
import headlab

create_group = zarr.Group.create_group

def create_then_die(self, name, *args, **kwargs):
    if name == "cells":  # the store's root and attributes exist, its cells group not yet
        os.kill(os.getpid(), signal.SIGKILL)
    return create_group(self, name, *args, **kwargs)

zarr.Group.create_group = create_then_die
headlab.run(spec_text({steps!r}), out=sys.argv[1])
"""


def test_a_kill_during_store_creation_leaves_nothing_resume_chokes_on(tmp_path):
    script = tmp_path / "kill.py"
    script.write_text(KILL_DURING_CREATION.format(tests=str(ROOT / "tests"), steps=STEPS))
    out = tmp_path / "runs"
    res = subprocess.run([sys.executable, str(script), str(out)], capture_output=True, text=True, timeout=300)
    assert res.returncode == -signal.SIGKILL, res.stderr
    assert headlab.list_runs(out) == []  # nothing half-created is listed as a run
    (left,) = out.iterdir()
    assert left.name.startswith(".") and left.name.endswith(".creating")
    with pytest.raises(RunNotFound) as info:  # one clear line, never a KeyError
        headlab.run(None, resume=left)
    assert "never finished being created" in str(info.value)
    cli = subprocess.run([sys.executable, "-m", "headlab.cli", "run", "--resume", str(left)],
                         capture_output=True, text=True, timeout=300)
    assert cli.returncode == 2 and "Traceback" not in cli.stderr, cli.stderr


# --- names and sweeps ---------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["../../x", "/tmp/abs", "..", "a/b", "a" * 101])
def test_run_names_are_safe_file_names(name):
    err = spec_error(spec_text(STEPS).replace("name: test", f"name: {json.dumps(name)}"))
    assert str(err).startswith("<spec>:1:1: name:"), err


def test_a_bad_name_never_writes_outside_out(tmp_path):
    out = tmp_path / "a" / "b"
    with pytest.raises(SpecError):
        headlab.run(spec_text(STEPS).replace("name: test", "name: ../../escaped"), out=out)
    assert not (tmp_path / "escaped").exists() and not list(tmp_path.rglob("escaped*"))


def test_step_ids_are_bounded():
    err = spec_error(spec_text(STEPS.replace("id: ind", "id: " + "i" * 65)))
    assert str(err).startswith("<spec>:5:5: steps[0].id:") and "at most 64" in str(err), err


def test_duplicate_sweep_values_are_rejected():
    err = spec_error(spec_text(STEPS, sweep="  task.length: [6, 6]\n"))
    assert str(err).startswith("<spec>:8:3: sweep.task.length:") and "repeats item 0" in str(err), err
    # values the results would label alike are duplicates too
    assert "repeats item 0" in str(spec_error(spec_text(STEPS, sweep="  seed: [1, 1.0]\n")))
    assert "repeats item 0" in str(spec_error(spec_text(STEPS, sweep="  ind: [{kind: induction}, {kind: induction}]\n")))


@pytest.mark.parametrize("sweep, message", [
    ("  steps.0.id: [a, b]\n", "changes the step ids"),
    ("  steps: [[{id: a, detect: {kind: induction}}]]\n", "changes the step ids"),
    ("  ind: [1, 2]\n", "name a key inside step 'ind'"),
    ("  name: [a, b]\n", "'name' cannot be swept"),
])
def test_step_ids_and_the_run_name_cannot_be_swept(sweep, message):
    err = spec_error(spec_text(STEPS, sweep=sweep))
    assert str(err).startswith("<spec>:8:3: sweep.") and message in str(err), err


def test_sweep_validation_is_linear_and_cells_are_lazy(monkeypatch):
    from headlab.spec import sweep as spec_module

    seen = []
    set_path = spec_module.set_path

    def spy(data, dotted, value, **kwargs):
        seen.append("sweep" in data)
        return set_path(data, dotted, value, **kwargs)

    monkeypatch.setattr(spec_module, "set_path", spy)
    values = ", ".join(str(i) for i in range(1, 101))
    sweep = f"  task.length: [{values}]\n  seed: [{values}]\n  task.n: [{values}]\n"
    loaded = headlab.load_spec(spec_text(STEPS, sweep=sweep))
    assert len(seen) == 300 and not any(seen)  # each value once, never copying the sweep itself
    tracemalloc.start()
    try:
        cells = loaded.cells
        assert len(cells) == 1_000_000
        last = cells[-1]
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1_000_000, peak  # the grid is never built
    assert last.index == 999_999 and last.as_dict() == {"task.length": 100, "seed": 100, "task.n": 100}
    assert loaded.cells[123_456].as_dict() == {"task.length": 13, "seed": 35, "task.n": 57}


# --- YAML limits --------------------------------------------------------------------------------

ALIAS_BOMB = "a: &a [x,x,x,x,x,x,x,x,x]\n" + "".join(
    f"{c}: &{c} [*{p},*{p},*{p},*{p},*{p},*{p},*{p},*{p},*{p}]\n" for p, c in zip("abcdefg", "bcdefgh", strict=True))


def test_a_yaml_alias_bomb_fails_fast():
    assert len(ALIAS_BOMB) < 1024
    with within(20):
        err = spec_error(spec_text(STEPS) + ALIAS_BOMB)
    assert "expands to more than" in str(err)


def test_an_alias_bomb_inside_model_config_is_refused():
    text = ("name: test\nmodel:\n  config:\n    model_type: llama\n    extra:\n" + textwrap.indent(ALIAS_BOMB, " " * 6)
            + "task: {kind: repeated_tokens, n: 4, length: 8}\nsteps:\n" + STEPS)
    with within(20):
        err = spec_error(text)
    assert "expands to more than" in str(err) and "model.config.extra" in str(err), err


@pytest.mark.parametrize("text", [
    "a: " + "[" * 5000 + "]" * 5000 + "\n",
    "a: " + "{a: " * 3000 + "1" + "}" * 3000 + "\n",
    "a:\n" + "".join("  " * i + f"k{i}:\n" for i in range(1, 200)) + "  " * 200 + "x: 1\n",
    "".join(f"a{i}: &a{i} [*a{i - 1}]\n" if i else "a0: &a0 [1]\n" for i in range(150)),
])
def test_deep_nesting_is_one_spec_error(text):
    with within(20):
        err = spec_error(text)
    assert f"nested deeper than {MAX_DEPTH} levels" in str(err), err


def test_a_huge_spec_is_refused_before_parsing():
    with within(5):
        err = spec_error(spec_text(STEPS) + "description: '" + "x" * 100_000 + "'\n")
    assert "characters long; the limit is" in str(err)


# --- templates and data files ---------------------------------------------------------------------

def file_task(tmp_path, prompt: str, rows=({"q": "hi"},)):
    from headlab.plugins.tasks.files import JsonlTask

    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return JsonlTask(path=str(path), prompt=prompt)


def build(task):
    from headlab import TaskContext
    from headlab.plugins.tasks.files import build_file_task

    return build_file_task(task, TaskContext(tokenizer=None, seed=0, vocab_size=0))


@pytest.mark.parametrize("prompt, message", [
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
     "more than 100,000 loop iterations and calls"),
    ("{% macro f(d) %}{% if d < 40 %}{{ f(d + 1) }}{{ f(d + 1) }}{% endif %}{% endmacro %}{{ f(0) }}",
     "more than 100,000 loop iterations and calls"),
    ("{{ q * 3000000 }}", "would build a value of 6,000,000"),
    ("{{ q|center(6000000) }}", "would build a value of 6,000,000"),
    ("{{ '{:>6000000}'.format(q) }}", "would build a field of 6,000,000"),
    ("{% set ns = namespace(s=q) %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}",
     "would build a value of"),
    ("{% for i in range(60000) %}{{ q * 50 }}{% endfor %}", "renders more than 5,000,000 characters"),
    ("{{ 2 ** 100000 }}", "integer of more than 4096 bits"),
])
def test_templates_are_bounded(tmp_path, prompt, message):
    from headlab.plugins.tasks.files import TaskDataError

    with within(30), pytest.raises(TaskDataError) as info:
        build(file_task(tmp_path, prompt))
    assert "d.jsonl row 1" in str(info.value) and "template `prompt`" in str(info.value)
    assert message in str(info.value), info.value


def test_a_bounded_template_still_renders(tmp_path):
    examples = build(file_task(tmp_path, "{% for c in q %}[{{ loop.index }}{{ c|upper }}]{% endfor %}{{ q ~ '!' }} "
                                         "{{ '%s-%d'|format(q, 3) }} {{ [q, q]|join(', ') }} {{ q * 2 }}"))
    assert examples[0].prompt == "[1H][2I]hi! hi-3 hi, hi hihi"


@pytest.mark.parametrize("tag", ["{% include 'x.txt' %}", "{% import 'm.j2' as m %}",
                                 "{% from 'm.j2' import f %}", "{% extends 'base.j2' %}"])
def test_include_and_import_are_refused_naming_the_template(tag):
    text = spec_text(STEPS, task=json.dumps({"kind": "jsonl", "path": "d.jsonl", "prompt": "Q " + tag}))
    err = spec_error(text)
    assert str(err).startswith("<spec>:3:") and "task.prompt" in str(err), err
    assert "template `prompt`" in str(err) and "is not allowed" in str(err)


def test_a_csv_field_over_the_csv_limit_names_file_and_line(tmp_path):
    import csv

    from headlab.plugins.tasks.files import CsvTask, TaskDataError

    path = tmp_path / "big.csv"
    path.write_text("q,a\nshort,1\n" + "x" * (csv.field_size_limit() + 10) + ",2\n")
    with pytest.raises(TaskDataError) as info:
        build(CsvTask(path=str(path), prompt="{{ q }}"))
    assert "big.csv line 3" in str(info.value) and "csv module's limit" in str(info.value)


@pytest.mark.parametrize("name, content", [
    ("bad.jsonl", b'{"q": "a"}\n{"q": "b"}\n{"q": "\xff"}\n'),
    ("bad.csv", b"q\nfine\n\xc3(\n"),
    ("bad.json", b'[{"q": "a"},\n {"q": "\xe2\x28\xa1"}]'),
])
def test_bad_utf8_in_a_data_file_names_file_and_line(tmp_path, name, content):
    from headlab.plugins.tasks.files import CsvTask, JsonlTask, TaskDataError

    path = tmp_path / name
    path.write_bytes(content)
    task = (CsvTask if name.endswith(".csv") else JsonlTask)(path=str(path), prompt="{{ q }}")
    with pytest.raises(TaskDataError) as info:
        build(task)
    line = {"bad.jsonl": 3, "bad.csv": 3, "bad.json": 2}[name]
    assert f"{name} line {line}: invalid UTF-8" in str(info.value), info.value


def test_a_bom_is_still_dropped(tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"q": "x"}\n')
    from headlab.plugins.tasks.files import JsonlTask

    assert build(JsonlTask(path=str(path), prompt="{{ q }}"))[0].prompt == "x"
