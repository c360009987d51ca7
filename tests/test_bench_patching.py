"""benchmarks/bench_patching.py's EAP-IG memory arithmetic: the dense layout's bytes per token (the issue's 8.66 MB
for Llama-3-8B), headlab's kept bytes per token from the shape against the edge_attribution detector's attrs
and the tensors its runs keep on tiny models, and the measured-per-token line (no benchmark run)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from headlab import StepContext
from headlab.plugins.detectors.edge_attribution import EdgeAttribution, detect, record

from fixtures.circuits import models, pair_examples

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_patching.py"
MiB = 2**20


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_patching", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_dense_layout_of_llama3_8b_is_the_issues_8_66_mb(bench):
    assert bench.n_sources(32, 32) == 1 + 32 * 33 == 1057
    dense = bench.dense_bytes_per_token(32, 32, 4096, 2)
    assert dense == 1057 * 4096 * 2 == 8_658_944
    assert f"{dense / 1e6:.2f}" == "8.66"
    big = bench.eap_memory(**bench.LLAMA3_8B)
    # z: 32 x 32 heads x 128; MLP outputs: 32 x 4096; embeddings: 4096; bf16
    assert big["activation"] == (131_072 + 131_072 + 4096) * 2 == 532_480
    # q/k/v: 32 x (32 + 16) x 128; attention norm inputs and MLP destinations: 2 x 32 x 4096; logits: 4096
    assert big["gradient"] == (196_608 + 262_144 + 4096) * 2 == 925_696
    assert big["ratio"] == pytest.approx(16.26, abs=5e-3)
    assert big["ratio_with_gradients"] == pytest.approx(5.94, abs=5e-3)
    assert big["cotangents"] == 48 * 4096 * 4


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_kept_bytes_from_the_shape_are_the_detectors(bench, arch):
    tok, lm, _ = models(arch)
    examples = pair_examples(tok)
    ds = detect(EdgeAttribution(method="eap_ig", ig_steps=2), StepContext(model=lm, examples=examples, results={},
                                                                           seed=0))
    geo = lm.geometry
    d_model = lm.model.config.hidden_size
    item = next(lm.model.parameters()).element_size()
    kept = bench.kept_bytes_per_token(geo.n_layers, geo.n_heads, geo.n_kv_heads, geo.head_dim, d_model, item)
    assert kept == {"activation": ds.attrs["activation_bytes_per_token"],
                    "gradient": ds.attrs["gradient_bytes_per_token"]}
    assert bench.dense_bytes_per_token(geo.n_layers, geo.n_heads, d_model, item) == ds.attrs["dense_bytes_per_token"]
    runs = record(lm, examples, [e.meta["answer_id"] for e in examples], [e.meta["wrong_id"] for e in examples],
                  "logit_diff")
    n, T = runs.pairs.n, runs.pairs.ids.shape[1]
    held = sum(t[:n].nelement() * t.element_size() for t in (runs.pairs.z, runs.mlp, runs.emb))
    assert kept["activation"] * n * T == held
    if arch == "llama":  # grouped-query attention: the key/value gradients are per key/value head
        assert geo.n_kv_heads < geo.n_heads


def test_eap_lines_report_the_measured_bytes_per_added_token(bench):
    shape = bench.eap_memory(2, 16, 16, 32, 512, 4)
    assert shape["dense"] == 35 * 512 * 4
    r = {"activation_bytes_per_token": 10 * 1024, "gradient_bytes_per_token": 22 * 1024, "peak_bytes": 584 * MiB}
    text = bench._eap_lines(r, shape, {"peak_bytes": 364 * MiB}, 128, 256)
    assert "7.00x headlab's activations" in text and "2.19x with its gradients" in text
    assert "1,760.0 KiB per added token" in text and "25.14x the dense layout's tensor" in text
    assert "18.3x one layer's" in text
    assert "peak growth" not in bench._eap_lines(r, shape, None, 128, 256)
    assert "- (timeout 5s)" in bench._eap_lines(r, shape, {"error": "timeout 5s"}, 128, 256)
