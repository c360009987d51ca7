"""The ``score`` action: per-strategy continuation scores against reference computations written here
(one eager forward per row, the reference codes' ``lm_score`` formulas), TruthfulQA's MC1/MC2/MC3
against their published definition (``MC_calcs``), and a run with a TruthfulQA file end to end."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import headlab
from headlab.context import Example
from headlab.generation import ScoreRequest, continuation_batch
from headlab.plugin_manager import get_manager
from headlab.plugins.decoding.contrastive import CAD, Contrastive, amateur_model, without_context
from headlab.plugins.decoding.decore import DeCoRe
from headlab.plugins.decoding.dola import DoLa
from headlab.plugins.decoding.greedy import Greedy, Sample
from headlab.plugins.metrics.multiple_choice import mc_metrics

from fixtures.decoding import (
    AMATEUR,
    eager_twin,
    masked_queries,
    model_config,
    one_thread,  # noqa: F401  (autouse)
    word_model,
    word_tokenizer,
)

EXAMPLES = [
    Example(prompt="the capital of france is rome . question : what is the capital of france ? answer :",
            spans={"context": [(0, 30)]}, choices=[" rome", " paris", " the capital is rome ."], label=0),
    Example(prompt="a b c . question : what is c ? answer :", spans={"context": [(0, 7)]},
            choices=[" c", " d e f g", " a"], label=2),
]


@pytest.fixture(scope="module")
def setup():
    lm = word_model(6, False, seed=9)
    pairs = [(ex, c) for ex in EXAMPLES for c in ex.choices]
    batch, n = continuation_batch(lm, pairs)
    req = ScoreRequest(lm, batch, n, [p[0] for p in pairs], [p[1] for p in pairs])
    return lm, eager_twin(lm), pairs, req


def scorer(kind: str):
    """The registered scorer of a decoder kind (the ``score`` action's route to it)."""
    return get_manager().get("decoders", kind).score


def split_ids(lm, prompt: str, cont: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference codes' split: full text ids, continuation = ids after len(tokenize(prompt))."""
    full = torch.tensor([lm.tokenizer(prompt + cont)["input_ids"]])
    prefix = len(lm.tokenizer(prompt)["input_ids"])
    return full, full[0, prefix:]


def test_continuation_tokens(setup):
    lm, _, pairs, req = setup
    assert req.n_tokens == [1, 1, 5, 1, 4, 1]
    ids, valid = req.targets()
    for r, (ex, c) in enumerate(pairs):
        _, cont = split_ids(lm, ex.prompt, c)
        assert ids[r][valid[r]].tolist() == cont.tolist()


def test_loglik_scores(setup):
    lm, twin, pairs, req = setup
    got_g, got_s = scorer("greedy")(Greedy(), req).logprobs, scorer("sample")(Sample(temperature=2.0), req).logprobs
    for r, (ex, c) in enumerate(pairs):
        full, cont = split_ids(lm, ex.prompt, c)
        with torch.no_grad():
            logits = twin(input_ids=full).logits[0].double()
        k = full.shape[1] - len(cont)
        ref = sum(logits[k - 1 + i].log_softmax(-1)[t].item() for i, t in enumerate(cont.tolist()))
        ref_t = sum((logits[k - 1 + i] / 2.0).log_softmax(-1)[t].item() for i, t in enumerate(cont.tolist()))
        assert got_g[r] == pytest.approx(ref, abs=1e-4)
        assert got_s[r] == pytest.approx(ref_t, abs=1e-4)


def reference_dola_score(twin, full, cont, layers, relative_top, post_softmax, value=-1000.0):
    """DoLa's ``lm_score`` (mode dola): per position, the premature layer by the kl_div divergence."""
    with torch.no_grad():
        out = twin(input_ids=full, output_hidden_states=True)
    head = twin.get_output_embeddings()
    k = full.shape[1] - len(cont)
    early = {j: head(out.hidden_states[j])[0] for j in layers}
    total = 0.0
    for i, tok in enumerate(cont.tolist()):
        seq_i = k - 1 + i
        final = out.logits[0, seq_i][None]
        stacked = torch.stack([early[j][seq_i][None] for j in layers])
        m = 0.5 * (F.softmax(final, -1)[None] + F.softmax(stacked, -1))
        kl1 = F.kl_div(F.log_softmax(final, -1)[None], m, reduction="none").mean(-1)
        kl2 = F.kl_div(F.log_softmax(stacked, -1), m, reduction="none").mean(-1)
        layer = layers[int((0.5 * (kl1 + kl2)).mean(-1).argmax())]
        fl = out.logits[0, seq_i].log_softmax(-1)
        diff = fl - early[layer][seq_i].log_softmax(-1)
        if post_softmax:
            diff = diff.log_softmax(-1)
        if relative_top > 0:
            thresh = fl.max() + np.log(relative_top)
            diff = torch.where(fl < thresh, torch.tensor(value), diff)
        total += diff[tok].item()
    return total


@pytest.mark.parametrize("opts", [{}, {"score_relative_top": 0.1, "score_post_softmax": True}])
def test_dola_score_equals_reference_lm_score(setup, opts):
    lm, twin, pairs, req = setup
    layers = [0, 1, 2, 3, 4, 5]
    got = scorer("dola")(DoLa(layers=layers, **opts), req).logprobs
    for r, (ex, c) in enumerate(pairs):
        full, cont = split_ids(lm, ex.prompt, c)
        ref = reference_dola_score(twin, full, cont, layers, opts.get("score_relative_top", 0.0),
                                   opts.get("score_post_softmax", False))
        assert got[r] == pytest.approx(ref, abs=2e-3)


def test_decore_score_equals_reference_lm_score(setup):
    lm, twin, pairs, req = setup
    heads = [(0, 1), (2, 3), (4, 0)]
    for opts in ({"alpha": "entropy"}, {"alpha": 0.5, "score_post_softmax": True}):
        got = scorer("decore")(DeCoRe(heads=[list(h) for h in heads], **opts), req).logprobs
        for r, (ex, c) in enumerate(pairs):
            full, cont = split_ids(lm, ex.prompt, c)
            with torch.no_grad():
                base = twin(input_ids=full).logits[0].double()
                with masked_queries(twin, heads):
                    masked = twin(input_ids=full).logits[0].double()
            k = full.shape[1] - len(cont)
            total = 0.0
            for i, tok in enumerate(cont.tolist()):
                lb, lm_ = base[k - 1 + i], masked[k - 1 + i]
                p = lb.softmax(-1)
                a = float(-(p * torch.log(p + 1e-12)).sum()) if opts["alpha"] == "entropy" else opts["alpha"]
                diff = (1 + a) * lb.log_softmax(-1) - a * lm_.log_softmax(-1)
                if opts.get("score_post_softmax"):
                    diff = diff.log_softmax(-1)
                total += diff[tok].item()
            assert got[r] == pytest.approx(total, abs=1e-3)


def test_cad_and_contrastive_scores(setup):
    lm, twin, pairs, req = setup
    got = scorer("cad")(CAD(alpha=0.5), req).logprobs
    cfg = Contrastive(amateur=AMATEUR, score_plausibility=True)
    am_twin = eager_twin(amateur_model(cfg.amateur, 0, "cpu"))
    got_cd = scorer("contrastive")(cfg, req).logprobs
    for r, (ex, c) in enumerate(pairs):
        full, cont = split_ids(lm, ex.prompt, c)
        plain, cont2 = split_ids(lm, without_context(ex), c)
        assert cont.tolist() == cont2.tolist()
        with torch.no_grad():
            lc, lp = twin(input_ids=full).logits[0].double(), twin(input_ids=plain).logits[0].double()
            le, la = lc, am_twin(input_ids=full).logits[0].double()
        k, kp = full.shape[1] - len(cont), plain.shape[1] - len(cont)
        ref = sum((1.5 * lc[k - 1 + i] - 0.5 * lp[kp - 1 + i]).log_softmax(-1)[t].item()
                  for i, t in enumerate(cont.tolist()))
        assert got[r] == pytest.approx(ref, abs=1e-3)
        ref_cd = 0.0
        for i, t in enumerate(cont.tolist()):
            e, a = le[k - 1 + i].log_softmax(-1), la[k - 1 + i].log_softmax(-1)
            ref_cd += (e[t] - a[t]).item() if e[t].exp() >= 0.1 * e.exp().max() else -1000.0
        assert got_cd[r] == pytest.approx(ref_cd, abs=1e-3)


def mc_calcs(scores_true, scores_false, ref_true, ref_best):
    """TruthfulQA's ``MC_calcs`` (as used by the DoLa evaluation), transcribed."""
    scores = {}
    max_false = max(scores_false)
    scores["MC1"] = 1.0 if scores_true[ref_true.index(ref_best)] > max_false else 0.0
    scores["MC3"] = sum(np.array(scores_true) > max_false) / float(len(scores_true))
    probs_true, probs_false = np.exp(scores_true), np.exp(scores_false)
    scores["MC2"] = sum(probs_true / (sum(probs_true) + sum(probs_false)))
    return scores


def test_mc_metrics_match_truthfulqa_definitions():
    rng = np.random.default_rng(0)
    examples, rows = [], []
    for _ in range(30):
        k = int(rng.integers(2, 7))
        labels = [0] * k
        for j in rng.choice(k, size=int(rng.integers(1, k)), replace=False):
            labels[j] = 1
        s = rng.normal(-5, 2, size=k)
        label = labels.index(1)
        examples.append(Example(prompt="p", choices=[f" c{j}" for j in range(k)], label=label,
                                meta={"labels": labels}))
        rows.append(np.pad(s, (0, 6 - k), constant_values=np.nan))
    out = mc_metrics(np.array(rows), examples)
    for i, ex in enumerate(examples):
        s = rows[i][: len(ex.choices)]
        lab = np.array(ex.meta["labels"], dtype=bool)
        ref = mc_calcs(list(s[lab]), list(s[~lab]), [c for c, t in zip(ex.choices, lab, strict=True) if t], ex.choices[ex.label])
        assert out["mc1"][i] == ref["MC1"] and out["mc3"][i] == pytest.approx(ref["MC3"])
        assert out["mc2"][i] == pytest.approx(ref["MC2"], rel=1e-9)
        assert out["accuracy"][i] == float(lab[int(np.argmax(s))])


def write_tokenizer(tmp_path):
    path = tmp_path / "tok"
    word_tokenizer().save_pretrained(str(path))
    return str(path)


def test_score_step_end_to_end(tmp_path):
    rows = [{"question": "what is the capital of france ?",
             "mc1_targets": {" paris .": 1, " rome .": 0, " a b c": 0},
             "mc2_targets": {" paris .": 1, " the capital is paris": 1, " rome .": 0}},
            {"question": "what is a ?", "mc1_targets": {" a": 1, " b": 0},
             "mc2_targets": {" a": 1, " a b": 1, " c d": 0, " e": 0}}]
    data = tmp_path / "mc_task.json"
    data.write_text(json.dumps([{"question": r["question"],
                                 "mc1_targets": {k.strip(): v for k, v in r["mc1_targets"].items()},
                                 "mc2_targets": {k.strip(): v for k, v in r["mc2_targets"].items()}} for r in rows]))
    cfg = dict(model_config(4), tokenizer=write_tokenizer(tmp_path))
    spec = f"""name: mc
model: {{config: {json.dumps(cfg)}}}
task: {{kind: truthfulqa, path: {data}, mode: mc2, primer: false}}
steps:
  - id: base
    score: {{batch_size: 3}}
  - id: dola
    score: {{decode: {{kind: dola, layers: [0, 2]}}}}
  - id: decore
    score: {{decode: {{kind: decore, heads: [[0, 1], [1, 2]], alpha: entropy}}}}
sweep:
  decore.decode.alpha: [0.5, entropy]
"""
    run = headlab.run(spec, out=tmp_path / "runs")
    base = run.results["base"]
    assert base["logprob"].dims[-2:] == ("example", "choice") and base.sizes["choice"] == 4
    assert set(base.attrs["metrics"]) == {"mc1", "mc2", "mc3", "accuracy"}
    assert run.summary()["base"]["kind"] == "score"  # labelled by its action, not "generate"
    assert "decore.decode.alpha" in run.results["decore"]["mc2"].dims
    # the stored numbers are the scores of the rows computed directly
    lm = word_model(4, False)
    lm.tokenizer = word_tokenizer()
    from headlab.runner import build_examples
    from headlab.spec import load_spec

    loaded = load_spec(spec)
    examples = build_examples(loaded.spec.task, lm, 0)
    pairs = [(ex, c) for ex in examples for c in ex.choices]
    batch, n = continuation_batch(lm, pairs)
    direct = scorer("greedy")(Greedy(), ScoreRequest(lm, batch, n, [p[0] for p in pairs], [p[1] for p in pairs]))
    flat = base["logprob"].isel({d: 0 for d in base["logprob"].dims if d not in ("example", "choice")}).values
    got = [flat[i, j] for i, ex in enumerate(examples) for j in range(len(ex.choices))]
    np.testing.assert_allclose(got, direct.logprobs, atol=1e-4)
    assert math.isnan(flat[0, 3])  # the first example has three choices


def test_score_errors(tmp_path, monkeypatch):
    from headlab.spec import SpecError

    with pytest.raises(SpecError, match="exactly one action"):
        headlab.load_spec("""name: x
model: {config: {model_type: llama}}
task: {kind: repeated_tokens}
steps:
  - id: a
    score: {}
    generate: {}
""")
    cfg = dict(model_config(2), tokenizer=write_tokenizer(tmp_path))
    spec = f"""name: x
model: {{config: {json.dumps(cfg)}}}
task: {{kind: counterfact, n: 2}}
steps:
  - id: a
    score: {{}}
"""
    with pytest.raises(headlab.StepError, match="choices") as err:  # names the step; the cause is the plugin's
        headlab.run(spec, out=tmp_path / "r")
    assert isinstance(err.value.cause, ValueError) and err.value.step == "a"
