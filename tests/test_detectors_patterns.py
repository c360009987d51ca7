"""Pattern detectors (docs/methods.md#pattern-detectors) against an independent eager computation.

Both scoring paths are checked: pair probes (the default at every length: the attention at the detection
pattern's ones) and the full pattern (``probe: pattern``).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import headlab

from fixtures.specs import TINY_LLAMA, spec_text

PATHS = ["pairs", "pattern"]  # the detector's `probe` option


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


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("kind", ["previous_token", "duplicate_token", "induction"])
@pytest.mark.parametrize("measure, ex_bos, ex_cur", [("mul", False, False), ("mul", True, True), ("abs", True, False),
                                                     ("abs", False, True), ("abs", True, True), ("mul", True, False)])
def test_pattern_scores_equal_eager_reference(tmp_path, kind, measure, ex_bos, ex_cur, path):
    steps = (f"  - id: d\n    detect: {{kind: {kind}, error_measure: {measure}, exclude_bos: {str(ex_bos).lower()}, "
             f"exclude_current_token: {str(ex_cur).lower()}, probe: {path}}}\n")
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
def test_pair_scores_equal_similarity(kind):
    """pair_scores (the attention at D's ones + A[:, 0] + the diagonal + row totals) == similarity (full
    pattern) on random causal attention, every measure and exclusion, with tokens that repeat the first
    token (duplicate ones in column 0) and repeat their neighbour (induction ones on the diagonal), and a
    padding query (an all-zero row)."""
    from headlab.plugins.detectors.patterns import detection_pairs, detection_pattern, pair_scores, similarity

    g = torch.Generator().manual_seed(0)
    toks = torch.tensor([0, 7, 3, 3, 0, 7, 3, 3, 0, 5, 5, 5])
    n = len(toks)
    det = detection_pattern(kind, toks)
    pairs = detection_pairs(kind, toks)
    assert torch.equal(det.nonzero(), pairs)  # distinct, sorted by query then key
    if kind == "duplicate_token":
        assert det[:, 0].sum() > 0  # the first token recurs: ones in the excluded BOS column
    logits = torch.randn(3, 2, n, n, generator=g) * 2
    a = torch.softmax(logits.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), -torch.inf), -1)
    a[..., 2, :] = 0  # a padding query
    a = a.float()
    for measure in ("mul", "abs"):
        for ex_bos in (False, True):
            for ex_cur in (False, True):
                got = pair_scores(a[..., pairs[:, 0], pairs[:, 1]], pairs, a[..., 0], a.sum(-1), measure, ex_bos,
                                  ex_cur, diag_mass=a.diagonal(0, -2, -1))
                want = similarity(a, det, measure, ex_bos, ex_cur)
                torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    if kind == "induction":
        assert det.diagonal().sum() > 0  # tok_i == tok_(i-1): ones on the diagonal


def test_detection_pairs_equal_transformer_lens_matrices():
    """The pairs of the three named patterns are the ones of TransformerLens' detection matrices
    (head_detector.get_*_detection_pattern, written out here), on sequences with many repeats, and are
    built without an n x n matrix."""
    from headlab.plugins.detectors.patterns import detection_pairs

    def tl(kind, toks):
        n = len(toks)
        if kind == "previous_token":
            d = torch.zeros(n, n)
            d[1:, :-1] = torch.eye(n - 1)
            return torch.tril(d)
        eq = (toks[None, :].repeat(n, 1) == toks[:, None].repeat(1, n)).int()
        eq.fill_diagonal_(0)
        dup = torch.tril(eq.float())
        if kind == "duplicate_token":
            return dup
        shifted = torch.roll(dup, shifts=1, dims=1)
        return torch.tril(torch.cat([torch.zeros(n, 1), shifted[:, 1:]], dim=1))

    g = torch.Generator().manual_seed(1)
    for n, vocab in ((1, 3), (2, 2), (17, 3), (64, 5), (200, 40)):
        toks = torch.randint(0, vocab, (n,), generator=g)
        for kind in ("previous_token", "duplicate_token", "induction"):
            assert torch.equal(detection_pairs(kind, toks), tl(kind, toks).nonzero()), (kind, n)
    # 4096 tokens of one repeated token: ~8.4M pairs, from O(pairs) memory (no 4096 x 4096 matrix either way)
    assert detection_pairs("previous_token", torch.zeros(4096, dtype=torch.long)).shape == (4095, 2)


def _skip_two(tokens):
    """A custom pattern: each query attends two tokens back."""
    i = torch.arange(2, len(tokens))
    return i, i - 2


def test_custom_patterns_by_name_path_function_and_matrix(tmp_path):
    """kind: pattern takes a registered name (= the named kind), a 'module:function' path, a function, or a
    TransformerLens-style (n, n) 0/1 matrix; each equals the eager reference of its own pattern; a function
    is stored by its import path."""
    from headlab.plugins.detectors import patterns

    task = "{kind: repeated_tokens, n: 3, length: [5, 7]}"
    steps = ("  - id: named\n    detect: {kind: pattern, pattern: induction, exclude_bos: true}\n"
             "  - id: kind\n    detect: {kind: induction, exclude_bos: true}\n"
             "  - id: path\n    detect: {kind: pattern, pattern: 'test_detectors_patterns:_skip_two', error_measure: abs}\n")
    run = headlab.run(spec_text(steps, task=task), out=tmp_path / "a")
    np.testing.assert_array_equal(run.results["named"]["example_score"].values, run.results["kind"]["example_score"].values)
    ds = run.results["path"]
    assert ds.attrs["pattern"] == "test_detectors_patterns:_skip_two" and ds.attrs["probe"] == "pairs"
    per_example = ds["example_score"].transpose("example", "layer", "head").values
    for e in range(3):
        ids = torch.tensor([int(t) for t in ds["input_ids"].values[e] if t >= 0])
        attn = eager_patterns(ids)
        n = len(ids)
        d = np.zeros((n, n))
        for i in range(2, n):
            d[i, i - 2] = 1
        for layer in range(attn.shape[0]):
            for head in range(attn.shape[1]):
                ref = float(1 - np.abs(attn[layer, head] - d).sum() / n)
                assert per_example[e, layer, head] == pytest.approx(ref, abs=1e-5)
    # from Python: a function returning pairs, and one returning a TL-style matrix, score the same
    from headlab.model import load_model
    from headlab.spec import ModelSpec

    lm = load_model(ModelSpec(config=dict(TINY_LLAMA)))
    examples = [headlab.Example(prompt="", input_ids=[int(t) for t in ds["input_ids"].values[e] if t >= 0])
                for e in range(3)]
    ctx = headlab.StepContext(model=lm, examples=examples, results={}, seed=0)

    def as_matrix(tokens):
        n = len(tokens)
        return torch.diag(torch.ones(n - 2), -2)

    a = patterns.detect(patterns.CustomPattern(pattern=_skip_two, error_measure="abs"), ctx)
    b = patterns.detect(patterns.CustomPattern(pattern=as_matrix, error_measure="abs"), ctx)
    np.testing.assert_allclose(a["example_score"].values, per_example, atol=1e-5, rtol=0)
    np.testing.assert_allclose(b["example_score"].values, a["example_score"].values, atol=1e-12, rtol=0)
    assert patterns.CustomPattern(pattern=_skip_two).model_dump(mode="json")["pattern"].endswith(":_skip_two")
    with pytest.raises(ValueError, match="unknown detection pattern"):
        patterns.detect(patterns.CustomPattern(pattern="no_such_pattern"), ctx)
    with pytest.raises(ValueError, match="0 and 1"):
        patterns.detect(patterns.CustomPattern(pattern=lambda t: torch.full((len(t), len(t)), 0.5)), ctx)


def test_pair_path_never_reads_the_pattern(tmp_path, monkeypatch):
    """The pair path asks the kernel for pair and span masses only, never the (n x n) pattern, at any length
    (a random sequence with many chance repeats included); it equals the pattern path on every measure /
    exclusion combination; attrs["probe"] names the path."""
    import headlab.instrument.attention as ins_attention

    calls = []
    real_kernel = ins_attention.kernel_attention

    def spy(*args, **kwargs):
        probes = kwargs.get("probes")  # a headlab.kernels.ProbeRequest
        calls.append((bool(probes is not None and probes.pattern), None if probes is None else probes.pairs,
                      None if probes is None else probes.offsets))
        return real_kernel(*args, **kwargs)

    monkeypatch.setattr(ins_attention, "kernel_attention", spy)
    combos = [(m, b, c) for m in ("mul", "abs") for b in (False, True) for c in (False, True)]

    def steps(probe):
        return "".join(f"  - id: {kind}_{m}_{int(b)}{int(c)}\n    detect: {{kind: {kind}, error_measure: {m}, "
                       f"exclude_bos: {str(b).lower()}, exclude_current_token: {str(c).lower()}, probe: {probe}}}\n"
                       for kind in ("induction", "duplicate_token") for m, b, c in combos)

    # 4 sequences of 2 x 90 random tokens from a 97-token vocabulary: hundreds of chance repeats each
    task = "{kind: repeated_tokens, n: 4, length: [6, 9, 90]}"
    run = headlab.run(spec_text(steps("pairs"), task=task), out=tmp_path / "pairs")
    assert calls and not any(pat for pat, _, _ in calls)
    assert all(pairs is not None and offs is None for _, pairs, offs in calls)
    calls.clear()
    ref = headlab.run(spec_text(steps("pattern"), task=task), out=tmp_path / "pattern")
    assert calls and all(pat and pairs is None for pat, pairs, _ in calls)
    for name, ds in run.results.items():
        assert ds.attrs["probe"] == "pairs" and ref.results[name].attrs["probe"] == "pattern"
        np.testing.assert_allclose(ds["example_score"].values, ref.results[name]["example_score"].values,
                                   atol=1e-5, rtol=0)


def test_detector_memory_is_linear_in_length():
    """The induction detector's peak allocation (every tensor created during detect, live at once) grows
    linearly with the sequence length: doubling it (BOS + r + r, 2 x 400 -> 2 x 800 tokens) at most
    2.5x the peak (a quadratic term, such as an n x n detection matrix or per-query masses at every
    chance-repeat offset, would make it ~4x); and the forward skips the KV cache and all logits but the
    last."""
    from headlab.model import load_model
    from headlab.plugins.detectors import patterns
    from headlab.spec import ModelSpec

    from fixtures.kernels import PeakMemorySpy

    cfg = dict(TINY_LLAMA, max_position_embeddings=4096, vocab_size=4096)
    lm = load_model(ModelSpec(config=cfg))
    out, _ = headlab.forward(lm, torch.tensor([[5, 6, 7]]), logits_to_keep=1)  # what the detector runs
    assert out.logits.shape[1] == 1 and out.past_key_values is None
    g = torch.Generator().manual_seed(0)
    peaks = []
    for half in (400, 800):
        seg = torch.randint(3, 4096, (half,), generator=g).tolist()
        ctx = headlab.StepContext(model=lm, examples=[headlab.Example(prompt="", input_ids=[1] + seg + seg)],
                                  results={}, seed=0)
        with PeakMemorySpy() as spy:
            ds = patterns.detect(patterns.Induction(exclude_bos=True, exclude_current_token=True), ctx)
        assert ds.attrs["probe"] == "pairs"
        peaks.append(spy.peak)
    assert peaks[1] <= 2.5 * peaks[0], peaks
