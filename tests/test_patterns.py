"""Pattern detectors (METHODS.md "Pattern detectors") against an independent eager computation."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import headlab

from conftest import TINY_LLAMA, spec_text


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


@pytest.mark.parametrize("kind", ["previous_token", "duplicate_token", "induction"])
@pytest.mark.parametrize("measure, ex_bos, ex_cur", [("mul", False, False), ("mul", True, True), ("abs", True, False)])
def test_pattern_scores_equal_eager_reference(tmp_path, kind, measure, ex_bos, ex_cur):
    steps = (f"  - id: d\n    detect: {{kind: {kind}, error_measure: {measure}, exclude_bos: {str(ex_bos).lower()}, "
             f"exclude_current_token: {str(ex_cur).lower()}}}\n")
    run = headlab.run(spec_text(steps, task="{kind: repeated_tokens, n: 3, length: [5, 7]}"), out=tmp_path)
    ds = run.results["d"]
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
