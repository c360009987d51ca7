"""The Triton path against the naive reference, on CPU under TRITON_INTERPRET=1.

TRITON_INTERPRET is read when a kernel is decorated with ``triton.jit``, i.e. when
``headlab.kernels.triton_attention`` is imported; this module sets it first and (re)imports that module so
it works whatever was imported before. On a CUDA machine the same tests run compiled kernels when
``HEADLAB_TRITON_CUDA=1`` (benchmarks/gpu_check.py does that).
"""

from __future__ import annotations

import importlib
import math
import os
import sys

import pytest
import torch

ON_CUDA = os.environ.get("HEADLAB_TRITON_CUDA") == "1" and torch.cuda.is_available()
if not ON_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"

triton = pytest.importorskip("triton")

from headlab.kernels import attention  # noqa: E402

if "headlab.kernels.triton_attention" in sys.modules and not ON_CUDA:
    importlib.reload(sys.modules["headlab.kernels.triton_attention"])
from headlab.kernels import triton_attention as ta  # noqa: E402
from headlab.kernels.contract import requests as checked  # noqa: E402

from fixtures.kernels import ALL_PROBES, check, make_case, pasta_reweighted, reference, requests  # noqa: E402

pytestmark = pytest.mark.triton
DEV = "cuda" if ON_CUDA else "cpu"


def on_dev(kw: dict) -> dict:
    """The tensors of a keyword dict on the test device."""
    return {n: x.to(DEV) if isinstance(x, torch.Tensor) else x for n, x in kw.items()}


def direct(q, kw: dict, **probes) -> tuple:
    """The checked (edits, probes) that triton_attention() takes, on the test device, from make_case's keywords
    ``kw`` and probe flags."""
    r = requests(on_dev(kw), **probes)
    return checked(r["edits"], r["probes"], q.shape[0], q.shape[1], DEV)


def run(q, k, v, kpm, kw, *, probes=None, **extra):
    """attention() on the Triton path with the edits and probes of ``kw`` (make_case's keywords) and the probe
    flags ``probes`` (:data:`ALL_PROBES`' keys)."""
    to = lambda x: x.to(DEV) if isinstance(x, torch.Tensor) else x  # noqa: E731
    out, st = attention(to(q), to(k), to(v), key_padding_mask=to(kpm), backend="triton",
                        **requests(on_dev(kw), **(probes or {})), **extra)
    assert st.backend == "triton"
    for name in ("argmax", "argmax_prob", "entropy", "span_mass", "offset_mass", "pattern", "pair_mass"):
        if getattr(st, name) is not None:
            setattr(st, name, getattr(st, name).cpu())
    return out.cpu(), st


@pytest.mark.parametrize(
    "shape",
    [(2, 4, 2, 20, 20, 16), (1, 4, 1, 9, 9, 16), (2, 4, 4, 1, 37, 16), (2, 4, 2, 3, 21, 8)],
    ids=["gqa2-prefill", "mqa", "decode", "chunk-with-past"],
)
def test_triton_matches_reference(shape):
    B, H, Hkv, Nq, Nk, D = shape
    q, k, v, kpm, kw = make_case(B, H, Hkv, Nq, Nk, D, pad=(0, 5) if B > 1 else (2,))
    out, st = run(q, k, v, kpm, kw, scale=D**-0.5, probes=ALL_PROBES)
    ref = reference(q, k, v, scale=D**-0.5, key_padding_mask=kpm, **kw)
    check(out, st, ref, atol=1e-5)


def test_triton_softcap_window_gqa4():
    q, k, v, kpm, kw = make_case(2, 8, 2, 19, 19, 16, pad=(0, 3))
    q = q * 3
    out, st = run(q, k, v, kpm, kw, scale=0.5, softcap=4.0, window=6, probes=ALL_PROBES)
    ref = reference(q, k, v, scale=0.5, key_padding_mask=kpm, softcap=4.0, window=6, **kw)
    check(out, st, ref, atol=1e-5)


def test_triton_split_decode_and_general_mask():
    """Flash-decoding split of the key axis (merged in torch) and a general attn_mask."""
    q, k, v, kpm, kw = make_case(2, 4, 2, 1, 70, 16, pad=(0, 9))
    dev = lambda x: x.to(DEV)  # noqa: E731
    out, st = ta.triton_attention(
        dev(q), dev(k), dev(v), *direct(q, kw, argmax=True, entropy=True), scale=0.25, causal=True,
        key_padding_mask=dev(kpm), attn_mask=None, softcap=None, window=None, num_splits=3,
    )
    st.argmax, st.argmax_prob, st.entropy, st.span_mass, st.offset_mass, st.pair_mass = (
        st.argmax.cpu(), st.argmax_prob.cpu(), st.entropy.cpu(), st.span_mass.cpu(), st.offset_mass.cpu(),
        st.pair_mass.cpu())
    ref = reference(q, k, v, scale=0.25, key_padding_mask=kpm, **kw)
    check(out.cpu(), st, ref, atol=1e-5)
    # general mask (not causal), no padding
    q, k, v, _, kw = make_case(2, 4, 2, 16, 16, 16, pad=None)
    am = torch.rand(2, 1, 16, 16, generator=torch.Generator().manual_seed(3)) > 0.4
    out, st = run(q, k, v, None, kw, scale=0.25, causal=False, attn_mask=am, probes=ALL_PROBES)
    ref = reference(q, k, v, scale=0.25, causal=False, attn_mask=am, **kw)
    check(out, st, ref, atol=1e-5)


@pytest.mark.parametrize("dtype,atol", [(torch.bfloat16, 3e-2), (torch.float16, 5e-3)])
def test_triton_half(dtype, atol):
    q, k, v, kpm, kw = make_case(2, 4, 2, 17, 17, 16, dtype=dtype, pad=(0, 4))
    out, st = run(q, k, v, kpm, kw, scale=0.25, probes=ALL_PROBES)
    assert out.dtype == dtype
    ref = reference(q, k, v, scale=0.25, key_padding_mask=kpm, **kw)
    check(out, st, ref, atol=atol, argmax=False)


def test_triton_pasta_equals_reweighting():
    q, k, v, _, _ = make_case(1, 2, 1, 16, 16, 16, pad=None, edits=False, spans=False)
    alpha = 0.05
    spans = torch.tensor([[[0, 5], [9, 16]]])
    _, st_b = run(q, k, v, None, dict(key_spans=spans, key_bias=torch.full((1, 2, 2), math.log(alpha))),
                  scale=0.3, probes=dict(pattern=True))
    ref = reference(q, k, v, scale=0.3)["pattern"].float()
    torch.testing.assert_close(st_b.pattern, pasta_reweighted(ref, alpha, (5, 9)), atol=1e-5, rtol=0)


def test_triton_offsets_across_key_tiles_and_splits():
    """Offset masses when an offset's keys fall in other key tiles than the query block's diagonal tile
    (small tiles, several query blocks, offsets up to the sequence length), GQA 2 with padding and edits, and
    the split-key decode path with past keys."""
    B, H, Hkv, N, D = 2, 4, 2, 45, 16
    q, k, v, kpm, kw = make_case(B, H, Hkv, N, N, D, pad=(0, 6))
    kw["probe_offsets"] = torch.tensor([[0, 1, 15, 16, 17, 31, 33, 44, 45, -1],
                                        [-1, 2, 14, 16, 20, 32, 40, 38, 3, 0]])
    dev = lambda x: x.to(DEV) if isinstance(x, torch.Tensor) else x  # noqa: E731
    ref = reference(q, k, v, scale=0.3, key_padding_mask=kpm, **kw)
    out, st = ta.triton_attention(
        dev(q), dev(k), dev(v), *direct(q, kw), scale=0.3, causal=True, key_padding_mask=dev(kpm),
        attn_mask=None, softcap=None, window=None, block_m=16, block_n=16,
    )
    assert ref["offset_mass"].abs().sum() > 10  # the probe reads real mass
    torch.testing.assert_close(st.offset_mass.cpu().double(), ref["offset_mass"], atol=1e-5, rtol=0)
    torch.testing.assert_close(out.cpu().double(), ref["z"], atol=1e-5, rtol=0)
    # decode: 2 queries against 60 keys, key axis split in 4 (merged in torch)
    q, k, v, kpm, kw = make_case(B, H, Hkv, 2, 60, D, pad=(0, 7))
    kw["probe_offsets"] = torch.tensor([[0, 1, 17, 33, 50, 59], [58, 1, 0, 16, 32, -1]])
    ref = reference(q, k, v, scale=0.3, key_padding_mask=kpm, **kw)
    for splits in (1, 4):
        out, st = ta.triton_attention(
            dev(q), dev(k), dev(v), *direct(q, kw), scale=0.3, causal=True, key_padding_mask=dev(kpm),
            attn_mask=None, softcap=None, window=None, block_n=16, num_splits=splits,
        )
        torch.testing.assert_close(st.offset_mass.cpu().double(), ref["offset_mass"], atol=1e-5, rtol=0)
        torch.testing.assert_close(out.cpu().double(), ref["z"], atol=1e-5, rtol=0)


def test_triton_offset_mass_of_uniform_attention():
    """Query masking = uniform attention over the visible keys: mass 1 / (visible keys) at each visible offset."""
    Nq, Nk = 3, 20
    q, k, v, _, _ = make_case(1, 2, 1, Nq, Nk, 16, pad=None, edits=False, spans=False)
    deltas = torch.tensor([[0, 1, 4, 7, -1, Nk]])
    _, st = run(q, k, v, None, dict(q_scale=torch.tensor([[0.0, 1.0]]), probe_offsets=deltas), scale=0.3, window=6)
    for i in range(Nq):
        for o, d in enumerate(deltas[0].tolist()):
            want = 1.0 / 6 if 0 <= d < 6 else 0.0
            assert st.offset_mass[0, 0, i, o].item() == pytest.approx(want, abs=1e-6), (i, d)
    _, st0 = run(q, k, v, None, dict(probe_offsets=torch.zeros(1, 0, dtype=torch.long)), scale=0.3)
    assert st0.offset_mass.shape == (1, 2, Nq, 0)


def test_triton_pairs_across_key_tiles_and_splits():
    """Pair masses (the pair kernel, from the rows' final max and normaliser) at cells far from the query
    block's diagonal tile, with edits, padding, softcap and a window; and on the split-key decode path, where
    the normaliser is the merge of the splits'; the reason names the pair path."""
    B, H, Hkv, N, D = 2, 4, 2, 45, 16
    q, k, v, kpm, kw = make_case(B, H, Hkv, N, N, D, pad=(0, 6), offsets=False)
    dev = lambda x: x.to(DEV) if isinstance(x, torch.Tensor) else x  # noqa: E731
    for extra in ({}, dict(softcap=3.0, window=20)):
        ref = reference(q, k, v, scale=0.3, key_padding_mask=kpm, **kw, **extra)
        out, st = ta.triton_attention(
            dev(q), dev(k), dev(v), *direct(q, kw), scale=0.3, causal=True, key_padding_mask=dev(kpm),
            attn_mask=None, block_m=16, block_n=16, **{"softcap": None, "window": None, **extra},
        )
        assert ref["pair_mass"].abs().sum() > 5  # the probe reads real mass
        torch.testing.assert_close(st.pair_mass.cpu().double(), ref["pair_mass"], atol=1e-5, rtol=0)
        torch.testing.assert_close(out.cpu().double(), ref["z"], atol=1e-5, rtol=0)
    _, st = run(q, k, v, kpm, kw, scale=0.3)
    assert st.reason.endswith("pairs from the rows' log-sum-exp (pair kernel)")
    # decode: 2 queries against 60 keys, key axis split in 4 (merged in torch)
    q, k, v, kpm, kw = make_case(B, H, Hkv, 2, 60, D, pad=(0, 7), offsets=False)
    ref = reference(q, k, v, scale=0.3, key_padding_mask=kpm, **kw)
    for splits in (1, 4):
        out, st = ta.triton_attention(
            dev(q), dev(k), dev(v), *direct(q, kw), scale=0.3, causal=True, key_padding_mask=dev(kpm),
            attn_mask=None, softcap=None, window=None, block_n=16, num_splits=splits,
        )
        torch.testing.assert_close(st.pair_mass.cpu().double(), ref["pair_mass"], atol=1e-5, rtol=0)
        torch.testing.assert_close(out.cpu().double(), ref["z"], atol=1e-5, rtol=0)
    # no pair in range: zeros of the requested width
    _, st0 = run(q, k, v, kpm, dict(probe_pairs=torch.full((B, 3, 2), -1)), scale=0.3)
    assert st0.pair_mass.shape == (B, H, 3) and (st0.pair_mass == 0).all()
