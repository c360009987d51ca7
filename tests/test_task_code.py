"""The trust boundary for lm-eval task definitions from a spec (``headlab.task_code``).

Each route by which a spec could make lm-eval run code gets a planted payload that would leave a marker
file; the payload must be refused (at validation, with one located line and exit 2) or neutralised (the
template rendered in headlab's sandbox), and the marker must not appear. ``trust_task_code: true`` lets the
same definitions through. lm-eval's own task code (copies made by ``harness.local_task``) stays allowed.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("lm_eval", reason="the eval extra (pip install 'headlab[eval]') is not installed")

from jinja2.exceptions import SecurityError  # noqa: E402

import headlab  # noqa: E402
from headlab import lm_eval as harness  # noqa: E402
from headlab.task_code import TaskCodeError, check_tasks, sandboxed_templates  # noqa: E402

from fixtures.cli import run as in_process  # noqa: E402

ROOT = Path(__file__).parent.parent


def validate(path: Path) -> subprocess.CompletedProcess:
    """``headlab validate PATH`` in this process (validation renders no task: nothing of lm-eval's runs or logs)."""
    return in_process("validate", str(path), cwd=path.parent)


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """``headlab ARGS`` as typed in ``cwd``, in a process of its own: a payload that escaped would run there, and
    lm-eval's loggers keep no stream of an earlier case."""
    return subprocess.run([sys.executable, "-m", "headlab.cli", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=300)


def qa_data(tmp_path: Path) -> Path:
    path = tmp_path / "qa.jsonl"
    rows = [{"question": "The capital of France is Paris. What is the capital of France", "answer": "Paris"},
            {"question": "Tom lives in Rome. Where does Tom live", "answer": "Rome"}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n", encoding="utf-8")
    return path


def inline_task(data: Path, doc_to_text: str, **extra) -> dict:
    return {"task": "inline_qa", "dataset_path": "json", "dataset_kwargs": {"data_files": {"validation": str(data)}},
            "validation_split": "validation", "output_type": "generate_until", "doc_to_text": doc_to_text,
            "doc_to_target": "{{ answer }}", "metric_list": [{"metric": "exact_match"}],
            "generation_kwargs": {"until": ["\n", "."], "max_gen_toks": 4}, **extra}


def spec(tasks: list, include_path: Path | None = None, trust: bool = False) -> str:
    step = {"id": "eval", "evaluate": {"tasks": tasks, "limit": 2, "include_defaults": False,
                                       "bootstrap_iters": 0}}
    if include_path is not None:
        step["evaluate"]["include_path"] = str(include_path)
    if trust:
        step["evaluate"]["trust_task_code"] = True
    return json.dumps({"name": "task-code", "model": "headlab-tiny", "task": {"kind": "repeated_tokens", "n": 1,
                                                                             "length": 4}, "steps": [step]})


def one_line_exit_2(res: subprocess.CompletedProcess) -> str:
    assert res.returncode == 2, res.stdout + res.stderr
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in res.stderr, res.stderr
    return lines[0]


# --------------------------------------------------------------------------- route 1: inline templates
def test_lm_eval_renders_a_template_payload_unless_sandboxed(tmp_path):
    """The hole: lm-eval's own Jinja2 environment runs Python reached through a template; under
    ``sandboxed_templates`` the same template is refused."""
    from lm_eval import utils

    payload = "{% set n = '_' ~ '_init__' %}{{ (cycler[n]|attr('__glob' ~ 'als__')).os.getcwd() }}"
    assert utils.apply_template(payload, {}) == str(Path.cwd())  # lm-eval as it ships: code runs
    with sandboxed_templates():
        with pytest.raises(SecurityError):
            utils.apply_template(payload, {})
        assert utils.apply_template("Q: {{ q | regex_replace('a+', 'b') }}", {"q": "caat"}) == "Q: cbt"
    assert utils.apply_template(payload, {}) == str(Path.cwd())  # restored afterwards


def test_validate_refuses_a_template_that_reaches_python(tmp_path):
    marker = tmp_path / "PWNED"
    payload = "{{ cycler.__init__.__globals__.os.system('touch " + str(marker) + "') }}"
    path = tmp_path / "spec.yaml"
    path.write_text(spec([inline_task(qa_data(tmp_path), payload)]))
    line = one_line_exit_2(validate(path))
    assert "steps[0].evaluate" in line and "'__init__'" in line and "not allowed" in line
    one_line_exit_2(cli("run", str(path), "--out", str(tmp_path / "runs"), cwd=tmp_path))
    assert not marker.exists() and not (tmp_path / "runs").exists()


def test_a_payload_hidden_from_validation_does_not_run(tmp_path):
    """Built at render time, the payload passes the static check; the sandbox refuses it when lm-eval renders
    the task, the run fails with a one-line error and the marker is never written."""
    marker = tmp_path / "PWNED"
    payload = ("{% set n = '_' ~ '_init__' %}{{ (cycler[n]|attr('__glob' ~ 'als__')).os.system('touch "
               + str(marker) + "') }}{{ question }}")
    path = tmp_path / "spec.yaml"
    path.write_text(spec([inline_task(qa_data(tmp_path), payload)]))
    assert validate(path).returncode == 0
    res = cli("run", str(path), "--out", str(tmp_path / "runs"), cwd=tmp_path)
    assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr
    assert "unsafe" in res.stderr and "eval" in res.stderr
    assert not marker.exists()


def test_an_honest_inline_task_runs_in_the_sandbox(tmp_path):
    path = tmp_path / "spec.yaml"
    path.write_text(spec([inline_task(qa_data(tmp_path), "{{ question | regex_replace('  +', ' ') }}?\nA:")]))
    run = headlab.run(path, out=tmp_path / "runs")
    ds = run.results["eval"]
    assert ds.attrs["task_code"] == "sandboxed" and list(ds["task"].values) == ["inline_qa"]
    assert ds["prompt"].values[0].startswith("The capital of France is Paris. What is the capital of France?\nA:")


# --------------------------------------------------------------------------- route 2: !function in task files
def plant_function(directory: Path, marker: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "evil.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n\ndef text(doc):\n"
                                       "    return doc['question']\n")
    task = directory / "evil_task.yaml"
    task.write_text("task: evil_task\ndataset_path: json\noutput_type: generate_until\n"
                    "doc_to_text: !function evil.text\ndoc_to_target: answer\n")
    return task


def test_function_tag_under_include_path_is_refused(tmp_path):
    marker = tmp_path / "PWNED"
    task = plant_function(tmp_path / "tasks", marker)
    path = tmp_path / "spec.yaml"
    path.write_text(spec(["evil_task"], include_path=tmp_path / "tasks"))
    line = one_line_exit_2(validate(path))
    assert f"{task}: doc_to_text: !function evil.text names Python code" in line and "trust_task_code" in line
    with pytest.raises(TaskCodeError, match="evil.text"):
        harness.evaluate("headlab-tiny", ["evil_task"], include_path=tmp_path / "tasks", include_defaults=False)
    assert not marker.exists()
    # trusted, the same definition is lm-eval's to run (here its loader imports the module)
    assert check_tasks(["evil_task"], tmp_path / "tasks", trust=True).files == [str(task.resolve())]
    path.write_text(spec(["evil_task"], include_path=tmp_path / "tasks", trust=True))
    assert validate(path).returncode == 0
    from lm_eval.tasks._yaml_loader import load_yaml

    assert load_yaml(task, resolve_func=True)["doc_to_text"]({"question": "q"}) == "q"  # lm-eval imports it
    assert marker.read_text() == "ran"


def test_function_tag_reached_by_include_or_by_path(tmp_path):
    marker = tmp_path / "PWNED"
    plant_function(tmp_path / "lib", marker)
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "wrapper.yaml").write_text("include: ../lib/evil_task.yaml\ntask: wrapper\n")
    with pytest.raises(TaskCodeError, match=r"lib/evil_task.yaml: doc_to_text: !function evil.text"):
        check_tasks(["wrapper"], tmp_path / "tasks")
    with pytest.raises(TaskCodeError, match="!function evil.text"):
        check_tasks([str(tmp_path / "lib" / "evil_task.yaml")], None)
    with pytest.raises(TaskCodeError, match=r"lib/evil_task.yaml: doc_to_text: !function evil.text"):
        check_tasks([{"task": "x", "include": str(tmp_path / "lib" / "evil_task.yaml")}], None)
    assert not marker.exists()


def test_other_tags_are_refused_with_the_line(tmp_path):
    (tmp_path / "t.yaml").write_text("task: t\ndoc_to_text: !!python/object/apply:os.system ['touch x']\n")
    with pytest.raises(TaskCodeError, match=r"t.yaml:2: .*no YAML tags"):
        check_tasks([], tmp_path)


def test_lm_eval_s_own_helpers_stay_allowed(tmp_path):
    data = tmp_path / "mc.jsonl"
    data.write_text(json.dumps({"question": "Q?", "mc1_targets": {"choices": ["a", "b"], "labels": [1, 0]},
                                "mc2_targets": {"choices": ["a", "b"], "labels": [1, 0]}}) + "\n")
    task = harness.local_task("truthfulqa_mc2", data, tmp_path / "tasks", name="local_mc2")
    assert "!function utils." in task.read_text()
    assert check_tasks(["local_mc2"], tmp_path / "tasks").files  # the helper is a byte copy of lm-eval's
    (tmp_path / "tasks" / "utils.py").write_text((tmp_path / "tasks" / "utils.py").read_text() + "\nimport os\n")
    with pytest.raises(TaskCodeError, match="!function utils.process_results_mc2"):
        check_tasks(["local_mc2"], tmp_path / "tasks")


# --------------------------------------------------------------------------- route 3: metrics, datasets
def test_metrics_outside_lm_eval_s_registry_are_refused(tmp_path):
    script = tmp_path / "evil_metric.py"
    script.write_text("open('PWNED', 'w')\n")
    data = qa_data(tmp_path)
    for metric, message in [({"metric": str(script)}, "not in lm-eval's metric registry"),
                            ({"metric": "exact_match", "hf_evaluate": True}, "hf_evaluate")]:
        with pytest.raises(TaskCodeError, match=message):
            check_tasks([inline_task(data, "{{ question }}", metric_list=[metric])], None)
    with pytest.raises(TaskCodeError, match="trust_remote_code"):
        check_tasks([inline_task(data, "{{ question }}", dataset_kwargs={"trust_remote_code": True})], None)
    assert check_tasks([inline_task(data, "{{ question }}")], None).inline == 1


def test_alias_bombs_and_missing_directories(tmp_path):
    lines = ["a: &a [x, x, x, x, x, x, x, x, x, x]"]
    for i in range(1, 9):
        lines.append(f"{chr(97 + i)}: &{chr(97 + i)} [" + ", ".join(f"*{chr(96 + i)}" for _ in range(10)) + "]")
    (tmp_path / "bomb.yaml").write_text("\n".join(lines) + "\ntask: bomb\n")
    with pytest.raises(TaskCodeError, match="expands to more than"):
        check_tasks([], tmp_path)
    with pytest.raises(TaskCodeError, match="is not a directory"):
        check_tasks([], tmp_path / "nope")


def test_jsonl_templates_refuse_underscore_names_when_validated():
    from headlab.sandbox import lint_template

    for source in ["{{ q.__class__ }}", "{{ q['__class__'] }}", "{{ q|attr('__class__') }}"]:
        with pytest.raises(ValueError, match="names starting with '_' are not allowed"):
            lint_template(source, "prompt")
    assert lint_template("{{ q.strip() }} {{ q['a_b'] }}", "prompt")
