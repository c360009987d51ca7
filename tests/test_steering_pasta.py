"""PASTA (plugins/steering/pasta.py) against independent computations.

- the bias equals post-softmax reweighting and renormalisation of eager attention (``output_attentions``)
  on every touched row, prefill and decode queries, for every ``scale_position`` and several sections;
  the per-key weights are computed here from the examples' character spans and the tokenizer's offsets;
- greedy generation under PASTA gives the same tokens as a naive implementation written here: an eager
  model with forward pre-hooks that add log(alpha) to the dense 4-D attention mask (the reference code's
  mechanism) inside transformers' own ``generate``;
- spec level: every form of ``heads`` resolves to the same steering; errors are clear.

The helpers (word-level tokenizer over the synthetic vocabulary, tiny random Llama, the eager hook
implementation) are shared with the other tests/test_steering_*.py modules, in tests/fixtures/steering.py.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from headlab import instrument as ins
from headlab.context import Example, StepContext, TaskContext
from headlab.generation import DecodeRequest, decode_loop, tokenize
from headlab.plugins.steering import pasta as P
from headlab.plugins.tasks.synthetic_tasks import Emphasis, build_emphasis

from fixtures.steering import (
    bias_matrix,
    build_tokenizer,
    eager_pasta,
    emphasis_examples,
    headlab_generate,
    hf_generate,
    key_weights,
    llama_config,
    loaded,
    pasta_plan,
    run_spec,
    step_ctx,
    tiny,
    two_section_example,
)


# --------------------------------------------------------------------------- the bias = reweighting
@pytest.mark.parametrize("mode", ["exclude", "include", "generation"])
def test_bias_equals_reweighting_on_every_touched_row(mode):
    tok = build_tokenizer()
    examples = emphasis_examples(3) + [two_section_example()]
    mh, me = tiny("headlab"), tiny("eager")
    batch = tokenize(loaded(mh), examples)
    assert len(set(batch.pad)) > 1  # left padding differs between rows
    heads = [(0, 1), (1, 0), (1, 3)]
    alpha = 0.05
    n_new = 4
    plan = pasta_plan(mh, batch, heads, alpha, mode, probes=ins.Probes(pattern=True))
    with ins.instrument(mh, plan) as rec, torch.no_grad():
        new = hf_generate(mh, batch, n_new)
    # eager attention of layer l over prompt + generated tokens from one full forward, unsteered in layer l
    # (the naive hooks steer the layers below l, so layer l sees the same inputs as in the steered run)
    full = torch.cat([batch.input_ids, new], 1)
    am = torch.cat([batch.attention_mask, torch.ones_like(new)], 1)
    bias = bias_matrix(tok, batch, alpha, mode)
    eager = []
    for layer in range(2):
        with eager_pasta(me, [h for h in heads if h[0] < layer], bias), torch.no_grad():
            eager.append(me(input_ids=full, attention_mask=am, position_ids=(am.cumsum(-1) - 1).clamp(min=0),
                            output_attentions=True).attentions[layer])
    got = rec.pattern  # (batch, layer, head, query, key) over prompt + steps (the last token is never fed)
    N = batch.length
    n_q = N + n_new - 1
    assert got.shape[3] == n_q
    for b, ex in enumerate(examples):
        w = key_weights(tok, ex, batch.pad[b], N, n_q, alpha, mode)
        real = am[b, :n_q].bool()
        for layer in range(2):
            for h in range(4):
                A = eager[layer][b, h, :n_q, :n_q].double()
                if (layer, h) in heads:
                    want = A * w
                    want = want / want.sum(-1, keepdim=True)
                else:
                    want = A
                torch.testing.assert_close(got[b, layer, h][real].double(), want[real], atol=3e-5, rtol=0)
    # the steering is not a no-op on touched heads, and decode rows (queries >= N) are covered
    touched = got[0, 0, 1, N:].double()
    assert not torch.allclose(touched, eager[0][0, 1, N:n_q, :n_q].double(), atol=1e-3)


def test_generation_matches_naive_eager_hooks():
    tok = build_tokenizer()
    examples = emphasis_examples(4, seed=3) + [two_section_example()]
    mh, me = tiny("headlab"), tiny("eager")
    batch = tokenize(loaded(mh), examples)
    heads = [(0, 0), (0, 2), (1, 1), (1, 2), (1, 3)]
    for mode, alpha in (("exclude", 0.01), ("include", 0.2), ("generation", 0.05)):
        plan = pasta_plan(mh, batch, heads, alpha, mode)
        ours = headlab_generate(mh, batch, plan, 8)
        with eager_pasta(me, heads, bias_matrix(tok, batch, alpha, mode)):
            ref = hf_generate(me, batch, 8).tolist()
        assert ours == ref, mode
    plain = hf_generate(me, batch, 8).tolist()
    with eager_pasta(me, heads, bias_matrix(tok, batch, 0.01, "exclude")):
        assert hf_generate(me, batch, 8).tolist() != plain  # steering changes what is generated


def test_pasta_bias_spans_follow_the_reference_additions():
    # exclude: each section's complement within the prompt [p0, n)
    assert P.pasta_bias([(3, 5)], (1, 10), 0.5, "exclude") == [((1, 3), math.log(0.5)), ((5, 10), math.log(0.5))]
    assert P.pasta_bias([(3, 5), (7, 8)], (0, 10), 0.5, "include") == [
        ((3, 5), math.log(0.5)), ((7, 8), math.log(0.5)), ((0, 10), -math.log(0.5))]
    assert P.pasta_bias([(3, 5), (7, 8)], (0, 10), 0.5, "generation") == [((0, 10), math.log(0.5))] * 2
    with pytest.raises(ValueError, match="scale_position"):
        P.pasta_bias([(3, 5)], (0, 10), 0.5, "everywhere")


def test_missing_emphasis_is_an_error_or_skipped():
    mh = tiny("headlab")
    exs = emphasis_examples(2) + [Example(prompt="Sara lives in Rome . Question: Where does Sara live? Answer:")]
    batch = tokenize(loaded(mh), exs)
    with pytest.raises(ValueError, match="no 'emphasis' span"):
        P.steer(P.Pasta(heads=[[0, 0]]), step_ctx(mh), batch, ins.Plan())
    plan = ins.Plan(probes=ins.Probes(pattern=True, layers=[0]))
    P.steer(P.Pasta(heads=[[0, 0]], missing="skip"), step_ctx(mh), batch, plan)
    with ins.instrument(mh, plan) as rec, torch.no_grad():
        mh(input_ids=batch.input_ids, attention_mask=batch.attention_mask)
    free = ins.Plan(probes=ins.Probes(pattern=True, layers=[0]))
    with ins.instrument(mh, free) as rec0, torch.no_grad():
        mh(input_ids=batch.input_ids, attention_mask=batch.attention_mask)
    assert torch.equal(rec.pattern[2], rec0.pattern[2])  # the unmarked row is untouched
    assert not torch.allclose(rec.pattern[0, 0, 0], rec0.pattern[0, 0, 0])


# --------------------------------------------------------------------------- scoring choices under PASTA
def reference_choice_scores(me, tok, pairs, heads, alpha, mode) -> list[float]:
    """Per (example, choice): an unpadded eager forward of ``prompt + choice`` steered by the naive hooks
    with the bias on the prompt's keys only (the choice's own keys unbiased, as generated keys are), and
    the sum of ``log p`` of the choice's tokens (those after ``len(tokenize(prompt))``)."""
    out = []
    for ex, choice in pairs:
        full = tok(ex.prompt + choice)["input_ids"]
        n_prompt = len(tok(ex.prompt)["input_ids"])
        bias = key_weights(tok, ex, 0, n_prompt, len(full), alpha, mode).log().float()[None]
        ids = torch.tensor([full])
        with eager_pasta(me, heads, bias), torch.no_grad():
            logp = me(input_ids=ids).logits[0].double().log_softmax(-1)
        out.append(sum(float(logp[n_prompt - 1 + i, t]) for i, t in enumerate(full[n_prompt:])))
    return out


@pytest.mark.parametrize("mode", ["exclude", "include"])
def test_scoring_steers_the_prompt_not_the_choice(mode):
    """PASTA in the ``score`` path (continuation rows, left-padded, multi-token choices) equals the naive
    reference that biases prompt keys only; biasing the choice's keys too (the old behaviour) differs."""
    from headlab.generation import ScoreRequest, continuation_batch
    from headlab.plugin_manager import get_manager
    from headlab.plugins.actions.common import steering_plan
    from headlab.plugins.decoding.greedy import Greedy

    tok = build_tokenizer()
    examples = emphasis_examples(3, seed=5) + [two_section_example()]
    choices = [" Paris", " Rome is old", " Oslo . Sara lives in Rome"]
    pairs = [(ex, c) for ex in examples for c in choices]
    mh, me = tiny("headlab"), tiny("eager")
    lm = loaded(mh)
    batch, n = continuation_batch(lm, pairs)
    assert len(set(batch.pad)) > 2 and max(n) > 3 and batch.continuation == n
    assert [batch.prompt_end(r) for r in range(batch.size)] == [batch.length - k for k in n]
    heads = [(0, 1), (1, 0), (1, 3)]
    alpha = 0.05
    cfg = P.Pasta(heads=[list(h) for h in heads], alpha=alpha, scale_position=mode)
    plan, _ = steering_plan([cfg], step_ctx(mh, examples), batch)
    request = ScoreRequest(lm, batch, n, [p[0] for p in pairs], [p[1] for p in pairs], plan)
    got = get_manager().get("decoders", "greedy").score(Greedy(), request).logprobs
    ref = reference_choice_scores(me, tok, pairs, heads, alpha, mode)
    assert got == pytest.approx(ref, abs=1e-4)
    # not vacuous: unsteered scores differ, and so do scores with the choice's keys biased as prompt
    plain = reference_choice_scores(me, tok, pairs, [], alpha, mode)
    assert max(abs(a - b) for a, b in zip(got, plain, strict=True)) > 1e-2
    old = ins.Plan()
    P.apply_pasta(old, heads, P.emphasis_sections(batch, "emphasis"), [(batch.pad[r], batch.length)
                  for r in range(batch.size)], alpha, mode)
    wrong = get_manager().get("decoders", "greedy").score(
        Greedy(), ScoreRequest(lm, batch, n, [p[0] for p in pairs], [p[1] for p in pairs], old)).logprobs
    multi = [r for r, k in enumerate(n) if k > 1]
    assert max(abs(wrong[r] - ref[r]) for r in multi) > 1e-2


# --------------------------------------------------------------------------- heads from every source
def test_spec_head_forms_are_equivalent(tmp_path):
    (tmp_path / "pasta.json").write_text(json.dumps({"0": [1, 3], "1": [0]}))
    (tmp_path / "layers.json").write_text(json.dumps([1]))
    gen = "max_new_tokens: 4, metrics: [exact_match]"
    steps = f"""  - id: none
    generate: {{{gen}}}
  - id: pairs
    generate: {{{gen}, steer: [{{kind: pasta, heads: [[0, 1], [0, 3], [1, 0]], alpha: 0.001}}]}}
  - id: mapping
    generate: {{{gen}, steer: [{{kind: pasta, heads: {{"0": [1, 3], "1": [0]}}, alpha: 0.001}}]}}
  - id: file
    generate: {{{gen}, steer: [{{kind: pasta, heads: {{file: {tmp_path / 'pasta.json'}}}, alpha: 0.001}}]}}
  - id: layer_list
    generate: {{{gen}, steer: [{{kind: pasta, heads: [1], alpha: 0.001}}]}}
  - id: layer_file
    generate: {{{gen}, steer: [{{kind: pasta, heads: {{file: {tmp_path / 'layers.json'}}}, alpha: 0.001}}]}}
  - id: layer_pairs
    generate: {{{gen}, steer: [{{kind: pasta, heads: [[1, 0], [1, 1], [1, 2], [1, 3]], alpha: 0.001}}]}}
"""
    res = run_spec(tmp_path, steps, n=4)
    out = {k: [str(x) for x in v["output"].values.ravel()] for k, v in res.items()}
    assert out["pairs"] == out["mapping"] == out["file"]
    assert out["layer_list"] == out["layer_file"] == out["layer_pairs"]
    assert out["pairs"] != out["none"] or out["layer_list"] != out["none"]
    assert res["pairs"].attrs["steer"] == ["pasta"]


def test_spec_runs_the_plugin_like_the_api(tmp_path):
    """A steered generate step of a spec == decode_loop with the plugin's plan built by hand."""
    steps = """  - id: steered
    generate: {max_new_tokens: 5, steer: [{kind: pasta, heads: [[0, 0], [1, 2]], alpha: 0.01}]}
"""
    res = run_spec(tmp_path, steps, n=3)
    from headlab.runner import ModelCache
    from headlab.spec import load_spec

    cfg = json.loads(res["steered"].attrs["config"])
    assert cfg["steer"][0]["kind"] == "pasta"
    # rebuild the same random model through the runner's loader and steer by hand
    loaded_spec = load_spec(_spec_text_for(tmp_path))
    lm = ModelCache(0).get(loaded_spec.spec.model)
    exs = build_emphasis(Emphasis(n=3), TaskContext(tokenizer=lm.tokenizer, seed=0, vocab_size=len(lm.tokenizer)))
    batch = tokenize(lm, exs)
    plan = ins.Plan()
    P.steer(P.Pasta(heads=[[0, 0], [1, 2]], alpha=0.01), StepContext(lm, exs, {}, 0), batch, plan)
    texts = decode_loop(DecodeRequest(lm, batch, 5, [], plan, 0), lambda o, _: o.logits[:, -1].argmax(-1)).texts
    assert [str(x) for x in res["steered"]["output"].values] == texts


def _spec_text_for(tmp_path) -> str:
    cfg = llama_config().to_dict()
    cfg = {k: cfg[k] for k in ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers",
                               "num_attention_heads", "num_key_value_heads", "vocab_size",
                               "max_position_embeddings", "initializer_range", "bos_token_id", "pad_token_id")}
    cfg["tokenizer"] = str(tmp_path / "tok")
    return (f"name: t\nmodel: {{config: {json.dumps(cfg)}}}\ntask: {{kind: emphasis, n: 3}}\n"
            "steps:\n  - id: x\n    generate: {max_new_tokens: 2}\n")


def test_spec_errors_are_clear(tmp_path):
    from headlab.spec import SpecError, load_spec

    with pytest.raises(SpecError, match="alpha"):
        load_spec(_spec_text_for(tmp_path).replace("generate: {max_new_tokens: 2}",
                                                   "generate: {steer: [{kind: pasta, heads: [0], alpha: 0}]}"))
    with pytest.raises(SpecError, match="scale_positon"):
        load_spec(_spec_text_for(tmp_path).replace(
            "generate: {max_new_tokens: 2}", "generate: {steer: [{kind: pasta, heads: [0], scale_positon: include}]}"))
