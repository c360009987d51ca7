"""The ``kv`` option of generate and score steps through the runner and the CLI: what a step with a KV policy
stores (``kv_bytes(layer)``, ``kv_full(layer, kv_head)``, the attrs ``kv_bytes_full`` and
``kv_kept_fraction``), a window that covers the context (then ``full``, said in the attrs, outputs
unchanged), ``headlab show``'s kept fraction, and the located errors."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

import headlab
from headlab import component
from headlab.geometry import Geometry
from headlab.kv import KvPolicyError

from fixtures import cli
from fixtures.specs import TINY_LLAMA, spec_text

ROOT = Path(__file__).parent.parent
CHECKPOINT = ROOT / "headlab" / "plugins" / "models" / "tiny" / "headlab-tiny" / "model.safetensors"
TASK = "{kind: repeated_tokens, n: 3, length: 8}"
DETECT = "  - id: ind\n    detect: {kind: induction}\n"
HEAD_DIM, ITEM, N_KV = 16, 4, 2  # TINY_LLAMA: hidden 64 over 4 heads, float32, 2 KV heads


def _gen(kv: str = "") -> str:
    step = "  - id: gen\n    generate:\n      max_new_tokens: 4\n" + (f"      kv: {kv}\n" if kv else "")
    return DETECT + step


def test_a_generate_step_with_a_kv_policy_stores_what_its_caches_held(tmp_path):
    kv = "{kind: streaming, full_heads: {from: ind, top: 1}, sink: 1, window: 3}"
    spec = spec_text(_gen(kv), task=TASK)
    (tmp_path / "s.yaml").write_text(spec)
    res = cli.run("run", str(tmp_path / "s.yaml"), "--out", str(tmp_path / "runs"), cwd=ROOT)
    assert res.returncode == 0, res.stderr
    (run_dir,) = (tmp_path / "runs").iterdir()
    ds = headlab.open_run(run_dir).results["gen"]
    assert ds["kv_full"].dims == ("layer", "kv_head") and ds["kv_full"].dtype == bool
    assert int(ds["kv_full"].sum()) == 1 and ds["kv_full"].attrs["window"] == 3
    assert ds["kv_bytes"].dims == ("layer",)
    full_bytes = int(ds.attrs["kv_bytes_full"])
    rows = ds.sizes["example"]
    per_layer_full = full_bytes // TINY_LLAMA["num_hidden_layers"]
    seen = per_layer_full // (2 * rows * N_KV * HEAD_DIM * ITEM)  # positions every row's cache went through
    assert per_layer_full == 2 * rows * N_KV * seen * HEAD_DIM * ITEM
    for layer in range(TINY_LLAMA["num_hidden_layers"]):
        n_full = int(ds["kv_full"].sel(layer=layer).sum())
        expected = 2 * rows * (n_full * seen + (N_KV - n_full) * (1 + 3)) * HEAD_DIM * ITEM  # equal rows, no pad
        assert int(ds["kv_bytes"].sel(layer=layer)) == expected
    kept = int(ds["kv_bytes"].sum()) / full_bytes
    assert ds.attrs["kv_kept_fraction"] == pytest.approx(kept) and kept < 1
    assert float(ds["kv_kept_fraction"]) == pytest.approx(kept)
    assert ds.attrs["kv_policy"] == "streaming" and "compressed group" in ds.attrs["kv_attention"]
    assert "kv_effective" not in ds.attrs
    res = cli.run("show", str(run_dir), "--steps", cwd=ROOT)
    assert res.returncode == 0, res.stderr
    assert f"gen: kv streaming kept fraction {kept:.4f}" in res.stdout


def test_a_window_covering_the_context_is_full_and_changes_nothing(tmp_path):
    kv = "{kind: streaming, full_heads: {from: ind, top: 1}, sink: 4, window: 200}"
    with_kv = headlab.run(spec_text(_gen(kv), task=TASK), out=tmp_path / "a").results["gen"]
    plain = headlab.run(spec_text(_gen(), task=TASK), out=tmp_path / "b").results["gen"]
    assert with_kv.attrs["kv_effective"] == "full" and "no token is dropped" in with_kv.attrs["kv_note"]
    assert bool(with_kv["kv_full"].all()) and with_kv["kv_full"].attrs["requested_full_kv_heads"] == 1
    assert np.array_equal(with_kv["output_ids"].values, plain["output_ids"].values)
    assert with_kv.attrs["kv_kept_fraction"] == 1.0
    assert int(with_kv["kv_bytes"].sum()) == with_kv.attrs["kv_bytes_full"] > 0
    assert "kv_bytes" not in plain and "kv_kept_fraction" not in plain.attrs  # no kv given: nothing measured


@pytest.mark.skipif(not CHECKPOINT.is_file(), reason="the embedded model headlab-tiny is not built")
def test_a_score_step_with_a_kv_policy(tmp_path):
    def run(score: str, out: str):
        spec = {"name": "kv", "model": "headlab-tiny", "task": {"kind": "kv_swap", "n": 2},
                "steps": [{"id": "s", "score": score}]}
        return headlab.run(spec, out=tmp_path / out).results["s"]

    ds = run({"kv": {"kind": "streaming", "sink": 1, "window": 2}}, "a")
    plain = run({}, "b")
    assert 0 < ds.attrs["kv_kept_fraction"] < 1 and not bool(ds["kv_full"].any())
    assert not np.allclose(ds["logprob"].values, plain["logprob"].values)  # the policy changed the scores
    full = run({"kv": {"kind": "full"}}, "c")  # measured, with the model's own cache: the same scores
    np.testing.assert_array_equal(full["logprob"].values, plain["logprob"].values)
    assert full.attrs["kv_kept_fraction"] == 1.0 and full.attrs["kv_bytes_full"] > 0


def test_heads_from_a_step_without_a_result_is_one_located_error():
    comp = component("kv", "streaming")
    config = comp.config.model_validate({"kind": "streaming", "full_heads": {"from": "ret", "top": 2}, "window": 8})
    ctx = SimpleNamespace(model=SimpleNamespace(geometry=Geometry(2, 4, 2, 16)), results={}, seed=0)
    from headlab.plugins.actions.common import compile_kv

    with pytest.raises(KvPolicyError, match="heads from step 'ret': the step has no result in this cell"):
        compile_kv(config, ctx, 100)
