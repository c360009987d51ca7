"""The head output replacement (``ReplaceZ`` / ``Plan.patch_z``) and the activation_patching detector on the
Triton path (CPU under TRITON_INTERPRET=1) == the torch path == the SDPA / native path, with the path that ran
read from ``rec.backends`` and from the dispatcher's choices (no silent fallback).

As in tests/test_kernels_triton.py, TRITON_INTERPRET is set before ``headlab.kernels.triton_attention`` is
(re)imported; with ``HEADLAB_TRITON_CUDA=1`` on a CUDA machine the same tests run the compiled kernels
(benchmarks/gpu_check.py does that).
"""

from __future__ import annotations

import functools
import importlib
import math
import os
import sys

import numpy as np
import pytest
import torch

ON_CUDA = os.environ.get("HEADLAB_TRITON_CUDA") == "1" and torch.cuda.is_available()
if not ON_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"

triton = pytest.importorskip("triton")

if "headlab.kernels.triton_attention" in sys.modules and not ON_CUDA:
    importlib.reload(sys.modules["headlab.kernels.triton_attention"])
import headlab.instrument.attention as ins_attention  # noqa: E402
import headlab.kernels.triton_attention as ta  # noqa: E402
from headlab import Plan, Probes, StepContext, forward  # noqa: E402
from headlab.plugins.detectors import activation_patching as ap  # noqa: E402

from fixtures.circuits import models, pair_examples  # noqa: E402

pytestmark = pytest.mark.triton
DEV = "cuda" if ON_CUDA else "cpu"
PAD = 3
T = 9


@functools.cache
def _llama():
    """The tiny random Llama of the circuit tests (2 layers, 4 query heads over 2 key/value heads: GQA) on the
    test device, and its tokenizer."""
    tok, lm, _ = models("llama")
    lm.model.to(DEV)
    return tok, lm


def _batch(vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Three rows of T random ids, row 1 left-padded by PAD."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, vocab, (3, T), generator=g)
    mask = torch.ones(3, T, dtype=torch.long)
    mask[1, :PAD] = 0
    ids[1, :PAD] = 0
    return ids.to(DEV), mask.to(DEV)


@pytest.fixture
def kernel_calls(monkeypatch) -> dict:
    """Counts the calls of the Triton kernel entry point (the dispatcher imports it per call)."""
    calls = {"n": 0}
    real = ta.triton_attention

    def counted(*a, **kw):
        calls["n"] += 1
        return real(*a, **kw)

    monkeypatch.setattr(ta, "triton_attention", counted)
    return calls


def _values(D: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Replacement values: (2 rows, 1 head, T, D) for every position, (1, 1, 2, D) for two positions, (D,)."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(2, 1, T, D, generator=g).to(DEV), torch.randn(1, 1, 2, D, generator=g).to(DEV),
            torch.randn(D, generator=g).to(DEV))


def _patch_plan(backend: str, D: int, seed: int = 3) -> Plan:
    """Head (0, 1) replaced at every position of rows 0 and 2, head (1, 2) (the other key/value head's group)
    at two absolute positions of the left-padded row 1, head (1, 0) at one position of every row."""
    every, two, one = _values(D, seed)
    return (Plan(backend=backend).patch_z([(0, 1)], every, rows=[0, 2])
            .patch_z([(1, 2)], two, rows=[1], positions=[PAD + 1, T - 2])
            .patch_z([(1, 0)], one, positions=[T - 1]))


def _real(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Logits (batch, position, vocab) at the real (unpadded) positions, float64 on the CPU."""
    return x[mask.bool()].double().cpu()


def _queries(x: torch.Tensor, mask: torch.Tensor, axis: int = 3) -> torch.Tensor:
    """A recording with batch axis 0 and position axis ``axis`` at the real (unpadded) positions: (real
    positions, other axes), on the CPU."""
    return x.cpu().movedim(axis, 1)[mask.bool().cpu()]


def _ran(rec, backend: str, L: int) -> None:
    """Every layer's call ran ``backend`` because the plan asked for it."""
    assert rec.backends == {layer: (backend, "requested") for layer in range(L)}


@pytest.mark.parametrize("pasta", [False, True], ids=["native-sdpa", "kernel-sdpa"])
def test_z_replacement_on_rows_and_positions_equals_torch_and_sdpa(pasta, kernel_calls):
    """Without other edits the SDPA path is the model's own SDPA call; with a finite PASTA key bias on heads
    of both layers (one of them a replaced head) it is headlab's SDPA call with the bias folded in."""
    tok, lm = _llama()
    ids, mask = _batch(len(tok), seed=1)
    L, D = lm.geometry.n_layers, lm.geometry.head_dim
    sdpa = ("sdpa", "finite key biases") if pasta else ("native", "no edits or probes")
    logits = {}
    for backend in ("triton", "torch", "sdpa", "auto"):
        kernel_calls["n"] = 0
        plan = _patch_plan(backend, D)
        if pasta:
            plan.bias_keys([(0, 1), (1, 3)], [(1, PAD + 2)], math.log(0.1))
        out, rec = forward(lm, ids, plan, attention_mask=mask)
        logits[backend] = out.logits
        if backend in ("triton", "torch"):
            _ran(rec, backend, L)
        else:
            assert rec.backends == dict.fromkeys(range(L), sdpa)
        assert kernel_calls["n"] == (L if backend == "triton" else 0)
    for backend in ("torch", "sdpa", "auto"):
        torch.testing.assert_close(_real(logits["triton"], mask), _real(logits[backend], mask), atol=2e-5, rtol=0)
    plain = Plan(backend="torch")
    if pasta:
        plain.bias_keys([(0, 1), (1, 3)], [(1, PAD + 2)], math.log(0.1))
    plain, _ = forward(lm, ids, plain, attention_mask=mask)
    change = (logits["triton"] - plain.logits).abs()
    assert change[0].max() > 1e-3 and change[2].max() > 1e-3  # head (0, 1) at every position
    assert change[1, PAD:PAD + 1].max() < 1e-5 < change[1, PAD + 1:].max()  # row 1: from its first patched token


def test_z_replacement_with_probes_and_other_edits_on_the_same_forward(kernel_calls):
    """Argmax, entropy and z probes on every layer, with output scales (one on a replaced head: the
    replacement comes after it), a finite PASTA key bias and score zeroing on heads of the same layers."""
    tok, lm = _llama()
    ids, mask = _batch(len(tok), seed=4)
    L, D = lm.geometry.n_layers, lm.geometry.head_dim
    probes = Probes(argmax=True, entropy=True, z_positions="all")
    spans = [[(PAD + 1, PAD + 4)]] * 3

    def plan(backend: str, others: bool = True) -> Plan:
        p = _patch_plan(backend, D, seed=5)
        p.probes = probes
        if others:
            p.scale_heads([(0, 1), (1, 3)], 0.0).bias_keys([(1, 2), (1, 1)], spans, math.log(0.05))
            p.mask_heads([(0, 2)], rows=[1], mode="score")
        return p

    recs, logits = {}, {}
    for backend in ("triton", "torch", "auto"):
        kernel_calls["n"] = 0
        out, recs[backend] = forward(lm, ids, plan(backend), attention_mask=mask)
        logits[backend] = out.logits
        if backend != "auto":
            _ran(recs[backend], backend, L)
            assert kernel_calls["n"] == (L if backend == "triton" else 0)
    for backend in ("torch", "auto"):
        torch.testing.assert_close(_real(logits["triton"], mask), _real(logits[backend], mask), atol=2e-5, rtol=0)
        for name in ("z", "argmax_prob", "entropy"):
            a, b = getattr(recs["triton"], name), getattr(recs[backend], name)
            torch.testing.assert_close(_queries(a, mask), _queries(b, mask), atol=2e-5, rtol=0)
        assert torch.equal(_queries(recs["triton"].argmax, mask), _queries(recs[backend].argmax, mask))
    every, two, one = _values(D, seed=5)
    z = recs["triton"].z  # (B, L, H, T, D): the replaced values, after the zero output scale of (0, 1)
    torch.testing.assert_close(z[[0, 2], 0, 1], every[:, 0], atol=0, rtol=0)
    torch.testing.assert_close(z[1, 1, 2, [PAD + 1, T - 2]], two[0, 0], atol=0, rtol=0)
    torch.testing.assert_close(z[:, 1, 0, T - 1], one.expand(3, D), atol=0, rtol=0)
    assert (_queries(z[:, 1, 3], mask, axis=1) == 0).all()  # scaled to 0
    assert (z[1, 0, 1, PAD:] == 0).all() and z[1, 0, 2, PAD:].abs().max() > 1e-3  # (0, 1) not replaced on row 1
    alone, _ = forward(lm, ids, plan("torch", others=False), attention_mask=mask)
    assert (logits["triton"] - alone.logits)[mask.bool()].abs().max() > 1e-3  # the other edits act


@pytest.fixture
def forced(monkeypatch):
    """Runs the detector's plans on a requested backend and collects every attention call's (requested,
    (backend, reason)) as the instrumentation's dispatcher chose it."""
    chosen: list[tuple[str, tuple[str, str]]] = []
    real = ins_attention.choose_backend

    def spy(requested, **kw):
        out = real(requested, **kw)
        chosen.append((requested, out))
        return out

    monkeypatch.setattr(ins_attention, "choose_backend", spy)

    def use(backend: str) -> list[tuple[str, tuple[str, str]]]:
        chosen.clear()
        monkeypatch.setattr(ap, "Plan", functools.partial(Plan, backend=backend))
        return chosen
    return use


@pytest.mark.parametrize("unit", ["z", "z_position"])
def test_activation_patching_scores_on_triton_equal_torch(unit, forced, kernel_calls):
    """Two pairs of two token lengths (one left-padded chunk), patched forwards resumed at the patched layer
    over the target run's cached prefix (Nq < Nk on the kernels)."""
    tok, lm = _llama()
    ctx = StepContext(model=lm, examples=pair_examples(tok)[:2], results={}, seed=0)
    config = ap.ActivationPatching(unit=unit, batch_size=64, pair_batch_size=3)
    ds = {}
    for backend in ("triton", "torch", "auto"):
        chosen = forced(backend)
        kernel_calls["n"] = 0
        ds[backend] = ap.detect(config, ctx)
        ran = [out for req, out in chosen if req == backend]
        if backend != "auto":
            # every call the plan edits or probes runs the requested path; a layer it leaves alone (after the
            # patched one) runs the model's own SDPA call, as rec.backends reports it
            assert set(ran) == {(backend, "requested")} and len(ran) > lm.geometry.n_layers
            assert {out for req, out in chosen if req != backend} <= {("native", "no edits or probes")}
            assert kernel_calls["n"] == (len(ran) if backend == "triton" else 0)
    assert ds["triton"].attrs["prefix"] == "target_cache"
    for backend in ("torch", "auto"):
        for name in ("clean", "corrupt", "patched", "score"):
            a, b = ds["triton"][name].values, ds[backend][name].values
            assert np.array_equal(np.isnan(a), np.isnan(b)), name
            np.testing.assert_allclose(a, b, atol=2e-5, rtol=1e-5, err_msg=name)
    patched = ds["triton"]["patched"].values
    assert np.nanmax(np.abs(patched - ds["triton"]["corrupt"].values)) > 1e-2  # some patch changes the metric
