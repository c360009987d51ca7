"""Hostile input, round two (issue [robustness]), while a run runs: a plugin's result checked against its
contract before it is stored, unstorable task fields, a full disk or a file-size limit, running out of memory,
one giant word in a task's text, progress inside long cells, and the Ray executor's resources and addresses.
Each case goes through the command line where the user meets it: exit code and one located line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Literal

import numpy as np
import pytest
import xarray as xr

import headlab
from headlab import ComponentConfig, StepError, hookimpl
from headlab.dims import head_array

from fixtures.cli import cli, error_line
from fixtures.specs import spec_text

STEPS = "  - id: ind\n    detect: {kind: induction}\n"


# --------------------------------------------------------------------------- a result's contract
class Odd(ComponentConfig):
    """A detector returning a chosen malformed result."""

    kind: Literal["odd"] = "odd"
    what: str = "good"


def odd(config: Odd, ctx):
    g = ctx.model.geometry
    score = head_array(np.arange(g.n_layers * g.n_heads, dtype=float).reshape(g.n_layers, g.n_heads))
    if config.what == "good":
        return score.to_dataset(name="score")
    if config.what == "transposed":  # over (head, layer) with the model's sizes swapped
        return xr.Dataset({"score": (("head", "layer"), np.zeros((g.n_layers, g.n_heads)))})
    if config.what == "too_many_layers":
        return xr.Dataset({"score": (("layer", "head"), np.zeros((g.n_layers + 3, g.n_heads)))})
    if config.what == "nan":
        return (score * np.nan).to_dataset(name="score")
    if config.what == "inf":
        return score.where(score > 0, np.inf).to_dataset(name="score")
    if config.what == "dicts":
        return xr.Dataset({"score": score, "info": ("example", np.array([{"a": i} for i in range(4)], dtype=object))})
    if config.what == "unknown_dim":
        return xr.Dataset({"score": score, "trace": (("example", "sample"), np.zeros((4, 3)))})
    if config.what == "examples":  # one value per example, but the task has 4
        return xr.Dataset({"score": score, "loss": ("example", np.zeros(7))})
    raise AssertionError(config.what)


class OddPlugin:
    @hookimpl
    def headlab_register_detectors(self, register):
        register(Odd, odd)


@pytest.fixture
def odd_plugin():
    name = headlab.register_plugin(OddPlugin(), "odd-plugin")
    yield name
    headlab.unregister_plugin(name)


@pytest.mark.parametrize("what, message", [
    ("transposed", "variable 'score': dimension 'layer' has size 4, but layers number 2"),
    ("too_many_layers", "variable 'score': dimension 'layer' has size 5, but layers number 2"),
    ("nan", "variable 'score' is NaN for every head: nothing was scored"),
    ("inf", "variable 'score' is infinite for some heads"),
    ("dicts", "variable 'info' holds dict values ({'a': 0})"),
    ("unknown_dim", "variable 'trace' has dimension 'sample', which is not one of headlab.DIMENSIONS"),
    ("examples", "variable 'loss': dimension 'example' has size 7, but examples number 4"),
])
def test_a_result_that_breaks_the_contract_is_refused_naming_plugin_and_variable(odd_plugin, tmp_path, capfd,
                                                                                   what, message):
    # the first cell is good and stays readable; the second breaks the contract
    text = spec_text(STEPS + "  - id: o\n    detect: {kind: odd}\n", sweep=f"  o.what: [good, {what}]\n")
    spec = tmp_path / "s.yaml"
    spec.write_text(text)
    code, err = cli(["run", str(spec), "--out", str(tmp_path / "runs")], capfd)
    line = error_line(err)
    assert code == 1, err
    assert line.startswith(f"error: step 'o' of cell c0001 (o.what='{what}') (detector 'odd', plugin {odd_plugin}): "
                           "ContractError: the result cannot be stored: "), line
    assert message in line, line
    (run,) = (tmp_path / "runs").iterdir()
    stored = headlab.open_run(run)
    assert stored.status == "failed" and stored.cells_done == 1
    assert float(stored.cell("c0000", "o")["score"].sum()) == sum(range(8))  # the earlier cell is intact
    assert "c0001" in stored.failed_cells and not (run / "cells" / "c0001" / "o").exists()  # nothing of the step
    assert stored.partial_cells["c0001"]["steps"] == ["ind"]  # the step before it is kept, marked partial


def test_a_good_result_is_stored_as_returned(odd_plugin, tmp_path):
    run = headlab.run(spec_text("  - id: o\n    detect: {kind: odd}\n"), out=tmp_path)
    assert run.results["o"]["score"].values.tolist() == np.arange(8.0).reshape(2, 4).tolist()


@pytest.mark.parametrize("rows, message", [
    ([{"q": "a b", "x": 1}, {"q": "c d", "x": "two"}],
     "meta field 'x' mixes types: int in example 0, str in example 1 ('two')"),
    ([{"q": "a b", "x": 1}, {"q": "c d", "x": 2**70}],
     "meta field 'x' of example 1 is 1180591620717411303424, an integer beyond 64 bits"),
    ([{"q": "a b", "x": True}, {"q": "c d", "x": 2.5}], "meta field 'x' mixes types: bool in example 0, float"),
])
def test_unstorable_task_fields_are_refused_before_the_step_runs(tmp_path, capfd, rows, message):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    spec = tmp_path / "s.yaml"
    spec.write_text(f"name: t\nmodel: headlab-tiny\ntask: {{kind: jsonl, path: {data}, prompt: '{{{{ q }}}}', "
                    "meta: [x]}\nsteps:\n  - id: gen\n    generate: {max_new_tokens: 1}\n")
    code, err = cli(["run", str(spec), "--out", str(tmp_path / "runs")], capfd)
    line = error_line(err)
    assert code == 2 and line.startswith("error: step 'gen' (task 'jsonl', plugin headlab.plugins.tasks.files): "), line
    assert message in line, line
    (run,) = (tmp_path / "runs").iterdir()
    assert headlab.open_run(run).status == "failed"


def test_numbers_of_both_kinds_combine_in_a_field(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text('{"q": "a b", "x": 1}\n{"q": "c d", "x": 2.5}\n')
    run = headlab.run(f"name: t\nmodel: headlab-tiny\ntask: {{kind: jsonl, path: {data}, prompt: '{{{{ q }}}}', "
                      "meta: [x]}\nsteps:\n  - id: gen\n    generate: {max_new_tokens: 1}\n", out=tmp_path / "runs")
    assert run.results["gen"]["x"].values.tolist() == [1.0, 2.5]


# --------------------------------------------------------------------------- a full disk, a file-size limit
LIMITED = """
import resource, sys
resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit}))
from headlab.cli import main
main(sys.argv[1:])
"""


@pytest.mark.slow  # a whole run in a subprocess under a file-size limit
def test_a_file_size_limit_names_the_path_and_the_resume_command_and_marks_the_run_failed(tmp_path):
    # the store's metadata fits under the limit; the stored prompts and token ids of 64 x 241 random tokens do not
    spec = tmp_path / "s.yaml"
    spec.write_text(spec_text("  - id: ind\n    detect: {kind: previous_token}\n",
                              task="{kind: repeated_tokens, n: 64, length: 120}",
                              model={"model_type": "llama", "hidden_size": 32, "num_hidden_layers": 1,
                                     "num_attention_heads": 2, "num_key_value_heads": 1, "intermediate_size": 32,
                                     "vocab_size": 50000, "max_position_embeddings": 256}))
    res = subprocess.run([sys.executable, "-c", LIMITED.format(limit=8_000), "run", str(spec), "--out",
                          str(tmp_path / "runs")], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    (run,) = (tmp_path / "runs").iterdir()
    line = error_line(res.stderr)
    assert res.returncode == 1, res.stderr
    assert f"cannot write cell c0000 into {run}/cells/c0000" in line and "File too large" in line, line
    assert f"then finish the run with `headlab run --resume {run}`" in line, line
    stored = headlab.open_run(run)
    assert stored.status == "failed" and stored.cells_done == 0  # not "running"
    # with the limit gone, the resume command it printed finishes the run
    res = subprocess.run([sys.executable, "-m", "headlab.cli", "run", "--resume", str(run)], capture_output=True,
                         text=True, timeout=300, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert headlab.open_run(run).status == "complete"


def test_a_full_disk_in_the_writer_is_one_line_and_a_failed_run(tmp_path, capfd, monkeypatch):
    import errno

    from headlab.results import RunWriter

    def full(self, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(RunWriter, "write_cell", full)
    spec = tmp_path / "s.yaml"
    spec.write_text(spec_text(STEPS))
    code, err = cli(["run", str(spec), "--out", str(tmp_path / "runs")], capfd)
    (run,) = (tmp_path / "runs").iterdir()
    line = error_line(err)
    assert code == 1 and f"cannot write cell c0000 into {run}/cells/c0000: No space left on device" in line, line
    assert f"`headlab run --resume {run}`" in line
    assert headlab.open_run(run).status == "failed"
    # full before the store exists: one line naming where it would have been, nothing left behind
    monkeypatch.setattr(RunWriter, "create", classmethod(lambda cls, path, attrs: full(cls)))
    code, err = cli(["run", str(spec), "--out", str(tmp_path / "other")], capfd)
    line = error_line(err)
    assert code == 1 and f"cannot create the run store {tmp_path / 'other'}/test-" in line, line
    assert "No space left on device; free space" in line and not (tmp_path / "other").exists()


# --------------------------------------------------------------------------- out of memory
@pytest.mark.parametrize("error, message", [
    ("cuda", "out of GPU memory allocating 20.00 GiB"),
    ("host", "out of host memory allocating 7.28 TiB"),
    ("bare", "out of host memory allocating (the allocator did not say how much)"),
])
def test_out_of_memory_names_the_step_the_size_and_the_knobs(tmp_path, capfd, monkeypatch, error, message):
    import torch
    import transformers

    def forward(self, *args, **kwargs):
        if error == "cuda":
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0 has a total "
                                              "capacity of 79.10 GiB of which 3.2 GiB is free.\nIf reserved ...")
        if error == "host":
            raise MemoryError("Unable to allocate 7.28 TiB for an array with shape (1000000, 1000000)")
        raise MemoryError()

    monkeypatch.setattr(transformers.LlamaForCausalLM, "forward", forward)
    spec = tmp_path / "s.yaml"
    spec.write_text(spec_text("  - id: gen\n    generate: {max_new_tokens: 2, batch_size: 4}\n"))
    code, err = cli(["run", str(spec), "--out", str(tmp_path / "runs")], capfd)
    line = error_line(err)
    assert code == 1, err
    assert line.startswith("error: step 'gen' (decoder 'greedy', plugin headlab.plugins.decoding.greedy): "
                           f"OutOfMemory: {message}; "), line
    assert "generate.batch_size of step 'gen'" in line and "limits.memory" in line, line
    with pytest.raises(StepError) as info:
        headlab.run(spec.read_text(), out=tmp_path / "api")
    assert isinstance(info.value, MemoryError)  # `except MemoryError` still catches it
    assert type(info.value.cause.__cause__).__name__ == ("OutOfMemoryError" if error == "cuda" else "MemoryError")


# --------------------------------------------------------------------------- one giant word
GIANT = "x" * 10_000_000  # 10 MB without a space


def test_a_giant_word_in_a_data_file_is_one_line_naming_the_row(tmp_path):
    data = tmp_path / "d.jsonl"
    word = "x" * 300_000  # 300 KB without a space (the 10 MB one is refused by the template's output bound)
    data.write_text(json.dumps({"q": "a b"}) + "\n" + json.dumps({"q": f"the {word} end"}) + "\n")
    spec = tmp_path / "s.yaml"
    spec.write_text(f"name: t\nmodel: headlab-tiny\ntask: {{kind: jsonl, path: {data}, prompt: '{{{{ q }}}}'}}\n"
                    "steps:\n  - id: gen\n    generate: {max_new_tokens: 1}\n")
    res = subprocess.run([sys.executable, "-m", "headlab.cli", "run", str(spec), "--out", str(tmp_path / "runs")],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert res.returncode == 2, res.stderr[-2000:]  # not 134 (an abort), not a run
    line = error_line(res.stderr)
    assert "step 'gen' (task 'jsonl'" in line and "d.jsonl row 2" in line and "template `prompt`" in line, line
    assert "a word of 300,000 characters without whitespace (from character 5)" in line, line


def test_a_giant_word_in_a_haystack_file_names_its_line_and_column(tmp_path, capfd):
    hay = tmp_path / "hay.txt"
    hay.write_text("The grass is green.\nIt rained " + GIANT + " today.\n")
    spec = tmp_path / "s.yaml"
    spec.write_text(f"name: t\nmodel: headlab-tiny\ntask: {{kind: niah, context_lengths: [64], depths: [0.5], needles: 1, "
                    f"haystack: {hay}}}\nsteps:\n  - id: r\n    detect: {{kind: retrieval}}\n")
    code, err = cli(["run", str(spec), "--out", str(tmp_path / "runs")], capfd)
    line = error_line(err)
    assert code == 2 and "step 'r' (task 'niah'" in line, line
    assert f"haystack file '{hay}' line 2 has a word of 10,000,000 characters without whitespace (from column 11)" \
        in line, line
    hay.write_text("The grass is green.\nIt rained " + "x" * 1000 + " today.\n")  # long, under the bound: runs
    assert cli(["run", str(spec), "--out", str(tmp_path / "runs")], capfd)[0] == 0


class Giant(ComponentConfig):
    kind: Literal["giant"] = "giant"


def giant_task(config: Giant, ctx):
    return [headlab.Example(prompt="a b"), headlab.Example(prompt="c d", target=" " + GIANT)]


class GiantPlugin:
    @hookimpl
    def headlab_register_tasks(self, register):
        register(Giant, giant_task)


def test_a_giant_word_from_any_task_is_refused_before_the_tokenizer(tmp_path):
    name = headlab.register_plugin(GiantPlugin(), "giant-plugin")
    try:
        with pytest.raises(StepError) as info:
            headlab.run("name: t\nmodel: headlab-tiny\ntask: {kind: giant}\nsteps:\n  - id: gen\n"
                        "    generate: {max_new_tokens: 1}\n", out=tmp_path)
    finally:
        headlab.unregister_plugin(name)
    assert isinstance(info.value, ValueError) and info.value.kind == "giant"
    assert "task 'giant': example 1's target has a word of 10,000,000 characters" in str(info.value)


# --------------------------------------------------------------------------- the Ray executor
@pytest.mark.parametrize("form", ["{}", "ray://{}"])
def test_an_unreachable_ray_address_is_one_line_within_15_s(tmp_path, capfd, monkeypatch, form):
    import socket
    import time

    pytest.importorskip("ray")
    with socket.socket() as s:  # a local port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    address = form.format(f"127.0.0.1:{port}")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    spec = tmp_path / "s.yaml"
    spec.write_text(spec_text(STEPS))
    start = time.monotonic()
    code, err = cli(["run", str(spec), "--out", str(tmp_path / "runs"), "--executor", "ray", "--address", address],
                    capfd)
    assert time.monotonic() - start < 15, err  # Ray alone retried for 40 s without a word
    line = error_line(err)
    assert code == 2, err
    assert f"cannot reach a Ray cluster at address '{address}': 127.0.0.1:{port}: Connection refused" in line, line
    assert not (tmp_path / "runs").exists()
    # RAY_ADDRESS with address auto is probed the same way
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{port}")
    code, err = cli(["run", str(spec), "--out", str(tmp_path / "runs"), "--executor", "ray", "--address", "auto"],
                    capfd)
    assert code == 2 and f"RAY_ADDRESS '127.0.0.1:{port}'" in error_line(err), err


class SmallCluster:
    """What the executor asks of Ray, for a cluster of 2 CPUs and no GPU (a real one: tests/test_executor_ray.py)."""

    def is_initialized(self):
        return True

    def cluster_resources(self):
        return {"CPU": 2.0, "memory": 1e9}

    def get_runtime_context(self):
        raise AssertionError("no worker may be started")


@pytest.mark.parametrize("ask, named", [
    ({"num_cpus_per_cell": 8}, "execution.num_cpus_per_cell is 8 but the Ray cluster has 2 CPUs in all"),
    ({"num_gpus_per_cell": 0.5}, "execution.num_gpus_per_cell is 0.5 but the Ray cluster has 0 GPUs in all"),
])
def test_a_worker_the_cluster_cannot_hold_is_one_line_before_the_store(tmp_path, capfd, monkeypatch, ask, named):
    from headlab.plugins.executors import ray as executor

    monkeypatch.setattr(executor, "_ray", SmallCluster)
    spec = tmp_path / "s.yaml"
    spec.write_text(spec_text(STEPS) + "execution: " + json.dumps({"executor": "ray", **ask}) + "\n")
    code, err = cli(["run", str(spec), "--out", str(tmp_path / "runs")], capfd)
    assert code == 2 and named in error_line(err), err
    assert not (tmp_path / "runs").exists()


# --------------------------------------------------------------------------- progress inside long cells
LONG = ("  - id: gen\n    generate: {max_new_tokens: 2, batch_size: 64}\n"
        "  - id: g2\n    generate: {max_new_tokens: 1, batch_size: 16}\n")
LONG_TASK = "{kind: repeated_tokens, n: 64, length: 64}"  # 64 rows x 128 tokens: one forward of 8,192 tokens


def test_the_command_shows_progress_inside_a_cell_on_a_log(tmp_path, capfd, monkeypatch):
    monkeypatch.setenv("HEADLAB_PROGRESS_SECONDS", "0")
    spec = tmp_path / "s.yaml"
    spec.write_text(spec_text(LONG, task=LONG_TASK))
    code, err = cli(["run", str(spec), "--out", str(tmp_path / "runs")], capfd)
    assert code == 0, err
    lines = [line.rsplit(" [", 1)[0] for line in err.splitlines()]  # without the elapsed time
    assert lines[0] == "test: cells: 0/1" and lines[-1] == "test: cells: 1/1", err
    # every line names the step that runs: its id, its place, what it does
    assert lines[1] == "step gen (1/2): generate greedy" and "step g2 (2/2): generate greedy" in lines, err
    assert all(line.startswith(("step gen", "step g2")) for line in lines[1:-1]), err
    inside = lines[lines.index("step gen: generating: 0/1"):]
    assert inside[:4] == ["step gen: generating: 0/1", "step gen: forward over 8,192 tokens: layers: 0/2",
                          "step gen: forward over 8,192 tokens: layers: 1/2",
                          "step gen: forward over 8,192 tokens: layers: 2/2"], err
    generating = [line for line in lines if ": generating" in line]
    assert generating == ["step gen: generating: 0/1", "step gen: generating: 1/1",
                          *(f"step g2: generating: {i}/4" for i in range(5))], err
    # short forwards (the decoding steps, the batches of 16 x 128 tokens of g2) report no layers
    assert sum(line.startswith("step gen: forward over") for line in lines) == 3, err
    assert not any("forward over" in line for line in lines if line.startswith("step g2")), err


def test_the_notebook_runner_shows_progress_inside_a_cell(tmp_path):
    pytest.importorskip("ipywidgets")
    from headlab.widgets import SpecRunner

    runner = SpecRunner(spec_text(LONG, task=LONG_TASK), out=tmp_path)
    runner.start(wait=True)
    assert runner.state == "complete", runner.status.value
    hist = runner.reporter.history
    forward = [(ev, value, total) for ev, key, value, total in hist if key == "forward:gen"]
    assert forward == [("start", 0, 2), ("advance", 1, 2), ("advance", 2, 2), ("stop", 2, 2)]
    assert [value for ev, key, value, _ in hist if ev == "advance" and key == "step:g2"] == [1, 2, 3, 4]
    assert runner.step_bar.max == 4  # the forward's layers never took over the step's bar


# --------------------------------------------------------------------------- the fuzz benchmark, briefly
@pytest.mark.slow  # the fuzz script, a process per case
def test_the_fuzz_benchmark_finds_no_escape_hang_or_code_run():
    import importlib.util

    spec = importlib.util.spec_from_file_location("fuzz", Path(__file__).parent.parent / "tools" / "reliability"
                                                  / "fuzz.py")
    fuzz = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fuzz)
    # the payloads are live: lm-eval's own (unsandboxed) renderer runs one and the marker appears
    lm_eval_utils = pytest.importorskip("lm_eval.utils")
    marker = Path(fuzz.tempfile.mkdtemp()) / "MARKER"
    lm_eval_utils.apply_template(f"{{{{ cycler.__init__.__globals__.os.system('touch {marker}') }}}}", {})
    assert marker.exists()
    report = fuzz.fuzz(60, seed=3, timeout=20.0, shares=(0.5, 0.5))
    assert (report["escapes"], report["hangs"], report["code_runs"], report["unlocated"]) == (0, 0, 0, 0), \
        report["failures"][:3]
    by = report["by_source"]
    assert by["set"].get("accepted", 0) and by["set"].get("refused", 0), by  # both outcomes are exercised
    assert by["lm_eval"].get("rendered", 0) and by["lm_eval"].get("refused", 0), by
