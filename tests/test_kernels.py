"""headlab.kernels: every path against a naive eager reference (float64, materialised scores).

The Triton path is checked by tests/test_kernels_triton.py (TRITON_INTERPRET=1); this module checks the
torch and sdpa paths; the shared reference and case generator are in tests/fixtures/kernels.py.
"""

from __future__ import annotations

import math

import pytest
import torch

from headlab.kernels import attention

from fixtures.kernels import (
    ALL_PROBES,
    AllocationSpy,
    PeakMemorySpy,
    check,
    make_case,
    pasta_reweighted,
    reference,
)

SHAPES = [
    # (B, H, Hkv, Nq, Nk, D)
    (2, 4, 4, 9, 9, 8),  # MHA
    (2, 4, 2, 9, 9, 8),  # GQA 2
    (2, 8, 2, 13, 13, 16),  # GQA 4
    (1, 4, 1, 7, 7, 8),  # MQA
    (2, 4, 2, 1, 11, 8),  # decode step with past keys
    (2, 4, 2, 3, 12, 8),  # chunked prefill / several queries with past
]


# --------------------------------------------------------------------------- torch path
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("edits", [False, True], ids=["plain", "edits"])
def test_torch_path_matches_reference(shape, edits):
    B, H, Hkv, Nq, Nk, D = shape
    q, k, v, kpm, kw = make_case(B, H, Hkv, Nq, Nk, D, edits=edits, pad=(0, 3) if B > 1 else (2,))
    scale = D**-0.5
    out, st = attention(q, k, v, scale=scale, key_padding_mask=kpm, backend="torch", block_q=4, **ALL_PROBES, **kw)
    assert st.backend == "torch"
    ref = reference(q, k, v, scale=scale, key_padding_mask=kpm, **kw)
    check(out, st, ref, atol=1e-5)


@pytest.mark.parametrize("budget", [40, 200, 1000])
def test_torch_path_blocks_of_head_groups(monkeypatch, budget):
    """A small block budget splits the heads into groups of kv heads (with their query heads), then shrinks
    the query block: the same results for every edit and probe, with GQA 2, padding, a window and a general
    mask."""
    import importlib

    tmod = importlib.import_module("headlab.kernels.torch_attention")
    monkeypatch.setattr(tmod, "_MAX_BLOCK_ELEMS", budget)
    q, k, v, kpm, kw = make_case(2, 4, 2, 10, 10, 8, pad=(0, 2))
    am = torch.rand(2, 4, 10, 10, generator=torch.Generator().manual_seed(5)) > 0.2
    for extra in (dict(window=4), dict(attn_mask=am, causal=False), dict(softcap=2.0)):
        out, st = attention(q, k, v, scale=0.5, key_padding_mask=kpm, backend="torch", **ALL_PROBES, **kw, **extra)
        ref = reference(q, k, v, scale=0.5, key_padding_mask=kpm, **kw, **extra)
        check(out, st, ref, atol=1e-5)


@pytest.mark.parametrize("softcap,window,causal", [(5.0, None, True), (None, 4, True), (3.0, 3, True),
                                                  (None, None, False), (None, 3, False)])
def test_torch_softcap_window_noncausal(softcap, window, causal):
    q, k, v, kpm, kw = make_case(2, 4, 2, 10, 10, 8, pad=(0, 2))
    q = q * 3  # large scores so the softcap bites
    out, st = attention(q, k, v, scale=0.5, causal=causal, key_padding_mask=kpm, softcap=softcap, window=window,
                        backend="torch", block_q=3, **ALL_PROBES, **kw)
    ref = reference(q, k, v, scale=0.5, causal=causal, key_padding_mask=kpm, softcap=softcap, window=window, **kw)
    check(out, st, ref, atol=1e-5)


def test_torch_window_decode_with_past():
    q, k, v, kpm, kw = make_case(2, 4, 2, 2, 14, 8, pad=(0, 5))
    out, st = attention(q, k, v, scale=0.3, key_padding_mask=kpm, window=5, backend="torch", **ALL_PROBES, **kw)
    ref = reference(q, k, v, scale=0.3, key_padding_mask=kpm, window=5, **kw)
    check(out, st, ref, atol=1e-5)


def test_general_attn_mask():
    q, k, v, kpm, kw = make_case(2, 4, 2, 8, 8, 8, pad=(0, 2))
    am = torch.rand(2, 1, 8, 8, generator=torch.Generator().manual_seed(1)) > 0.3
    am[:, :, :, 0] = True
    for backend in ("torch", "sdpa"):
        extra = ALL_PROBES | kw if backend == "torch" else {}
        out, st = attention(q, k, v, scale=0.3, causal=False, key_padding_mask=kpm, attn_mask=am, backend=backend,
                            **extra)
        ref = reference(q, k, v, scale=0.3, causal=False, key_padding_mask=kpm, attn_mask=am,
                        **(kw if backend == "torch" else {}))
        if backend == "torch":
            check(out, st, ref, atol=1e-5)
        else:
            torch.testing.assert_close(out.double(), ref["z"], atol=1e-5, rtol=0)


@pytest.mark.parametrize("dtype,atol", [(torch.bfloat16, 2e-2), (torch.float16, 4e-3)])
def test_torch_half_precision(dtype, atol):
    q, k, v, kpm, kw = make_case(2, 4, 2, 9, 9, 16, dtype=dtype)
    out, st = attention(q, k, v, scale=0.25, key_padding_mask=kpm, backend="torch", **ALL_PROBES, **kw)
    assert out.dtype == dtype and st.entropy.dtype == torch.float32
    ref = reference(q, k, v, scale=0.25, key_padding_mask=kpm, **kw)
    check(out, st, ref, atol=atol)


@pytest.mark.parametrize("shape", SHAPES[:5], ids=lambda s: "x".join(map(str, s)))
def test_sdpa_path_matches_reference(shape):
    B, H, Hkv, Nq, Nk, D = shape
    q, k, v, kpm, _ = make_case(B, H, Hkv, Nq, Nk, D, edits=False, spans=False)
    for window in (None, 3):
        out, st = attention(q, k, v, scale=0.4, key_padding_mask=kpm, window=window)  # auto -> sdpa
        assert st.backend == "sdpa"
        ref = reference(q, k, v, scale=0.4, key_padding_mask=kpm, window=window)
        torch.testing.assert_close(out.double(), ref["z"], atol=1e-5, rtol=0)
        assert torch.isfinite(out).all()


@pytest.mark.parametrize("shape", SHAPES[:5], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("shared", [True, False], ids=["bias-per-kv-head", "bias-per-query-head"])
def test_sdpa_path_takes_scales_and_key_bias(shape, shared):
    """Query/output scales and finite key biases run on SDPA (auto) and equal the reference."""
    B, H, Hkv, Nq, Nk, D = shape
    q, k, v, kpm, kw = make_case(B, H, Hkv, Nq, Nk, D, spans=False)
    kw.pop("score_zero")
    if shared:
        kb = kw["key_bias"].view(B, Hkv, H // Hkv, -1)[:, :, :1]
        kw["key_bias"] = kb.expand(B, Hkv, H // Hkv, kb.shape[-1]).reshape(B, H, -1).clone()
    for window in (None, 3):
        out, st = attention(q, k, v, scale=0.4, key_padding_mask=kpm, window=window, **kw)
        assert st.backend == "sdpa"
        ref = reference(q, k, v, scale=0.4, key_padding_mask=kpm, window=window, **kw)
        torch.testing.assert_close(out.double(), ref["z"], atol=1e-5, rtol=0)


def test_sdpa_key_bias_path_is_linear_memory_and_infinite_bias_uses_torch():
    B, H, N, D = 1, 2, 512, 8
    q, k, v = (torch.randn(B, H, N, D) for _ in range(3))
    spans = torch.tensor([[[0, 100], [200, N]]])
    seen: list[int] = []

    with AllocationSpy(seen):
        _, st = attention(q, k, v, scale=0.3, key_spans=spans, key_bias=torch.full((1, 2, 2), math.log(0.01)))
    assert st.backend == "sdpa"
    assert max(seen) < B * H * N * N // 4
    _, st = attention(q, k, v, scale=0.3, key_spans=spans, key_bias=torch.full((1, 2, 2), -math.inf))
    assert st.backend == "torch"


def test_padding_queries_are_zero_and_finite():
    q, k, v, kpm, kw = make_case(2, 4, 2, 9, 9, 8, pad=(0, 4))
    out, st = attention(q, k, v, scale=0.3, key_padding_mask=kpm, backend="torch", **ALL_PROBES, **kw)
    assert torch.isfinite(out).all()
    assert (out[1, :, :4] == 0).all()
    assert (st.argmax[1, :, :4] == -1).all() and (st.entropy[1, :, :4] == 0).all()
    assert (st.span_mass[1, :, :4] == 0).all()


def test_edit_semantics():
    """The edits do what docs/methods.md#head-masking-and-scaling and docs/methods.md#pasta say, read off the
    output directly."""
    q, k, v, kpm, _ = make_case(1, 2, 1, 6, 6, 8, pad=None, edits=False, spans=False)
    # query masking -> uniform over the causal prefix -> z = running mean of V
    out, st = attention(q, k, v, scale=0.3, q_scale=torch.tensor([[0.0, 1.0]]), probe_entropy=True)
    mean_v = v[0, 0].cumsum(0) / torch.arange(1, 7)[:, None]
    torch.testing.assert_close(out[0, 0], mean_v, atol=1e-6, rtol=0)
    torch.testing.assert_close(st.entropy[0, 0], torch.log(torch.arange(1, 7).float()), atol=1e-6, rtol=0)
    # score zeroing is the same thing (no bias): uniform attention
    out2, _ = attention(q, k, v, scale=0.3, score_zero=torch.tensor([[True, False]]), backend="torch")
    torch.testing.assert_close(out2[0, 0], mean_v, atol=1e-6, rtol=0)
    # output scale
    base, _ = attention(q, k, v, scale=0.3, backend="torch")
    out3, _ = attention(q, k, v, scale=0.3, out_scale=torch.tensor([[0.0, 2.5]]), backend="torch")
    assert (out3[0, 0] == 0).all()
    torch.testing.assert_close(out3[0, 1], 2.5 * base[0, 1], atol=1e-6, rtol=0)
    # PASTA: log(alpha) on the complement of the emphasised span == post-softmax reweighting
    alpha = 0.01
    spans = torch.tensor([[[0, 2], [4, 6]]])  # complement of [2, 4)
    bias = torch.full((1, 2, 2), math.log(alpha))
    _, st_b = attention(q, k, v, scale=0.3, key_spans=spans, key_bias=bias, return_pattern=True)
    _, st_0 = attention(q, k, v, scale=0.3, return_pattern=True, backend="torch")
    torch.testing.assert_close(st_b.pattern, pasta_reweighted(st_0.pattern, alpha, (2, 4)), atol=1e-6, rtol=0)


def test_memory_is_blocked():
    """The torch path never allocates a (B, H, Nq, Nk) score tensor without return_pattern."""
    B, H, N, D = 1, 2, 512, 8
    q, k, v = (torch.randn(B, H, N, D) for _ in range(3))
    seen: list[int] = []

    with AllocationSpy(seen):
        attention(q, k, v, scale=0.3, probe_argmax=True, probe_entropy=True,
                  probe_spans=torch.tensor([[[0, 10]]]), backend="torch", block_q=32)
    assert max(seen) <= B * H * 32 * N
    assert max(seen) < B * H * N * N // 4


def test_validation_errors():
    q, k, v = torch.randn(1, 3, 4, 8), torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match="multiple"):
        attention(q, k, v, scale=1.0)
    q = torch.randn(1, 4, 4, 8)
    with pytest.raises(ValueError, match="sdpa"):
        attention(q, k, v, scale=1.0, probe_argmax=True, backend="sdpa")
    with pytest.raises(ValueError, match="sdpa"):
        attention(q, k, v, scale=1.0, score_zero=torch.ones(1, 4, dtype=torch.bool), backend="sdpa")
    with pytest.raises(ValueError, match="key_spans"):
        attention(q, k, v, scale=1.0, key_spans=torch.zeros(1, 1, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="queries"):
        attention(torch.randn(1, 4, 5, 8), k, v, scale=1.0)


# --------------------------------------------------------------------------- offset probe
@pytest.mark.parametrize("Nq,Nk,window", [(6, 6, None), (3, 8, None), (1, 9, None), (4, 10, 3)])
def test_offset_mass_of_uniform_attention(Nq, Nk, window):
    """Query masking makes attention uniform over the visible keys, so the mass ``delta`` keys back from query
    i (key position Nk - Nq + i) is 1 / (number of visible keys) when that key is visible, else 0."""
    q, k, v, _, _ = make_case(1, 2, 1, Nq, Nk, 8, pad=None, edits=False, spans=False)
    deltas = torch.tensor([[0, 1, 2, 5, -1, Nk]])
    _, st = attention(q, k, v, scale=0.3, q_scale=torch.tensor([[0.0, 1.0]]), probe_offsets=deltas, window=window,
                      backend="torch", block_q=2)
    assert st.offset_mass.shape == (1, 2, Nq, 6) and st.offset_mass.dtype == torch.float32
    for i in range(Nq):
        pos = Nk - Nq + i
        n_vis = pos + 1 if window is None else min(pos + 1, window)
        for o, d in enumerate(deltas[0].tolist()):
            want = 1.0 / n_vis if 0 <= d < n_vis else 0.0
            assert st.offset_mass[0, 0, i, o].item() == pytest.approx(want, abs=1e-6), (i, d)


def test_offset_probe_backend_shapes_and_validation():
    q, k, v, _, _ = make_case(2, 4, 2, 5, 5, 8, pad=None, edits=False, spans=False)
    offs = torch.tensor([[1], [0]])
    _, st = attention(q, k, v, scale=0.3, probe_offsets=offs)  # a probe: auto must not pick sdpa
    assert st.backend == "torch" and st.offset_mass.shape == (2, 4, 5, 1)
    _, st_pat = attention(q, k, v, scale=0.3, return_pattern=True, backend="torch")
    torch.testing.assert_close(st.offset_mass[0, :, 1:, 0], st_pat.pattern[0].diagonal(-1, -2, -1), atol=1e-6,
                               rtol=0)
    torch.testing.assert_close(st.offset_mass[1, :, :, 0], st_pat.pattern[1].diagonal(0, -2, -1), atol=1e-6, rtol=0)
    assert (st.offset_mass[0, :, 0] == 0).all()  # query 0 has no previous token
    _, st0 = attention(q, k, v, scale=0.3, probe_offsets=torch.zeros(2, 0, dtype=torch.long))
    assert st0.offset_mass.shape == (2, 4, 5, 0)
    with pytest.raises(ValueError, match="sdpa"):
        attention(q, k, v, scale=0.3, probe_offsets=offs, backend="sdpa")
    with pytest.raises(ValueError, match=r"\(B, O\)"):
        attention(q, k, v, scale=0.3, probe_offsets=torch.tensor([1, 2]))
    with pytest.raises(ValueError, match=">= 0"):
        attention(q, k, v, scale=0.3, probe_offsets=torch.tensor([[1], [-2]]))
    with pytest.raises(ValueError, match="integers"):
        attention(q, k, v, scale=0.3, probe_offsets=torch.tensor([[1.0], [0.0]]))


def test_offset_probe_memory_is_blocked():
    """Offset masses are gathered per query block: no (B, H, Nq, Nk) tensor, as for the other probes."""
    B, H, N, D = 1, 2, 512, 8
    q, k, v = (torch.randn(B, H, N, D) for _ in range(3))
    seen: list[int] = []

    offs = torch.arange(64)[None]
    with AllocationSpy(seen):
        _, st = attention(q, k, v, scale=0.3, probe_offsets=offs, backend="torch", block_q=32)
    assert max(seen) <= max(B * H * 32 * N, B * H * N * 64)  # one score block, or the (B, H, N, O) output
    assert max(seen) < B * H * N * N // 4
    assert st.offset_mass.shape == (B, H, N, 64)


def test_torch_path_memory_is_linear_in_length():
    """Peak live memory of the torch path with every streaming probe (argmax, entropy, spans, offsets and
    ~N pairs) at N and 2N: at most 2.2x (the scratch is one (B, H, block, N) block, edited in place; the
    outputs are O(N)); a quadratic term would give ~4x."""
    B, H, D = 1, 4, 16
    peaks = []
    for N in (768, 1536):
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(B, H, N, D, generator=g) for _ in range(3))
        i = torch.arange(N)
        pairs = torch.stack([torch.cat([i, i[1:]]), torch.cat([i, i[1:] // 2])], -1)[None]  # diagonal + far keys
        with PeakMemorySpy() as spy:
            _, st = attention(q, k, v, scale=0.3, probe_argmax=True, probe_entropy=True,
                              probe_spans=torch.tensor([[[0, 1], [0, N]]]), probe_offsets=torch.tensor([[0, 1, 7]]),
                              probe_pairs=pairs, backend="torch", block_q=64)
        assert st.pair_mass.shape == (B, H, 2 * N - 1)
        peaks.append(spy.peak)
    assert peaks[1] <= 2.2 * peaks[0], peaks
