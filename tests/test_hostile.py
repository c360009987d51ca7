"""Hostile input, round two (issue [robustness]): each case is one a hostile or careless user tried, and what
headlab must do instead of what it did. Other classes live beside the code they exercise:
a spec that runs code -> tests/test_task_code.py; stored runs that cannot be read -> tests/test_runner.py
(``test_cells_of_different_sizes_*``, ``test_one_malformed_or_newer_run_*``); README examples ->
tests/test_example_specs.py.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from fixtures.cli import run
from fixtures.specs import spec_text

STEPS = "  - id: ind\n    detect: {kind: induction}\n"


def cli(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``headlab ARGS`` as typed in ``cwd``, in this process (none of these cases needs a process of its own)."""
    return run(*args, cwd=cwd, env=env)


def one_line(res: subprocess.CompletedProcess, code: int = 2) -> str:
    """The one error line of a command that failed with ``code`` (progress bars aside)."""
    assert res.returncode == code, res.stdout + res.stderr
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    if any(line.startswith("error:") for line in lines):  # a run that stopped: its progress lines, then the error
        lines = [line for line in lines if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in res.stderr, res.stderr
    return lines[0]


# --------------------------------------------------------------------------- provenance that cannot lie
def test_a_tilde_in_out_is_the_home_directory(tmp_path):
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir(), work.mkdir()
    (work / "spec.yaml").write_text(spec_text(STEPS))
    res = cli("run", "spec.yaml", "--out", "~/runs", cwd=work, env={"HOME": str(home)})
    assert res.returncode == 0, res.stderr
    assert not (work / "~").exists()  # nothing under ./~ ...
    (run,) = (home / "runs").iterdir()  # ... the whole store in $HOME/runs, readable
    assert "complete" in cli("show", str(run), cwd=work).stdout
    assert run.name in cli("runs", "~/runs", cwd=work, env={"HOME": str(home)}).stdout


def test_resume_refuses_the_flags_it_cannot_honour(tmp_path):
    (tmp_path / "spec.yaml").write_text(spec_text(STEPS))
    assert cli("run", "spec.yaml", "--out", "runs", cwd=tmp_path).returncode == 0
    (run,) = (tmp_path / "runs").iterdir()
    for extra, named in [(["spec.yaml"], "SPEC"), (["--set", "seed=3"], "--set"), (["--out", "other"], "--out"),
                         (["spec.yaml", "--set", "seed=3", "--out", "o"], "SPEC, --set, --out")]:
        line = one_line(cli("run", *extra, "--resume", str(run), cwd=tmp_path))
        assert f"cannot honour {named}" in line and "without --resume" in line
    assert not (tmp_path / "other").exists() and not (tmp_path / "o").exists()
    res = cli("run", "--resume", str(run), cwd=tmp_path)
    assert res.returncode == 0, res.stderr


def test_task_fields_cannot_clobber_headlabs_own_variables(tmp_path):
    data = tmp_path / "qa.jsonl"
    data.write_text('{"q": "Q1", "prompt": "fake", "layer": 3}\n{"q": "Q2", "prompt": "fake", "layer": 4}\n')
    for field, what in [("prompt", "variable 'prompt'"), ("layer", "dimension 'layer'")]:
        meta = f"meta: [{field}]" if field else ""
        text = (f"name: t\nmodel: headlab-tiny\ntask: {{kind: jsonl, path: {data}, prompt: '{{{{ q }}}}', {meta}}}\n"
                "steps:\n  - id: gen\n    generate: {max_new_tokens: 1}\n")
        (tmp_path / "spec.yaml").write_text(text)
        line = one_line(cli("run", "spec.yaml", "--out", "runs", cwd=tmp_path))
        assert f"a field {field!r}, the name of headlab's own {what}" in line and "gen" in line, line


# --------------------------------------------------------------------------- nothing hangs
def alias_bomb(levels: int = 9) -> str:
    names = [chr(97 + i) for i in range(levels)]
    parts = [f"{names[0]}: &{names[0]} [x, x, x, x, x, x, x, x, x, x]"]
    parts += [f"{n}: &{n} [" + ", ".join([f"*{p}"] * 10) + "]" for p, n in zip(names, names[1:], strict=False)]
    return "{" + ", ".join(parts) + "}"


def test_set_values_go_through_the_spec_loader_and_name_set(tmp_path):
    (tmp_path / "spec.yaml").write_text(spec_text(STEPS))
    cases = [(alias_bomb(), "expands to more than"), ("!!python/object/apply:os.system [id]", "is not allowed"),
             ("[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]]]"
              "]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]", "nested deeper than"),
             ("abc", "task.n: Input should be a valid integer"),
             ('"\\x00\\uD800"', "the text holds an unpaired surrogate (\\ud800)")]
    for value, message in cases:
        res = cli("run", "spec.yaml", "--set", f"task.n={value}", "--out", "runs", cwd=tmp_path)
        line = one_line(res)
        assert line.startswith("error: command line: --set task.n=") and message in line, line
    line = one_line(cli("run", "spec.yaml", "--set", "task.nn=3", "--out", "runs", cwd=tmp_path))
    assert "--set task.nn=3: task.nn: unknown key 'nn' (did you mean 'n'?)" in line
    assert not (tmp_path / "runs").exists()  # refused before the store exists


def test_a_step_id_set_to_a_collection_is_refused_with_the_others_still_addressed(tmp_path):
    (tmp_path / "spec.yaml").write_text(spec_text(STEPS))
    for value in ("[6, 9]", "{kind: niah}"):
        line = one_line(cli("run", "spec.yaml", "--set", f"steps.0.id={value}", "--set", "task.n=3",
                            "--out", "runs", cwd=tmp_path))
        assert line.startswith("error: ") and "steps[0].id: Input should be a valid string" in line, line
    line = one_line(cli("run", "spec.yaml", "--set", "steps=5", "--set", "gen.max_new_tokens=3", cwd=tmp_path))
    assert "'gen' is neither a top-level key nor a step id" in line, line
    (tmp_path / "surrogate.yaml").write_text(spec_text(STEPS).replace("name: test", 'name: "\\udc00"', 1))
    line = one_line(cli("validate", "surrogate.yaml", cwd=tmp_path))
    assert "unpaired surrogate (\\udc00)" in line and "surrogate.yaml:" in line, line
    assert not (tmp_path / "runs").exists()


# --------------------------------------------------------------------------- contracts enforced
def _selection(**kw):
    from headlab.spec import HeadsFrom

    return HeadsFrom.model_validate({"from": "det", **kw})


def test_head_selections_refuse_what_would_run_silently_wrong():
    import numpy as np
    import pytest

    from headlab.dims import head_array
    from headlab.geometry import Geometry
    from headlab.heads import HeadSelectionError, select_heads

    geo = Geometry(n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8)
    good = {"det": head_array(np.arange(8.0).reshape(2, 4)).to_dataset(name="score")}
    assert select_heads(_selection(top=2), good, geo) == [(1, 3), (1, 2)]
    nan = {"det": head_array(np.full((2, 4), np.nan)).to_dataset(name="score")}
    with pytest.raises(HeadSelectionError, match="only 0 heads have a finite score"):
        select_heads(_selection(top=4), nan, geo)
    transposed = {"det": head_array(np.zeros((2, 4))).T.rename({"layer": "head", "head": "layer"}).to_dataset(name="score")}
    with pytest.raises(HeadSelectionError, match="is 4 layers x 2 heads; this model has 2 x 4"):
        select_heads(_selection(top=1), transposed, geo)
    with pytest.raises(HeadSelectionError, match=r"threshold 100.0 selects no head .*highest score is 7"):
        select_heads(_selection(threshold=100), good, geo)
    assert select_heads(_selection(threshold=100, allow_empty=True), good, geo) == []


def test_an_in_memory_store_is_refused_on_the_command_line(tmp_path):
    (tmp_path / "spec.yaml").write_text(spec_text(STEPS))
    line = one_line(cli("run", "spec.yaml", "--out", "memory://runs", cwd=tmp_path))
    assert "an in-memory store ends with this process" in line
    (tmp_path / "mem.yaml").write_text(spec_text(STEPS, out="memory://runs"))
    assert "output 'memory://runs'" in one_line(cli("run", "mem.yaml", cwd=tmp_path))


def test_a_factor_beyond_float32_is_refused_when_validated():
    from headlab import SpecError, load_spec

    text = spec_text("  - id: gen\n    generate: {max_new_tokens: 1, steer: [{kind: head_scale, heads: [[0, 1]], "
                     "factor: 1e39}]}\n")
    try:
        load_spec(text)
    except SpecError as e:
        assert "steer[0].factor" in str(e) and "beyond float32's range" in str(e), str(e)
    else:
        raise AssertionError("1e39 is infinite in float32 and must be refused")
    load_spec(text.replace("1e39", "1e38"))


def test_a_generator_refuses_what_it_cannot_produce_before_generating():
    import time

    import pytest

    from headlab import SpecError, load_spec
    from headlab.plugins.tasks import generators

    most = generators.max_distractors()
    assert 100 < most < 10_000
    text = "name: t\nmodel: headlab-tiny\ntask: {kind: niah, context_lengths: [64], depths: 2, needles: 1, " \
           "distractors: %d}\nsteps:\n  - id: r\n    detect: {kind: retrieval}\n"
    start = time.monotonic()
    with pytest.raises(SpecError, match=f"at most {most} distractors"):
        load_spec(text % (most + 1))
    assert time.monotonic() - start < 10  # refused at once (it looped forever at 100% CPU)
    load_spec(text % most)
    with pytest.raises(ValueError, match="distinct subjects"):
        generators.niah([64], [0.5], generators.DEFAULT_NEEDLES[:1], seed=0, distractors=most + 1)


# --------------------------------------------------------------------------- past the model
def test_prompts_past_the_context_window_are_refused_with_both_numbers(tmp_path):
    import headlab

    # TINY_LLAMA: max_position_embeddings 256; a 300-token repeated sequence is past it
    long = spec_text("  - id: gen\n    generate: {max_new_tokens: 4}\n", task="{kind: repeated_tokens, n: 1, length: 150}")
    (tmp_path / "long.yaml").write_text(long)
    line = one_line(cli("run", "long.yaml", "--out", "runs", cwd=tmp_path))
    assert "example 0 is 300 tokens + 4 new tokens = 304, longer than the model's context window of 256" in line
    assert "`model: {extrapolate: true}`" in line and "step 'gen'" in line
    # right at the limit it runs; asked for, past it runs too
    edge = spec_text("  - id: gen\n    generate: {max_new_tokens: 6}\n", task="{kind: repeated_tokens, n: 1, length: 125}")
    assert headlab.run(edge, out=tmp_path / "ok").status == "complete"  # 250 + 6 = 256
    asked = long.replace('"max_position_embeddings": 256}', '"max_position_embeddings": 256}, extrapolate: true')
    assert "extrapolate: true" in asked
    assert headlab.run(asked, out=tmp_path / "ok").status == "complete"
