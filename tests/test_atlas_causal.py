"""The atlas's causal check (headlab.plugins.atlas.causal; docs/atlas.md#causal-check): on a model whose
previous-token and induction heads are set by hand, masking them raises the loss on repeated tokens and the
labels are supported, while a label on a random head is not; every effect equals the same masks applied by
forward hooks on an eager copy of the model, with the losses computed here from the definition. The other
metrics (log-perplexity, successor accuracy) are checked the same way on a tiny random GQA Llama with left
padding."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import xarray as xr

from headlab.plugins.atlas.causal import (
    causal_check,
    causal_lines,
    draw_controls,
    log_perplexity,
    successor_accuracy,
    successor_examples,
    top_labelled,
)

from fixtures.atlas import build_circuit_model
from fixtures.detectors import build_models, tiny_config, word_tokenizer

TASK = {"kind": "repeated_tokens", "n": 8, "length": 16}


def _hooked(model, heads: list[tuple[int, int]]):
    """Forward pre-hooks on o_proj zeroing the given heads' slices of its input (the head outputs z)."""
    d = model.config.head_dim
    handles = []
    for layer in sorted({ly for ly, _ in heads}):
        cols = [h for ly, h in heads if ly == layer]

        def zero(_, args, cols=cols):
            x = args[0].clone()
            for h in cols:
                x[..., h * d: (h + 1) * d] = 0
            return (x,)

        handles.append(model.model.layers[layer].self_attn.o_proj.register_forward_pre_hook(zero))
    return handles


def _eager_nll(model, rows: list[list[int]], heads: list[tuple[int, int]]) -> list[np.ndarray]:
    """Per row, -log p(token i + 1 | tokens <= i), each row run alone (no padding), heads zeroed by hooks."""
    handles = _hooked(model, heads)
    try:
        out = []
        with torch.no_grad():
            for ids in rows:
                t = torch.tensor([ids])
                logp = torch.log_softmax(model(t).logits[0].double(), -1)
                out.append(-logp[:-1].gather(-1, t[0, 1:, None])[:, 0].numpy())
        return out
    finally:
        for h in handles:
            h.remove()


def _parse(name: str) -> tuple[int, int]:
    layer, head = name[1:].split("H")
    return int(layer), int(head)


def _pattern_scores(model, rows: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Previous-token and induction scores (TransformerLens 'mul': sum(A * D) / sum(A)), from eager attention."""
    prev, ind = [], []
    with torch.no_grad():
        for ids in rows:
            att = torch.stack(model(torch.tensor([ids]), output_attentions=True).attentions)[:, 0].double()
            n = len(ids)
            d_prev = torch.zeros(n, n, dtype=torch.double)
            d_prev[torch.arange(1, n), torch.arange(n - 1)] = 1
            dup = torch.tensor([[float(ids[i] == ids[j] and j < i) for j in range(n)] for i in range(n)])
            d_ind = torch.zeros(n, n, dtype=torch.double)
            d_ind[:, 1:] = dup[:, :-1]
            d_ind = torch.tril(d_ind)
            total = att.sum((-1, -2))
            prev.append(((att * d_prev).sum((-1, -2)) / total).numpy())
            ind.append(((att * d_ind).sum((-1, -2)) / total).numpy())
    return np.mean(prev, 0), np.mean(ind, 0)


def _cube(scores: dict[str, np.ndarray], labels: dict[str, np.ndarray], steps: dict) -> xr.Dataset:
    dets = list(scores)
    score = np.stack([scores[d] for d in dets])
    rank = np.stack([(-s).ravel().argsort(kind="stable").argsort().reshape(s.shape) + 1 for s in score])
    return xr.Dataset({"score": (("detector", "layer", "head"), score),
                       "label": (("detector", "layer", "head"), np.stack([labels[d] for d in dets])),
                       "rank": (("detector", "layer", "head"), rank)},
                      coords={"detector": dets}, attrs={"detector_steps": json.dumps(steps), "model": "circuit"})


@pytest.fixture(scope="module")
def circuit():
    lm, eager = build_circuit_model()
    rng = np.random.default_rng(5)
    rows = [list(s) + list(s) for s in rng.integers(0, 48, (3, 16)).tolist()]
    prev, ind = _pattern_scores(eager, rows)
    zeros = np.zeros_like(prev, dtype=bool)
    scores = {"previous_token": prev, "induction": ind, "duplicate_token": np.zeros_like(prev),
              "copy_suppression": np.zeros_like(prev), "attention_sink": np.zeros_like(prev)}
    random_label = zeros.copy()
    random_label[0, 2] = True  # a head that does nothing in particular
    labels = {"previous_token": prev > 0.5, "induction": ind > 0.3, "duplicate_token": random_label,
              "copy_suppression": random_label, "attention_sink": zeros}
    steps = {d: {"task": TASK, "detect": {"kind": d}} for d in scores}
    cube = _cube(scores, labels, steps)
    checked = causal_check(lm, cube, k=2, draws=3, seed=1)
    return lm, eager, cube, checked


def test_constructed_heads_are_found_and_causally_supported_random_ones_are_not(circuit):
    _, _, cube, checked = circuit
    assert top_labelled(cube, "previous_token", 4) == [(0, 0)]
    assert top_labelled(cube, "induction", 4) == [(1, 0)]
    c = checked.sel(detector="previous_token")
    assert list(c["causal_heads"].values) == ["L0H0", ""]
    assert bool(c["supported"]) and str(c["causal_status"].values) == "supported"
    assert str(c["causal_metric"].values) == "repeat_loss"
    assert float(c["effect"]) > 1.0 > 0.1 > float(np.abs(c["control_effect"]).max())
    # controls: one head each, in layer 0, never the masked head
    for d in range(3):
        heads = [_parse(x) for x in c["control_heads"].values[d] if x]
        assert len(heads) == 1 and heads[0][0] == 0 and heads[0] != (0, 0)
    assert bool(checked["supported"].sel(detector="induction"))
    rnd = checked.sel(detector="duplicate_token")
    assert not bool(rnd["supported"]) and str(rnd["causal_status"].values) == "not supported"
    assert str(checked["causal_status"].sel(detector="copy_suppression").values) == "no causal metric"
    assert np.isnan(float(checked["effect"].sel(detector="copy_suppression")))
    assert str(checked["causal_status"].sel(detector="attention_sink").values) == "no labelled heads"
    assert not checked["supported"].sel(detector=["copy_suppression", "attention_sink"]).any()
    assert checked.attrs["causal_k"] == 2 and checked.attrs["causal_draws"] == 3 and checked.attrs["causal_seed"] == 1
    lines = causal_lines(checked)
    assert lines[0].startswith("previous_token: supported (repeat_loss: effect +")
    assert "duplicate_token: not supported" in lines[2]
    # the cube's own variables are kept as they were
    xr.testing.assert_equal(checked[["score", "label", "rank"]], cube[["score", "label", "rank"]])


def test_effects_equal_hooked_eager_masks_and_the_loss_definition(circuit):
    lm, eager, _, checked = circuit
    from headlab import TaskContext, component

    comp = component("tasks", "repeated_tokens")
    examples = comp.impl(comp.config.model_validate(TASK), TaskContext(tokenizer=None, seed=1, vocab_size=48))
    rows = [ex.input_ids for ex in examples]

    def loss(heads):
        # the second copy's tokens after its first: positions 17..31 of s + s (no BOS: no tokenizer)
        return float(np.mean([nll[16:].mean() for nll in _eager_nll(eager, rows, heads)]))

    base = loss([])
    for det in ("previous_token", "induction", "duplicate_token"):
        c = checked.sel(detector=det)
        top = [_parse(x) for x in c["causal_heads"].values if x]
        np.testing.assert_allclose(float(c["causal_base"]), base, rtol=1e-5)
        np.testing.assert_allclose(float(c["effect"]), loss(top) - base, rtol=1e-4, atol=1e-5)
        want = [loss([_parse(x) for x in draw if x]) - base for draw in c["control_heads"].values]
        np.testing.assert_allclose(c["control_effect"].values, want, rtol=1e-4, atol=1e-5)
        spread = np.std(want, ddof=1)
        assert bool(c["supported"]) == bool(loss(top) - base > max(0.0, np.mean(want) + 2 * spread))


ORDINALS = ("one two three four five six seven eight nine ten Monday Tuesday Wednesday Thursday Friday Saturday "
            "Sunday B C D E F").split()  # "A" and "Q" are in the base vocabulary


@pytest.fixture(scope="module")
def gqa():
    tok = word_tokenizer(ORDINALS)
    lm, models = build_models(tiny_config(len(tok)), seed=3, tokenizer=tok)
    return tok, lm, models["eager"]


def test_successor_accuracy_and_log_perplexity_equal_hooked_eager_forwards(gqa):
    tok, lm, eager = gqa
    examples = successor_examples(tok)
    # numbers, weekdays and letters (digits and months are not in this vocabulary); windows of 1..3 items
    assert {ex.meta["sequence"] for ex in examples} == {"numbers", "weekdays", "letters"}
    assert len(examples) == 9 + 6 + 5
    first = examples[0]
    assert first.input_ids == [tok.bos_token_id, tok.convert_tokens_to_ids("one")]
    assert first.meta["answer_id"] == tok.convert_tokens_to_ids("two")
    assert examples[5].input_ids[1:] == [tok.convert_tokens_to_ids(w) for w in ("four", "five", "six")]
    for heads in ([], [(0, 1), (1, 3)]):
        got = successor_accuracy(lm, examples, heads, batch_size=7)  # batches of prompts of 2 to 4 tokens
        handles = _hooked(eager, heads)
        try:
            with torch.no_grad():
                want = []
                for ex in examples:
                    logits = eager(torch.tensor([ex.input_ids])).logits[0, -1]
                    cand = ex.meta["candidates"]
                    want.append(float(cand[int(logits[cand].argmax())] == ex.meta["answer_id"]))
        finally:
            for h in handles:
                h.remove()
        np.testing.assert_array_equal(got, want)
        rows = [ex.input_ids for ex in examples]
        np.testing.assert_allclose(log_perplexity(lm, examples, heads, batch_size=7),
                                   [nll.mean() for nll in _eager_nll(eager, rows, heads)], rtol=1e-4, atol=1e-5)


def test_the_atlas_labels_the_constructed_head_and_its_causal_check_supports_it(circuit):
    from headlab.plugins.atlas.atlas import build_atlas

    lm = circuit[0]
    cube = build_atlas(lm, detectors=["previous_token", "induction"], tokens=32, n=4, seed=0)
    assert np.argwhere(cube["label"].sel(detector="previous_token").values).tolist() == [[0, 0]]
    assert np.argwhere(cube["label"].sel(detector="induction").values).tolist() == [[1, 0]]
    checked = causal_check(lm, cube, k=4, draws=3, seed=0)
    assert checked["supported"].values.tolist() == [True, True]
    # the metric ran on the atlas's own task for these detectors (recorded in detector_steps)
    assert json.loads(cube.attrs["detector_steps"])["previous_token"]["task"]["kind"] == "repeated_tokens"
    assert (checked["effect"] > 1.0).all() and (np.abs(checked["control_effect"]) < 0.1).all()


def test_causal_options_are_validated_in_the_spec():
    from fixtures.specs import spec_error, spec_text

    message = spec_error(spec_text("  - id: atlas\n    atlas: {causal: {draws: 1}}\n"))
    assert "causal" in message and "draws" in message
    message = spec_error(spec_text("  - id: atlas\n    atlas: {causal: {mode: mean}}\n"))
    assert "mode" in message


@pytest.mark.slow
def test_causal_check_from_the_command_line_on_the_embedded_model(tmp_path, capfd):
    import headlab

    from fixtures.cli import command

    code, out, err = command(["atlas", "headlab-tiny", "--causal", "--out", str(tmp_path), "--n", "4",
                              "--tokens", "64", "--detectors", "previous_token,induction,retrieval,successor"], capfd)
    assert code == 0, err
    ds = headlab.open_run(next(tmp_path.iterdir())).results["atlas"]
    assert bool(ds["supported"].sel(detector="previous_token"))
    # the retrieval-head paper's finding on the embedded model: its retrieval heads carry needle recall
    r = ds.sel(detector="retrieval")
    assert str(r["causal_metric"].values) == "needle_recall" and bool(r["supported"])
    assert float(r["causal_base"]) - float(r["effect"]) < 0.5 < float(r["causal_base"])
    assert set(ds["causal_heads"].sel(detector="previous_token").values) - {""} == {"L2H0", "L2H5", "L1H5"}
    assert ds["control_effect"].dims == ("detector", "draw") and ds.sizes["draw"] == 5
    assert "causal check" in out and "previous_token: supported (repeat_loss: effect +" in out
    assert "successor: no labelled heads" in out


def test_controls_are_drawn_in_the_top_heads_layers_or_from_the_whole_model_when_a_layer_is_full():
    rng = np.random.default_rng(0)
    for _ in range(20):
        heads, matched = draw_controls([(0, 1), (2, 0), (2, 3)], 3, 4, rng)
        assert matched and sorted(ly for ly, _ in heads) == [0, 2, 2]
        assert not {(0, 1), (2, 0), (2, 3)} & set(heads) and len(set(heads)) == 3
    full = [(1, h) for h in range(4)]
    heads, matched = draw_controls(full, 3, 4, rng)
    assert not matched and len(set(heads)) == 4 and not set(full) & set(heads)
