"""DoLa against an independent implementation of transformers' former ``_dola_decoding`` written here:
full recomputation per step on an eager-attention copy of the model (no KV cache), HF's candidate
buckets, ``_relative_top_filter`` (with its sort), ``_dola_select_contrast`` (batch-mean divergence) and
transformers' own ``RepetitionPenaltyLogitsProcessor``."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from headlab.plugins.decoding.dola import DoLa, candidate_layers, divergence, dola
from headlab.plugins.decoding.greedy import Greedy, greedy

from fixtures.decoding import (
    eager_twin,
    ids_of,
    one_thread,  # noqa: F401  (autouse)
    random_prompts,
    request_for,
    word_model,
)


# --------------------------------------------------------------------------- the reference (HF semantics)
def hf_candidates(final_layer: int, tied: bool, dola_layers) -> list[int]:
    if not tied:
        start_layer = 0
    elif final_layer > 2:
        start_layer = 2
    elif final_layer == 2:
        start_layer = 1
    else:
        start_layer = 0
    if dola_layers == "low":
        if start_layer == final_layer // 2:
            return [start_layer]
        return (list(range(start_layer, final_layer // 2, 2)) if final_layer <= 40
                else list(range(start_layer, 20, 2)))
    if dola_layers == "high":
        return (list(range(final_layer // 2, final_layer, 2)) if final_layer <= 40
                else list(range(final_layer - 20, final_layer, 2)))
    return [i for i in dola_layers if i < final_layer]


def hf_relative_top_filter(scores, baseline_scores, relative_top=0.1, filter_value=-float("Inf"),
                           base_filter_value=-1e-3, min_tokens_to_keep=1):
    scores_normalized = scores.log_softmax(dim=-1)
    baseline_scores_normalized = baseline_scores.log_softmax(dim=-1)
    sorted_logits, _ = torch.sort(scores_normalized, descending=True)
    min_thresh = sorted_logits[..., min_tokens_to_keep - 1]
    probs_max = torch.max(scores_normalized, dim=-1).values
    with np.errstate(divide="ignore"):
        probs_thresh = probs_max + np.log(relative_top)
    probs_thresh = torch.min(min_thresh, probs_thresh).unsqueeze(-1)
    baseline_scores_normalized[scores_normalized < probs_thresh] = base_filter_value
    scores_normalized[scores_normalized < probs_thresh] = filter_value
    return scores_normalized, baseline_scores_normalized


def hf_select_contrast(layers, premature, final_logits, relative_top, chosen, textbook=False):
    if len(layers) == 1:
        base_logits = premature[layers[0]]
        chosen.append(layers[0])
    else:
        stacked = torch.stack([premature[i] for i in layers], dim=0)
        softmax_mature = F.softmax(final_logits, dim=-1)
        softmax_premature = F.softmax(stacked, dim=-1)
        avg_dist = 0.5 * (softmax_mature[None, :, :] + softmax_premature)
        log_softmax_mature = F.log_softmax(final_logits, dim=-1)
        log_softmax_premature = F.log_softmax(stacked, dim=-1)
        kl1 = F.kl_div(log_softmax_mature[None, :, :], avg_dist, reduction="none").mean(-1)
        kl2 = F.kl_div(log_softmax_premature, avg_dist, reduction="none").mean(-1)
        js_divs = (0.5 * (kl1 + kl2)).mean(-1)
        if textbook:  # 0.5 * (KL(p||M) + KL(q||M)), summed over the vocabulary, then the batch mean
            log_m = avg_dist.log()
            js_divs = 0.5 * ((softmax_mature[None] * (log_softmax_mature[None] - log_m)).sum(-1)
                             + (softmax_premature * (log_softmax_premature - log_m)).sum(-1)).mean(-1)
        layer = layers[int(js_divs.argmax().item())]
        chosen.append(layer)
        base_logits = premature[layer]
    final_logits, base_logits = hf_relative_top_filter(final_logits, base_logits, relative_top)
    return final_logits - base_logits


def reference_dola(twin, ids: torch.Tensor, max_new: int, dola_layers, *, penalty: float = 1.2,
                   relative_top: float = 0.1, norm: bool = False, eos: int = 2, pad: int = 0,
                   textbook: bool = False):
    """HF ``_dola_decoding`` semantics on an unpadded batch, recomputing the whole sequence every step."""
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    lm_head = twin.get_output_embeddings()
    layers = hf_candidates(twin.config.num_hidden_layers, twin.config.tie_word_embeddings, dola_layers)
    processor = RepetitionPenaltyLogitsProcessor(penalty)
    seq, unfinished, chosen = ids, torch.ones(ids.shape[0], dtype=torch.long), []
    with torch.no_grad():
        for _ in range(max_new):
            out = twin(input_ids=seq, output_hidden_states=True)
            final = out.logits[:, -1, :].float()
            premature = {}
            for j in layers:
                h = out.hidden_states[j][:, -1, :]
                premature[j] = lm_head(twin.model.norm(h) if norm else h).float()
            logits = hf_select_contrast(layers, premature, final, relative_top, chosen, textbook)
            scores = processor(seq, logits)
            nxt = torch.argmax(scores, dim=-1)
            nxt = nxt * unfinished + pad * (1 - unfinished)
            seq = torch.cat([seq, nxt[:, None]], dim=1)
            unfinished = unfinished & (nxt != eos).long()
            if unfinished.max() == 0:
                break
    rows = []
    for r in seq[:, ids.shape[1]:].tolist():
        rows.append(r[: r.index(eos)] if eos in r else r)
    return rows, chosen


# --------------------------------------------------------------------------- tests
@pytest.mark.parametrize("N", [1, 2, 3, 4, 8, 12, 40, 41, 48, 80])
@pytest.mark.parametrize("tied", [False, True])
def test_candidate_buckets_follow_hf(N, tied):
    for layers in ("low", "high", [0, 1, 5, 39, 47, 100]):
        expect = hf_candidates(N, tied, layers)
        if not expect:
            with pytest.raises(ValueError):
                candidate_layers(N, tied, layers)
        else:
            assert candidate_layers(N, tied, layers) == expect


def test_candidate_start_rule():
    assert candidate_layers(8, False, "low") == [0, 2]
    assert candidate_layers(8, True, "low") == [2]
    assert candidate_layers(2, True, "low") == [1] and candidate_layers(2, False, "low") == [0]
    assert candidate_layers(48, True, "low") == list(range(2, 20, 2))
    assert candidate_layers(48, False, "high") == list(range(28, 48, 2))


def test_divergences_against_explicit_sums():
    from scipy.spatial.distance import jensenshannon

    g = torch.Generator().manual_seed(0)
    final, prem = torch.randn(3, 11, generator=g, dtype=torch.float64), torch.randn(2, 3, 11, generator=g,
                                                                                   dtype=torch.float64)
    p = final.softmax(-1)
    for j in range(2):
        for b in range(3):
            q = prem[j, b].softmax(-1)
            m = 0.5 * (p[b] + q)
            ref = 0.5 * (np.mean((m * (m.log() - p[b].log())).numpy()) + np.mean((m * (m.log() - q.log())).numpy()))
            assert divergence(final, prem, "reference")[j, b].item() == pytest.approx(ref, rel=1e-5)
            js = jensenshannon(p[b].numpy(), q.numpy()) ** 2
            assert divergence(final, prem, "jsd")[j, b].item() == pytest.approx(js, rel=1e-5)


CASES = [  # (layers, tied, dola_layers): tied and untied embeddings, every bucket rule
    (8, False, "low"), (8, False, "high"), (8, True, "low"), (8, True, "high"), (8, False, [0, 1, 3, 5, 9]),
    (4, True, "low"), (2, True, "low"), (3, False, "high"),
]


@pytest.mark.parametrize("n_layers,tied,which", CASES)
def test_dola_equals_hf_reference_token_for_token(n_layers, tied, which):
    lm = word_model(n_layers, tied, seed=n_layers + tied)
    twin = eager_twin(lm)
    prompts = random_prompts(3, seed=n_layers * 7 + tied)
    cfg = DoLa(layers=which)
    batched = dola(cfg, request_for(lm, prompts, max_new=10))
    differs = False
    for i, prompt in enumerate(prompts):
        (ref,), chosen = reference_dola(twin, ids_of(lm, prompt), 10, which)
        alone = dola(cfg, request_for(lm, [prompt], max_new=10))
        assert alone.tokens[0] == ref, (prompt, alone.tokens[0], ref)
        assert batched.tokens[i] == ref  # left-padded batch == batch of one
        assert [c[0] for c in alone.info["premature_layer"]][: len(chosen)] == chosen[: len(alone.info["premature_layer"])]
        differs |= greedy(Greedy(), request_for(lm, [prompt], max_new=10)).tokens[0] != ref
    assert differs  # the contrast changes the output: the comparison is not vacuous


def test_dola_options_final_norm_relative_top_penalty():
    lm = word_model(8, False, seed=11)
    twin = eager_twin(lm)
    prompt = random_prompts(1, seed=5)[0]
    for kw, ref_kw in (({"final_norm": True}, {"norm": True}),
                       ({"relative_top": 0.3, "repetition_penalty": 1.0}, {"relative_top": 0.3, "penalty": 1.0}),
                       ({"relative_top": 0.0, "repetition_penalty": 2.0}, {"relative_top": 0.0, "penalty": 2.0})):
        ours = dola(DoLa(layers=[0, 2, 4, 6], **kw), request_for(lm, [prompt], max_new=10)).tokens[0]
        (ref,), _ = reference_dola(twin, ids_of(lm, prompt), 10, [0, 2, 4, 6], **ref_kw)
        assert ours == ref, kw


def test_batch_shared_layer_choice_equals_reference_batch():
    lm = word_model(8, False, seed=4)
    twin = eager_twin(lm)
    prompts = [p for p in random_prompts(40, seed=9) if len(p.split()) == 6][:4]
    assert len(prompts) == 4  # same length: the reference batch has no padding
    cfg = DoLa(layers="high", layer_choice="batch")
    ours = dola(cfg, request_for(lm, prompts, max_new=8))
    ids = torch.cat([ids_of(lm, p) for p in prompts])
    ref, chosen = reference_dola(twin, ids, 8, "high")
    assert ours.tokens == ref
    assert [c[0] for c in ours.info["premature_layer"]] == chosen[: len(ours.info["premature_layer"])]
    assert all(len(set(c)) == 1 for c in ours.info["premature_layer"])  # one layer for the whole batch
    per_row = dola(DoLa(layers="high"), request_for(lm, prompts, max_new=8)).info["premature_layer"]
    assert any(len(set(c)) > 1 for c in per_row)  # per-row choice really differs between rows here


def test_dola_textbook_jsd_option():
    lm = word_model(8, False, seed=4)
    twin = eager_twin(lm)
    layers = [0, 1, 2, 3, 4, 5, 6, 7]
    seen_difference = False
    for prompt in random_prompts(3, seed=12):
        jsd = dola(DoLa(layers=layers, divergence="jsd"), request_for(lm, [prompt], max_new=8))
        (ref,), chosen = reference_dola(twin, ids_of(lm, prompt), 8, layers, textbook=True)
        assert jsd.tokens[0] == ref
        assert [c[0] for c in jsd.info["premature_layer"]] == chosen[: len(jsd.info["premature_layer"])]
        default = dola(DoLa(layers=layers), request_for(lm, [prompt], max_new=8)).info["premature_layer"]
        seen_difference |= default != jsd.info["premature_layer"]
    assert seen_difference  # the two divergences pick different layers somewhere


def test_dola_with_steering_plan_composes():
    from headlab.instrument import Plan

    lm = word_model(8, False, seed=2)
    prompts = random_prompts(2, seed=13)
    base = dola(DoLa(), request_for(lm, prompts, max_new=8))
    plan = Plan().mask_heads([(layer, None) for layer in range(8)], mode="output")
    steered = dola(DoLa(), request_for(lm, prompts, max_new=8, plan=plan))
    assert steered.tokens != base.tokens
