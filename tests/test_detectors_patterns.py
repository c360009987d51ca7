"""Pattern detectors (METHODS.md "Pattern detectors") against an independent eager computation.

Both scoring paths are checked: offset probes (the default whenever the detection patterns need at most
``MAX_OFFSETS`` distinct offsets) and the full-pattern fallback (forced by setting ``MAX_OFFSETS`` to -1).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import headlab

from conftest import TINY_LLAMA, spec_text

PATHS = {"offsets": None, "pattern": -1}  # path -> MAX_OFFSETS that forces it (None: the module's default)


def eager_patterns(ids: torch.Tensor) -> np.ndarray:
    """(layer, head, n, n) attention of the same random model (seed 0) through eager attention."""
    cfg = dict(TINY_LLAMA)
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():
        out = model(input_ids=ids[None], output_attentions=True)
    return torch.stack(out.attentions)[:, 0].double().numpy()


def reference_score(a: np.ndarray, toks: list[int], kind: str, measure: str, ex_bos: bool, ex_cur: bool) -> float:
    """TransformerLens head_detector semantics, written with explicit loops."""
    n = len(toks)
    d = np.zeros((n, n))
    for i in range(n):
        for j in range(n):
            if kind == "previous_token":
                d[i, j] = float(j == i - 1)
            elif kind == "duplicate_token":
                d[i, j] = float(j < i and toks[i] == toks[j])
            else:  # induction: attends to the token after an earlier copy of the current token
                d[i, j] = float(1 <= j <= i and j - 1 < i and toks[i] == toks[j - 1])
    a = a.copy()
    if measure == "mul":
        if ex_bos:
            a[:, 0] = 0
        if ex_cur:
            np.fill_diagonal(a, 0)
        return float((a * d).sum() / a.sum())
    diff = np.abs(a - d)
    if ex_bos:
        diff[:, 0] = 0
    if ex_cur:
        np.fill_diagonal(diff, 0)
    return float(1 - diff.sum() / n)


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("kind", ["previous_token", "duplicate_token", "induction"])
@pytest.mark.parametrize("measure, ex_bos, ex_cur", [("mul", False, False), ("mul", True, True), ("abs", True, False),
                                                     ("abs", False, True), ("abs", True, True), ("mul", True, False)])
def test_pattern_scores_equal_eager_reference(tmp_path, monkeypatch, kind, measure, ex_bos, ex_cur, path):
    if PATHS[path] is not None:
        monkeypatch.setattr("headlab.plugins.detectors.patterns.MAX_OFFSETS", PATHS[path])
    steps = (f"  - id: d\n    detect: {{kind: {kind}, error_measure: {measure}, exclude_bos: {str(ex_bos).lower()}, "
             f"exclude_current_token: {str(ex_cur).lower()}}}\n")
    run = headlab.run(spec_text(steps, task="{kind: repeated_tokens, n: 3, length: [5, 7]}"), out=tmp_path)
    ds = run.results["d"]
    assert ds.attrs["probe"] == path
    per_example = ds["example_score"].transpose("example", "layer", "head").values
    for e in range(3):
        ids = ds["input_ids"].values[e]
        ids = torch.tensor([int(t) for t in ids if t >= 0])
        attn = eager_patterns(ids)
        for layer in range(attn.shape[0]):
            for head in range(attn.shape[1]):
                ref = reference_score(attn[layer, head], ids.tolist(), kind, measure, ex_bos, ex_cur)
                assert per_example[e, layer, head] == pytest.approx(ref, abs=1e-5)
    np.testing.assert_allclose(ds["score"].transpose("layer", "head").values, per_example.mean(0), atol=1e-12)


def test_induction_pattern_finds_a_planted_induction_head():
    """A hand-made attention that does induction scores 1, a previous-token one scores 0."""
    from headlab.plugins.detectors.patterns import detection_pattern, similarity

    toks = torch.tensor([5, 1, 2, 3, 1, 2, 3])
    det = detection_pattern("induction", toks)
    ideal = det.clone()
    ideal[det.sum(-1) == 0, 0] = 1.0  # rows without a previous copy attend to BOS
    assert similarity(ideal, det, "mul", True, False).item() == pytest.approx(1.0)
    prev = torch.diag(torch.ones(6), -1)
    prev[0, 0] = 1
    assert similarity(prev, det, "mul", False, False).item() == pytest.approx(0.0)


@pytest.mark.parametrize("kind", ["previous_token", "duplicate_token", "induction"])
def test_probe_scores_equal_similarity(kind):
    """probe_scores (offsets + A[:, 0] + row totals) == similarity (full pattern) on random causal attention,
    every measure and exclusion, with tokens that repeat the first token (duplicate ones in column 0) and repeat
    their neighbour (induction ones on the diagonal), and a padding query (an all-zero row)."""
    from headlab.plugins.detectors.patterns import (
        detection_pattern,
        pattern_offsets,
        probe_scores,
        similarity,
    )

    g = torch.Generator().manual_seed(0)
    toks = torch.tensor([0, 7, 3, 3, 0, 7, 3, 3, 0, 5, 5, 5])
    n = len(toks)
    det = detection_pattern(kind, toks)
    if kind == "duplicate_token":
        assert det[:, 0].sum() > 0  # the first token recurs: ones in the excluded BOS column
    logits = torch.randn(3, 2, n, n, generator=g) * 2
    a = torch.softmax(logits.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), -torch.inf), -1)
    a[..., 2, :] = 0  # a padding query
    a = a.float()
    for measure in ("mul", "abs"):
        for ex_bos in (False, True):
            for ex_cur in (False, True):
                offs = pattern_offsets(det, ex_cur)
                om = torch.stack([torch.cat([torch.zeros(*a.shape[:2], d), a.diagonal(-d, -2, -1)], -1)
                                  for d in offs], -1)  # (..., n, O): A[i, i - d]
                got = probe_scores(om, offs, a[..., 0], a.sum(-1), det, measure, ex_bos, ex_cur)
                want = similarity(a, det, measure, ex_bos, ex_cur)
                torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    if kind == "induction":
        assert det.diagonal().sum() > 0  # tok_i == tok_(i-1): ones on the diagonal (offset 0)
    assert pattern_offsets(torch.eye(n).roll(1, 1)) is None  # a one above the diagonal: no offset probe


def test_probe_path_never_reads_the_pattern(tmp_path, monkeypatch):
    """The offset path asks the kernel for offset and span masses only, never the (n x n) pattern; it equals
    the pattern path on every measure / exclusion combination; MAX_OFFSETS bounds the offsets per row."""
    import headlab.instrument as ins
    import headlab.plugins.detectors.patterns as patterns

    calls = []
    real_kernel = ins.kernel_attention

    def spy(*args, **kwargs):
        probes = kwargs.get("probes")  # a headlab.kernels.ProbeRequest
        calls.append((bool(probes is not None and probes.pattern), None if probes is None else probes.offsets))
        return real_kernel(*args, **kwargs)

    monkeypatch.setattr(ins, "kernel_attention", spy)
    combos = [(m, b, c) for m in ("mul", "abs") for b in (False, True) for c in (False, True)]
    steps = "".join(f"  - id: {kind}_{m}_{int(b)}{int(c)}\n    detect: {{kind: {kind}, error_measure: {m}, "
                    f"exclude_bos: {str(b).lower()}, exclude_current_token: {str(c).lower()}}}\n"
                    for kind in ("induction", "duplicate_token") for m, b, c in combos)
    task = "{kind: repeated_tokens, n: 4, length: [6, 9]}"
    run = headlab.run(spec_text(steps, task=task), out=tmp_path / "offsets")
    assert calls and not any(pat for pat, _ in calls)
    assert all(offs is not None for _, offs in calls)
    monkeypatch.setattr(patterns, "MAX_OFFSETS", -1)
    calls.clear()
    ref = headlab.run(spec_text(steps, task=task), out=tmp_path / "pattern")
    assert calls and all(pat and offs is None for pat, offs in calls)
    for name, ds in run.results.items():
        assert ds.attrs["probe"] == "offsets" and ref.results[name].attrs["probe"] == "pattern"
        np.testing.assert_allclose(ds["example_score"].values, ref.results[name]["example_score"].values,
                                   atol=1e-5, rtol=0)
    # the bound: previous_token needs offset 1, plus the diagonal (offset 0) when it is excluded
    monkeypatch.setattr(patterns, "MAX_OFFSETS", 1)
    steps = ("  - id: one\n    detect: {kind: previous_token}\n"
             "  - id: two\n    detect: {kind: previous_token, exclude_current_token: true}\n")
    bound = headlab.run(spec_text(steps, task=task), out=tmp_path / "bound")
    assert bound.results["one"].attrs["probe"] == "offsets" and bound.results["two"].attrs["probe"] == "pattern"
