"""The circuit analysis errors of issue 23 through the command line, as a user types them (``headlab run
spec.yaml`` in the spec's folder): unequal pair lengths, a multi-token answer, a metric equal on the clean and the
corrupted prompts, and a unit the architecture lacks are each one located line on stderr, exit 2, no traceback."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import headlab

from fixtures.cli import cli, error_line

# a tiny random model on the embedded model's word tokenizer (every word of the pairs below is one token)
LLAMA = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 811, "max_position_embeddings": 256,
         "tokenizer": "headlab-tiny"}
POST_NORM = {
    "gemma2": {**LLAMA, "model_type": "gemma2", "head_dim": 16, "query_pre_attn_scalar": 16},
    "olmo2": {**LLAMA, "model_type": "olmo2"},
}
ROWS = [{"clean": "red : blue , green : cat . red :", "corrupt": "red : blue , green : cat . green :",
         "answer": "blue", "wrong": "cat"},
        {"clean": "red : dog , green : bird . green :", "corrupt": "red : dog , green : bird . red :",
         "answer": "bird", "wrong": "dog"}]
PLUGIN = "plugin headlab.plugins"
HEADLAB = Path(sys.executable).parent / "headlab"  # the console script a user types


def write_spec(folder, steps: str, rows: list[dict], model: dict | None = None, sweep: str = "") -> None:
    """``spec.yaml`` and its ``pairs.jsonl`` (a path relative to the folder the user runs in)."""
    (folder / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    text = (f"name: circuits\nmodel: {{config: {json.dumps(model or LLAMA)}}}\n"
            f"task: {{kind: pairs, path: pairs.jsonl}}\nsteps:\n{steps}")
    (folder / "spec.yaml").write_text(text + (f"sweep:\n{sweep}" if sweep else ""))


def run_cli(folder, capfd, monkeypatch) -> tuple[int, str]:
    """``headlab run spec.yaml`` in ``folder``: (exit code, the one error line)."""
    monkeypatch.chdir(folder)
    code, err = cli(["run", "spec.yaml", "--out", "runs"], capfd)
    return code, error_line(err)


def test_a_pair_of_unequal_token_lengths_names_the_file_and_the_row(tmp_path, capfd, monkeypatch):
    rows = [ROWS[0], {**ROWS[1], "corrupt": "red : dog , green : bird bird . red :"}]
    write_spec(tmp_path, "  - id: dla\n    detect: {kind: direct_logit_attribution}\n", rows)
    want = (f"error: step 'dla' (task 'pairs', {PLUGIN}.tasks.pairs): TaskDataError: pairs task: pairs.jsonl row 2: "
            "the clean prompt is 11 tokens and the corrupted one 12; a pair needs prompts of equal token length")
    code, line = run_cli(tmp_path, capfd, monkeypatch)
    assert code == 2 and line == want


@pytest.mark.slow  # a headlab process of its own
def test_a_pair_of_unequal_token_lengths_is_the_same_line_as_typed(tmp_path):
    rows = [ROWS[0], {**ROWS[1], "corrupt": "red : dog , green : bird bird . red :"}]
    write_spec(tmp_path, "  - id: dla\n    detect: {kind: direct_logit_attribution}\n", rows)
    res = subprocess.run([str(HEADLAB), "run", "spec.yaml"], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert res.returncode == 2 and error_line(res.stderr) == (
        f"error: step 'dla' (task 'pairs', {PLUGIN}.tasks.pairs): TaskDataError: pairs task: pairs.jsonl row 2: "
        "the clean prompt is 11 tokens and the corrupted one 12; a pair needs prompts of equal token length"), res.stderr


@pytest.mark.parametrize("field, value, what", [("answer", "blue green", "the answer ' blue green' is 2 tokens"),
                                                ("wrong", "cat dog cat", "the wrong answer ' cat dog cat' is 3 "
                                                 "tokens")])
def test_an_answer_of_several_tokens_names_the_file_and_the_row(tmp_path, capfd, monkeypatch, field, value, what):
    write_spec(tmp_path, "  - id: patch\n    detect: {kind: activation_patching}\n",
               [ROWS[0], {**ROWS[1], field: value}])
    code, line = run_cli(tmp_path, capfd, monkeypatch)
    assert code == 2
    assert line.startswith(f"error: step 'patch' (task 'pairs', {PLUGIN}.tasks.pairs): TaskDataError: pairs task: "
                           f"pairs.jsonl row 2: {what}"), line


@pytest.mark.parametrize("normalise, what", [
    ("means", "the mean metric is the same on the clean and the corrupted prompts"),
    ("per_example", "example 0 has the same metric on its clean and corrupted prompts")])
def test_a_corruption_that_leaves_the_metric_unchanged_is_one_line(tmp_path, capfd, monkeypatch, normalise, what):
    same = [{**row, "corrupt": row["clean"]} for row in ROWS]
    write_spec(tmp_path, f"  - id: patch\n    detect: {{kind: activation_patching, normalise: {normalise}}}\n", same)
    code, line = run_cli(tmp_path, capfd, monkeypatch)
    assert code == 2
    assert line.startswith(f"error: step 'patch' (detector 'activation_patching', {PLUGIN}.detectors."
                           f"activation_patching): ValueError: activation_patching: {what}"), line
    assert "undefined" in line


@pytest.mark.parametrize("arch", sorted(POST_NORM))
def test_edge_attribution_on_a_post_norm_architecture_is_one_line(tmp_path, capfd, monkeypatch, arch):
    write_spec(tmp_path, "  - id: eap\n    detect: {kind: edge_attribution}\n", ROWS, model=POST_NORM[arch])
    code, line = run_cli(tmp_path, capfd, monkeypatch)
    assert code == 2
    assert line.startswith(f"error: step 'eap' (detector 'edge_attribution', {PLUGIN}.detectors.edge_attribution): "
                           f"ValueError: edge_attribution: {arch} normalises each attention output before the "
                           "residual stream"), line
    assert line.endswith("use a pre-norm model (llama, mistral, qwen2, gpt2, phi3)")


@pytest.mark.parametrize("option, what", [
    ("senders: [[2, 0]]", "sender [2, 0] is not a head of this model (2 layers x 4 heads)"),
    ("senders: [[0, 4]]", "sender [0, 4] is not a head of this model (2 layers x 4 heads)"),
    ("receivers: {heads: [[1, 2]], input: v}", "receiver [1, 2] is not one of this model's key/value heads (2 layers "
                                               "x 2; input v)")])
def test_path_patching_with_a_head_the_model_lacks_is_one_line(tmp_path, capfd, monkeypatch, option, what):
    write_spec(tmp_path, f"  - id: paths\n    detect: {{kind: path_patching, {option}}}\n", ROWS)
    code, line = run_cli(tmp_path, capfd, monkeypatch)
    assert code == 2
    assert line.startswith(f"error: step 'paths' (detector 'path_patching', {PLUGIN}.detectors.path_patching): "
                           f"ValueError: path_patching: {what}"), line


def test_the_cells_before_a_failing_one_are_kept(tmp_path, capfd, monkeypatch):
    """A sweep whose second cell's pairs file has a multi-token answer: the first cell (both steps) is on disk,
    the run is marked failed and the line names the failing cell. (Within a cell, the steps completed before a
    failing one are kept as a partial cell: tests/test_partial_cells.py.)"""
    steps = ("  - id: dla\n    detect: {kind: direct_logit_attribution}\n"
             "  - id: patch\n    detect: {kind: activation_patching}\n")
    write_spec(tmp_path, steps, ROWS, sweep="  task.path: [pairs.jsonl, bad.jsonl]\n")
    (tmp_path / "bad.jsonl").write_text(json.dumps({**ROWS[0], "answer": "blue green"}) + "\n")
    code, line = run_cli(tmp_path, capfd, monkeypatch)
    assert code == 2
    assert "cell c0001 (task.path='bad.jsonl')" in line and "bad.jsonl row 1: the answer ' blue green' is 2" in line
    (store,) = (tmp_path / "runs").iterdir()
    run = headlab.open_run(store)
    assert run.status == "failed" and run.cells_done == 1 and set(run.failed_cells) == {"c0001"}
    dla, patch = run.cell("c0000", "dla"), run.cell("c0000", "patch")
    assert dla.sizes["example"] == patch.sizes["example"] == 2
    assert patch["score"].dims == ("layer", "head")
    assert float(abs(patch["clean"] - patch["corrupt"]).min()) > 0  # the corruption changes each answer's metric
    for i in range(2):  # the two steps read the same clean runs
        assert float(patch["clean"][i]) == pytest.approx(float(dla["logit_diff"][i]), abs=1e-4)


@pytest.mark.parametrize("unit", ["resid", "kv"])
def test_activation_patching_on_an_architecture_whose_layers_headlab_does_not_know_is_one_line(
        tmp_path, capfd, monkeypatch, unit):
    """On a supported architecture every unit runs (tests/test_detectors_activation_patching.py); on one whose
    decoder layers headlab's anatomy does not know, the residual stream (``resid``) and the forwards started at
    the patched layer (``resume``, the default) cannot be placed: one line naming the step and the model type."""
    starcoder2 = {**LLAMA, "model_type": "starcoder2"}
    write_spec(tmp_path, f"  - id: patch\n    detect: {{kind: activation_patching, unit: {unit}}}\n", ROWS,
               model=starcoder2)
    code, line = run_cli(tmp_path, capfd, monkeypatch)
    assert code == 2
    assert line.startswith(f"error: step 'patch' (detector 'activation_patching', {PLUGIN}.detectors."
                           "activation_patching): AnatomyError: headlab.anatomy: model type 'starcoder2' "
                           "(Starcoder2ForCausalLM) is not supported: its layers and projections are not known"), line
