"""successor and copy_suppression (docs/methods.md#ov-circuits) against an explicit dense computation: the full
vocabulary x vocabulary OV matrix of every head, written out from the modules' own projection weights (the
value rows of the head's key/value head, its slice of the output projection), the input norm's and the final
norm's weights (LayerNorm: centred; gemma2 and olmo2: also the attention output's norm) and the unembedding,
in float64; the detectors compute it in blocks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from headlab import Example, StepContext
from headlab.plugins.detectors.copy_suppression import CopySuppression, ov_rank_scores
from headlab.plugins.detectors.copy_suppression import detect as detect_copy
from headlab.plugins.detectors.successor import Successor
from headlab.plugins.detectors.successor import detect as detect_successor

from fixtures.circuits import ARCHS, POST_NORM_ARCHS, config, gain, randomise_norms
from fixtures.detectors import SPECIALS, build_models, word_tokenizer

SEQ_WORDS = ("one two three four five six Monday Tuesday Wednesday Friday Saturday Sunday B C D E F G "
             "ant bee cat dog eel fox").split()


def dense_ov(model, arch: str, layer: int, n_heads: int, n_kv: int) -> torch.Tensor:
    """(head, vocab, vocab) OV circuits, float64."""
    base = model.transformer if arch == "gpt2" else model.model
    block = (base.h if arch == "gpt2" else base.layers)[layer]
    W_E = base.wte.weight.detach().double() if arch == "gpt2" else base.embed_tokens.weight.detach().double()
    d = W_E.shape[1]
    D = d // n_heads
    if arch == "gpt2":
        x = (W_E - W_E.mean(-1, keepdim=True)) * block.ln_1.weight.detach().double()
        W = block.attn.c_attn.weight.detach().double()  # Conv1D (in, out): columns q | k | v
        W_V = [W[:, 2 * d + h * D: 2 * d + (h + 1) * D] for h in range(n_heads)]
        W_O = [block.attn.c_proj.weight.detach().double()[h * D:(h + 1) * D] for h in range(n_heads)]
        g = base.ln_f.weight.detach().double()
    else:
        x = W_E if arch == "olmo2" else W_E * gain(block.input_layernorm)  # olmo2: no norm before attention
        v = block.self_attn.v_proj.weight.detach().double()  # (kv * D, d)
        D = block.self_attn.o_proj.weight.shape[1] // n_heads
        group = n_heads // n_kv
        W_V = [v[(h // group) * D:(h // group + 1) * D].T for h in range(n_heads)]
        W_O = [block.self_attn.o_proj.weight.detach().double()[:, h * D:(h + 1) * D].T for h in range(n_heads)]
        if arch in POST_NORM_ARCHS:  # the attention output's own norm
            W_O = [w * gain(block.post_attention_layernorm) for w in W_O]
        g = gain(base.norm)
    W_U = model.lm_head.weight.detach().double().T
    out = []
    for h in range(n_heads):
        y = x @ W_V[h] @ W_O[h]
        if arch == "gpt2":
            y = y - y.mean(-1, keepdim=True)
        out.append((y * g) @ W_U)
    return torch.stack(out)


def setup(arch: str):
    tok = word_tokenizer(SEQ_WORDS)
    lm, m = build_models(config(arch, len(tok)), seed=3, tokenizer=tok)
    randomise_norms(m, seed=3)
    cfg = m["eager"].config
    n_heads = cfg.n_head if arch == "gpt2" else cfg.num_attention_heads
    n_kv = n_heads if arch == "gpt2" else cfg.num_key_value_heads
    ov = [dense_ov(m["eager"], arch, layer, n_heads, n_kv) for layer in range(lm.geometry.n_layers)]
    return tok, lm, ov


@pytest.mark.parametrize("arch", ARCHS + POST_NORM_ARCHS)
def test_copying_and_suppression_scores_equal_the_dense_top_and_bottom_k(arch):
    tok, lm, ov = setup(arch)
    k = 3
    tokens = torch.tensor([t for t in range(len(tok)) if t >= len(SPECIALS)])  # every non-special token
    ctx = StepContext(model=lm, examples=[Example(prompt="ant")], results={}, seed=0)
    ds = detect_copy(CopySuppression(k=k, tokens=10_000, block=7, row_block=5, precision="float64"), ctx)
    top = np.zeros((len(ov), ov[0].shape[0]))
    bottom = np.zeros_like(top)
    for layer, circuits in enumerate(ov):
        for h, m in enumerate(circuits):
            rows = m[tokens]
            top[layer, h] = np.mean([int(t) in rows[i].topk(k).indices.tolist() for i, t in enumerate(tokens)])
            bottom[layer, h] = np.mean([int(t) in rows[i].topk(k, largest=False).indices.tolist()
                                        for i, t in enumerate(tokens)])
    np.testing.assert_allclose(ds["copying"].values, top)
    np.testing.assert_allclose(ds["score"].values, bottom)
    assert ds.attrs["n_tokens"] == len(tokens) and ds.attrs["k"] == k
    assert len(np.unique(bottom)) > 1  # the heads differ: the comparison is not between constants


def test_a_token_sample_is_seeded_and_scored_on_its_tokens():
    tok, lm, ov = setup("llama")
    tokens = torch.tensor([5, 9, 12, 20])
    top, bottom = ov_rank_scores(lm, tokens, 2, block=4, row_block=3, precision="float64")
    for layer, circuits in enumerate(ov):
        for h, m in enumerate(circuits):
            assert top[layer, h] == np.mean([int(t) in m[t].topk(2).indices.tolist() for t in tokens])
    ctx = StepContext(model=lm, examples=[Example(prompt="ant")], results={}, seed=4)
    a = detect_copy(CopySuppression(tokens=6), ctx)
    b = detect_copy(CopySuppression(tokens=6), ctx)
    assert a.attrs["n_tokens"] == 6
    np.testing.assert_array_equal(a["score"].values, b["score"].values)


SEQUENCES = {"numbers": ["one", "two", "three", "four", "five", "six"],
             "days": ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"],
             "letters": ["A", "B", "C", "D E", "E", "F", "G"]}


@pytest.mark.parametrize("arch", ARCHS + POST_NORM_ARCHS)
def test_succession_scores_equal_the_dense_argmax_over_each_sequence(arch):
    tok, lm, ov = setup(arch)
    ctx = StepContext(model=lm, examples=[Example(prompt="ant")], results={}, seed=0)
    ds = detect_successor(Successor(sequences=SEQUENCES, precision="float64"), ctx)
    known = {w: tok.convert_tokens_to_ids(w) for items in SEQUENCES.values() for w in items
             if " " not in w and tok.convert_tokens_to_ids(w) != tok.unk_token_id}
    ids = {name: [known.get(w) for w in items] for name, items in SEQUENCES.items()}
    hits = np.zeros((len(ov), ov[0].shape[0]))
    scored = 0
    for seq in ids.values():
        kept = [t for t in seq if t is not None]
        for a, b in zip(seq, seq[1:], strict=False):
            if a is None or b is None:
                continue
            scored += 1
            for layer, circuits in enumerate(ov):
                for h, m in enumerate(circuits):
                    hits[layer, h] += kept[int(m[a, kept].argmax())] == b
    # Thursday is unknown to the tokenizer, "D E" two tokens: both skipped, and the items before them unscored
    assert ds.attrs["items_skipped"] == 2 and ds.attrs["skipped"] == "days:Thursday, letters:D E"
    assert ds.attrs["items_scored"] == scored == 5 + 4 + 4
    np.testing.assert_allclose(ds["score"].values, hits / scored)
    assert len(np.unique(hits)) > 1


def test_no_scorable_item_is_an_error():
    tok, lm, _ = setup("llama")
    ctx = StepContext(model=lm, examples=[Example(prompt="ant")], results={}, seed=0)
    with pytest.raises(ValueError, match="successor: no item of any sequence.*skipped: x:zebra, x:yak"):
        detect_successor(Successor(sequences={"x": ["zebra", "yak"]}), ctx)


@pytest.mark.parametrize("arch", ARCHS + POST_NORM_ARCHS)
def test_the_eigen_copying_score_equals_the_dense_eigenvalues_of_the_vocabulary_square_circuit(arch):
    """``copying: eigen``: Re(sum lambda) / sum |lambda| over the eigenvalues of the whole vocabulary x
    vocabulary OV matrix (its zero eigenvalues add nothing), from ``torch.linalg.eigvals`` of the dense matrix."""
    tok, lm, ov = setup(arch)
    ctx = StepContext(model=lm, examples=[Example(prompt="ant")], results={}, seed=0)
    ds = detect_copy(CopySuppression(copying="eigen", tokens=8, block=7, precision="float64"), ctx)
    want = np.zeros((len(ov), ov[0].shape[0]))
    for layer, circuits in enumerate(ov):
        for h, m in enumerate(circuits):
            eig = torch.linalg.eigvals(m)
            want[layer, h] = float(eig.real.sum() / eig.abs().sum())
    assert ov[0].shape[-1] == len(tok) > 2 * lm.geometry.head_dim  # a vocabulary wider than the heads
    np.testing.assert_allclose(ds["copying"].values, want, atol=1e-6)
    assert ds.attrs["copying"] == "eigen" and np.ptp(want) > 0.1  # the heads differ
    top_k = detect_copy(CopySuppression(tokens=8, block=7, precision="float64"), ctx)
    np.testing.assert_array_equal(top_k["score"].values, ds["score"].values)  # the suppression score is unchanged
