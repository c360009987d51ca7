"""probe (docs/methods.md#per-head-probes): z collected by an eager forward pre-hook on each layer's o_proj (one
example at a time, no padding, no headlab code), sklearn fitted per head on the folds the detector records, give
the detector's accuracies, directions, sigma and class means; on Llama with grouped-query attention, Qwen2 and
GPT-2, left-padded batches, two and three classes, every position option, both classifiers and both logistic
solvers (lbfgs, sklearn's default, and newton-cholesky), each against sklearn's same solver. A head planted to
carry the label ranks first."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from sklearn.linear_model import LogisticRegression

from headlab import Example, StepContext
from headlab.plugins.probes.probe import Probe, detect

from fixtures.circuits import models
from fixtures.detectors import WORDS, build_models, tiny_config, word_tokenizer
from fixtures.probes import labelled, reference_z


def unit(v):
    return v / np.linalg.norm(v)


CASES = [("llama", 2, "last", "logistic", "lbfgs"), ("llama", 3, "mean", "logistic", "lbfgs"),
         ("qwen2", 3, "last", "logistic", "lbfgs"), ("gpt2", 2, "last", "logistic", "lbfgs"),
         ("llama", 3, "last", "logistic", "newton-cholesky"), ("gpt2", 3, -2, "nearest_mean", "lbfgs"),
         ("llama", 2, 1, "nearest_mean", "lbfgs")]


@pytest.mark.parametrize(("arch", "n_classes", "position", "classifier", "solver"), CASES)
def test_probe_equals_sklearn_on_z_from_an_eager_hook(arch, n_classes, position, classifier, solver):
    tok, lm, pair = models(arch)
    lm.model.double()
    eager = pair["eager"].double()
    examples = labelled(36, n_classes)
    config = Probe(label="truth", group="qid", position=position, folds=3, seed=1, classifier=classifier,
                   solver=solver, batch_size=8)
    ds = detect(config, StepContext(model=lm, examples=examples, results={}, seed=0))
    L, H = lm.geometry.n_layers, lm.geometry.n_heads
    z = reference_z(eager, tok, examples, position, L, H)
    y = np.array([int(ex.meta["truth"]) for ex in examples])
    fold = ds["fold"].values
    np.testing.assert_array_equal(ds["class_index"].values, y)
    assert sorted(set(fold.tolist())) == [0, 1, 2]
    for q in {ex.meta["qid"] for ex in examples}:  # a question's examples share a fold
        assert len({fold[i] for i, ex in enumerate(examples) if ex.meta["qid"] == q}) == 1
    positive = n_classes - 1
    for layer in range(L):
        for head in range(H):
            X = z[:, layer, head]
            accs = []
            for k in range(3):
                tr, te = fold != k, fold == k
                if classifier == "logistic":
                    pred = LogisticRegression(C=1.0, max_iter=1000, solver=solver).fit(X[tr], y[tr]).predict(X[te])
                else:
                    means = np.stack([X[tr & (y == c)].mean(0) for c in range(n_classes)])
                    cos = (X[te] @ means.T) / np.linalg.norm(X[te], axis=1)[:, None] / np.linalg.norm(means, axis=1)
                    pred = cos.argmax(1)
                accs.append((pred == y[te]).mean())
            assert ds["score"].values[layer, head] == pytest.approx(np.mean(accs), abs=1e-12)
            assert ds["accuracy_std"].values[layer, head] == pytest.approx(np.std(accs), abs=1e-12)
            mm = unit(X[y == positive].mean(0) - X[y != positive].mean(0))
            assert float(mm @ ds["direction"].values[layer, head]) >= 1 - 1e-6
            # the RMS norms compute in float32 even in a float64 model: z agrees to ~1e-7 of its scale
            assert ds["sigma"].values[layer, head] == pytest.approx(np.std(X @ mm), rel=1e-5)
            for c in range(n_classes):
                np.testing.assert_allclose(ds["class_mean"].values[c, layer, head], X[y == c].mean(0),
                                           rtol=1e-5, atol=1e-6 * np.abs(X).max())
            if classifier == "logistic":
                w = LogisticRegression(C=1.0, max_iter=1000, solver=solver).fit(X, (y == positive).astype(int)).coef_[0]
                assert float(unit(w) @ ds["probe_direction"].values[layer, head]) >= 1 - 1e-6
    assert "probe_direction" in ds if classifier == "logistic" else "probe_direction" not in ds
    assert ds.attrs["forwards"] == 5  # 36 examples in batches of 8
    assert ds.attrs["fits"] == (L * H * 4 if classifier == "logistic" else 0)
    assert ds.attrs["positive_class"] == str(ds["class"].values[positive])
    assert ds.attrs["solver"] == solver
    assert ds["score"].dims == ("layer", "head") and ds["direction"].dims == ("layer", "head", "head_dim")
    assert ds["class_mean"].dims == ("class", "layer", "head", "head_dim")


def test_without_groups_the_folds_are_stratified_and_the_seed_moves_them():
    tok, lm, _ = models("llama")
    examples = labelled(30, 3, seed=2)
    ctx = StepContext(model=lm, examples=examples, results={}, seed=0)
    a = detect(Probe(label="truth", folds=3, classifier="nearest_mean"), ctx)
    b = detect(Probe(label="truth", folds=3, classifier="nearest_mean", seed=5), ctx)
    y = a["class_index"].values
    for k in range(3):
        counts = np.bincount(y[a["fold"].values == k], minlength=3)
        np.testing.assert_array_less(np.abs(counts - np.bincount(y) / 3), 1.0 + 1e-9)
    assert a.attrs["seed"] == 0 and b.attrs["seed"] == 5
    assert not np.array_equal(a["fold"].values, b["fold"].values)


def test_a_planted_head_ranks_first():
    """Layer 0 of a random 2-layer Llama (4 key/value heads) where only head 2 can see the first word: the two
    label words have opposite embeddings, every other head's keys and values are blind to them, and head 2's
    values read them strongly; layer 1 writes nothing (its value projection is zero)."""
    tok = word_tokenizer()
    lm, _ = build_models(tiny_config(len(tok), num_key_value_heads=4), seed=3, tokenizer=tok, impls=("headlab",))
    model = lm.model
    emb = model.model.embed_tokens.weight
    ant, bee = tok.convert_tokens_to_ids(["ant", "bee"])
    attn0 = model.model.layers[0].self_attn
    D = lm.geometry.head_dim
    planted = 2
    with torch.no_grad():
        emb[bee] = -emb[ant]
        u = model.model.layers[0].input_layernorm.weight * emb[ant]
        u = u / u.norm()
        for proj in (attn0.k_proj, attn0.v_proj):
            proj.weight -= (proj.weight @ u)[:, None] * u[None]  # blind to the label words
        rows = slice(planted * D, (planted + 1) * D)
        attn0.v_proj.weight[rows] += 20.0 * torch.randn(D, generator=torch.Generator().manual_seed(0))[:, None] * u
        model.model.layers[1].self_attn.v_proj.weight.zero_()
    rng = random.Random(0)
    others = [w for w in WORDS if w not in ("ant", "bee")]
    examples = []
    for i in range(40):
        first = "ant" if i % 2 else "bee"
        words = [first] + [rng.choice(others) for _ in range(rng.randint(2, 6))]
        examples.append(Example(prompt=" ".join(words), meta={"truth": first == "ant"}))
    ds = detect(Probe(label="truth", folds=2), StepContext(model=lm, examples=examples, results={}, seed=0))
    score = ds["score"].values
    assert np.unravel_index(score.argmax(), score.shape) == (0, planted)
    assert score[0, planted] >= 0.95, score
    assert np.sort(score.ravel())[-2] < 0.7, score  # the other heads are blind: chance level


def test_fits_in_worker_processes_equal_the_fits_in_this_process():
    """n_jobs: 2 runs the per-head fits in joblib worker processes; every output equals n_jobs: 1's."""
    _, lm, _ = models("llama")
    ctx = StepContext(model=lm, examples=labelled(24, 2, seed=4), results={}, seed=0)
    one = detect(Probe(label="truth", folds=2), ctx)
    two = detect(Probe(label="truth", folds=2, n_jobs=2), ctx)
    assert one.attrs["fits"] == two.attrs["fits"] > 0
    for name in ("score", "accuracy_std", "probe_direction", "direction", "sigma"):
        np.testing.assert_array_equal(one[name].values, two[name].values)
