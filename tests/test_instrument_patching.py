"""The head output replacement edit (``ReplaceZ`` / ``Plan.patch_z``) on tiny random Llama (GQA), Qwen2 and
GPT-2 models, against independent references: the clean run's own logits, and an eager copy of the model whose
output projection gets a forward pre-hook that overwrites one head's slice of its input."""

from __future__ import annotations

import pytest
import torch

from headlab import Plan, Probes, ReplaceZ, SteeringConflictError, forward

from fixtures.circuits import ARCHS, kv_projection_hooks, models

PAD = 3


def _setup(arch: str):
    tok, lm, out = models(arch)
    return lm, out["eager"], len(tok)


def _batch(vocab: int, B: int = 2, n: int = 9, pad: int = PAD, seed: int = 0):
    """Random ids, row 1 (and every odd row) left-padded by ``pad``."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, vocab, (B, n), generator=g)
    mask = torch.ones(B, n, dtype=torch.long)
    mask[1::2, :pad] = 0
    ids[1::2, :pad] = 0
    return ids, mask


def _o_proj(model, arch: str, layer: int):
    return model.transformer.h[layer].attn.c_proj if arch == "gpt2" else model.model.layers[layer].self_attn.o_proj


def _logits(model, ids, mask):
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits


def _real(x, mask):
    return x[mask.bool()]


@pytest.mark.parametrize("backend", ["auto", "torch"])
@pytest.mark.parametrize("arch", ARCHS)
def test_every_head_replaced_by_the_clean_run_reproduces_the_clean_logits(arch, backend):
    """At the positions whose token the corruption left alone (the embedding and every head output the clean
    ones, so the MLPs too)."""
    lm, _, vocab = _setup(arch)
    clean, mask = _batch(vocab, seed=1)
    corrupt = clean.clone()
    corrupt[:, 4:6] = _batch(vocab, seed=2)[0][:, 4:6]  # two tokens in the middle differ
    same = mask.clone()
    same[:, 4:6] = 0  # positions of unchanged tokens: every input of their residual stream is the clean one
    L, H = lm.geometry.n_layers, lm.geometry.n_heads
    out_clean, rec = forward(lm, clean, Plan(probes=Probes(z_positions="all")), attention_mask=mask)
    z = rec.z  # (B, L, H, T, D)
    plan = Plan(backend=backend)
    for layer in range(L):
        plan.patch_z([(layer, h) for h in range(H)], z[:, layer])
    out, _ = forward(lm, corrupt, plan, attention_mask=mask)
    out_corrupt, _ = forward(lm, corrupt, Plan(backend=backend), attention_mask=mask)
    torch.testing.assert_close(_real(out.logits, same), _real(out_clean.logits, same), atol=1e-5, rtol=0)
    assert (_real(out_corrupt.logits, same) - _real(out_clean.logits, same)).abs().max() > 1e-2
    # a recording of z in the patched run reads the replaced values
    plan.probes = Probes(z_positions="all")
    _, rec2 = forward(lm, corrupt, plan, attention_mask=mask)
    torch.testing.assert_close(rec2.z, z, atol=0, rtol=0)


@pytest.mark.parametrize("mode", ["replace", "add"])
@pytest.mark.parametrize("backend", ["auto", "torch"])
@pytest.mark.parametrize("arch", ARCHS)
def test_one_head_at_one_position_equals_an_o_proj_pre_hook(arch, backend, mode):
    lm, eager, vocab = _setup(arch)
    ids, mask = _batch(vocab)
    D = lm.geometry.head_dim
    layer, head, row, position = 1, 2, 1, 6  # row 1 is left-padded: position 6 is its fourth token
    values = torch.randn(D, generator=torch.Generator().manual_seed(3))

    def hook(module, args):
        x = args[0].clone()
        if mode == "replace":
            x[row, position, head * D:(head + 1) * D] = values
        else:
            x[row, position, head * D:(head + 1) * D] += values
        return (x,)

    handle = _o_proj(eager, arch, layer).register_forward_pre_hook(hook)
    try:
        want = _logits(eager, ids, mask)
    finally:
        handle.remove()
    base = _logits(eager, ids, mask)
    build = Plan.patch_z if mode == "replace" else Plan.add_z
    plan = build(Plan(backend=backend), [(layer, head)], values, rows=[row], positions=[position])
    out, _ = forward(lm, ids, plan, attention_mask=mask)
    torch.testing.assert_close(_real(out.logits, mask), _real(want, mask), atol=2e-5, rtol=0)
    torch.testing.assert_close(out.logits[0], base[0], atol=2e-5, rtol=0)  # row 0 untouched
    assert (out.logits[row, position:] - base[row, position:]).abs().max() > 1e-3
    torch.testing.assert_close(out.logits[row, PAD:position], base[row, PAD:position], atol=2e-5, rtol=0)


@pytest.mark.parametrize("arch", ARCHS)
def test_rows_of_a_left_padded_batch_equal_each_row_patched_alone(arch):
    """Row 0 patches (0, 1) at every position, row 1 (left-padded by PAD) patches (1, 3) at two absolute
    positions; each equals its unpadded prompt patched alone at the same tokens."""
    lm, _, vocab = _setup(arch)
    ids, mask = _batch(vocab, seed=4)
    T, D = ids.shape[1], lm.geometry.head_dim
    g = torch.Generator().manual_seed(5)
    v0, v1 = torch.randn(T, D, generator=g), torch.randn(2, D, generator=g)
    plan = Plan().patch_z([(0, 1)], v0[None, None], rows=[0]).patch_z([(1, 3)], v1[None, None], rows=[1],
                                                                        positions=[PAD + 1, T - 1])
    out, _ = forward(lm, ids, plan, attention_mask=mask)
    alone0, _ = forward(lm, ids[:1], Plan().patch_z([(0, 1)], v0), attention_mask=mask[:1])
    real1 = ids[1:, PAD:]
    alone1, _ = forward(lm, real1, Plan().patch_z([(1, 3)], v1, positions=[1, T - 1 - PAD]))
    torch.testing.assert_close(out.logits[0], alone0.logits[0], atol=2e-5, rtol=0)
    torch.testing.assert_close(out.logits[1, PAD:], alone1.logits[0], atol=2e-5, rtol=0)
    plain, _ = forward(lm, real1)
    assert (alone1.logits - plain.logits).abs().max() > 1e-3


@pytest.mark.parametrize("mirror", [True, False])
def test_tile_repeats_the_values_of_each_source_row(mirror):
    lm, _, vocab = _setup("llama")
    ids, mask = _batch(vocab, seed=6)
    B, T, D = ids.shape[0], ids.shape[1], lm.geometry.head_dim
    g = torch.Generator().manual_seed(7)
    per_row = torch.randn(B, 1, T, D, generator=g)
    shared = torch.randn(1, 1, D, generator=g)
    plan = Plan().patch_z([(0, 2)], per_row).patch_z([(1, 0)], shared, rows=[1], positions=[T - 2])
    tiled = plan.tile(2, B, mirror=mirror)
    assert tiled.edits[0].rows == ([0, 2, 1, 3] if mirror else [0, 1])
    assert tiled.edits[1].rows == ([1, 3] if mirror else [1])
    by_hand = Plan()
    if mirror:
        by_hand.patch_z([(0, 2)], torch.cat([per_row, per_row]))
        by_hand.patch_z([(1, 0)], shared, rows=[1, 3], positions=[T - 2])
    else:
        by_hand.patch_z([(0, 2)], per_row, rows=[0, 1]).patch_z([(1, 0)], shared, rows=[1], positions=[T - 2])
    two_ids, two_mask = ids.repeat(2, 1), mask.repeat(2, 1)
    out, _ = forward(lm, two_ids, tiled, attention_mask=two_mask)
    ref, _ = forward(lm, two_ids, by_hand, attention_mask=two_mask)
    alone, _ = forward(lm, ids, plan, attention_mask=mask)
    plain, _ = forward(lm, ids, attention_mask=mask)
    torch.testing.assert_close(out.logits, ref.logits, atol=1e-6, rtol=0)
    torch.testing.assert_close(_real(out.logits[:B], mask), _real(alone.logits, mask), atol=1e-5, rtol=0)
    copy1 = _real(out.logits[B:], mask)
    want1 = _real((alone if mirror else plain).logits, mask)
    torch.testing.assert_close(copy1, want1, atol=1e-5, rtol=0)
    assert (_real(alone.logits, mask) - _real(plain.logits, mask)).abs().max() > 1e-3


def test_gradient_flows_to_the_values():
    """d logit / d values through the replacement equals finite differences of the patched logit."""
    lm, _, vocab = _setup("qwen2")
    lm.model.double()
    try:
        ids, mask = _batch(vocab, B=1, pad=0, seed=8)
        T, D = ids.shape[1], lm.geometry.head_dim
        _, rec = forward(lm, ids, Plan(probes=Probes(z_positions="all")))
        z0 = rec.z[0, 0, 1].clone()  # (T, D) of head (0, 1)
        leaf = z0.clone().requires_grad_(True)
        out, _ = forward(lm, ids, Plan().patch_z([(0, 1)], leaf), grad=True)
        (grad,) = torch.autograd.grad(out.logits[0, -1, 5], leaf)
        direction = torch.randn(T, D, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
        eps = 1e-3  # the RMS norms compute in float32 even in a float64 model: smaller steps are noise
        plus, _ = forward(lm, ids, Plan().patch_z([(0, 1)], z0 + eps * direction))
        minus, _ = forward(lm, ids, Plan().patch_z([(0, 1)], z0 - eps * direction))
        fd = float(plus.logits[0, -1, 5] - minus.logits[0, -1, 5]) / (2 * eps)
        assert float((grad * direction).sum()) == pytest.approx(fd, rel=1e-3)
        assert abs(fd) > 1e-4
    finally:
        lm.model.float()


def test_an_added_zero_leaf_gets_the_total_derivative_a_replacement_cuts():
    """With every head of both layers patched, a replaced layer-0 z reaches the logits only around layer 1's
    heads; an added zero keeps those paths: its gradient is the one of a single replaced head."""
    lm, _, vocab = _setup("llama")
    ids, mask = _batch(vocab, B=1, pad=0, seed=10)
    L, H = lm.geometry.n_layers, lm.geometry.n_heads
    _, rec = forward(lm, ids, Plan(probes=Probes(z_positions="all")))
    z = rec.z[0]
    leaf = z[0, 1].clone().requires_grad_(True)
    single, _ = forward(lm, ids, Plan().patch_z([(0, 1)], leaf), grad=True)
    (want,) = torch.autograd.grad(single.logits[0, -1, 5], leaf)
    zeros = [torch.zeros_like(z[layer], requires_grad=True) for layer in range(L)]
    plan = Plan()
    for layer in range(L):
        plan.add_z([(layer, h) for h in range(H)], zeros[layer][None])
    added, _ = forward(lm, ids, plan, grad=True)
    (got,) = torch.autograd.grad(added.logits[0, -1, 5], zeros[0])
    torch.testing.assert_close(got[1], want, atol=1e-6, rtol=1e-5)
    leaves = [z[layer].clone().requires_grad_(True) for layer in range(L)]
    plan = Plan()
    for layer in range(L):
        plan.patch_z([(layer, h) for h in range(H)], leaves[layer][None])
    replaced, _ = forward(lm, ids, plan, grad=True)
    (cut,) = torch.autograd.grad(replaced.logits[0, -1, 5], leaves[0])
    assert (cut[1] - want).abs().max() > 1e-3


def test_validation_conflicts_and_touches():
    lm, _, vocab = _setup("llama")
    with pytest.raises(ValueError, match="explicit"):
        ReplaceZ([(0, None)], torch.zeros(16))
    ids, mask = _batch(vocab)
    bad = Plan().patch_z([(0, 1), (0, 2)], torch.zeros(3, 2, 1, 16), positions=[1])
    with pytest.raises(ValueError, match=r"do not broadcast to \(rows, heads, positions, head_dim\) = \(2, 2, 1, 16\)"):
        forward(lm, ids, bad, attention_mask=mask)
    with pytest.raises(ValueError, match="head_dim 8"):
        forward(lm, ids, Plan().patch_z([(0, 1)], torch.zeros(8)), attention_mask=mask)
    plan = Plan().patch_z([(1, 2)], torch.zeros(16), rows=[0], owner="a")
    assert plan.touches(1) and not plan.touches(0)
    assert plan.edits_on(1, 2) == plan.edits and plan.edits_on(1, 1) == []
    plan.patch_z([(1, 2)], torch.ones(16), rows=[1], owner="b")  # other rows: no conflict
    with pytest.raises(SteeringConflictError, match="'a' and 'c' both apply a head output replacement to head"):
        plan.patch_z([(1, 2)], torch.ones(16), rows=[0], owner="c")
    plan.scale_heads([(1, 2)], 0.5, owner="c")  # another kind of edit on the head: no conflict


# --------------------------------------------------------------------------- keys and values (ReplaceKV)
@pytest.mark.parametrize("backend", ["auto", "torch"])
@pytest.mark.parametrize("arch", ARCHS)
def test_every_kv_head_replaced_by_the_clean_run_reproduces_the_clean_logits(arch, backend):
    lm, _, vocab = _setup(arch)
    clean, mask = _batch(vocab, seed=11)
    corrupt = clean.clone()
    corrupt[:, 4:6] = _batch(vocab, seed=12)[0][:, 4:6]
    same = mask.clone()
    same[:, 4:6] = 0
    L, K = lm.geometry.n_layers, lm.geometry.n_kv_heads
    out_clean, rec = forward(lm, clean, Plan(probes=Probes(kv_positions="all")), attention_mask=mask)
    assert rec.k.shape[2] == K and rec.kv_positions == list(range(clean.shape[1]))
    assert rec.to_xarray("k").dims == ("example", "layer", "kv_head", "position", "head_dim")
    plan = Plan(backend=backend)
    for layer in range(L):
        plan.patch_kv([(layer, k) for k in range(K)], rec.k[:, layer], rec.v[:, layer])
    out, _ = forward(lm, corrupt, plan, attention_mask=mask)
    plain, _ = forward(lm, corrupt, Plan(backend=backend), attention_mask=mask)
    torch.testing.assert_close(_real(out.logits, same), _real(out_clean.logits, same), atol=1e-5, rtol=0)
    assert (_real(plain.logits, same) - _real(out_clean.logits, same)).abs().max() > 1e-2


@pytest.mark.parametrize("part", ["keys", "values", "both"])
@pytest.mark.parametrize("arch", ARCHS)
def test_one_kv_head_at_one_position_equals_projection_hooks(arch, part):
    """The clean prompt's key / value of KV head 1 at one position into the corrupted run (row 1, left-padded)
    == the key / value projection's output there overwritten by the clean run's (the rotary embedding then
    turns it into the same key: the position is the same)."""
    lm, eager, vocab = _setup(arch)
    clean, mask = _batch(vocab, seed=13)
    corrupt = clean.clone()
    corrupt[:, 4:7] = _batch(vocab, seed=14)[0][:, 4:7]
    layer, kvh, row, position = 1, 1, 1, 5
    D = lm.geometry.head_dim
    seen: dict = {}

    def keep(name, out):
        seen[name] = out.detach().clone()
        return out
    handles = kv_projection_hooks(eager, arch, layer, keep)
    try:
        _logits(eager, clean, mask)
    finally:
        for h in handles:
            h.remove()
    wanted = {"keys": ("k",), "values": ("v",), "both": ("k", "v")}[part]

    def overwrite(name, out):
        if name not in wanted:
            return out
        out = out.clone()
        out[row, position, kvh * D:(kvh + 1) * D] = seen[name][row, position, kvh * D:(kvh + 1) * D]
        return out
    handles = kv_projection_hooks(eager, arch, layer, overwrite)
    try:
        want = _logits(eager, corrupt, mask)
    finally:
        for h in handles:
            h.remove()
    _, rec = forward(lm, clean, Plan(probes=Probes(kv_positions=[position], layers=[layer])), attention_mask=mask)
    k, v = rec.k[row, 0, kvh], rec.v[row, 0, kvh]  # (1, D) at the position
    plan = Plan().patch_kv([(layer, kvh)], k if "k" in wanted else None, v if "v" in wanted else None,
                           rows=[row], positions=[position])
    out, _ = forward(lm, corrupt, plan, attention_mask=mask)
    plain = _logits(eager, corrupt, mask)
    torch.testing.assert_close(_real(out.logits, mask), _real(want, mask), atol=2e-5, rtol=0)
    assert (out.logits[row, position:] - plain[row, position:]).abs().max() > 1e-4
    torch.testing.assert_close(out.logits[0], plain[0], atol=2e-5, rtol=0)


def test_kv_replacement_tiles_and_validates():
    lm, _, vocab = _setup("qwen2")
    ids, mask = _batch(vocab, seed=15)
    B, D = ids.shape[0], lm.geometry.head_dim
    g = torch.Generator().manual_seed(16)
    keys = torch.randn(B, 1, 2, D, generator=g)
    plan = Plan().patch_kv([(0, 1)], keys, None, positions=[PAD, PAD + 2])
    assert plan.touches(0) and not plan.touches(1) and plan.edits_on(0, 1) == []
    tiled = plan.tile(2, B)
    by_hand = Plan().patch_kv([(0, 1)], torch.cat([keys, keys]), None, positions=[PAD, PAD + 2])
    out, _ = forward(lm, ids.repeat(2, 1), tiled, attention_mask=mask.repeat(2, 1))
    ref, _ = forward(lm, ids.repeat(2, 1), by_hand, attention_mask=mask.repeat(2, 1))
    alone, _ = forward(lm, ids, plan, attention_mask=mask)
    torch.testing.assert_close(out.logits, ref.logits, atol=1e-6, rtol=0)
    torch.testing.assert_close(_real(out.logits[B:], mask), _real(alone.logits, mask), atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="give keys, values or both"):
        Plan().patch_kv([(0, 1)])
    with pytest.raises(ValueError, match="kv head out of range"):
        forward(lm, ids, Plan().patch_kv([(0, 2)], torch.zeros(D)), attention_mask=mask)


@pytest.mark.parametrize("arch", ARCHS)
def test_an_addition_from_a_position_on_equals_an_o_proj_pre_hook_under_the_kv_cache(arch):
    """``AddZ(from_position=p)``: row 0 from its last prompt token on, row 1 (left-padded) from a position inside
    its prompt, through a prefill and three decode steps of a KV cache; the eager reference adds at every
    absolute position >= p of the whole sequence in one forward."""
    from headlab import instrumented

    lm, eager, vocab = _setup(arch)
    ids, mask = _batch(vocab, seed=11)
    T, D = ids.shape[1], lm.geometry.head_dim
    new = _batch(vocab, seed=12)[0][:, :3]
    g = torch.Generator().manual_seed(13)
    v0, v1 = torch.randn(2, 1, D, generator=g), torch.randn(1, 1, D, generator=g)  # (heads, 1, D), (1, 1, D)
    starts = {0: T - 1, 1: PAD + 2}
    plan = Plan().add_z([(0, 1), (1, 3)], v0, rows=[0], from_position=starts[0])
    plan.add_z([(1, 0)], v1, rows=[1], from_position=starts[1])
    steps = []
    with torch.no_grad(), instrumented(lm, plan):
        m = mask
        out = lm.model(input_ids=ids, attention_mask=m, position_ids=(m.cumsum(-1) - 1).clamp(min=0), use_cache=True)
        steps.append(out.logits[:, -1])
        for t in range(new.shape[1]):
            m = torch.cat([m, torch.ones(m.shape[0], 1, dtype=m.dtype)], 1)
            out = lm.model(input_ids=new[:, t:t + 1], attention_mask=m, position_ids=m.sum(-1, keepdim=True) - 1,
                           cache=out.cache, use_cache=True)
            steps.append(out.logits[:, -1])
    adds = {0: [((0, 1), v0[0, 0]), ((1, 3), v0[1, 0])], 1: [((1, 0), v1[0, 0])]}
    handles = []
    for layer in range(2):
        def hook(module, args, layer=layer):
            x = args[0].clone()
            for row, items in adds.items():
                for (ly, h), v in items:
                    if ly == layer:
                        x[row, starts[row]:, h * D:(h + 1) * D] += v
            return (x,)
        handles.append(_o_proj(eager, arch, layer).register_forward_pre_hook(hook))
    full_ids, full_mask = torch.cat([ids, new], 1), torch.cat([mask, torch.ones_like(new)], 1)
    try:
        want = _logits(eager, full_ids, full_mask)
    finally:
        for h in handles:
            h.remove()
    base = _logits(eager, full_ids, full_mask)
    got = torch.stack(steps, 1)  # (B, 1 + 3, vocab): the predictions at positions T-1 .. T+2
    torch.testing.assert_close(got, want[:, T - 1:], atol=2e-5, rtol=0)
    assert (got - base[:, T - 1:]).abs().amax(-1).min() > 1e-4  # every step of both rows is steered
    with pytest.raises(ValueError, match="give positions or from_position, not both"):
        Plan().add_z([(0, 1)], v1, positions=[1], from_position=1)
    with pytest.raises(ValueError, match="positions axis of size 1"):
        Plan().add_z([(0, 1)], torch.zeros(1, 2, D), from_position=1)


def test_additions_below_a_shared_trunk_apply_when_every_copy_has_them():
    """Two copies of a batch sharing layer 0 (``shared_trunk`` at layer 1): a mirrored addition on a layer-0 head
    gives what the copies give run apart; one on copy 0 only is refused."""
    from headlab import shared_trunk

    lm, _, vocab = _setup("llama")
    ids, mask = _batch(vocab, seed=14)
    B, D = ids.shape[0], lm.geometry.head_dim
    v = torch.randn(1, 1, D, generator=torch.Generator().manual_seed(15))
    plan = Plan().add_z([(0, 2)], v, from_position=4).tile(2, B, mirror=True)
    plan.mask_heads([(1, 1)], rows=list(range(B, 2 * B)))
    apart, _ = forward(lm, ids.repeat(2, 1), plan, attention_mask=mask.repeat(2, 1))
    with shared_trunk(lm.model, 1, 2):
        shared, _ = forward(lm, ids, plan, attention_mask=mask)
    torch.testing.assert_close(_real(shared.logits, mask.repeat(2, 1)), _real(apart.logits, mask.repeat(2, 1)),
                               atol=1e-5, rtol=0)
    one = Plan().add_z([(0, 2)], v, from_position=4).tile(2, B, mirror=False)
    with shared_trunk(lm.model, 1, 2), pytest.raises(ValueError, match="differs between copies of the batch"):
        forward(lm, ids, one, attention_mask=mask)
