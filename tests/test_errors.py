"""Errors at the boundary (issue 15): one line naming the spec location or the step, plugin and file; exit
codes 0 / 1 / 2 / 130; ``--debug`` for the traceback. Each example of the issue that printed a traceback has
a test here, except those part 1 tests (tests/test_reliability.py: nesting depth, Jinja include, CSV field
limit, bad UTF-8, names and ids too long; YAML ``!!pairs`` and complex keys with part 1's spec loading)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Literal

import pytest
import torch

import headlab
from headlab import ComponentConfig, StepError, hookimpl
from headlab.model import ModelLoadError
from headlab.spec import SpecError

from fixtures.cli import cli, error_line
from fixtures.specs import TINY_LLAMA, spec_error, spec_text

ROOT = Path(__file__).parent.parent
STEPS = "  - id: ind\n    detect: {kind: induction}\n"
MODEL_LINE = f"model: {{config: {json.dumps(TINY_LLAMA)}}}"


# --- a broken plugin: named with its step, exit 1 (a bug) or 2 (it refused its input) -------------------

class Boom(ComponentConfig):
    """A detector that fails in a chosen way."""

    kind: Literal["boom"] = "boom"
    what: str = "runtime"


def boom(config: Boom, ctx):
    if config.what == "none":
        return None
    if config.what == "exit":
        sys.exit(3)
    if config.what == "value":
        raise ValueError("this input is wrong\nsecond line")
    raise RuntimeError("kaboom")


class BoomPlugin:
    @hookimpl
    def headlab_register_detectors(self, register):
        register(Boom, boom)


@pytest.fixture
def boom_plugin():
    name = headlab.register_plugin(BoomPlugin(), "boom-plugin")
    yield name
    headlab.unregister_plugin(name)


@pytest.mark.parametrize("what, cause, code", [
    ("runtime", "RuntimeError: kaboom", 1),
    ("value", "ValueError: this input is wrong second line", 2),
    ("none", "ContractError: the detector returned NoneType, not an xarray Dataset", 1),  # issue: returning None
    ("exit", "SystemExit: the plugin called sys.exit(3)", 1),  # a plugin exiting mid-run is no success
])
def test_a_plugin_exception_names_step_component_and_plugin(boom_plugin, tmp_path, capfd, what, cause, code):
    text = spec_text(STEPS + f"  - id: b\n    detect: {{kind: boom, what: {what}}}\n")
    with pytest.raises(StepError) as info:
        headlab.run(text, out=tmp_path / "api")
    e = info.value
    assert (e.step, e.action, e.kind, e.plugin, e.category) == ("b", "detect", "boom", boom_plugin, "detector")
    assert isinstance(e, type(e.__cause__)) or what == "exit"  # `except ValueError` still catches it
    assert str(e) == f"step 'b' (detector 'boom', plugin {boom_plugin}): {cause}"
    assert type(e.__cause__).__name__ == cause.split(":")[0]
    spec = tmp_path / "s.yaml"
    spec.write_text(text)
    got, err = cli(["run", str(spec), "--out", str(tmp_path / "cli")], capfd)
    assert got == code, err
    assert error_line(err).startswith(f"error: step 'b' (detector 'boom', plugin {boom_plugin}): {cause}")


def test_debug_shows_the_traceback(boom_plugin, tmp_path, capfd):
    spec = tmp_path / "s.yaml"
    spec.write_text(spec_text("  - id: b\n    detect: {kind: boom}\n"))
    code, err = cli(["run", str(spec), "--out", str(tmp_path / "a")], capfd)
    assert code == 1 and "Traceback" not in err and "--debug shows the traceback" in err
    code, err = cli(["run", str(spec), "--out", str(tmp_path / "b"), "--debug"], capfd)
    assert code == 1 and "Traceback (most recent call last)" in err and 'raise RuntimeError("kaboom")' in err
    assert err.strip().splitlines()[-1].startswith("error: step 'b'")


def test_a_failing_builtin_names_its_own_plugin(tmp_path):
    """The innermost registered component in the traceback is named: here the task of the step."""
    data = tmp_path / "d.jsonl"
    data.write_text('{"q": "a"}\n{"q": \n')
    text = spec_text(STEPS, task=json.dumps({"kind": "jsonl", "path": str(data), "prompt": "{{ q }}"}))
    with pytest.raises(StepError) as info:
        headlab.run(text, out=tmp_path)
    assert str(info.value).startswith("step 'ind' (task 'jsonl', plugin headlab.plugins.tasks.files): "
                                      "TaskDataError: ")
    assert "d.jsonl line 2" in str(info.value)


def test_a_decoder_error_names_the_decoder(tmp_path, monkeypatch):
    from headlab.plugins.decoding import dola

    def broken(*args, **kwargs):
        raise ValueError("premature layer out of range")

    monkeypatch.setattr(dola, "candidate_layers", broken)  # fails inside the decoder's own module
    text = spec_text(STEPS + "  - id: gen\n    generate: {decode: {kind: dola}, max_new_tokens: 2}\n",
                     sweep="  task.length: [4, 5]\n")
    with pytest.raises(StepError) as info:
        headlab.run(text, out=tmp_path)
    assert str(info.value) == ("step 'gen' of cell c0000 (task.length=4) (decoder 'dola', plugin "
                               "headlab.plugins.decoding.dola): ValueError: premature layer out of range")


def test_exit_codes(tmp_path, capfd):
    good = tmp_path / "good.yaml"
    good.write_text(spec_text(STEPS))
    assert cli(["run", str(good), "--out", str(tmp_path / "r")], capfd)[0] == 0
    bad = tmp_path / "bad.yaml"
    bad.write_text(spec_text(STEPS).replace("induction", "inductoin"))
    assert cli(["run", str(bad)], capfd)[0] == 2
    assert cli(["validate", str(bad)], capfd)[0] == 2
    assert cli(["show", str(tmp_path)], capfd)[0] == 2
    assert cli(["run"], capfd)[0] == 2


def test_a_plugin_exiting_at_import_leaves_runs_working(tmp_path):
    """Issue 15: a plugin calling sys.exit at import killed every command. It is reported and skipped."""
    (tmp_path / "exits_now.py").write_text("import sys\nsys.exit('plugin refuses to load')\n")
    info = tmp_path / "exits_now-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: exits_now\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[headlab]\nexits_now = exits_now\n")
    spec = tmp_path / "s.yaml"
    spec.write_text(spec_text(STEPS))
    env = {"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    res = subprocess.run([sys.executable, "-m", "headlab.cli", "run", str(spec), "--out", str(tmp_path / "r")],
                         capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr


# --- tracebacks the issue listed, now one located line -------------------------------------------------

def test_a_list_where_a_component_is_expected():
    err = spec_error(spec_text("  - id: ind\n    detect: [induction]\n"))
    assert err.startswith("<spec>:6:5: steps[0].detect: expected a detector: a mapping with `kind`")
    assert err.endswith("got a list")
    err = spec_error(spec_text("  - id: ind\n    detect: {kind: [induction]}\n"))
    assert "`kind` must be a name" in err and "got a list" in err


@pytest.mark.parametrize("length, message", [
    ("[]", "<spec>:3:37: task.length: "),  # was ZeroDivisionError
    ("0", "<spec>:3:37: task.length: Input should be greater than or equal to 1"),  # were all-zero scores
    ("-3", "<spec>:3:37: task.length: Input should be greater than or equal to 1"),
    ("[4, 0]", "<spec>:3:49: task.length[1]: Input should be greater than or equal to 1"),
])
def test_empty_zero_and_negative_lengths(length, message):
    assert spec_error(spec_text(STEPS, task=f"{{kind: repeated_tokens, n: 4, length: {length}}}")).startswith(message)


@pytest.mark.parametrize("model, where", [
    ("{path: ''}", "model.path: String should have at least 1 character"),
    ("''", "model: String should have at least 1 character"),
    ("{id: headlab-tiny, device: tpu9}", "model.device: unknown device 'tpu9'"),
    ("{id: headlab-tiny, device: meta}", "model.device: unknown device 'meta'"),
])
def test_empty_model_path_and_unknown_device(model, where):
    err = spec_error(spec_text(STEPS).replace(MODEL_LINE, f"model: {model}"))
    assert where in err and err.startswith("<spec>:2:"), err


def test_cuda_without_cuda_is_one_line(tmp_path, capfd, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    text = spec_text(STEPS).replace(MODEL_LINE, f"model: {{config: {json.dumps(TINY_LLAMA)}, device: 'cuda:0'}}")
    with pytest.raises(ModelLoadError, match=r"device 'cuda:0': this machine .* has no CUDA device"):
        headlab.run(text, out=tmp_path)
    assert not (tmp_path).exists() or not list(tmp_path.iterdir())
    spec = tmp_path / "s.yaml"
    spec.write_text(text.replace("'cuda:0'", "cuda"))
    code, err = cli(["run", str(spec), "--out", str(tmp_path / "r")], capfd)
    assert code == 2 and "error: device 'cuda': this machine" in error_line(err)


def test_a_corrupted_safetensors_file_is_one_line(tmp_path, capfd):
    from headlab.plugins.models.embedded import CHECKPOINT

    ckpt = tmp_path / "ckpt"
    shutil.copytree(CHECKPOINT, ckpt)
    weights = ckpt / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[:8] + b"{garbage" + data[16: len(data) // 2])
    text = spec_text(STEPS).replace(MODEL_LINE, f"model: {{path: {json.dumps(str(ckpt))}}}")
    with pytest.raises(ModelLoadError) as info:
        headlab.run(text, out=tmp_path / "r")
    assert f"cannot load model '{ckpt}'" in str(info.value) and "\n" not in str(info.value)
    spec = tmp_path / "s.yaml"
    spec.write_text(text)
    code, err = cli(["run", str(spec), "--out", str(tmp_path / "r")], capfd)
    assert code == 2 and f"cannot load model '{ckpt}'" in error_line(err)


# --- unclear errors, now naming their key or file --------------------------------------------------------

@pytest.mark.parametrize("seed", ["100000000000000000000000000", "1099511627776", "-1"])
def test_a_huge_or_negative_seed_names_seed(seed):
    err = spec_error(spec_text(STEPS) + f"seed: {seed}\n")
    assert err.startswith("<spec>:7:1: seed: "), err
    with pytest.raises(SpecError, match=r"^<dict>: seed: "):
        headlab.load_spec({"task": {"kind": "repeated_tokens"}, "steps": [{"id": "a", "detect": {"kind": "induction"}}],
                           "seed": int(seed)})


@pytest.mark.parametrize("heads", ["{from: ind, top: 0}", "{file: h.json, top: 0}"])
def test_top_0_names_top(heads):
    err = spec_error(spec_text(STEPS + f"  - id: g\n    generate: {{steer: [{{kind: pasta, heads: {heads}}}]}}\n"))
    assert "steps[1].generate.steer[0].heads.top: Input should be greater than or equal to 1" in err, err


def test_top_larger_than_the_model_is_refused_before_running(tmp_path):
    text = spec_text(STEPS + "  - id: g\n    generate: {decode: {kind: decore, heads: {from: ind, top: 9}}}\n")
    with pytest.raises(SpecError) as info:
        headlab.run(text, out=tmp_path)
    assert str(info.value) == ("<spec>:8:58: steps[1].generate.decode.heads.top: top 9 is more than this model's 8 "
                               "heads (2 layers x 4 heads)")
    assert not tmp_path.exists() or not list(tmp_path.iterdir())  # refused before a store was created
    headlab.run(text.replace("top: 9", "top: 8"), out=tmp_path)  # every head is allowed


@pytest.mark.parametrize("content, message", [
    (b"{not json", "line 1 column 2: not JSON"),
    (b'{"0": [1],\n "1": [oops]}', "line 2 column 8: not JSON"),
    (b'{"0-1": [0.5], "\xff": 1}', "not UTF-8 text"),
    (b'{"a-b": [1]}', "not a retrieval-head"),
])
def test_a_bad_heads_file_names_the_file(tmp_path, content, message):
    heads = tmp_path / "heads.json"
    heads.write_bytes(content)
    text = spec_text(STEPS + f"  - id: g\n    generate: {{steer: [{{kind: head_mask, heads: {{file: {heads}}}}}]}}\n")
    with pytest.raises(StepError) as info:
        headlab.run(text, out=tmp_path / "r")
    assert f"heads file '{heads}'" in str(info.value) and message in str(info.value), info.value
    assert "\n" not in str(info.value)
