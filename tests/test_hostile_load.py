"""Hostile input, round two (issue [robustness]), at load time and on resume: models headlab cannot study, hub
ids that cannot load, lm-eval tasks that cannot run, empty prompts, the datasets cache, and resuming a run
whose inputs changed or whose store holds links. Each is refused with one located line (exit code 2) before
anything is computed or written, or, for the cache and links, never writes outside the place it belongs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import xarray as xr

import headlab
from headlab.model import ModelLoadError, load_model
from headlab.spec import ModelSpec, SpecError

from fixtures.cli import run
from fixtures.specs import TINY_LLAMA, spec_text

STEPS = "  - id: ind\n    detect: {kind: induction}\n"
TASK = "{kind: repeated_tokens, n: 2, length: 4}"


def cli(*args: str, cwd: Path, env: dict[str, str] | None = None, drop: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """``headlab ARGS`` as typed in ``cwd``: in this process, or in a new one where the case changes the environment
    (cache directories that libraries read when they are imported)."""
    if not env and not drop:
        return run(*args, cwd=cwd)
    full = {k: v for k, v in {**os.environ, **(env or {})}.items() if k not in drop}
    return subprocess.run([sys.executable, "-m", "headlab.cli", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=300, env=full)


def one_line(res: subprocess.CompletedProcess, code: int = 2) -> str:
    """The one error line of a command that failed with ``code`` (progress bars aside)."""
    assert res.returncode == code, res.stdout + res.stderr
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    if any(line.startswith("error:") for line in lines):
        lines = [line for line in lines if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in res.stderr, res.stderr
    return lines[0]


def tiny_tokenizer():
    from headlab.model import load_model_by_name_tokenizer

    return load_model_by_name_tokenizer("headlab-tiny")


def save_checkpoint(directory: Path, model_type: str, **config) -> Path:
    """A tiny checkpoint with random weights and headlab-tiny's tokenizer (811 tokens), saved locally."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **config))
    model.save_pretrained(directory)
    tiny_tokenizer().save_pretrained(directory)
    return directory


SMALL = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
         "intermediate_size": 64, "max_position_embeddings": 64}


# --------------------------------------------------------------------------- models headlab cannot study
def test_an_encoder_checkpoint_is_refused_before_a_store_exists(tmp_path):
    save_checkpoint(tmp_path / "bert", "bert", vocab_size=900, hidden_size=32, num_hidden_layers=1,
                    num_attention_heads=2, intermediate_size=64, is_decoder=True)
    (tmp_path / "s.yaml").write_text(f"name: t\nmodel: {{path: bert}}\ntask: {TASK}\nsteps:\n{STEPS}")
    line = one_line(cli("run", "s.yaml", "--out", "runs", cwd=tmp_path))
    assert "model 'bert' is a bert model, an encoder" in line and "needs a decoder-only language model" in line
    assert not (tmp_path / "runs").exists()


def test_a_tokenizer_past_the_embedding_is_refused_before_a_store_exists(tmp_path):
    save_checkpoint(tmp_path / "small", "llama", vocab_size=97, **SMALL)
    (tmp_path / "s.yaml").write_text(f"name: t\nmodel: {{path: small}}\ntask: {TASK}\nsteps:\n{STEPS}")
    line = one_line(cli("run", "s.yaml", "--out", "runs", cwd=tmp_path))
    assert "its tokenizer has 811 tokens (ids up to 810) but its input embedding has 97 rows" in line, line
    assert "vocab_size of at least 811" in line
    assert not (tmp_path / "runs").exists()
    # the same model with an embedding for every token loads
    save_checkpoint(tmp_path / "fits", "llama", vocab_size=811, **SMALL)
    assert load_model(ModelSpec(path=str(tmp_path / "fits"))).geometry.n_heads == 2


def test_configs_headlab_cannot_study_are_refused_naming_the_fix():
    cases = [({"model_type": "llama", **{**TINY_LLAMA, "num_key_value_heads": 3}},
              "4 attention heads cannot share 3 key/value heads", "e.g. 2"),
             ({**TINY_LLAMA, "tokenizer": "headlab-tiny"}, "811 tokens (ids up to 810)", "97 rows"),
             ({"model_type": "bart", "vocab_size": 97, "d_model": 32, "encoder_layers": 1, "decoder_layers": 1,
               "encoder_attention_heads": 2, "decoder_attention_heads": 2, "encoder_ffn_dim": 64,
               "decoder_ffn_dim": 64}, "is an encoder-decoder model", "decoder-only"),
             ({"model_type": "roberta", "vocab_size": 97, "hidden_size": 32, "num_hidden_layers": 1,
               "num_attention_heads": 2, "intermediate_size": 64}, "a roberta model, an encoder", "decoder-only")]
    for config, first, second in cases:
        start = time.monotonic()
        with pytest.raises(ModelLoadError) as info:
            load_model(ModelSpec(config=config))
        assert first in str(info.value) and second in str(info.value), str(info.value)
        assert time.monotonic() - start < 5  # from the config, before any weight is built
    assert load_model(ModelSpec(config={**TINY_LLAMA, "num_key_value_heads": 1})).geometry.n_kv_heads == 1


def test_a_divisible_kv_head_count_is_found_at_load_not_in_the_detector(tmp_path):
    model = {**TINY_LLAMA, "num_key_value_heads": 3}
    (tmp_path / "s.yaml").write_text(spec_text(STEPS, model=model))
    line = one_line(cli("run", "s.yaml", "--out", "runs", cwd=tmp_path))
    assert "4 attention heads cannot share 3 key/value heads" in line and "induction" not in line
    assert not (tmp_path / "runs").exists()


# --------------------------------------------------------------------------- hub ids that cannot load
@pytest.fixture
def empty_hub(monkeypatch, tmp_path):
    """An empty local hub cache, the hub online as far as the client knows."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    return constants


def test_an_unreachable_hub_is_one_line_at_once(empty_hub, monkeypatch):
    import socket

    with socket.socket() as s:  # a port nothing listens on: connections are refused
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setattr(empty_hub, "ENDPOINT", f"http://127.0.0.1:{port}")
    start = time.monotonic()
    with pytest.raises(ModelLoadError) as info:
        load_model(ModelSpec(id="someorg/not-here"))
    assert time.monotonic() - start < 5
    assert f"the hub cannot be reached (127.0.0.1:{port}: Connection refused)" in str(info.value)
    assert "hf download someorg/not-here" in str(info.value)


def test_a_hub_that_does_not_answer_gives_up_after_the_probe(empty_hub, monkeypatch):
    import socket

    from headlab import model as model_module

    calls = []

    def silent(address, timeout=None):
        calls.append((address, timeout))
        raise TimeoutError

    monkeypatch.setattr(socket, "create_connection", silent)
    with pytest.raises(ModelLoadError, match=r"huggingface.co:443: no answer within 5 s"):
        load_model(ModelSpec(id="someorg/not-here"))
    assert calls == [(("huggingface.co", 443), model_module.HUB_PROBE_SECONDS)]  # one probe, no retries


def test_offline_missing_paths_and_non_ids_are_one_line(tmp_path):
    # the suite runs with HF_HUB_OFFLINE=1 (conftest), as the subprocess does
    cases = [("someorg/not-here", "is not in the local Hugging Face cache, and HF_HUB_OFFLINE is set"),
             ("./not-here", "no such checkpoint directory"), (str(tmp_path / "gone"), "no such checkpoint directory"),
             ("a/b/c", "no such checkpoint directory")]
    for ref, message in cases:
        with pytest.raises(ModelLoadError, match=message):
            load_model(ModelSpec(id=ref))
    (tmp_path / "s.yaml").write_text(f"name: t\nmodel: someorg/not-here\ntask: {TASK}\nsteps:\n{STEPS}")
    start = time.monotonic()
    line = one_line(cli("run", "s.yaml", "--out", "runs", cwd=tmp_path, env={"HF_HOME": str(tmp_path / "hf")}))
    assert "model 'someorg/not-here' is not a checkpoint directory" in line and "HF_HUB_OFFLINE" in line
    assert time.monotonic() - start < 120 and not (tmp_path / "runs").exists()


# --------------------------------------------------------------------------- lm-eval tasks that cannot run
@pytest.fixture(scope="module")
def task_dir(tmp_path_factory) -> Path:
    pytest.importorskip("lm_eval")
    from headlab import lm_eval as harness

    d = tmp_path_factory.mktemp("tasks")
    rows = [{"question": f"What is {i} plus 0", "answer": [str(i)]} for i in range(4)]
    (d / "nq.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    harness.local_task("nq_open", d / "nq.jsonl", d / "tasks", name="local_nq")
    return d


def eval_spec(evaluate: str) -> str:
    return f"name: ev\nmodel: headlab-tiny\ntask: {TASK}\nsteps:\n  - id: eval\n    evaluate: {evaluate}\n"


def preflight_error(text: str) -> str:
    from headlab.runner import check_steps

    loaded = headlab.load_spec(text)  # valid as data ...
    with pytest.raises(SpecError) as info:
        check_steps(loaded)  # ... refused by what lm-eval knows
    assert "\n" not in str(info.value)
    return str(info.value)


def test_lm_eval_task_names_fields_metrics_and_shots_are_checked_before_a_run(task_dir):
    inc = f"include_path: {task_dir / 'tasks'}, include_defaults: false"
    data = f"dataset_path: json, dataset_kwargs: {{data_files: {{validation: {task_dir / 'nq.jsonl'}}}}}, " \
           "validation_split: validation"
    assert "steps[0].evaluate.tasks[0]: unknown lm-eval task 'local_nqq'" in preflight_error(
        eval_spec(f"{{tasks: [local_nqq], {inc}}}"))
    assert "(did you mean 'local_nq'?)" in preflight_error(eval_spec(f"{{tasks: [local_nqq], {inc}}}"))
    line = preflight_error(eval_spec(f"{{tasks: [local_nq], {inc}, num_fewshot: 100000}}"))
    assert "steps[0].evaluate.num_fewshot: num_fewshot 100,000 is more than 1,024" in line
    line = preflight_error(eval_spec(f"{{tasks: [local_nq], {inc}, num_fewshot: 5}}"))
    assert "num_fewshot 5 is more than the 4 document(s) its few-shot split 'train'" in line
    line = preflight_error(eval_spec(f"{{tasks: [{{task: mc, {data}, output_type: multiple_choice, "
                                     "doc_to_text: '{{question}}', doc_to_target: 0}], include_defaults: false}"))
    assert "steps[0].evaluate.tasks[0]: lm-eval task 'mc': a multiple_choice task needs doc_to_choice" in line
    line = preflight_error(eval_spec(f"{{tasks: [{{task: gen, {data}, doc_to_text: '{{question}}'}}], "
                                     "include_defaults: false}"))
    assert "a generate_until task needs doc_to_target" in line
    line = preflight_error(eval_spec(f"{{tasks: [{{task: g, {data}, doc_to_text: '{{question}}', doc_to_target: "
                                     "'{{answer}}', metric_list: [{metric: acc}]}], include_defaults: false}"))
    assert "metric_list[0]: metric 'acc' scores loglikelihood or multiple_choice tasks" in line
    assert "output_type is generate_until" in line
    line = preflight_error(eval_spec(f"{{tasks: [{{task: o, {data}, output_type: answer, doc_to_text: x, "
                                     "doc_to_target: y}], include_defaults: false}"))
    assert "output_type 'answer' is not one of" in line
    # what runs passes: lm-eval's own task copied with local data, at a few-shot count its data can give
    from headlab.runner import check_steps

    check_steps(headlab.load_spec(eval_spec(f"{{tasks: [local_nq], {inc}, num_fewshot: 4}}")))


def test_an_unknown_lm_eval_task_exits_2_in_validate_and_run_before_the_store(task_dir, tmp_path):
    spec = eval_spec(f"{{tasks: [local_nqq], include_path: {task_dir / 'tasks'}, include_defaults: false}}")
    (tmp_path / "s.yaml").write_text(spec)
    for args in (("validate", "s.yaml"), ("run", "s.yaml", "--out", "runs")):
        line = one_line(cli(*args, cwd=tmp_path))
        assert line.startswith("error: s.yaml:6:") and "unknown lm-eval task 'local_nqq'" in line, line
    assert not (tmp_path / "runs").exists()


@pytest.mark.slow  # an lm-eval run in a process of its own
def test_an_evaluate_step_caches_datasets_under_out_not_home(task_dir, tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    spec = eval_spec(f"{{tasks: [local_nq], include_path: {task_dir / 'tasks'}, include_defaults: false, "
                     "max_gen_toks: 2}")
    (tmp_path / "s.yaml").write_text(spec)
    res = cli("run", "s.yaml", "--out", "runs", cwd=tmp_path, env={"HOME": str(home)},
              drop=("HF_DATASETS_CACHE", "HF_HOME", "XDG_CACHE_HOME"))
    assert res.returncode == 0, res.stderr
    assert [p for p in home.rglob("*")] == []  # nothing under $HOME (it went to ~/.cache/huggingface/datasets)
    cache = tmp_path / "runs" / ".cache" / "datasets"
    assert any(p.suffix == ".arrow" for p in cache.rglob("*"))  # the prepared dataset is under --out
    assert [r.name for r in headlab.list_runs(tmp_path / "runs")] == ["ev"]  # the cache is not listed as a run


# --------------------------------------------------------------------------- empty prompts
def test_an_empty_prompt_is_refused_naming_the_task_and_example(tmp_path):
    rows = [{"q": "Is it?", "choices": ["yes", "no"], "label": 0}, {"q": "  ", "choices": ["yes", "no"], "label": 1}]
    (tmp_path / "e.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    for step in ("score: {}", "generate: {max_new_tokens: 2}"):
        (tmp_path / "s.yaml").write_text(
            "name: t\nmodel: headlab-tiny\ntask: {kind: jsonl, path: e.jsonl, prompt: '{{ q }}', choices: "
            f"'{{{{ choices }}}}', label: label}}\nsteps:\n  - id: st\n    {step}\n")
        line = one_line(cli("run", "s.yaml", "--out", "runs", cwd=tmp_path))
        assert "step 'st' (task 'jsonl'" in line and "task 'jsonl' example 1 (data row 2) has an empty prompt" in line
    # token-id tasks and prompts with text are examples; the same file without the empty row runs
    (tmp_path / "e.jsonl").write_text(json.dumps(rows[0]) + "\n")
    assert cli("run", "s.yaml", "--out", "runs", cwd=tmp_path).returncode == 0


# --------------------------------------------------------------------------- resuming a run whose inputs changed
def _qa(path: Path, n: int) -> None:
    path.write_text("\n".join(json.dumps({"q": f"Q{i}?", "choices": ["yes", "no"], "label": i % 2})
                              for i in range(n)) + "\n")


QA_SPEC = ("name: t\nmodel: headlab-tiny\ntask: {kind: jsonl, path: qa.jsonl, prompt: '{{ q }}', choices: "
           "'{{ choices }}', label: label}\nsteps:\n  - id: sc\n    score: {}\n")


# slow: four runs through the command line; test_input_digests_cover_swept_files_and_name_the_one_that_changed
# checks the same refusal and digests in process in the default set
@pytest.mark.slow
def test_resume_refuses_a_changed_data_file_and_recompute_recomputes(tmp_path):
    _qa(tmp_path / "qa.jsonl", 3)
    (tmp_path / "s.yaml").write_text(QA_SPEC)
    assert cli("run", "s.yaml", "--out", "runs", cwd=tmp_path).returncode == 0
    (run,) = (tmp_path / "runs").iterdir()
    recorded = headlab.open_run(run).attrs["input_digests"]
    assert list(recorded) == ["task.path"] and recorded["task.path"]["path"] == "qa.jsonl"
    assert cli("run", "--resume", str(run), cwd=tmp_path).returncode == 0  # unchanged: resumes
    _qa(tmp_path / "qa.jsonl", 5)
    line = one_line(cli("run", "--resume", str(run), cwd=tmp_path))
    assert f"cannot resume {run}: task.path file 'qa.jsonl' changed since the run started" in line
    assert f"`headlab run --resume {run} --recompute`" in line
    assert headlab.open_run(run).results["sc"].sizes["example"] == 3  # nothing was mixed in
    assert "--recompute recomputes a stored run" in one_line(cli("run", "s.yaml", "--recompute", cwd=tmp_path))
    assert cli("run", "--resume", str(run), "--recompute", cwd=tmp_path).returncode == 0
    assert headlab.open_run(run).results["sc"].sizes["example"] == 5  # every cell from the current file
    assert cli("run", "--resume", str(run), cwd=tmp_path).returncode == 0  # the new digest is recorded
    (tmp_path / "qa.jsonl").unlink()
    assert "task.path file 'qa.jsonl' is gone" in one_line(cli("run", "--resume", str(run), cwd=tmp_path))


def test_resume_refuses_changed_weights_and_a_spec_that_resolves_differently(tmp_path):
    import zarr
    from safetensors.torch import load_file, save_file

    from headlab.inputs import InputChanged

    ckpt = save_checkpoint(tmp_path / "ckpt", "llama", vocab_size=811, **SMALL)
    text = f"name: t\nmodel: {{path: {ckpt}}}\ntask: {TASK}\nsteps:\n{STEPS}"
    run = headlab.run(text, out=tmp_path / "runs")
    weights = load_file(ckpt / "model.safetensors")
    name = next(iter(weights))
    weights[name] = weights[name] + 1
    save_file(weights, ckpt / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(InputChanged, match=r"the weights of model .* changed since the run started"):
        headlab.run(None, resume=run.path)
    assert headlab.run(None, resume=run.path, recompute=True).status == "complete"
    headlab.run(None, resume=run.path)  # the recomputed run's weights are recorded
    # a stored resolved spec that differs from what the spec resolves to now (a default that changed)
    root = zarr.open_group(str(run.path), mode="r+")
    resolved = json.loads(root.attrs["resolved"])
    resolved["steps"][0]["detect"]["error_measure"] = "add"
    root.attrs["resolved"] = json.dumps(resolved)
    with pytest.raises(InputChanged, match=r"resolves differently now .*steps\[0\].detect.error_measure was "
                                           r'"add", is now "mul"'):
        headlab.run(None, resume=run.path)


# --------------------------------------------------------------------------- links inside a store
def test_a_missing_cell_that_is_a_link_is_replaced_never_written_through(tmp_path):
    text = spec_text(STEPS, sweep="  task.n: [2, 3]\n")
    first = headlab.run(text, out=tmp_path / "runs")
    cell = Path(first.path) / "cells" / "c0001"
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("mine")
    import shutil

    shutil.rmtree(cell)
    cell.symlink_to(outside, target_is_directory=True)
    resumed = headlab.run(None, resume=first.path)
    assert not cell.is_symlink() and cell.is_dir()  # the link was replaced by the cell ...
    assert sorted(p.name for p in outside.iterdir()) == ["keep.txt"]  # ... and nothing was written through it
    again = headlab.run(text, out=tmp_path / "again")
    xr.testing.assert_identical(resumed.results["ind"], again.results["ind"])


def test_a_cells_group_that_is_a_link_is_refused_in_one_line(tmp_path):
    (tmp_path / "s.yaml").write_text(spec_text(STEPS))
    assert cli("run", "s.yaml", "--out", "runs", cwd=tmp_path).returncode == 0
    (run,) = (tmp_path / "runs").iterdir()
    (run / "cells").rename(tmp_path / "elsewhere")
    (run / "cells").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    line = one_line(cli("run", "--resume", str(run), cwd=tmp_path))
    assert "cells is a symbolic link" in line and "never writes through a link" in line


def test_input_digests_cover_swept_files_and_name_the_one_that_changed(tmp_path, monkeypatch):
    from headlab.inputs import InputChanged, check_resume, file_digest, input_digests

    monkeypatch.chdir(tmp_path)
    for name, n in (("a.jsonl", 2), ("b.jsonl", 3)):
        _qa(tmp_path / name, n)
    loaded = headlab.load_spec(QA_SPEC.replace("path: qa.jsonl", "path: a.jsonl") +
                               "sweep:\n  task.path: [a.jsonl, b.jsonl, not-a-file.jsonl]\n")
    digests = input_digests(loaded.spec)
    assert digests == {"task.path": {"path": "a.jsonl", "sha256": file_digest(tmp_path / "a.jsonl")},
                       "sweep.task.path[0]": {"path": "a.jsonl", "sha256": file_digest(tmp_path / "a.jsonl")},
                       "sweep.task.path[1]": {"path": "b.jsonl", "sha256": file_digest(tmp_path / "b.jsonl")}}
    attrs = {"resolved": loaded.spec.model_dump_json(by_alias=True), "input_digests": digests}
    check_resume(attrs, loaded.spec, "RUN")  # nothing changed
    _qa(tmp_path / "b.jsonl", 4)
    with pytest.raises(InputChanged, match=r"cannot resume RUN: sweep.task.path\[1\] file 'b.jsonl' changed"):
        check_resume(attrs, loaded.spec, "RUN")
