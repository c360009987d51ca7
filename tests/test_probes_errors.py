"""The probe and sav errors of issue 35 through the command line, as a user types them (``headlab run spec.yaml``
in the spec's folder): a label field missing from an example (or from the task's meta), a single class, fewer
examples of a class than folds, groups that leave a fold empty or with one class to train on, a position outside a
prompt and a sav step naming a step that is not a probe are each one located line on stderr, exit 2, no
traceback."""

from __future__ import annotations

import json

import pytest

from fixtures.cli import cli, error_line

LLAMA = {"model_type": "llama", "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "intermediate_size": 64, "vocab_size": 811, "tokenizer": "headlab-tiny"}
ROWS = [{"text": "red cat", "truth": True, "qid": 0}, {"text": "blue dog", "truth": False, "qid": 0},
        {"text": "red bird", "truth": True, "qid": 1}, {"text": "green cat", "truth": False, "qid": 1},
        {"text": "a red dog", "truth": True, "qid": 2}, {"text": "the blue", "truth": False, "qid": 2}]
DETECTOR = "error: step 'pr' (detector 'probe', plugin headlab.plugins.probes.probe): ValueError: probe: "


def run_cli(folder, capfd, monkeypatch, steps: str, rows: list[dict], meta: str = "[truth, qid]") -> tuple[int, str]:
    """``headlab run spec.yaml`` in ``folder`` over ``statements.jsonl``: (exit code, the one error line)."""
    (folder / "statements.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "spec.yaml").write_text(
        f"name: probes\nmodel: {{config: {json.dumps(LLAMA)}}}\n"
        f"task: {{kind: jsonl, path: statements.jsonl, prompt: \"{{{{ text }}}}\", meta: {meta}}}\nsteps:\n{steps}")
    monkeypatch.chdir(folder)
    code, err = cli(["run", "spec.yaml", "--out", "runs"], capfd)
    return code, error_line(err)


PROBE = "  - id: pr\n    detect: {kind: probe, label: truth%s}\n"


@pytest.mark.parametrize("case, options, rows, want", [
    ("missing", "", ROWS[:3] + [{"text": "x", "qid": 1}] + ROWS[4:],
     "error: step 'pr' (task 'jsonl', plugin headlab.plugins.tasks.files): TaskDataError: jsonl task: "
     "statements.jsonl row 4: meta field 'truth' is missing"),
    ("single", "", [{**r, "truth": True} for r in ROWS],
     DETECTOR + "every example has truth = True, a single class; a probe needs examples of at least two classes"),
    ("few", ", folds: 4", ROWS,
     DETECTOR + "class truth = False has 3 example(s), fewer than folds: 4; give every class at least 4 examples "
     "or lower folds"),
    ("few groups", ", group: qid, folds: 4", ROWS + [{**r, "qid": 0} for r in ROWS[:2]],
     DETECTOR + "the examples form 3 group(s), fewer than folds: 4, so a fold would be empty; give more groups or "
     "lower folds"),
    ("one-class group", ", group: qid", [{**r, "qid": int(r["truth"])} for r in ROWS],
     DETECTOR + "fold 0 leaves a single class to train on (groups too large or too few for 2 folds); use more, "
     "smaller groups or lower folds"),
    ("position", ", position: 9", ROWS,
     DETECTOR + "position 9 is outside example 0's prompt of 3 tokens; choose a position inside every prompt "
     "(0 .. its length - 1, or negative from its end)"),
])
def test_probe_input_errors_are_one_line(tmp_path, capfd, monkeypatch, case, options, rows, want):
    code, line = run_cli(tmp_path, capfd, monkeypatch, PROBE % options, rows)
    assert code == 2 and line == want, line


def test_a_label_the_task_does_not_give_is_refused_before_the_run(tmp_path, capfd, monkeypatch):
    code, line = run_cli(tmp_path, capfd, monkeypatch, PROBE % "", ROWS, meta="[qid]")
    assert code == 2
    assert line == ("error: spec.yaml:6:5: steps[0].detect: step 'pr': detector 'probe' reads meta['truth'], which "
                    "task 'jsonl' does not give; probe fits csv/jsonl with meta: [truth]"), line
    assert not (tmp_path / "runs").exists()


def test_sav_naming_a_step_that_is_not_a_probe_is_one_line(tmp_path, capfd, monkeypatch):
    steps = "  - id: ind\n    detect: {kind: induction}\n  - id: vote\n    sav: {probe: ind}\n"
    code, line = run_cli(tmp_path, capfd, monkeypatch, steps, ROWS)
    assert code == 2
    assert line == ("error: step 'vote' (action 'sav', plugin headlab.plugins.probes.sav): ValueError: sav: step "
                    "'ind' is not a probe step (it ran induction); name a step with detect: {kind: probe, "
                    "classifier: nearest_mean, ...}"), line
