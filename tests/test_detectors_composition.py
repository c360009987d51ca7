"""composition (docs/methods.md#composition-scores) against the dense formula written out here from the
modules' own weights in float64: every head's d_model x d_model OV and QK matrices (a query head reads the
key and value rows of its key/value head), the input norm's gain folded into the reading weights (LayerNorm:
reading and writing weights centred; gemma2 and olmo2: the attention output norm's gain in W_O; olmo2: the
query and key norms' gains), then ``||OV_s M||_F / (||OV_s||_F ||M||_F)`` for M = QK, QK^T, OV of every later
head; and on a two-layer attention-only GPT-2 whose weights are set here to make head (0, 0) a previous-token
head and head (1, 0) an induction head reading it through its keys."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from headlab import Example, StepContext
from headlab.plugins.detectors.composition import Composition, detect, random_baseline

from fixtures.circuits import ARCHS, POST_NORM_ARCHS, config, gain, randomise_norms
from fixtures.detectors import build_models, word_tokenizer


def dense_heads(model, arch: str, layer: int, H: int, K: int) -> tuple[list, list, list, list]:
    """Per query head, the folded W_Q, W_K, W_V (d, D) and W_O (D, d), float64, from the modules."""
    if arch == "gpt2":
        block = model.transformer.h[layer]
        W = block.attn.c_attn.weight.detach().double()  # Conv1D (in, out): columns q | k | v
        d = W.shape[0]
        D = d // H
        g = block.ln_1.weight.detach().double()[:, None]
        centre = lambda w: w - w.mean(0, keepdim=True)  # noqa: E731
        Q = [centre(g * W[:, h * D:(h + 1) * D]) for h in range(H)]
        Kw = [centre(g * W[:, d + h * D: d + (h + 1) * D]) for h in range(H)]
        V = [centre(g * W[:, 2 * d + h * D: 2 * d + (h + 1) * D]) for h in range(H)]
        W_out = block.attn.c_proj.weight.detach().double()  # (in = H * D, out = d)
        Wo = [W_out[h * D:(h + 1) * D] - W_out[h * D:(h + 1) * D].mean(1, keepdim=True) for h in range(H)]
        return Q, Kw, V, Wo
    block = model.model.layers[layer]
    attn = block.self_attn
    q, k, v = (p.weight.detach().double() for p in (attn.q_proj, attn.k_proj, attn.v_proj))
    o = attn.o_proj.weight.detach().double()  # (d, H * D)
    D = o.shape[1] // H
    group = H // K
    if arch == "olmo2":  # no input norm; query and key norms over all heads' projections
        q = q * gain(attn.q_norm)[:, None]
        k = k * gain(attn.k_norm)[:, None]
    else:
        g = gain(block.input_layernorm)[None, :]
        q, k, v = q * g, k * g, v * g
    Q = [q[h * D:(h + 1) * D].T for h in range(H)]
    Kw = [k[(h // group) * D:(h // group + 1) * D].T for h in range(H)]
    V = [v[(h // group) * D:(h // group + 1) * D].T for h in range(H)]
    Wo = [o[:, h * D:(h + 1) * D].T for h in range(H)]
    if arch in POST_NORM_ARCHS:
        Wo = [w * gain(block.post_attention_layernorm)[None, :] for w in Wo]
    return Q, Kw, V, Wo


def dense_scores(model, arch: str, L: int, H: int, K: int) -> np.ndarray:
    heads = [dense_heads(model, arch, layer, H, K) for layer in range(L)]
    fro = torch.linalg.matrix_norm
    out = np.zeros((3, L, H, L, H))
    for s in range(L):
        for j in range(H):
            Qs, Ks, Vs, Os = heads[s]
            ov_s = Vs[j] @ Os[j]
            for layer in range(s + 1, L):
                Q, Kw, V, Wo = heads[layer]
                for h in range(H):
                    for m, right in enumerate((Q[h] @ Kw[h].T, Kw[h] @ Q[h].T, V[h] @ Wo[h])):
                        out[m, s, j, layer, h] = float(fro(ov_s @ right) / (fro(ov_s) * fro(right)))
    return out


def setup(arch: str, layers: int = 3):
    tok = word_tokenizer()
    cfg = config(arch, len(tok))
    cfg["n_layer" if arch == "gpt2" else "num_hidden_layers"] = layers
    lm, models = build_models(cfg, seed=5, tokenizer=tok, impls=("headlab",))
    randomise_norms(models, seed=5)
    return lm, models["headlab"]


@pytest.mark.parametrize("arch", ARCHS + POST_NORM_ARCHS)
def test_composition_equals_the_dense_formula(arch):
    lm, model = setup(arch)
    geo = lm.geometry
    assert arch == "gpt2" or geo.n_kv_heads < geo.n_heads  # grouped-query attention
    ctx = StepContext(model=lm, examples=[Example(prompt="ant")], results={}, seed=0)
    ds = detect(Composition(precision="float64", baseline_samples=20), ctx)
    want = dense_scores(model, arch, geo.n_layers, geo.n_heads, geo.n_kv_heads)
    for m, name in enumerate(("q_comp", "k_comp", "v_comp")):
        assert ds[name].dims == ("src_layer", "src_head", "layer", "head")
        np.testing.assert_allclose(ds[name].values, want[m], rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(ds["score"].values, want.max(axis=(0, 1, 2)), rtol=1e-6)
    assert (ds["score"].sel(layer=0) == 0).all() and (ds["score"].sel(layer=slice(1, None)) > 0).all()
    assert len(np.unique(np.round(want[1][0, :, 1], 6))) > 1  # the heads differ
    float32 = detect(Composition(baseline_samples=20), ctx)
    np.testing.assert_allclose(float32["k_comp"].values, want[1], rtol=1e-4, atol=1e-6)


def test_the_baseline_is_the_ratio_of_seeded_random_matrices():
    d, e, n = 24, 4, 50
    got = random_baseline(d, e, n, seed=7, precision="float64", chunk=7)
    gen = torch.Generator().manual_seed(7)
    want = []
    for start in range(0, n, 7):
        c = min(7, n - start)
        a1, a2 = (torch.randn(c, d, e, generator=gen, dtype=torch.float64) for _ in range(2))
        b1, b2 = (torch.randn(c, e, d, generator=gen, dtype=torch.float64) for _ in range(2))
        for i in range(c):
            left, right = a1[i] @ b1[i], a2[i] @ b2[i]
            want.append(float(torch.linalg.matrix_norm(left @ right)
                              / (torch.linalg.matrix_norm(left) * torch.linalg.matrix_norm(right))))
    np.testing.assert_allclose(got, want, rtol=1e-10)
    lm, _ = setup("llama", layers=2)
    ctx = StepContext(model=lm, examples=[Example(prompt="ant")], results={}, seed=3)
    ds = detect(Composition(precision="float64", baseline_samples=30), ctx)
    base = random_baseline(64, lm.geometry.head_dim, 30, seed=3, precision="float64")
    assert float(ds["baseline_mean"]) == pytest.approx(base.mean())
    assert float(ds["baseline_std"]) == pytest.approx(base.std(ddof=1))
    assert 0 < float(ds["baseline_std"]) < float(ds["baseline_mean"]) < 1


# ---------------------------------------------------------------- a constructed induction circuit
V_TOK, N_POS, D_MODEL, N_HEAD = 16, 16, 64, 4
D_HEAD = D_MODEL // N_HEAD
TOKEN, POS, PREV, OUT = 0, 16, 32, 48  # the residual stream's subspaces (16 dimensions each)


def induction_model():
    """GPT-2, 2 layers x 4 heads, attention only (MLPs zero), norms identity: tokens and positions one-hot in
    their own subspaces; head (0, 0) attends from position p to p - 1 and writes that token into PREV; head
    (1, 0) queries with the current token and keys on PREV (an induction head); the other heads are random."""
    cfg = {"model_type": "gpt2", "n_embd": D_MODEL, "n_layer": 2, "n_head": N_HEAD, "vocab_size": V_TOK,
           "n_positions": N_POS, "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0}
    lm, models = build_models(cfg, seed=0, impls=("headlab", "eager"))
    gen = torch.Generator().manual_seed(0)
    eye = torch.eye(16)
    c = 30.0
    with torch.no_grad():
        state = models["eager"].state_dict()
        for name, p in state.items():
            if "ln_" in name:
                p.fill_(1.0 if name.endswith("weight") else 0.0)
            elif ".mlp." in name or name.endswith(".bias"):
                p.zero_()
        state["transformer.wte.weight"].zero_()[:, TOKEN:TOKEN + 16] = eye
        state["transformer.wpe.weight"].zero_()[:, POS:POS + 16] = eye
        for layer in range(2):
            W = torch.randn(D_MODEL, 3 * D_MODEL, generator=gen) * 0.1  # Conv1D (in, out): q | k | v
            Wo = torch.randn(D_MODEL, D_MODEL, generator=gen) * 0.1  # (H * D, d)
            W[:, 0:D_HEAD] = 0
            W[:, D_MODEL:D_MODEL + D_HEAD] = 0
            W[:, 2 * D_MODEL:2 * D_MODEL + D_HEAD] = 0
            Wo[0:D_HEAD] = 0
            if layer == 0:  # previous token: query at p matches key at p - 1; copy the token into PREV
                W[POS:POS + 16, 0:D_HEAD] = c * eye
                W[POS:POS + 15, D_MODEL + 1:D_MODEL + D_HEAD] = eye[:15, :15]
            else:  # induction: query with the token, key on the previous token
                W[TOKEN:TOKEN + 16, 0:D_HEAD] = c * eye
                W[PREV:PREV + 16, D_MODEL:D_MODEL + D_HEAD] = eye
            W[TOKEN:TOKEN + 16, 2 * D_MODEL:2 * D_MODEL + D_HEAD] = eye
            Wo[0:D_HEAD, (PREV if layer == 0 else OUT):(PREV if layer == 0 else OUT) + 16] = 4 * eye
            state[f"transformer.h.{layer}.attn.c_attn.weight"].copy_(W)
            state[f"transformer.h.{layer}.attn.c_proj.weight"].copy_(Wo)
        for m in models.values():
            m.load_state_dict(state)
    return lm, models["eager"]


def test_a_previous_token_head_feeding_an_induction_head_is_the_largest_k_composition():
    lm, eager = induction_model()
    first = torch.randperm(V_TOK - 1, generator=torch.Generator().manual_seed(1))[:7] + 1
    ids = torch.cat([torch.tensor([0]), first, first])[None]  # BOS, then 7 tokens twice: 15 positions
    with torch.no_grad():
        att = eager(ids, output_attentions=True).attentions
    n = ids.shape[1]
    prev = att[0][0, 0]  # (query, key) of head (0, 0)
    assert all(float(prev[p, p - 1]) > 0.9 for p in range(1, n))
    ind = att[1][0, 0]
    assert all(float(ind[p, p - 6]) > 0.9 for p in range(8, n))  # the token after the first occurrence
    ctx = StepContext(model=lm, examples=[Example(prompt="x")], results={}, seed=0)
    ds = detect(Composition(precision="float64"), ctx)
    k = ds["k_comp"].values
    assert np.unravel_index(k.argmax(), k.shape) == (0, 0, 1, 0)
    assert k.max() > max(ds["q_comp"].values.max(), ds["v_comp"].values.max())
    assert float(ds["score"].sel(layer=1, head=0)) == k.max()
    chance = float(ds["baseline_mean"] + 3 * ds["baseline_std"])
    assert k[0, 0, 1, 0] > chance
    others = np.delete(k[:, :, 1, :].reshape(-1), 0)  # every other pair (layer 0 -> layer 1)
    assert np.median(others) < chance
