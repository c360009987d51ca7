"""sav (docs/methods.md#sparse-attention-vectors): the votes, the predictions and the accuracy of a sav step equal
a NumPy reference built on z read by an eager forward pre-hook on o_proj (one example per forward): class means
of the probe's examples, heads ranked by their nearest-mean accuracy on the probe's folds, cosine votes,
majority with ties to the highest-ranked head; on a text task (Llama with grouped-query attention, left padding,
three classes) and on tiny LLaVA and Qwen2-VL with images. Top-k against all heads is a sweep of a spec."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

import headlab
from headlab import Example, StepContext
from headlab.model import load_model
from headlab.plugins.probes.probe import Probe, detect
from headlab.plugins.probes.sav import majority_vote, sav, sav_config
from headlab.spec import HeadsFrom, ModelSpec
from headlab.vision import placeholder

from fixtures import vision as F
from fixtures.circuits import models
from fixtures.probes import labelled, reference_z

Sav = sav_config(None)  # the config uses no registered kind


def reference_votes(z_train, y, fold, n_folds, z_test, top):
    """NumPy SAVs: (head_vote (example, rank), votes, winner) of the ``top`` heads ranked by held-out accuracy."""
    n_classes = int(y.max()) + 1
    L, H = z_train.shape[1:3]

    def cos_argmax(means, z):  # means (C, D), z (n, D)
        c = (z @ means.T) / np.linalg.norm(z, axis=1)[:, None] / np.linalg.norm(means, axis=1)[None]
        return c.argmax(1)

    score = np.zeros((L, H))
    for layer in range(L):
        for head in range(H):
            X = z_train[:, layer, head]
            accs = []
            for k in range(n_folds):
                tr, te = fold != k, fold == k
                means = np.stack([X[tr & (y == c)].mean(0) for c in range(n_classes)])
                accs.append((cos_argmax(means, X[te]) == y[te]).mean())
            score[layer, head] = np.mean(accs)
    order = sorted(np.ndindex(L, H), key=lambda lh: (-score[lh], lh))[:top]
    head_vote = np.stack([cos_argmax(np.stack([z_train[y == c, l_, h].mean(0) for c in range(n_classes)]),
                                     z_test[:, l_, h]) for l_, h in order], axis=1)
    votes = np.stack([(head_vote == c).sum(1) for c in range(n_classes)], axis=1)
    winner = []
    for e in range(len(z_test)):
        best = votes[e].max()
        winner.append(next(c for c in head_vote[e] if votes[e, c] == best))  # the highest-ranked tied vote
    return head_vote, votes, np.array(winner), order


def test_majority_vote_breaks_ties_by_rank():
    head_vote = np.array([[2, 0, 0, 2], [1, 0, 2, 2], [0, 1, 2, 1]])
    votes, winner = majority_vote(head_vote, 3)
    np.testing.assert_array_equal(votes, [[2, 0, 2], [1, 1, 2], [1, 2, 1]])
    np.testing.assert_array_equal(winner, [2, 2, 1])


@pytest.mark.parametrize("top", [3, 8])
def test_sav_on_text_equals_numpy(top):
    tok, lm, pair = models("llama")
    lm.model.double()
    eager = pair["eager"].double()
    train, test = labelled(36, 3, seed=4), labelled(14, 3, seed=5)
    pr = detect(Probe(label="truth", folds=3, classifier="nearest_mean"),
                StepContext(model=lm, examples=train, results={}, seed=0))
    config = Sav(probe="pr", heads=HeadsFrom(**{"from": "pr", "top": top}), batch_size=4)
    ds = sav(config, StepContext(model=lm, examples=test, results={"pr": pr}, seed=0))
    L, H = lm.geometry.n_layers, lm.geometry.n_heads
    z_train = reference_z(eager, tok, train, "last", L, H)
    z_test = reference_z(eager, tok, test, "last", L, H)
    y = np.array([ex.meta["truth"] for ex in train])
    head_vote, votes, winner, order = reference_votes(z_train, y, pr["fold"].values, 3, z_test, top)
    assert list(zip(ds["rank_layer"].values.tolist(), ds["rank_head"].values.tolist(), strict=True)) == \
        [tuple(map(int, h)) for h in order]
    np.testing.assert_array_equal(ds["head_vote"].values, head_vote)
    np.testing.assert_array_equal(ds["votes"].values, votes)
    np.testing.assert_array_equal(ds["prediction"].values, winner)
    gold = np.array([ex.meta["truth"] for ex in test])
    assert float(ds["accuracy"]) == pytest.approx((winner == gold).mean())
    assert ds.attrs["n_heads"] == top and ds.attrs["forwards"] == 4


def vlm_examples(n: int, seed: int) -> list[Example]:
    """Examples with one image each, labelled by the image's mean brightness (dark / bright halves of the draws)."""
    out = []
    for i in range(n):
        img = F.image(seed + i, (24 + 8 * (i % 2), 32))
        out.append(Example(prompt=F.PROMPTS[i % len(F.PROMPTS)], images=[img],
                           meta={"bright": i % 2 == 0, "index": i}))
    return out


def vlm_reference_z(lm, model, examples) -> np.ndarray:
    """(example, layer, head, D): o_proj inputs at the last position, one example per forward of transformers'
    own model on the processor's inputs."""
    geo = lm.geometry
    captured = {}
    layers = F.text_layers(model)
    handles = [layers[i].self_attn.o_proj.register_forward_pre_hook(
        lambda m, args, i=i: captured.__setitem__(i, args[0][0, -1].detach())) for i in range(geo.n_layers)]
    out = []
    try:
        for ex in examples:
            text = ex.prompt.replace("<image>", placeholder(lm.processor))
            inputs = lm.processor(text=[text], images=ex.images, return_tensors="pt")
            inputs = {k: v.double() if v.is_floating_point() else v for k, v in inputs.items()}
            with torch.no_grad():
                model(**inputs)
            out.append(np.stack([captured[i].reshape(geo.n_heads, -1).numpy() for i in range(geo.n_layers)]))
    finally:
        for h in handles:
            h.remove()
    return np.stack(out)


@pytest.mark.parametrize("arch", ["llava", "qwen2_vl"])
def test_sav_on_a_vlm_with_images_equals_numpy(arch):
    import copy

    lm = load_model(ModelSpec(config=F.CONFIGS[arch], device="cpu"))
    lm.model.double()
    model = copy.deepcopy(lm.model)
    model.set_attn_implementation("sdpa")  # transformers' own attention (eager turns padded rows to NaN)
    train, test = vlm_examples(12, 0), vlm_examples(6, 100)
    pr = detect(Probe(label="bright", folds=2, classifier="nearest_mean", batch_size=4),
                StepContext(model=lm, examples=train, results={}, seed=0))
    top = 5
    ds = sav(Sav(probe="pr", heads=HeadsFrom(**{"from": "pr", "top": top}), batch_size=4),
             StepContext(model=lm, examples=test, results={"pr": pr}, seed=0))
    z_train, z_test = vlm_reference_z(lm, model, train), vlm_reference_z(lm, model, test)
    y = np.array([int(ex.meta["bright"]) for ex in train])
    head_vote, votes, winner, _ = reference_votes(z_train, y, pr["fold"].values, 2, z_test, top)
    np.testing.assert_array_equal(ds["head_vote"].values, head_vote)
    np.testing.assert_array_equal(ds["votes"].values, votes)
    np.testing.assert_array_equal(ds["prediction"].values, np.array([False, True])[winner])


def test_top_k_against_all_heads_is_a_sweep(tmp_path):
    rng = random.Random(0)
    words = "red blue green cat dog bird".split()
    rows = []
    for _ in range(24):
        w = [rng.choice(words) for _ in range(rng.randint(3, 6))]
        rows.append({"text": " ".join(w), "colour": w[-1] in ("red", "blue", "green")})
    (tmp_path / "s.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    spec = {"name": "sav", "model": {"config": {"model_type": "llama", "hidden_size": 32, "num_hidden_layers": 2,
                                                 "num_attention_heads": 4, "num_key_value_heads": 2,
                                                 "intermediate_size": 64, "vocab_size": 811,
                                                 "tokenizer": "headlab-tiny"}},
            "task": {"kind": "jsonl", "path": str(tmp_path / "s.jsonl"), "prompt": "{{ text }}", "meta": ["colour"]},
            "steps": [{"id": "pr", "detect": {"kind": "probe", "label": "colour", "classifier": "nearest_mean"}},
                      {"id": "vote", "sav": {"probe": "pr", "heads": {"from": "pr", "top": 1}}}],
            "sweep": {"vote.sav.heads.top": [1, 3, 8]}, "seed": 0}
    run = headlab.run(spec, out=tmp_path / "runs")
    ds = run.results["vote"]
    assert ds["votes"].sum("class").values.tolist() == [[1] * 24, [3] * 24, [8] * 24]
    acc = ds["accuracy"].values
    assert acc.shape == (3,) and np.all((acc >= 0) & (acc <= 1))
