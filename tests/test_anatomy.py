"""headlab.anatomy on tiny random models of every supported architecture (and the text towers of LLaVA and
Qwen2-VL): per-head weights rebuild the projections and the attention of each layer from the layer's input,
the embeddings and the unembedding rebuild the model's embedding output and logits."""

from __future__ import annotations

import copy
import math
import sys
import types

import pytest
import torch

from headlab import anatomy
from headlab.anatomy import AnatomyError, HeadWeights
from headlab.model import LoadedModel, load_model
from headlab.spec import ModelSpec

from fixtures.specs import TINY_LLAMA
from fixtures.vision import LLAVA, QWEN2_VL

_TEXT = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "intermediate_size": 96, "vocab_size": 97, "max_position_embeddings": 64, "initializer_range": 0.25}
CONFIGS = {
    "llama": {**TINY_LLAMA, "initializer_range": 0.25},
    "mistral": {"model_type": "mistral", **_TEXT},
    "qwen2": {"model_type": "qwen2", **_TEXT},
    # scale from query_pre_attn_scalar (not head_dim); small caps so both soft-cappings change the numbers
    "gemma2": {"model_type": "gemma2", **_TEXT, "head_dim": 16, "query_pre_attn_scalar": 24,
               "attn_logit_softcapping": 2.0, "final_logit_softcapping": 1.5},
    # no GQA in gpt2; the inverse-layer scaling makes the scale differ per layer
    "gpt2": {"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 97, "n_positions": 64,
             "initializer_range": 0.25, "scale_attn_by_inverse_layer_idx": True},
    "olmo2": {"model_type": "olmo2", **_TEXT},
    "phi3": {"model_type": "phi3", **_TEXT, "pad_token_id": 0, "partial_rotary_factor": 0.5},
    "llava": LLAVA,
    "qwen2_vl": QWEN2_VL,
}
#: the projection modules of each attention, as the modelling files name them (what the anatomy must match)
QKV = {"gpt2": ("c_attn",), "phi3": ("qkv_proj",)}
OUT = {"gpt2": "c_proj"}
TOL = {"atol": 1e-5, "rtol": 1e-5}


@pytest.fixture(scope="module", params=list(CONFIGS))
def lm(request) -> LoadedModel:
    return load_model(ModelSpec(config=copy.deepcopy(CONFIGS[request.param]), device="cpu"), seed=0)


def arch(lm: LoadedModel) -> str:
    return lm.model.config.model_type


def ids_for(lm: LoadedModel, batch: int = 2, length: int = 7) -> torch.Tensor:
    """Ordinary text tokens (no image or special tokens)."""
    g = torch.Generator().manual_seed(1)
    return torch.randint(3, 90, (batch, length), generator=g)


def forward(lm: LoadedModel, ids: torch.Tensor):
    with torch.no_grad():
        return lm.model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False)


def out_proj(lm: LoadedModel, layer: int) -> torch.nn.Module:
    return getattr(lm.attention_module(layer), OUT.get(arch(lm), "o_proj"))


def first(output):
    return output[0] if isinstance(output, tuple) else output


def test_head_weights_have_transformerlens_shapes_and_gqa_map(lm):
    g = lm.geometry
    H, K, D = g.n_heads, g.n_kv_heads, g.head_dim
    d = lm.embedding.shape[1]
    if arch(lm) != "gpt2":
        assert K < H  # every GQA-capable architecture is tested with grouped-query attention
    for layer in range(g.n_layers):
        hw = lm.head_weights(layer)
        assert isinstance(hw, HeadWeights) and hw.layer == layer
        assert hw.W_Q.shape == (H, d, D) and hw.W_K.shape == hw.W_V.shape == (K, d, D)
        assert hw.W_O.shape == (H, D, d)
        assert (hw.n_heads, hw.n_kv_heads, hw.d_head, hw.d_model) == (H, K, D, d)
        assert hw.kv_head_of == tuple(h * K // H for h in range(H))
        has_qkv_bias = arch(lm) in ("qwen2", "qwen2_vl", "gpt2")
        for b, n in ((hw.b_Q, H), (hw.b_K, K), (hw.b_V, K)):
            assert (b is not None) == has_qkv_bias
            assert b is None or b.shape == (n, D)
        assert (hw.b_O is not None) == (arch(lm) == "gpt2")
        assert hw.b_O is None or hw.b_O.shape == (d,)
        assert hw.per_query_head(hw.W_K).shape == (H, d, D)
        assert torch.equal(hw.per_query_head(hw.W_K)[H - 1], hw.W_K[K - 1])


def capture(lm: LoadedModel, hooks: list[tuple[torch.nn.Module, str, object]]) -> torch.Tensor:
    """Run one forward on :func:`ids_for` with ``(module, "pre" | "post", fn)`` hooks (pre-hooks get kwargs)."""
    ids = ids_for(lm)
    handles = [m.register_forward_pre_hook(fn, with_kwargs=True) if kind == "pre" else m.register_forward_hook(fn)
               for m, kind, fn in hooks]
    try:
        return forward(lm, ids).logits
    finally:
        for h in handles:
            h.remove()


def test_w_o_rebuilds_the_output_projection_head_by_head(lm):
    seen: dict[int, dict] = {layer: {} for layer in range(lm.geometry.n_layers)}
    capture(lm, [(out_proj(lm, layer), "post", lambda m, a, out, s=s: s.update(z=a[0], out=out))
                 for layer, s in seen.items()])
    for layer, s in seen.items():
        proj, hw = out_proj(lm, layer), lm.head_weights(layer)
        B, N, _ = s["z"].shape
        z = s["z"].reshape(B, N, hw.n_heads, hw.d_head)
        b_O = 0 if hw.b_O is None else hw.b_O
        rebuilt = torch.einsum("bnhd,hdm->bnm", z, hw.W_O) + b_O
        assert s["out"].abs().max() > 1e-2
        torch.testing.assert_close(rebuilt, s["out"], **TOL)
        with torch.no_grad():
            for h in range(hw.n_heads):
                only = torch.zeros_like(z)
                only[:, :, h] = z[:, :, h]
                alone = proj(only.reshape(B, N, -1)) - b_O
                torch.testing.assert_close(z[:, :, h] @ hw.W_O[h], alone, **TOL)


def test_w_q_k_v_are_the_heads_slices_of_the_projections(lm):
    layer = lm.geometry.n_layers - 1
    attn = lm.attention_module(layer)
    names = QKV.get(arch(lm), ("q_proj", "k_proj", "v_proj"))
    seen: dict[str, torch.Tensor] = {}
    capture(lm, [(getattr(attn, n), "post", lambda m, a, out, n=n: seen.update({n: out, "x": a[0]}))
                 for n in names])
    projected = torch.cat([seen[n] for n in names], dim=-1)
    hw = lm.head_weights(layer)
    parts = []
    for W, b in ((hw.W_Q, hw.b_Q), (hw.W_K, hw.b_K), (hw.W_V, hw.b_V)):
        per_head = torch.einsum("bnm,hmd->bnhd", seen["x"], W) + (0 if b is None else b)
        parts.append(per_head.flatten(2))
    torch.testing.assert_close(torch.cat(parts, dim=-1), projected, **TOL)


def _modelling_module(module: torch.nn.Module) -> types.ModuleType:
    return sys.modules[type(module).__module__]


def test_one_layer_rebuilt_from_the_anatomy_matches_the_attention_module(lm):
    B, N = ids_for(lm).shape
    captured: dict[int, dict] = {layer: {} for layer in range(lm.geometry.n_layers)}
    hooks: list = []
    for layer, s in captured.items():
        attn = lm.attention_module(layer)
        hooks += [(lm.decoder_layers[layer], "pre", lambda m, a, kw, s=s: s.update(h=a[0] if a else kw["hidden_states"])),
                  (attn, "pre", lambda m, a, kw, s=s: s.update(rope=kw.get("position_embeddings"))),
                  (attn, "post", lambda m, a, out, s=s: s.update(out=first(out)))]
    capture(lm, hooks)
    for layer, seen in captured.items():
        attn, hw = lm.attention_module(layer), lm.head_weights(layer)
        norm = lm.input_norm(layer)
        with torch.no_grad():
            x = seen["h"] if norm is None else norm(seen["h"])

            q, k, v = (torch.einsum("bnm,hmd->bhnd", x, W) + (0 if b is None else b[None, :, None])
                       for W, b in ((hw.W_Q, hw.b_Q), (hw.W_K, hw.b_K), (hw.W_V, hw.b_V)))
            qk_norms = lm.query_key_norms(layer)
            if qk_norms is not None:  # olmo2: over the whole projection, before RoPE
                q, k = (n(t.transpose(1, 2).flatten(2)).view(t.transpose(1, 2).shape).transpose(1, 2)
                        for n, t in zip(qk_norms, (q, k), strict=True))
            if arch(lm) != "gpt2":
                if arch(lm) == "qwen2_vl":
                    cos, sin = seen["rope"]  # the model's multimodal positions, from its own rotary embedding
                else:
                    rotary = anatomy.text_model(lm.model).rotary_emb
                    cos, sin = rotary(x, torch.arange(N)[None])
                    torch.testing.assert_close((cos, sin), tuple(seen["rope"]))
                q, k = _modelling_module(attn).apply_rotary_pos_emb(q, k, cos, sin)
            k, v = hw.per_query_head(k.transpose(0, 1)).transpose(0, 1), \
                hw.per_query_head(v.transpose(0, 1)).transpose(0, 1)
            scores = (q @ k.transpose(-1, -2)) * hw.scale
            if hw.softcap is not None:
                scores = hw.softcap * torch.tanh(scores / hw.softcap)
            causal = torch.ones(N, N, dtype=torch.bool).tril()
            z = scores.masked_fill(~causal, -math.inf).softmax(-1) @ v
            out = torch.einsum("bhnd,hdm->bnm", z, hw.W_O) + (0 if hw.b_O is None else hw.b_O)
        assert seen["out"].abs().max() > 1e-2
        torch.testing.assert_close(out, seen["out"], **TOL)


def test_scale_and_softcap_come_from_the_architecture(lm):
    D = lm.geometry.head_dim
    for layer in range(lm.geometry.n_layers):
        hw = lm.head_weights(layer)
        expected = {"gemma2": 24 ** -0.5, "gpt2": D ** -0.5 / (layer + 1)}.get(arch(lm), D ** -0.5)
        assert hw.scale == pytest.approx(expected)
        assert hw.softcap == (2.0 if arch(lm) == "gemma2" else None)


def test_embedding_and_position_embedding_rebuild_the_first_hidden_state(lm):
    ids = ids_for(lm)
    text_cfg = lm.model.config.get_text_config()
    vocab = text_cfg.vocab_size
    d = lm.geometry.n_heads * lm.geometry.head_dim if arch(lm) == "gpt2" else text_cfg.hidden_size
    assert lm.embedding.shape == (vocab, d)
    seen = {}
    capture(lm, [(lm.decoder_layers[0], "pre", lambda m, a, kw: seen.update(h=a[0] if a else kw["hidden_states"]))])
    expected = lm.embedding[ids] * (math.sqrt(d) if arch(lm) == "gemma2" else 1.0)
    W_pos = lm.position_embedding
    assert (W_pos is not None) == (arch(lm) == "gpt2")
    if W_pos is not None:
        assert W_pos.shape == (64, d)
        expected = expected + W_pos[: ids.shape[1]]
    torch.testing.assert_close(seen["h"], expected, **TOL)


def test_final_norm_and_unembedding_give_the_logits(lm):
    text_cfg = lm.model.config.get_text_config()
    W_U = lm.unembedding
    d = lm.embedding.shape[1]
    assert W_U.shape == (d, text_cfg.vocab_size)
    assert lm.unembedding_bias is None
    if arch(lm) in ("gemma2", "gpt2"):  # tied: the same storage, transposed
        assert W_U.data_ptr() == lm.embedding.data_ptr() and torch.equal(W_U, lm.embedding.T)
    seen = {}
    logits = capture(lm, [(lm.decoder_layers[-1], "post", lambda m, a, out: seen.update(h=first(out)))])
    with torch.no_grad():
        by_hand = lm.final_norm(seen["h"]) @ W_U
        if arch(lm) == "gemma2":
            by_hand = 1.5 * torch.tanh(by_hand / 1.5)
        torch.testing.assert_close(by_hand, logits, **TOL)
        torch.testing.assert_close(lm.unembed(seen["h"]), logits, **TOL)
        torch.testing.assert_close(lm.unembed(lm.final_norm(seen["h"]), norm=False), logits, **TOL)


def test_input_norm_and_query_key_norms_are_the_architectures_modules(lm):
    for layer in range(lm.geometry.n_layers):
        block = lm.decoder_layers[layer]
        name = {"gpt2": "ln_1", "olmo2": None}.get(arch(lm), "input_layernorm")
        assert lm.input_norm(layer) is (None if name is None else getattr(block, name))
        norms = lm.query_key_norms(layer)
        attn = lm.attention_module(layer)
        assert norms == ((attn.q_norm, attn.k_norm) if arch(lm) == "olmo2" else None)
        assert attn.layer_idx == layer


def test_head_weights_are_views_of_the_parameters(lm):
    hw = lm.head_weights(0)
    proj = out_proj(lm, 0)
    before = proj.weight.detach().clone()
    with torch.no_grad():
        hw.W_O[1, 2, 3] = before.max() + 1.0
        changed = (proj.weight.detach() != before).nonzero().tolist()
        proj.weight.copy_(before)
    D = hw.d_head
    assert changed == ([[D + 2, 3]] if arch(lm) == "gpt2" else [[3, D + 2]])
    assert not any(t.requires_grad for t in (hw.W_Q, hw.W_K, hw.W_V, hw.W_O))


def test_layer_out_of_range_is_an_index_error(lm):
    n = lm.geometry.n_layers
    with pytest.raises(IndexError, match=f"the model has {n} layers"):
        lm.head_weights(n)


def test_an_unknown_architecture_is_a_one_line_error_naming_it():
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("opt", hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                  ffn_dim=32, vocab_size=50, word_embed_proj_dim=16, max_position_embeddings=32)
    model = AutoModelForCausalLM.from_config(config)
    for call in (anatomy.decoder_layers, anatomy.final_norm, anatomy.embedding, anatomy.unembedding,
                 lambda m: anatomy.head_weights(m, 0), lambda m: anatomy.input_norm(m, 0)):
        with pytest.raises(AnatomyError) as info:
            call(model)
        message = str(info.value)
        assert "\n" not in message and "'opt'" in message and "OPTForCausalLM" in message and "llama" in message
    with pytest.raises(ValueError, match="'opt'"):  # a ValueError: the model is the wrong input for anatomy
        _ = LoadedModel(model=model, tokenizer=None, name="opt", geometry=None).decoder_layers


def test_a_vision_model_with_an_unknown_text_tower_names_both():
    text = types.SimpleNamespace(model_type="opt")
    config = types.SimpleNamespace(model_type="llava", get_text_config=lambda: text)
    with pytest.raises(AnatomyError, match=r"^headlab.anatomy: the text tower of this llava model is a 'opt' "
                                           r"model, whose layers .* not known \(supported: gemma2, gpt2"):
        anatomy.decoder_layers(types.SimpleNamespace(config=config))


def test_a_missing_module_is_named():
    lm = load_model(ModelSpec(config=dict(TINY_LLAMA), device="cpu"))
    del lm.model.model.layers[1].self_attn
    with pytest.raises(AnatomyError, match=r"^headlab.anatomy: this llama model \(LlamaForCausalLM\) has no "
                                           r"'self_attn' module"):
        lm.attention_module(1)
    assert lm.attention_module(0).layer_idx == 0


def test_the_docs_example_computes_ov_norms_and_the_logit_lens():
    import re
    from pathlib import Path

    doc = (Path(__file__).parent.parent / "docs" / "plugins.md").read_text()
    section = doc.split("## Model anatomy", 1)[1].split("\n## ", 1)[0]
    namespace: dict = {}
    exec(re.search(r"```python\n(.*?)```", section, flags=re.S).group(1), namespace)  # noqa: S102
    lm = load_model(ModelSpec(config={**TINY_LLAMA, "initializer_range": 0.25}, device="cpu"))
    H, K, D = lm.geometry.n_heads, lm.geometry.n_kv_heads, lm.geometry.head_dim
    with torch.no_grad():
        norms = namespace["ov_norms"](lm)
        for layer, block in enumerate(lm.model.model.layers):  # by hand, as the weights are stored
            wv, wo = block.self_attn.v_proj.weight, block.self_attn.o_proj.weight
            for h in range(H):
                kv = h // (H // K)
                ov = wv[kv * D:(kv + 1) * D].T @ wo[:, h * D:(h + 1) * D].T
                assert norms[layer, h].item() == pytest.approx(torch.linalg.matrix_norm(ov).item(), rel=1e-5)
        ids = ids_for(lm)
        out = lm.model(input_ids=ids, output_hidden_states=True)
        torch.testing.assert_close(namespace["logit_lens"](lm, out.hidden_states[-2]),
                                   lm.model.lm_head(lm.model.model.norm(out.hidden_states[-2])), **TOL)
