"""The errors of the weight-level scores of issue 36 through the command line, as a user types them (``headlab
run spec.yaml`` in the spec's folder): composition on a model whose anatomy lacks a weight, and an eigenvalue
copying score whose vocabulary block is over the memory budget, are each one located line on stderr, exit 2,
no traceback."""

from __future__ import annotations

import json

import pytest

from headlab import Example, StepContext
from headlab.anatomy import AnatomyError
from headlab.model import ModelSpec, load_model
from headlab.plugins.detectors.composition import Composition, detect
from headlab.resources import ENV

from fixtures.cli import cli, error_line

LLAMA = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "intermediate_size": 16, "vocab_size": 811, "max_position_embeddings": 64,
         "tokenizer": "headlab-tiny"}
PLUGIN = "plugin headlab.plugins.detectors"


@pytest.fixture(autouse=True)
def no_env_budget(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)


def run_cli(folder, capfd, monkeypatch, step: str, model: dict, *args: str) -> tuple[int, str]:
    """``headlab run spec.yaml ARGS`` in ``folder`` for a spec of one step: (exit code, stderr)."""
    (folder / "spec.yaml").write_text(f"name: weights\nmodel: {{config: {json.dumps(model)}}}\n"
                                      f"task: {{kind: repeated_tokens, n: 2, length: 4}}\nsteps:\n{step}")
    monkeypatch.chdir(folder)
    return cli(["run", "spec.yaml", "--out", "runs", *args], capfd)


def test_composition_on_a_model_whose_anatomy_lacks_the_head_weights_names_them(tmp_path, capfd, monkeypatch):
    code, err = run_cli(tmp_path, capfd, monkeypatch, "  - id: comp\n    detect: {kind: composition}\n",
                        {**LLAMA, "model_type": "starcoder2"})
    line = error_line(err)
    assert code == 2
    assert line.startswith(f"error: step 'comp' (detector 'composition', {PLUGIN}.composition): AnatomyError: "
                           "composition: the model's anatomy has no W_Q, W_K, W_V, W_O of layer 0: headlab.anatomy: "
                           "model type 'starcoder2' (Starcoder2ForCausalLM) is not supported"), line
    assert not list((tmp_path / "runs").glob("*/cells/*/comp"))


def test_composition_names_the_layer_and_the_module_it_lacks():
    lm = load_model(ModelSpec(config={k: v for k, v in LLAMA.items() if k != "tokenizer"}, device="cpu"))
    del lm.model.model.layers[1].self_attn.o_proj
    ctx = StepContext(model=lm, examples=[Example(prompt="x")], results={}, seed=0)
    with pytest.raises(AnatomyError, match=r"^composition: the model's anatomy has no W_Q, W_K, W_V, W_O of layer 1: "
                                           r"headlab.anatomy: this llama model \(LlamaForCausalLM\) has no 'o_proj' "
                                           r"module"):
        detect(Composition(baseline_samples=2), ctx)


def test_a_vocabulary_block_over_the_memory_budget_is_one_line(tmp_path, capfd, monkeypatch):
    """One layer, untied: the model's 0.46 MiB of parameters fit a 640 KiB budget, the float64 blocks of the
    embedding and the unembedding (2 x 811 rows x 64 x 8 bytes, 0.79 MiB) do not."""
    model = {**LLAMA, "num_hidden_layers": 1, "tie_word_embeddings": False}
    step = ("  - id: copying\n    detect: {kind: copy_suppression, copying: eigen, precision: float64, tokens: 1, "
            "row_block: 1}\n")
    code, err = run_cli(tmp_path, capfd, monkeypatch, step, model, "--memory-limit", "640KiB")
    line = error_line(err)
    assert code == 2
    assert line.startswith("error: step 'copying': vocabulary block of W_E and W_U (copying: eigen) would take an "
                           "estimated 811.0 KiB (2 x 811 vocabulary rows (block) x 64 hidden x 8 bytes; a smaller "
                           "block needs less), over the budget of 640.0 KiB"), line
    code, err = run_cli(tmp_path, capfd, monkeypatch, step.replace("row_block: 1", "row_block: 1, block: 256"),
                        model, "--memory-limit", "640KiB")
    assert code == 0 and "error" not in err, err  # the fix the line names: a smaller block


def test_copying_eigen_on_a_circuit_that_is_not_square_names_both_sizes():
    import torch

    from headlab.plugins.detectors.copy_suppression import CopySuppression
    from headlab.plugins.detectors.copy_suppression import detect as detect_copy

    lm = load_model(ModelSpec(config={k: v for k, v in LLAMA.items() if k != "tokenizer"}, device="cpu"))
    lm.model.lm_head = torch.nn.Linear(64, 800, bias=False)  # an unembedding of 800 columns, 811 embedding rows
    ctx = StepContext(model=lm, examples=[Example(prompt="x")], results={}, seed=0)
    with pytest.raises(ValueError, match=r"^copy_suppression: copying: eigen: the embedding has 811 rows and the "
                                         r"unembedding 800 columns: the OV circuit is not a square matrix"):
        detect_copy(CopySuppression(copying="eigen", tokens=4), ctx)
