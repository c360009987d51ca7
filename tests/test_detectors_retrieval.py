"""The retrieval detector (docs/methods.md#retrieval-score) against the reference method written out here:
batch-1 greedy decoding with eager attention and ``output_attentions``, top-1 key of the decode query,
needle span + copy-paste condition, 1/(needle length) per hit, mean over retrieved instances."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch
from rouge_score import rouge_scorer

import headlab
from headlab import Example

from fixtures.detectors import WORDS, build_models, save_tokenizer, tiny_config, word_tokenizer


def reference_retrieval(eager, ids: list[int], s: int, e: int, max_new: int, eos: int, stop=(), tok=None):
    """Wu et al.'s procedure, batch 1: prefill ids[:-1], then decode feeding the last prompt token with
    eager attention; per step, per head: top-1 key in [s, e) holding the generated token adds 1/(e-s).
    Stops after the step that generates EOS or completes a stop string (that step is scored)."""
    L = eager.config.num_hidden_layers
    H = eager.config.num_attention_heads
    score = np.zeros((L, H))
    out_tokens: list[int] = []
    inp = torch.tensor([ids])
    with torch.no_grad():
        q = eager(input_ids=inp[:, :-1], use_cache=True)
        past = q.cache
        token = inp[0, -1]
        for _ in range(max_new):
            o = eager(input_ids=token.view(1, 1), cache=past, use_cache=True, output_attentions=True)
            past = o.cache
            token = o.logits[0, -1].argmax()
            out_tokens.append(int(token))
            for layer in range(L):
                for head in range(H):
                    row = o.attentions[layer][0, head, -1]
                    i = int(row.topk(1).indices[0])
                    if s <= i < e and ids[i] == int(token):
                        score[layer, head] += 1 / (e - s)
            if int(token) == eos:
                break
            if stop and any(x in tok.decode(out_tokens, skip_special_tokens=True) for x in stop):
                break
    return score, out_tokens


def needle_examples(n: int, seed: int = 0) -> list[Example]:
    """Word sequences of several lengths with a marked needle (char span) in the middle."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        before = [rng.choice(WORDS) for _ in range(rng.randint(3, 12))]
        needle = [rng.choice(["bee", "cat", "jay"]) for _ in range(rng.randint(2, 5))]
        after = [rng.choice(WORDS) for _ in range(rng.randint(1, 6))]
        head = " ".join(before) + " "
        prompt = head + " ".join(needle) + " " + " ".join(after) + " ."
        out.append(Example(prompt=prompt, spans={"needle": [(len(head), len(head) + len(" ".join(needle)))]},
                           meta={"i": i}))
    return out


@pytest.fixture(scope="module")
def setup():
    tok = word_tokenizer()
    lm, models = build_models(tiny_config(len(tok)), seed=1, tokenizer=tok)  # a seed with many hits
    return tok, lm, models


@pytest.mark.parametrize("stop", [(), ("fox",)])
def test_retrieval_scores_equal_batch1_eager_reference(setup, stop):
    from headlab.generation import tokenize
    from headlab.plugins.detectors.retrieval import retrieval_scores

    tok, lm, models = setup
    examples = needle_examples(7)
    scores, texts = retrieval_scores(lm, examples, max_new_tokens=10, batch_size=3, stop=stop, length_slack=10)
    total_hits = 0.0
    for i, ex in enumerate(examples):
        batch = tokenize(lm, [ex])
        s, e = batch.token_span(0, *ex.spans["needle"][0])
        ids = batch.input_ids[0].tolist()
        assert tok.convert_ids_to_tokens(ids[s:e]) == tok.tokenize(ex.prompt[slice(*ex.spans["needle"][0])])
        ref, ref_tokens = reference_retrieval(models["eager"], ids, s, e, 10, eos=2, stop=stop, tok=tok)
        np.testing.assert_allclose(scores[i], ref, atol=1e-5, rtol=0)
        trimmed = ref_tokens[:-1] if ref_tokens and ref_tokens[-1] == 2 else ref_tokens
        text = tok.decode(trimmed, skip_special_tokens=True)
        assert texts[i] == (text[:text.index(stop[0])] if stop and stop[0] in text else text)
        total_hits += ref.sum()
    assert total_hits > 3, "the test needs copy-paste hits to be meaningful"


def test_copy_paste_condition_unit():
    """Hand-made argmax rows: a hit needs the key inside [s, e), the same token, and an active step."""
    from headlab.plugins.detectors.retrieval import copy_paste_hits

    seq = torch.tensor([[1, 7, 8, 9, 7, 5, 7, 9]])  # prompt of 6, then 2 generated tokens (7, 9)
    gen = torch.tensor([[7, 9]])
    spans = torch.tensor([[1, 4]])
    argmax = torch.tensor([[[[1, 3], [4, 3], [2, 1], [1, -1]]]])  # (1, 1 layer, 4 heads, 2 steps)
    hits = copy_paste_hits(argmax, seq, gen, torch.tensor([[True, True]]), spans)
    assert hits[0, 0].tolist() == [[True, True], [False, True], [False, False], [True, False]]
    hits = copy_paste_hits(argmax, seq, gen, torch.tensor([[True, False]]), spans)
    assert hits[0, 0, :, 1].tolist() == [False] * 4


def test_retrieval_plugin_spec_retrieved_mean_export_and_load(tmp_path, setup):
    """Through a spec with a `jsonl` task (needle marked with tags): per-instance scores equal the eager
    reference, `retrieved` is ROUGE-1 recall > 0.5 (rouge-score package), `score` is the mean over
    retrieved instances, `export` writes the reference JSON, `load` reads it back."""
    tok, _, models = setup
    tok_path = save_tokenizer(tok, tmp_path / "tok")
    examples = needle_examples(6, seed=3)
    records = []
    for i, ex in enumerate(examples):
        (s, e), = ex.spans["needle"]
        text = ex.prompt[:s] + "<needle>" + ex.prompt[s:e] + "</needle>" + ex.prompt[e:]
        ids = tok(ex.prompt)["input_ids"]
        ns = len(tok(ex.prompt[:s], add_special_tokens=True)["input_ids"])
        ne = ns + len(tok(ex.prompt[s:e], add_special_tokens=False)["input_ids"])
        _, out = reference_retrieval(models["eager"], ids, ns, ne, 6, eos=2)
        words = tok.decode([t for t in out if t != 2], skip_special_tokens=True).split()
        # half the targets are words the model outputs (retrieved), half are not
        answer = words[0] if (i % 2 == 0 and words) else "zebra"
        records.append({"text": text, "answer": answer})
    path = tmp_path / "needles.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in records))
    cfg = tiny_config(len(tok), tokenizer=tok_path)
    export = tmp_path / "heads.json"
    spec = (f"name: t\nseed: 1\nmodel: {{config: {json.dumps(cfg)}}}\n"
            f"task: {{kind: jsonl, path: {path}, prompt: '{{{{ text }}}}', target: '{{{{ answer }}}}', "
            f"span_tags: {{needle: needle}}}}\n"
            f"steps:\n  - id: ret\n    detect: {{kind: retrieval, max_new_tokens: 6, batch_size: 4, length_slack: 10, "
            f"reference: target, export: {export}}}\n"
            f"  - id: loaded\n    detect: {{kind: retrieval, load: {export}}}\n")
    run = headlab.run(spec, out=tmp_path / "runs")
    ds = run.results["ret"]
    per = ds["example_score"].transpose("example", "layer", "head").values
    scorer = rouge_scorer.RougeScorer(["rouge1"], use_stemmer=True)
    expect_retrieved = []
    for i, ex in enumerate(examples):
        (s, e), = ex.spans["needle"]
        ids = tok(ex.prompt)["input_ids"]
        ns = len(tok(ex.prompt[:s])["input_ids"])
        ne = ns + len(tok(ex.prompt[s:e], add_special_tokens=False)["input_ids"])
        ref, _ = reference_retrieval(models["eager"], ids, ns, ne, 6, eos=2)
        np.testing.assert_allclose(per[i], ref, atol=1e-5, rtol=0)
        # the needle's token span the scores used is stored, in the prompt's token ids
        assert (int(ds["needle_start"].values[i]), int(ds["needle_end"].values[i])) == (ns, ne)
        assert ds["input_ids"].values[i, ns:ne].tolist() == ids[ns:ne]
        recall = scorer.score(" " + records[i]["answer"], str(ds["output"].values[i]).strip())["rouge1"].recall
        expect_retrieved.append(recall > 0.5)
    assert ds["retrieved"].values.tolist() == expect_retrieved
    assert 0 < sum(expect_retrieved) < len(examples)
    kept = per[np.array(expect_retrieved)]
    np.testing.assert_allclose(ds["score"].transpose("layer", "head").values, kept.mean(0), atol=1e-12)
    assert ds["retrieval_head"].values.tolist() == (ds["score"].values >= 0.1).tolist()
    data = json.loads(export.read_text())
    assert set(data) == {f"{layer}-{head}" for layer in range(2) for head in range(4)}
    for key, values in data.items():
        layer, head = map(int, key.split("-"))
        assert values == pytest.approx(kept[:, layer, head].tolist())
    loaded = run.results["loaded"]["score"].transpose("layer", "head").values
    np.testing.assert_allclose(loaded, kept.mean(0), atol=1e-12)
    top = run.summary()["ret"]["top"]
    assert top[0]["score"] == pytest.approx(float(kept.mean(0).max()))


def test_read_retrieval_json_checks_geometry(tmp_path):
    from headlab.model import Geometry
    from headlab.plugins.detectors.retrieval import read_retrieval_json

    p = tmp_path / "h.json"
    p.write_text(json.dumps({"0-1": [0.5, 0.3], "1-0": [0.2]}))
    ds = read_retrieval_json(p, Geometry(2, 2, 2, 8))
    assert ds["score"].values.tolist() == [[0.0, pytest.approx(0.4)], [0.2, 0.0]]
    with pytest.raises(ValueError, match="outside this model"):
        read_retrieval_json(p, Geometry(1, 2, 2, 8))
    (tmp_path / "bad.json").write_text(json.dumps({"0": [1]}))
    with pytest.raises(ValueError, match="not a retrieval-head JSON"):
        read_retrieval_json(tmp_path / "bad.json")


def test_length_batches_bound_padding():
    from headlab.plugins.detectors.retrieval import length_batches

    lengths = [256, 512, 250, 1024, 260, 510, 1000, 255, 300]
    batches = length_batches(lengths, batch_size=3)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for b in batches:
        assert len(b) <= 3 and max(lengths[i] for i in b) <= 1.125 * min(lengths[i] for i in b)
    assert batches[0] == [2, 7, 0]  # sorted by length, ties by index
    assert length_batches(lengths, batch_size=100, slack=10) == [sorted(range(9), key=lambda i: (lengths[i], i))]
