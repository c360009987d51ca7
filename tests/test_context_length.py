"""The tokenizer's "Token indices sequence length is longer than the specified maximum sequence length" warning
never reaches the user: a task that tokenizes a long text to cut it is silent, a run with a prompt past the
model's context window fails with headlab's one line (step, task, example, fix), ``tokenize`` outside a run warns
in one line of its own, and a run that asks to extrapolate is silent."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

import headlab
from headlab.generation import ContextLengthWarning, tokenize
from headlab.scoring import build_examples

from fixtures.cli import cli, error_line

ROOT = Path(__file__).parent.parent
pytestmark = pytest.mark.skipif(not (ROOT / "headlab/plugins/models/tiny/headlab-tiny/config.json").is_file(),
                                reason="the embedded model headlab-tiny is not built")
TOKENIZER_WARNING = "Token indices sequence length is longer than the specified maximum"


@pytest.fixture
def said() -> list[str]:
    """What transformers logs (the tokenizer's warning goes through its loggers, not the warnings module)."""
    import logging

    messages: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    logger, keep = logging.getLogger("transformers"), Keep(logging.WARNING)
    logger.addHandler(keep)
    yield messages
    logger.removeHandler(keep)


@pytest.fixture(scope="module")
def tiny() -> headlab.LoadedModel:
    return headlab.load_model(headlab.load_spec("model: headlab-tiny\ntask: {kind: counterfact}\n"
                                                "steps: [{id: g, generate: {}}]\n").spec.model)


def test_a_task_cutting_a_long_text_is_silent(tiny, capfd, said):
    assert tiny.context_length == 4096
    task = headlab.load_spec("model: headlab-tiny\ntask: {kind: niah, context_lengths: [4000], depths: [0.5], "
                             "needles: 1}\nsteps: [{id: g, generate: {}}]\n").spec.task
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        examples = build_examples(task, tiny, 0)  # the haystack is tokenized whole (> 4,096 tokens), then cut
    assert len(tiny.tokenizer(examples[0].prompt)["input_ids"]) <= 4096
    _, err = capfd.readouterr()
    assert TOKENIZER_WARNING not in err and not [m for m in said if TOKENIZER_WARNING in m], said


def test_a_prompt_past_the_context_window_is_one_line_of_headlab(tiny, capfd, said):
    long = "word " * 5000
    with pytest.warns(ContextLengthWarning) as caught:
        batch = tokenize(tiny, [headlab.Example(prompt="short"), headlab.Example(prompt=long)])
    assert batch.input_ids.shape[1] > 4096 and len(caught) == 1
    message = str(caught[0].message)
    assert message.startswith("example 1 of the batch ('word word") and "longer than the model's context " \
        "window of 4,096 tokens" in message and "`model: {extrapolate: true}`" in message
    assert "\n" not in message
    _, err = capfd.readouterr()
    assert TOKENIZER_WARNING not in err and not [m for m in said if TOKENIZER_WARNING in m], said


SPEC = """\
name: long
model: {{id: headlab-tiny, extrapolate: {extrapolate}}}
task: {{kind: niah, context_lengths: [4300], depths: [0.5], needles: 1}}
steps:
  - id: gen
    generate: {{max_new_tokens: 1}}
"""


def test_a_run_past_the_context_window_fails_in_one_line(tmp_path, capfd, said):
    spec = tmp_path / "long.yaml"
    spec.write_text(SPEC.format(extrapolate="false"))
    code, err = cli(["run", str(spec), "--out", str(tmp_path / "runs")], capfd)
    assert code == 2 and TOKENIZER_WARNING not in err and not [m for m in said if TOKENIZER_WARNING in m], err
    line = error_line(err)
    assert line.startswith("error: step 'gen' (task 'niah', ") and "example 0 is 4,3" in line, line
    assert "longer than the model's context window of 4,096 tokens; shorten the task, or set " \
        "`model: {extrapolate: true}` to run past it" in line, line


def test_a_run_that_extrapolates_on_purpose_is_silent(tmp_path, capfd, said):
    with warnings.catch_warnings():
        warnings.simplefilter("error", ContextLengthWarning)
        run = headlab.run(SPEC.format(extrapolate="true"), out=tmp_path)
    assert run.status == "complete" and int((run.results["gen"]["input_ids"] >= 0).sum()) > 4096
    _, err = capfd.readouterr()
    assert TOKENIZER_WARNING not in err and not [m for m in said if TOKENIZER_WARNING in m], said
