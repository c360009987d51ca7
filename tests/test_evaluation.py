"""lm-evaluation-harness under headlab (``headlab.lm_eval``, the ``evaluate`` action, ``headlab.logprobs``).

Offline: the tasks are copies of lm-eval's own ``truthfulqa_mc1``, ``truthfulqa_mc2`` and ``nq_open`` YAML
with only the dataset fields changed (:func:`headlab.lm_eval.local_task`), over JSON files written here, on
the embedded model ``headlab-tiny``. Checked: greedy equals lm-eval's ``hf`` model (the same checkpoint,
loaded by lm-eval) request by request; DoLa, DeCoRe and PASTA through lm-eval equal headlab's own
``score`` / ``generate`` steps on the same prompts; a detect -> evaluate spec whose stored per-sample
records reproduce its per-task metrics; the CLI; the error without the extra.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("lm_eval", reason="the eval extra (pip install 'headlab[eval]') is not installed")

import headlab  # noqa: E402
from headlab import lm_eval as harness  # noqa: E402
from headlab.lm_eval import adapter  # noqa: E402
from headlab.plugins.models.embedded import CHECKPOINT  # noqa: E402
from headlab.plugins.tasks import generators as S  # noqa: E402

pytestmark = pytest.mark.skipif(not (CHECKPOINT / "config.json").is_file(), reason="headlab-tiny is not built")

TASKS = ["local_mc1", "local_mc2", "local_nq"]
DECORE = {"kind": "decore", "heads": [[3, 0], [3, 1], [3, 4], [3, 5]], "alpha": 1.0}
DOLA = {"kind": "dola", "layers": [0, 2]}
PASTA = {"kind": "pasta", "heads": [2, 3], "alpha": 0.01}
CAPITALS = [("France", "Paris"), ("Italy", "Rome"), ("Spain", "Madrid"), ("Germany", "Berlin"), ("Japan", "Tokyo"),
            ("Peru", "Lima")]
UNTIL = ["\n", ".", ","]  # nq_open's stop strings
FAKE = ["Montevideo", "Vienna", "Oslo", "Cairo", "Lima", "Quito"]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def mc_rows() -> list[dict]:
    """TruthfulQA MC rows (the hub dataset's fields) about capitals, half with a contradicting context."""
    rows = []
    for i, (country, capital) in enumerate(CAPITALS):
        fake = FAKE[i] if FAKE[i] != capital else FAKE[0]
        if i % 2:
            q, true, false = f"According to the latest news, the capital of {country} is {fake}. What is the capital of " \
                f"{country}?", fake, capital
        else:
            q, true, false = f"What is the capital of {country}?", capital, fake
        other = CAPITALS[(i + 1) % len(CAPITALS)][1]
        rows.append({"question": q, "mc1_targets": {"choices": [true, false, other], "labels": [1, 0, 0]},
                     "mc2_targets": {"choices": [true, f"The capital is {true}", false, other],
                                     "labels": [1, 1, 0, 0]}})
    return rows


def nq_rows() -> list[dict]:
    """NQ-Open rows (``question`` without '?', ``answer`` list) the model can answer from the question."""
    rows = [{"question": f"The capital of {c} is {a}. Question: What is the capital of {c}", "answer": [a]}
            for c, a in CAPITALS]
    rows += [{"question": f"Tom lives in {a}. Question: Where does Tom live", "answer": [a]} for _, a in CAPITALS[:3]]
    return rows


def emphasis_rows() -> tuple[list[dict], list[dict]]:
    """PASTA's setting in both formats: the first statement marked with <em>...</em> in the question."""
    mc, nq = [], []
    for r in S.emphasis(5, seed=3):
        question = r["prompt_marked"].removesuffix(" Answer:")
        mc.append({"question": question, "mc1_targets": {"choices": [r["emphasis_answer"], r["default_answer"]],
                                                          "labels": [1, 0]},
                   "mc2_targets": {"choices": [r["emphasis_answer"], r["default_answer"]], "labels": [1, 0]}})
        nq.append({"question": question.removesuffix("?"), "answer": [r["emphasis_answer"]]})
    return mc, nq


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n", encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def tasks_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("lm_eval_tasks")
    mc, nq = write_jsonl(d / "mc.jsonl", mc_rows()), write_jsonl(d / "nq.jsonl", nq_rows())
    emc, enq = emphasis_rows()
    emc, enq = write_jsonl(d / "emph_mc.jsonl", emc), write_jsonl(d / "emph_nq.jsonl", enq)
    tasks = d / "tasks"
    harness.local_task("truthfulqa_mc1", mc, tasks, name="local_mc1")
    harness.local_task("truthfulqa_mc2", mc, tasks, name="local_mc2")
    harness.local_task("nq_open", nq, tasks, name="local_nq")
    harness.local_task("truthfulqa_mc1", emc, tasks, name="emph_mc1")
    harness.local_task("nq_open", enq, tasks, name="emph_nq")
    return tasks


@pytest.fixture(scope="module")
def manager(tasks_dir):
    return harness.task_manager(tasks_dir, include_defaults=False)


@pytest.fixture(scope="module")
def tiny():
    return headlab.scoring.as_model("headlab-tiny")


def run_lm(lm, tasks, manager, **kw):
    from lm_eval import simple_evaluate

    return simple_evaluate(model=lm, tasks=tasks, task_manager=manager, log_samples=True, bootstrap_iters=0, **kw)


@pytest.fixture(scope="module")
def hf_results(manager):
    from lm_eval.models.huggingface import HFLM

    hf = HFLM(pretrained=str(CHECKPOINT), batch_size=4, device="cpu")
    return run_lm(hf, TASKS, manager)


@pytest.fixture(scope="module")
def greedy_results(manager, tiny):
    # transformers' generate takes the checkpoint's generation_config.max_new_tokens (24) over lm-eval's max_length
    return run_lm(harness.HeadlabLM(tiny, batch_size=3, max_gen_toks=24), TASKS, manager)


def responses(results, task):
    return [s["resps"] for s in results["samples"][task]]


# --------------------------------------------------------------------------- greedy = lm-eval's hf model
def test_greedy_equals_hf_on_multiple_choice(hf_results, greedy_results):
    for task in ("local_mc1", "local_mc2"):
        ours, ref = greedy_results["samples"][task], hf_results["samples"][task]
        assert [s["doc_id"] for s in ours] == [s["doc_id"] for s in ref]
        for a, b in zip(ours, ref, strict=True):
            assert [arg[1] for arg in a["arguments"]] == [arg[1] for arg in b["arguments"]]
            got, want = [r[0] for r in a["resps"]], [r[0] for r in b["resps"]]
            assert np.allclose([g[0] for g in got], [w[0] for w in want], atol=1e-4, rtol=0)
            assert [g[1] for g in got] == [w[1] for w in want]  # is_greedy
            # MC1 (0/1) identical; MC2 (a probability mass) equal up to the float noise of the log-likelihoods
            assert a["acc"] == (b["acc"] if task == "local_mc1" else pytest.approx(b["acc"], abs=1e-5))
        assert greedy_results["results"][task]["acc,none"] == pytest.approx(hf_results["results"][task]["acc,none"],
                                                                              abs=1e-5 if task == "local_mc2" else 0)
    # not vacuous: MC1 is neither 0 nor 1, some continuations are greedy and some are not
    assert 0 < greedy_results["results"]["local_mc1"]["acc,none"] < 1
    flags = [r[0][1] for s in greedy_results["samples"]["local_mc1"] for r in s["resps"]]
    assert any(flags) and not all(flags)


def test_greedy_equals_hf_on_generation(hf_results, greedy_results):
    ours, ref = responses(greedy_results, "local_nq"), responses(hf_results, "local_nq")
    assert ours == ref
    assert [s["exact_match"] for s in greedy_results["samples"]["local_nq"]] == \
        [s["exact_match"] for s in hf_results["samples"]["local_nq"]]
    em = greedy_results["results"]["local_nq"]["exact_match,remove_whitespace"]
    assert em == hf_results["results"]["local_nq"]["exact_match,remove_whitespace"]
    assert 0 < em < 1  # the model answers some questions right and some wrong


def test_rolling_and_empty_context_equal_hf(tiny):
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    hf = HFLM(pretrained=str(CHECKPOINT), batch_size=2, device="cpu", max_length=12)
    ours = harness.HeadlabLM(tiny, batch_size=2, max_length=12)
    texts = ["the capital of France is Paris . Tom lives in Rome . Question : Where does Tom live ? Answer : Rome . ok",
             "Tom lives in Oslo ."]
    rolling = [Instance("loglikelihood_rolling", {}, (t,), 0) for t in texts]
    a, b = ours.loglikelihood_rolling(rolling), hf.loglikelihood_rolling(rolling)
    assert np.allclose(a, b, atol=1e-4, rtol=0) and len(tiny.tokenizer(texts[0])["input_ids"]) > 2 * 12  # 3 windows
    pairs = [Instance("loglikelihood", {}, ("", " Paris is big"), 0), Instance("loglikelihood", {}, ("A:  ", "Rome"), 0)]
    got, want = ours.loglikelihood(pairs), hf.loglikelihood(pairs)
    assert np.allclose([g[0] for g in got], [w[0] for w in want], atol=1e-4, rtol=0)
    assert [g[1] for g in got] == [w[1] for w in want]


# --------------------------------------------------------------------------- strategies = headlab's own steps
def step_spec(tmp_path: Path, mc_samples: list[dict], nq_samples: list[dict], cfg: dict) -> str:
    """A spec scoring and generating lm-eval's logged prompts (markers kept: the jsonl task strips them into
    ``emphasis`` spans) with headlab's own ``score`` and ``generate`` steps under ``cfg``."""
    mc = write_jsonl(tmp_path / "mc_prompts.jsonl", [
        {"prompt": s["arguments"][0][0], "choices": [a[1].removeprefix(" ") for a in s["arguments"]], "label": 0}
        for s in mc_samples])
    nq = write_jsonl(tmp_path / "nq_prompts.jsonl", [{"prompt": s["arguments"][0][0]} for s in nq_samples])
    decode = json.dumps(cfg.get("decode", {"kind": "greedy"}))
    steer = json.dumps(cfg.get("steer", []))
    task = '{kind: jsonl, path: %s, prompt: "{{ prompt }}", span_tags: {emphasis: em}%s}'
    return (f"name: same-prompts\nmodel: headlab-tiny\n"
            f"task: {task % (mc, ', choices: choices, label: label')}\n"
            f"steps:\n"
            f"  - id: mc\n    score: {{decode: {decode}, steer: {steer}, batch_size: 8, metrics: [accuracy]}}\n"
            f"  - id: gen\n    task: {task % (nq, '')}\n"
            f"    generate: {{decode: {decode}, steer: {steer}, max_new_tokens: 12, stop: {json.dumps(UNTIL)}}}\n")


def lm_eval_logprobs(results, task) -> list[list[float]]:
    return [[r[0][0] for r in s["resps"]] for s in results["samples"][task]]


@pytest.mark.parametrize("name", ["dola", "decore", "pasta"])
def test_strategies_through_lm_eval_equal_headlab_steps(name, tiny, manager, tmp_path):
    mc_task, nq_task = ("emph_mc1", "emph_nq") if name == "pasta" else ("local_mc1", "local_nq")
    cfg = {"dola": {"decode": DOLA}, "decore": {"decode": DECORE}, "pasta": {"steer": [PASTA]}}[name]
    lm = harness.HeadlabLM(tiny, batch_size=4, max_gen_toks=12, **cfg)
    res = run_lm(lm, [mc_task, nq_task], manager)
    base = run_lm(harness.HeadlabLM(tiny, batch_size=4, max_gen_toks=12), [mc_task, nq_task], manager)
    run = headlab.run(step_spec(tmp_path, res["samples"][mc_task], res["samples"][nq_task], cfg), out=tmp_path / "r")
    stored = run.results["mc"]["logprob"].values
    ours = lm_eval_logprobs(res, mc_task)
    for i, row in enumerate(ours):
        assert np.allclose(row, stored[i, : len(row)], atol=1e-5, rtol=0), (name, i)
    assert [s["resps"][0][0] for s in res["samples"][nq_task]] == list(run.results["gen"]["output"].values)
    # the strategy changes the scores (not a vacuous comparison)
    plain = lm_eval_logprobs(base, mc_task)
    assert max(abs(a - b) for r, p in zip(ours, plain, strict=True) for a, b in zip(r, p, strict=True)) > 1e-2


def test_iti_through_lm_eval_equals_headlab_logprobs_and_generate(tiny, manager):
    """ITI (from a probe dataset given as ``results``, ``positions: answer``) in lm-eval's loglikelihood requests
    and generations equals headlab's own ``logprobs`` / ``generate`` on the logged requests."""
    import xarray as xr

    geo, rng = tiny.geometry, np.random.default_rng(0)
    unit = rng.standard_normal((geo.n_layers, geo.n_heads, geo.head_dim))
    unit /= np.linalg.norm(unit, axis=-1, keepdims=True)
    probe = {"pr": xr.Dataset({"score": (("layer", "head"), rng.uniform(size=unit.shape[:2])),
                               "direction": (("layer", "head", "head_dim"), unit),
                               "sigma": (("layer", "head"), np.full(unit.shape[:2], 2.0))})}
    iti = {"kind": "iti", "probe": "pr", "heads": {"from": "pr", "top": 6}, "alpha": 4.0, "positions": "answer"}
    res = run_lm(harness.HeadlabLM(tiny, batch_size=4, max_gen_toks=12, steer=[iti], results=probe),
                 ["local_mc2", "local_nq"], manager)  # mc2 has choices of several tokens
    args = [a for s in res["samples"]["local_mc2"] for a in s["arguments"]]
    got = [r[0][0] for s in res["samples"]["local_mc2"] for r in s["resps"]]
    ours = headlab.logprobs(tiny, [a[0] for a in args], [a[1] for a in args], steer=[iti], results=probe)
    assert np.allclose(got, ours.logprobs, atol=1e-5, rtol=0)
    plain = headlab.logprobs(tiny, [a[0] for a in args], [a[1] for a in args]).logprobs
    assert max(abs(a - b) for a, b in zip(got, plain, strict=True)) > 1e-2
    prompts = [s["arguments"][0][0] for s in res["samples"]["local_nq"]]
    texts = [s["resps"][0][0] for s in res["samples"]["local_nq"]]
    assert texts == headlab.generate(tiny, prompts, steer=[iti], results=probe, max_new_tokens=12, stop=UNTIL).texts
    assert texts != headlab.generate(tiny, prompts, max_new_tokens=12, stop=UNTIL).texts


def test_pasta_missing_span_follows_its_config(tiny, manager):
    """A task with no <em> markers: PASTA's ``missing: error`` is an error, ``missing: skip`` leaves it unsteered."""
    with pytest.raises(ValueError, match="no 'emphasis' span"):
        run_lm(harness.HeadlabLM(tiny, steer=[PASTA]), ["local_mc1"], manager, limit=2)
    skipped = run_lm(harness.HeadlabLM(tiny, steer=[{**PASTA, "missing": "skip"}]), ["local_mc1"], manager, limit=2)
    plain = run_lm(harness.HeadlabLM(tiny), ["local_mc1"], manager, limit=2)
    assert lm_eval_logprobs(skipped, "local_mc1") == lm_eval_logprobs(plain, "local_mc1")


def test_logprobs_api(tiny):
    prompt = "According to the latest news, the capital of France is Vienna. Question: What is the capital of France? Answer:"
    s = headlab.logprobs(tiny, [prompt, prompt], [" Vienna", " Paris"])
    assert s.logprobs[0] > s.logprobs[1] and s.greedy == [True, False] and len(s.tokens[0]) == 1
    ids = tiny.tokenizer(prompt)["input_ids"]
    by_ids = headlab.logprobs(tiny, [ids], [tiny.tokenizer(" Vienna", add_special_tokens=False)["input_ids"]])
    assert by_ids.logprobs[0] == pytest.approx(s.logprobs[0], abs=1e-5)
    with torch.no_grad():
        logits = tiny.model(input_ids=torch.tensor([ids])).logits[0, -1].log_softmax(-1)
    assert s.logprobs[0] == pytest.approx(float(logits[tiny.tokenizer(" Vienna", add_special_tokens=False)["input_ids"][0]]),
                                          abs=1e-4)
    whole = headlab.logprobs(tiny, ["Tom lives in Oslo ."])
    assert len(whole.tokens[0]) == len(tiny.tokenizer("Tom lives in Oslo .")["input_ids"]) - 1
    d = headlab.logprobs(tiny, [prompt], [" Vienna"], decode=DECORE)
    assert d.logprobs[0] != pytest.approx(s.logprobs[0], abs=1e-3)
    out = headlab.generate(tiny, [prompt], max_new_tokens=4, stop=["."])
    assert out.texts == ["Vienna"]
    with pytest.raises(ValueError, match="unknown decoder kind 'dolla'"):
        headlab.logprobs(tiny, [prompt], [" Vienna"], decode="dolla")


# --------------------------------------------------------------------------- a spec: detect -> evaluate
SPEC = """name: detect-evaluate
model: headlab-tiny
task: {{kind: niah, context_lengths: [128], depths: 2, needles: 2}}
steps:
  - id: retrieval
    detect: {{kind: retrieval}}
  - id: eval
    evaluate:
      tasks: [local_mc1, local_mc2, local_nq]
      include_path: {tasks}
      include_defaults: false
      decode: {{kind: decore, heads: {{from: retrieval, top: 4}}, alpha: 1.0}}
      max_gen_toks: 12
"""


@pytest.fixture(scope="module")
def spec_run(tasks_dir, tmp_path_factory):
    return headlab.run(SPEC.format(tasks=tasks_dir), out=tmp_path_factory.mktemp("runs"))


def test_spec_detect_then_evaluate_stores_records_that_reproduce_the_metrics(spec_run, tiny):
    ds = spec_run.results["eval"]
    assert list(ds["task"].values) == TASKS and set(ds.attrs["metrics"]) == {"acc", "exact_match"}
    assert set(ds["acc"].dims) == {"task"} and ds.attrs["example_source"] == "lm-eval"
    assert set(ds.dims) <= set(headlab.DIMENSIONS)
    tasks = ds["sample_task"].values
    for metric in ds.attrs["metrics"]:
        for t in ds["task"].values:
            value = float(ds[metric].sel(task=t))
            if math.isnan(value):
                continue
            assert np.mean(ds[f"sample_{metric}"].values[tasks == t]) == pytest.approx(value, abs=1e-9)
    lp = ds["logprob"].values
    mc1 = tasks == "local_mc1"
    assert ((np.nanargmax(lp[mc1], axis=1) == 0).astype(float) == ds["sample_acc"].values[mc1]).all()
    labels = np.array([[1, 1, 0, 0]])
    mc2 = tasks == "local_mc2"
    p = np.exp(lp[mc2])
    np.testing.assert_allclose((p * labels).sum(1) / p.sum(1), ds["sample_acc"].values[mc2], atol=1e-9)
    nq = tasks == "local_nq"
    answers = [json.loads(t)[0] for t in ds["target"].values[nq]]
    assert list(ds["sample_exact_match"].values[nq]) == [float(o.strip() == a) for o, a in
                                                          zip(ds["output"].values[nq], answers, strict=True)]
    # the heads came from the detect step: the same scores directly, with heads from its stored results
    heads = {"from": "retrieval", "top": 4}
    first = [i for i in np.flatnonzero(mc1)][:2]
    prompts = [str(ds["prompt"].values[i]) for i in first for _ in range(3)]
    conts = [str(ds["choice_text"].values[i, j]) for i in first for j in range(3)]
    direct = headlab.logprobs(tiny, prompts, conts, decode={**DECORE, "heads": heads}, results=spec_run.results)
    np.testing.assert_allclose(direct.logprobs, lp[first, :3].ravel(), atol=1e-4)  # other batches: float noise
    fixed = headlab.logprobs(tiny, prompts, conts, decode={**DECORE, "heads": [[3, 4]]})
    assert not np.allclose(fixed.logprobs, direct.logprobs, atol=1e-3)


def test_show_and_report_display_the_tasks(spec_run, tmp_path):
    from typer.testing import CliRunner

    from headlab.cli import app

    out = CliRunner().invoke(app, ["show", str(spec_run.path), "--steps"], env={"COLUMNS": "200"})
    assert out.exit_code == 0, out.output
    assert "\neval: evaluate" in out.output and "per task" in out.output and "local_nq" in out.output
    acc = float(spec_run.results["eval"]["acc"].sel(task="local_mc2"))
    assert f"{acc:.4f}" in out.output
    summary = spec_run.summary()["eval"]
    assert summary["kind"] == "evaluate" and [r["task"] for r in summary["tasks"]] == TASKS
    from headlab.report import render_report

    html = render_report(spec_run)
    assert "metrics per task" in html and "local_mc2" in html and "samples (first" in html


@pytest.mark.slow  # lm-eval's own CLI in a process of its own; the same evaluation runs in process above
def test_cli_runs_lm_eval_with_a_headlab_spec(tasks_dir, tmp_path, capsys):
    """``headlab eval`` is lm-eval's command line with ``--model headlab``; ``spec=`` runs the spec's steps
    before its evaluate step (the detector), so ``heads: {from: retrieval}`` resolves."""
    spec = tmp_path / "steer.yaml"
    spec.write_text(SPEC.format(tasks=tasks_dir), encoding="utf-8")
    harness.main(["--tasks", "local_mc1", "--include_path", str(tasks_dir), "--model_args",
                  json.dumps({"spec": str(spec)}), "--batch_size", "4", "--limit", "3"])
    printed = capsys.readouterr().out
    assert "headlab" in printed and "local_mc1" in printed
    lm = harness.HeadlabLM(spec=str(spec))
    assert lm.decode.kind == "decore" and lm.decode.heads.from_ == "retrieval" and "score" in lm.results["retrieval"]


def test_registered_in_lm_eval(manager, tiny):
    from lm_eval import simple_evaluate
    from lm_eval.api.registry import get_model

    assert get_model("headlab") is harness.HeadlabLM and get_model("hf").__name__ == "HFLM"
    res = simple_evaluate(model="headlab", model_args="decode=dola,batch_size=2", tasks=["local_mc1"],
                          task_manager=manager, limit=2, bootstrap_iters=0)
    assert res["config"]["model_name"] == "headlab-tiny" and res["config"]["decode"]["kind"] == "dola"


def test_headlab_harness_is_an_alias_of_headlab_lm_eval():
    import headlab.harness as alias

    assert alias.__all__ == harness.__all__
    assert all(getattr(alias, name) is getattr(harness, name) for name in harness.__all__)


# --------------------------------------------------------------------------- without the extra
def test_without_lm_eval_the_error_names_the_extra(monkeypatch, tmp_path):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "lm_eval" else real(name, *a))
    with pytest.raises(headlab.SpecError, match=r"steps\[1\]\.evaluate.*pip install 'headlab\[eval\]'") as e:
        headlab.load_spec(SPEC.format(tasks=tmp_path))
    assert "\n" not in str(e.value)
    monkeypatch.setattr(adapter, "HAVE_LM_EVAL", False)
    with pytest.raises(ImportError, match=r"pip install 'headlab\[eval\]'"):
        harness.evaluate("headlab-tiny", ["local_mc1"])
    import subprocess
    import sys

    code = ("import sys, headlab.lm_eval.adapter as h; h.HAVE_LM_EVAL = False; sys.argv = ['headlab', 'eval', '--tasks', 'x']; "
            "from headlab.cli import main; main()")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0
    assert "pip install 'headlab[eval]'" in proc.stderr
