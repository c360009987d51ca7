"""headlab.instrument on tiny random-weight models built from transformers configs (no downloads).

Independent checks: SDPA / eager models with the same weights, eager ``output_attentions`` patterns,
forward pre-hooks on the output projection, full-sequence forwards vs ``generate`` steps.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import transformers

from headlab import instrument as ins

from fixtures.kernels import pasta_reweighted

ins.register()

V = 97
N = 12
PAD = 4


def _cfg(arch: str):
    common = dict(vocab_size=V, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64)
    if arch == "llama":
        return transformers.LlamaConfig(hidden_size=64, intermediate_size=96, num_key_value_heads=2, **common)
    if arch == "mistral":  # GQA 4 + sliding window shorter than the sequence
        return transformers.MistralConfig(hidden_size=64, intermediate_size=96, num_key_value_heads=1,
                                          sliding_window=5, head_dim=16, **common)
    if arch == "qwen2":
        return transformers.Qwen2Config(hidden_size=64, intermediate_size=96, num_key_value_heads=2, **common)
    if arch == "gemma2":  # softcap, query_pre_attn_scalar, alternating sliding / full layers
        return transformers.Gemma2Config(hidden_size=64, intermediate_size=96, num_key_value_heads=2, head_dim=16,
                                         sliding_window=5, query_pre_attn_scalar=16, attn_logit_softcapping=2.0,
                                         **common)
    if arch == "gpt2":
        return transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=V, n_positions=64)
    if arch == "olmo2":
        return transformers.Olmo2Config(hidden_size=64, intermediate_size=96, num_key_value_heads=4, **common)
    if arch == "phi3":
        return transformers.Phi3Config(hidden_size=64, intermediate_size=96, num_key_value_heads=2,
                                       pad_token_id=0, **common)
    raise KeyError(arch)


ARCHS = ["llama", "mistral", "qwen2", "gemma2", "gpt2", "olmo2", "phi3"]
_MODELS: dict = {}


def load(arch: str, impl: str):
    """The same random weights under attention implementation ``impl`` (cached per module)."""
    key = (arch, impl)
    if key not in _MODELS:
        cfg = _cfg(arch)
        cls = transformers.AutoModelForCausalLM
        torch.manual_seed(0)
        base = cls.from_config(copy.deepcopy(cfg), attn_implementation="eager").eval()
        if impl == "eager":
            m = base
        else:
            m = cls.from_config(copy.deepcopy(cfg), attn_implementation=impl).eval()
            m.load_state_dict(base.state_dict())
        _MODELS[key] = m
    return _MODELS[key]


def batch(B=2, n=N, pad=PAD, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, V, (B, n), generator=g)
    am = torch.ones(B, n, dtype=torch.long)
    if B > 1 and pad:
        am[1, :pad] = 0
        ids[1, :pad] = 0
    return ids, am


def eager_pattern(arch: str, ids, am) -> torch.Tensor:
    """(B, L, H, N, N): eager's ``output_attentions`` for ``arch`` on the batch, stacked over layers."""
    eager = load(arch, "eager")
    with torch.no_grad():
        att = eager(input_ids=ids, attention_mask=am, output_attentions=True).attentions
    return torch.stack(list(att), dim=1).float()


def logits(model, ids, am, **kw):
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=am, **kw).logits


def real(x, am):
    """Positions of real tokens only: (rows concatenated)."""
    return x[am.bool()]


def sdpa_or_eager(arch):
    # Gemma 2's softcap is not available under SDPA; eager is its reference
    return "eager" if arch == "gemma2" else "sdpa"


# --------------------------------------------------------------------------- parity
@pytest.mark.parametrize("arch", ARCHS)
def test_empty_plan_identical_to_reference(arch):
    ids, am = batch()
    ref = logits(load(arch, sdpa_or_eager(arch)), ids, am)
    m = load(arch, "headlab")
    out_free = logits(m, ids, am)
    with ins.instrument(m, ins.Plan()):
        out_ctx = logits(m, ids, am)
    if arch == "gemma2":
        torch.testing.assert_close(real(out_free, am), real(ref, am), atol=1e-5, rtol=0)
    else:
        assert torch.equal(out_free, ref), "outside any context: must be exactly SDPA"
    assert torch.equal(out_ctx, out_free), "empty plan: must be exactly the uninstrumented path"


@pytest.mark.parametrize("arch", ARCHS)
def test_probes_parity_and_patterns(arch):
    """Probes only: logits agree with SDPA at least as closely as eager does; the recorded pattern,
    argmax and entropy equal eager's output_attentions on real query rows."""
    ids, am = batch()
    ref = logits(load(arch, sdpa_or_eager(arch)), ids, am)
    eager = load(arch, "eager")
    with torch.no_grad():
        eo = eager(input_ids=ids, attention_mask=am, output_attentions=True)
    eager_gap = (real(eo.logits, am) - real(ref, am)).abs().max().item()
    m = load(arch, "headlab")
    probes = ins.Probes(argmax=True, entropy=True, spans=[(0, 3), (3, 8), (8, N)], pattern=True,
                        z_positions="last")
    with ins.instrument(m, ins.Plan(probes=probes)) as rec:
        out = logits(m, ids, am)
    gap = (real(out, am) - real(ref, am)).abs().max().item()
    assert gap <= max(eager_gap, 2e-5), (gap, eager_gap)
    L, H = 2, 4
    assert rec.argmax.shape == (2, L, H, N) and rec.argmax.dtype == torch.long
    assert rec.span_mass.shape == (2, L, H, N, 3)
    assert rec.pattern.shape == (2, L, H, N, N)
    assert rec.z.shape[:4] == (2, L, H, 1) and rec.z_positions == [N - 1]
    assert rec.dims["span_mass"] == ("example", "layer", "head", "query", "span")
    pat_e = torch.stack(list(eo.attentions), dim=1).float()  # (B, L, H, Nq, Nk)
    rows = am.bool()  # real query rows
    for b in range(2):
        pe, po = pat_e[b][:, :, rows[b]], rec.pattern[b][:, :, rows[b]]
        torch.testing.assert_close(po, pe, atol=2e-5, rtol=0)
        torch.testing.assert_close(rec.span_mass[b, :, :, rows[b], 1], pe[..., 3:8].sum(-1), atol=2e-5, rtol=0)
        ent = -(pe * pe.clamp_min(1e-30).log()).sum(-1)
        torch.testing.assert_close(rec.entropy[b][:, :, rows[b]], ent, atol=1e-4, rtol=0)
        top = pe.amax(-1)
        picked = pe.gather(-1, rec.argmax[b][:, :, rows[b]][..., None]).squeeze(-1)
        torch.testing.assert_close(picked, top, atol=2e-5, rtol=0)
    assert (rec.argmax[1, :, :, :PAD] == -1).all()


def test_pasta_bias_equals_reweighting():
    """log(alpha) on the non-emphasised keys of one head == eager pattern reweighted by hand."""
    ids, am = batch()
    eager = load("llama", "eager")
    with torch.no_grad():
        pe = eager(input_ids=ids, attention_mask=am, output_attentions=True).attentions[0].float()
    m = load("llama", "headlab")
    alpha = 0.05
    emph = (6, 9)
    plan = ins.Plan(probes=ins.Probes(pattern=True, layers=[0]))
    plan.bias_keys([(0, 1)], [(0, emph[0]), (emph[1], N)], math.log(alpha))
    with ins.instrument(m, plan) as rec:
        logits(m, ids, am)
    want = pe.clone()
    want[:, 1] = pasta_reweighted(pe[:, 1], alpha, emph)
    got = rec.pattern[:, 0]
    for b in range(2):
        r = am[b].bool()
        torch.testing.assert_close(got[b][:, r], want[b][:, r], atol=2e-5, rtol=0)
    assert not torch.allclose(got[0, 1], pe[0, 1], atol=1e-3)


def _oproj(model, arch, layer):
    if arch == "gpt2":
        return model.transformer.h[layer].attn.c_proj
    return model.model.layers[layer].self_attn.o_proj


@pytest.mark.parametrize("arch", ["llama", "gpt2", "gemma2"])
def test_output_gate_zero_equals_oproj_prehook(arch):
    """Gate 0 on (layer 1, head 2) in row 1 only == zeroing that head's slice of o_proj's input."""
    ids, am = batch()
    ref_model = load(arch, sdpa_or_eager(arch))
    D = 16
    h = 2

    def hook(mod, args):
        x = args[0].clone()
        x[1, :, h * D:(h + 1) * D] = 0
        return (x,)

    handle = _oproj(ref_model, arch, 1).register_forward_pre_hook(hook)
    try:
        want = logits(ref_model, ids, am)
    finally:
        handle.remove()
    base = logits(ref_model, ids, am)
    m = load(arch, "headlab")
    plan = ins.Plan().mask_heads([(1, h)], rows=[1], mode="output")
    with ins.instrument(m, plan):
        got = logits(m, ids, am)
    torch.testing.assert_close(real(got, am), real(want, am), atol=2e-5, rtol=0)
    torch.testing.assert_close(got[0], base[0], atol=2e-5, rtol=0)  # row 0 untouched
    assert (got[1] - base[1]).abs().max() > 1e-4


def test_rows_in_one_batch_equal_separate_runs():
    """Base row + query-masked row in one batched forward == each run on its own."""
    ids, _ = batch(B=1, pad=0)
    two = ids.repeat(2, 1)
    m = load("qwen2", "headlab")
    heads = [(0, 1), (1, 3)]
    with ins.instrument(m, ins.Plan().mask_heads(heads, rows=[1], mode="query")):
        both = logits(m, two, torch.ones_like(two))
    with ins.instrument(m, ins.Plan().mask_heads(heads, mode="query")):
        masked = logits(m, ids, torch.ones_like(ids))
    plain = logits(m, ids, torch.ones_like(ids))
    torch.testing.assert_close(both[1], masked[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(both[0], plain[0], atol=1e-5, rtol=0)
    # score masking with no bias is the same uniform attention as query masking
    with ins.instrument(m, ins.Plan().mask_heads(heads, mode="score")):
        score_masked = logits(m, ids, torch.ones_like(ids))
    torch.testing.assert_close(score_masked, masked, atol=1e-5, rtol=0)


@pytest.mark.parametrize("arch", ["llama", "mistral", "gemma2"])
def test_generate_probes_match_full_forward(arch):
    """argmax per generated step (KV cache, left padding) == a full-sequence forward's argmax."""
    ids, am = batch()
    m = load(arch, "headlab")
    new = 5
    plan = ins.Plan(probes=ins.Probes(argmax=True, spans=[(0, 6)]))
    with ins.instrument(m, plan) as rec, torch.no_grad():
        out = m.generate(input_ids=ids, attention_mask=am, max_new_tokens=new, min_new_tokens=new,
                         do_sample=False, pad_token_id=0)
    assert rec.argmax.shape == (2, 2, 4, N + new - 1)
    seq = out[:, :-1]
    am_full = torch.cat([am, torch.ones(2, new - 1, dtype=am.dtype)], dim=1)
    with ins.instrument(m, ins.Plan(probes=ins.Probes(argmax=True, spans=[(0, 6)]))) as full:
        logits(m, seq, am_full)
    r = am_full.bool()
    for b in range(2):
        assert torch.equal(rec.argmax[b][..., r[b]], full.argmax[b][..., r[b]])
        torch.testing.assert_close(rec.span_mass[b][..., r[b], :], full.span_mass[b][..., r[b], :],
                                   atol=1e-5, rtol=0)


def test_on_layer_callback_sets_scale_for_later_calls():
    """A callback choosing heads at the first call (VHR-style) == the same heads scaled statically."""
    ids, am = batch()
    m = load("llama", "headlab")
    seen, store = [], {}

    def pick(layer, z, ctx):
        seen.append((layer, ctx.call, ctx.q_start, tuple(z.shape)))
        if ctx.call == 0:
            norms = z[:, :, -1].float().norm(dim=-1)  # (B, H) at the last prompt position
            store[layer] = norms > norms.median(dim=1, keepdim=True).values
            return torch.where(store[layer], 2.0, 1.0)
        return None

    kw = dict(max_new_tokens=3, min_new_tokens=3, do_sample=False, pad_token_id=0, output_logits=True,
              return_dict_in_generate=True)
    with ins.instrument(m, ins.Plan().on_layer(pick)), torch.no_grad():
        out_cb = m.generate(input_ids=ids, attention_mask=am, **kw)
    static = ins.Plan()
    for layer, c in store.items():
        for row, head in c.nonzero().tolist():
            static.scale_heads([(layer, head)], 2.0, rows=[row])
    assert 0 < len(static.edits) < 2 * 2 * 4
    with ins.instrument(m, static), torch.no_grad():
        out_st = m.generate(input_ids=ids, attention_mask=am, **kw)
    for a, b in zip(out_cb.logits, out_st.logits, strict=True):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=0)
    assert (0, 0, 0, (2, 4, N, 16)) in seen and (1, 2, N + 1, (2, 4, 1, 16)) in seen


def test_refusals():
    m = load("llama", "sdpa")
    with pytest.raises(ins.UnsupportedModelError, match="attn_implementation"):
        with ins.instrument(m, ins.Plan()):
            pass
    mh = load("llama", "headlab")
    with pytest.raises(ValueError, match="out of range"):
        with ins.instrument(mh, ins.Plan().mask_heads([(7, 0)])):
            pass

    class Fake(torch.nn.Module):
        layer_idx = 0
        is_causal = True

    q = torch.randn(1, 4, 3, 16)
    with pytest.raises(ins.UnsupportedModelError, match="position_bias"):
        ins.attention_forward(Fake(), q, q, q, None, position_bias=torch.zeros(1, 4, 3, 3))
    assert ins.register() == "headlab"  # idempotent


def test_llava_vlm():
    """A tiny LLaVA (CLIP vision tower + Llama text model): the vision tower passes through, the language
    model's layers are instrumented; empty plan identical to SDPA, probes parity."""
    vc = transformers.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                       num_attention_heads=2, image_size=16, patch_size=8, projection_dim=32)
    tc = transformers.LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, vocab_size=V + 3, max_position_embeddings=64)
    cfg = transformers.LlavaConfig(vision_config=vc, text_config=tc, image_token_index=V + 1,
                                   vision_feature_layer=-1, vision_feature_select_strategy="default")
    torch.manual_seed(0)
    cls = transformers.LlavaForConditionalGeneration
    ms = cls._from_config(copy.deepcopy(cfg), attn_implementation="sdpa").eval()
    mh = cls._from_config(copy.deepcopy(cfg), attn_implementation="headlab").eval()
    mh.load_state_dict(ms.state_dict())
    n_img = (16 // 8) ** 2
    n = N + n_img
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, V, (2, n), generator=g)
    am = torch.ones(2, n, dtype=torch.long)
    ids[0, 2:2 + n_img] = V + 1
    ids[1, :PAD], am[1, :PAD] = 0, 0  # left padding, then the image block
    ids[1, PAD + 1:PAD + 1 + n_img] = V + 1
    pix = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        ref = ms(input_ids=ids, attention_mask=am, pixel_values=pix).logits
        free = mh(input_ids=ids, attention_mask=am, pixel_values=pix).logits
        assert torch.equal(free, ref)
        with ins.instrument(mh, ins.Plan(probes=ins.Probes(argmax=True, spans=[(2, 2 + n_img)]))) as rec:
            out = mh(input_ids=ids, attention_mask=am, pixel_values=pix).logits
    torch.testing.assert_close(real(out, am), real(ref, am), atol=2e-5, rtol=0)
    assert rec.argmax.shape == (2, 2, 4, ids.shape[1])


# --------------------------------------------------------------------------- offset probe
@pytest.mark.parametrize("arch", ["llama", "mistral", "gemma2", "gpt2"])
def test_offset_mass_equals_eager_pattern_diagonals(arch):
    """Probes(offsets=...) records A[t, t - delta] of eager's pattern, with per-row offsets and left padding."""
    ids, am = batch()
    pat_e = eager_pattern(arch, ids, am)
    m = load(arch, "headlab")
    per_row = [[1, 0, 3, 11], [2, 1]]
    with ins.instrument(m, ins.Plan(probes=ins.Probes(offsets=per_row))) as rec:
        logits(m, ids, am)
    om = rec.offset_mass
    assert om.shape == (2, 2, 4, N, 4) and om.dtype == torch.float32
    assert rec.dims["offset_mass"] == ("example", "layer", "head", "query", "offset")
    assert rec.pattern is None and "offset_mass" in rec.as_dict()
    for b in range(2):
        for o, d in enumerate(per_row[b]):
            for t in range(N):
                if not am[b, t]:
                    continue  # padding query: eager's row is not defined the same way
                want = pat_e[b, :, :, t, t - d] if t - d >= 0 else torch.zeros(2, 4)
                torch.testing.assert_close(om[b, :, :, t, o], want, atol=2e-5, rtol=0)
        assert (om[b, ..., len(per_row[b]):] == 0).all()  # padded slots
    assert om[0, ..., 0].abs().sum() > 1  # real mass was read
    # a shared list and a (batch, offset) tensor are the same probe
    with ins.instrument(m, ins.Plan(probes=ins.Probes(offsets=[2, 1]))) as shared:
        logits(m, ids, am)
    with ins.instrument(m, ins.Plan(probes=ins.Probes(offsets=torch.tensor([[2, 1], [2, 1]])))) as tens:
        logits(m, ids, am)
    torch.testing.assert_close(shared.offset_mass[1], om[1, ..., :2], atol=1e-6, rtol=0)
    assert torch.equal(tens.offset_mass, shared.offset_mass)


@pytest.mark.parametrize("arch, cache", [("llama", None), ("mistral", None), ("gemma2", None), ("llama", "static")])
def test_generate_offset_mass_matches_full_forward(arch, cache):
    """Offset masses of decode steps (KV cache, left padding; Mistral and Gemma 2 with a sliding window; a static
    cache, whose empty slots after the queries shift the kernel's key coordinates) == a full forward over the
    generated sequence."""
    ids, am = batch()
    m = load(arch, "headlab")
    new = 5
    offs = [0, 1, 3, 6]
    kw = {} if cache is None else dict(cache_implementation=cache)
    with ins.instrument(m, ins.Plan(probes=ins.Probes(offsets=offs))) as rec, torch.no_grad():
        out = m.generate(input_ids=ids, attention_mask=am, max_new_tokens=new, min_new_tokens=new,
                         do_sample=False, pad_token_id=0, **kw)
    assert rec.offset_mass.shape == (2, 2, 4, N + new - 1, len(offs))
    seq = out[:, :-1]
    am_full = torch.cat([am, torch.ones(2, new - 1, dtype=am.dtype)], dim=1)
    with ins.instrument(m, ins.Plan(probes=ins.Probes(offsets=offs, pattern=True))) as full:
        logits(m, seq, am_full)
    r = am_full.bool()
    for b in range(2):
        torch.testing.assert_close(rec.offset_mass[b][..., r[b], :], full.offset_mass[b][..., r[b], :],
                                   atol=1e-5, rtol=0)
    # and the full forward's offset masses are the recorded pattern's diagonals
    pat = full.pattern
    for o, d in enumerate(offs):
        torch.testing.assert_close(full.offset_mass[..., d:, o], pat.diagonal(-d, -2, -1), atol=1e-6, rtol=0)
    assert rec.offset_mass[..., N:, 1].abs().sum() > 0.1  # decode steps saw their previous token


# --------------------------------------------------------------------------- pair probe
def _random_pairs(B: int, n: int, count: int, seed: int) -> list[list[tuple[int, int]]]:
    """Per-row (query, key) pairs over n positions: random cells (future and padding keys among them), each
    row's diagonal and previous token, rows of different lengths."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for b in range(B):
        qi = torch.randint(0, n, (count + 3 * b,), generator=g).tolist()
        kj = torch.randint(0, n, (count + 3 * b,), generator=g).tolist()
        rows.append(list(zip(qi, kj, strict=True)) + [(t, t) for t in range(0, n, 3)] + [(n - 1, n - 2)])
    return rows


@pytest.mark.parametrize("arch", ["llama", "mistral", "gemma2", "gpt2"])
def test_pair_mass_equals_eager_pattern_cells(arch):
    """Probes(pairs=...) records A[query, key] of eager's pattern at each pair, per row, in the order given,
    with left padding (Mistral and Gemma 2: sliding windows shorter than the sequence); rec.pairs and the
    xarray coordinates name the cells; a (B, P, 2) tensor and a function of (start, stop) are the same probe."""
    ids, am = batch()
    pat_e = eager_pattern(arch, ids, am)
    m = load(arch, "headlab")
    per_row = _random_pairs(2, N, 20, seed=1)
    with ins.instrument(m, ins.Plan(probes=ins.Probes(pairs=per_row))) as rec:
        logits(m, ids, am)
    pm = rec.pair_mass
    n_pairs = max(len(r) for r in per_row)
    assert pm.shape == (2, 2, 4, n_pairs) and pm.dtype == torch.float32
    assert rec.dims["pair_mass"] == ("example", "layer", "head", "pair")
    assert rec.pattern is None and rec.backends[0][0] == "torch"
    for b in range(2):
        for p, (t, j) in enumerate(per_row[b]):
            assert rec.pairs[b, p].tolist() == [t, j]
            if not am[b, t]:
                continue  # padding query: eager's row is not defined the same way
            torch.testing.assert_close(pm[b, :, :, p], pat_e[b, :, :, t, j], atol=2e-5, rtol=0)
        assert (pm[b, ..., len(per_row[b]):] == 0).all() and (rec.pairs[b, len(per_row[b]):] == -1).all()
    assert pm[0].abs().sum() > 1  # real mass was read
    da = rec.to_xarray("pair_mass")
    assert da.dims == ("example", "layer", "head", "pair")
    assert da["pair_query"].values[1, 2] == per_row[1][2][0] and da["pair_key"].values[1, 2] == per_row[1][2][1]
    tens = torch.full((2, n_pairs, 2), -1)
    for b, r in enumerate(per_row):
        tens[b, :len(r)] = torch.tensor(r)
    with ins.instrument(m, ins.Plan(probes=ins.Probes(pairs=tens))) as rec_t:
        logits(m, ids, am)
    assert torch.equal(rec_t.pair_mass, pm)
    calls = []

    def fn(start, stop):
        calls.append((start, stop))
        return [[(t, j) for t, j in r if start <= t < stop] for r in per_row]

    with ins.instrument(m, ins.Plan(probes=ins.Probes(pairs=fn))) as rec_f:
        logits(m, ids, am)
    assert calls == [(0, N)] and torch.equal(rec_f.pair_mass, pm)


@pytest.mark.parametrize("arch, cache", [("llama", None), ("mistral", None), ("gemma2", None), ("llama", "static")])
def test_generate_pair_mass_matches_full_forward(arch, cache):
    """Pair masses of decode steps (KV cache, left padding, sliding windows that drop keys, a static cache)
    == a full forward over the generated sequence; the pairs are recorded call by call (prompt queries, then
    each step's), and a function of (start, stop) is called once per call."""
    ids, am = batch()
    m = load(arch, "headlab")
    new = 5
    n_all = N + new - 1
    per_row = _random_pairs(2, n_all, 30, seed=2)
    kw = {} if cache is None else dict(cache_implementation=cache)
    calls = []

    def fn(start, stop):
        calls.append((start, stop))
        return per_row

    with ins.instrument(m, ins.Plan(probes=ins.Probes(pairs=fn))) as rec, torch.no_grad():
        out = m.generate(input_ids=ids, attention_mask=am, max_new_tokens=new, min_new_tokens=new,
                         do_sample=False, pad_token_id=0, **kw)
    assert calls == [(0, N)] + [(t, t + 1) for t in range(N, n_all)]
    seq = out[:, :-1]
    am_full = torch.cat([am, torch.ones(2, new - 1, dtype=am.dtype)], dim=1)
    with ins.instrument(m, ins.Plan(probes=ins.Probes(pairs=per_row, pattern=True))) as full:
        logits(m, seq, am_full)
    for b in range(2):
        got = {tuple(rec.pairs[b, p].tolist()): rec.pair_mass[b, ..., p] for p in range(rec.pairs.shape[1])
               if rec.pairs[b, p, 0] >= 0}
        assert sorted(got) == sorted(set(per_row[b]))  # every pair once (a repeated pair may repeat)
        call = [max(0, t - N + 1) for t, _ in (rec.pairs[b, p].tolist() for p in range(rec.pairs.shape[1])) if t >= 0]
        assert call == sorted(call)  # call by call: the prompt's pairs in the order given, then each step's
        assert [pq for pq in map(tuple, rec.pairs[b].tolist()) if 0 <= pq[0] < N] == [pq for pq in per_row[b]
                                                                                    if pq[0] < N]
        for p, (t, j) in enumerate(per_row[b]):
            if am_full[b, t]:
                torch.testing.assert_close(got[(t, j)], full.pair_mass[b, ..., p], atol=1e-5, rtol=0)
                want = full.pattern[b, :, :, t, j]
                torch.testing.assert_close(full.pair_mass[b, ..., p], want, atol=1e-6, rtol=0)
    assert rec.pair_mass.abs().sum() > 1


def test_pair_probe_tile_and_validation():
    """Plan.tile repeats per-row pairs for every copy; bad pairs raise."""
    ids, am = batch()
    m = load("llama", "headlab")
    per_row = _random_pairs(2, N, 8, seed=3)
    with ins.instrument(m, ins.Plan(probes=ins.Probes(pairs=per_row))) as rec:
        logits(m, ids, am)
    plan = ins.Plan(probes=ins.Probes(pairs=per_row)).tile(2, 2)
    with ins.instrument(m, plan) as rec2:
        logits(m, ids.repeat(2, 1), am.repeat(2, 1))
    torch.testing.assert_close(rec2.pair_mass[2:], rec.pair_mass, atol=1e-6, rtol=0)
    assert torch.equal(rec2.pairs[:2], rec.pairs) and torch.equal(rec2.pairs[2:], rec.pairs)
    for pairs, match in (([(1, -2)], ">= 0"), ([[(1, 0)], [(2, 1)], [(3, 0)]], "rows"),
                         (torch.tensor([[0.5, 1.0]]), "integers"), (torch.zeros(3, 2, 2, dtype=torch.long), "batch")):
        with pytest.raises(ValueError, match=match):
            with ins.instrument(m, ins.Plan(probes=ins.Probes(pairs=pairs))):
                logits(m, ids, am)


def test_offset_probe_validation():
    ids, am = batch()
    m = load("llama", "headlab")
    for offsets, match in (([-1], ">= 0"), ([[1], [2], [3]], "rows"), (torch.tensor([[0.5, 1.0]]), "integers"),
                           (torch.tensor([[1, 2]]), r"\(batch, offset\)")):
        with pytest.raises(ValueError, match=match):
            with ins.instrument(m, ins.Plan(probes=ins.Probes(offsets=offsets))):
                logits(m, ids, am)


# --------------------------------------------------------------------------- shared trunk
def _copies_plan():
    """Copy 1 (rows 2-3) masks two heads of layer 1; layer 0 is steered alike in both copies."""
    plan = ins.Plan().scale_heads([(0, 1)], 0.5)
    return plan.mask_heads([(1, 0), (1, 2)], rows=[2, 3], mode="query")


@pytest.mark.parametrize("arch", ARCHS)
def test_shared_trunk_equals_running_every_copy(arch):
    """Layer 0 once on copy 0, repeated on entering layer 1 == all four rows through every layer, in a
    prefill with left padding and in a cached decode step."""
    ids, am = batch()
    m = load(arch, "headlab")
    with ins.instrument(m, _copies_plan()), torch.no_grad():
        full = m(input_ids=ids.repeat(2, 1), attention_mask=am.repeat(2, 1), use_cache=True)
        nxt = full.logits[:2, -1].argmax(-1, keepdim=True)
        am2 = torch.cat([am, torch.ones_like(am[:, :1])], 1)
        full_step = m(input_ids=nxt.repeat(2, 1), attention_mask=am2.repeat(2, 1), cache=full.cache, use_cache=True)
    with ins.instrument(m, _copies_plan()), ins.shared_trunk(m, 1, 2), torch.no_grad():
        ours = m(input_ids=ids, attention_mask=am, use_cache=True)
        step = m(input_ids=nxt, attention_mask=am2, cache=ours.cache, use_cache=True)
    assert ours.logits.shape == full.logits.shape
    r = am.repeat(2, 1)
    torch.testing.assert_close(real(ours.logits, r), real(full.logits, r), atol=1e-5, rtol=0)
    torch.testing.assert_close(step.logits, full_step.logits, atol=1e-5, rtol=0)
    assert (full.logits[2:] - full.logits[:2]).abs().max() > 1e-3  # the copies really differ


@pytest.mark.parametrize("arch", ["llama", "mistral", "gemma2"])
def test_expand_cache_continues_a_prefill_run_once(arch):
    """A prompt prefilled once (no edits yet), its cache repeated from layer 1, then a masked copy:
    == both copies prefilled separately (DeCoRe's reference prefix)."""
    ids, am = batch()
    m = load(arch, "headlab")
    plan = ins.Plan()
    nxt = torch.tensor([[5], [7]])
    am2 = torch.cat([am, torch.ones_like(am[:, :1])], 1)
    with ins.instrument(m, plan), torch.no_grad():
        pre = m(input_ids=ids.repeat(2, 1), attention_mask=am.repeat(2, 1), use_cache=True)
        plan.mask_heads([(1, 0), (1, 2)], rows=[2, 3], mode="query")
        full = m(input_ids=nxt.repeat(2, 1), attention_mask=am2.repeat(2, 1), cache=pre.cache, use_cache=True)
    plan = ins.Plan()
    with ins.instrument(m, plan), torch.no_grad():
        with ins.shared_trunk(m, 2, 2):
            once = m(input_ids=ids, attention_mask=am, use_cache=True)
        assert once.logits.shape[0] == 2
        ins.expand_cache(once.cache, 1, 2)
        assert once.cache.layers[0].keys.shape[0] == 2 and once.cache.layers[1].keys.shape[0] == 4
        plan.mask_heads([(1, 0), (1, 2)], rows=[2, 3], mode="query")
        with ins.shared_trunk(m, 1, 2):
            ours = m(input_ids=nxt, attention_mask=am2, cache=once.cache, use_cache=True)
    torch.testing.assert_close(ours.logits, full.logits, atol=1e-5, rtol=0)


def test_shared_trunk_refuses_copies_that_differ_below_it():
    ids, am = batch()
    m = load("llama", "headlab")
    plan = ins.Plan().mask_heads([(0, 1)], rows=[3])
    with ins.instrument(m, plan), ins.shared_trunk(m, 1, 2), pytest.raises(ValueError, match="differs between copies"):
        logits(m, ids, am)
    probes = ins.Plan(probes=ins.Probes(argmax=True))
    with ins.instrument(m, probes), ins.shared_trunk(m, 1, 2), pytest.raises(ValueError, match="probes"):
        logits(m, ids, am)
    with pytest.raises(ValueError, match="layer must be in 0..2"), ins.shared_trunk(m, 3, 2):
        pass


# --------------------------------------------------------------------------- plan: typed edits, tile, conflicts
def _row_scale(layer, z, ctx):
    """A callback whose scale depends on each row's own ``z`` (so copy 0's rows must be the ones it sees)."""
    if layer != 1 or ctx.call != 0:
        return None
    return 1.0 + 0.5 * torch.tanh(z[:, :, -1, 0].float())


def _scales(B):
    """Random query scales (layer, head), shared by the rows, and output scales (row, layer, head)."""
    g = torch.Generator().manual_seed(5)
    return 0.5 + torch.rand(2, 4, generator=g), 0.5 + torch.rand(B, 2, 4, generator=g)


def _steered(B):
    """A plan for ``B`` rows using every edit type, per-row and shared (a scale on every head), and probes."""
    q2, osc = _scales(B)
    plan = ins.Plan(probes=ins.Probes(spans=[[(0, 3)], [(4, 9)]], offsets=[[0, 1], [2]], argmax=True))
    plan.add(ins.QueryScale([(0, 1)], 0.0, [1], owner="a"), ins.ScoreZero([(1, 0)], [0]),
             ins.OutputScale([(1, None)], 1.5), ins.KeyBias([(0, 3)], [[(1, 4)], [(5, 8)]], -2.0),
             ins.KeyBias([(1, 2), (1, 3)], [(2, 6), (7, 9)], [-1.0, 0.5], [1]))
    plan.add(*[ins.QueryScale([(ly, h)], float(q2[ly, h])) for ly in range(2) for h in range(4)],
             *[ins.OutputScale([(ly, h)], float(osc[r, ly, h]), [r]) for r in range(B) for ly in range(2)
               for h in range(4)])
    return plan.on_layer(_row_scale)


def _by_hand(B, mirror):
    """:func:`_steered` written directly for two copies of ``B`` rows, row by row."""
    q2, osc = _scales(B)
    rows = (lambda rs: [r + c * B for c in range(2) for r in rs]) if mirror else (lambda rs: list(rs))
    plan = ins.Plan(probes=ins.Probes(spans=[[(0, 3)], [(4, 9)]] * 2, offsets=[[0, 1], [2]] * 2, argmax=True))
    spans = [[(1, 4)], [(5, 8)]] * (2 if mirror else 1)
    plan.add(ins.QueryScale([(0, 1)], 0.0, rows([1])), ins.ScoreZero([(1, 0)], rows([0])),
             ins.OutputScale([(1, None)], 1.5, rows(range(B))), ins.KeyBias([(0, 3)], spans, -2.0, rows(range(B))),
             ins.KeyBias([(1, 2), (1, 3)], [(2, 6), (7, 9)], [-1.0, 0.5], rows([1])))
    plan.add(*[ins.QueryScale([(ly, h)], float(q2[ly, h]), rows(range(B))) for ly in range(2) for h in range(4)],
             *[ins.OutputScale([(ly, h)], float(osc[r, ly, h]), rows([r])) for r in range(B) for ly in range(2)
               for h in range(4)])

    def scale(layer, z, ctx):
        s = _row_scale(layer, z, ctx)
        if s is None or mirror:
            return s
        return torch.cat([s[:B], torch.ones_like(s[B:])])

    return plan.on_layer(scale)


@pytest.mark.parametrize("mirror", [True, False])
def test_tile_equals_the_plan_written_row_by_row(mirror):
    """``Plan.tile`` (mirror: every copy like its source row; else copy 0 only) == the plan for ``2B`` rows
    written by hand: same logits and probes on two copies of a left-padded batch."""
    ids, am = batch()
    B = ids.shape[0]
    m = load("llama", "headlab")
    two = (ids.repeat(2, 1), am.repeat(2, 1))
    plan = _steered(B)
    tiled = plan.tile(2, B, mirror=mirror)
    assert [type(e) for e in tiled.edits] == [type(e) for e in plan.edits] and len(plan.edits) == 6 + 8 + 8 * B
    assert tiled.edits[0].owner == "a" and tiled.edits[0].rows == ([1, 3] if mirror else [1])
    assert tiled.edits[5].rows == (None if mirror else [0, 1])  # a scale shared by the rows
    assert tiled.edits[13].rows == ([0, 2] if mirror else [0])  # a scale of row 0
    with ins.instrument(m, tiled) as rec:
        out = logits(m, *two)
    with ins.instrument(m, _by_hand(B, mirror)) as ref_rec:
        ref = logits(m, *two)
    with ins.instrument(m, plan) as alone_rec:
        alone = logits(m, ids, am)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=0)
    torch.testing.assert_close(real(out[:B], am), real(alone, am), atol=1e-5, rtol=0)
    assert (real(out[B:], am) - real(alone, am)).abs().max() < 1e-5 if mirror else \
        (real(out[B:], am) - real(alone, am)).abs().max() > 1e-3
    for name in ("span_mass", "offset_mass", "argmax"):
        torch.testing.assert_close(getattr(rec, name), getattr(ref_rec, name), atol=1e-6, rtol=0)
        torch.testing.assert_close(getattr(rec, name)[:B], getattr(alone_rec, name), atol=1e-5, rtol=0)
    assert plan.tile(1, B).edits == plan.edits and plan.tile(1, B) is not plan
    with pytest.raises(ValueError, match="copies and rows"):
        plan.tile(0, B)


def test_edits_and_edits_on():
    cb_any, cb_13 = (lambda *a: None), (lambda *a: None)
    plan = ins.Plan().scale_queries([(0, 1)], 0.5).scale_heads([0], 0.0).bias_keys([(1, 2)], [(0, 2)], -1.0)
    plan.on_layer(cb_any).on_layer(cb_13, heads=[(1, 3)])
    qs, osc, kb, la, lb = plan.edits
    assert isinstance(qs, ins.QueryScale) and qs.heads == [(0, 1)] and qs.factor == 0.5 and qs.rows is None
    assert isinstance(osc, ins.OutputScale) and osc.heads == [(0, None)]
    assert isinstance(kb, ins.KeyBias) and isinstance(la, ins.LayerCallback) and la.heads is None
    assert plan.callbacks == (cb_any, cb_13)
    assert plan.edits_on(0, 1) == [qs, osc, la]
    assert plan.edits_on(0, 2) == [osc, la]
    assert plan.edits_on(1, 2) == [kb, la]
    assert plan.edits_on(1, 3) == [la, lb]
    assert [e.kind for e in plan.edits] == ["q_scale", "out_scale", "key_bias", "out_scale", "out_scale"]
    for dense in ("q_scale", "score_zero", "out_scale", "key_spans", "key_bias"):  # typed edits only
        with pytest.raises(TypeError, match=dense):
            ins.Plan(**{dense: torch.ones(2, 4)})
    assert ins.per_row_spans([(1, 2)], 2) == [[(1, 2)], [(1, 2)]]
    assert ins.per_row_spans([[(1, 2)], []], 2) == [[(1, 2)], []]
    with pytest.raises(ValueError, match="expected 3"):
        ins.per_row_spans([[(1, 2)], []], 3)


class _Config:
    def __init__(self, kind):
        self.kind = kind


def test_conflicts_name_both_methods_the_head_and_the_edit():
    plan = ins.Plan().scale_heads([(1, 2)], 2.0, owner="head_scale")
    with pytest.raises(ins.SteeringConflictError,
                       match=r"steering conflict: 'head_scale' and 'head_mask' both apply a output scale/mask to "
                             r"head \(1, 2\) on the same batch rows"):
        plan.mask_heads([(1, 2)], mode="output", owner="head_mask")
    assert issubclass(ins.SteeringConflictError, ValueError) and len(plan.edits) == 1
    plan.scale_heads([(1, 2)], 3.0, owner="head_scale")  # the same owner may add again
    plan.mask_heads([(1, 2)], mode="query", owner="head_mask")  # another kind of edit
    plan.mask_heads([(1, 2)], mode="output")  # no owner: never checked
    with pytest.raises(ins.SteeringConflictError, match=r"'head_scale' and 'vhr'.*head \(1, 2\)"):
        plan.on_layer(lambda *a: None, heads=[1], rows=[0], owner="vhr")  # a callback declaring layer 1
    plan.on_layer(lambda *a: None, owner="vhr")  # declaring no heads: never checked
    with pytest.raises(ins.SteeringConflictError, match=r"query scale/mask to every head of layer 0"):
        ins.Plan().scale_queries([0], 0.5, owner="x").scale_queries([0], 2.0, owner="y")
    # configs as owners: named by their kind, one owner per object
    a, b = _Config("pasta"), _Config("pasta")
    rows = ins.Plan().bias_keys([(0, 0)], [(1, 2)], -1.0, rows=[0], owner=a)
    assert rows.edits[0].owner == "pasta" and rows.edits[0].instance is a
    rows.bias_keys([(0, 0)], [(1, 2)], -1.0, rows=[0], owner=a).bias_keys([(0, 0)], [(1, 2)], -1.0, rows=[1], owner=b)
    with pytest.raises(ins.SteeringConflictError, match="'pasta' and 'pasta'"):
        rows.bias_keys([(0, 0), (0, 1)], [(1, 2)], -1.0, owner=b)
    # add() is all or none
    n = len(rows.edits)
    with pytest.raises(ins.SteeringConflictError):
        rows.add(ins.QueryScale([(0, 0)], 0.0, owner="p"), ins.QueryScale([(0, 0)], 2.0, owner="q"))
    assert len(rows.edits) == n
