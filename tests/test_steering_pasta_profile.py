"""pasta_profile (plugins/steering/pasta_profile.py): batched one-head-at-a-time PASTA profiling.

Independent references: per (head, example), unbatched and unpadded, an eager model with the naive PASTA
pre-hook on that single head gives log p(target | prompt) by hand, and transformers' ``generate`` gives
the outputs scored by the metric; the ranking and the intersection of the top-k are recomputed here from
the gains with plain Python sets.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from headlab.context import TaskContext
from headlab.heads import read_heads_file
from headlab.plugins.steering import pasta_profile as PP
from headlab.plugins.tasks.synthetic_tasks import Emphasis, build_emphasis

from fixtures.steering import (
    build_tokenizer,
    eager_pasta,
    key_weights,
    run_spec,
    step_ctx,
    tiny,
)

TASKS = [{"kind": "emphasis", "n": 3, "seed": 0}, {"kind": "emphasis", "n": 3, "seed": 9, "filler_sentences": [1, 2]}]


def task_examples(t):
    tok = build_tokenizer()
    cfg = Emphasis.model_validate(t)
    return build_emphasis(cfg, TaskContext(tokenizer=tok, seed=0, vocab_size=len(tok)))


def eager_logprob(me, ex, head, alpha, mode="exclude") -> float:
    tok = build_tokenizer()
    p = tok(ex.prompt)["input_ids"]
    full = tok(ex.prompt + ex.target)["input_ids"]
    assert full[: len(p)] == p
    ids = torch.tensor([full])
    heads = [] if head is None else [head]
    bias = key_weights(tok, ex, 0, len(p), len(p), alpha, mode).log().float()[None]
    with eager_pasta(me, heads, bias), torch.no_grad():
        logp = torch.log_softmax(me(input_ids=ids).logits.double(), -1)[0]
    return float(sum(logp[i - 1, full[i]] for i in range(len(p), len(full))))


def test_profile_matches_unbatched_eager_and_intersections():
    mh, me = tiny("headlab"), tiny("eager")
    cfg = PP.PastaProfile(tasks=TASKS, alpha=0.01, top_k=4, batch_size=7)  # odd size: chunks split examples
    ds = PP.profile(cfg, step_ctx(mh))
    assert list(ds["task"].values) == ["0-emphasis", "1-emphasis"]
    for t, task in enumerate(TASKS):
        exs = task_examples(task)
        base = np.mean([eager_logprob(me, ex, None, 0.01) for ex in exs])
        assert ds["baseline"].values[t] == pytest.approx(base, abs=2e-4)
        for layer in range(2):
            for h in range(4):
                want = np.mean([eager_logprob(me, ex, (layer, h), 0.01) for ex in exs])
                assert ds["steered"].values[t, layer, h] == pytest.approx(want, abs=2e-4), (t, layer, h)
    gain = ds["gain"].values
    heads = [(ly, h) for ly in range(2) for h in range(4)]
    C = len(heads)
    tops = [[hh for hh in sorted(heads, key=lambda x, t=t: (-gain[t][x], x))] for t in range(2)]
    for k in range(1, C + 1):
        inter = set(tops[0][:k]) & set(tops[1][:k])
        by_score = {hh for hh in heads if ds["score"].values[hh] > 1 - k / C}
        assert by_score == inter, k
    selected = {hh for hh in heads if bool(ds["selected"].values[hh])}
    assert selected == set(tops[0][:4]) & set(tops[1][:4])
    assert json.loads(ds.attrs["pasta_heads"]) == {str(ly): [h for l2, h in sorted(selected) if l2 == ly]
                                                    for ly in sorted({ly for ly, _ in selected})}


def test_generation_metric_matches_hf_generate():
    """The step's own examples (tasks: []); targets are the unsteered model's first generated word, so the
    metric is 1 without steering and changes when a head's steering changes the output."""
    mh, me = tiny("headlab"), tiny("eager")
    tok = build_tokenizer()
    exs = task_examples({"kind": "emphasis", "n": 4, "seed": 2})
    for ex in exs:
        p = tok(ex.prompt)["input_ids"]
        with torch.no_grad():
            out = me.generate(input_ids=torch.tensor([p]), max_new_tokens=1, do_sample=False, pad_token_id=0)
        ex.target = " " + tok.decode(out[0, len(p):], skip_special_tokens=True)
    cands = [[0, 0], [0, 1], [0, 2], [0, 3], [1, 2]]
    cfg = PP.PastaProfile(metric="contains", max_new_tokens=3, heads=cands, alpha=0.001, batch_size=6)
    ds = PP.profile(cfg, step_ctx(mh, exs))
    from headlab.plugins.metrics.text import normalize

    def run(head):
        vals = []
        for ex in exs:
            p = tok(ex.prompt)["input_ids"]
            bias = key_weights(tok, ex, 0, len(p), len(p), 0.001, "exclude").log().float()[None]
            with eager_pasta(me, [] if head is None else [head], bias), torch.no_grad():
                out = me.generate(input_ids=torch.tensor([p]), max_new_tokens=3, do_sample=False, pad_token_id=0)
            text = tok.decode(out[0, len(p):], skip_special_tokens=True)
            vals.append(float(normalize(ex.target) in normalize(text)))
        return np.mean(vals)

    assert ds["baseline"].values[0] == pytest.approx(run(None)) == 1.0
    for layer, h in cands:
        assert ds["steered"].values[0, layer, h] == pytest.approx(run((layer, h)))
    assert np.nanmin(ds["steered"].values[0]) < 1.0  # some head's steering changes an output
    assert np.isnan(ds["score"].values[1, 0]) and not np.isnan(ds["score"].values[0, 0])  # (1, 0): not a candidate


def test_profile_in_a_spec_feeds_pasta_and_writes_the_json(tmp_path):
    out_json = tmp_path / "heads" / "pasta.json"
    steps = f"""  - id: profile
    detect: {{kind: pasta_profile, n_examples: 2, top_k: 3, write: {out_json},
              tasks: [{{kind: emphasis, n: 2}}, {{kind: emphasis, n: 2, seed: 4}}]}}
  - id: from_profile
    generate: {{max_new_tokens: 3, steer: [{{kind: pasta, heads: {{from: profile, top: 3}}}}]}}
  - id: from_file
    generate: {{max_new_tokens: 3, steer: [{{kind: pasta, heads: {{file: {out_json}}}}}]}}
"""
    res = run_spec(tmp_path, steps, n=3)
    prof = res["profile"]
    selected = sorted((int(ly), int(h)) for ly, h in zip(*np.nonzero(prof["selected"].values), strict=True))
    assert read_heads_file(out_json) == selected
    from headlab.heads import ranked

    top3 = [hh for hh, _ in ranked(prof["score"])[:3]]
    assert set(selected) <= set(top3) or len(selected) > 3
    # explicit heads == {from: profile, top: 3}
    pairs = json.dumps([list(hh) for hh in top3])
    res2 = run_spec(tmp_path, f"""  - id: explicit
    generate: {{max_new_tokens: 3, steer: [{{kind: pasta, heads: {pairs}}}]}}
""", n=3)
    assert list(res2["explicit"]["output"].values) == list(res["from_profile"]["output"].values)
    if len(selected) == 3:
        assert list(res["from_file"]["output"].values) == list(res["from_profile"]["output"].values)


def test_profile_config_errors():
    with pytest.raises(ValueError, match="unknown task kind 'emphasiz'"):
        PP.PastaProfile(tasks=[{"kind": "emphasiz"}])
    with pytest.raises(ValueError, match="n_examples"):
        PP.PastaProfile(tasks=[{"kind": "emphasis", "n_examples": 3}])
    mh = tiny("headlab")
    from headlab.plugin_manager import PluginError

    with pytest.raises(PluginError, match="no metrics plugin provides kind 'acc'"):
        PP.profile(PP.PastaProfile(tasks=TASKS[:1], metric="acc"), step_ctx(mh))
