"""The head importance errors of issue 36 through the command line, as a user types them (``headlab run spec.yaml``
in the spec's folder): a metric with no gradient, a fraction outside (0, 1] and ``min_per_layer`` above a layer's
heads are each one located line on stderr, exit 2, no traceback."""

from __future__ import annotations

import json
from pathlib import Path

from fixtures.cli import cli, error_line

LLAMA = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 811, "max_position_embeddings": 256,
         "tokenizer": "headlab-tiny"}
IMP = "  - id: imp\n    detect: {kind: head_importance}\n"
MEASURE = "measure: {generate: {max_new_tokens: 1, metrics: [exact_match]}}"


def run_spec(folder: Path, steps: str, capfd, monkeypatch) -> tuple[int, str]:
    """``spec.yaml`` with ``steps`` on a tiny random model, run as ``headlab run spec.yaml`` in ``folder``."""
    (folder / "spec.yaml").write_text(f"name: imp\nmodel: {{config: {json.dumps(LLAMA)}}}\n"
                                      f"task: {{kind: counterfact, n: 2}}\nsteps:\n{steps}")
    monkeypatch.chdir(folder)
    code, err = cli(["run", "spec.yaml", "--out", "runs"], capfd)
    return code, error_line(err)


def test_a_metric_without_a_gradient(tmp_path, capfd, monkeypatch):
    code, line = run_spec(tmp_path, "  - id: imp\n    detect: {kind: head_importance, metric: exact_match}\n",
                          capfd, monkeypatch)
    assert code == 2
    assert line == ("error: spec.yaml:6:37: steps[0].detect.metric: 'exact_match' scores generated text and has no "
                    "gradient with respect to the heads' outputs; use one of cross_entropy, logit_diff, logprob "
                    "(cross_entropy: the task's targets)")


def test_a_fraction_outside_zero_one(tmp_path, capfd, monkeypatch):
    steps = IMP + f"  - id: curve\n    prune_curve: {{heads: {{from: imp}}, {MEASURE}, fractions: [0.5, 1.5]}}\n"
    code, line = run_spec(tmp_path, steps, capfd, monkeypatch)
    assert code == 2
    assert line == ("error: spec.yaml:8:105: steps[1].prune_curve.fractions: fraction 1.5 is outside (0, 1]: a "
                    "fraction of the heads masked, e.g. [0.25, 0.5, 1.0]")
    steps = IMP + f"  - id: curve\n    prune_curve: {{heads: {{from: imp}}, {MEASURE}, fractions: [0]}}\n"
    code, line = run_spec(tmp_path, steps, capfd, monkeypatch)
    assert code == 2 and "steps[1].prune_curve.fractions: fraction 0.0 is outside (0, 1]" in line


def test_min_per_layer_above_the_layers_heads(tmp_path, capfd, monkeypatch):
    steps = IMP + f"  - id: curve\n    prune_curve: {{heads: {{from: imp}}, {MEASURE}, min_per_layer: 5}}\n"
    code, line = run_spec(tmp_path, steps, capfd, monkeypatch)
    assert code == 2
    assert line == ("error: step 'curve' (action 'prune_curve', plugin headlab.plugins.actions.prune_curve): "
                    "ValueError: prune_curve: min_per_layer 5 is more than a layer's 4 heads; give 0 .. 4")



def test_a_mean_mask_without_means_from(tmp_path, capfd, monkeypatch):
    steer = "steer: [{kind: head_mask, heads: [[0, 1]], mode: mean}]"
    code, line = run_spec(tmp_path, f"  - id: gen\n    generate: {{max_new_tokens: 1, {steer}}}\n", capfd,
                          monkeypatch)
    assert code == 2
    assert line.startswith("error: spec.yaml:6:") and line.endswith(
        "steps[0].generate.steer[0]: mode mean replaces z by a mean: give means_from: <step id> (a step whose "
        "result has z_mean, e.g. a prune_curve with mode: mean)"), line


def test_a_mean_mask_from_a_step_without_means(tmp_path, capfd, monkeypatch):
    steer = "steer: [{kind: head_mask, heads: [[0, 1]], mode: mean, means_from: first}]"
    steps = (f"  - id: first\n    generate: {{max_new_tokens: 1}}\n"
             f"  - id: gen\n    generate: {{max_new_tokens: 1, {steer}}}\n")
    code, line = run_spec(tmp_path, steps, capfd, monkeypatch)
    assert code == 2
    assert line == ("error: step 'gen' (steering 'head_mask', plugin headlab.plugins.steering.heads): ValueError: "
                    "head_mask: means_from: step 'first' has no z_mean in this cell (a prune_curve with mode: mean "
                    "records one); name such a step")
