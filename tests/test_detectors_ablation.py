"""The ablation check (docs/methods.md#causal-check-by-ablation and docs/methods.md#head-masking-and-scaling) against an
independent computation: eager models whose masked heads are removed by weight surgery (query masking:
the head's rows of q_proj zeroed, so its scores are 0 and it attends uniformly; output masking: the head's
columns of o_proj zeroed), decoded one example at a time."""

from __future__ import annotations

import copy
import json
import random

import numpy as np
import pytest
import torch
from rouge_score import rouge_scorer

import headlab

from fixtures.detectors import WORDS, build_models, save_tokenizer, tiny_config, word_tokenizer

MAX_NEW = 5


def surgery(model, heads, mode: str):
    """A copy of ``model`` with ``heads`` masked by editing weights."""
    m = copy.deepcopy(model)
    D = m.config.hidden_size // m.config.num_attention_heads
    with torch.no_grad():
        for layer, head in heads:
            attn = m.model.layers[layer].self_attn
            if mode == "query":
                attn.q_proj.weight[head * D:(head + 1) * D] = 0
            else:
                attn.o_proj.weight[:, head * D:(head + 1) * D] = 0
    return m


def greedy_batch1(model, tok, prompt: str, max_new: int, prefix_model=None) -> str:
    """Greedy decoding of one prompt; with ``prefix_model`` the prompt minus its last token is prefilled by
    that (unmasked) model and ``model`` continues from its KV cache."""
    ids = torch.tensor([tok(prompt)["input_ids"]])
    out = []
    with torch.no_grad():
        cache = None
        if prefix_model is not None:
            cache = prefix_model(input_ids=ids[:, :-1], use_cache=True).cache
            feed = ids[:, -1:]
        else:
            feed = ids
        for _ in range(max_new):
            o = model(input_ids=feed, cache=cache, use_cache=True)
            cache = o.cache
            nxt = int(o.logits[0, -1].argmax())
            if nxt == tok.eos_token_id:
                break
            out.append(nxt)
            feed = torch.tensor([[nxt]])
    return tok.decode(out, skip_special_tokens=True)


@pytest.fixture(scope="module")
def setup():
    tok = word_tokenizer()
    lm, models = build_models(tiny_config(len(tok), initializer_range=0.2), seed=3, tokenizer=tok)  # peaky attention
    return tok, lm, models


def _task(tmp_path, tok, eager, n=4):
    rng = random.Random(1)
    records = []
    for i in range(n):
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 11))) + " ."
        words = greedy_batch1(eager, tok, text, MAX_NEW).split()
        records.append({"text": text, "answer": words[0] if (words and i % 2 == 0) else "zebra"})
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in records))
    return path, records


@pytest.mark.parametrize("mode, match_layers, mask_prompt", [("query", False, True), ("output", True, False)])
def test_ablation_equals_weight_surgery_reference(tmp_path, setup, mode, match_layers, mask_prompt):
    tok, _, models = setup
    eager = models["eager"]
    path, records = _task(tmp_path, tok, eager)
    cfg = tiny_config(len(tok), initializer_range=0.2, tokenizer=save_tokenizer(tok, tmp_path / "tok"))
    heads = [[1, 2], [0, 1], [1, 0]]
    spec = (f"name: t\nseed: 3\nmodel: {{config: {json.dumps(cfg)}}}\n"
            f"task: {{kind: jsonl, path: {path}, prompt: '{{{{ text }}}}', target: '{{{{ answer }}}}'}}\n"
            f"steps:\n  - id: abl\n    detect: {{kind: ablation, heads: {json.dumps(heads)}, k: [1, all], draws: 2, "
            f"mode: {mode}, match_layers: {str(match_layers).lower()}, mask_prompt: {str(mask_prompt).lower()}, "
            f"max_new_tokens: {MAX_NEW}, batch_size: 14, length_slack: 10, "
            f"metric: {{kind: needle_recall, raw: true, reference: target}}}}\n")
    ds = headlab.run(spec, out=tmp_path / "runs").results["abl"]
    scorer = rouge_scorer.RougeScorer(["rouge1"], use_stemmer=True)

    def check(masked, outputs, values):
        model = surgery(eager, masked, mode) if masked else eager
        for i, r in enumerate(records):
            ref = greedy_batch1(model, tok, r["text"], MAX_NEW, prefix_model=None if mask_prompt else eager)
            assert outputs[i] == ref
            assert values[i] == pytest.approx(scorer.score(" " + r["answer"], ref.strip())["rouge1"].recall)

    check([], ds["output_base"].values, ds["base_example"].values)
    assert float(ds["base"]) == pytest.approx(ds["base_example"].values.mean())
    assert ds["top_layer"].values.tolist() == [1, 0, 1] and ds["top_head"].values.tolist() == [2, 1, 0]
    changed = 0
    for a, k in enumerate([1, 3]):
        top = [tuple(h) for h in heads[:k]]
        check(top, ds["output_top"].values[a], ds["top_example"].values[a])
        assert float(ds["top"].values[a]) == pytest.approx(ds["top_example"].values[a].mean())
        changed += sum(x != y for x, y in zip(ds["output_top"].values[a], ds["output_base"].values, strict=True))
        for d in range(2):
            drawn = [(int(x), int(y)) for x, y in zip(ds["random_layer"].values[a, d], ds["random_head"].values[a, d],
                                                      strict=True) if x >= 0]
            assert len(drawn) == k and len(set(drawn)) == k and not set(drawn) & set(top)
            if match_layers:
                assert sorted(x for x, _ in drawn) == sorted(x for x, _ in top)
            check(drawn, ds["output_random"].values[a, d], ds["random_example"].values[a, d])
    assert changed > 0, "masking should change some outputs for the test to mean something"


def test_draw_random_heads_constraints():
    from headlab.model import Geometry
    from headlab.plugins.detectors.ablation import draw_random_heads

    geo = Geometry(3, 4, 4, 8)
    top = [(0, 1), (0, 2), (2, 3)]
    rng = np.random.default_rng(0)
    seen = set()
    for _ in range(20):
        d = draw_random_heads(top, geo, rng, match_layers=True)
        assert sorted(x for x, _ in d) == [0, 0, 2] and not set(d) & set(top)
        seen.add(tuple(d))
        d = draw_random_heads(top, geo, rng)
        assert len(set(d)) == 3 and not set(d) & set(top)
    assert len(seen) > 1
    with pytest.raises(ValueError, match="layer 0"):
        draw_random_heads([(0, h) for h in range(3)], geo, rng, match_layers=True)
    assert len(draw_random_heads([(0, h) for h in range(3)], geo, rng, match_layers=True, exclude=False)) == 3


def test_ablation_spec_errors(tmp_path):
    from fixtures.specs import spec_text

    with pytest.raises(headlab.SpecError, match="metric"):
        headlab.load_spec(spec_text("  - id: a\n    detect: {kind: ablation, heads: [[0, 1]], metric: nope}\n"))
    with pytest.raises(headlab.SpecError, match="k"):
        headlab.load_spec(spec_text("  - id: a\n    detect: {kind: ablation, heads: [[0, 1]], k: [0]}\n"))
