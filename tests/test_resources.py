"""The resource guard (issue 15): huge ``n``, ``length``, ``max_new_tokens``, context lengths or models are
refused in seconds, before anything is allocated or any store is created, with the estimate and the budget
in one line; the budget comes from ``--memory-limit``, ``HEADLAB_MEMORY_LIMIT``, the spec's ``limits`` or
the machine."""

from __future__ import annotations

import json
import time

import pytest

import headlab
from headlab import resources
from headlab.cli import main
from headlab.resources import ENV, ResourceLimitError

from fixtures.specs import TINY_LLAMA, spec_text
from fixtures.timing import within

STEPS = "  - id: ind\n    detect: {kind: induction}\n"
GEN = "  - id: g\n    generate: {max_new_tokens: %d}\n"


@pytest.fixture(autouse=True)
def no_env_budget(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)


def refused(text: str, tmp_path, seconds: float = 30) -> str:
    out = tmp_path / "runs"
    with within(seconds), pytest.raises(ResourceLimitError) as info:
        headlab.run(text, out=out)
    assert not out.exists() or not list(out.iterdir()), "a store was created for a refused run"
    message = str(info.value)
    assert "\n" not in message and "would take an estimated" in message and "over the budget of" in message
    return message


@pytest.mark.parametrize("text, what", [
    (spec_text(STEPS, task="{kind: repeated_tokens, n: 1000000000, length: 8}"),
     "examples of task 'repeated_tokens' would take an estimated 1.9 TiB (1,000,000,000 examples"),
    (spec_text(STEPS, task="{kind: repeated_tokens, n: 4, length: 100000000}"), "hidden states of a batch's forward"),
    (spec_text(GEN % 1_000_000_000), "KV cache would take an estimated 1.9 TiB (2 layers x 2 x 2 kv heads x 16 dims "
                                     "x 1,000,000,017 tokens x 4 rows x 4 bytes)"),
    (spec_text("  - id: r\n    detect: {kind: retrieval}\n", task="{kind: niah, context_lengths: [1000000000]}"),
     "KV cache"),
    (spec_text(STEPS, task="{kind: niah, context_lengths: {lo: 8, hi: 64, n: 2000000000}, depths: 1000000}"),
     "examples of task 'niah'"),
    (spec_text(GEN % 4, task="{kind: counterfact, filler_sentences: [0, 1000000000]}"), "KV cache"),
    (spec_text(GEN % 4, task="{kind: emphasis, n: 2000000000}"), "examples of task 'emphasis'"),
    (spec_text("  - id: l\n    detect: {kind: lookback, max_new_tokens: 2000000000}\n"), "KV cache"),
])
def test_huge_sizes_are_refused_before_allocating(tmp_path, text, what):
    assert what in refused(text, tmp_path)


def test_a_data_file_task_still_bounds_the_steps(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text('{"q": "a"}\n')
    text = spec_text(GEN % 2_000_000_000, task=json.dumps({"kind": "jsonl", "path": str(data), "prompt": "{{ q }}"}))
    assert "KV cache would take an estimated" in refused(text, tmp_path / "r")


def test_a_huge_model_config_is_refused_before_it_is_built(tmp_path):
    big = {**TINY_LLAMA, "hidden_size": 65536, "intermediate_size": 262144, "num_hidden_layers": 64}
    message = refused(spec_text(STEPS, model=big), tmp_path, seconds=20)
    assert message.startswith("model: parameters of model.config would take an estimated 15.0 TiB")


def test_one_huge_cell_of_a_sweep_is_refused_before_any_cell_runs(tmp_path):
    text = spec_text(STEPS, sweep="  task.length: [4, 5, 100000000]\n")
    assert refused(text, tmp_path).startswith("cell c0002 (task.length=100000000), step 'ind': hidden states of a batch's forward")


def test_the_budget_comes_from_the_command_line_the_environment_or_the_spec(tmp_path, monkeypatch, capfd):
    text = spec_text(GEN % 1000)  # a 2.0 MiB KV cache; the model's parameters take 338 KiB
    small = text + "limits: {memory: 1MiB}\n"
    assert "step 'g': KV cache would take an estimated 2.0 MiB" in refused(small, tmp_path / "a")
    assert "over the budget of 1.0 MiB (the spec's limits.memory)" in refused(small, tmp_path / "a")
    headlab.run(text.replace("1000", "8") + "limits: {memory: 1MiB, guard: false}\n", out=tmp_path / "b")
    monkeypatch.setenv(ENV, "none")
    headlab.run(small.replace("1000", "8"), out=tmp_path / "c")  # the environment overrides the spec
    monkeypatch.setenv(ENV, "1.5MiB")
    assert f"over the budget of 1.5 MiB ({ENV} (or --memory-limit))" in refused(text, tmp_path / "d")
    monkeypatch.delenv(ENV)
    spec = tmp_path / "s.yaml"
    spec.write_text(text)
    capfd.readouterr()
    with pytest.raises(SystemExit) as info:
        main(["run", str(spec), "--out", str(tmp_path / "e"), "--memory-limit", "1MiB"])
    err = capfd.readouterr().err
    assert info.value.code == 2 and "Traceback" not in err
    (line,) = [x for x in err.splitlines() if x.startswith("error:")]
    assert "step 'g': KV cache would take an estimated 2.0 MiB" in line and "over the budget of 1.0 MiB" in line
    assert ENV not in __import__("os").environ  # the option holds for that command only
    with pytest.raises(SystemExit) as info:
        main(["run", str(spec), "--memory-limit", "lots"])
    assert info.value.code == 2 and "--memory-limit: 'lots' is not a size" in capfd.readouterr().err


def test_the_default_budget_is_most_of_the_machine(monkeypatch):
    monkeypatch.setattr(resources, "machine_memory", lambda: 10 * 2**30)
    budget = resources.budget(None, "cpu")
    assert budget.host == budget.device == 8 * 2**30 and "80% of this machine's memory" in budget.source


def test_estimates_follow_the_formulas(tmp_path):
    from headlab.model import load_model
    from headlab.resources import estimates

    loaded = headlab.load_spec(spec_text(STEPS + "  - id: g\n    generate: {max_new_tokens: 10, batch_size: 3}\n",
                                         task="{kind: repeated_tokens, n: 5, length: 20}"))
    lm = load_model(loaded.spec.model)
    found = {(step, e.what): e for step, e in estimates(loaded.spec, lm)}
    tokens = 1 + 2 * 20
    assert found[("g", "KV cache")].bytes == 2 * 2 * 2 * 16 * (tokens + 10) * 3 * 4
    # pair probes: memory linear in length (one forward's hidden states), the full pattern only when asked
    assert found[("ind", "hidden states of a batch's forward")].bytes == 5 * tokens * 64 * 4
    patterns = headlab.load_spec(spec_text("  - id: ind\n    detect: {kind: induction, probe: pattern}\n",
                                           task="{kind: repeated_tokens, n: 5, length: 20}"))
    full = {(step, e.what): e for step, e in estimates(patterns.spec, lm)}
    assert full[("ind", "full attention patterns")].bytes == 5 * 2 * 4 * tokens * tokens * 4
    assert found[("ind", "examples of task 'repeated_tokens'")].bytes == 5 * (1024 + 64 * tokens)


def test_a_normal_run_is_fast_to_check(tmp_path):
    text = spec_text(STEPS, sweep="  task.length: [" + ", ".join(str(i) for i in range(4, 68)) + "]\n")
    loaded = headlab.load_spec(text)
    from headlab.model import load_model
    from headlab.runner import preflight

    lm = load_model(loaded.spec.model)
    started = time.time()
    for cell in loaded.cells:
        preflight(loaded, loaded.for_cell(cell), lm, cell)
    assert time.time() - started < 10
    assert json.loads(json.dumps(resources.format_bytes(3 * 2**30))) == "3.0 GiB"
