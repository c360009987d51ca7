"""attention_sink (docs/methods.md#attention-sinks-and-massive-activations) against an eager computation: a
separately built copy of the model with attn_implementation="eager" and output_attentions / output_hidden_states,
one unpadded example at a time; the detector runs the examples as one left-padded batch."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from headlab import Example, StepContext
from headlab.plugins.detectors.attention_sink import AttentionSink, detect

from fixtures.circuits import ARCHS, POST_NORM_ARCHS, models

PROMPTS = ["ant bee cat dog eel", "fox gnu hen ibis jay ant bee cat dog eel fox gnu", "cat . cat ?",
           "dog dog dog dog dog dog dog"]


def reference(model, arch: str, ids: list[int], threshold: float):
    """(sink score (layer, head), per layer max|h| / median|h|, per layer entries above threshold x median)."""
    norm = model.transformer.ln_f if arch == "gpt2" else model.model.norm
    last: list[torch.Tensor] = []
    hook = norm.register_forward_pre_hook(lambda m, args: last.append(args[0][0].detach()))
    try:
        with torch.no_grad():
            out = model(input_ids=torch.tensor([ids]), output_attentions=True, output_hidden_states=True)
    finally:
        hook.remove()
    sink = np.stack([a[0, :, 1:, 0].double().mean(-1).numpy() for a in out.attentions])
    # hidden_states[l + 1] is layer l's output, except the last entry, which is after the final norm
    states = [h[0] for h in out.hidden_states[1:-1]] + [last[0]]
    ratio, count = [], []
    for h in states:
        a = h.abs().double().flatten()
        med = float(np.median(a.numpy()))
        ratio.append(float(a.max()) / med)
        count.append(int((a > threshold * med).sum()))
    return sink, np.array(ratio), np.array(count)


@pytest.mark.parametrize("arch", ARCHS + POST_NORM_ARCHS)
def test_sink_scores_and_massive_activations_equal_the_eager_computation(arch):
    tok, lm, m = models(arch)
    examples = [Example(prompt=p) for p in PROMPTS]
    threshold = 3.0
    refs = [reference(m["eager"], arch, tok(p).input_ids, threshold) for p in PROMPTS]
    sink = np.stack([r[0] for r in refs])
    epsilon = float(np.median(sink.mean(0)))  # about half the heads above it
    ctx = StepContext(model=lm, examples=examples, results={}, seed=0)
    ds = detect(AttentionSink(batch_size=4, epsilon=epsilon, massive_threshold=threshold), ctx)
    np.testing.assert_allclose(ds["example_score"].values, sink, atol=1e-5)
    np.testing.assert_allclose(ds["score"].values, sink.mean(0), atol=1e-5)
    assert ds.attrs["sink_rate"] == pytest.approx(float((sink.mean(0) > epsilon).mean()))
    assert 0 < ds.attrs["sink_rate"] < 1
    np.testing.assert_allclose(ds["massive_ratio"].values, np.max([r[1] for r in refs], axis=0), rtol=1e-5)
    np.testing.assert_allclose(ds["massive_count"].values, np.mean([r[2] for r in refs], axis=0))
    assert ds["massive_ratio"].dims == ("layer",) and ds["score"].dims == ("layer", "head")
    assert ds.attrs["reference"] == "docs/methods.md#attention-sinks-and-massive-activations"


def test_a_prompt_of_one_token_is_refused():
    tok, lm, _ = models("llama")
    ctx = StepContext(model=lm, examples=[Example(prompt="ant bee"), Example(prompt="")], results={}, seed=0)
    with pytest.raises(ValueError, match="row 1 has a single token"):
        detect(AttentionSink(), ctx)
